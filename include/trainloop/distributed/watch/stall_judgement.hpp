#pragma once
/// @file
/// @brief Who stalled, from the ranks' published records (rank_record.hpp): the rules the stall
/// watchdog applies, as functions of the records alone.
///
/// - A rank stale for its limit stalled when no rank is behind it (issued fewer collectives) and
///   another waits for it (issued more, or is blocked in a later collective); when every rank is
///   stuck at the same count, the lowest rank reports for all. With NCCL a waiting rank's host is
///   stuck too (in a synchronisation, not in the collective): the counts tell them apart.
/// - A rank blocked for twice the limit names from outside a rank that stopped publishing (frozen:
///   it may have issued the collective, but its process cannot take part; or it never published),
///   or one behind that is stalled by its own measure. One that is idle or in rank0_first
///   publishes a stale time of 0: it works as its program says.

#include <trainloop/distributed/watch/rank_record.hpp>

#include <functional>
#include <optional>
#include <vector>

namespace trainloop::distributed {

/// The ranks that wait for `own` (empty: every rank is stuck and `own` reports for all), when
/// `own`, stale for its limit, is a rank that stalled; nothing when it is not. `records` holds
/// every rank's published record, `own` included, by rank.
inline std::optional<std::vector<const RankRecord*>> ranks_waiting_for(const RankRecord& own,
                                                                      const std::vector<RankRecord>& records,
                                                                      int world_size) {
  std::vector<const RankRecord*> waiting;
  bool every_rank_stuck = static_cast<int>(records.size()) == world_size;
  for (const auto& r : records) {
    if (r.rank == own.rank) continue;
    if (r.issued < own.issued) return std::nullopt;  // a rank behind this one: the others wait for it
    if (r.issued > own.issued || r.waiting_seq > own.issued) waiting.push_back(&r);
    if (r.stale_seconds < r.limit_seconds && r.waiting_seq == 0) every_rank_stuck = false;
  }
  if (!waiting.empty() || (every_rank_stuck && own.rank == records.front().rank)) return waiting;
  return std::nullopt;
}

/// A rank named from outside by `own`, blocked for twice its limit, and for how long it has not
/// published.
struct UnresponsiveRank {
  RankRecord record;            ///< its last record (`missing` when it never published)
  double silent_seconds = 0.0;  ///< since its record last changed, as `own` saw it
};

/// The first rank holding up the collective `own` waits in (see the file comment), or nothing.
/// `silent_seconds(rank)` says how long that rank's record has not changed.
inline std::optional<UnresponsiveRank> unresponsive_rank(const RankRecord& own, const std::vector<RankRecord>& published,
                                                         int world_size,
                                                         const std::function<double(int)>& silent_seconds) {
  for (int rank = 0; rank < world_size; ++rank) {
    if (rank == own.rank) continue;
    UnresponsiveRank found;
    found.record.rank = rank;
    found.record.missing = true;
    for (const auto& record : published) {
      if (record.rank == rank) found.record = record;
    }
    const RankRecord& r = found.record;
    found.silent_seconds = silent_seconds(rank);
    const bool frozen = found.silent_seconds >= own.limit_seconds;
    if (frozen || (r.issued < own.waiting_seq && r.stale_seconds >= r.limit_seconds)) return found;
  }
  return std::nullopt;
}

}  // namespace trainloop::distributed
