#define BOOST_TEST_MODULE test_checkpoint_files
#include "unit_test.hpp"

// Checkpoints a user can trust with a real run: ModelCheckpoint removes only its own files in its
// own directory and keeps its limits across resumes, kills and directory changes; a failed load
// changes nothing; a killed write leaves no debris; a full disk is an error, not a crash; and
// DataParallel with random layers is reproducible. (Resume exactness: test_checkpoint; DDP's
// share: test_ddp; the sharding levels': test_sharding.)

#include "checkpoint_test_model.hpp"
#include "small_tmpfs.hpp"
#include "test_support.hpp"

#include <trainloop/detail/atomic_directory.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

/// The names of the files in `dir`, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

/// Every file of `dir` with its size and modification time: equal before and after means untouched.
std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> fingerprint(const fs::path& dir) {
  std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto status = fs::symlink_status(entry.path());
    files[entry.path().filename().string()] = {fs::is_regular_file(status) ? fs::file_size(entry.path()) : 0,
                                               fs::is_regular_file(status) ? fs::last_write_time(entry.path())
                                                                           : fs::file_time_type{}};
  }
  return files;
}

std::shared_ptr<tl::ModelCheckpoint> checkpoints(const fs::path& dir, int64_t keep_last, int64_t keep_best = 0) {
  auto options = tl::ModelCheckpointOptions(dir).keep_last(keep_last).keep_best(keep_best);
  if (keep_best > 0) options.monitor("val_loss").mode(tl::MonitorMode::Min);
  return std::make_shared<tl::ModelCheckpoint>(options);
}

/// Copies a run directory as `cp -r` does (the last.ckpt link stays a link).
void copy_run_directory(const fs::path& from, const fs::path& to) {
  fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
}

/// The count of names in `names` that are periodic / best checkpoints.
int64_t periodic_count(const std::vector<std::string>& names) {
  return std::count_if(names.begin(), names.end(), [](const auto& n) {
    const auto position = tl::parse_checkpoint_name(n);
    return position && !position->best;
  });
}
int64_t best_count(const std::vector<std::string>& names) {
  return std::count_if(names.begin(), names.end(), [](const auto& n) {
    const auto position = tl::parse_checkpoint_name(n);
    return position && position->best;
  });
}

}  // namespace

// ---- Which files ModelCheckpoint removes -------------------------------------------------------

BOOST_AUTO_TEST_CASE(resuming_from_a_copied_run_directory_never_touches_the_source) {
  TempDir root;
  const fs::path source = root.path / "source", copy = root.path / "copy";
  {
    Run run(1, tl::gpu_mode::Single());
    run.loop.fit(2, {checkpoints(source, 2)});
  }
  const auto before = fingerprint(source);
  BOOST_REQUIRE_EQUAL(before.size(), 3u);  // two periodic files and last.ckpt
  copy_run_directory(source, copy);
  Run resumed(7, tl::gpu_mode::Single());
  resumed.loop.fit(1, {checkpoints(copy, 1)}, "last");
  BOOST_TEST(resumed.loop.history().epochs.size() == 3u);  // resumed from the copy's epoch 2
  BOOST_TEST((fingerprint(source) == before), "the source run's files changed");
  // keep_last(1) in the copy: its own older files go, the newest stays.
  BOOST_TEST(names_in(copy) == (std::vector<std::string>{"epoch=0003-step=000024.ckpt", "last.ckpt"}),
             boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(fine_tuning_from_another_runs_checkpoint_into_a_new_directory_never_touches_it) {
  TempDir root;
  const fs::path source = root.path / "source", target = root.path / "fine-tuned";
  {
    Run run(1, tl::gpu_mode::Single());
    run.loop.fit(2, {checkpoints(source, 2, 2)});
  }
  const auto before = fingerprint(source);
  Run tuned(7, tl::gpu_mode::Single());
  auto callback = checkpoints(target, 1, 1);
  tuned.loop.fit(2, {callback}, (source / "epoch=0002-step=000016.ckpt").string());
  BOOST_TEST((fingerprint(source) == before), "the source run's files changed");
  const auto names = names_in(target);
  for (const auto& name : names) BOOST_TEST_MESSAGE(name);
  BOOST_TEST(periodic_count(names) == 1);  // epoch 4 only
  BOOST_TEST(best_count(names) == 1);
  BOOST_TEST(std::count(names.begin(), names.end(), "epoch=0004-step=000032.ckpt") == 1);
  // best() names this run's own file, not the source run's.
  BOOST_REQUIRE_EQUAL(callback->best().size(), 1u);
  BOOST_TEST(callback->best().front().second.parent_path() == target);
  BOOST_TEST(fs::exists(callback->best().front().second));
}

BOOST_AUTO_TEST_CASE(a_file_outside_the_callbacks_directory_can_never_be_removed) {
  TempDir root;
  const fs::path own = root.path / "own", outside = root.path / "outside";
  fs::create_directories(own);
  fs::create_directories(outside);
  // Files a restored state could name: another directory's checkpoints, by absolute and relative
  // path, a user's file in the callback's own directory, and an own checkpoint of the same name.
  const std::vector<fs::path> planted{outside / "epoch=0001-step=000008.ckpt", outside / "best-epoch=0001-val_loss=0.1000.ckpt",
                                      own / "notes.ckpt", own / "epoch=0001-step=000008.ckpt.keep"};
  for (const auto& path : planted) std::ofstream(path) << "user data";
  std::ostringstream files;
  files << "recent\t0\t" << planted[0].string() << "\nrecent\t0\t../outside/epoch=0001-step=000008.ckpt\n"
        << "best\t0.1\t" << planted[1].string() << "\nbest\t-1\t../outside/best-epoch=0001-val_loss=0.1000.ckpt\n"
        << "recent\t0\t" << planted[2].string() << "\nsurplus\t0\t" << planted[0].string() << "\nsurplus\t0\t../outside\n";
  torch::serialize::OutputArchive archive;
  archive.write("files", c10::IValue(files.str()));
  std::ostringstream bytes;
  archive.save_to(bytes);
  std::istringstream in(bytes.str());
  torch::serialize::InputArchive restored;
  restored.load_from(in);
  auto callback = checkpoints(own, 1, 1);
  callback->load_state(restored);
  BOOST_TEST(callback->recent().empty());  // none of them is this callback's file in its directory
  BOOST_TEST(callback->best().empty());
  Run run(1, tl::gpu_mode::Single());
  run.loop.fit(3, {callback});
  for (const auto& path : planted) BOOST_TEST(fs::exists(path), path.string() + " was removed");
  const auto names = names_in(own);
  BOOST_TEST(periodic_count(names) == 1);  // its own files do follow keep_last(1)
  BOOST_TEST(fs::read_symlink(own / "last.ckpt") == "epoch=0003-step=000024.ckpt");
}

BOOST_AUTO_TEST_CASE(keep_last_and_keep_best_hold_across_any_number_of_resumes) {
  TempDir resumed_dir, straight_dir;
  // Four "program runs" of one epoch each, every one resuming from the last.
  std::shared_ptr<tl::ModelCheckpoint> last_callback;
  for (int run_index = 0; run_index < 4; ++run_index) {
    Run run(100 + run_index, tl::gpu_mode::Single());
    last_callback = checkpoints(resumed_dir.path, 2, 2);
    run.loop.fit(1, {last_callback}, "last");
    const auto names = names_in(resumed_dir.path);
    BOOST_TEST(periodic_count(names) == std::min(run_index + 1, 2), "after run " << run_index + 1);
    BOOST_TEST(best_count(names) <= 2, "after run " << run_index + 1);
    BOOST_TEST(last_callback->recent().size() == static_cast<size_t>(std::min(run_index + 1, 2)));
  }
  // The same four epochs without interruption keep exactly the same files and the same best().
  Run straight(100, tl::gpu_mode::Single());
  auto straight_callback = checkpoints(straight_dir.path, 2, 2);
  const auto history = straight.loop.fit(4, {straight_callback});
  BOOST_TEST(names_in(resumed_dir.path) == names_in(straight_dir.path), boost::test_tools::per_element());
  BOOST_REQUIRE_EQUAL(last_callback->best().size(), 2u);
  BOOST_REQUIRE_EQUAL(straight_callback->best().size(), 2u);
  // best() holds the two lowest validation losses of all four epochs, best first.
  std::vector<double> losses;
  for (const auto& epoch : history.epochs) losses.push_back(epoch.validation->loss);
  std::sort(losses.begin(), losses.end());
  for (size_t i = 0; i < 2; ++i) {
    BOOST_TEST(last_callback->best()[i].first == losses[i]);
    BOOST_TEST(last_callback->best()[i].second.filename() == straight_callback->best()[i].second.filename());
    BOOST_TEST(fs::exists(last_callback->best()[i].second));
  }
}

// ---- Kills during writes ----------------------------------------------------------------------

namespace {
/// Forks a process that starts writing `target` atomically, writes `bytes` of it and is killed
/// by SIGKILL: what a preempted job leaves. Returns once it is dead.
void killed_while_writing(const fs::path& target, size_t bytes) {
  const pid_t child = ::fork();
  BOOST_REQUIRE(child >= 0);
  if (child == 0) {
    tl::detail::BasicAtomicFile<tl::CheckpointError> file(target, "the checkpoint");
    file.write(std::string(bytes, 'x'));
    ::kill(::getpid(), SIGKILL);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  BOOST_REQUIRE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

int temporaries_in(const fs::path& dir) {
  int count = 0;
  for (const auto& name : names_in(dir)) count += tl::detail::is_temporary_name(name) ? 1 : 0;
  return count;
}
}  // namespace

BOOST_AUTO_TEST_CASE(the_next_writer_removes_what_killed_writers_left_and_nothing_else) {
  TempDir dir;
  {
    Run run(1, tl::gpu_mode::Single());
    run.loop.fit(1, {checkpoints(dir.path, 0)});
  }
  killed_while_writing(dir.path / "epoch=0002-step=000016.ckpt", 100000);
  killed_while_writing(dir.path / "epoch=0002-step=000016.ckpt", 2000);
  BOOST_REQUIRE_EQUAL(temporaries_in(dir.path), 2);
  // A live writer's temporary (this process's) and one of another machine stay.
  const fs::path live = tl::detail::temporary_path_for(dir.path / "epoch=0009-step=000099.ckpt", "live01");
  const fs::path elsewhere = dir.path / "epoch=0009-step=000099.ckpt.trainloop-tmp.1-1-0123456789abcdef.other1";
  std::ofstream(live) << "in progress";
  std::ofstream(elsewhere) << "another machine's";
  Run rerun(2, tl::gpu_mode::Single());
  rerun.loop.fit(1, {checkpoints(dir.path, 0)}, "last");
  BOOST_TEST(rerun.loop.history().epochs.size() == 2u);
  BOOST_TEST(temporaries_in(dir.path) == 2);
  BOOST_TEST(fs::exists(live));
  BOOST_TEST(fs::exists(elsewhere));
  BOOST_TEST(names_in(dir.path) ==
                 (std::vector<std::string>{"epoch=0001-step=000008.ckpt", "epoch=0002-step=000016.ckpt", elsewhere.filename().string(),
                                           live.filename().string(), "last.ckpt"}),
             boost::test_tools::per_element());
}

// A per-rank checkpoint is filled as a temporary directory (detail/atomic_directory.hpp): one whose
// maker was killed is removed by the next writer, a live one stays, and a committed one replaces
// an earlier directory of the same name whole.
BOOST_AUTO_TEST_CASE(a_killed_writers_checkpoint_directory_is_removed_and_a_committed_one_appears_whole) {
  TempDir dir;
  const fs::path target = dir.path / "epoch=0003-step=000024.ckpt";
  const pid_t child = ::fork();
  BOOST_REQUIRE(child >= 0);
  if (child == 0) {
    const fs::path temporary = tl::detail::make_temporary_directory_for(target);
    std::ofstream(temporary / "__0_0.distcp") << std::string(5000, 'x');
    ::kill(::getpid(), SIGKILL);
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  BOOST_REQUIRE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  BOOST_REQUIRE_EQUAL(temporaries_in(dir.path), 1);
  BOOST_TEST(tl::checkpoint_candidates(dir.path).empty());  // never a candidate
  // The next writer in the directory removes it (making its own temporary directory); its own stays.
  const fs::path live = tl::detail::make_temporary_directory_for(dir.path / "epoch=0004-step=000032.ckpt");
  BOOST_TEST(temporaries_in(dir.path) == 1);
  BOOST_TEST(tl::detail::remove_dead_temporaries(dir.path) == 0);
  BOOST_TEST(fs::is_directory(live));
  // Written twice under one name: the second directory replaces the first, nothing else remains.
  for (const char* content : {"first", "second"}) {
    const fs::path temporary = tl::detail::make_temporary_directory_for(target);
    std::ofstream(temporary / ".metadata") << content;
    tl::detail::commit_directory(temporary, target);
  }
  std::ifstream metadata(target / ".metadata");
  std::string text;
  metadata >> text;
  BOOST_TEST(text == "second");
  // ModelCheckpoint's second name of a per-rank checkpoint (its best name): a directory of hard links.
  const fs::path best = dir.path / "best-epoch=0003-val_loss=0.1000.ckpt";
  tl::detail::link_atomically(target, best);
  BOOST_TEST(fs::equivalent(best / ".metadata", target / ".metadata"));
  fs::remove_all(live);
  BOOST_TEST(names_in(dir.path) == (std::vector<std::string>{best.filename().string(), target.filename().string()}),
             boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(last_means_the_newest_complete_checkpoint_whatever_last_ckpt_points_at) {
  TempDir dir;
  Run uninterrupted(1, tl::gpu_mode::Single());
  uninterrupted.loop.fit(3);
  {
    Run run(1, tl::gpu_mode::Single());
    run.loop.fit(2, {checkpoints(dir.path, 0)});
  }
  // A kill between the rename of epoch 2's file and the update of the link.
  fs::remove(dir.path / "last.ckpt");
  fs::create_symlink("epoch=0001-step=000008.ckpt", dir.path / "last.ckpt");
  Run rerun(5, tl::gpu_mode::Single());
  rerun.loop.fit(2, {checkpoints(dir.path, 0)}, "last");  // the program run again: fit(2) finished, fit(2) more
  Run resumed(6, tl::gpu_mode::Single());
  auto history = resumed.loop.fit(1, {checkpoints(dir.path, 0)}, (dir.path / "epoch=0002-step=000016.ckpt").string());
  BOOST_TEST(rerun.loop.history().epochs.size() == 4u);  // from epoch 2, not epoch 1
  BOOST_TEST(history.epochs.size() == 3u);
  BOOST_TEST(torch::equal(resumed.params(), uninterrupted.params()));
}

BOOST_AUTO_TEST_CASE(files_made_surplus_before_a_kill_are_removed_on_the_next_fit) {
  TempDir dir;
  {
    Run run(1, tl::gpu_mode::Single());
    run.loop.fit(2, {checkpoints(dir.path, 1)});
  }
  BOOST_REQUIRE((names_in(dir.path) == std::vector<std::string>{"epoch=0002-step=000016.ckpt", "last.ckpt"}));
  // Killed after epoch 2's file was renamed into place, before epoch 1's was removed and the
  // link updated: epoch 1's file is still there and last.ckpt points at it.
  fs::copy_file(dir.path / "epoch=0002-step=000016.ckpt", dir.path / "epoch=0001-step=000008.ckpt");
  fs::remove(dir.path / "last.ckpt");
  fs::create_symlink("epoch=0001-step=000008.ckpt", dir.path / "last.ckpt");
  Run rerun(3, tl::gpu_mode::Single());
  rerun.loop.fit(1, {checkpoints(dir.path, 1)}, "last");
  BOOST_TEST(names_in(dir.path) == (std::vector<std::string>{"epoch=0003-step=000024.ckpt", "last.ckpt"}),
             boost::test_tools::per_element());
}

// ---- All-or-nothing loads ---------------------------------------------------------------------

namespace {
/// The Net with another last layer: 4 classes instead of 3.
struct FourClassNetImpl : torch::nn::Module {
  FourClassNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(FourClassNet);

/// Refuses any state it is given: a user's callback whose load_state throws.
struct RefusingCallback : tl::Callback {
  int state = 1;
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("state", c10::IValue(int64_t{state}));
  }
  void load_state(torch::serialize::InputArchive&) override { throw std::runtime_error("this state is from elsewhere"); }
  std::string state_key() const override { return "refusing"; }
};

/// Everything a load could change, captured.
struct LoopState {
  torch::Tensor params, optimizer, rng;
  int64_t epochs = 0, steps = 0;
  std::vector<fs::path> recent;
};
template <class Model>
LoopState capture(Model& net, torch::optim::Adam& optimizer, const tl::History& history,
                  const tl::ModelCheckpoint* callback = nullptr) {
  LoopState state;
  state.params = flat(net->parameters()).clone();
  state.optimizer = optimizer_state(optimizer).clone();
  state.rng = tl::detail::capture_rng_state();
  state.epochs = static_cast<int64_t>(history.epochs.size());
  state.steps = history.total_steps;
  if (callback) state.recent = callback->recent();
  return state;
}
void require_unchanged(const LoopState& before, const LoopState& after) {
  BOOST_TEST(torch::equal(before.params, after.params), "max |model change| = "
                                                            << (before.params - after.params).abs().max().item<double>());
  BOOST_TEST(torch::equal(before.optimizer, after.optimizer));
  BOOST_TEST(torch::equal(before.rng, after.rng));
  BOOST_TEST(before.epochs == after.epochs);
  BOOST_TEST(before.steps == after.steps);
  BOOST_TEST(before.recent == after.recent, boost::test_tools::per_element());
}
}  // namespace

BOOST_AUTO_TEST_CASE(a_checkpoint_of_another_model_changes_nothing_in_single_and_dp) {
  TempDir dir;
  {
    Run source(1, tl::gpu_mode::Single());
    source.loop.fit(1, {checkpoints(dir.path, 1)});
  }
  const fs::path checkpoint = dir.path / "epoch=0001-step=000008.ckpt";
  for (const std::string mode_name : {"single", "dp"}) {
    torch::manual_seed(3);
    FourClassNet net;
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    auto four_classes = blobs(60, 1);
    four_classes = tl::data::TensorDataset(four_classes.inputs(), four_classes.targets(), 4);
    tl::TrainLoop<FourClassNet, tl::gpu_mode::Any> loop(
        net, four_classes, {}, optimizer, torch::nn::CrossEntropyLoss(), Run::base_options(),
        mode_name == "dp" ? tl::gpu_mode::Any(tl::gpu_mode::DataParallel::cpu_replicas(2)) : tl::gpu_mode::Any(tl::gpu_mode::Single()));
    loop.fit(1);  // optimizer state, progress and a random stream of its own
    const LoopState before = capture(net, optimizer, loop.history());
    std::string message;
    try {
      loop.load_checkpoint(checkpoint);
    } catch (const tl::CheckpointError& error) {
      message = error.what();
    }
    BOOST_TEST(message.find("parameter 'fc2.weight' has shape [3, 16] in the checkpoint and [4, 16] in the model") !=
                   std::string::npos,
               mode_name << ": " << message);
    require_unchanged(before, capture(net, optimizer, loop.history()));
    // Resuming in fit() is refused the same way, and the loop trains on from where it was.
    message = error_of([&] { loop.fit(1, {}, checkpoint.string()); });
    BOOST_TEST(message.find("fc2.weight") != std::string::npos, message);
    require_unchanged(before, capture(net, optimizer, loop.history()));
    BOOST_TEST(loop.fit(1).epochs.size() == 2u);
  }
}

BOOST_AUTO_TEST_CASE(a_callback_refusing_its_state_rolls_back_the_optimizer_and_the_other_callbacks) {
  TempDir dir, other;
  {
    Run source(1, tl::gpu_mode::Single());
    source.loop.fit(2, {checkpoints(dir.path, 2), std::make_shared<RefusingCallback>()});
  }
  Run run(2, tl::gpu_mode::Single());
  auto own = checkpoints(other.path, 3);
  run.loop.fit(3, {own});
  const LoopState before = capture(run.net, run.optimizer, run.loop.history(), own.get());
  BOOST_REQUIRE_EQUAL(before.recent.size(), 3u);
  // The ModelCheckpoint's key comes first: its state (epochs 1 and 2, whose names are in its
  // directory too) is loaded before the refusal, and must be rolled back with the optimizer's.
  const std::string message = error_of([&] {
    run.loop.fit(1, {own, std::make_shared<RefusingCallback>()}, (dir.path / "epoch=0002-step=000016.ckpt").string());
  });
  BOOST_TEST(message.find("a callback could not load its state") != std::string::npos, message);
  BOOST_TEST(message.find("this state is from elsewhere") != std::string::npos, message);
  require_unchanged(before, capture(run.net, run.optimizer, run.loop.history(), own.get()));
}

// ---- A full disk ------------------------------------------------------------------------------

namespace {
/// The size of the Run's checkpoints after an epoch (Adam's moments included), in bytes.
uintmax_t checkpoint_bytes() {
  TempDir dir;
  Run run(1, tl::gpu_mode::Single());
  run.loop.fit(1);
  run.loop.save_checkpoint(dir.path / "probe.ckpt");
  return fs::file_size(dir.path / "probe.ckpt");
}
}  // namespace

BOOST_AUTO_TEST_CASE(a_full_disk_stops_training_with_an_error_naming_the_file_and_keeps_the_earlier_checkpoints,
                     *boost::unit_test::precondition(can_mount_tmpfs)) {
  // Room for two checkpoints (tmpfs counts whole pages), not three.
  const uintmax_t pages = (checkpoint_bytes() + 4095) / 4096;
  for (const std::string mode_name : {"single", "dp"}) {
    SmallTmpfs disk((2 * pages + pages / 2) * 4096);
    BOOST_REQUIRE(disk.mounted);
    Run run(1, mode_name == "dp" ? tl::gpu_mode::Any(tl::gpu_mode::DataParallel::cpu_replicas(2))
                                 : tl::gpu_mode::Any(tl::gpu_mode::Single()));
    std::string message;
    bool checkpoint_error = false;
    try {
      run.loop.fit(3, {checkpoints(disk.dir.path, 0)});
    } catch (const tl::CheckpointError& error) {
      checkpoint_error = true;
      message = error.what();
    }
    BOOST_TEST(checkpoint_error, mode_name << ": " << message);
    const std::string third = (disk.dir.path / "epoch=0003-step=000024.ckpt").string();
    BOOST_TEST(message.find("cannot write the checkpoint " + third) != std::string::npos, message);
    BOOST_TEST(message.find("No space left on device") != std::string::npos, message);
    BOOST_TEST(names_in(disk.dir.path) ==
                   (std::vector<std::string>{"epoch=0001-step=000008.ckpt", "epoch=0002-step=000016.ckpt", "last.ckpt"}),
               boost::test_tools::per_element());
    Run reader(9, tl::gpu_mode::Single());
    reader.loop.load_checkpoint(disk.dir.path / "last.ckpt");
    BOOST_TEST(reader.loop.history().epochs.size() == 2u);
  }
}

// ---- DataParallel with random layers ----------------------------------------------------------

namespace {
/// Net with dropout, cloneable: DataParallel's replicas get the same dropout.
struct DropoutNetImpl : torch::nn::Cloneable<DropoutNetImpl> {
  explicit DropoutNetImpl(double dropout = 0.2) : p(dropout) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::dropout(torch::relu(fc1(x)), p, is_training())); }
  double p;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DropoutNet);

struct DpRun {
  DropoutNet net;
  torch::optim::Adam optimizer;
  tl::TrainLoop<DropoutNet, tl::gpu_mode::DataParallel> loop;
  explicit DpRun(uint64_t init_seed, int replicas = 3)
      : net((torch::manual_seed(init_seed), DropoutNet())),
        optimizer(net->parameters(), torch::optim::AdamOptions(1e-2)),
        loop(net, blobs(60, 1), blobs(30, 2), optimizer, torch::nn::CrossEntropyLoss(), Run::base_options(),
             tl::gpu_mode::DataParallel::cpu_replicas(replicas)) {}
};
}  // namespace

BOOST_AUTO_TEST_CASE(dp_with_dropout_trains_the_same_weights_every_run_and_resumes_exactly) {
  DpRun first(1), second(1);
  first.loop.fit(4);
  second.loop.fit(4);
  BOOST_TEST_MESSAGE("two dp runs with dropout: max |difference| = "
                     << (flat(first.net->parameters()) - flat(second.net->parameters())).abs().max().item<double>());
  BOOST_TEST(torch::equal(flat(first.net->parameters()), flat(second.net->parameters())));
  // The dropout masks did matter: without dropout the weights differ.
  DropoutNet no_dropout = (torch::manual_seed(1), DropoutNet(0.0));
  torch::optim::Adam optimizer(no_dropout->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop<DropoutNet, tl::gpu_mode::DataParallel> plain(no_dropout, blobs(60, 1), blobs(30, 2), optimizer,
                                                              torch::nn::CrossEntropyLoss(), Run::base_options(),
                                                              tl::gpu_mode::DataParallel::cpu_replicas(3));
  plain.fit(4);
  BOOST_TEST(!torch::equal(flat(first.net->parameters()), flat(no_dropout->parameters())));

  TempDir dir;
  {
    DpRun killed(1);
    killed.loop.fit(2, {checkpoints(dir.path, 1)});
  }
  DpRun resumed(42);
  auto history = resumed.loop.fit(2, {checkpoints(dir.path, 1)}, "last");
  BOOST_TEST(history.epochs.size() == 4u);
  BOOST_TEST(torch::equal(flat(resumed.net->parameters()), flat(first.net->parameters())));
  BOOST_TEST(torch::equal(optimizer_state(resumed.optimizer), optimizer_state(first.optimizer)));
}
