#pragma once
/// @file
/// @brief The exception classes that travel between a spawned rank and the process that
/// launched it, in one table: a rank's failure reaches the caller as the class the rank threw,
/// and a failed fit() call is replayed in the ranks of a later call as the class the caller caught.
///
/// | class (as named in reports)    | a rank threw it: the caller catches              | replayed in later ranks as |
/// |--------------------------------|--------------------------------------------------|----------------------------|
/// | c10::OutOfMemoryError, c10::IndexError, c10::ValueError, c10::TypeError, c10::NotImplementedError, c10::Error | that class, the RankFailedError nested | that class |
/// | trainloop::CheckpointError     | CheckpointError, the RankFailedError nested      | CheckpointError            |
/// | trainloop::ConfigurationError  | ConfigurationError, the RankFailedError nested   | ConfigurationError         |
/// | trainloop::CommunicationError  | CommunicationError, the RankFailedError nested   | CommunicationError         |
/// | trainloop::StallError, trainloop::DesyncError | that class, the RankFailedError nested | that class |
/// | trainloop::RankFailedError     | RankFailedError (the rank launched ranks itself) | RankFailedError, details kept |
/// | anything else                  | RankFailedError                                  | trainloop::Error           |
///
/// libtorch's classes are rebuilt without a backtrace: the caller's own stack would only mislead,
/// and the rank's is in its kept error file (RankFailedError::Details::full_error_file).

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>

#include <c10/util/Exception.h>

#include <array>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace trainloop::distributed::detail {

/// One class of the table above: how to recognise it, throw it, and throw it around the
/// exception being handled (std::throw_with_nested).
struct RelayedException {
  const char* name;
  bool (*matches)(const std::exception&);
  [[noreturn]] void (*throw_plain)(const std::string& message);
  [[noreturn]] void (*throw_nesting_current)(const std::string& message);
};

/// The class `E` rebuilt from a message (libtorch's classes without a backtrace: `{}` is an
/// empty backtrace in libtorch 1.13 and 2.x alike).
template <class E>
E rebuild_exception(const std::string& message) {
  if constexpr (std::is_base_of_v<c10::Error, E>) {
    return E(message, {}, nullptr);
  } else {
    return E(message);
  }
}

template <class E>
constexpr RelayedException relayed(const char* name) {
  return {name, [](const std::exception& error) { return dynamic_cast<const E*>(&error) != nullptr; },
          [](const std::string& message) { throw rebuild_exception<E>(message); },
          [](const std::string& message) { std::throw_with_nested(rebuild_exception<E>(message)); }};
}

/// Most derived first: the first entry that matches an exception names it. RankFailedError is
/// not in it (its details need more than a message; see the functions below).
inline const std::array<RelayedException, 11>& relayed_exceptions() {
  static const std::array<RelayedException, 11> table{
      relayed<c10::OutOfMemoryError>("c10::OutOfMemoryError"),
      relayed<c10::IndexError>("c10::IndexError"),
      relayed<c10::ValueError>("c10::ValueError"),
      relayed<c10::TypeError>("c10::TypeError"),
      relayed<c10::NotImplementedError>("c10::NotImplementedError"),
      relayed<c10::Error>("c10::Error"),
      relayed<CheckpointError>("trainloop::CheckpointError"),
      relayed<ConfigurationError>("trainloop::ConfigurationError"),
      relayed<CommunicationError>("trainloop::CommunicationError"),
      relayed<StallError>("trainloop::StallError"),
      relayed<DesyncError>("trainloop::DesyncError"),
  };
  return table;
}

inline constexpr const char* kRankFailedName = "trainloop::RankFailedError";
inline constexpr const char* kPlainErrorName = "trainloop::Error";

/// The table's entry named `type`, or null. A libtorch class the table does not list
/// ("c10::DistBackendError" of a newer libtorch) is taken as c10::Error.
inline const RelayedException* find_relayed(const std::string& type) {
  const bool libtorch_class = type.rfind("c10::", 0) == 0;
  const RelayedException* any_libtorch_error = nullptr;
  for (const auto& entry : relayed_exceptions()) {
    if (type == entry.name) return &entry;
    if (std::string_view(entry.name) == "c10::Error") any_libtorch_error = &entry;
  }
  return libtorch_class ? any_libtorch_error : nullptr;
}

/// The class name by which `error` travels (the table's, "trainloop::RankFailedError", or
/// "trainloop::Error" for anything else).
inline std::string relayed_type_name(const std::exception& error) {
  if (dynamic_cast<const RankFailedError*>(&error) != nullptr) return kRankFailedName;
  for (const auto& entry : relayed_exceptions()) {
    if (entry.matches(error)) return entry.name;
  }
  return kPlainErrorName;
}

/// In the launching process, from the catch block of a rank's RankFailedError: throws the class
/// the rank threw (the RankFailedError, with the rank's details, nested inside), or rethrows the
/// RankFailedError itself when the rank's class is not in the table.
[[noreturn]] inline void rethrow_rank_failure(const RankFailedError& failure) {
  // std::throw_with_nested nests the exception being handled: this must run in its catch block.
  if (const RelayedException* entry = find_relayed(failure.details().error_type)) {
    entry->throw_nesting_current(failure.what());
  }
  throw;
}

/// A failed fit() call as the caller caught it: its class, message and (for a RankFailedError)
/// the rank's details, as length-prefixed fields (messages span lines).
inline std::string encode_failure_record(const std::exception& error) {
  std::vector<std::string> fields{relayed_type_name(error), error.what()};
  if (const auto* failed = dynamic_cast<const RankFailedError*>(&error)) {
    const auto& d = failed->details();
    fields.insert(fields.end(), {std::to_string(d.rank), std::to_string(d.exit_code), std::to_string(d.signal),
                                 d.rank_error, d.error_type, d.full_error_file});
  }
  std::string record;
  for (const auto& field : fields) record += std::to_string(field.size()) + "\n" + field + "\n";
  return record;
}

/// Throws what encode_failure_record() described: the same class and message, a
/// RankFailedError with its details. @throws trainloop::Error for an unreadable record.
[[noreturn]] inline void throw_failure_record(const std::string& record, const std::string& where) {
  std::vector<std::string> fields;
  for (size_t at = 0; at < record.size();) {
    const size_t newline = record.find('\n', at);
    if (newline == std::string::npos) break;
    const std::string digits = record.substr(at, newline - at);
    if (digits.empty() || digits.size() > 12 || digits.find_first_not_of("0123456789") != std::string::npos) break;
    const size_t length = std::stoul(digits);
    if (newline + 1 + length > record.size()) break;
    fields.push_back(record.substr(newline + 1, length));
    at = newline + 1 + length + 1;
  }
  if (fields.size() < 2) {
    throw Error("trainloop: the record of a failed fit() call " + where +
                " is unreadable; expected the class and message the launching process wrote");
  }
  const std::string& type = fields[0];
  const std::string& message = fields[1];
  if (type == kRankFailedName) {
    RankFailedError::Details details;
    if (fields.size() >= 8) {
      auto number = [](const std::string& text) {
        try {
          return std::stoi(text);
        } catch (const std::exception&) {
          return -1;
        }
      };
      details.rank = number(fields[2]);
      details.exit_code = number(fields[3]);
      details.signal = number(fields[4]);
      details.rank_error = fields[5];
      details.error_type = fields[6];
      details.full_error_file = fields[7];
    }
    throw RankFailedError(message, details);
  }
  if (const RelayedException* entry = find_relayed(type)) entry->throw_plain(message);
  throw Error(message);
}

/// Writes the record of a failed fit() call (atomically). Best effort: the failure being
/// reported matters more than its record.
inline void write_failure_record(const std::filesystem::path& path, const std::exception& error) noexcept {
  try {
    ::trainloop::detail::write_file_atomically(path, encode_failure_record(error), "the record of a failed fit()");
  } catch (...) {
  }
}

/// Throws what the record at `path` describes (see throw_failure_record()).
[[noreturn]] inline void replay_failure_record(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string record((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  throw_failure_record(record, path.string());
}

}  // namespace trainloop::distributed::detail
