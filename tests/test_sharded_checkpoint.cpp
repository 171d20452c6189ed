#define BOOST_TEST_MODULE test_sharded_checkpoint
#include "unit_test.hpp"

// Per-rank checkpoints (checkpoint/dcp_checkpoint.hpp, loop/sharded_checkpoint_io.hpp): what a
// sharded run writes (torch.distributed.checkpoint's layout, every rank its own file, nothing
// gathered), Python's dcp.load reading it and trainloop reading Python's dcp.save, resuming in
// other modes and world sizes, and the bad directories, each named. Restarts bit for bit at every
// level and the resumes in plain DDP, on 3 ranks and in one process are test_sharding's.

#include "ddp_test_support.hpp"
#include "python_reference.hpp"

#include <trainloop/interop/dcp_weights.hpp>
#include <trainloop/interop/load_state_dict.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace {

// Python's side: `read CKPT REF` loads our checkpoint with dcp.load into zeros shaped like the
// reference (torch.load of what trainloop's own reader got) and prints the largest difference;
// `write OUT REF` saves a model with dcp.save and its state_dict with torch.save.
constexpr const char* kPythonScript = R"PY(
import sys
import torch
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 4):
    print("TRAINLOOP_TEST_SKIPPED: torch", torch.__version__, "has no DCP reader of torch 2.11's format")
    sys.exit(0)
import torch.distributed.checkpoint as dcp

command, work = sys.argv[1], sys.argv[2]
if command == "read":
    ckpt, ref = sys.argv[3], sys.argv[4]
    expected = torch.load(ref, weights_only=False)  # our own file: a typed Dict (torch.jit._pickle tags)
    model, optim = {}, {}
    for key, value in expected.items():
        if key.startswith("model."):
            model[key[6:]] = torch.zeros_like(value)
        else:
            name, field = key[len("optim.state."):].rsplit(".", 1)
            optim.setdefault(name, {})[field] = torch.zeros_like(value)
    dcp.load({"model": model, "optim": {"state": optim}}, checkpoint_id=ckpt)
    worst, equal = 0.0, 0
    for key, value in expected.items():
        if key.startswith("model."):
            got = model[key[6:]]
        else:
            name, field = key[len("optim.state."):].rsplit(".", 1)
            got = optim[name][field]
        worst = max(worst, (got.double() - value.double()).abs().max().item())
        equal += int(torch.equal(got, value))
    print("tensors", len(expected), "equal", equal, "max_abs_diff", worst)
elif command == "write":
    out, ref = sys.argv[3], sys.argv[4]
    torch.manual_seed(7)
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
    net = Mlp()
    dcp.save({"model": net.state_dict()}, checkpoint_id=out)
    torch.save(net.state_dict(), ref)
    print("written")
)PY";

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// A 2-rank fsdp (full) run of the "ckpt" scenario with Adam: its checkpoint directory.
fs::path sharded_run(const fs::path& dir, const std::string& extra = "") {
  auto run = run_ckpt("dcp_full", dir, "TL_TEST_OPTIMIZER=adam TL_TEST_SHARDING=full TL_TEST_EPOCHS=2 " + extra);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  fs::remove_all(run.dir);
  return dir;
}

/// A one-process loop over the test's MLP with Adam, as the worker builds it.
struct OneProcess {
  Mlp net;
  torch::optim::Adam optimizer;
  tl::TrainLoop<Mlp> loop;
  OneProcess()
      : optimizer(net->parameters(), torch::optim::AdamOptions(0.01)),
        loop(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(8)) {}
};

}  // namespace

BOOST_AUTO_TEST_CASE(a_sharded_run_writes_every_rank_its_own_file_in_dcp_layout_and_nothing_is_left_behind) {
  const fs::path dir = sharded_run(fresh_dir("dcp_layout"));
  const fs::path last = fs::canonical(dir / "last.ckpt");
  BOOST_TEST(tl::is_sharded_checkpoint(last));
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(last)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  BOOST_TEST(names == (std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "trainloop.pt"}));
  // Each rank wrote its share: Adam's state and the weights of about half the elements each.
  const auto rank0 = fs::file_size(last / "__0_0.distcp"), rank1 = fs::file_size(last / "__1_0.distcp");
  BOOST_TEST_MESSAGE("rank files: " << rank0 << " and " << rank1 << " bytes");
  BOOST_TEST(rank1 > 0u);
  for (const auto& entry : fs::directory_iterator(dir)) BOOST_TEST(!tl::detail::is_temporary_name(entry.path().filename().string()));
  // Every element of every tensor is stored once (the metadata reader checks the cover).
  tl::detail::DcpCheckpoint checkpoint(last);
  BOOST_TEST(checkpoint.metadata().tensors.count("model.fc2.weight") == 1u);
  BOOST_TEST(checkpoint.metadata().tensors.at("model.fc2.weight").chunks.size() >= 2u);  // from both ranks
  BOOST_TEST(checkpoint.has("optim.state.fc1.weight.exp_avg_sq"));
  BOOST_TEST(checkpoint.read_whole("optim.state.fc1.weight.step").item<double>() == 10.0);  // 2 epochs of 5 steps
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_sharded_checkpoint_resumes_in_single_and_dp_and_python_dcp_load_reads_exactly_our_tensors) {
  const fs::path dir = sharded_run(fresh_dir("dcp_python"));
  const fs::path last = fs::canonical(dir / "last.ckpt");
  OneProcess single;
  single.loop.load_checkpoint(last);
  BOOST_TEST(single.optimizer.state().size() == 6u);
  // The same checkpoint in dp: the same weights.
  Mlp net_dp;
  torch::optim::Adam adam_dp(net_dp->parameters(), torch::optim::AdamOptions(0.01));
  tl::TrainLoop<Mlp, tl::gpu_mode::DataParallel> dp(net_dp, make_data(40, 1), {}, adam_dp, torch::nn::CrossEntropyLoss(),
                                                    tl::TrainLoopOptions().batch_size(8),
                                                    tl::gpu_mode::DataParallel().devices({torch::kCPU, torch::kCPU}));
  dp.load_checkpoint(last);
  for (size_t i = 0; i < single.net->parameters().size(); ++i) {
    BOOST_TEST(torch::equal(single.net->parameters()[i], net_dp->parameters()[i]));
  }
  // Its weights as safetensors, streamed tensor by tensor: the same weights again.
  tl::interop::dcp_to_safetensors(last, dir / "weights.safetensors");
  Mlp from_safetensors;
  tl::interop::load_safetensors(*from_safetensors, dir / "weights.safetensors");
  for (size_t i = 0; i < single.net->parameters().size(); ++i) {
    BOOST_TEST(torch::equal(single.net->parameters()[i], from_safetensors->parameters()[i]));
  }
  if (!python_present(0)) return;
  // What trainloop read, as Python's torch.load reads it; then Python's dcp.load of the directory.
  c10::Dict<std::string, torch::Tensor> expected;
  auto& state = single.optimizer.state();
  for (const auto& item : single.net->named_parameters()) {
    expected.insert("model." + item.key(), item.value().detach().clone());
    auto& adam = static_cast<torch::optim::AdamParamState&>(*state.at(tl::detail::optimizer_state_key(state, item.value())));
    expected.insert("optim.state." + item.key() + ".exp_avg", adam.exp_avg().clone());
    expected.insert("optim.state." + item.key() + ".exp_avg_sq", adam.exp_avg_sq().clone());
  }
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(expected));
  std::ofstream(dir / "expected.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const auto run = run_python_script(dir, "dcp_interop.py", kPythonScript, "read", {last.string(), (dir / "expected.pt").string()});
  BOOST_TEST_MESSAGE(run.output);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  if (contains(run.output, "TRAINLOOP_TEST_SKIPPED")) return;
  BOOST_TEST(contains(run.output, "tensors 18 equal 18 max_abs_diff 0.0"), run.output);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_python_dcp_save_loads_into_a_trainloop_model, *boost::unit_test::precondition(python_present)) {
  const fs::path dir = fresh_dir("dcp_from_python");
  const auto run = run_python_script(dir, "dcp_interop.py", kPythonScript, "write",
                                     {(dir / "from_python").string(), (dir / "reference.pt").string()});
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  if (contains(run.output, "TRAINLOOP_TEST_SKIPPED")) return;
  Mlp net;
  tl::interop::load_dcp_weights(*net, dir / "from_python");
  Mlp reference;
  tl::interop::load_state_dict(*reference, dir / "reference.pt");
  for (size_t i = 0; i < net->parameters().size(); ++i) BOOST_TEST(torch::equal(net->parameters()[i], reference->parameters()[i]));
  // A weights-only directory resumes nothing: the error says so and names the directory.
  OneProcess one;
  BOOST_TEST(contains(error_of([&] { one.loop.load_checkpoint(dir / "from_python"); }),
                      "is a torch.distributed.checkpoint directory without trainloop's state"));
  // Ours, written from one process, reads back bit for bit.
  tl::interop::save_dcp_weights(*net, dir / "ours");
  Mlp again;
  tl::interop::load_dcp_weights(*again, dir / "ours");
  for (size_t i = 0; i < net->parameters().size(); ++i) BOOST_TEST(torch::equal(net->parameters()[i], again->parameters()[i]));
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(bad_sharded_checkpoints_are_named_and_the_previous_one_is_resumed_instead) {
  const fs::path dir = sharded_run(fresh_dir("dcp_bad"), "TL_TEST_EVERY_STEPS=5");
  const fs::path last = fs::canonical(dir / "last.ckpt");
  auto broken = [&](const std::string& name, const std::function<void(const fs::path&)>& damage) {
    const fs::path copy = dir / "broken" / name;
    fs::create_directories(copy.parent_path());
    fs::copy(last, copy, fs::copy_options::recursive);
    damage(copy);
    OneProcess one;
    return error_of([&] { one.loop.load_checkpoint(copy); });
  };
  const std::string missing = broken("missing.ckpt", [](const fs::path& p) { fs::remove(p / "__1_0.distcp"); });
  BOOST_TEST(contains(missing, "__1_0.distcp"), missing);
  const std::string truncated = broken("truncated.ckpt", [](const fs::path& p) {
    fs::resize_file(p / "__1_0.distcp", fs::file_size(p / "__1_0.distcp") / 2);
  });
  BOOST_TEST(contains(truncated, "__1_0.distcp"), truncated);
  const std::string evil = broken("evil.ckpt", [](const fs::path& p) {
    // pickle.dumps of os.system("echo pwned") as a reduce, protocol 2: what a malicious .metadata holds.
    const std::string pickle("\x80\x02" "cos\nsystem\n" "X\x0a\x00\x00\x00" "echo pwned" "\x85R.", 31);
    std::ofstream(p / ".metadata", std::ios::binary | std::ios::trunc) << pickle;
  });
  BOOST_TEST(contains(evil, ".metadata"), evil);
  BOOST_TEST(contains(evil, "os.system"), evil);
  // Another model's checkpoint: the first parameter that differs, with both shapes.
  struct WideImpl : torch::nn::Module {
    torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
    WideImpl() {
      fc1 = register_module("fc1", torch::nn::Linear(6, 32));
      fc2 = register_module("fc2", torch::nn::Linear(32, 16));
      fc3 = register_module("fc3", torch::nn::Linear(16, 3));
    }
  };
  WideImpl wide;
  const std::string other = error_of([&] { tl::interop::load_dcp_weights(wide, last); });
  BOOST_TEST(contains(other, "parameter 'fc1.weight' has shape [16, 6] in the checkpoint and [32, 6] in the model"), other);
  BOOST_TEST(contains(other, last.string()), other);
  // Resuming "last" from a directory whose newest checkpoint lost a rank's file: the previous one.
  const std::vector<fs::path> candidates = tl::checkpoint_candidates(dir);
  BOOST_REQUIRE(candidates.size() >= 2u);
  fs::remove(candidates.front() / "__0_0.distcp");
  BOOST_TEST_MESSAGE("newest, made unreadable: " << candidates.front() << "; the one before: " << candidates[1]);
  OneProcess one;
  const tl::History history = one.loop.fit(2, tl::CallbackList{std::make_shared<tl::ModelCheckpoint>(
                                                  tl::ModelCheckpointOptions(dir / "resumed"))},
                                           tl::Resume::from(dir));
  // Resumed from step 5 (inside the 2-epoch fit that wrote it), not the finished step 10: 10 steps in all.
  BOOST_TEST(history.total_steps == 10);
  fs::remove_all(dir);
}

// ---- Checkpoints written behind training (loop/background_checkpoint_io.hpp) -----------------------

namespace {

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The periodic checkpoints in `dir`, by name (not a killed writer's temporary directory).
std::vector<std::string> periodic_checkpoints(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("epoch=", 0) == 0 && !tl::detail::is_temporary_name(name)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_checkpoint_written_behind_training_is_the_one_written_in_the_foreground_byte_for_byte_at_every_level) {
  // 2 ranks, Adam, 10 steps, a checkpoint every 2: the same job with training waiting for each
  // checkpoint (TL_TEST_BACKGROUND=0) and with checkpoints written behind it (the default).
  for (const std::string level : {"optimizer", "gradients", "full"}) {
    BOOST_TEST_CONTEXT("sharding " << level) {
      const fs::path dir = fresh_dir("dcp_background_" + level);
      const std::string settings = "TL_TEST_OPTIMIZER=adam TL_TEST_SHARDING=" + level + " TL_TEST_EPOCHS=2 TL_TEST_EVERY_STEPS=2 ";
      auto waited = run_ckpt("fg_" + level, dir / "foreground", settings + "TL_TEST_BACKGROUND=0");
      auto behind = run_ckpt("bg_" + level, dir / "background", settings + "TL_TEST_BACKGROUND=1");
      BOOST_REQUIRE_MESSAGE(waited.exit_code == 0, waited.output);
      BOOST_REQUIRE_MESSAGE(behind.exit_code == 0, behind.output);
      const std::vector<std::string> names = periodic_checkpoints(dir / "background");
      BOOST_TEST(names == periodic_checkpoints(dir / "foreground"), boost::test_tools::per_element());
      // Steps 2, 4, 6, 8, 10 and the epochs' ends (5; 10 again, the same name rewritten right after
      // its step's: it waits for that one): none lost, the last one waited for at the end.
      BOOST_TEST(names.size() == 6u);
      for (const std::string& name : names) {
        for (const std::string file : {".metadata", "__0_0.distcp", "__1_0.distcp"}) {
          BOOST_TEST_CONTEXT(name << "/" << file) {
            const std::string expected = file_bytes(dir / "foreground" / name / file);
            BOOST_TEST(!expected.empty());
            BOOST_TEST((file_bytes(dir / "background" / name / file) == expected));
          }
        }
      }
      BOOST_TEST(fs::canonical(dir / "background" / "last.ckpt").filename() == names.back());
      // The loop's state (trainloop.pt: progress, every rank's random stream) of the same moment:
      // a resume from the background's step-6 checkpoint (inside epoch 2) ends as the uninterrupted job.
      BOOST_REQUIRE(names.size() > 3u);
      auto resumed = run_ckpt("bg_resumed_" + level, dir / "resumed",
                              settings + "TL_TEST_RESUME=" + (dir / "background" / names[3]).string());
      BOOST_REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
      BOOST_TEST(torch::equal(load_params((resumed.dir / "params.pt").string()), load_params((waited.dir / "params.pt").string())));
      BOOST_TEST(torch::equal(load_params((behind.dir / "params.pt").string()), load_params((waited.dir / "params.pt").string())));
      for (const fs::path& d : fs::directory_iterator(dir / "background")) BOOST_TEST(!tl::detail::is_temporary_name(d.filename().string()));
      for (auto* run : {&waited, &behind, &resumed}) fs::remove_all(run->dir);
      fs::remove_all(dir);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_rank_killed_while_its_checkpoint_is_written_behind_training_leaves_the_previous_one_whole) {
  // fsdp full, a checkpoint every 2 steps: rank 1, then rank 0 (the one that commits), killed in
  // its writer thread once its file of step 4's checkpoint is written. The job ends named; step
  // 2's checkpoint is whole and `last`, and a resume from it ends as the uninterrupted job.
  const std::string settings = "TL_TEST_OPTIMIZER=adam TL_TEST_SHARDING=full TL_TEST_EPOCHS=2 TL_TEST_EVERY_STEPS=2 ";
  const fs::path dir = fresh_dir("dcp_background_kill");
  auto whole = run_ckpt("bg_whole", dir / "whole", settings);
  BOOST_REQUIRE_MESSAGE(whole.exit_code == 0, whole.output);
  for (const int rank : {1, 0}) {
    BOOST_TEST_CONTEXT("rank " << rank << " killed") {
      const fs::path ckpts = dir / ("killed" + std::to_string(rank));
      auto killed = run_ckpt("bg_killed" + std::to_string(rank), ckpts,
                             settings + "TRAINLOOP_TEST_KILL_AT=" + std::to_string(rank) + ":4:background-write");
      BOOST_TEST(killed.exit_code != 0);
      BOOST_TEST(contains(killed.output, "RANK_FAILED rank=" + std::to_string(rank)), killed.output);
      BOOST_TEST(periodic_checkpoints(ckpts) == std::vector<std::string>{"epoch=0001-step=000002.ckpt"},
                 boost::test_tools::per_element());
      BOOST_TEST(fs::canonical(ckpts / "last.ckpt").filename() == "epoch=0001-step=000002.ckpt");
      OneProcess one;  // loadable in one process
      BOOST_CHECK_NO_THROW(one.loop.load_checkpoint(ckpts / "last.ckpt"));
      auto resumed = run_ckpt("bg_after_kill" + std::to_string(rank), ckpts, settings + "TL_TEST_RESUME=last");
      BOOST_REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
      BOOST_TEST(torch::equal(load_params((resumed.dir / "params.pt").string()), load_params((whole.dir / "params.pt").string())));
      // The killed write's temporary directory is gone (the resumed job's first writer removed it).
      for (const fs::path& d : fs::directory_iterator(ckpts)) BOOST_TEST(!tl::detail::is_temporary_name(d.filename().string()));
      for (auto* run : {&killed, &resumed}) fs::remove_all(run->dir);
    }
  }
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(whole.dir);
  fs::remove_all(dir);
}

namespace {
/// The worker's CheckpointReportsLog: per checkpoint, whether it went behind training and failed.
std::vector<std::pair<int, int>> checkpoint_reports(const fs::path& run_dir) {
  std::ifstream in(run_dir / "reports.txt");
  std::vector<std::pair<int, int>> reports;
  for (int background = 0, failed = 0; in >> background >> failed;) reports.emplace_back(background, failed);
  return reports;
}
}  // namespace

BOOST_AUTO_TEST_CASE(plain_ddps_one_file_goes_behind_training_resumes_exactly_and_a_kill_in_its_write_leaves_the_previous_one) {
  // Plain DDP (rank 0 writes one file), 2 ranks, Adam, a model over 16 MiB (hidden 2048: 4.2 M
  // parameters), a checkpoint every 2 steps: behind training against training waiting for it.
  const std::string settings = "TL_TEST_OPTIMIZER=adam TL_TEST_HIDDEN=2048 TL_TEST_EPOCHS=2 TL_TEST_EVERY_STEPS=2 ";
  const fs::path dir = fresh_dir("gathered_background");
  auto waited = run_ckpt("gathered_fg", dir / "foreground", settings + "TL_TEST_BACKGROUND=0");
  auto behind = run_ckpt("gathered_bg", dir / "background", settings + "TL_TEST_BACKGROUND=1");
  BOOST_REQUIRE_MESSAGE(waited.exit_code == 0, waited.output);
  BOOST_REQUIRE_MESSAGE(behind.exit_code == 0, behind.output);
  const auto behind_reports = checkpoint_reports(behind.dir), waited_reports = checkpoint_reports(waited.dir);
  BOOST_TEST(behind_reports.size() == 7u);  // steps 2, 4, 6, 8, 10 and the epochs' ends (5; 10 again)
  BOOST_TEST(waited_reports.size() == behind_reports.size());
  for (const auto& [background, failed] : behind_reports) BOOST_TEST((background == 1 && failed == 0));
  for (const auto& [background, failed] : waited_reports) BOOST_TEST((background == 0 && failed == 0));
  const std::vector<std::string> names = periodic_checkpoints(dir / "background");
  BOOST_TEST(names == periodic_checkpoints(dir / "foreground"), boost::test_tools::per_element());
  BOOST_TEST(torch::equal(load_params((behind.dir / "params.pt").string()), load_params((waited.dir / "params.pt").string())));
  // A resume from the checkpoint of step 6 (inside epoch 2), written behind training, ends as the job
  // that waited for every checkpoint.
  BOOST_REQUIRE(names.size() > 3u);
  auto resumed = run_ckpt("gathered_bg_resumed", dir / "resumed", settings + "TL_TEST_RESUME=" + (dir / "background" / names[3]).string());
  BOOST_REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  BOOST_TEST(torch::equal(load_params((resumed.dir / "params.pt").string()), load_params((waited.dir / "params.pt").string())));
  // Rank 0 killed in its writer thread once step 4's file is streamed, before its commit: the job
  // ends named, step 2's checkpoint is whole and `last`, and the resume from it ends as the others.
  const fs::path ckpts = dir / "killed";
  auto killed = run_ckpt("gathered_killed", ckpts, settings + "TRAINLOOP_TEST_KILL_AT=0:4:background-write");
  BOOST_TEST(killed.exit_code != 0);
  BOOST_TEST(contains(killed.output, "RANK_FAILED rank=0"), killed.output);
  BOOST_TEST(periodic_checkpoints(ckpts) == std::vector<std::string>{"epoch=0001-step=000002.ckpt"}, boost::test_tools::per_element());
  BOOST_TEST(fs::canonical(ckpts / "last.ckpt").filename() == "epoch=0001-step=000002.ckpt");
  auto after_kill = run_ckpt("gathered_after_kill", ckpts, settings + "TL_TEST_RESUME=last");
  BOOST_REQUIRE_MESSAGE(after_kill.exit_code == 0, after_kill.output);
  BOOST_TEST(torch::equal(load_params((after_kill.dir / "params.pt").string()), load_params((waited.dir / "params.pt").string())));
  for (const fs::path& entry : fs::directory_iterator(ckpts)) BOOST_TEST(!tl::detail::is_temporary_name(entry.filename().string()));
  BOOST_TEST(leftover_workers() == 0);
  for (auto* run : {&waited, &behind, &resumed, &killed, &after_kill}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}
