#define BOOST_TEST_MODULE test_process_group
#include "unit_test.hpp"

#include "test_support.hpp"
#include "thread_ranks.hpp"

#include <trainloop/distributed/comm/point_to_point.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/elastic/box_descriptor.hpp>
#include <trainloop/distributed/elastic/shared_copy_file.hpp>
#include <trainloop/distributed/launch/free_port.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace distributed = trainloop::distributed;
using namespace std::chrono_literals;

namespace {

/// Ranks are threads of this process, each with its own store client and Gloo backend.
struct OneThreadPerRank {
  OneThreadPerRank() { torch::set_num_threads(1); }
};
BOOST_TEST_GLOBAL_FIXTURE(OneThreadPerRank);

}  // namespace

BOOST_AUTO_TEST_SUITE(collectives)

BOOST_AUTO_TEST_CASE(all_reduce_sum_is_exact_over_2_and_3_ranks) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](distributed::ProcessGroup& group) {
      RANK_TEST(group.rank() >= 0);
      RANK_TEST(group.world_size() == world);
      RANK_TEST((group.backend() == distributed::Backend::Gloo));
      const double r = group.rank();
      // single tensor
      torch::Tensor x = torch::full({5}, r + 1.0);
      group.all_reduce_sum(x);
      RANK_TEST(torch::equal(x, torch::full({5}, world * (world + 1) / 2.0)));
      // several tensors of several dtypes, one non-contiguous
      torch::Tensor a = torch::arange(6, torch::kFloat32).view({2, 3}) * (r + 1);
      torch::Tensor b = torch::full({4}, static_cast<std::int64_t>(group.rank() * 10 + 1), torch::kInt64);
      torch::Tensor c_base = torch::arange(12, torch::kFloat64).view({3, 4});
      torch::Tensor c = c_base.t();  // non-contiguous view: result must land in c_base
      const double ranks_sum = world * (world - 1) / 2.0;
      group.all_reduce_sum(std::vector<torch::Tensor>{a, b, c});
      RANK_TEST(torch::equal(a, torch::arange(6, torch::kFloat32).view({2, 3}) * (world * (world + 1) / 2.0)));
      RANK_TEST(torch::equal(b, torch::full({4}, static_cast<std::int64_t>(10 * ranks_sum + world), torch::kInt64)));
      RANK_TEST(torch::equal(c_base, torch::arange(12, torch::kFloat64).view({3, 4}) * world));
      // tensors of >= 256 KiB get a collective of their own, in place or (non-contiguous) staged
      torch::Tensor big = torch::full({70000}, r + 1.0);
      torch::Tensor big_base = torch::full({300, 300}, r + 1.0);
      torch::Tensor small = torch::full({3}, r);
      group.all_reduce_sum(std::vector<torch::Tensor>{small, big, big_base.t(), a});
      RANK_TEST(torch::equal(big, torch::full({70000}, world * (world + 1) / 2.0)));
      RANK_TEST(torch::equal(big_base, torch::full({300, 300}, world * (world + 1) / 2.0)));
      RANK_TEST(torch::equal(small, torch::full({3}, ranks_sum)));
      RANK_TEST(torch::equal(a, torch::arange(6, torch::kFloat32).view({2, 3}) * (world * (world + 1) / 2.0 * world)));  // summed twice
      // async
      torch::Tensor y = torch::full({3}, 2.0 * r);
      distributed::WorkHandle work = group.all_reduce_sum_async(y);
      group.wait(work);
      RANK_TEST(torch::equal(y, torch::full({3}, 2.0 * ranks_sum)));
    });
  }
}

BOOST_AUTO_TEST_CASE(broadcast_copies_the_root_values) {
  run_ranks(3, [](distributed::ProcessGroup& group) {
    const double r = group.rank();
    torch::Tensor a = torch::full({2, 2}, r);
    torch::Tensor b = torch::full({3}, static_cast<std::int64_t>(100 + group.rank()), torch::kInt64);
    torch::Tensor big = torch::full({100000}, r);
    group.broadcast(std::vector<torch::Tensor>{a, big, b}, /*root=*/1);
    RANK_TEST(torch::equal(a, torch::full({2, 2}, 1.0)));
    RANK_TEST(torch::equal(big, torch::full({100000}, 1.0)));
    RANK_TEST(torch::equal(b, torch::full({3}, std::int64_t{101}, torch::kInt64)));
    torch::Tensor c = torch::full({4}, r + 7);
    group.broadcast(c);  // default root 0
    RANK_TEST(torch::equal(c, torch::full({4}, 7.0)));
  });
}

BOOST_AUTO_TEST_CASE(all_reduce_max_and_all_gather) {
  run_ranks(3, [](distributed::ProcessGroup& group) {
    torch::Tensor stop = torch::tensor({group.rank() == 1 ? 1 : 0}, torch::kInt64);
    group.all_reduce_max(stop);
    RANK_TEST(stop.item<std::int64_t>() == 1);
    torch::Tensor mine = torch::tensor({std::int64_t{group.rank()}, std::int64_t{group.rank() * group.rank()}});
    torch::Tensor all = group.all_gather(mine);
    RANK_TEST(all.sizes() == torch::IntArrayRef({3, 2}));
    RANK_TEST(torch::equal(all, torch::tensor({0, 0, 1, 1, 2, 4}, torch::kInt64).view({3, 2})));
  });
}

BOOST_AUTO_TEST_CASE(reduce_scatter_and_all_gather_into_shard_and_reassemble_over_2_and_3_ranks) {
  // The collectives a sharded optimizer (ZeRO) needs: each rank receives the sum of its chunk,
  // then every rank's chunk is put back together in rank order (Gloo's own reduce-scatter).
  for (int world : {2, 3}) {
    run_ranks(world, [world](distributed::ProcessGroup& group) {
      const auto r = static_cast<double>(group.rank());
      const torch::Tensor whole = torch::arange(4 * world, torch::kFloat64).view({world, 4}) * (r + 1);
      torch::Tensor mine = torch::empty({4}, torch::kFloat64);
      group.reduce_scatter_sum(whole, mine);
      const double rank_factor_sum = world * (world + 1) / 2.0;  // sum over ranks of (r + 1)
      const torch::Tensor expected = torch::arange(4 * group.rank(), 4 * group.rank() + 4, torch::kFloat64) *
                                     rank_factor_sum;
      RANK_TEST(torch::equal(mine, expected));
      group.reduce_scatter_sum(whole, mine);  // and again: nothing left over from the first call
      RANK_TEST(torch::equal(mine, expected));
      torch::Tensor gathered = torch::empty({world, 4}, torch::kFloat64);
      group.all_gather_into(mine, gathered);
      RANK_TEST(torch::equal(gathered, torch::arange(4 * world, torch::kFloat64).view({world, 4}) * rank_factor_sum));
      // Sizes that do not shard are a clear error, before any message is sent.
      torch::Tensor wrong = torch::empty({3}, torch::kFloat64);
      try {
        group.reduce_scatter_sum(whole, wrong);
        RANK_TEST(false);
      } catch (const trainloop::ConfigurationError& error) {
        RANK_TEST(std::string(error.what()).find("expected " + std::to_string(world) + " x 3") != std::string::npos);
      }
    });
  }
}

BOOST_AUTO_TEST_CASE(pass_to_left_hands_each_rank_the_bytes_of_the_rank_after_it_over_2_and_3_ranks) {
  // Elastic training's neighbour copies (distributed/elastic/share_copies.hpp): lengths differ per
  // rank; a buffer of the right length is reused, one of another length replaced.
  for (int world : {2, 3}) {
    run_ranks(world, [world](distributed::ProcessGroup& group) {
      auto bytes_of = [](int rank) {
        return (torch::arange(1000 + 37 * rank, torch::kInt64) * (rank + 3)).remainder(251).to(torch::kUInt8);
      };
      const int right = (group.rank() + 1) % world;
      torch::Tensor received = distributed::pass_to_left(group, bytes_of(group.rank()));
      RANK_TEST(torch::equal(received, bytes_of(right)));
      torch::Tensor again = distributed::pass_to_left(group, bytes_of(group.rank()), received);
      RANK_TEST(again.data_ptr() == received.data_ptr());  // reused
      RANK_TEST(torch::equal(again, bytes_of(right)));
      torch::Tensor replaced = distributed::pass_to_left(group, bytes_of(group.rank()), torch::empty({3}, torch::kUInt8));
      RANK_TEST(torch::equal(replaced, bytes_of(right)));
    });
    // Rank 1 sends nothing (its copy is in a file): its left neighbour gets an empty tensor, the
    // others their bytes. A fresh group, and one pass: thread-ranks of one process time out in
    // the all-gather of a pass that follows three passes, or one like this, in the same group
    // (Gloo's connections within one process); ranks that are processes, as trainloop runs them,
    // go on (test_elastic's two-machine cases pass blocks across machines and name files within
    // one at every step).
    run_ranks(world, [world](distributed::ProcessGroup& group) {
      auto bytes_of = [](int rank) { return torch::full({100 + rank}, rank + 1, torch::kUInt8); };
      const int right = (group.rank() + 1) % world;
      const torch::Tensor mine = group.rank() == 1 ? torch::empty({0}, torch::kUInt8) : bytes_of(group.rank());
      torch::Tensor partly = distributed::pass_to_left(group, mine);
      const bool as_expected = right == 1 ? partly.numel() == 0 : torch::equal(partly, bytes_of(right));
      RANK_TEST(as_expected);
    });
  }
}

BOOST_AUTO_TEST_CASE(a_copy_in_a_shared_memory_file_outlives_its_writer_and_only_a_sealed_step_is_read) {
  // Elastic training's copies for a keeper on the same machine (distributed/elastic/shared_copy_file.hpp).
  namespace elastic = trainloop::distributed::elastic;
  const std::filesystem::path path = "/dev/shm/trainloop-elastic-test-" + std::to_string(::getpid()) + "-copy";
  trainloop::detail::ShareCapture capture;
  auto file = std::make_unique<elastic::SharedCopyFile>();
  const torch::Tensor weight = torch::arange(12, torch::kFloat32).view({3, 4});
  std::vector<trainloop::TensorShare> shares{{"model.w", {3, 4}, 0, weight.reshape({-1})}};
  capture.plan(shares, {}, {}, /*one_block=*/true, [&](int64_t bytes) { return file->block(path, bytes); });
  BOOST_REQUIRE(file->holds(capture.block()));
  const std::atomic<bool> never{false};
  BOOST_TEST(capture.copy(never));
  const torch::Tensor descriptor = elastic::detail::encode_boxes(capture.boxes());
  // Not sealed yet: a writer killed while copying names no step.
  BOOST_CHECK_THROW(elastic::read_shared_copy(path, 3), trainloop::CommunicationError);
  BOOST_REQUIRE(file->seal(descriptor, 3));
  auto read_back = [&](int64_t step) {
    const auto [read_descriptor, block] = elastic::read_shared_copy(path, step);
    return elastic::detail::decode_boxes(read_descriptor, block);
  };
  BOOST_TEST(torch::equal(read_back(3).at(0).buffer, weight));
  try {
    (void)read_back(4);
    BOOST_TEST(false);
  } catch (const trainloop::CommunicationError& error) {
    BOOST_TEST(std::string(error.what()).find("holds step 3") != std::string::npos, error.what());
  }
  // The next step: unsealed while copied again, sealed with the new step.
  file->unseal();
  BOOST_CHECK_THROW(elastic::read_shared_copy(path, 3), trainloop::CommunicationError);
  weight.mul_(2);
  capture.plan(shares, {}, {}, /*one_block=*/true, [&](int64_t bytes) { return file->block(path, bytes); });
  BOOST_TEST(capture.copy(never));
  BOOST_REQUIRE(file->seal(descriptor, 4));
  // Its writer gone (the object and the mapping it returned): the file and what it holds stay.
  const torch::Tensor expected = weight.clone();
  elastic::SharedCopyFile moved = std::move(*file);
  file.reset();
  BOOST_TEST(std::filesystem::exists(path));
  BOOST_TEST(torch::equal(read_back(4).at(0).buffer, expected));
  // Every truncation and garbled trailer: an error naming the file, never a crash.
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  const std::filesystem::path broken = path.string() + "-broken";
  for (int64_t length = 0; length < size; length += 7) {
    std::filesystem::copy_file(path, broken, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::resize_file(broken, static_cast<std::uintmax_t>(length));
    BOOST_CHECK_THROW(elastic::read_shared_copy(broken, 4), trainloop::CommunicationError);
  }
  for (int64_t at = size - 32; at < size; at += 8) {
    std::filesystem::copy_file(path, broken, std::filesystem::copy_options::overwrite_existing);
    std::fstream garble(broken, std::ios::in | std::ios::out | std::ios::binary);
    garble.seekp(at);
    const int64_t nonsense = -5;
    garble.write(reinterpret_cast<const char*>(&nonsense), 8);
    garble.close();
    BOOST_CHECK_THROW(elastic::read_shared_copy(broken, 4), trainloop::CommunicationError);
  }
  std::filesystem::remove(broken);
  moved.remove();
  BOOST_TEST(!std::filesystem::exists(path));
  BOOST_CHECK_THROW(elastic::read_shared_copy(path, 4), trainloop::CommunicationError);
}

BOOST_AUTO_TEST_CASE(a_copied_blocks_descriptor_round_trips_and_a_malformed_one_is_a_clear_error) {
  namespace elastic = trainloop::distributed::elastic;
  trainloop::detail::ShareCapture capture;
  const torch::Tensor weight = torch::arange(12, torch::kFloat32).view({3, 4});
  const torch::Tensor step = torch::full({}, 7.0, torch::kFloat64);
  std::vector<trainloop::TensorShare> shares{{"model.w", {3, 4}, 2, weight.reshape({-1}).narrow(0, 2, 9)},
                                              {"optim.state.w.step", {}, 0, step}};
  capture.plan(shares, {}, {{"model.bn.running_mean", torch::ones({5}, torch::kFloat64)}}, /*one_block=*/true);
  const std::atomic<bool> never{false};
  BOOST_TEST(capture.copy(never));
  const torch::Tensor encoded = elastic::detail::encode_boxes(capture.boxes());
  const std::vector<trainloop::detail::CapturedBox> decoded = elastic::detail::decode_boxes(encoded, capture.block());
  BOOST_REQUIRE(decoded.size() == capture.boxes().size());
  for (size_t i = 0; i < decoded.size(); ++i) {
    BOOST_TEST(decoded[i].key == capture.boxes()[i].key);
    BOOST_TEST(decoded[i].offsets == capture.boxes()[i].offsets);
    BOOST_TEST(decoded[i].size == capture.boxes()[i].size);
    BOOST_TEST(torch::equal(decoded[i].buffer, capture.boxes()[i].buffer));
  }
  // Every truncation, a block too short, and garbled numbers: an error naming the copy, never a crash.
  for (int64_t length = 0; length < encoded.numel(); length += 5) {
    BOOST_CHECK_THROW(elastic::detail::decode_boxes(encoded.narrow(0, 0, length).clone(), capture.block()),
                      trainloop::CommunicationError);
  }
  BOOST_CHECK_THROW(elastic::detail::decode_boxes(encoded, capture.block().narrow(0, 0, 8).clone()), trainloop::CommunicationError);
  for (int64_t at = 8; at < encoded.numel(); at += 8) {
    torch::Tensor garbled = encoded.clone();
    garbled.narrow(0, at, std::min<int64_t>(8, encoded.numel() - at)).fill_(0xff);
    try {
      (void)elastic::detail::decode_boxes(garbled, capture.block());
    } catch (const trainloop::CommunicationError& error) {
      BOOST_TEST(std::string(error.what()).find("neighbour's copy of sharded state is malformed") != std::string::npos);
    }
  }
  // Element types no share holds (no size; no plain view of bytes): the same error, not libtorch's.
  for (const c10::ScalarType dtype : {c10::ScalarType::Undefined, c10::ScalarType::QInt8, c10::ScalarType::Bits8}) {
    torch::Tensor retyped = encoded.clone();
    const auto value = static_cast<int64_t>(dtype);
    std::memcpy(static_cast<char*>(retyped.data_ptr()) + 16, &value, 8);  // the first box's dtype
    BOOST_CHECK_THROW(elastic::detail::decode_boxes(retyped, capture.block()), trainloop::CommunicationError);
  }
}

BOOST_AUTO_TEST_CASE(barrier_waits_for_the_slowest_rank) {
  // Events in one order, not durations: ranks 0 and 1 enter the barrier first; rank 2 arrives
  // only once both are in it; ranks 0 and 1 leave it after rank 2 arrived. Rank 2's delay is
  // there to let a barrier that does not wait show it; no check depends on its length.
  std::atomic<int> events{0}, entered{0};
  std::vector<int> left_at(3, -1);
  int rank2_arrived_at = -1;
  run_ranks(3, [&](distributed::ProcessGroup& group) {
    group.barrier();  // all ranks constructed
    if (group.rank() == 2) {
      while (entered.load() < 2) std::this_thread::yield();
      std::this_thread::sleep_for(50ms);
      rank2_arrived_at = events++;
    } else {
      ++entered;
    }
    group.barrier();
    left_at[group.rank()] = events++;
  });
  RANK_TEST(rank2_arrived_at >= 0);
  RANK_TEST(left_at[0] > rank2_arrived_at);
  RANK_TEST(left_at[1] > rank2_arrived_at);
  RANK_TEST(left_at[2] > rank2_arrived_at);  // and rank 2, last in, was let out
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(errors)

BOOST_AUTO_TEST_CASE(unreachable_master_times_out_with_address_and_timeout) {
  const int port = distributed::find_free_port();  // nobody listens there
  auto options = thread_rank_options(/*rank=*/1, /*world_size=*/2, port);
  options.timeout = 1000ms;
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_of([&] { distributed::ProcessGroup::create(options); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST_MESSAGE("unreachable master: " << message << " after " << seconds << " s");
  // It kept trying for the timeout (a lower bound that neither a fast nor a loaded machine
  // breaks)... and then gave up: bounded by far more than the timeout, only to tell giving up
  // from retrying for ever (not a speed goal).
  RANK_TEST(seconds >= 0.8);
  RANK_TEST(seconds < 60.0);
  RANK_TEST(message.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  RANK_TEST(message.find("1000 ms") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(a_master_that_drops_packets_times_out_on_time) {
  // A listening socket whose accept queue is full drops new connection requests silently, as a
  // firewall does: the client gets no answer at all. A blocking connect waited ~130 s (the
  // kernel's SYN retries) while the message promised the timeout.
  const int server = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  BOOST_REQUIRE(::bind(server, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  BOOST_REQUIRE(::listen(server, 0) == 0);
  socklen_t length = sizeof address;
  ::getsockname(server, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  const int filler = ::socket(AF_INET, SOCK_STREAM, 0);  // fills the queue of length 1
  BOOST_REQUIRE(::connect(filler, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  BOOST_REQUIRE((distributed::probe_connection("127.0.0.1", port, 300ms) == distributed::ConnectProbe::NoAnswer));

  distributed::ProcessGroupOptions options;
  options.rank = 1;
  options.world_size = 2;
  options.master_port = port;
  options.timeout = 2000ms;
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    distributed::ProcessGroup::create(options);
  } catch (const trainloop::CommunicationError& error) {
    message = error.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(filler);
  ::close(server);
  BOOST_TEST_MESSAGE("gave up after " << seconds << " s: " << message);
  // At least the timeout (the lower bound holds on any machine), and not the kernel's ~130 s of
  // SYN retries: the upper bound only tells those apart, it is not a speed goal.
  BOOST_TEST(seconds >= 1.8);
  BOOST_TEST(seconds < 60.0);
  BOOST_TEST(message.find("127.0.0.1:" + std::to_string(port)) != std::string::npos, message);
  BOOST_TEST(message.find("within the timeout of 2000 ms") != std::string::npos, message);
  BOOST_TEST(message.find("no answer") != std::string::npos, message);
}

BOOST_AUTO_TEST_CASE(a_client_may_start_before_the_server_with_a_short_timeout) {
  const int port = distributed::find_free_port();
  std::vector<double> sums(2, 0.0);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int rank : {1, 0}) {
    ranks.emplace_back([&, rank] {
      try {
        if (rank == 0) std::this_thread::sleep_for(400ms);  // server comes up late
        auto options = thread_rank_options(rank, 2, port);
        options.timeout = 1500ms;
        distributed::ProcessGroup group = distributed::ProcessGroup::create(options);
        torch::Tensor x = torch::full({1}, rank + 1.0);
        group.all_reduce_sum(x);
        sums[rank] = x.item<double>();
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : ranks) thread.join();
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  RANK_TEST(sums[0] == 3.0);
  RANK_TEST(sums[1] == 3.0);
}

BOOST_AUTO_TEST_CASE(port_in_use_on_rank_0_names_the_port) {
  const int port = distributed::find_free_port();
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  BOOST_REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  BOOST_REQUIRE(::listen(listener, 4) == 0);
  auto options = thread_rank_options(/*rank=*/0, /*world_size=*/2, port);
  options.timeout = 1000ms;
  const std::string message = error_of([&] { distributed::ProcessGroup::create(options); });
  ::close(listener);
  BOOST_TEST_MESSAGE("port in use: " << message);
  RANK_TEST(message.find("port " + std::to_string(port)) != std::string::npos);
  RANK_TEST(message.find("already in use") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(bad_options_are_rejected_before_any_connection) {
  auto options = thread_rank_options(/*rank=*/2, /*world_size=*/2, 29500);
  RANK_TEST(error_of([&] { distributed::ProcessGroup::create(options); }).find("rank is 2") != std::string::npos);
  options = thread_rank_options(0, 1, 0);
  RANK_TEST(error_of([&] { distributed::ProcessGroup::create(options); }).find("master_port is 0") != std::string::npos);
  options = thread_rank_options(0, 1, 29500);
  options.backend = distributed::Backend::Nccl;
  const std::string nccl = error_of([&] { distributed::ProcessGroup::create(options); });
  RANK_TEST(nccl.find("nccl") != std::string::npos);
  distributed::ProcessGroup empty;
  RANK_TEST(!empty.valid());
  RANK_TEST(error_of([&] { empty.barrier(); }).find("empty ProcessGroup") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(single_rank_group_is_an_identity) {
  auto options = thread_rank_options(0, 1, distributed::find_free_port());
  distributed::ProcessGroup group = distributed::ProcessGroup::create(options);
  torch::Tensor x = torch::tensor({1.5, -2.0});
  group.all_reduce_sum(x);
  group.barrier();
  RANK_TEST(torch::equal(x, torch::tensor({1.5, -2.0})));
  RANK_TEST(torch::equal(group.all_gather(x), x.unsqueeze(0)));
}

BOOST_AUTO_TEST_SUITE_END()
