#pragma once
/// @file
/// @brief MixUp (Zhang et al.; fastai's MixUp callback): each training sample is blended with
/// another sample of the same batch, x = λ·x_i + (1−λ)·x_j, and its loss is blended the same way.
///
/// @code
/// loop.fit(10, {trainloop::MixUp(0.4)});  // the class count from the data (ImageFolder, TensorDataset, FashionMNIST)
/// loop.fit(10, {trainloop::MixUp(trainloop::MixUpOptions(0.4).num_classes(10))});  // or given
/// @endcode
///
/// As fastai: a λ per sample drawn from Beta(α, α) and replaced by max(λ, 1−λ) (so each sample
/// stays mostly itself), the partner j a random permutation of the batch. Mixing stays within
/// this rank's micro-batch. Draws are reproducible: the generator is seeded by (seed, rank,
/// global step), so a resumed run mixes exactly as an uninterrupted one.
///
/// The loss is mixed by mixing the targets: class labels become soft targets λ·onehot(y_i) +
/// (1−λ)·onehot(y_j), and a cross-entropy loss of soft targets *is* λ·CE(y_i) + (1−λ)·CE(y_j)
/// (it is linear in the target); torch::nn::CrossEntropyLoss accepts them. Float targets
/// (regression) are blended directly, as fastai does. Accuracy counts a soft target's most
/// likely class, the sample's own.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/stable_hash.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace trainloop {

/// @brief Options of MixUp.
struct MixUpOptions {
  /// @param alpha the Beta(α, α) parameter (fastai's default 0.4)
  explicit MixUpOptions(double alpha = 0.4) : alpha_(alpha) {}
  /// The Beta(α, α) parameter.
  TORCH_ARG(double, alpha);
  /// Number of classes, to turn integer labels into soft targets; 0: the training dataset's (an
  /// ImageFolder's classes, a TensorDataset's num_classes), an error when it does not say.
  TORCH_ARG(int64_t, num_classes) = 0;
  /// Seed of the draws (combined with the rank and the global step).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// @brief Mixes every training micro-batch (see the file comment).
class MixUp : public Callback {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit MixUp(MixUpOptions options = MixUpOptions()) : options_(options) {
    TRAINLOOP_CHECK(options_.alpha() > 0.0, "MixUp alpha is ", options_.alpha(), "; expected a positive number");
    TRAINLOOP_CHECK(options_.num_classes() >= 0, "MixUp num_classes is ", options_.num_classes(), "; expected 0 or more");
  }

  /// @brief fastai's `MixUp(0.1)`: Beta(α, α) with α = `alpha`, other options at their defaults.
  explicit MixUp(double alpha) : MixUp(MixUpOptions(alpha)) {}

  /// @brief MixUp works on (input, target) batches: fit() refuses other batch types up front.
  bool needs_example_batches() const override { return true; }

  void on_train_batch(TrainState& state, torch::Tensor& input, torch::Tensor& target) override {
    const int64_t n = input.size(0);
    if (n < 2) return;
    std::mt19937_64 generator(mix(options_.seed(), static_cast<uint64_t>(state.rank), static_cast<uint64_t>(state.global_step),
                                  static_cast<uint64_t>(state.batch)));
    // λ ~ Beta(α, α) as X / (X + Y) with X, Y ~ Gamma(α, 1); then max(λ, 1 − λ).
    std::gamma_distribution<double> gamma(options_.alpha(), 1.0);
    std::vector<float> lambdas(static_cast<size_t>(n));
    for (auto& lambda : lambdas) {
      const double x = gamma(generator), y = gamma(generator);
      const double l = x + y > 0.0 ? x / (x + y) : 0.5;
      lambda = static_cast<float>(std::max(l, 1.0 - l));
    }
    std::vector<int64_t> partner(static_cast<size_t>(n));
    std::iota(partner.begin(), partner.end(), 0);
    for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with our generator (reproducible everywhere)
      std::uniform_int_distribution<int64_t> pick(0, i);
      std::swap(partner[static_cast<size_t>(i)], partner[static_cast<size_t>(pick(generator))]);
    }
    const auto device = input.device();
    const auto order = torch::tensor(partner, torch::kInt64).to(device);
    auto lambda = torch::tensor(lambdas, torch::kFloat32).to(device);
    std::vector<int64_t> shape(static_cast<size_t>(input.dim()), 1);
    shape[0] = n;
    input = torch::lerp(input.index_select(0, order), input, lambda.to(input.scalar_type()).view(shape));

    torch::Tensor soft;
    if (target.is_floating_point()) {
      soft = target;
    } else {
      // The class count: the option when given, else what the training data says (fastai's
      // MixUp needs neither: it mixes two losses; a soft target needs the width of the one-hot).
      const int64_t classes = options_.num_classes() > 0 ? options_.num_classes() : state.num_classes;
      TRAINLOOP_CHECK(classes > 0, "MixUp got class labels, num_classes 0 and a training dataset that does not say "
                      "its classes; expected MixUpOptions().num_classes(C) with the model's number of classes (or "
                      "an ImageFolder, or a TensorDataset given num_classes)");
      soft = torch::one_hot(target.to(torch::kInt64), classes).to(torch::kFloat32);
    }
    std::vector<int64_t> target_shape(static_cast<size_t>(soft.dim()), 1);
    target_shape[0] = n;
    target = torch::lerp(soft.index_select(0, order.to(soft.device())), soft,
                         lambda.to(soft.device()).to(soft.scalar_type()).view(target_shape));
  }

  /// @brief The options.
  const MixUpOptions& options() const { return options_; }

 private:
  static uint64_t mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    using detail::splitmix64;  // neighbouring keys give unrelated seeds
    return splitmix64(a ^ splitmix64(b ^ splitmix64(c ^ splitmix64(d))));
  }

  MixUpOptions options_;
};

}  // namespace trainloop
