#pragma once
/// @file
/// @brief The central directory of a torch archive (a zip file), read before libtorch reads any
/// record, so that what a record declares cannot make the reader allocate more than the file holds.
///
/// Why by hand: libtorch's reader (caffe2::serialize::PyTorchStreamReader) allocates the size a
/// record declares before reading it, and libtorch 1.13 has no call that tells that size first
/// (2.x's getRecordSize does; 1.13's only offsets). A second zip library (libzip, minizip) would
/// be a new link dependency of every user's build for ~100 lines of the fixed layout below
/// (APPNOTE.TXT 4.3.12, 4.3.14-16, 4.5.3), so it is read here. Only the directory is read:
/// the records themselves are still read by libtorch.
///
/// What torch writes and what is checked: tensor data is stored, never compressed (libtorch's
/// writer deflates only a TorchScript archive's code and debug tables); each record lies inside
/// the file and together they are no larger than the file, so no two records can claim the same
/// bytes to multiply an allocation; deflated records are bounded by deflate's 1032:1 and a total.
///
/// One name, one record: libtorch reads `<top folder>/<name>`, the top folder being the first
/// record's, and finds it with miniz's mz_zip_reader_locate_file, which compares names without
/// regard to ASCII case and, among equal names, returns any one. So every record must be under
/// the first record's top folder, and no two names may be equal ignoring case; otherwise the
/// size checked here could be another record's than the one libtorch reads (a 4-byte record
/// checked, a 20 KiB one read: heap bytes in a tensor). torch's writers write neither.

#include <trainloop/error.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <filesystem>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace trainloop::serialization {

/// @brief One record of a zip archive as its central directory describes it.
struct ZipRecord {
  std::string name;          ///< full name, with the archive's top folder ("archive/data.pkl")
  uint16_t method = 0;       ///< 0: stored; anything else: compressed
  uint64_t size = 0;         ///< bytes once read (uncompressed)
  uint64_t stored_size = 0;  ///< bytes in the file
  uint64_t offset = 0;       ///< of its local header
  uint64_t data_offset = 0;  ///< of its bytes (after the local header, checked against the file)
};

namespace detail {

using trainloop::detail::concat;

inline uint64_t read_le(const char* at, size_t bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes; ++i) value |= uint64_t(static_cast<uint8_t>(at[i])) << (8 * i);
  return value;
}

/// Reads `count` bytes at `offset` of `in` (from `base`, the archive's first byte in the file),
/// or throws an error naming `path`.
inline std::string read_at(std::ifstream& in, uint64_t offset, uint64_t count, uint64_t file_size,
                           const std::filesystem::path& path, uint64_t base = 0) {
  if (offset > file_size || count > file_size - offset) {
    throw CheckpointError(concat("trainloop: ", path.string(), " is truncated or corrupt (its zip directory ",
                                 "points at bytes ", offset, "-", offset + count, " of a ", file_size,
                                 "-byte ", base == 0 ? "file" : "archive inside it", "); expected a complete file"));
  }
  std::string bytes(count, '\0');
  in.seekg(static_cast<std::streamoff>(base + offset));
  in.read(bytes.data(), static_cast<std::streamsize>(count));
  if (!in) throw CheckpointError(concat("trainloop: cannot read ", path.string(), "; expected a readable file"));
  return bytes;
}

}  // namespace detail

/// @brief The records of the zip archive at bytes [begin, begin + length) of `path` (a torch.save
/// blob inside a larger file, as a DCP .distcp item): offsets relative to `begin`, every check
/// of read_zip_directory(path) against the `length` bytes; a range past the file's end is an error.
/// `length` UINT64_MAX with `begin` 0: the whole file.
/// @throws trainloop::CheckpointError naming the file and what is wrong: no directory (not a zip,
///         or truncated), a compressed record, or records that claim more bytes than the archive has.
inline std::vector<ZipRecord> read_zip_directory(const std::filesystem::path& path, uint64_t begin, uint64_t length) {
  using detail::concat;
  using detail::read_le;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(concat("trainloop: cannot open ", path.string(), "; expected a readable file"));
  in.seekg(0, std::ios::end);
  const uint64_t whole_size = static_cast<uint64_t>(in.tellg());
  const bool whole = begin == 0 && length == UINT64_MAX;
  if (!whole && (begin > whole_size || length > whole_size - begin)) {
    throw CheckpointError(concat("trainloop: ", path.string(), " is truncated (an archive at bytes ", begin, "-",
                                 begin + length, " of a ", whole_size, "-byte file); expected a complete file"));
  }
  const uint64_t file_size = whole ? whole_size : length;  // the archive's size
  const std::string where = whole ? "" : concat(" at bytes ", begin, "-", begin + length);
  auto corrupt = [&](const std::string& what) {
    return CheckpointError(concat("trainloop: ", path.string(), " is truncated or corrupt (a zip archive", where, " with ", what,
                                  "); expected a complete torch archive"));
  };
  // The end-of-central-directory record: 22 bytes and a comment of at most 65535, at the end.
  constexpr uint64_t kEndRecord = 22;
  if (file_size < kEndRecord) throw corrupt(concat("only ", file_size, " bytes"));
  const uint64_t tail_size = std::min<uint64_t>(file_size, kEndRecord + 65535);
  const std::string tail = detail::read_at(in, file_size - tail_size, tail_size, file_size, path, begin);
  size_t end_at = std::string::npos;
  for (size_t i = tail.size() - kEndRecord + 1; i-- > 0;) {
    if (read_le(tail.data() + i, 4) == 0x06054b50) {
      end_at = i;
      break;
    }
  }
  if (end_at == std::string::npos) throw corrupt("no end-of-central-directory record");
  const char* end = tail.data() + end_at;
  uint64_t entries = read_le(end + 10, 2);
  uint64_t directory_size = read_le(end + 12, 4);
  uint64_t directory_offset = read_le(end + 16, 4);
  // ZIP64 (files over 4 GiB, or records past 4 GiB): its locator sits right before the record.
  const uint64_t end_position = file_size - tail_size + end_at;
  if (end_position >= 20) {
    const std::string locator = detail::read_at(in, end_position - 20, 20, file_size, path, begin);
    if (read_le(locator.data(), 4) == 0x07064b50) {
      const std::string end64 = detail::read_at(in, read_le(locator.data() + 8, 8), 56, file_size, path, begin);
      if (read_le(end64.data(), 4) != 0x06064b50) throw corrupt("a ZIP64 locator that points at no ZIP64 record");
      entries = read_le(end64.data() + 32, 8);
      directory_size = read_le(end64.data() + 40, 8);
      directory_offset = read_le(end64.data() + 48, 8);
    }
  }
  constexpr uint64_t kEntryHeader = 46;
  if (entries > directory_size / kEntryHeader) {
    throw corrupt(concat(entries, " records declared in a ", directory_size, "-byte directory"));
  }
  const std::string directory = detail::read_at(in, directory_offset, directory_size, file_size, path, begin);
  std::vector<ZipRecord> records;
  records.reserve(entries);
  // One name, one record (see the file comment): the top folder of the first record, and every
  // name once ignoring ASCII case, as libtorch's lookup compares them.
  std::string top_folder;
  std::unordered_map<std::string, std::string> folded_names;  // lower-cased -> as written
  auto check_one_record_per_name = [&](const std::string& name) {
    const auto slash = name.find('/');
    if (slash == std::string::npos || slash == 0) {
      throw corrupt(concat("the record ", quote_untrusted(name), " outside any top folder"));
    }
    if (top_folder.empty()) top_folder = name.substr(0, slash + 1);
    if (name.compare(0, top_folder.size(), top_folder) != 0) {
      throw corrupt(concat("records under two top folders, ", quote_untrusted(top_folder), " and ", quote_untrusted(name.substr(0, slash + 1)),
                           ", which libtorch's reader does not tell apart"));
    }
    std::string folded = name;
    for (char& c : folded) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
    const auto [previous, added] = folded_names.emplace(std::move(folded), name);
    if (!added) {
      throw corrupt(concat("two records named ", quote_untrusted(previous->second), " and ", quote_untrusted(name),
                           ", which libtorch's reader (names compared ignoring case) does not tell apart"));
    }
  };
  // Deflated records (code) once inflated: a TorchScript model's code is a few MiB at most.
  constexpr uint64_t kMaxInflated = uint64_t{256} << 20;
  uint64_t stored_total = 0, inflated_total = 0;
  size_t at = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    if (directory.size() - at < kEntryHeader || read_le(directory.data() + at, 4) != 0x02014b50) {
      throw corrupt(concat("a directory entry (", i, ") that is not a central-directory header"));
    }
    const char* header = directory.data() + at;
    ZipRecord record;
    // General-purpose flags: encrypted (bit 0), patch data (5), strong encryption (6), masked
    // directory (13) — none of which torch writes or libtorch's reader supports.
    const uint64_t flags = read_le(header + 8, 2);
    record.method = static_cast<uint16_t>(read_le(header + 10, 2));
    record.stored_size = read_le(header + 20, 4);
    record.size = read_le(header + 24, 4);
    const size_t name_length = read_le(header + 28, 2);
    const size_t extra_length = read_le(header + 30, 2);
    const size_t comment_length = read_le(header + 32, 2);
    record.offset = read_le(header + 42, 4);
    if (directory.size() - at - kEntryHeader < name_length + extra_length + comment_length) {
      throw corrupt(concat("a directory entry (", i, ") that runs past the directory"));
    }
    record.name.assign(header + kEntryHeader, name_length);
    check_one_record_per_name(record.name);
    if ((flags & 0x2061) != 0) {
      throw corrupt(concat("the record ", quote_untrusted(record.name), " flagged encrypted or patched (flags 0x", std::hex,
                           flags, std::dec, ")"));
    }
    // ZIP64 extra field: the 8-byte values of the fields that hold 0xFFFFFFFF, in this order.
    const char* extra = header + kEntryHeader + name_length;
    for (size_t e = 0; e + 4 <= extra_length;) {
      const uint64_t id = read_le(extra + e, 2), length = read_le(extra + e + 2, 2);
      if (e + 4 + length > extra_length) break;
      if (id == 0x0001) {
        const char* value = extra + e + 4;
        const char* value_end = value + length;
        auto widen = [&](uint64_t& field) {
          if (field != 0xFFFFFFFFu) return;
          if (value_end - value < 8) throw corrupt(concat("the record ", quote_untrusted(record.name), " whose ZIP64 field is cut short"));
          field = read_le(value, 8);
          value += 8;
        };
        widen(record.size);
        widen(record.stored_size);
        widen(record.offset);
      }
      e += 4 + length;
    }
    if (record.offset > file_size || record.stored_size > file_size - record.offset) {
      throw corrupt(concat("the record ", quote_untrusted(record.name), " that declares ", record.stored_size, " bytes at offset ", record.offset,
                           " of a ", file_size, "-byte file"));
    }
    stored_total += record.stored_size;  // each <= file_size, so no overflow before the check below
    if (stored_total > file_size) throw corrupt(concat("records that claim more than the file's ", file_size, " bytes together"));
    if (record.method == 0) {
      if (record.size != record.stored_size) {
        throw corrupt(concat("the stored record ", quote_untrusted(record.name), " that declares ", record.size, " bytes in ", record.stored_size));
      }
    } else {
      // libtorch's writer deflates a TorchScript archive's code and debug tables (code/), never
      // tensor data nor the pickles of data and constants: bounded by deflate's own limit
      // (1032:1) and kMaxInflated in all.
      const bool deflated = record.method == 8;
      const bool code = record.name.compare(top_folder.size(), 5, "code/") == 0;
      inflated_total += record.size;
      if (!deflated || !code || record.size / 1032 > record.stored_size || inflated_total > kMaxInflated) {
        throw CheckpointError(concat("trainloop: ", path.string(), " has the record ", quote_untrusted(record.name), " compressed (zip ",
                                     "method ", record.method, ", ", record.stored_size, " -> ", record.size,
                                     " bytes); expected every record but TorchScript code (code/) stored and at most ",
                                     kMaxInflated, " bytes deflated in all, as torch.save, torch.jit.save and torch::save write"));
      }
    }
    records.push_back(std::move(record));
    at += kEntryHeader + name_length + extra_length + comment_length;
  }
  // Each record's local header, as miniz reads it before the bytes (signature, then the name and
  // extra field that the bytes follow): a record whose local header is not there or does not name
  // it is refused here, not by libtorch's reader mid-construction (which then leaks its state).
  constexpr uint64_t kLocalHeader = 30;
  for (auto& record : records) {
    const std::string local = detail::read_at(in, record.offset, kLocalHeader, file_size, path, begin);
    if (read_le(local.data(), 4) != 0x04034b50) {
      throw corrupt(concat("the record ", quote_untrusted(record.name), " whose local header at byte ", record.offset,
                           " is not a zip local header"));
    }
    const uint64_t name_length = read_le(local.data() + 26, 2), extra_length = read_le(local.data() + 28, 2);
    const std::string name = detail::read_at(in, record.offset + kLocalHeader, name_length, file_size, path, begin);
    record.data_offset = record.offset + kLocalHeader + name_length + extra_length;
    if (name != record.name || record.data_offset > file_size || record.stored_size > file_size - record.data_offset) {
      throw corrupt(concat("the record ", quote_untrusted(record.name), " whose local header names ",
                           quote_untrusted(name), " and puts its ", record.stored_size, " bytes at byte ",
                           record.data_offset, " of ", file_size));
    }
  }
  return records;
}

/// @brief The records of the zip archive `path`, checked as described in the file comment.
/// @throws trainloop::CheckpointError naming the file and what is wrong: no directory (not a zip,
///         or truncated), a compressed record, or records that claim more bytes than the file has.
inline std::vector<ZipRecord> read_zip_directory(const std::filesystem::path& path) {
  return read_zip_directory(path, 0, UINT64_MAX);
}

/// @brief The bytes of a stored (uncompressed) record of size at most `max_bytes`, read here from
/// what read_zip_directory() checked: for the few records trainloop must see before libtorch's
/// reader is made (its `version`).
/// @throws trainloop::CheckpointError naming the file when the record is compressed or larger.
inline std::string read_stored_record(const std::filesystem::path& path, const ZipRecord& record, uint64_t max_bytes) {
  if (record.method != 0 || record.size > max_bytes) {
    throw CheckpointError(detail::concat("trainloop: ", path.string(), " has the record ", quote_untrusted(record.name),
                                         " of ", record.size, " bytes (zip method ", record.method,
                                         "); expected at most ", max_bytes, " bytes, stored"));
  }
  std::ifstream in(path, std::ios::binary);
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  return detail::read_at(in, record.data_offset, record.size, file_size, path);
}

}  // namespace trainloop::serialization
