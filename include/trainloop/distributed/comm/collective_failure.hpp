#pragma once
/// @file
/// @brief What a collective that failed becomes (distributed/comm/process_group.hpp): running out
/// of memory stays a c10::OutOfMemoryError, with context, for the caller may react to it; a
/// failure between ranks that called different collectives is a DesyncError naming both calls
/// (found by the stall watchdog, through the process's collective log); anything else a
/// CommunicationError naming the collective, the rank, the backend and the timeout.

#include <trainloop/detail/error_context.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <exception>

namespace trainloop::distributed::detail {

/// Turns the exception being handled into what ProcessGroup::wait() documents: collective `seq`
/// (`what`) of the group failed on `rank` of `world_size`, which runs `backend` with `timeout`.
/// Call from a catch block only; an exception that is not a std::exception is rethrown as it is.
[[noreturn]] inline void rethrow_collective_failure(std::uint64_t seq, const char* what, int rank, int world_size,
                                                    Backend backend, std::chrono::milliseconds timeout) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError&) {
    // Not a communication failure: the caller may react to it (a smaller batch).
    ::trainloop::detail::rethrow_with_context(::trainloop::detail::concat(
        "trainloop: ", what, " on rank ", rank, " of ", world_size, " ran out of memory"));
  } catch (const std::exception& error) {
    if (auto desync = progress::progress_beacon().collectives().explain_failure(seq)) {
      throw DesyncError(::trainloop::detail::concat("trainloop: ", what, " failed on rank ", rank, " of ",
                                                    world_size, ": ", *desync));
    }
    throw CommunicationError(::trainloop::detail::concat(
        "trainloop: ", what, " failed on rank ", rank, " of ", world_size, " (", to_string(backend),
        ", timeout ", timeout.count(), " ms; did another rank fail or call a different collective?): ",
        error.what()));
  }
  throw;  // not a std::exception: as it is
}

}  // namespace trainloop::distributed::detail
