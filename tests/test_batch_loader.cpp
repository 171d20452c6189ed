#define BOOST_TEST_MODULE test_batch_loader
#include "unit_test.hpp"

#include <trainloop/data/batch_loader.hpp>
#include <trainloop/data/shard_sampler.hpp>
#include <trainloop/data/tensor_dataset.hpp>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <ranges>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using trainloop::data::BatchLoader;
using trainloop::data::BatchLoaderOptions;
using trainloop::data::TensorDataset;
using namespace std::chrono_literals;

namespace {

std::vector<size_t> iota_vector(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}

/// Sample i has input row [i, 10 i] and target i.
TensorDataset numbered_dataset(int64_t n) {
  const auto ids = torch::arange(n, torch::kInt64);
  return TensorDataset(torch::stack({ids, ids * 10}, 1).to(torch::kFloat32), ids);
}

/// A TensorDataset that sleeps a random 0-3 ms per batch (so workers finish out of order),
/// counts the batches it loaded, and throws for any batch containing `poisoned`.
class UnrulyDataset
    : public torch::data::datasets::BatchDataset<UnrulyDataset, torch::data::Example<>> {
 public:
  explicit UnrulyDataset(int64_t n, size_t poisoned = SIZE_MAX,
                         std::chrono::milliseconds max_delay = 3ms)
      : inner_(numbered_dataset(n)), poisoned_(poisoned), max_delay_(max_delay) {}

  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    thread_local std::mt19937 engine(std::hash<std::thread::id>{}(std::this_thread::get_id()));
    if (max_delay_.count() > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(engine() % (max_delay_.count() * 1000)));
    }
    ++loaded;
    for (size_t i : indices) {
      if (i == poisoned_) throw std::runtime_error("poisoned sample " + std::to_string(i));
    }
    return inner_.get_batch(indices);
  }
  c10::optional<size_t> size() const override { return inner_.size(); }

  std::atomic<size_t> loaded{0};

 private:
  TensorDataset inner_;
  size_t poisoned_;
  std::chrono::milliseconds max_delay_;
};

/// A plain torch::data::Dataset that only defines get(): its batches are vectors of examples.
class PerSampleDataset : public torch::data::datasets::Dataset<PerSampleDataset> {
 public:
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {torch::full({2}, static_cast<float>(i)), torch::tensor(i)};
  }
  c10::optional<size_t> size() const override { return 10; }
};

/// A dataset whose batch is its own type, passed through untouched.
struct IndexBatch {
  std::vector<size_t> indices;
};
class PassThroughDataset
    : public torch::data::datasets::BatchDataset<PassThroughDataset, IndexBatch> {
 public:
  IndexBatch get_batch(c10::ArrayRef<size_t> indices) override { return {indices.vec()}; }
  c10::optional<size_t> size() const override { return 100; }
};

/// Every batch of a full pass, via range-for.
template <class Loader>
std::vector<torch::data::Example<>> drain(Loader& loader) {
  std::vector<torch::data::Example<>> out;
  for (auto& batch : loader) out.push_back(batch);
  return out;
}

}  // namespace

// Range-for and std::ranges algorithms both accept the loader.
static_assert(std::input_iterator<BatchLoader<TensorDataset>::iterator>);
static_assert(std::ranges::input_range<BatchLoader<TensorDataset>&>);

BOOST_AUTO_TEST_CASE(batches_come_in_order_with_a_partial_last_batch) {
  auto dataset = numbered_dataset(10);
  BatchLoader loader(dataset, iota_vector(10), 3);
  static_assert(std::is_same_v<decltype(loader)::batch_type, torch::data::Example<>>);
  BOOST_TEST(loader.num_batches() == 4u);

  const auto batches = drain(loader);
  BOOST_REQUIRE_EQUAL(batches.size(), 4u);
  const std::vector<int64_t> expected_sizes{3, 3, 3, 1};
  int64_t sample = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    BOOST_TEST(batches[b].target.size(0) == expected_sizes[b]);
    for (int64_t row = 0; row < batches[b].target.size(0); ++row, ++sample) {
      BOOST_TEST(batches[b].target[row].item<int64_t>() == sample);
      BOOST_TEST(batches[b].data[row][1].item<float>() == 10.0f * sample);
    }
  }
  BOOST_TEST(sample == 10);

  BatchLoader dropping(dataset, iota_vector(10), 3, 0, /*drop_last=*/true);
  BOOST_TEST(dropping.num_batches() == 3u);
  BOOST_TEST(drain(dropping).size() == 3u);
}

BOOST_AUTO_TEST_CASE(workers_deliver_the_same_batches_in_the_same_order) {
  const size_t n = 257;
  trainloop::data::ShardSampler sampler(n, 0, 1, trainloop::data::ShardSamplerOptions().seed(9));
  const auto indices = sampler.indices();

  auto reference_dataset = std::make_shared<UnrulyDataset>(n, SIZE_MAX, 0ms);
  BatchLoader reference(reference_dataset, indices, 16);
  const auto expected = drain(reference);
  BOOST_REQUIRE_EQUAL(expected.size(), 17u);
  BOOST_TEST(expected.back().target.size(0) == 1);

  for (size_t workers : {1, 2, 3}) {
    auto dataset = std::make_shared<UnrulyDataset>(n);
    BatchLoader loader(dataset, indices, BatchLoaderOptions(16).num_workers(workers));
    std::vector<torch::data::Example<>> got;
    while (auto batch = loader.next()) got.push_back(*batch);
    BOOST_REQUIRE_EQUAL(got.size(), expected.size());
    for (size_t b = 0; b < got.size(); ++b) {
      BOOST_TEST(got[b].target.equal(expected[b].target), "workers=" << workers << " batch " << b);
      BOOST_TEST(got[b].data.equal(expected[b].data));
    }
    BOOST_TEST(dataset->loaded.load() == 17u);
    BOOST_TEST(!loader.next().has_value());
  }
}

BOOST_AUTO_TEST_CASE(a_dataset_exception_is_rethrown_at_its_batch) {
  for (size_t workers : {0, 2}) {
    BOOST_TEST_CONTEXT("workers=" << workers) {
      // Sample 5 is in batch 1 (samples 3, 4, 5) of four.
      UnrulyDataset dataset(10, /*poisoned=*/5);
      BatchLoader loader(dataset, iota_vector(10), 3, workers);
      BOOST_TEST(loader.next()->target[0].item<int64_t>() == 0);
      bool threw = false;
      try {
        loader.next();
      } catch (const std::runtime_error& error) {
        threw = true;
        BOOST_TEST(std::string(error.what()) == "poisoned sample 5");
      }
      BOOST_TEST(threw);
      // The failed batch is consumed; the rest of the pass is still delivered.
      BOOST_TEST(loader.next()->target[0].item<int64_t>() == 6);
      BOOST_TEST(loader.next()->target[0].item<int64_t>() == 9);
      BOOST_TEST(!loader.next().has_value());
    }
  }
}

BOOST_AUTO_TEST_CASE(destroying_mid_pass_stops_the_workers, *boost::unit_test::timeout(30)) {
  // The count of batches loaded shows the workers stopped (not how long destruction took): a
  // destructor that let them finish the pass would load all 10000. The timeout bounds a hang only.
  auto dataset = std::make_shared<UnrulyDataset>(10000, SIZE_MAX, 5ms);
  {
    BatchLoader loader(dataset, iota_vector(10000), 1, 4);  // 10000 batches of ~2.5 ms
    BOOST_TEST(loader.next().has_value());
    BOOST_TEST(loader.next().has_value());
  }
  {
    BatchLoader untouched(dataset, iota_vector(10000), 1, 4);  // never consumed
  }
  BOOST_TEST(dataset->loaded.load() < 100u, "workers stopped instead of loading the whole pass");
}

BOOST_AUTO_TEST_CASE(prefetching_is_bounded_by_prefetch_factor_times_workers) {
  auto dataset = std::make_shared<UnrulyDataset>(100, SIZE_MAX, 0ms);
  // Waits until `count` batches were loaded (the 60 s only bound a hang), then a little longer
  // to catch overshoot: a pause that can only miss a bug on a slow machine, never fail a good loader.
  auto settle = [&](size_t count) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (dataset->loaded.load() < count && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(100ms);
    return dataset->loaded.load();
  };
  BatchLoader loader(dataset, iota_vector(100), BatchLoaderOptions(1).num_workers(2));
  BOOST_TEST(settle(4) == 4u, "2 workers x prefetch factor 2");
  BOOST_TEST(loader.next()->target[0].item<int64_t>() == 0);
  BOOST_TEST(settle(5) == 5u, "one batch taken, one more loaded");
}

BOOST_AUTO_TEST_CASE(per_sample_datasets_are_stacked_and_other_batches_pass_through) {
  PerSampleDataset per_sample;
  BatchLoader stacked(per_sample, iota_vector(10), 4, 2);
  static_assert(std::is_same_v<decltype(stacked)::batch_type, torch::data::Example<>>);
  const auto batches = drain(stacked);
  BOOST_REQUIRE_EQUAL(batches.size(), 3u);
  BOOST_TEST(batches[0].data.sizes() == torch::IntArrayRef({4, 2}));
  BOOST_TEST(batches[2].target.sizes() == torch::IntArrayRef({2}));
  BOOST_TEST(batches[2].data[1][0].item<float>() == 9.0f);
  BOOST_TEST(batches[1].target[3].item<int64_t>() == 7);

  PassThroughDataset pass_through;
  BatchLoader loader(pass_through, std::vector<size_t>{5, 6, 7, 8, 9}, 2);
  static_assert(std::is_same_v<decltype(loader)::batch_type, IndexBatch>);
  std::vector<std::vector<size_t>> chunks;
  for (const auto& batch : loader) chunks.push_back(batch.indices);
  BOOST_TEST((chunks == std::vector<std::vector<size_t>>{{5, 6}, {7, 8}, {9}}));
}

BOOST_AUTO_TEST_CASE(single_pass_reset_and_batch_size_errors) {
  auto dataset = numbered_dataset(10);
  try {
    BatchLoader loader(dataset, iota_vector(10), 0);
    BOOST_FAIL("expected an error for batch size 0");
  } catch (const trainloop::Error& error) {
    BOOST_TEST(std::string(error.what()) ==
               "trainloop: batch size 0; expected a positive number");
  }

  BatchLoader loader(dataset, iota_vector(10), 5, 1);
  BOOST_TEST(drain(loader).size() == 2u);
  BOOST_CHECK_THROW(loader.begin(), trainloop::Error);  // the pass is over

  loader.reset({9, 8, 7});
  const auto again = drain(loader);
  BOOST_REQUIRE_EQUAL(again.size(), 1u);
  BOOST_TEST(again[0].target.equal(torch::tensor({9, 8, 7}, torch::kInt64)));

  BatchLoader empty(dataset, {}, 4, 2);
  BOOST_TEST(empty.num_batches() == 0u);
  BOOST_TEST(drain(empty).empty());
}
