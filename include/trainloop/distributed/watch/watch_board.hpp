#pragma once
/// @file
/// @brief trainloop::distributed::WatchBoard: where the ranks' stall watchdogs meet — each rank's
/// record (rank_record.hpp) and the first verdict, in the job's store under the process group's
/// prefix + "/watch". Its own TCPStore client, so the watchdog never waits behind the backend's use
/// of the store (NCCL's communicator set-up), and one mutex so the watchdog's thread and a failing
/// collective's explainer can share it.

#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/comm/store_text.hpp>
#include <trainloop/distributed/watch/rank_record.hpp>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace trainloop::distributed {

/// @brief A rank's verdict as the others read it: the error it ends with (its type tells a stall
/// from a desync, not its wording) and its report's first line.
struct WatchVerdict {
  std::string type;      ///< "trainloop::StallError" or "trainloop::DesyncError"
  std::string headline;  ///< the report's first line
};

/// The ranks' records and the verdict, in the job's store.
class WatchBoard {
 public:
  /// Connects a client of the store `group_options` names (also on the rank that hosts it).
  explicit WatchBoard(const ProcessGroupOptions& group_options) {
    ProcessGroupOptions client = group_options;
    client.is_store_server = false;
    client.timeout = std::min<std::chrono::milliseconds>(group_options.timeout, std::chrono::seconds(60));
    store_ = c10::make_intrusive<::c10d::PrefixStore>(group_options.store_prefix + "/watch", connect_store(client));
  }

  /// Publishes `record` as its rank's.
  void publish(const RankRecord& record) {
    const std::string text = record.to_text();
    std::lock_guard<std::mutex> lock(mutex_);
    store_->set(key(record.rank), detail::store_bytes(text));
  }
  /// Rank `rank`'s last record, if it published one.
  std::optional<RankRecord> read(int rank) {
    std::optional<std::string> text = get_if_set(key(rank));
    return text ? RankRecord::parse(*text) : std::nullopt;
  }
  /// The first verdict a rank left, if any.
  std::optional<WatchVerdict> verdict() {
    const std::optional<std::string> text = get_if_set("verdict");
    if (!text) return std::nullopt;
    const auto newline = text->find('\n');  // "<error type>\n<headline>"
    if (newline == std::string::npos) return WatchVerdict{"trainloop::StallError", *text};
    return WatchVerdict{text->substr(0, newline), text->substr(newline + 1)};
  }
  /// The record of a rank (other than `rank` of `world_size`) whose collective numbered
  /// `mine.seq` is not `mine`, if one is found. The others publish within `period`; a rank that
  /// never issued that collective (it died, or is behind) is no mismatch. Reads at once, then after
  /// 0.1 s, 0.3 s and a period at most.
  std::optional<RankRecord> find_other_call(int rank, int world_size, const progress::CollectiveCall& mine,
                                            std::chrono::milliseconds period) {
    const auto started = std::chrono::steady_clock::now();
    for (const auto pause : {std::chrono::milliseconds(0), std::chrono::milliseconds(100), std::chrono::milliseconds(200),
                             period}) {
      std::this_thread::sleep_for(pause);
      bool every_rank_seen = true;
      for (int r = 0; r < world_size; ++r) {
        if (r == rank) continue;
        auto other = read(r);
        if (!other || other->issued < mine.seq) {
          every_rank_seen = false;
          continue;
        }
        if (const auto* theirs = other->call(mine.seq); theirs != nullptr && !theirs->matches(mine)) return other;
      }
      if (every_rank_seen || std::chrono::steady_clock::now() - started > period + std::chrono::milliseconds(400)) break;
    }
    return std::nullopt;
  }
  /// Leaves `verdict` unless another rank left one first.
  void leave_verdict(const WatchVerdict& verdict) {
    const std::string text = verdict.type + "\n" + verdict.headline;
    std::lock_guard<std::mutex> lock(mutex_);
    if (store_->add("verdicts", 1) == 1) store_->set("verdict", detail::store_bytes(text));
  }

 private:
  static std::string key(int rank) { return "rank" + std::to_string(rank); }
  std::optional<std::string> get_if_set(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!store_->check({name})) return std::nullopt;
    return detail::store_text(store_->get(name));
  }

  std::mutex mutex_;
  c10::intrusive_ptr<::c10d::Store> store_;
};

}  // namespace trainloop::distributed
