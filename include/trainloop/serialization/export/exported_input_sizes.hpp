#pragma once
/// @file
/// @brief The sizes an exported program takes: each dimension of its input fixed or a symbol
/// (torch.export.Dim) in a range. A fixed size that differs, a symbol with two sizes, or a size out
/// of its range is a ConfigurationError naming the dimension and what was exported — for a fixed
/// batch, also the fixes (export with a Dim, or drop_last).

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_graph.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief The input sizes of one program; see the file comment.
class ExportedInputSizes {
 public:
  /// @brief The sizes `graph` was exported with.
  explicit ExportedInputSizes(const ExportGraph& graph) : program_(graph.program), dims_(graph.input_dims), ranges_(graph.ranges) {}

  /// @brief Checks `input` against them.
  /// @throws trainloop::ConfigurationError naming the dimension and what was exported.
  void check(const torch::Tensor& input) const {
    using trainloop::detail::concat;
    auto exported = [&] {
      std::string text = "[";
      for (size_t d = 0; d < dims_.size(); ++d) {
        text += (d ? ", " : "") + (dims_[d].fixed ? std::to_string(*dims_[d].fixed) : dims_[d].symbol.empty() ? quote_untrusted(dims_[d].expression) : escape_untrusted(dims_[d].symbol));
      }
      return text + "]";
    };
    if (static_cast<size_t>(input.dim()) != dims_.size()) {
      throw ConfigurationError(concat("trainloop: the input of ", program_, " has ", input.dim(), " dimensions ",
                                      input.sizes(), "; expected ", dims_.size(), ", as exported: ", exported()));
    }
    std::map<std::string, int64_t> bound;
    for (size_t d = 0; d < dims_.size(); ++d) {
      const int64_t size = input.size(static_cast<int64_t>(d));
      const auto& dim = dims_[d];
      if (dim.fixed && *dim.fixed != size) {
        throw ConfigurationError(concat(
            "trainloop: the input of ", program_, " has size ", size, " in dimension ", d, "; expected ", *dim.fixed,
            ": the program was exported with that size fixed (sizes ", exported(), "). Export it with a dynamic size, "
            "torch.export.export(model, (x,), dynamic_shapes=({", d, ": torch.export.Dim(\"batch\")},))",
            d == 0 ? ", or train with drop_last so that every batch has that size (also in evaluation)" : ""));
      }
      if (dim.symbol.empty() || dim.fixed) continue;
      const auto [previous, fresh] = bound.emplace(dim.symbol, size);
      if (!fresh && previous->second != size) {
        throw ConfigurationError(concat("trainloop: the input of ", program_, " has sizes ", input.sizes(), "; expected ",
                                        "equal sizes wherever the export has the symbol ", escape_untrusted(dim.symbol), ": ", exported()));
      }
      const auto range = ranges_.find(dim.symbol);
      if (range != ranges_.end() && (size < range->second.min || (range->second.max && size > *range->second.max))) {
        throw ConfigurationError(concat("trainloop: the input of ", program_, " has size ", size, " in dimension ", d,
                                        "; expected ", range->second.min, " to ",
                                        range->second.max ? std::to_string(*range->second.max) : std::string("any size"),
                                        " (the range of its torch.export.Dim ", escape_untrusted(dim.symbol), ")"));
      }
    }
  }

 private:
  std::string program_;
  std::vector<ExportDim> dims_;
  std::map<std::string, SymbolRange> ranges_;
};

}  // namespace trainloop::serialization
