#pragma once
/// @file
/// @brief Adding trainloop's context to errors without changing their type, and describing an
/// exception (its text without libtorch's backtrace, its full text, its type) for reports.
///
/// Why not wrap: users catch libtorch's types to react (`c10::OutOfMemoryError` → retry with a
/// smaller batch). Wrapping the error in a trainloop type would hide it from those handlers, so
/// a `c10::Error` gets the context appended with `add_context()` and is rethrown as itself.

#include <trainloop/detail/type_name.hpp>
#include <trainloop/error.hpp>

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace trainloop::detail {

/// The message of `error` without libtorch's C++ backtrace; for nested exceptions
/// (std::throw_with_nested) the inner messages follow, separated by ": ".
inline std::string error_text(const std::exception& error) {
  std::string text;
  if (const auto* torch_error = dynamic_cast<const c10::Error*>(&error)) {
    text = torch_error->what_without_backtrace();
  } else {
    text = error.what();
  }
  try {
    std::rethrow_if_nested(error);
  } catch (const std::exception& inner) {
    text += ": " + error_text(inner);
  } catch (...) {
    text += ": an exception that is not a std::exception";
  }
  return text;
}

/// The complete text of `error`: with libtorch's backtrace, nested exceptions included.
inline std::string full_error_text(const std::exception& error) {
  std::string text = error.what();
  try {
    std::rethrow_if_nested(error);
  } catch (const std::exception& inner) {
    text += "\n\ncaused by: " + full_error_text(inner);
  } catch (...) {
  }
  return text;
}

/// Rethrows the exception being handled: a `c10::Error` with `context` added to its message
/// (same object, same type); anything else unchanged. Call from a catch block only.
[[noreturn]] inline void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (c10::Error& error) {
    error.add_context(context);
    throw;
  }
}

/// Runs `body()`; a `c10::Error` escaping it gets `context()` added (see rethrow_with_context).
/// `context` is only evaluated on failure.
template <class Body, class Context>
decltype(auto) with_error_context(Body&& body, Context&& context) {
  try {
    return std::forward<Body>(body)();
  } catch (const c10::Error&) {
    rethrow_with_context(std::forward<Context>(context)());
  }
}

}  // namespace trainloop::detail
