#pragma once
/// @file
/// @brief Bytes between ranks of a ProcessGroup, point to point (the backend's send and recv):
/// each rank to its left neighbour (elastic training's copies of sharded state), and one rank to
/// another (its hand-off to other machines). Every rank of the group calls each as it calls a
/// collective: one call in every rank's collective log, so the stall watchdog's comparison holds.

#include <trainloop/distributed/comm/collective_issuer.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// Every rank of `group` sends `mine` (1-D uint8 on the CPU, any length) to the rank before it
/// (rank r to r-1, rank 0 to the last) and returns what the rank after it sent — in `reuse` when it
/// has that length (no allocation step after step), else in a new tensor. The lengths travel first (an
/// all-gather of one number per rank); an empty message is not sent. Elastic training's neighbour copies of sharded state
/// (distributed/elastic/share_copies.hpp): (W-1)/W less on the wire than an all-gather would.
inline torch::Tensor pass_to_left(ProcessGroup& group, const torch::Tensor& mine, torch::Tensor reuse = torch::Tensor()) {
  torch::NoGradGuard no_grad;
  detail::CollectiveIssuer& issuer = group.issuer();
  TRAINLOOP_CHECK(mine.dim() == 1 && mine.scalar_type() == torch::kUInt8 && mine.device().is_cpu(),
                  "pass_to_left sends 1-D uint8 bytes on the CPU; got ", c10::toString(mine.scalar_type()), " ",
                  mine.sizes(), " on ", mine.device());
  const torch::Tensor lengths = group.all_gather(torch::full({1}, mine.numel(), torch::kInt64)).reshape({-1}).to(torch::kCPU);
  const int world = issuer.world_size();
  const int left = (issuer.rank() + world - 1) % world;
  const int right = (issuer.rank() + 1) % world;
  const std::int64_t incoming = lengths[right].item<std::int64_t>();
  torch::Tensor theirs = reuse.defined() && reuse.is_contiguous() && reuse.numel() == incoming &&
                                 reuse.scalar_type() == torch::kUInt8 && reuse.device().is_cpu()
                             ? reuse
                             : torch::empty({incoming}, torch::kUInt8);
  if (world == 1) {
    theirs.copy_(mine);
    return theirs;
  }
  std::vector<torch::Tensor> out{mine.contiguous()};
  std::vector<torch::Tensor> in{theirs};
  constexpr int kTag = 0x7e1a;  // this exchange's messages only
  // Logged as one call without a size: the ranks' lengths differ by design.
  std::uint64_t seq = issuer.log_call(progress::CollectiveKind::PassToLeft, torch::Tensor());
  // Empty messages do not travel: both ends know the length (a copy kept in a file sends none).
  std::optional<WorkHandle> sent, received;
  if (mine.numel() > 0) {
    sent = issuer.launched(std::exchange(seq, 0), "pass_to_left", [&] { return issuer.native_checked()->send(out, left, kTag); });
  }
  if (incoming > 0) {
    received = issuer.launched(seq, "pass_to_left", [&] { return issuer.native_checked()->recv(in, right, kTag); });
  }
  if (received) issuer.wait_point_to_point(*received, "pass_to_left");
  if (sent) issuer.wait_point_to_point(*sent, "pass_to_left");
  return theirs;
}

/// Rank `from`'s `bytes` (1-D uint8 on the CPU, any length) to rank `to`, the length first.
/// Every rank calls it (one call in every rank's collective log, so the stall watchdog's
/// comparison holds) but only those two exchange anything: `to` gets the bytes, every other rank
/// an undefined tensor. Elastic training's hand-off to other machines (elastic/machine_directory.hpp).
inline torch::Tensor send_bytes(ProcessGroup& group, const torch::Tensor& bytes, int from, int to) {
  torch::NoGradGuard no_grad;
  detail::CollectiveIssuer& issuer = group.issuer();
  const int world = issuer.world_size();
  TRAINLOOP_CHECK(from >= 0 && from < world && to >= 0 && to < world && from != to, "send_bytes from rank ", from,
                  " to rank ", to, "; expected two different ranks of ", world);
  const std::uint64_t seq = issuer.log_call(progress::CollectiveKind::SendBytes, torch::Tensor());
  const int me = issuer.rank();
  if (me != from && me != to) return torch::Tensor();
  constexpr int kTag = 0x7e1b;  // this exchange's messages only
  auto exchange = [&](torch::Tensor tensor, std::uint64_t logged) {
    std::vector<torch::Tensor> tensors{std::move(tensor)};
    WorkHandle work = issuer.launched(logged, "send_bytes", [&] {
      return me == from ? issuer.native_checked()->send(tensors, to, kTag) : issuer.native_checked()->recv(tensors, from, kTag);
    });
    issuer.wait_point_to_point(work, "send_bytes");
  };
  if (me == from) {
    TRAINLOOP_CHECK(bytes.dim() == 1 && bytes.scalar_type() == torch::kUInt8 && bytes.device().is_cpu(),
                    "send_bytes sends 1-D uint8 bytes on the CPU; got ", c10::toString(bytes.scalar_type()), " ",
                    bytes.sizes(), " on ", bytes.device());
    exchange(torch::full({1}, bytes.numel(), torch::kInt64), seq);
    if (bytes.numel() > 0) exchange(bytes.contiguous(), 0);
    return torch::Tensor();
  }
  torch::Tensor length = torch::empty({1}, torch::kInt64);
  exchange(length, seq);
  torch::Tensor received = torch::empty({length.item<std::int64_t>()}, torch::kUInt8);
  if (received.numel() > 0) exchange(received, 0);
  return received;
}

}  // namespace trainloop::distributed
