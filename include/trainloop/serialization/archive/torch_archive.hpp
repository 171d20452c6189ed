#pragma once
/// @file
/// @brief A torch archive (the zip file that torch.save, torch.jit.save and torch::save write)
/// opened for reading without trusting it: its directory checked before any record is read
/// (zip_directory.hpp), its pickles read by the safe unpickler (pickle_reader.hpp), and, for a
/// TorchScript archive, a check that loading it with libtorch runs none of its code.
///
/// What is safe on a file from a stranger:
/// - read_pickle() / module_tensors(): no code runs, ever; memory is bounded by the file's size
///   and PickleLimits; every failure is a CheckpointError naming the file.
/// - check_runs_no_code(): after it passes, `torch::jit::load` of the same file compiles only
///   class declarations without methods (no `def` in any of its code), so it runs nothing of the
///   file. trainloop's checkpoints are such archives; a scripted model is not (it has forward).

#include <trainloop/error.hpp>
#include <trainloop/serialization/bool_bytes.hpp>
#include <trainloop/serialization/nesting_depth.hpp>
#include <trainloop/serialization/pickle/pickle_reader.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/archive/whole_word.hpp>
#include <trainloop/serialization/archive/zip_directory.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// The first line of a libtorch error (its backtrace and C++ frames follow in 1.13), escaped and
/// cut to a few hundred bytes: libtorch's messages can quote the file.
inline std::string first_line(const std::exception& error) {
  const std::string_view text = error.what();
  return escape_untrusted(text.substr(0, text.find('\n')), 2 * kQuotedBytes);
}

/// @brief An open torch archive; see the file comment.
class TorchArchive {
 public:
  /// @brief Opens `path`.
  /// @param path the file
  /// @param expected what the caller reads, for messages ("expected a file written by ...")
  /// @param label what the file is, before its path in messages ("state_dict file ", "checkpoint ")
  /// @throws trainloop::CheckpointError naming the path for a missing file, a legacy (pre-1.6)
  ///         torch.save file, anything else that is not a zip archive, one libtorch cannot read
  ///         (its error nested), or a directory that fails read_zip_directory()'s checks.
  TorchArchive(std::filesystem::path path, std::string expected, std::string label = "")
      : path_(std::move(path)), expected_(std::move(expected)), label_(std::move(label)) {
    using trainloop::detail::concat;
    std::error_code error;
    if (!std::filesystem::is_regular_file(path_, error)) {
      throw CheckpointError(concat("trainloop: ", label_, path_.string(),
                                   std::filesystem::exists(path_, error) ? " is not a regular file; " : " does not exist; ",
                                   expected_));
    }
    // The first bytes tell a zip archive from the formats people most often have instead.
    char magic[8] = {};
    std::ifstream(path_, std::ios::binary).read(magic, sizeof magic);
    if (std::string_view(magic, 4) != std::string_view("PK\x03\x04", 4)) {
      const bool legacy = static_cast<unsigned char>(magic[0]) == 0x80;  // a bare pickle
      throw CheckpointError(concat(
          "trainloop: ", label_, path_.string(),
          legacy ? " is a legacy torch.save file (a bare pickle: PyTorch < 1.6, or _use_new_zipfile_serialization=False); "
                 : " is not a zip archive, so not a torch archive; ",
          expected_, legacy ? "; re-save it in Python with torch.save(torch.load(path), path)" : ""));
    }
    // libtorch 2.x's torch::jit::load takes a file with "PTMF" at byte 4 for a flatbuffer
    // (mobile) module, whatever its first bytes: no zip that torch writes has it.
    if (std::string_view(magic + 4, 4) == "PTMF") {
      throw CheckpointError(concat("trainloop: ", label_, path_.string(), " is a zip archive marked as a flatbuffer module ",
                                   "(PTMF at byte 4); ", expected_));
    }
    // The directory first: libtorch's reader allocates what a record declares (its constructor
    // reads `version`), so nothing of it runs before every declared size is checked.
    const auto records = read_zip_directory(path_);  // every record under one top folder
    for (const auto& record : records) sizes_[record.name.substr(record.name.find('/') + 1)] = record.size;
    check_format_version(records);
    try {
      reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path_.string());
    } catch (const std::exception& libtorch_error) {
      std::throw_with_nested(CheckpointError(concat("trainloop: ", label_, path_.string(), " is a zip archive that libtorch ",
                                                    "cannot read as a torch archive (", first_line(libtorch_error), "); ",
                                                    expected_)));
    }
  }

  /// The file.
  const std::filesystem::path& path() const { return path_; }
  /// True when the archive has record `name` (without the archive's top folder).
  bool has(const std::string& name) const { return sizes_.count(name) != 0; }
  /// True for a TorchScript archive (torch.jit.save, torch::save, a trainloop checkpoint): it has
  /// the constants table of compiled code, which torch.save's files do not (or no data.pkl at all).
  bool is_torchscript() const { return has("constants.pkl") || !has("data.pkl"); }

  /// @brief The bytes of record `name`, at most `max_bytes` of them.
  /// @throws trainloop::CheckpointError when it is missing or larger.
  std::string read(const std::string& name, size_t max_bytes) {
    const auto found = sizes_.find(name);
    if (found == sizes_.end()) throw error(concat_("lacks the record ", quote_untrusted(name), "; expected a complete file"));
    if (found->second > max_bytes) {
      throw error(concat_("has a record ", quote_untrusted(name), " of ", found->second, " bytes; expected at most ", max_bytes));
    }
    return guarded([&] {
      auto [data, size] = reader_->getRecord(name);
      check_read_size(name, size, found->second);
      return std::string(static_cast<const char*>(data.get()), size);
    });
  }

  /// @brief Reads the pickle `name` ("data.pkl") with the safe unpickler.
  /// @param name the record
  /// @param flavor which globals it may name
  /// @param limits the bounds it is held to
  /// @param load_data true: storages are read into CPU tensors; false: only their sizes are checked
  ///        against the records and the tensors are meta tensors (a check that reads no weights)
  /// @throws trainloop::CheckpointError naming the file, the record and, for a pickle that is
  ///         not one trainloop reads, the byte offset and the reason.
  PickleDocument read_pickle(const std::string& name, PickleFlavor flavor, bool load_data = true,
                             PickleLimits limits = {}) {
    check_byte_order();
    const std::string bytes = read(name, limits.max_pickle_bytes);
    // A pickle's storages are in the folder named as it is ("data.pkl": data/, a TorchScript
    // archive's "constants.pkl": constants/), or in .data/ when libtorch shared them.
    const std::string folder = name.substr(0, name.rfind('.')) + "/";
    auto load_storage = [&](const std::string& key, torch::ScalarType dtype, int64_t numel) {
      std::string record = folder + key;
      if (!sizes_.count(record) && sizes_.count(".data/" + key)) record = ".data/" + key;
      const auto found = sizes_.find(record);
      if (found == sizes_.end()) throw error(concat_("lacks the storage ", quote_untrusted(record), "; expected a complete file"));
      const int64_t nbytes = checked_mul(numel, static_cast<int64_t>(c10::elementSize(dtype)), "a storage's byte size");
      if (static_cast<uint64_t>(nbytes) != found->second) {
        throw error(concat_("has ", found->second, " bytes in storage ", quote_untrusted(record), " of ", numel, " ", dtype,
                            " elements; expected ", nbytes, " (a complete file)"));
      }
      const auto options = torch::TensorOptions().dtype(dtype);
      if (!load_data) return torch::empty({numel}, options.device(torch::kMeta));
      if (numel == 0) return torch::empty({0}, options);
      return guarded([&] {
        auto [data, size] = reader_->getRecord(record);
        check_read_size(record, size, static_cast<uint64_t>(nbytes));
        if (dtype == torch::kBool) {
          const auto bad = first_invalid_bool_byte(data.get(), static_cast<std::size_t>(nbytes));
          if (bad != static_cast<std::size_t>(nbytes)) {
            throw error(concat_("has BOOL storage ", quote_untrusted(record), " holding byte ",
                                int(static_cast<const unsigned char*>(data.get())[bad]), " at element ", bad, "; expected 0 or 1"));
          }
        }
        c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                             /*resizable=*/false);
        return torch::empty({0}, options).set_(std::move(storage));
      });
    };
    try {
      return guarded([&] { return Unpickler(bytes, flavor, load_storage, limits).run(); });
    } catch (const PickleError& pickle_error) {
      throw error(concat_("has a ", quote_untrusted(name), " that is not a pickle of weights (", pickle_error.what(), "); ", expected_));
    }
  }

  /// @brief Checks that `torch::jit::load` of this archive runs none of its code: no class in
  /// its code defines a method (no `def`), its code nests within kMaxCodeNesting, and
  /// check_pickles() passes. Each code record is read once, and scanned in linear time.
  /// @throws trainloop::CheckpointError naming the file and the record that fails.
  void check_runs_no_code() {
    for_each_code_record([&](const std::string& name, const std::string& source) {
      check_code_nesting_of(name, source);
      if (contains_whole_word(source, "def")) {
        throw error(concat_("is a TorchScript archive whose code defines methods (", quote_untrusted(name), "), which loading it ",
                            "would compile and may run; ", expected_, " (a scripted model: interop::ScriptModule ",
                            "loads one, as torch.jit.load does)"));
      }
    });
    check_pickles();
  }

  /// @brief How deep the brackets of an archive's TorchScript code may nest. libtorch's parser
  /// recurses a few frames per level and has no limit of its own (issue 50: 200,000 levels were a
  /// stack overflow in every resume); Python's own parser stops at 200 levels, and the code libtorch
  /// writes for real models (type annotations of nested tuples, a module's attribute list) nests
  /// fewer than 10.
  static constexpr int kMaxCodeNesting = 100;

  /// @brief Checks that the archive's TorchScript code (code/ *.py, which `torch::jit::load`
  /// parses) nests brackets at most kMaxCodeNesting deep, in time linear in its size.
  /// @throws trainloop::CheckpointError naming the file and the record that fails.
  void check_code_nesting() {
    for_each_code_record([&](const std::string& name, const std::string& source) { check_code_nesting_of(name, source); });
  }

  /// @brief Checks that every pickle `torch::jit::load` reads of the archive (data.pkl,
  /// constants.pkl, the code's debug tables) reads under the safe unpickler's allow-list and
  /// limits, without reading weights: libtorch's own unpickler, which bounds neither nesting nor
  /// memory, reads them after this. (A traced model's traced_inputs.pkl, whose storages 2.11
  /// writes empty, is read by libtorch only when asked to restore shapes, which trainloop never does.)
  /// @throws trainloop::CheckpointError naming the file and the record that fails.
  void check_pickles() {
    for (const auto& [name, size] : sizes_) {
      const bool read_by_load = name == "data.pkl" || name == "constants.pkl" ||
                                (name.rfind("code/", 0) == 0 && ends_with(name, ".debug_pkl"));
      if (read_by_load) read_pickle(name, PickleFlavor::TorchScript, /*load_data=*/false);
    }
  }

 private:
  /// Calls `visit(name, source)` for each record of the archive's TorchScript code (code/ *.py).
  template <class Visit>
  void for_each_code_record(Visit&& visit) {
    for (const auto& [name, size] : sizes_) {
      if (name.rfind("code/", 0) != 0 || !ends_with(name, ".py")) continue;
      visit(name, read(name, PickleLimits{}.max_pickle_bytes));
    }
  }

  /// Throws when code record `name` nests brackets beyond kMaxCodeNesting.
  void check_code_nesting_of(const std::string& name, const std::string& source) {
    if (const int depth = nesting_depth_beyond(source, kMaxCodeNesting, "\"'")) {
      throw error(concat_("has TorchScript code (", quote_untrusted(name), ") nesting brackets ", depth,
                          " levels deep; expected at most ", kMaxCodeNesting, " (libtorch's parser would recurse that deep)"));
    }
  }

  static bool ends_with(const std::string& text, std::string_view end) {
    return text.size() >= end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
  }
  template <class... Parts>
  static std::string concat_(Parts&&... parts) {
    return trainloop::detail::concat(std::forward<Parts>(parts)...);
  }
  CheckpointError error(const std::string& what) const {
    return CheckpointError(concat_("trainloop: ", label_, path_.string(), " ", what));
  }
  /// Runs `read` with libtorch's and the allocator's errors turned into a CheckpointError naming
  /// the file (the original nested), so none reaches the caller as itself.
  template <class Read>
  auto guarded(Read&& read) -> decltype(read()) {
    try {
      return read();
    } catch (const c10::Error& libtorch_error) {
      std::throw_with_nested(error(concat_("cannot be read (libtorch: ", first_line(libtorch_error), "); expected a complete file")));
    } catch (const std::bad_alloc&) {
      std::throw_with_nested(error("needs more memory than this machine gives; expected a file of weights"));
    }
  }
  /// What libtorch read must be the record whose size was checked: never trust that the two
  /// lookups (read_zip_directory's and libtorch's) found the same record, check the bytes.
  void check_read_size(const std::string& name, size_t read, uint64_t expected) const {
    if (read != expected) {
      throw error(concat_("gave ", read, " bytes for the record ", quote_untrusted(name), " whose directory entry says ", expected,
                          "; expected one record per name"));
    }
  }
  /// The archive's format version, read and checked as libtorch's reader does in its
  /// constructor (a decimal number in `.data/version` or `version`, within the range this
  /// libtorch reads): a file that would fail there is refused here with its reason, before the
  /// reader is made (libtorch's reader leaks its zip state when its constructor throws).
  void check_format_version(const std::vector<ZipRecord>& records) const {
    bool any = false;
    for (const auto& record : records) {
      const std::string name = record.name.substr(record.name.find('/') + 1);
      if (name != "version" && name != ".data/version") continue;  // libtorch 2.x prefers the second
      any = true;
      const std::string text = read_stored_record(path_, record, 32);
      const size_t end = text.find_last_not_of(" \t\r\n");
      const std::string digits = end == std::string::npos ? "" : text.substr(0, end + 1);
      const bool number = !digits.empty() && digits.size() <= 18 && digits.find_first_not_of("0123456789") == std::string::npos;
      const uint64_t version = number ? std::stoull(digits) : 0;
      if (!number || version < caffe2::serialize::kMinSupportedFileFormatVersion ||
          version > caffe2::serialize::kMaxSupportedFileFormatVersion) {
        throw error(concat_("has the format version ", quote_untrusted(text), " in ", quote_untrusted(name),
                            "; expected a number from ", caffe2::serialize::kMinSupportedFileFormatVersion, " to ",
                            caffe2::serialize::kMaxSupportedFileFormatVersion, " (this libtorch's range)"));
      }
    }
    if (!any) throw error(concat_("has no version record; ", expected_));
  }
  void check_byte_order() {
    if (!has("byteorder")) return;  // written since PyTorch 2.1: the storages' byte order
    if (read("byteorder", 16) != "little") {
      throw error("was written on a big-endian machine; expected one written on a little-endian machine");
    }
  }

  std::filesystem::path path_;
  std::string expected_;
  std::string label_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  std::unordered_map<std::string, uint64_t> sizes_;  // record (without the top folder) -> bytes
};

/// @brief The tensors of a TorchScript archive's module tree (its data.pkl, read by
/// TorchArchive::read_pickle with PickleFlavor::TorchScript): every tensor attribute by its
/// dotted name ("layer1.0.weight"), submodules depth first, in the file's order. Attributes that
/// are neither tensors nor objects are skipped; so is `skip` at the top.
/// @throws PickleError when the root is not an object, or modules nest deeper than `max_depth`
///         or in a cycle.
inline std::vector<std::pair<std::string, torch::Tensor>> module_tensors(const PickleDocument& document,
                                                                         const std::string& skip = "",
                                                                         size_t max_depth = 256) {
  using Kind = PickleValue::Kind;
  if (document.root.kind != Kind::Object) pickle_fail("the archive holds ", a_kind(document.root.kind), "; expected a module");
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<uint32_t> seen;
  // Explicit stack, no recursion: (object, its name prefix, depth), children pushed in reverse.
  struct Pending {
    PickleValue object;
    std::string prefix;
    size_t depth;
  };
  std::vector<Pending> pending{{document.root, "", 0}};
  while (!pending.empty()) {
    Pending next = std::move(pending.back());
    pending.pop_back();
    if (next.depth > max_depth) pickle_fail("modules nest more than ", max_depth, " deep");
    if (!seen.insert(next.object.index).second) pickle_fail("a module contains itself");
    const auto& state = document.items(next.object)[1];
    if (state.kind != Kind::Dict) continue;  // an object without attributes
    const auto& items = document.items(state);
    std::vector<Pending> children;
    for (size_t i = 0; i + 1 < items.size(); i += 2) {
      if (items[i].kind != Kind::String) pickle_fail("an attribute named by ", a_kind(items[i].kind), "; expected a str");
      const std::string& name = document.text(items[i]);
      if (next.depth == 0 && name == skip) continue;
      if (items[i + 1].kind == Kind::Tensor) {
        out.emplace_back(next.prefix + name, document.tensor(items[i + 1]));
      } else if (items[i + 1].kind == Kind::Object) {
        children.push_back({items[i + 1], next.prefix + name + ".", next.depth + 1});
      }
    }
    // Python's state_dict order: a module's own tensors, then each child's, depth first.
    for (auto child = children.rbegin(); child != children.rend(); ++child) pending.push_back(std::move(*child));
  }
  return out;
}

}  // namespace trainloop::serialization
