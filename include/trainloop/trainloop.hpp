#pragma once
/// @file
/// @brief The umbrella header: everything a trainloop user needs.

/// Major version: changes break the API.
#define TRAINLOOP_VERSION_MAJOR 0
/// Minor version: additions.
#define TRAINLOOP_VERSION_MINOR 1
/// Patch version: fixes.
#define TRAINLOOP_VERSION_PATCH 0
/// The version as one number: major * 10000 + minor * 100 + patch.
#define TRAINLOOP_VERSION (TRAINLOOP_VERSION_MAJOR * 10000 + TRAINLOOP_VERSION_MINOR * 100 + TRAINLOOP_VERSION_PATCH)

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/csv_logger.hpp>
#include <trainloop/callbacks/progress_bar.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/fashion_mnist.hpp>
#include <trainloop/data/tensor_dataset.hpp>
#include <trainloop/error.hpp>
#include <trainloop/distributed/rank_session.hpp>
#include <trainloop/gpu_mode/data_parallel.hpp>
#include <trainloop/gpu_mode/distributed.hpp>
#include <trainloop/gpu_mode/parse.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/history.hpp>
#include <trainloop/metrics/accuracy.hpp>
#include <trainloop/metrics/metric.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/options.hpp>
#include <trainloop/train_loop.hpp>
