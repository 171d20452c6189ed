#pragma once
/// @file
/// @brief Stateful: anything whose state travels in checkpoints (every Callback is one). The
/// checkpoint code knows only this interface, so it depends on no concrete callback.

#include <trainloop/detail/type_name.hpp>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief A component whose state a checkpoint saves and restores under a key.
///
/// A checkpoint missing the state of a component that has state (save_state() writes something)
/// is an error naming the key and the keys the checkpoint holds, unless the component declares
/// its state optional: resuming with a callback the checkpoint never knew would otherwise start
/// it from scratch without a word. Components without state (a progress bar) may always be added.
class Stateful {
 public:
  virtual ~Stateful() = default;
  /// @brief Writes this component's state (what it needs to continue exactly after a resume).
  virtual void save_state(torch::serialize::OutputArchive&) const {}
  /// @brief Restores what save_state() wrote.
  virtual void load_state(torch::serialize::InputArchive&) {}
  /// @brief The name the state is stored under: the class name by default. The loop appends
  /// "#2", "#3"... to repeated names, in the order the components were given.
  virtual std::string state_key() const { return detail::demangled(typeid(*this).name()); }
  /// @brief True when a checkpoint without this component's state may be loaded: the component
  /// then keeps the state it has (e.g. a ModelCheckpoint pointed at a new directory to fine-tune).
  virtual bool state_optional() const { return false; }
};

namespace detail {
/// A component with the key its state is stored under.
using KeyedStates = std::vector<std::pair<std::string, Stateful*>>;

/// True when `component.save_state()` writes anything (read back through an archive: the
/// output archive cannot list its keys). Only asked when a checkpoint lacks the component's key.
inline bool has_state(const Stateful& component) {
  torch::serialize::OutputArchive written;
  component.save_state(written);
  std::stringstream bytes;
  written.save_to(bytes);
  torch::serialize::InputArchive read;
  read.load_from(bytes);
  return !read.keys().empty();
}
}  // namespace detail

}  // namespace trainloop
