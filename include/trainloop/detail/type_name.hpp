#pragma once
/// @file
/// @brief Readable C++ type names (demangled), without libtorch: the one place trainloop
/// demangles, used by error reports, a spawned rank's failure file and Stateful's default key.

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>

namespace trainloop::detail {

/// The readable form of a mangled C++ type name (the mangled one if it cannot be demangled).
inline std::string demangled(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> readable(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(mangled);
}

/// The readable C++ type name of `error`'s dynamic type ("c10::OutOfMemoryError", "std::runtime_error").
inline std::string error_type_name(const std::exception& error) { return demangled(typeid(error).name()); }

/// The readable name of type `T` ("torch::data::Example<at::Tensor, at::Tensor>").
template <class T>
std::string readable_type_name() {
  return demangled(typeid(T).name());
}

}  // namespace trainloop::detail
