#pragma once
/// @file
/// @brief The one place that knows which libtorch version we are built against.
///
/// Debian ships libtorch 1.13 (CPU, Gloo); GPU machines use the libtorch inside pip torch 2.x
/// (CUDA, NCCL). Every difference between the two is guarded here, by TORCH_VERSION_MAJOR/MINOR
/// only (Debian's version.h says 1.13.0 for 1.13.1), so the rest of the code never branches on it.

#include <torch/version.h>

/// True when built against libtorch 2.0 or newer.
#define TRAINLOOP_TORCH_2 (TORCH_VERSION_MAJOR >= 2)
