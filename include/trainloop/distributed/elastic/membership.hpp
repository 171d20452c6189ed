#pragma once
/// @file
/// @brief Who is left after a rank was lost, agreed through the job's store: every survivor
/// reports itself and the last step it committed; old rank 0 (whose process holds the store: if
/// it is gone, so is the store, and the job ends named) decides once and writes the decision;
/// every survivor reads the same one. No collective: the group that lost the rank cannot run one.
///
/// Keys, all under `trainloop-elastic/g<generation>/` of the job's store (a generation per
/// group: the first is 0, each regroup the next; nothing of an older generation is read again):
/// - `who/<rank>`: "<owner tag>" of the rank's process, written when the generation's group forms
///   (detail/process_identity.hpp: pid, start time and machine, so a process of this machine is
///   judged alive or gone without waiting);
/// - `abandon`: set by the first survivor that sees a collective fail; every wait of the
///   generation's group asks for it (comm/abandonable_wait.hpp) and gives up;
/// - `alive/<rank>`: "<committed step>" of each survivor;
/// - `decision`: "<committed step> <holder> <all committed it: 0|1> <oldest reported step> <member>... ;
///   <lost rank>:<pid>:<cause>|...".
/// A rank that did not report is lost when its process is gone (same machine: at once) or, on
/// another machine, when `wait_for_remote` has passed without a word from it.

#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/store_text.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace trainloop::distributed::elastic {

/// One rank's place in a decision: its rank before the regroup.
struct LostRank {
  int rank = -1;         ///< its rank in the group that lost it
  long pid = 0;          ///< its process id (0 when unknown)
  std::string cause;     ///< why it counts as lost
};

/// What the survivors agreed.
struct Membership {
  std::int64_t committed_step = -1;  ///< the newest step a survivor committed (-1: none in this fit)
  int holder = -1;                   ///< the old rank that holds that step's state (lowest such)
  std::vector<int> members;          ///< old ranks that go on, in order: new rank i is members[i]
  std::vector<LostRank> lost;        ///< old ranks that do not
  bool all_committed = false;        ///< every member committed committed_step (none is a step behind)
  std::int64_t oldest_step = -1;     ///< the oldest step a survivor reported (sharded state: the step every one holds)
};

/// The store keys of one generation (see the file comment).
class GenerationKeys {
 public:
  /// The keys of generation `generation` (0: the job's first group).
  explicit GenerationKeys(int generation) : prefix_("trainloop-elastic/g" + std::to_string(generation) + "/") {}
  /// Rank `rank`'s process (its owner tag).
  std::string who(int rank) const { return prefix_ + "who/" + std::to_string(rank); }
  /// Rank `rank` reported alive after a loss, with its newest committed step.
  std::string alive(int rank) const { return prefix_ + "alive/" + std::to_string(rank); }
  /// Set when the group's collectives are to be abandoned.
  std::string abandon() const { return prefix_ + "abandon"; }
  /// Old rank 0's decision.
  std::string decision() const { return prefix_ + "decision"; }

 private:
  std::string prefix_;
};

namespace detail {


/// A zombie (ended, not yet reaped by its parent) counts as gone: process_alive() sees its /proc entry.
inline bool process_is_zombie(long pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto name_end = stat.rfind(')');
  return name_end != std::string::npos && name_end + 2 < stat.size() && stat[name_end + 2] == 'Z';
}

/// The pid in an owner tag ("<pid>-<start>-<domain>"), 0 when it does not parse.
inline long pid_of_tag(const std::string& tag) {
  try {
    return std::stol(tag.substr(0, tag.find('-')));
  } catch (const std::exception&) {
    return 0;
  }
}

inline std::string encode(const Membership& m) {
  std::ostringstream out;
  out << m.committed_step << ' ' << m.holder << ' ' << (m.all_committed ? 1 : 0) << ' ' << m.oldest_step;
  for (int rank : m.members) out << ' ' << rank;
  out << " ;";
  for (const auto& lost : m.lost) {
    std::string cause = lost.cause;
    std::replace(cause.begin(), cause.end(), '|', '/');
    out << lost.rank << ':' << lost.pid << ':' << cause << '|';
  }
  return out.str();
}

inline Membership decode(const std::string& text) {
  Membership m;
  const auto split = text.find(" ;");
  TRAINLOOP_CHECK(split != std::string::npos, "the elastic decision in the store is '", text,
                  "'; expected '<step> <holder> <all> <oldest> <members> ;<lost>'");
  std::istringstream head(text.substr(0, split));
  int all_committed = 0;
  head >> m.committed_step >> m.holder >> all_committed >> m.oldest_step;
  m.all_committed = all_committed != 0;
  for (int rank; head >> rank;) m.members.push_back(rank);
  std::string tail = text.substr(split + 2);
  for (std::size_t start = 0, end; (end = tail.find('|', start)) != std::string::npos; start = end + 1) {
    const std::string item = tail.substr(start, end - start);
    const auto a = item.find(':'), b = item.find(':', a + 1);
    LostRank lost;
    lost.rank = std::stoi(item.substr(0, a));
    lost.pid = std::stol(item.substr(a + 1, b - a - 1));
    lost.cause = item.substr(b + 1);
    m.lost.push_back(lost);
  }
  return m;
}

}  // namespace detail

/// Writes this process's owner tag for `rank` of generation `generation`'s group.
inline void publish_identity(::c10d::Store& store, const GenerationKeys& keys, int rank) {
  store.set(keys.who(rank), distributed::detail::store_bytes(::trainloop::detail::own_owner_tag()));
}

/// Asks every wait of this generation's group to give up (a collective failed here).
inline void request_abandon(::c10d::Store& store, const GenerationKeys& keys) {
  store.set(keys.abandon(), distributed::detail::store_bytes("1"));
}

/// Whether a survivor asked this generation's waits to give up (one store lookup).
inline bool abandon_requested(::c10d::Store& store, const GenerationKeys& keys) {
  return store.check({keys.abandon()});
}

/// Reports this rank as alive, with the last step it committed (-1: none in this fit).
inline void report_alive(::c10d::Store& store, const GenerationKeys& keys, int rank, std::int64_t committed_step) {
  store.set(keys.alive(rank), distributed::detail::store_bytes(std::to_string(committed_step)));
}

/// On old rank 0: waits until each of the `world` old ranks reported or is lost (see the file
/// comment), decides, writes the decision and returns it. `explain(rank)` words why a rank whose
/// process is gone was lost (its error file, when its launcher keeps one).
template <class Explain>
Membership decide_membership(::c10d::Store& store, const GenerationKeys& keys, int world,
                             std::chrono::milliseconds wait_for_remote, Explain&& explain) {
  const auto deadline = std::chrono::steady_clock::now() + wait_for_remote;
  std::map<int, std::int64_t> reported;
  std::map<int, LostRank> lost;
  while (static_cast<int>(reported.size() + lost.size()) < world) {
    for (int rank = 0; rank < world; ++rank) {
      if (reported.count(rank) || lost.count(rank)) continue;
      if (store.check({keys.alive(rank)})) {
        reported[rank] = std::stoll(distributed::detail::store_text(store.get(keys.alive(rank))));
        continue;
      }
      const std::string tag = store.check({keys.who(rank)}) ? distributed::detail::store_text(store.get(keys.who(rank))) : "";
      const long pid = detail::pid_of_tag(tag);
      if (!tag.empty() && (::trainloop::detail::owner_tag_is_dead(tag) || detail::process_is_zombie(pid))) {
        lost[rank] = LostRank{rank, pid, explain(rank)};
      } else if (std::chrono::steady_clock::now() >= deadline) {
        lost[rank] = LostRank{rank, pid, ::trainloop::detail::concat("no word from it within ", wait_for_remote.count(),
                                                                     " ms (another machine, or hung)")};
      }
    }
    if (static_cast<int>(reported.size() + lost.size()) < world) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Membership m;
  for (const auto& [rank, step] : reported) {
    m.members.push_back(rank);
    if (step > m.committed_step) {
      m.committed_step = step;
      m.holder = rank;
    }
  }
  if (m.holder < 0 && !m.members.empty()) m.holder = m.members.front();
  m.all_committed = std::all_of(reported.begin(), reported.end(), [&](const auto& entry) { return entry.second == m.committed_step; });
  m.oldest_step = m.committed_step;
  for (const auto& [rank, step] : reported) m.oldest_step = std::min(m.oldest_step, step);
  for (const auto& [rank, entry] : lost) m.lost.push_back(entry);
  store.set(keys.decision(), distributed::detail::store_bytes(detail::encode(m)));
  return m;
}

/// On every other survivor: the decision old rank 0 wrote (waits for it up to `timeout`).
/// @throws trainloop::CommunicationError when none comes (old rank 0, which holds the store, is lost).
inline Membership read_membership(::c10d::Store& store, const GenerationKeys& keys, std::chrono::milliseconds timeout) {
  try {
    store.wait({keys.decision()}, timeout);
    return detail::decode(distributed::detail::store_text(store.get(keys.decision())));
  } catch (const c10::Error& error) {
    throw CommunicationError(::trainloop::detail::concat(
        "trainloop: no decision on who goes on after a lost rank came from rank 0 within ", timeout.count(),
        " ms; rank 0's process holds the job's store, so it was lost too, and the job cannot go on (elastic "
        "training survives the loss of any rank but 0). Details: ", error.what_without_backtrace()));
  }
}

}  // namespace trainloop::distributed::elastic
