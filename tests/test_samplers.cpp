#define BOOST_TEST_MODULE test_samplers
#include "unit_test.hpp"

#include "test_support.hpp"

#include <trainloop/data/shard_sampler.hpp>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

using trainloop::data::ShardSampler;
using trainloop::data::ShardSamplerOptions;

namespace {

std::vector<size_t> iota_vector(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}

/// How many times each of [0, n) occurs in the shards together.
std::vector<size_t> occurrences(const std::vector<std::vector<size_t>>& shards, size_t n) {
  std::vector<size_t> count(n, 0);
  for (const auto& shard : shards) {
    for (size_t i : shard) {
      BOOST_REQUIRE_LT(i, n);
      ++count[i];
    }
  }
  return count;
}


const std::vector<size_t> kSizes{97, 99, 10};
const std::vector<size_t> kWorlds{1, 2, 3};

}  // namespace

BOOST_AUTO_TEST_CASE(training_shards_are_equal_cover_everything_and_share_one_permutation) {
  const auto options = ShardSamplerOptions().shuffle(true).seed(42);
  for (size_t n : kSizes) {
    for (size_t w : kWorlds) {
      BOOST_TEST_CONTEXT("N=" << n << " w=" << w) {
        const size_t per_rank = (n + w - 1) / w;
        std::vector<std::vector<size_t>> full_orders;  // the w=1 order of each epoch
        for (uint64_t epoch : {0, 1}) {
          ShardSampler whole(n, 0, 1, options);
          whole.set_epoch(epoch);
          const auto order = whole.indices();
          auto sorted = order;
          std::sort(sorted.begin(), sorted.end());
          BOOST_TEST(sorted == iota_vector(n), "the epoch order is a permutation of [0, N)");
          BOOST_TEST(order != iota_vector(n), "shuffled");
          full_orders.push_back(order);

          std::vector<std::vector<size_t>> shards;
          for (size_t r = 0; r < w; ++r) {
            ShardSampler sampler(n, r, w, options);
            sampler.set_epoch(epoch);
            shards.push_back(sampler.indices());
            BOOST_TEST(shards.back().size() == per_rank);
            BOOST_TEST(sampler.num_samples() == per_rank);
            // Every rank deals from the same permutation: position r + k*w, padding wraps.
            for (size_t k = 0; k < per_rank; ++k) {
              BOOST_TEST(shards.back()[k] == order[(r + k * w) % n]);
            }
          }
          const auto count = occurrences(shards, n);
          BOOST_TEST(std::count(count.begin(), count.end(), 0) == 0, "every sample is visited");
          BOOST_TEST(std::accumulate(count.begin(), count.end(), size_t{0}) == per_rank * w);
          BOOST_TEST(*std::max_element(count.begin(), count.end()) <= (per_rank * w > n ? 2u : 1u));
        }
        BOOST_TEST(full_orders[0] != full_orders[1], "the order changes between epochs");

        // Reproducible: a fresh sampler, or going back to an epoch, gives the same list.
        ShardSampler again(n, w - 1, w, options);
        again.set_epoch(1);
        const auto epoch1 = again.indices();
        ShardSampler fresh(n, w - 1, w, options);
        fresh.set_epoch(1);
        BOOST_TEST(fresh.indices() == epoch1);
        again.set_epoch(0);
        again.set_epoch(1);
        BOOST_TEST(again.indices() == epoch1);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(different_seeds_give_different_orders_and_seed_plus_epoch_is_the_key) {
  ShardSampler a(100, 0, 1, ShardSamplerOptions().seed(1));
  ShardSampler b(100, 0, 1, ShardSamplerOptions().seed(2));
  BOOST_TEST(a.indices() != b.indices());
  // As in PyTorch's DistributedSampler, the generator is seeded with seed + epoch.
  ShardSampler c(100, 0, 1, ShardSamplerOptions().seed(5));
  c.set_epoch(2);
  ShardSampler d(100, 0, 1, ShardSamplerOptions().seed(7));
  BOOST_TEST(c.indices() == d.indices());
}

BOOST_AUTO_TEST_CASE(the_permutation_is_pinned_so_all_builds_agree) {
  // mt19937_64 + rejection sampling is fully specified, so every rank (whatever its standard
  // library or libtorch) computes this same order; a change here breaks mixed deployments.
  ShardSampler sampler(10, 0, 1, ShardSamplerOptions().seed(0));
  const std::vector<size_t> expected{7, 2, 0, 8, 3, 9, 6, 1, 5, 4};
  BOOST_TEST(sampler.indices() == expected);
}

BOOST_AUTO_TEST_CASE(evaluation_shards_are_disjoint_and_cover_each_sample_once) {
  for (size_t n : kSizes) {
    for (size_t w : kWorlds) {
      for (bool shuffle : {false, true}) {
        BOOST_TEST_CONTEXT("N=" << n << " w=" << w << " shuffle=" << shuffle) {
          std::vector<std::vector<size_t>> shards;
          size_t smallest = n;
          size_t largest = 0;
          for (size_t r = 0; r < w; ++r) {
            ShardSampler sampler(n, r, w,
                                 ShardSamplerOptions().shuffle(shuffle).pad_to_equal(false));
            shards.push_back(sampler.indices());
            BOOST_TEST(sampler.num_samples() == shards.back().size());
            smallest = std::min(smallest, shards.back().size());
            largest = std::max(largest, shards.back().size());
          }
          const auto count = occurrences(shards, n);
          BOOST_TEST(count == std::vector<size_t>(n, 1), "each sample exactly once");
          BOOST_TEST(largest - smallest <= 1u);
        }
      }
    }
  }
  // The unshuffled evaluation shard of rank r is r, r+w, r+2w, ...
  BOOST_TEST(ShardSampler::evaluation(10, 1, 3).indices() == (std::vector<size_t>{1, 4, 7}));
  BOOST_TEST(ShardSampler::evaluation(10, 0, 3).indices() == (std::vector<size_t>{0, 3, 6, 9}));
}

BOOST_AUTO_TEST_CASE(drop_last_truncates_to_a_multiple_of_the_world_size) {
  for (size_t n : kSizes) {
    for (size_t w : kWorlds) {
      std::vector<std::vector<size_t>> shards;
      for (size_t r = 0; r < w; ++r) {
        ShardSampler sampler(n, r, w, ShardSamplerOptions().seed(3).drop_last(true));
        shards.push_back(sampler.indices());
        BOOST_TEST(shards.back().size() == n / w);
        BOOST_TEST(sampler.num_samples() == n / w);
      }
      const auto count = occurrences(shards, n);
      BOOST_TEST(*std::max_element(count.begin(), count.end()) == 1u, "no sample twice");
      BOOST_TEST(std::accumulate(count.begin(), count.end(), size_t{0}) == n / w * w);
    }
  }
}

BOOST_AUTO_TEST_CASE(sequential_sampler_is_the_identity) {
  BOOST_TEST(ShardSampler::sequential(7).indices() == iota_vector(7));
  auto sampler = ShardSampler::sequential(1000);
  sampler.set_epoch(5);  // no effect without shuffling
  BOOST_TEST(sampler.indices() == iota_vector(1000));
}

BOOST_AUTO_TEST_CASE(invalid_configurations_are_rejected_with_the_values) {
  BOOST_TEST(error_of([] { ShardSampler(3, 0, 4); }) ==
             "trainloop: world size 4 is larger than the dataset (3 samples); expected at least "
             "one training sample per rank");
  BOOST_TEST(error_of([] { ShardSampler(3, 0, 4, ShardSamplerOptions().drop_last(true)); })
                 .find("world size 4 is larger than the dataset (3 samples)") != std::string::npos);
  BOOST_TEST(error_of([] { ShardSampler(10, 2, 2); }).find("rank 2") != std::string::npos);
  BOOST_TEST(error_of([] { ShardSampler(10, 0, 0); }).find("world size 0") !=
             std::string::npos);
  BOOST_TEST(error_of([] { ShardSampler(0, 0, 1); }).find("0 samples") != std::string::npos);
  // Evaluation tolerates more ranks than samples: the extra ranks get nothing.
  BOOST_TEST(ShardSampler::evaluation(3, 3, 4).indices().empty());
  BOOST_TEST(ShardSampler::evaluation(3, 3, 4).num_samples() == 0u);
  BOOST_TEST(ShardSampler::evaluation(3, 2, 4).indices() == (std::vector<size_t>{2}));
}
