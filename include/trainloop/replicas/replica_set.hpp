#pragma once
/// @file
/// @brief ReplicaSet: the caller's module (replica 0) plus copies of it on other devices, built
/// once, with the two transfers gpu_mode::DataParallel needs per step: gradients of every replica
/// summed into replica 0, and replica 0's parameters and buffers copied to the others.

#include <trainloop/error.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

namespace trainloop::detail {

/// True when replicas of `Module` are made with `clone(device)` (it derives from torch::nn::Cloneable).
template <class Module>
inline constexpr bool cloneable_module_v = std::is_base_of_v<torch::nn::Cloneable<Module>, Module>;

/// True when `Module` copies itself for a device: `std::shared_ptr<Module> replicate(torch::Device) const`
/// (a model that holds more than its registered tensors, such as interop::ScriptModule).
template <class Module>
concept SelfReplicatingModule = requires(const Module& module, torch::Device device) {
  { module.replicate(device) } -> std::convertible_to<std::shared_ptr<Module>>;
};

/// True when gpu_mode::DataParallel can build replicas of `Module`: by its own replicate(), cloned,
/// or default-constructed and then given the original's parameters and buffers.
template <class Module>
inline constexpr bool replicable_module_v =
    SelfReplicatingModule<Module> || cloneable_module_v<Module> || std::is_default_constructible_v<Module>;

/// Restores torch's default CPU generator on scope exit: building a replica runs the module's
/// initialisers, which must not shift the random numbers the caller's training draws next.
class CpuGeneratorStateGuard {
 public:
  CpuGeneratorStateGuard() : generator_(at::detail::getDefaultCPUGenerator()), state_(generator_.get_state()) {}
  ~CpuGeneratorStateGuard() { generator_.set_state(state_); }
  CpuGeneratorStateGuard(const CpuGeneratorStateGuard&) = delete;
  CpuGeneratorStateGuard& operator=(const CpuGeneratorStateGuard&) = delete;

 private:
  at::Generator generator_;
  torch::Tensor state_;
};

/// Replica 0 (the caller's module, on devices[0]) and one copy per further device.
template <class Module>
class ReplicaSet {
  static_assert(replicable_module_v<Module>,
                "trainloop: gpu_mode::DataParallel needs to copy the model onto every device. Derive the module from "
                "torch::nn::Cloneable<Impl> (and implement reset()), make it default-constructible (its parameters "
                "and buffers are then copied from the original by name), or give it "
                "`std::shared_ptr<Impl> replicate(torch::Device) const`.");

 public:
  /// @brief Builds a replica of `primary` on every device after the first.
  /// @param primary the caller's module, already on devices[0]
  /// @param devices one device per replica; devices[0] is primary's
  ReplicaSet(std::shared_ptr<Module> primary, std::vector<torch::Device> devices) : devices_(std::move(devices)) {
    replicas_.push_back(std::move(primary));
    {
      CpuGeneratorStateGuard keep_random_stream;
      for (size_t r = 1; r < devices_.size(); ++r) replicas_.push_back(make_replica(r));
    }
    for (const auto& replica : replicas_) {
      parameters_.push_back(replica->parameters());
      buffers_.push_back(defined_only(replica->buffers()));
    }
    copied_.assign(parameters_[0].size() + buffers_[0].size(), Fingerprint{});
    copy_to_replicas(/*only_changed=*/false);
  }

  /// Number of replicas, the caller's module included.
  size_t size() const { return replicas_.size(); }
  /// Replica `r` (0 is the caller's module).
  Module& replica(size_t r) { return *replicas_[r]; }
  /// The device of replica `r`.
  const torch::Device& device(size_t r) const { return devices_[r]; }

  /// Puts every replica in replica 0's mode (train() or eval()).
  void follow_training_mode() {
    const bool training = replicas_[0]->is_training();
    for (size_t r = 1; r < replicas_.size(); ++r)
      if (replicas_[r]->is_training() != training) replicas_[r]->train(training);
  }

  /// Adds every other replica's gradients into replica 0's (on devices[0]) and clears theirs,
  /// so replica 0 holds the gradient of the whole batch and the others start the next window empty.
  void reduce_gradients_into_primary() {
    torch::NoGradGuard no_grad;
    const auto& primary = parameters_[0];
    for (size_t r = 1; r < replicas_.size(); ++r) {
      for (size_t p = 0; p < primary.size(); ++p) {
        torch::Tensor& source = parameters_[r][p].mutable_grad();
        if (!source.defined()) continue;  // parameter unused by this replica's shard, or no shard
        torch::Tensor& target = primary[p].mutable_grad();
        if (target.defined()) {
          target.add_(source.to(devices_[0]));
        } else {
          target = source.to(devices_[0], /*non_blocking=*/false, /*copy=*/true);
        }
        source.reset();
      }
    }
  }

  /// Drops the gradients held by replicas other than 0 (after a failed batch, or before a new fit()).
  void clear_replica_gradients() {
    for (size_t r = 1; r < replicas_.size(); ++r)
      for (auto& parameter : parameters_[r]) parameter.mutable_grad().reset();
  }

  /// @brief Copies replica 0's parameters and buffers into every other replica.
  /// @param only_changed copy only tensors replica 0 changed since the last copy (detected by
  ///        their storage and autograd version counter); false copies everything
  void copy_to_replicas(bool only_changed) {
    if (replicas_.size() == 1) return;
    torch::NoGradGuard no_grad;
    const size_t parameter_count = parameters_[0].size();
    for (size_t k = 0; k < copied_.size(); ++k) {
      const bool is_parameter = k < parameter_count;
      const torch::Tensor& source = is_parameter ? parameters_[0][k] : buffers_[0][k - parameter_count];
      // Frozen or unfrozen (trainloop::freeze) without a change of value: the flag still follows,
      // or a replica would compute a gradient the model's parameter must not get (or miss one).
      for (size_t r = 1; is_parameter && r < replicas_.size(); ++r) {
        torch::Tensor& target = parameters_[r][k];
        if (target.requires_grad() != source.requires_grad()) target.set_requires_grad(source.requires_grad());
      }
      const Fingerprint now{source.data_ptr(), source._version()};
      if (only_changed && now == copied_[k]) continue;
      for (size_t r = 1; r < replicas_.size(); ++r) {
        torch::Tensor& target = is_parameter ? parameters_[r][k] : buffers_[r][k - parameter_count];
        target.copy_(source);
      }
      copied_[k] = now;
    }
  }

 private:
  /// Where and at which version replica 0's tensor was when it was last copied.
  struct Fingerprint {
    const void* data = nullptr;
    int64_t version = -1;
    bool operator==(const Fingerprint&) const = default;
  };

  static std::vector<torch::Tensor> defined_only(std::vector<torch::Tensor> tensors) {
    std::erase_if(tensors, [](const torch::Tensor& t) { return !t.defined(); });
    return tensors;
  }

  std::shared_ptr<Module> make_replica(size_t r) {
    const auto& primary = *replicas_[0];
    if constexpr (SelfReplicatingModule<Module>) {
      auto copy = primary.replicate(devices_[r]);
      TRAINLOOP_CHECK(copy != nullptr, "the model's replicate() returned no module for DataParallel replica ", r);
      return copy;
    } else if constexpr (cloneable_module_v<Module>) {
      auto copy = std::dynamic_pointer_cast<Module>(primary.clone(devices_[r]));
      TRAINLOOP_CHECK(copy != nullptr, "cloning the model for DataParallel replica ", r, " on ", devices_[r].str(),
                      " returned a module of another type; expected ", typeid(Module).name());
      return copy;
    } else {
      auto copy = std::make_shared<Module>();
      copy->to(devices_[r]);
      match_structure(primary.named_parameters(), copy->named_parameters(), "parameter", r);
      match_structure(primary.named_buffers(), copy->named_buffers(), "buffer", r);
      return copy;  // values are copied by copy_to_replicas() with everything else
    }
  }

  /// Checks a default-constructed replica has the model's tensors (names, shapes) and gives them
  /// the model's dtypes (the model may have been converted after construction).
  void match_structure(const torch::OrderedDict<std::string, torch::Tensor>& original,
                       const torch::OrderedDict<std::string, torch::Tensor>& built, const char* kind, size_t r) const {
    const char* advice =
        "; a model whose structure depends on constructor arguments must derive from torch::nn::Cloneable<Impl> "
        "(and implement reset()) so DataParallel clones it instead of default-constructing it";
    TRAINLOOP_CHECK(original.size() == built.size(), "DataParallel replica ", r, ": the model has ", original.size(), " ",
                    kind, "s but a default-constructed ", typeid(Module).name(), " has ", built.size(), advice);
    for (size_t i = 0; i < original.size(); ++i) {
      const auto& want = original[i];
      const auto& got = built[i];
      TRAINLOOP_CHECK(want.key() == got.key(), "DataParallel replica ", r, ": the model's ", kind, " ", i, " is '",
                      want.key(), "' but a default-constructed module's is '", got.key(), "'", advice);
      TRAINLOOP_CHECK(want.value().defined() == got.value().defined() &&
                          (!want.value().defined() || want.value().sizes() == got.value().sizes()),
                      "DataParallel replica ", r, ": the model's ", kind, " '", want.key(), "' has shape ",
                      want.value().defined() ? want.value().sizes() : c10::IntArrayRef{},
                      " but a default-constructed module's has shape ",
                      got.value().defined() ? got.value().sizes() : c10::IntArrayRef{}, advice);
      if (!want.value().defined()) continue;
      torch::Tensor built_tensor = got.value();
      if (built_tensor.scalar_type() != want.value().scalar_type()) {
        torch::NoGradGuard no_grad;
        built_tensor.set_data(built_tensor.to(want.value().scalar_type()));
      }
    }
  }

  std::vector<torch::Device> devices_;
  std::vector<std::shared_ptr<Module>> replicas_;
  std::vector<std::vector<torch::Tensor>> parameters_;  // [replica][parameter], in parameters() order
  std::vector<std::vector<torch::Tensor>> buffers_;     // [replica][buffer], defined buffers only
  std::vector<Fingerprint> copied_;                     // per parameter, then per buffer, of replica 0
};

}  // namespace trainloop::detail
