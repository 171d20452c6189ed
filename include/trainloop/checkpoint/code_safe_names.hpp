#pragma once
/// @file
/// @brief The names a checkpoint file writes into TorchScript code, checked before it is written.
///
/// A checkpoint is libtorch's archive (checkpoint_file.hpp), so that `torch::load(model, path)`
/// reads its weights without trainloop. That format writes every module, parameter and buffer
/// name, and every archive key, into the TorchScript code of the archive, as an identifier or a
/// double-quoted string: a name holding a double quote, a backslash or a newline gave a file no
/// resume could read, found only at that resume (issue 50; measured with libtorch 2.15: `a b(`,
/// `x-y`, `q'x`, a tab and `((((` read back; `q"x`, `b\n` and a newline do not). Keeping
/// `torch::load` means keeping names in code, so what may be written there is checked here, before
/// anything is: such a name is a CheckpointError and the earlier checkpoint stays. Names from a
/// stranger's .pt2 are narrower still (letters, digits, `_`, `-`, `.`: export_graph.hpp), and
/// code read back is bounded before libtorch parses it (serialization/nesting_depth.hpp).

#include <trainloop/error.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace trainloop::detail {

/// The first character of `name` that TorchScript code cannot carry in a string literal (a double
/// quote, a backslash, a control byte), or `name.end()`.
inline std::string::const_iterator first_character_code_cannot_carry(const std::string& name) {
  return std::find_if(name.begin(), name.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return c == '"' || c == '\\' || byte < 0x20 || byte == 0x7f;
  });
}

/// @brief Refuses a checkpoint of `model` at `path` whose names (the model's modules, parameters and
/// buffers, and `keys`: the callbacks' state keys) libtorch would write into code it cannot read back.
/// @throws trainloop::CheckpointError naming the name, its character, the file and what is expected.
inline void check_names_fit_checkpoint_code(const torch::nn::Module& model, const std::vector<std::string>& keys,
                                            const std::filesystem::path& path) {
  auto check = [&](const std::string& what, const std::string& name) {
    const auto bad = first_character_code_cannot_carry(name);
    if (bad == name.end()) return;
    throw CheckpointError(concat("trainloop: cannot write the checkpoint ", path.string(), ": ", what, " ",
                                 serialization::quote_untrusted(name), " holds ",
                                 serialization::quote_untrusted(std::string(1, *bad)),
                                 ", which libtorch's checkpoint format writes into TorchScript code that no resume could "
                                 "read back; expected names without double quotes, backslashes or control characters "
                                 "(the previous checkpoint is unchanged)"));
  };
  for (const auto& item : model.named_modules("", /*include_self=*/false)) check("the model's module", item.key());
  for (const auto& item : model.named_parameters(/*recurse=*/true)) check("the model's parameter", item.key());
  for (const auto& item : model.named_buffers(/*recurse=*/true)) check("the model's buffer", item.key());
  for (const auto& key : keys) check("the callback state key", key);
}

}  // namespace trainloop::detail
