#define BOOST_TEST_MODULE test_elastic
#include "unit_test.hpp"

#include "test_paths.hpp"

// Elastic training (distributed/elastic/, docs/elastic.md): a rank killed (SIGKILL, by the test hook
// TRAINLOOP_TEST_KILL_AT) at a chosen step and phase, and the job goes on with the survivors and ends
// with exit status 0 — with the parameters, the optimizer's effect and every epoch's sample count and
// loss of a run that changed its world size at the same step on purpose (a checkpoint of that step
// resumed on fewer ranks), bit for bit on the CPU. Losing rank 0 (which holds the store) ends the job
// named, as without elastic training. ddp_worker's "ckpt" scenario: batch 4 per rank, shuffled, SGD
// with momentum, 60 samples (5 steps an epoch on 3 ranks, 8 on 2).

#include "ddp_test_support.hpp"
#include "two_node_network.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace {

constexpr int kSamples = 60;
constexpr int kEpochs = 2;

std::string common_settings() {
  return "TL_TEST_EPOCHS=" + std::to_string(kEpochs) + " TL_TEST_TRAIN_SAMPLES=" + std::to_string(kSamples) + " ";
}

/// The checkpoint ModelCheckpoint writes after global step `step` (5 steps per epoch on 3 ranks,
/// 10 on 2: the epochs before the resume decide the name's epoch).
fs::path checkpoint_after(const fs::path& dir, int step, int steps_per_epoch) {
  char name[64];
  std::snprintf(name, sizeof name, "epoch=%04d-step=%06d.ckpt", (step - 1) / steps_per_epoch + 1, step);
  return dir / name;
}

/// The step the survivors resumed from, as the main process's line says ("from step C held by").
int resumed_from_step(const std::string& output) {
  std::smatch match;
  static const std::regex pattern("lost at step ([0-9]+): .*from step ([0-9]+) held by rank");
  BOOST_REQUIRE_MESSAGE(std::regex_search(output, match, pattern), output);
  return std::stoi(match[2]);
}

/// The elastic run ended as the deliberate one: the same parameters bit for bit, every sample of
/// every epoch counted once, each epoch's loss and accuracy and the last validation loss exactly
/// the deliberate run's.
void expect_same_end(const std::string& name, WorkerRun& elastic, WorkerRun& deliberate) {
  const torch::Tensor ended = load_params((elastic.dir / "params.pt").string());
  const torch::Tensor changed = load_params((deliberate.dir / "params.pt").string());
  BOOST_TEST_MESSAGE(name << ": max |elastic - deliberate| = " << (ended - changed).abs().max().item<double>());
  BOOST_TEST(torch::equal(ended, changed), name << ": the parameters differ from the deliberate world-size change");
  int epoch = 1;  // every epoch the deliberate run trained (kEpochs, or what a case's TL_TEST_EPOCHS asks)
  for (; deliberate.result.count("epoch" + std::to_string(epoch) + "_samples") != 0; ++epoch) {
    const std::string key = "epoch" + std::to_string(epoch);
    BOOST_TEST(elastic.result[key + "_samples"] == kSamples, name << " " << key);
    BOOST_TEST(elastic.result[key + "_loss"] == deliberate.result[key + "_loss"], name << " " << key);
    BOOST_TEST(elastic.result[key + "_accuracy"] == deliberate.result[key + "_accuracy"], name << " " << key);
  }
  BOOST_TEST(epoch > kEpochs, name << ": the deliberate run reported " << epoch - 1 << " epochs");
  BOOST_TEST(elastic.result["val_loss"] == deliberate.result["val_loss"]);
}

/// Runs ddp_worker with `world` ranks, elastic, one rank killed as `kill` says (rank:step:phase),
/// then the deliberate reference: `world` ranks writing a checkpoint every step, that step's
/// checkpoint resumed on `survivors` ranks (0: world-1). Both must end alike, bit for bit. `mode` (a sharding
/// level) applies to all three runs, `extra` to the elastic one. Returns the elastic run's output.
std::string lost_rank_equals_deliberate_change(const std::string& name, int world, const std::string& kill,
                                        const std::string& extra = "", const std::string& mode = "",
                                        const std::vector<std::string>& expected_in_log = {}, int survivors = 0) {
  if (survivors == 0) survivors = world - 1;
  const fs::path dir = fresh_dir("elastic_" + name);
  WorkerRun elastic = run_worker("ckpt", world, 0,
                                 common_settings() + mode + extra + "TL_TEST_ELASTIC=1 TL_TEST_CKPT_DIR=" + (dir / "elastic").string() +
                                     " TRAINLOOP_TEST_KILL_AT=" + kill,
                                 "_elastic_" + name);
  BOOST_TEST_MESSAGE(name << ": " << elastic.output);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output);
  BOOST_TEST(elastic.output.find("continuing with " + std::to_string(world - 1) + " rank") != std::string::npos);
  for (const std::string& expected : expected_in_log) BOOST_TEST(elastic.output.find(expected) != std::string::npos, expected);
  BOOST_TEST(leftover_workers() == 0);
  const int committed = resumed_from_step(elastic.output);

  WorkerRun before = run_worker("ckpt", world, 0,
                                common_settings() + mode + "TL_TEST_EVERY_STEPS=1 TL_TEST_CKPT_DIR=" + (dir / "before").string(),
                                "_before_" + name);
  BOOST_REQUIRE_MESSAGE(before.exit_code == 0, before.output);
  const fs::path resumed_checkpoint = checkpoint_after(dir / "before", committed, (kSamples + 4 * world - 1) / (4 * world));
  BOOST_REQUIRE_MESSAGE(fs::exists(resumed_checkpoint), resumed_checkpoint.string());
  WorkerRun after = run_worker("ckpt", survivors, 0,
                               common_settings() + mode + "TL_TEST_CKPT_DIR=" + (dir / "after").string() +
                                   " TL_TEST_RESUME=" + resumed_checkpoint.string(),
                               "_after_" + name);
  BOOST_REQUIRE_MESSAGE(after.exit_code == 0, after.output);

  BOOST_TEST_MESSAGE(name << ": resumed from step " << committed);
  expect_same_end(name, elastic, after);
  for (auto* run : {&elastic, &before, &after}) fs::remove_all(run->dir);
  fs::remove_all(dir);
  return elastic.output;
}

/// Runs ddp_worker with 3 ranks, elastic, rank 2 killed in its forward of step 3, and its
/// replacement admitted at the commit of step 5 (TRAINLOOP_TEST_AWAIT_REPLACEMENT holds rank 0
/// there until it asks): the job goes on with 2 ranks from step 2, and with 3 again from step 5.
/// The deliberate reference changes its world size at the same steps on purpose: 3 ranks writing
/// a checkpoint every step, step 2's resumed on 2 ranks writing one every step, step 5's resumed on
/// 3. Both must end alike, bit for bit. `mode` (a sharding level) applies to every run.
void replacement_equals_deliberate_changes(const std::string& name, const std::string& mode) {
  const fs::path dir = fresh_dir("elastic_join_" + name);
  WorkerRun elastic = run_worker("ckpt", 3, 0,
                                 common_settings() + mode + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_CKPT_DIR=" +
                                     (dir / "elastic").string() +
                                     " TRAINLOOP_TEST_KILL_AT=2:3:forward TRAINLOOP_TEST_AWAIT_REPLACEMENT=5",
                                 "_join_" + name);
  BOOST_TEST_MESSAGE(name << ": " << elastic.output);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output);
  BOOST_TEST(resumed_from_step(elastic.output) == 2);
  BOOST_TEST(elastic.output.find("started a replacement for rank 2") != std::string::npos, elastic.output);
  BOOST_TEST(elastic.output.find("joined at step 6 as rank 2; continuing with 3 ranks") != std::string::npos, elastic.output);
  BOOST_TEST(leftover_workers() == 0);

  auto run = [&](const std::string& part, int world, const std::string& settings) {
    WorkerRun result = run_worker("ckpt", world, 0, common_settings() + mode + "TL_TEST_CKPT_DIR=" + (dir / part).string() + settings,
                                  "_join_" + part + "_" + name);
    BOOST_REQUIRE_MESSAGE(result.exit_code == 0, result.output);
    return result;
  };
  WorkerRun before = run("before", 3, " TL_TEST_EVERY_STEPS=1");
  const fs::path step2 = checkpoint_after(dir / "before", 2, 5);
  WorkerRun middle = run("middle", 2, " TL_TEST_EVERY_STEPS=1 TL_TEST_RESUME=" + step2.string());
  const fs::path step5 = checkpoint_after(dir / "middle", 5, 8);
  BOOST_REQUIRE_MESSAGE(fs::exists(step5), step5.string());
  WorkerRun after = run("after", 3, " TL_TEST_RESUME=" + step5.string());

  expect_same_end(name, elastic, after);
  for (auto* worker : {&elastic, &before, &middle, &after}) fs::remove_all(worker->dir);
  fs::remove_all(dir);
}

/// Hand-off files left in /dev/shm by this test's jobs (none may stay).
int hand_off_files_left() {
  int count = 0;
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator("/dev/shm", ignored)) {
    count += entry.path().filename().string().rfind("trainloop-elastic-", 0) == 0 ? 1 : 0;
  }
  return count;
}

}  // namespace

BOOST_AUTO_TEST_CASE(three_ranks_lose_one_in_its_forward_and_end_as_two_would_from_that_step) {
  // With a BatchNorm layer (TL_TEST_NORM): the survivors keep their weights and optimizer state in
  // memory (the hand-off holds the loop's state alone), and the running statistics their forward of
  // step 3 moved are put back as step 2 committed them.
  lost_rank_equals_deliberate_change("forward", 3, "2:3:forward", "", "TL_TEST_NORM=1 ");
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(three_ranks_lose_one_inside_a_gradient_all_reduce_and_redo_the_step) {
  // Step 7 is epoch 2's second step: the epoch's partial sums of all three ranks carry over.
  // The holder's state sent to the other survivor over the new group, as when they are a step apart.
  lost_rank_equals_deliberate_change("backward", 3, "1:7:backward", "TRAINLOOP_TEST_ELASTIC_SHARE=1 ");
}

BOOST_AUTO_TEST_CASE(two_ranks_lose_one_after_its_commit_and_the_last_goes_on_alone) {
  // Killed after the step's commit, before its optimizer step: the survivor holds that step or
  // the one before; the line names which, and the reference resumes from that one.
  lost_rank_equals_deliberate_change("optimizer", 2, "1:4:optimizer");
}

BOOST_AUTO_TEST_CASE(three_ranks_lose_one_inside_a_checkpoint_write) {
  lost_rank_equals_deliberate_change("checkpoint", 3, "2:4:checkpoint", "TL_TEST_EVERY_STEPS=2 ");
}

BOOST_AUTO_TEST_CASE(three_ranks_lose_one_in_the_validation_after_an_epoch) {
  // Step 5 ends epoch 1 on 3 ranks; rank 2 dies in the validation after it.
  lost_rank_equals_deliberate_change("evaluation", 3, "2:5:evaluation");
}

// Comm hooks: the bucket's collective in flight is the hook's (fp16: a cast and an all-reduce on the
// reducer's communication thread). The regrouped fit makes a fresh hook, as a checkpoint resumed
// with another world size starts one afresh (comm_hook_state.hpp), so the two still end alike.

BOOST_AUTO_TEST_CASE(three_ranks_with_an_fp16_comm_hook_lose_one_inside_the_hooks_all_reduce) {
  lost_rank_equals_deliberate_change("fp16_hook", 3, "1:7:backward", "", "TL_TEST_COMM_HOOK=fp16 ");
}

BOOST_AUTO_TEST_CASE(three_ranks_with_powersgd_compressing_lose_one_and_its_state_starts_afresh_as_on_a_resume) {
  // PowerSGD compresses from its 11th step (rank 2 here; 4 epochs of 5 steps on 3 ranks): rank 1 dies in
  // step 13's backward, after two compressed steps whose error feedback the survivors leave behind, as
  // the deliberate run's 2 ranks leave the 3-rank checkpoint's.
  lost_rank_equals_deliberate_change("powersgd_hook", 3, "1:13:backward", "", "TL_TEST_COMM_HOOK=powersgd:2 TL_TEST_EPOCHS=4 ");
}

// Sharded state (docs/elastic.md): the lost rank's shards come from its neighbour's copy, every
// survivor's own from its copy of the same step; the survivors resume from that step on W-1 ranks.
// The deliberate runs train elastic too (nobody lost): an elastic group sums sharded gradients with
// an all-reduce, whose rounding on 3 ranks may differ from Gloo's reduce-scatter's.

BOOST_AUTO_TEST_CASE(three_ranks_at_sharding_full_lose_one_in_its_forward_and_end_as_two_would_from_that_step) {
  const std::string output =
      lost_rank_equals_deliberate_change("full_forward", 3, "2:3:forward", "", "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ");
  // The survivors' hand-off, kept for two commits, is removed by rank 0, not left to the launcher.
  BOOST_TEST(output.find("elastic hand-off file") == std::string::npos, output);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(three_ranks_with_zero1_lose_one_inside_a_gradient_all_reduce_inside_an_epoch) {
  lost_rank_equals_deliberate_change("optimizer_backward", 3, "1:7:backward", "", "TL_TEST_SHARDING=optimizer TL_TEST_ELASTIC=1 ");
}

BOOST_AUTO_TEST_CASE(two_ranks_at_sharding_gradients_lose_one_after_its_commit_and_the_last_goes_on_alone) {
  lost_rank_equals_deliberate_change("gradients_optimizer", 2, "1:4:optimizer", "", "TL_TEST_SHARDING=gradients TL_TEST_ELASTIC=1 ");
}

BOOST_AUTO_TEST_CASE(three_ranks_at_sharding_full_lose_one_inside_the_exchange_of_the_copies) {
  // Rank 2 dies with its copies of step 5 taken, before it sealed them in their file or told its
  // keeper: the keeper never gets them whole, so the survivors go on from step 4's or step 3's
  // copies, whichever every one of them holds.
  lost_rank_equals_deliberate_change("full_share_copy", 3, "2:5:share-copy", "", "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ");
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_replacement_joins_and_the_job_ends_as_deliberate_world_size_changes_would) {
  // With a BatchNorm layer: the members keep their model in memory, the replacement reads rank 0's whole state.
  replacement_equals_deliberate_changes("replicated", "TL_TEST_NORM=1 ");
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_replacement_joins_a_job_at_sharding_full_from_the_members_copies) {
  replacement_equals_deliberate_changes("full", "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ");
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_replacement_the_fit_does_not_admit_ends_with_the_job) {
  // Admitted at step 1000 only, which never comes: it waits, the fit ends, and it ends with success.
  const fs::path dir = fresh_dir("elastic_join_unneeded");
  WorkerRun run = run_worker("ckpt", 3, 0,
                             common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_CKPT_DIR=" +
                                 (dir / "ckpt").string() + " TRAINLOOP_TEST_KILL_AT=2:3:forward TRAINLOOP_TEST_AWAIT_REPLACEMENT=1000",
                             "_join_unneeded");
  BOOST_TEST_MESSAGE(run.output);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.output.find("started a replacement for rank 2") != std::string::npos, run.output);
  BOOST_TEST(run.output.find("joined at step") == std::string::npos, run.output);
  BOOST_TEST(run.result["epoch2_samples"] == kSamples);
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
  fs::remove_all(dir);
}

namespace {

/// Runs 3 elastic ranks whose rank 2 dies in its forward of step 3, is replaced (admitted at the
/// commit of step 5: it joins at step 6), and its replacement dies in its forward of step 7; the
/// launcher may start `replacements` per place. Returns the run (removed by the caller).
WorkerRun replacement_lost_again(const std::string& name, int replacements) {
  const fs::path dir = fresh_dir("elastic_again_" + name);
  WorkerRun run = run_worker("ckpt", 3, 0,
                             common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=" + std::to_string(replacements) +
                                 " TL_TEST_CKPT_DIR=" + (dir / "ckpt").string() +
                                 " TRAINLOOP_TEST_KILL_AT=2:3:forward,2:7:forward TRAINLOOP_TEST_AWAIT_REPLACEMENT=5",
                             "_again_" + name);
  BOOST_TEST_MESSAGE(name << ": " << run.output);
  fs::remove_all(dir);
  return run;
}

/// How often `text` occurs in `output`.
int occurrences(const std::string& output, const std::string& text) {
  int count = 0;
  for (auto at = output.find(text); at != std::string::npos; at = output.find(text, at + 1)) ++count;
  return count;
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_replacement_that_dies_too_is_lost_as_any_rank_and_the_used_up_place_is_named) {
  // max_replacements 1: the place of rank 2 gets one replacement; when that one dies the others go
  // on with 2 ranks, every sample of both epochs counted once, and the launcher says why no third
  // process comes.
  WorkerRun run = replacement_lost_again("used_up", 1);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(occurrences(run.output, "started a replacement for rank 2") == 1, run.output);
  BOOST_TEST(run.output.find("joined at step 6 as rank 2; continuing with 3 ranks") != std::string::npos, run.output);
  BOOST_TEST(occurrences(run.output, "continuing with 2 ranks") == 2, run.output);
  BOOST_TEST(run.output.find("rank 2 was lost again and its 1 replacement is used up (max_replacements 1)") != std::string::npos,
             run.output);
  for (int epoch = 1; epoch <= kEpochs; ++epoch) BOOST_TEST(run.result["epoch" + std::to_string(epoch) + "_samples"] == kSamples);
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(with_two_replacements_a_place_lost_twice_gets_a_second_one) {
  // max_replacements 2: the second replacement is started; this job admits only at step 5 (the
  // test hook), so it waits and ends with the job, exit status 0.
  WorkerRun run = replacement_lost_again("second", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.output.find("1 of at most 2") != std::string::npos, run.output);
  BOOST_TEST(run.output.find("2 of at most 2") != std::string::npos, run.output);
  BOOST_TEST(occurrences(run.output, "continuing with 2 ranks") == 2, run.output);
  BOOST_TEST(run.output.find("used up") == std::string::npos, run.output);
  for (int epoch = 1; epoch <= kEpochs; ++epoch) BOOST_TEST(run.result["epoch" + std::to_string(epoch) + "_samples"] == kSamples);
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_replacement_lost_before_the_grown_group_forms_leaves_the_members_going_on_exactly) {
  // Rank 2 dies at step 3; its replacement is admitted at step 5's commit and dies before the grown
  // group's rendezvous (kill point `join`). The members stop waiting for it after elastic_wait (3 s
  // here), form their own group again and go on from step 5 as they were: the end equals 3 ranks
  // that became 2 at step 2 on purpose, bit for bit, and the hand-off link made for it is removed.
  lost_rank_equals_deliberate_change("join_lost", 3, "2:3:forward,2:6:join",
                                     "TL_TEST_REPLACEMENTS=1 TRAINLOOP_TEST_AWAIT_REPLACEMENT=5 TL_TEST_ELASTIC_WAIT_MS=3000 ", "",
                                     {"started a replacement for rank 2", "admitted at step 6 was lost before the grown group formed",
                                      "rank 2 was lost again and its 1 replacement is used up"});
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_second_loss_before_the_next_commit_resumes_from_the_same_step) {
  // Rank 2 dies inside the checkpoint write after step 2 (step 2 committed): ranks 0 and 1 go on
  // from step 2 with 2 ranks; rank 1 dies in its forward of step 3, before any step of the new
  // group is committed: rank 0 resumes from step 2 again (the hand-off it kept), alone — not from
  // the fit's start. The end equals 3 ranks that became 1 at step 2 on purpose, bit for bit.
  // With a BatchNorm layer: the hand-off kept is the loop's state alone, so rank 0's running statistics,
  // which its forward of step 3 moved, come back from memory as step 2 committed them. One thread in
  // every run: the survivor keeps the 3-rank job's thread count, and BatchNorm's sums round by it.
  lost_rank_equals_deliberate_change("second_loss", 3, "2:2:checkpoint,1:3:forward", "TL_TEST_EVERY_STEPS=1 ",
                                     "TL_TEST_NORM=1 OMP_NUM_THREADS=1 ",
                                     {"rank 1 (pid", "continuing with 1 rank (regrouped"}, 1);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_second_loss_before_the_copies_of_a_new_step_resumes_a_sharded_job_from_the_kept_hand_off) {
  // Sharding full: rank 2 dies in its forward of step 3; ranks 0 and 1 go on from step 2 (the copies)
  // with 2 ranks. Rank 1 dies in the 2-rank group's forward of step 3 (`@1`: the group's generation
  // after one regroup), before any copies of the new group's steps exist: rank 0 resumes from the
  // step 2 hand-off it kept, alone — not from the fit's start. The end equals 3 ranks that became 1
  // at step 2 on purpose, bit for bit, and the hand-off is gone from /dev/shm.
  const std::string output = lost_rank_equals_deliberate_change(
      "full_second_loss", 3, "2:3:forward,1:3:forward@1", "", "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ",
      {"rank 1 (pid", "lost at step 3", "continuing with 1 rank (regrouped", "from step 2 again: the hand-off every survivor kept since it"},
      1);
  // Rank 0 removed the kept hand-off itself (the launcher says when it has to remove what ranks left).
  BOOST_TEST(output.find("elastic hand-off file") == std::string::npos, output);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(two_neighbours_lost_at_once_end_a_sharded_job_named) {
  // Rank 1 kept rank 2's only copy: nothing can rebuild rank 2's shards.
  const fs::path dir = fresh_dir("elastic_neighbours");
  WorkerRun run = run_worker("ckpt", 3, 0,
                             common_settings() + "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 TL_TEST_CKPT_DIR=" +
                                 (dir / "ckpt").string() + " TRAINLOOP_TEST_KILL_AT=1:3:forward,2:3:forward",
                             "_elastic_neighbours");
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code != 0);
  BOOST_TEST(run.output.find("kept the only copy of its shards") != std::string::npos, run.output);
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_rank_lost_before_the_group_forms_ends_the_elastic_job_at_once_named) {
  // Rank 1's program fails before fit() (it never joins the group): elastic training goes on only
  // from a formed group, so the job ends as without it — rank 1 and its error named, at once, no
  // replacement started. Before, the launcher let the others go on, and rank 0 waited for rank 1 in
  // the group's rendezvous until the timeout (20 s in ddp_worker; 10 minutes by default), then failed
  // naming its own timeout (seen on a GPU machine: a rank given a device it does not have).
  auto run = run_worker("throw_before_fit", 2, 0, "TL_TEST_ELASTIC=1");
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.seconds < 15.0);
  BOOST_TEST(run.output.find("rank 1 failed: rank 1 could not open its shard of the data") != std::string::npos, run.output);
  BOOST_TEST(run.output.find("was lost before the job's group formed; elastic training goes on only from a formed group") !=
             std::string::npos, run.output);
  BOOST_TEST(run.output.find("started a replacement") == std::string::npos, run.output);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(losing_rank_zero_ends_the_job_named_and_leaves_nothing) {
  // Rank 0's process holds the job's store: nothing can agree without it.
  const fs::path dir = fresh_dir("elastic_rank0");
  WorkerRun run = run_worker("ckpt", 3, 0,
                             common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_CKPT_DIR=" + (dir / "ckpt").string() +
                                 " TRAINLOOP_TEST_KILL_AT=0:3:forward",
                             "_elastic_rank0");
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.output.find("RANK_FAILED rank=0") != std::string::npos, run.output);
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(hand_off_files_left() == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
  fs::remove_all(dir);
}

// ---- Several machines ------------------------------------------------------------------------
// Two "machines" (two_node_network.hpp): each node of ddp_worker runs in its own network
// namespace, with its own host name and its own /dev/shm, so no machine can read another's
// hand-off: what crosses machines goes over the group. A rank on the other machine is judged lost
// after elastic_wait (3 s here) without a word.

namespace {

/// The output, exit statuses, results and hand-off files left of a 2-node elastic job.
struct TwoMachineRun {
  int exit_code = -1;                           ///< both nodes' summed
  int node_exit_code[2] = {-1, -1};             ///< each node's
  std::string output[2];                        ///< each node's
  std::map<std::string, double> result;         ///< node 0's caller's result file
  fs::path params[2];                           ///< each node's caller's trained parameters
  int left[2] = {-1, -1};                       ///< elastic files left in each machine's /dev/shm
};

/// A spare machine 1 (run_two_machines): the same command again on machine 1 with `settings`,
/// after machine 1's first command ended (it was lost whole), or `beside` it once the shell
/// condition `waits_for` holds (a standby while machine 1's ranks are alive).
struct SpareMachine {
  std::string settings;
  bool beside = false;
  std::string waits_for;
};

/// Runs ddp_worker's "ckpt" scenario as 2 machines of `per_node` ranks each (both nodes' ranks
/// numbered node * per_node + local rank), with `settings` (and `node1_settings` on machine 1); its
/// checkpoints in `dir`/ckpt. With `spare`, machine 1 runs the same command again (SpareMachine),
/// with the spare's settings instead of `node1_settings` (its log after the first's in the output;
/// machine 1's exit status is the spare's).
TwoMachineRun run_two_machines(trainloop_test::TwoNodeNetwork& network, const fs::path& dir, int per_node,
                               const std::string& settings, const std::string& node1_settings = "",
                               const std::optional<SpareMachine>& spare = std::nullopt) {
  std::string nodes[2];
  for (int node = 0; node < 2; ++node) {
    const fs::path out = dir / ("node" + std::to_string(node));
    fs::create_directories(out / "tmp");
    const std::string log = (dir / ("node" + std::to_string(node) + ".log")).string();
    auto command = [&](const std::string& own_settings, const std::string& to) {
      return "env TMPDIR=" + (out / "tmp").string() + " " + network.node_env(node) + " " + settings + " " + own_settings +
             " TL_TEST_CKPT_DIR=" + (dir / "ckpt").string() + " " + test_program("ddp_worker") + " ckpt " +
             std::to_string(per_node) + " " + out.string() + " 29731 > " + to + " 2>&1";
    };
    std::string commands = command(node == 1 ? node1_settings : "", log);
    if (node == 1 && spare) {
      const std::string started_spare = (spare->waits_for.empty() ? "" : "until " + spare->waits_for + "; do sleep 0.05; done; ") +
                                        command(spare->settings, log + ".spare");
      commands = spare->beside ? "(" + commands + ") & (" + started_spare + "); s=$?; wait; (exit $s)"
                               : "(" + commands + "); " + started_spare;
    }
    nodes[node] = network.machine(node, commands, dir / ("left" + std::to_string(node)));
  }
  auto [status, shell_output] =
      trainloop_test::shell("(" + nodes[0] + " & " + nodes[1] + "; s1=$?; wait %1; s0=$?; echo \"exit statuses $s0 $s1\")");
  TwoMachineRun run;
  std::smatch statuses;
  const bool ended = status == 0 && std::regex_search(shell_output, statuses, std::regex("exit statuses ([0-9]+) ([0-9]+)"));
  run.node_exit_code[0] = ended ? std::stoi(statuses[1]) : -1;
  run.node_exit_code[1] = ended ? std::stoi(statuses[2]) : -1;
  run.exit_code = ended ? run.node_exit_code[0] + run.node_exit_code[1] : -1;
  for (int node = 0; node < 2; ++node) {
    for (const std::string suffix : {".log", ".log.spare"}) {
      std::ifstream log(dir / ("node" + std::to_string(node) + suffix));
      run.output[node].append(std::istreambuf_iterator<char>(log), std::istreambuf_iterator<char>());
    }
    run.params[node] = dir / ("node" + std::to_string(node)) / "params.pt";
    std::ifstream left(dir / ("left" + std::to_string(node)));
    left >> run.left[node];
  }
  run.output[0] += shell_output;
  run.result = read_result(dir / "node0" / "result.txt");
  return run;
}

/// The two-machine run ended as the deliberate one on one machine (`deliberate`): both machines'
/// callers hold its parameters bit for bit, every sample of every epoch counted once, each epoch's
/// loss and accuracy and the last validation loss equal, and no hand-off left on either machine.
void expect_same_end_on_both_machines(const std::string& name, const TwoMachineRun& elastic, WorkerRun& deliberate,
                                      int nodes = 2) {
  const torch::Tensor changed = load_params((deliberate.dir / "params.pt").string());
  for (int node = 0; node < nodes; ++node) {
    const torch::Tensor ended = load_params(elastic.params[node].string());
    BOOST_TEST_MESSAGE(name << ": node " << node << ": max |elastic - deliberate| = " << (ended - changed).abs().max().item<double>());
    BOOST_TEST(torch::equal(ended, changed), name << ": node " << node << "'s parameters differ from the deliberate change");
    BOOST_TEST(elastic.left[node] == 0, name << ": node " << node << " left " << elastic.left[node] << " hand-off files");
  }
  BOOST_TEST(leftover_workers() == 0, name << ": a rank's process outlived its machine's job");  // both machines' (one process namespace)
  for (int epoch = 1; epoch <= kEpochs; ++epoch) {
    const std::string key = "epoch" + std::to_string(epoch);
    BOOST_TEST(elastic.result.at(key + "_samples") == kSamples, name << " " << key);
    BOOST_TEST(elastic.result.at(key + "_loss") == deliberate.result[key + "_loss"], name << " " << key);
    BOOST_TEST(elastic.result.at(key + "_accuracy") == deliberate.result[key + "_accuracy"], name << " " << key);
  }
  BOOST_TEST(elastic.result.at("val_loss") == deliberate.result["val_loss"]);
}

/// Skips (with ctest's marker) where two machines cannot be made here; true when they can.
bool two_machines_or_skip(trainloop_test::TwoNodeNetwork& network) {
  if (network.machines_ready()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: two machines cannot be made here (network, mount and UTS namespaces need root "
               "and iproute2): " << network.error << std::endl;
  return false;
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_sharded_job_on_two_machines_loses_a_rank_and_ends_as_four_ranks_that_became_three_would) {
  // Ranks 0, 1 on machine 0 and 2, 3 on machine 1, sharding full; rank 2 dies in its forward of
  // step 3. Its shards come from rank 1's copy (machine 0), the survivors' from their own: machine 0
  // writes files 0, 1, 2, `.metadata` and the loop's state, machine 1 file 3, and each gets what it
  // lacks from the other. The end equals 4 ranks that became 3 at step 2 on purpose (on one machine).
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const std::string mode = "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ";
  const fs::path dir = fresh_dir("elastic_two_machines_loss");
  const TwoMachineRun elastic = run_two_machines(
      network, dir / "elastic", 2, common_settings() + mode + "TL_TEST_ELASTIC_WAIT_MS=3000 TRAINLOOP_TEST_KILL_AT=2:3:forward");
  BOOST_TEST_MESSAGE("machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output[0] + elastic.output[1]);
  BOOST_TEST(elastic.output[0].find("continuing with 3 ranks") != std::string::npos, elastic.output[0]);
  const int committed = resumed_from_step(elastic.output[0]);

  WorkerRun before = run_worker("ckpt", 4, 0, common_settings() + mode + "TL_TEST_EVERY_STEPS=1 TL_TEST_CKPT_DIR=" + (dir / "before").string(),
                                "_two_machines_before");
  BOOST_REQUIRE_MESSAGE(before.exit_code == 0, before.output);
  const fs::path resumed = checkpoint_after(dir / "before", committed, 4);  // 60 samples, 16 a step
  BOOST_REQUIRE_MESSAGE(fs::exists(resumed), resumed.string());
  WorkerRun after = run_worker("ckpt", 3, 0,
                               common_settings() + mode + "TL_TEST_CKPT_DIR=" + (dir / "after").string() + " TL_TEST_RESUME=" + resumed.string(),
                               "_two_machines_after");
  BOOST_REQUIRE_MESSAGE(after.exit_code == 0, after.output);
  BOOST_TEST_MESSAGE("resumed from step " << committed);
  expect_same_end_on_both_machines("two machines, sharding full", elastic, after);
  BOOST_TEST(leftover_workers() == 0);
  for (auto* run : {&before, &after}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}

namespace {

/// `elastic` ended on both machines as 2 ranks that changed their world size on purpose, on one
/// machine, to 1 after step `shrunk` and back to 2 after step `grown` (`mode`'s settings; its runs
/// in `dir`; steps of the first epoch).
void expect_end_of_two_ranks_that_became_one_and_two_again(const std::string& name, const TwoMachineRun& elastic,
                                                           const fs::path& dir, const std::string& mode, int shrunk = 2,
                                                           int grown = 5) {
  auto run = [&](const std::string& part, int world, const std::string& settings) {
    WorkerRun result = run_worker("ckpt", world, 0, common_settings() + mode + "TL_TEST_CKPT_DIR=" + (dir / part).string() + settings,
                                  "_two_machines_join_" + part + "_" + name);
    BOOST_REQUIRE_MESSAGE(result.exit_code == 0, result.output);
    return result;
  };
  WorkerRun before = run("before", 2, " TL_TEST_EVERY_STEPS=1");
  const fs::path at_shrink = checkpoint_after(dir / "before", shrunk, 8);  // 60 samples, 8 a step on 2 ranks
  WorkerRun middle = run("middle", 1, " TL_TEST_EVERY_STEPS=1 TL_TEST_RESUME=" + at_shrink.string());
  const fs::path at_growth = checkpoint_after(dir / "middle", grown, 15);  // 4 a step on 1
  BOOST_REQUIRE_MESSAGE(fs::exists(at_growth), at_growth.string());
  WorkerRun after = run("after", 2, " TL_TEST_RESUME=" + at_growth.string());
  expect_same_end_on_both_machines(name, elastic, after);
  BOOST_TEST(leftover_workers() == 0);
  for (auto* worker : {&before, &middle, &after}) fs::remove_all(worker->dir);
}

/// 2 machines of one rank each; rank 1 (machine 1) dies in its forward of step 3, rank 0 goes on
/// alone from step 2, and machine 1's launcher starts a replacement there, admitted at the commit
/// of step 5 — on a machine where no member runs, so the state goes to it over the grown group
/// (`mode`: replicated, the loop's state from rank 0; sharded, machine 0's copy of the per-rank
/// checkpoint to a new copy on machine 1). The deliberate reference changes its world size at the
/// same steps on one machine: 2 ranks to step 2, 1 to step 5, 2 to the end. Both end alike.
void replacement_on_another_machine(const std::string& name, const std::string& mode) {
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const fs::path dir = fresh_dir("elastic_two_machines_join_" + name);
  const TwoMachineRun elastic =
      run_two_machines(network, dir / "elastic", 1,
                       common_settings() + mode +
                           "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_ELASTIC_WAIT_MS=3000 "
                           "TRAINLOOP_TEST_KILL_AT=1:3:forward TRAINLOOP_TEST_AWAIT_REPLACEMENT=5");
  BOOST_TEST_MESSAGE(name << ": machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output[0] + elastic.output[1]);
  BOOST_TEST(resumed_from_step(elastic.output[0]) == 2);
  BOOST_TEST(elastic.output[1].find("started a replacement for rank 1") != std::string::npos, elastic.output[1]);
  BOOST_TEST(elastic.output[0].find("joined at step 6 as rank 1; continuing with 2 ranks") != std::string::npos, elastic.output[0]);

  expect_end_of_two_ranks_that_became_one_and_two_again(name, elastic, dir, mode);
  fs::remove_all(dir);
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_replacement_on_another_machine_gets_the_replicated_state_over_the_group) {
  replacement_on_another_machine("replicated", "");
}

BOOST_AUTO_TEST_CASE(a_replacement_on_another_machine_with_one_rank_left_gets_its_state_over_the_group) {
  // At sharding full too: one rank left holds the whole state (no copies at world size 1).
  replacement_on_another_machine("full", "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ");
}

BOOST_AUTO_TEST_CASE(a_spare_machine_started_in_place_of_one_lost_whole_joins_the_running_fit) {
  // 2 machines of one rank: machine 1 is lost whole in rank 1's forward of step 3 (its launcher
  // killed with it: nothing is left there to start a replacement), rank 0 goes on alone from step
  // 2. Then the same command starts again on machine 1 (a spare in its place): its launcher finds
  // the job training, and its rank joins as a replacement, admitted at the commit of step 5 (the
  // state over the grown group). Both end as 2 ranks that became 1 at step 2 and 2 again at step 5.
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const fs::path dir = fresh_dir("elastic_two_machines_spare");
  const TwoMachineRun elastic = run_two_machines(
      network, dir / "elastic", 1,
      common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_ELASTIC_WAIT_MS=3000 TRAINLOOP_TEST_AWAIT_REPLACEMENT=5",
      "TRAINLOOP_TEST_KILL_AT=1:3:forward TRAINLOOP_TEST_KILL_LAUNCHER=1", SpareMachine{});
  BOOST_TEST_MESSAGE("machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output[0] + elastic.output[1]);
  BOOST_TEST(resumed_from_step(elastic.output[0]) == 2);
  BOOST_TEST(elastic.output[1].find("started a replacement") == std::string::npos, elastic.output[1]);
  BOOST_TEST(elastic.output[1].find("is training already (elastic): this machine stands in for a lost one; its rank 1 "
                                    "starts as a replacement") != std::string::npos,
             elastic.output[1]);
  BOOST_TEST(elastic.output[0].find("joined at step 6 as rank 1; continuing with 2 ranks") != std::string::npos, elastic.output[0]);
  expect_end_of_two_ranks_that_became_one_and_two_again("spare_machine", elastic, dir, "");
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_standby_machine_waits_while_every_rank_is_alive_and_takes_the_place_of_the_next_lost) {
  // 2 machines of one rank, and a spare started on machine 1 once the fit trains (its first
  // checkpoint written): it asks to join while both ranks are alive, and rank 0 (held at the
  // commit of step 3 until it asks) admits none — the job is at the size it was launched with.
  // Rank 1 dies in its forward of step 5 (its launcher starts no replacement), rank 0 goes on alone
  // from step 4, and admits the standby at the commit of step 7. The end equals 2 ranks that became
  // 1 at step 4 and 2 again at step 7.
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const fs::path dir = fresh_dir("elastic_two_machines_standby");
  const TwoMachineRun elastic = run_two_machines(
      network, dir / "elastic", 1,
      common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_ELASTIC_WAIT_MS=3000 TL_TEST_EVERY_STEPS=1 "
                          "TRAINLOOP_TEST_AWAIT_REPLACEMENT=3,7",
      "TL_TEST_REPLACEMENTS=0 TRAINLOOP_TEST_KILL_AT=1:5:forward",
      SpareMachine{"", true, "ls " + (dir / "elastic" / "ckpt").string() + " 2>/dev/null | grep -q step=000001"});
  BOOST_TEST_MESSAGE("machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output[0] + elastic.output[1]);
  BOOST_TEST(elastic.output[1].find("this machine stands in for a lost one; its rank 1 starts as a replacement") != std::string::npos,
             elastic.output[1]);
  BOOST_TEST(elastic.output[0].find("continuing with 3 ranks") == std::string::npos, elastic.output[0]);
  BOOST_TEST(resumed_from_step(elastic.output[0]) == 4);
  BOOST_TEST(elastic.output[0].find("joined at step 8 as rank 1; continuing with 2 ranks") != std::string::npos, elastic.output[0]);
  expect_end_of_two_ranks_that_became_one_and_two_again("standby_machine", elastic, dir, "", 4, 7);
  fs::remove_all(dir);
}

namespace {

/// The checkpoint ModelCheckpoint wrote after global step `step` in `dir`, whatever its epoch.
fs::path checkpoint_at_step(const fs::path& dir, int step) {
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "-step=%06d.ckpt", step);
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0) {
      return entry.path();
    }
  }
  BOOST_FAIL("no checkpoint of step " << step << " in " << dir.string());
  return {};
}

}  // namespace

BOOST_AUTO_TEST_CASE(replacements_on_a_machine_left_empty_get_a_copy_of_the_sharded_state_there) {
  // 2 machines of 2 ranks at sharding full: rank 2 dies in its forward of step 3, rank 3 in its
  // forward of step 5 (machine 1 has no member left), and machine 1's launcher starts a replacement
  // for each, both admitted at the commit of step 7: the members' copies are on machine 0 only, so
  // machine 1 gets a new copy of the per-rank checkpoint, every file sent from machine 0. The end
  // equals 4 ranks that became 3 and then 2 at the same steps and 4 again at step 7, bit for bit.
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const std::string mode = "TL_TEST_SHARDING=full TL_TEST_ELASTIC=1 ";
  const fs::path dir = fresh_dir("elastic_two_machines_emptied");
  const TwoMachineRun elastic =
      run_two_machines(network, dir / "elastic", 2,
                       common_settings() + mode +
                           "TL_TEST_REPLACEMENTS=1 TL_TEST_ELASTIC_WAIT_MS=3000 "
                           "TRAINLOOP_TEST_KILL_AT=2:3:forward,3:5:forward TRAINLOOP_TEST_AWAIT_REPLACEMENT=7");
  BOOST_TEST_MESSAGE("machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_REQUIRE_MESSAGE(elastic.exit_code == 0, elastic.output[0] + elastic.output[1]);
  std::vector<int> resumed;  // the step each loss resumed from
  static const std::regex pattern("lost at step [0-9]+: .*?from step ([0-9]+) held by rank");
  for (std::sregex_iterator at(elastic.output[0].begin(), elastic.output[0].end(), pattern), end; at != end; ++at) {
    resumed.push_back(std::stoi((*at)[1]));
  }
  BOOST_REQUIRE_MESSAGE(resumed.size() == 2, elastic.output[0]);
  BOOST_TEST(elastic.output[0].find("joined at step 8 as rank 2; continuing with 4 ranks") != std::string::npos, elastic.output[0]);
  BOOST_TEST(elastic.output[0].find("joined at step 8 as rank 3; continuing with 4 ranks") != std::string::npos, elastic.output[0]);

  auto run = [&](const std::string& part, int world, const std::string& settings) {
    WorkerRun result = run_worker("ckpt", world, 0, common_settings() + mode + "TL_TEST_CKPT_DIR=" + (dir / part).string() + settings,
                                  "_two_machines_emptied_" + part);
    BOOST_REQUIRE_MESSAGE(result.exit_code == 0, result.output);
    return result;
  };
  WorkerRun four = run("four", 4, " TL_TEST_EVERY_STEPS=1");
  WorkerRun three = run("three", 3, " TL_TEST_EVERY_STEPS=1 TL_TEST_RESUME=" + checkpoint_at_step(dir / "four", resumed[0]).string());
  WorkerRun two = run("two", 2, " TL_TEST_EVERY_STEPS=1 TL_TEST_RESUME=" + checkpoint_at_step(dir / "three", resumed[1]).string());
  WorkerRun after = run("after", 4, " TL_TEST_RESUME=" + checkpoint_at_step(dir / "two", 7).string());
  BOOST_TEST_MESSAGE("resumed from steps " << resumed[0] << " and " << resumed[1] << ", grown at step 7");
  expect_same_end_on_both_machines("emptied machine, sharding full", elastic, after);
  BOOST_TEST(leftover_workers() == 0);
  for (auto* worker : {&four, &three, &two, &after}) fs::remove_all(worker->dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_machine_whose_every_rank_is_lost_ends_named_while_the_job_goes_on_without_it) {
  // 2 machines of one rank each, no replacements: rank 1 dies in its forward of step 3. Machine 0's
  // rank trains to the end (every sample of both epochs once, exit status 0); machine 1's fit() has
  // no rank left to hand it the trained state and ends naming why, with nothing left in /dev/shm.
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const fs::path dir = fresh_dir("elastic_two_machines_lost");
  const TwoMachineRun run = run_two_machines(
      network, dir, 1, common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_ELASTIC_WAIT_MS=3000 TRAINLOOP_TEST_KILL_AT=1:3:forward");
  BOOST_TEST_MESSAGE("machine 0: " << run.output[0] << "\nmachine 1: " << run.output[1]);
  BOOST_TEST(run.node_exit_code[0] == 0, run.output[0]);
  BOOST_TEST(run.node_exit_code[1] != 0, run.output[1]);
  BOOST_TEST(run.output[0].find("continuing with 1 rank") != std::string::npos, run.output[0]);
  BOOST_TEST(run.output[1].find("every rank this launcher started was lost (1) and no replacement of theirs was in the job") !=
                 std::string::npos,
             run.output[1]);
  for (int epoch = 1; epoch <= kEpochs; ++epoch) BOOST_TEST(run.result.at("epoch" + std::to_string(epoch) + "_samples") == kSamples);
  BOOST_TEST(run.left[0] == 0);
  BOOST_TEST(run.left[1] == 0);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_replacement_lost_while_the_grown_group_hands_it_the_state_leaves_the_member_going_on) {
  // 2 machines of one rank: rank 1 dies in its forward of step 3, rank 0 goes on alone, and machine
  // 1's launcher starts a replacement, admitted at the commit of step 5; the grown group forms and
  // the replacement dies before the state reaches it over the group (kill point `hand-off`). The
  // member's hand-off over the group fails, and it is lost as any rank: rank 0 goes on alone from
  // step 5, its model and optimizer as they were. The end on machine 0 equals 2 ranks that became 1
  // at step 2 on purpose, bit for bit; machine 1's fit ends named (no rank of it is left).
  trainloop_test::TwoNodeNetwork network;
  if (!two_machines_or_skip(network)) return;
  const fs::path dir = fresh_dir("elastic_two_machines_hand_off_lost");
  const TwoMachineRun elastic = run_two_machines(
      network, dir / "elastic", 1,
      common_settings() + "TL_TEST_ELASTIC=1 TL_TEST_REPLACEMENTS=1 TL_TEST_ELASTIC_WAIT_MS=3000 "
                          "TRAINLOOP_TEST_KILL_AT=1:3:forward,1:6:hand-off TRAINLOOP_TEST_AWAIT_REPLACEMENT=5");
  BOOST_TEST_MESSAGE("machine 0: " << elastic.output[0] << "\nmachine 1: " << elastic.output[1]);
  BOOST_TEST(elastic.node_exit_code[0] == 0, elastic.output[0]);
  BOOST_TEST(elastic.node_exit_code[1] != 0, elastic.output[1]);
  BOOST_TEST(resumed_from_step(elastic.output[0]) == 2);
  BOOST_TEST(elastic.output[1].find("started a replacement for rank 1") != std::string::npos, elastic.output[1]);
  BOOST_TEST(elastic.output[0].find("lost at step 6: ") != std::string::npos, elastic.output[0]);
  BOOST_TEST(elastic.output[0].find("continuing with 1 rank (regrouped in") != std::string::npos, elastic.output[0]);
  BOOST_TEST(elastic.output[0].find("from step 5 held by rank 0") != std::string::npos, elastic.output[0]);
  BOOST_TEST(elastic.output[1].find("rank 1 was lost again and its 1 replacement is used up") != std::string::npos, elastic.output[1]);
  BOOST_TEST(elastic.left[1] == 0);

  WorkerRun before = run_worker("ckpt", 2, 0, common_settings() + "TL_TEST_EVERY_STEPS=1 TL_TEST_CKPT_DIR=" + (dir / "before").string(),
                                "_hand_off_lost_before");
  BOOST_REQUIRE_MESSAGE(before.exit_code == 0, before.output);
  const fs::path step2 = checkpoint_after(dir / "before", 2, 8);  // 60 samples, 8 a step on 2 ranks
  WorkerRun after = run_worker("ckpt", 1, 0,
                               common_settings() + "TL_TEST_CKPT_DIR=" + (dir / "after").string() + " TL_TEST_RESUME=" + step2.string(),
                               "_hand_off_lost_after");
  BOOST_REQUIRE_MESSAGE(after.exit_code == 0, after.output);
  expect_same_end_on_both_machines("replacement lost in the hand-off", elastic, after, /*nodes=*/1);
  BOOST_TEST(leftover_workers() == 0);
  for (auto* run : {&before, &after}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}
