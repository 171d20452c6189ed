#pragma once
/// @file
/// @brief How a replacement process asks to join a running elastic job, and how the job admits it,
/// through the job's store (the protocol; replacement_join.hpp forms the group with it).
///
/// Keys under `trainloop-elastic/join/` (one job: the launcher's store):
/// - `tickets`: a counter; a replacement takes the next ticket (`add`), then writes `<ticket>/who`
///   ("<its launcher rank> <owner tag>", so that rank 0 can tell it is still alive);
/// - `<ticket>/admitted`: rank 0's answer, `<generation> <rank> <world size> <step> <hand-off>` (the
///   step the group resumes from; the sharded hand-off's directory, or "-" when the state comes over
///   the new group);
/// - `closed`: rank 0 set it when the fit ended; a replacement still waiting then ends (exit 0);
/// - `admitting`: rank 0 sets it (to the number of the program's fit() call it trains, TRAINLOOP_FIT_INDEX)
///   at the fit's first commit when the job admits replacements: a machine's launcher that finds it
///   (and no `closed`) starts its ranks as replacements, a spare machine in place of a lost one
///   (replacement_join.hpp: running_fit_admits()).
/// `trainloop-elastic/g<generation>/grow` is rank 0's decision for the other members: whether the
/// state goes over the grown group (1) or every replacement reads it from this machine's memory
/// (0), then the tickets it admitted, in the order of their new ranks. Under the grown group's
/// generation, `formed/<member>` says whether each member formed it and `grown` is rank 0's verdict:
/// it goes on only when every member formed it (a replacement lost between its admission and the
/// group's rendezvous: the members form the group without it again).
///
/// Rank 0 looks for waiting replacements at each step's commit, at most every 100 ms (one store
/// round trip), and puts their number in its row of the commit (commit_record.hpp), so every rank
/// learns it at the same step and they agree without another collective.

#include <trainloop/detail/environment.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/store_text.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace trainloop::distributed::elastic {

/// Thrown by an engine at a step boundary when its ranks agreed at the last commit to admit
/// waiting replacements; the elastic fit (elastic_fit.hpp) catches it, grows the group and resumes.
class ReplacementsJoin : public std::exception {
 public:
  /// `waiting`: how many replacements rank 0 saw waiting at the commit.
  explicit ReplacementsJoin(std::int64_t waiting) : waiting_(waiting) {}
  /// How many replacements rank 0 saw waiting.
  std::int64_t waiting() const { return waiting_; }
  /// What it is (it is caught by the elastic fit, never shown).
  const char* what() const noexcept override {
    return "trainloop: replacements join at this step boundary (elastic training's signal; the elastic fit handles it)";
  }

 private:
  std::int64_t waiting_;
};

/// One replacement's request.
struct JoinRequest {
  std::int64_t ticket = 0;  ///< its place in the queue
  int launcher_rank = 0;    ///< the rank whose place its launcher gave it
  std::string owner;        ///< its owner tag (pid, start time, machine)
  /// Its pid, for the log.
  long pid() const { return std::atol(owner.substr(0, owner.find('-')).c_str()); }
  /// Whether it runs on this machine (and pid namespace): it can read this process's files in memory.
  bool on_this_machine() const {
    return owner.size() > 16 && owner.substr(owner.size() - 16) == ::trainloop::detail::pid_domain_tag();
  }
};

/// Where a replacement goes once admitted.
struct Admission {
  int generation = 0;    ///< the group's generation it joins
  int rank = 0;          ///< its rank there
  int world_size = 0;    ///< the group's size
  std::int64_t step = 0; ///< the step the group resumes from (its collectives until then are logged at it)
  std::string hand_off;  ///< the sharded hand-off's directory, empty when the state comes over the group
};

/// The store keys (see the file comment).
namespace join_keys {
/// The counter replacements take their tickets from.
inline std::string tickets() { return "trainloop-elastic/join/tickets"; }
/// Who holds ticket `ticket`: "<launcher rank> <owner tag>".
inline std::string who(std::int64_t ticket) { return "trainloop-elastic/join/" + std::to_string(ticket) + "/who"; }
/// Rank 0's answer to ticket `ticket`.
inline std::string admitted(std::int64_t ticket) { return "trainloop-elastic/join/" + std::to_string(ticket) + "/admitted"; }
/// Set when the fit ended: replacements still waiting end.
inline std::string closed() { return "trainloop-elastic/join/closed"; }
/// Set by rank 0 while the fit admits replacements: the number of the program's fit() call it trains.
inline std::string admitting() { return "trainloop-elastic/join/admitting"; }
/// Rank 0's decision for the members of generation `generation`.
inline std::string grow(int generation) { return "trainloop-elastic/g" + std::to_string(generation) + "/grow"; }
/// Whether member `rank` formed the grown group of generation `generation` ("1", or "0 <why not>").
inline std::string formed(int generation, int rank) {
  return "trainloop-elastic/g" + std::to_string(generation) + "/formed/" + std::to_string(rank);
}
/// Rank 0's verdict on the grown group of generation `generation`: "1" (it goes on) or "0 <why not>".
inline std::string verdict(int generation) { return "trainloop-elastic/g" + std::to_string(generation) + "/grown"; }
}  // namespace join_keys

/// Rank 0's view of the queue (see the file comment).
class JoinWatch {
 public:
  /// How many live replacements wait, in ticket order; looks at the store at most every 100 ms.
  /// `committed_step`: the step being committed (the test hook `TRAINLOOP_TEST_AWAIT_REPLACEMENT=<step>[,<step>...]`
  /// admits at those steps only, waiting at each up to two minutes until one asks: tests then know
  /// where it joins).
  std::int64_t waiting(::c10d::Store& store, std::int64_t committed_step) {
    if (!announced_) {  // a spare machine's launcher looks for it (see the file comment)
      const char* fit = std::getenv(env_names::fit_index);
      store.set(join_keys::admitting(), distributed::detail::store_bytes(fit != nullptr && *fit != '\0' ? fit : "1"));
      announced_ = true;
    }
    const auto now = std::chrono::steady_clock::now();
    const std::vector<std::int64_t>& holds = test_hold_steps();
    const bool hold = std::find(holds.begin(), holds.end(), committed_step) != holds.end();
    if (!holds.empty() && !hold) return 0;
    if (!hold && now - checked_ < kInterval) return static_cast<std::int64_t>(ready_.size());
    checked_ = now;
    look(store);
    const auto deadline = now + std::chrono::minutes(2);
    while (hold && ready_.empty() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      look(store);
    }
    return static_cast<std::int64_t>(ready_.size());
  }

  /// The first `count` replacements that wait and are still alive; every ticket up to the last one
  /// looked at is decided (taken, or passed over because its process is gone).
  std::vector<JoinRequest> take(::c10d::Store& store, std::int64_t count) {
    look(store);
    std::vector<JoinRequest> taken;
    for (const JoinRequest& request : ready_) {
      if (static_cast<std::int64_t>(taken.size()) == count) break;
      taken.push_back(request);
      next_ = request.ticket + 1;
    }
    ready_.clear();
    checked_ = {};
    return taken;
  }

 private:
  static constexpr std::chrono::milliseconds kInterval{100};

  static const std::vector<std::int64_t>& test_hold_steps() {
    static const std::vector<std::int64_t> steps = [] {
      std::vector<std::int64_t> listed;
      const char* text = std::getenv("TRAINLOOP_TEST_AWAIT_REPLACEMENT");
      for (std::istringstream in(text == nullptr ? "" : text); in.good();) {
        std::string step;
        std::getline(in, step, ',');
        if (!step.empty()) {
          listed.push_back(::trainloop::detail::parse_integer(step, "TRAINLOOP_TEST_AWAIT_REPLACEMENT's step", 1,
                                                              std::numeric_limits<long>::max()));
        }
      }
      return listed;
    }();
    return steps;
  }

  /// The live requests from the first undecided ticket on (up to the first whose process has not
  /// written its owner yet); tickets of processes that are gone are decided: passed over.
  void look(::c10d::Store& store) {
    ready_.clear();
    const std::int64_t tickets = store.add(join_keys::tickets(), 0);
    for (std::int64_t ticket = next_; ticket < tickets; ++ticket) {
      if (!store.check({join_keys::who(ticket)})) break;
      std::istringstream who(distributed::detail::store_text(store.get(join_keys::who(ticket))));
      JoinRequest request;
      request.ticket = ticket;
      who >> request.launcher_rank >> request.owner;
      if (::trainloop::detail::owner_tag_is_dead(request.owner)) {
        if (ready_.empty()) next_ = ticket + 1;
        continue;
      }
      ready_.push_back(request);
    }
  }

  bool announced_ = false;  // join_keys::admitting() is set
  std::int64_t next_ = 0;  // the first ticket not decided
  std::vector<JoinRequest> ready_;
  std::chrono::steady_clock::time_point checked_{};
};

/// Rank 0's decision on admitting replacements (see the file comment).
struct GrowDecision {
  std::vector<JoinRequest> joined;  ///< the replacements admitted, in the order of their new ranks
  bool over_group = false;          ///< the state goes to them over the grown group (else each reads its hand-off)
};

/// On rank 0: admits `joining` into generation `generation` + 1 of `old_world` + their number
/// ranks (they take the ranks after the members'), resuming from `step`, telling each where the
/// state is (`hand_offs[i]` for `joining[i]`, all empty: over the group), and writes the decision
/// for the other members.
inline void write_admissions(::c10d::Store& store, int generation, int old_world, const std::vector<JoinRequest>& joining,
                             std::int64_t step, const std::vector<std::string>& hand_offs) {
  TRAINLOOP_CHECK(hand_offs.size() == joining.size(), "admitting ", joining.size(), " replacements with ", hand_offs.size(),
                  " hand-offs; expected one each");
  const bool over_group = !hand_offs.empty() && hand_offs.front().empty();
  std::ostringstream decision;
  decision << (over_group ? 1 : 0) << ' ';
  for (std::size_t i = 0; i < joining.size(); ++i) {
    const std::string& hand_off = hand_offs[i];
    store.set(join_keys::admitted(joining[i].ticket),
              distributed::detail::store_bytes(::trainloop::detail::concat(generation + 1, ' ', old_world + static_cast<int>(i), ' ',
                                                           old_world + static_cast<int>(joining.size()), ' ', step, ' ',
                                                           hand_off.empty() ? std::string("-") : hand_off)));
    decision << joining[i].ticket << ' ' << joining[i].launcher_rank << ' ' << joining[i].owner << ' ';
  }
  store.set(join_keys::grow(generation), distributed::detail::store_bytes(decision.str()));
}

/// On the other members: rank 0's decision for generation `generation` (waits up to `timeout`).
/// @throws trainloop::CommunicationError when none comes (rank 0 lost).
inline GrowDecision read_admissions(::c10d::Store& store, int generation, std::chrono::milliseconds timeout) {
  try {
    store.wait({join_keys::grow(generation)}, timeout);
  } catch (const c10::Error& error) {
    throw CommunicationError(::trainloop::detail::concat("trainloop: rank 0's decision on the replacements joining did not "
                                                         "come within ", timeout.count(), " ms: ", error.what_without_backtrace()));
  }
  std::istringstream decision(distributed::detail::store_text(store.get(join_keys::grow(generation))));
  GrowDecision grow;
  int over_group = 0;
  decision >> over_group;
  grow.over_group = over_group != 0;
  for (JoinRequest request; decision >> request.ticket >> request.launcher_rank >> request.owner;) grow.joined.push_back(request);
  return grow;
}

/// Waits up to `timeout` for `key` (polled: the store's blocking wait would hold its client from the
/// other threads of this process) and returns its text.
/// @throws trainloop::CommunicationError naming `what` when it does not come.
inline std::string wait_for_key(::c10d::Store& store, const std::string& key, std::chrono::milliseconds timeout,
                                const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
    while (!store.check({key})) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw CommunicationError(::trainloop::detail::concat("trainloop: ", what, " did not come within ", timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return distributed::detail::store_text(store.get(key));
  } catch (const c10::Error& error) {
    throw CommunicationError(::trainloop::detail::concat("trainloop: the job's store went away while waiting for ", what,
                                                         " (rank 0, whose process holds it, is gone): ",
                                                         error.what_without_backtrace()));
  }
}

namespace detail {

/// What a "1" (yes) or "0 <why not>" word in the store says: empty for yes, else why not.
inline std::string why_not(const std::string& word) {
  if (word == "1") return std::string();
  return word.size() > 2 ? word.substr(2) : std::string("no reason");
}

}  // namespace detail

/// Rank 0's verdict on the grown group of generation `generation` (agree_on_growth): the empty
/// string when it goes on, else why not.
inline std::string verdict_of_growth(::c10d::Store& store, int generation, std::chrono::milliseconds timeout) {
  return detail::why_not(wait_for_key(store, join_keys::verdict(generation), timeout, "rank 0's verdict on the grown group"));
}

/// Every member's part in deciding whether the grown group of generation `generation` goes on:
/// member `rank` of the `members` before it says whether it formed that group (`failure`: why
/// not; empty when it did); rank 0 waits for every member's word and writes the verdict, which
/// every member (and every replacement: verdict_of_growth) reads. The group goes on only when
/// every member formed it. @return the empty string when it goes on, else why not.
inline std::string agree_on_growth(::c10d::Store& store, int generation, int rank, int members, const std::string& failure,
                                   std::chrono::milliseconds timeout) {
  store.set(join_keys::formed(generation, rank), distributed::detail::store_bytes(failure.empty() ? "1" : "0 " + failure));
  if (rank == 0) {
    std::string first_failure;
    for (int member = 0; member < members; ++member) {
      const std::string why = detail::why_not(wait_for_key(store, join_keys::formed(generation, member), timeout,
                                                           ::trainloop::detail::concat("member ", member, "'s word on the grown group")));
      if (!why.empty() && first_failure.empty()) first_failure = ::trainloop::detail::concat("rank ", member, ": ", why);
    }
    store.set(join_keys::verdict(generation), distributed::detail::store_bytes(first_failure.empty() ? "1" : "0 " + first_failure));
  }
  return verdict_of_growth(store, generation, timeout);
}

/// In a replacement: takes a ticket and says who asks. @return the ticket.
inline std::int64_t ask_to_join(::c10d::Store& store, int launcher_rank) {
  const std::int64_t ticket = store.add(join_keys::tickets(), 1) - 1;
  const std::string who = ::trainloop::detail::concat(launcher_rank, ' ', ::trainloop::detail::own_owner_tag());
  store.set(join_keys::who(ticket), distributed::detail::store_bytes(who));
  return ticket;
}

/// In a replacement: waits until rank 0 admits ticket `ticket` (nothing when the fit ended first).
/// No limit: the survivors admit it at their next step boundary inside an epoch, which a long
/// evaluation may put minutes away. A store that went away ends the wait as a closed fit does:
/// rank 0's process ended (the job is over, or its launcher is ending it, rank 0 lost).
inline std::optional<Admission> wait_for_admission(::c10d::Store& store, std::int64_t ticket) {
  for (;;) {
    bool admitted = false;
    try {
      admitted = store.check({join_keys::admitted(ticket)});
      if (!admitted && store.check({join_keys::closed()})) return std::nullopt;
    } catch (const std::exception&) {
      return std::nullopt;  // rank 0's process, which holds the store, ended: the job is over (or its launcher ends it)
    }
    if (admitted) {
      std::istringstream answer(distributed::detail::store_text(store.get(join_keys::admitted(ticket))));
      Admission admission;
      answer >> admission.generation >> admission.rank >> admission.world_size >> admission.step >> admission.hand_off;
      TRAINLOOP_CHECK(!answer.fail() && admission.world_size > admission.rank && admission.rank > 0,
                      "the admission of replacement ticket ", ticket, " in the store is malformed; expected "
                      "'<generation> <rank> <world size> <step> <hand-off>'");
      if (admission.hand_off == "-") admission.hand_off.clear();
      return admission;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

/// On rank 0 when its fit ended: replacements still waiting end.
inline void close_admissions(::c10d::Store& store) { store.set(join_keys::closed(), distributed::detail::store_bytes("1")); }

}  // namespace trainloop::distributed::elastic
