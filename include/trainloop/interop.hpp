#pragma once
/// @file
/// @brief Weights to and from Python: read what `torch.save(model.state_dict(), path)` wrote,
/// load it into a model by name, and write a state_dict that Python's `torch.load` reads; train
/// TorchScript models (`torch.jit.script(model).save(path)`) and save them back; read and write
/// safetensors (one file or Hugging Face's sharded form).

#include <trainloop/interop/load_state_dict.hpp>
#include <trainloop/interop/python_state_dict.hpp>
#include <trainloop/interop/exported_program.hpp>
#include <trainloop/interop/script_module.hpp>
#include <trainloop/interop/dcp_weights.hpp>
#include <trainloop/interop/safetensors_weights.hpp>
#include <trainloop/interop/state_dict.hpp>
