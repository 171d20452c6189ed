#pragma once
/// @file
/// @brief Choosing and checking the master port of rank 0's TCPStore.

#include <trainloop/error.hpp>

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <netdb.h>
#include <netinet/in.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

namespace trainloop::distributed {

namespace detail {

/// Closes a socket descriptor when it goes out of scope.
struct SocketCloser {
  int fd = -1;
  ~SocketCloser() {
    if (fd >= 0) ::close(fd);
  }
};

/// Resolves `host` (name or numeric address) for a TCP bind on `port`.
inline addrinfo* resolve_for_bind(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_ADDRCONFIG;
  addrinfo* addresses = nullptr;
  const std::string service = std::to_string(port);
  int status = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &addresses);
  TRAINLOOP_CHECK(status == 0, "cannot resolve host '", host, "': ", ::gai_strerror(status),
                  "; expected a local host name or address");
  return addresses;
}

/// Outcome of trying to bind (host, port).
struct BindProbe {
  int error = 0;  ///< 0 on success, else errno of the last failed bind
  int port = 0;   ///< the port actually bound (differs from the request when it was 0)
};

/// Binds a TCP socket to (host, port) on the first of host's addresses that accepts it,
/// reads back the bound port, and closes the socket. `reuse_address` mirrors the TCPStore
/// server, which sets SO_REUSEADDR: with it, ports held only by TIME_WAIT leftovers of an
/// earlier run count as free, as they are for the store, while a listening socket still
/// makes the bind fail.
inline BindProbe probe_bind(const std::string& host, int port, bool reuse_address) {
  addrinfo* addresses = resolve_for_bind(host, port);
  BindProbe probe{EADDRNOTAVAIL, 0};
  for (addrinfo* address = addresses; address != nullptr; address = address->ai_next) {
    SocketCloser socket{::socket(address->ai_family, address->ai_socktype, address->ai_protocol)};
    if (socket.fd < 0) {
      probe.error = errno;
      continue;
    }
    int on = 1;
    if (reuse_address) ::setsockopt(socket.fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (::bind(socket.fd, address->ai_addr, address->ai_addrlen) != 0) {
      probe.error = errno;
      if (probe.error == EADDRINUSE) break;  // definitive: somebody holds the port
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    ::getsockname(socket.fd, reinterpret_cast<sockaddr*>(&bound), &length);
    probe.port = bound.ss_family == AF_INET6
                     ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    probe.error = 0;
    break;
  }
  ::freeaddrinfo(addresses);
  return probe;
}

}  // namespace detail

/// Asks the kernel for a currently unused TCP port on `host` (binds port 0, reads the port
/// back, closes the socket).
/// @note Another process may take the port between this call and the store's bind; the
///       window is short and the store then fails with a clear "address in use" error.
/// @return a port in [1, 65535].
inline int find_free_port(const std::string& host = "127.0.0.1") {
  detail::BindProbe probe = detail::probe_bind(host, 0, /*reuse_address=*/false);
  TRAINLOOP_CHECK(probe.error == 0, "cannot bind a TCP socket on ", host, ": ",
                  std::strerror(probe.error), "; expected a local address to pick a free port on");
  return probe.port;
}

/// Throws when `port` cannot be bound on `host`, with a message that says what to do.
/// @throws trainloop::Error "port 29500 on 127.0.0.1 is already in use; pass another master
///         port or 0 to pick a free one" when the port is taken; another message naming the
///         system error when `host` is not an address of this machine.
inline void check_port_available(const std::string& host, int port) {
  TRAINLOOP_CHECK(port >= 1 && port <= 65535, "master port ", port,
                  " is out of range; expected 1..65535, or 0 to pick a free one");
  detail::BindProbe probe = detail::probe_bind(host, port, /*reuse_address=*/true);
  TRAINLOOP_CHECK(probe.error != EADDRINUSE, "port ", port, " on ", host,
                  " is already in use; pass another master port or 0 to pick a free one");
  TRAINLOOP_CHECK(probe.error == 0, "cannot bind port ", port, " on ", host, ": ",
                  std::strerror(probe.error),
                  "; expected the master address to be an address of this machine");
}

}  // namespace trainloop::distributed
