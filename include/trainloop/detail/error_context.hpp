#pragma once
/// @file
/// @brief Adding trainloop's context to errors without changing their type, and describing an
/// exception (its text without libtorch's backtrace, its full text, its type) for reports.
///
/// Why not wrap: users catch libtorch's types to react (`c10::OutOfMemoryError` → retry with a
/// smaller batch). Wrapping the error in a trainloop type would hide it from those handlers, so
/// a `c10::Error` gets the context appended with `add_context()` and is rethrown as itself.

#include <trainloop/error.hpp>

#include <c10/util/Exception.h>

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>

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

/// The readable form of a mangled C++ type name.
inline std::string demangled(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> readable(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(mangled);
}

/// The readable C++ type name of `error` ("c10::OutOfMemoryError", "std::runtime_error").
inline std::string error_type_name(const std::exception& error) { return demangled(typeid(error).name()); }

/// The readable name of type `T` ("torch::data::Example<at::Tensor, at::Tensor>").
template <class T>
std::string readable_type_name() {
  return demangled(typeid(T).name());
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
