#pragma once
/// @file
/// @brief One tensor item of a DCP data file (`__<rank>_0.distcp`): the torch.save blob that
/// torch 2.11's FileSystemWriter writes per chunk (`torch.save(tensor, stream)` at the item's
/// offset; its zip offsets relative to the item's first byte), read without trusting it.
///
/// The item's zip directory is checked inside the item's byte range (read_zip_directory's
/// checks: every record inside, stored, one record per name), its data.pkl read by the safe
/// unpickler (a tensor: _rebuild_tensor_v2 of one CPU storage; nothing else named), the storage
/// record's size proved equal to numel * itemsize and the view (storage offset, size, strides,
/// which Python's items may have: a transposed tensor is saved as it is) proved inside it
/// (tensor_rebuild.hpp) before a byte of data is read. The bytes are then pread from the file:
/// all of them (read()) or one flat range of a row-major item (read_flat()).

#include <trainloop/error.hpp>
#include <trainloop/serialization/bool_bytes.hpp>
#include <trainloop/serialization/pickle/pickle_reader.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/archive/zip_directory.hpp>

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization::dcp {

/// @brief A file opened for pread; closed with it.
class ReadOnlyFile {
 public:
  /// @throws trainloop::CheckpointError naming the file when it cannot be opened.
  explicit ReadOnlyFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      throw CheckpointError(trainloop::detail::concat("trainloop: cannot open the DCP data file ", untrusted_file_path(path_), " (",
                                                      std::strerror(errno), "); expected a readable file"));
    }
  }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile() { ::close(fd_); }

  /// The file.
  const std::filesystem::path& path() const { return path_; }

  /// Reads exactly `count` bytes at `offset` into `out`.
  /// @throws trainloop::CheckpointError naming the file when fewer are there (a file cut short since it was checked).
  void read(uint64_t offset, void* out, uint64_t count) const {
    auto* at = static_cast<char*>(out);
    while (count > 0) {
      const ssize_t got = ::pread(fd_, at, count, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        throw CheckpointError(trainloop::detail::concat("trainloop: the DCP data file ", untrusted_file_path(path_), " ends before byte ",
                                                        offset + count, " (", got < 0 ? std::strerror(errno) : "end of file",
                                                        "); expected a complete file"));
      }
      at += got;
      offset += static_cast<uint64_t>(got);
      count -= static_cast<uint64_t>(got);
    }
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

/// @brief One tensor item: where its storage's bytes are and the view of them it describes.
class DistcpItem {
 public:
  /// @brief Reads and checks the item at bytes [offset, offset + length) of `file`.
  /// @throws trainloop::CheckpointError naming the file and the item's range: not a torch.save
  ///         archive there, not a tensor, a storage not on the CPU, a view outside its storage.
  DistcpItem(const ReadOnlyFile& file, int64_t offset, int64_t length) : file_(file), offset_(offset), length_(length) {
    using trainloop::detail::concat;
    if (offset < 0 || length < 0) fail(concat("is at a negative offset or length; expected both >= 0"));
    const auto records = read_zip_directory(file.path(), static_cast<uint64_t>(offset), static_cast<uint64_t>(length));
    const std::string top = records.empty() ? "" : records.front().name.substr(0, records.front().name.find('/') + 1);
    std::map<std::string, const ZipRecord*> by_name;  // without the top folder
    for (const auto& record : records) by_name[record.name.substr(top.size())] = &record;
    auto stored = [&](const std::string& name, uint64_t max_bytes) {
      const auto found = by_name.find(name);
      if (found == by_name.end()) fail(concat("lacks the record ", quote_untrusted(name), "; expected a torch.save archive of a tensor"));
      const ZipRecord& record = *found->second;
      if (record.method != 0 || record.size > max_bytes) {
        fail(concat("has the record ", quote_untrusted(name), " of ", record.size, " bytes (zip method ", record.method,
                    "); expected at most ", max_bytes, ", stored"));
      }
      std::string bytes(record.size, '\0');
      file_.read(static_cast<uint64_t>(offset_) + record.data_offset, bytes.data(), record.size);
      return bytes;
    };
    if (by_name.count("byteorder") && stored("byteorder", 16) != "little") {
      fail("was written on a big-endian machine; expected a little-endian item");
    }
    const std::string pickle = stored("data.pkl", PickleLimits{}.max_pickle_bytes);
    // The storage's record and size, proved here; the tensor made over a meta storage of its
    // elements, so that its view is proved inside it without reading a byte of data.
    int storages = 0;
    auto load_storage = [&](const std::string& key, torch::ScalarType dtype, int64_t numel) {
      const auto found = by_name.find("data/" + key);
      if (found == by_name.end()) pickle_fail("the storage ", quote_untrusted(key), " has no record data/", quote_untrusted(key));
      const int64_t nbytes = checked_mul(numel, static_cast<int64_t>(c10::elementSize(dtype)), "a storage's byte size");
      if (found->second->method != 0 || found->second->size != static_cast<uint64_t>(nbytes)) {
        pickle_fail("the storage record ", quote_untrusted(key), " has ", found->second->size, " bytes for ", numel, " ", dtype,
                    " elements; expected ", nbytes, ", stored");
      }
      ++storages;
      data_offset_ = static_cast<uint64_t>(offset_) + found->second->data_offset;
      storage_numel_ = numel;
      return torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
    };
    PickleDocument document;
    try {
      Unpickler unpickler(pickle, PickleFlavor::StateDict, load_storage);
      unpickler.require_storage_location("cpu");
      document = unpickler.run();
    } catch (const PickleError& error) {
      fail(concat("is not a torch.save of one tensor (data.pkl: ", error.what(), "); expected a tensor item as DCP writes it"));
    }
    if (document.root.kind != PickleValue::Kind::Tensor || storages != 1) {
      fail(concat("holds ", a_kind(document.root.kind), " of ", storages, " storages; expected one tensor (a DCP tensor item)"));
    }
    view_ = document.tensor(document.root);
    // Python's writer saves each chunk with a storage of its own elements (it clones views of
    // larger ones), so a view never has more elements than its storage: what read() makes is
    // then bounded by the file, whatever sizes and strides (stride 0) the item claims.
    if (view_.numel() > storage_numel_) {
      fail(concat("is a view of ", view_.numel(), " elements of a storage of ", storage_numel_,
                  "; expected at most the storage's elements (as DCP writes items)"));
    }
  }

  /// The item's dtype.
  c10::ScalarType dtype() const { return view_.scalar_type(); }
  /// The item's size.
  std::vector<int64_t> size() const { return view_.sizes().vec(); }

  /// @brief Checks the item is a tensor of `dtype` and `size` (its chunk's box); `fqn` names it.
  /// @throws trainloop::CheckpointError naming the file, the item and the tensor.
  void check(const std::string& fqn, c10::ScalarType dtype, const std::vector<int64_t>& size) const {
    if (view_.scalar_type() != dtype || view_.sizes().vec() != size) {
      fail(trainloop::detail::concat("holds a ", view_.scalar_type(), " tensor of size ", view_.sizes(), " for ", escape_untrusted(fqn),
                                     "; expected ", dtype, " of size ", c10::IntArrayRef(size), " (the metadata's chunk)"));
    }
  }

  /// @brief The whole item, as its own contiguous CPU tensor.
  torch::Tensor read() const {
    const int64_t numel = view_.numel();
    if (numel == 0) return torch::empty(view_.sizes(), torch::TensorOptions().dtype(view_.scalar_type()));
    // The elements the view reaches: [storage offset, last], proved inside the storage.
    int64_t last = view_.storage_offset();
    for (int64_t d = 0; d < view_.dim(); ++d) last += (view_.size(d) - 1) * view_.stride(d);
    const int64_t span = last + 1 - view_.storage_offset();
    const auto item = static_cast<int64_t>(view_.element_size());
    auto storage = torch::empty({span}, torch::TensorOptions().dtype(view_.scalar_type()));
    file_.read(data_offset_ + static_cast<uint64_t>(view_.storage_offset() * item), storage.data_ptr(), static_cast<uint64_t>(span * item));
    check_bools(storage.data_ptr(), span, view_.storage_offset());
    if (view_.is_contiguous() && span == numel) return storage.view(view_.sizes());
    return storage.as_strided(view_.sizes(), view_.strides(), 0).contiguous();
  }

  /// @brief True when the item's elements lie row-major and contiguous in its storage (every
  /// item trainloop writes, and Python's unless it saved a transposed view), so read_flat() can
  /// read any run of them.
  bool row_major() const { return view_.is_contiguous(); }

  /// @brief Elements [begin, begin + count) of the item in row-major order, read into `out`
  /// (count elements of its dtype). Only for a row_major() item.
  void read_flat(int64_t begin, int64_t count, void* out) const {
    const auto item = static_cast<int64_t>(view_.element_size());
    if (!row_major() || begin < 0 || count < 0 || begin > view_.numel() || count > view_.numel() - begin) {
      fail(trainloop::detail::concat("is read at elements ", begin, "-", begin + count, " of its ", view_.numel(),
                                     "; expected a range inside a row-major item"));
    }
    file_.read(data_offset_ + static_cast<uint64_t>((view_.storage_offset() + begin) * item), out, static_cast<uint64_t>(count * item));
    check_bools(out, count, view_.storage_offset() + begin);
  }

 private:
  /// A BOOL item's `count` bytes at `data`, the storage's elements from `first` on: 0 or 1 each.
  void check_bools(const void* data, int64_t count, int64_t first) const {
    if (view_.scalar_type() != torch::kBool) return;
    const auto bad = first_invalid_bool_byte(data, static_cast<std::size_t>(count));
    if (bad != static_cast<std::size_t>(count)) {
      fail(trainloop::detail::concat("is a BOOL tensor holding byte ", int(static_cast<const unsigned char*>(data)[bad]),
                                     " at storage element ", first + static_cast<int64_t>(bad), "; expected 0 or 1"));
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw CheckpointError(trainloop::detail::concat("trainloop: the DCP data file ", untrusted_file_path(file_.path()), "'s item at bytes ",
                                                    offset_, "-", offset_ + length_, " ", what));
  }

  const ReadOnlyFile& file_;
  int64_t offset_ = 0, length_ = 0;
  torch::Tensor view_;        // a meta tensor: the item's dtype, size, strides and storage offset
  uint64_t data_offset_ = 0;  // the storage's first byte in the file
  int64_t storage_numel_ = 0;
};

}  // namespace trainloop::serialization::dcp
