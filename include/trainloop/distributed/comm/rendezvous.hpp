#pragma once
/// @file
/// @brief Meeting the other ranks: the options of a process group, and the connection to rank
/// 0's TCPStore within the timeout, with errors that name the address and port.

#include <trainloop/error.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>

namespace trainloop::distributed {

/// Which communication library carries the collectives.
enum class Backend {
  Auto,  ///< NCCL when the group's device is CUDA, Gloo otherwise
  Gloo,  ///< CPU tensors (tensors on other devices are staged through host memory)
  Nccl   ///< CUDA tensors; only with a libtorch compiled with NCCL (USE_C10D_NCCL)
};

/// "auto", "gloo" or "nccl".
inline const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::Gloo: return "gloo";
    case Backend::Nccl: return "nccl";
    default: return "auto";
  }
}

/// The backend named "auto", "gloo" or "nccl" (`--backend`).
/// @throws trainloop::ConfigurationError naming any other name.
inline Backend backend_named(const std::string& name) {
  if (name == "auto") return Backend::Auto;
  if (name == "gloo") return Backend::Gloo;
  if (name == "nccl") return Backend::Nccl;
  throw ConfigurationError("trainloop: backend is '" + name + "'; expected auto, gloo or nccl");
}

/// How to build a process group: who we are, where rank 0's store listens, which backend.
/// An aggregate, so `ProcessGroupOptions{.rank = 1, .world_size = 2, .master_port = p}` works.
struct ProcessGroupOptions {
  int rank = 0;                            ///< this process's rank, in [0, world_size)
  int world_size = 1;                      ///< number of ranks
  std::string master_addr = "127.0.0.1";   ///< host of the TCPStore server
  int master_port = 29500;                 ///< port of the TCPStore server, in [1, 65535]
  /// Whether this rank hosts the TCPStore server. Unset: rank 0 does. Set false on every rank
  /// when somebody else already hosts it (torchrun with TORCHELASTIC_USE_AGENT_STORE=True).
  std::optional<bool> is_store_server = std::nullopt;
  Backend backend = Backend::Auto;         ///< resolved with `device` when Auto
  torch::Device device = torch::kCPU;      ///< this rank's compute device (cuda:LOCAL_RANK for NCCL)
  /// Limit for connecting to the store, the rendezvous, and each collective. Short in tests.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  /// Key prefix in the store, so our keys never collide with those of an agent's store.
  std::string store_prefix = "trainloop/default_pg";
  /// Gloo: the rendezvous alone waits at most this long for the other ranks (0: `timeout`), the
  /// collectives `timeout`. Elastic training grows its group with a replacement that may be gone
  /// (distributed/elastic/replacement_join.hpp): the members stop waiting for it soon.
  std::chrono::milliseconds rendezvous_timeout{0};
};

/// @throws trainloop::ConfigurationError naming the first option out of range.
inline void validate(const ProcessGroupOptions& o) {
  TRAINLOOP_CHECK(o.world_size >= 1, "world_size is ", o.world_size, "; expected >= 1");
  TRAINLOOP_CHECK(o.rank >= 0 && o.rank < o.world_size, "rank is ", o.rank, "; expected 0 <= rank < world_size (",
                  o.world_size, ")");
  TRAINLOOP_CHECK(o.master_port >= 1 && o.master_port <= 65535, "master_port is ", o.master_port,
                  "; expected 1..65535 (pick a free one with find_free_port())");
  TRAINLOOP_CHECK(!o.master_addr.empty(), "master_addr is empty; expected the host of rank 0");
  TRAINLOOP_CHECK(o.timeout.count() > 0, "timeout is ", o.timeout.count(), " ms; expected > 0");
}

/// What a TCP connection attempt found.
enum class ConnectProbe {
  Accepted,  ///< something listens and accepted the connection
  Refused,   ///< the host answered that nothing listens (or the address does not resolve yet)
  NoAnswer   ///< nothing answered within the time allowed (a firewall that drops packets, a dead host)
};

/// Tries one TCP connection to host:port, giving up after `limit`. Non-blocking connect plus
/// poll: a blocking connect to a host that silently drops packets waits for the kernel's SYN
/// retries (~130 s here), whatever timeout the caller promised.
inline ConnectProbe probe_connection(const std::string& host, int port, std::chrono::milliseconds limit) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return ConnectProbe::Refused;
  ConnectProbe result = ConnectProbe::Refused;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (addrinfo* candidate = found; candidate != nullptr && result != ConnectProbe::Accepted;
       candidate = candidate->ai_next) {
    const int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                            candidate->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, candidate->ai_addr, candidate->ai_addrlen) == 0) {
      result = ConnectProbe::Accepted;
    } else if (errno == EINPROGRESS) {
      pollfd waiting{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      const int ready = ::poll(&waiting, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
      if (ready == 0) {
        result = ConnectProbe::NoAnswer;
      } else if (ready > 0) {
        int error = 0;
        socklen_t length = sizeof error;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
        if (error == 0) result = ConnectProbe::Accepted;
        else if (error == ETIMEDOUT || error == EHOSTUNREACH || error == ENETUNREACH) result = ConnectProbe::NoAnswer;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return result;
}

namespace detail {

inline constexpr std::chrono::milliseconds kConnectRetryPause{100};
inline constexpr std::chrono::milliseconds kConnectAttemptTimeout{1000};

inline CommunicationError store_server_error(const ProcessGroupOptions& o, const std::exception& error) {
  const std::string what = error.what();
  const bool in_use = what.find("in use") != std::string::npos;
  return CommunicationError(::trainloop::detail::concat(
      "trainloop: rank ", o.rank, " cannot start the rendezvous store (TCPStore server) on port ", o.master_port,
      in_use ? ": the port is already in use (another job, or a leftover process?); pass another master port, "
               "or 0 to the launcher to pick a free one"
             : "",
      ". Details: ", what));
}

inline CommunicationError store_client_error(const ProcessGroupOptions& o, const std::string& what_happened) {
  return CommunicationError(::trainloop::detail::concat(
      "trainloop: rank ", o.rank, " could not connect to the rendezvous store at ", o.master_addr, ":", o.master_port,
      " within the timeout of ", o.timeout.count(), " ms (", what_happened,
      "); expected rank 0 (or the agent) to listen there: check MASTER_ADDR/MASTER_PORT, that rank 0 started, and "
      "that no firewall drops the connection"));
}

}  // namespace detail

/// Connects to (or, on the store server, starts) the TCPStore at master_addr:master_port, giving
/// up after the options' timeout (plus at most one attempt's second).
/// @throws trainloop::CommunicationError naming the address, port and timeout.
inline c10::intrusive_ptr<::c10d::Store> connect_store(const ProcessGroupOptions& o) {
  using namespace detail;
  const bool is_server = o.is_store_server.value_or(o.rank == 0);
  ::c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(o.master_port);
  store_options.isServer = is_server;
  // numWorkers stays unset: the backend's rendezvous already waits for every rank, with
  // the same timeout, and an unset count keeps clients of an agent's store from touching it.
  //
  // Clients first probe the port with a bounded non-blocking connect, and only hand it to the
  // TCPStore once something accepts. Then each TCPStore attempt is exactly 1 s: libtorch 1.13
  // truncates the store's connect timeout to whole seconds (a 999 ms attempt gives up before
  // connecting), and on a refused connection it either sleeps a 1 s back-off or, when less than
  // that remains, gives up at once.
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  std::string last_problem = "nothing listened";
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (!is_server) {
      const auto probe = probe_connection(o.master_addr, o.master_port,
                                          std::clamp(left, std::chrono::milliseconds(1), kConnectAttemptTimeout));
      if (probe != ConnectProbe::Accepted) {
        last_problem = probe == ConnectProbe::NoAnswer ? "no answer: packets to it seem to be dropped"
                                                       : "connection refused: nothing listens there";
        if (std::chrono::steady_clock::now() >= deadline) throw store_client_error(o, last_problem);
        if (probe == ConnectProbe::Refused) std::this_thread::sleep_for(std::min(kConnectRetryPause, left));
        continue;  // rank 0 is not listening yet: wait quietly (a failed TCPStore connect logs a line)
      }
    }
    store_options.timeout = is_server ? std::max(o.timeout, kConnectAttemptTimeout) : kConnectAttemptTimeout;
    try {
      auto store = c10::make_intrusive<::c10d::TCPStore>(o.master_addr, store_options);
      store->setTimeout(o.timeout);  // later gets and waits get the full timeout
      return store;
    } catch (const std::exception& error) {
      if (is_server) throw store_server_error(o, error);
      last_problem = error.what();
      if (std::chrono::steady_clock::now() >= deadline) throw store_client_error(o, last_problem);
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(kConnectRetryPause, deadline - std::chrono::steady_clock::now()));
  }
}

}  // namespace trainloop::distributed
