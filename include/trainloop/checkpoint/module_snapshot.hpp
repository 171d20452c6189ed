#pragma once
/// @file
/// @brief A model written into a checkpoint archive as `torch::nn::Module::save` writes it, for a
/// checkpoint written behind training (checkpoint/background_gathered_write.hpp): the same keys, in
/// the same order, nested the same way, holding the same values as the foreground's file (tested
/// bit for bit; the files themselves differ only where the History holds wall-clock times).
///
/// What differs is what the archive holds. A parameter changes only at an optimizer step, which
/// waits until the checkpoint's thread has copied it: the archive holds a host buffer standing in
/// for it, filled by that thread (checkpoint/gathered_capture.hpp), or, where none can stand in, a
/// view of it — the step then waits until the archive is streamed. A buffer may change in the next
/// forward (batch normalisation's running statistics, updated in place while that thread still
/// streams): the archive holds a copy taken now, small beside the parameters. Libtorch's Module::save cannot be told either, so this mirrors it
/// (torch/csrc/api/src/nn/module.cpp); a module that overrides save() is written here as the base
/// class would write it — such a model needs `ModelCheckpointOptions::in_background(false)`.

#include <trainloop/checkpoint/gathered_capture.hpp>

#include <torch/torch.h>

namespace trainloop::detail {

/// Writes `module`'s parameters (`capture`'s stand-ins, or views), buffers (copies) and
/// serializable children into `archive` as Module::save would (see the file comment).
inline void save_module_snapshot(const torch::nn::Module& module, torch::serialize::OutputArchive& archive,
                                 GatheredCapture& capture) {
  torch::NoGradGuard no_grad;
  for (const auto& parameter : module.named_parameters(/*recurse=*/false)) {
    // The file records requires_grad: the stand-in or view carries the parameter's.
    const torch::Tensor& value = parameter.value();
    torch::Tensor held = capture.stand_in(value);
    if (held.is_same(value)) held = value.detach().requires_grad_(value.requires_grad());
    archive.write(parameter.key(), held);
  }
  for (const auto& buffer : module.named_buffers(/*recurse=*/false)) {
    const torch::Tensor& value = buffer.value();
    archive.write(buffer.key(), value.defined() ? value.detach().clone() : value, /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    save_module_snapshot(*child.value(), child_archive, capture);
    archive.write(child.key(), child_archive);
  }
}

}  // namespace trainloop::detail
