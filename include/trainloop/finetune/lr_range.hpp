#pragma once
/// @file
/// @brief Discriminative learning rates: fastai's `slice(lo, hi)` spread over the param groups
/// of an optimizer, from the body's first group (lowest rate) to the head (highest).
///
/// @code
/// trainloop::set_learning_rates(optimizer, trainloop::lr_range(trainloop::LrSlice(1e-5, 1e-3), 3));
/// // groups at 1e-5, 1e-4, 1e-3; a schedule then keeps these ratios (schedules/step_schedule.hpp)
/// @endcode

#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstddef>
#include <vector>

namespace trainloop {

/// @brief fastai's `slice`: `LrSlice(hi)` is `slice(hi)`, `LrSlice(lo, hi)` is `slice(lo, hi)`.
struct LrSlice {
  /// @brief `slice(stop)`: every group but the last at stop / 10, the last at stop.
  explicit LrSlice(double stop) : stop(stop) {}
  /// @brief `slice(start, stop)`: from start (first group) to stop (last), evenly in log scale.
  LrSlice(double start, double stop) : start(start), stop(stop) {}
  double start = 0.0;  ///< the first group's rate; 0: the `slice(stop)` form
  double stop = 0.0;   ///< the last group's rate
};

/// @brief fastai's even_mults: `n` numbers from `start` to `stop`, each the previous times the
/// same factor ((stop / start)^(1 / (n - 1))); `{stop}` when n is 1.
/// @throws trainloop::ConfigurationError when n is 0 or start and stop are not positive.
inline std::vector<double> even_mults(double start, double stop, std::size_t n) {
  TRAINLOOP_CHECK(n >= 1, "even_mults over ", n, " values; expected at least 1");
  TRAINLOOP_CHECK(start > 0.0 && stop > 0.0, "even_mults from ", start, " to ", stop, "; expected positive numbers");
  if (n == 1) return {stop};
  const double step = std::pow(stop / start, 1.0 / static_cast<double>(n - 1));
  std::vector<double> values;
  for (std::size_t i = 0; i < n; ++i) values.push_back(start * std::pow(step, static_cast<double>(i)));
  return values;
}

/// @brief fastai's Learner.lr_range: the learning rates of `groups` param groups for `slice`.
/// `LrSlice(lo, hi)` gives even_mults(lo, hi, groups); `LrSlice(hi)` gives hi / 10 for every
/// group but the last, and hi for the last.
/// @throws trainloop::ConfigurationError when groups is 0 or a rate is not positive.
inline std::vector<double> lr_range(const LrSlice& slice, std::size_t groups) {
  TRAINLOOP_CHECK(groups >= 1, "a learning-rate range over ", groups, " param groups; expected at least 1");
  TRAINLOOP_CHECK(slice.stop > 0.0, "the learning-rate slice ends at ", slice.stop, "; expected a positive rate");
  if (slice.start > 0.0) return even_mults(slice.start, slice.stop, groups);
  TRAINLOOP_CHECK(slice.start == 0.0, "the learning-rate slice starts at ", slice.start,
                  "; expected a positive rate (or none, for slice(stop))");
  std::vector<double> rates(groups - 1, slice.stop / 10.0);
  rates.push_back(slice.stop);
  return rates;
}

/// @brief Sets param group g's learning rate to `rates[g]`, for every group of `optimizer`.
/// @throws trainloop::ConfigurationError when the counts differ.
inline void set_learning_rates(torch::optim::Optimizer& optimizer, const std::vector<double>& rates) {
  auto& groups = optimizer.param_groups();
  TRAINLOOP_CHECK(rates.size() == groups.size(), "the optimizer has ", groups.size(), " param groups but ",
                  rates.size(), " learning rates were given; expected one per group");
  for (std::size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(rates[g]);
}

}  // namespace trainloop
