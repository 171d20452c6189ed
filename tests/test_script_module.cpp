#define BOOST_TEST_MODULE test_script_module
#include "unit_test.hpp"

// TorchScript models (interop::ScriptModule) against the real thing: Python's torch and
// torchvision script the models and train the eager reference; C++ trains the scripted ones
// through TrainLoop in single, dp and ddp, resumes them, and saves them back for Python. Cases
// that need Python are skipped where no python3 imports torch and torchvision; the C++-only
// cases (a module defined in C++ TorchScript) always run.

#include "python_reference.hpp"
#include "test_paths.hpp"
#include "test_support.hpp"

#include <trainloop/interop.hpp>
#include <trainloop/trainloop.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace tl = trainloop;
namespace interop = trainloop::interop;

namespace {

constexpr const char* kScript = R"PY(
import sys, os, collections
import torch, torch.nn as nn, torchvision
torch.set_num_threads(1)
command, out = sys.argv[1], sys.argv[2]

class SmallNet(nn.Module):  # no BatchNorm: ranks' batch statistics would differ from one process's
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))

class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
    def forward(self, x, y):
        return self.fc(x) + y

def save_tensors(name, **tensors):
    torch.save(collections.OrderedDict(tensors), os.path.join(out, name))

def sgd_steps(model, x, y, steps):  # what script_module_worker and the C++ cases do
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

if command == 'generate':
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10)
    torch.jit.script(resnet).save(os.path.join(out, 'resnet18.pt'))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    save_tensors('resnet_data.pt', x=x, y=y)
    sgd_steps(resnet, x, y, 3)
    torch.save(resnet.state_dict(), os.path.join(out, 'resnet18_eager_3_steps.pt'))
    resnet.eval()
    torch.jit.trace(resnet, x[:1]).save(os.path.join(out, 'traced.pt'))
    torch.save(resnet.state_dict(), os.path.join(out, 'state_dict.pt'))
    torch.jit.script(SmallNet()).save(os.path.join(out, 'smallnet.pt'))
    save_tensors('small_data.pt', x=torch.randn(24, 3, 8, 8), y=torch.randint(0, 10, (24,)))
    torch.jit.script(TwoInputs()).save(os.path.join(out, 'two_inputs.pt'))
elif command == 'check_saved':  # argv[3]: C++'s TorchScript file, [4]: C++'s state_dict, [5]: the reference
    saved = torch.jit.load(sys.argv[3]).state_dict()
    cpp, reference = torch.load(sys.argv[4]), torch.load(sys.argv[5])
    assert list(saved.keys()) == list(cpp.keys()), 'the saved model has other names than C++ wrote'
    to_cpp = max((saved[k].double() - cpp[k].double()).abs().max().item() for k in saved)
    to_reference = max((saved[k].double() - reference[k].double()).abs().max().item() for k in saved)
    print(f'saved_vs_cpp={to_cpp:.6g} saved_vs_reference={to_reference:.6g}')
)PY";

TempDir& work() {
  static TempDir dir("tl-script-module");
  return dir;
}

/// The files Python's `generate` writes, made by the first case that needs them.
const fs::path& python_files() {
  static const fs::path dir = [] {
    const auto run = run_python_script(work().path, "script_models.py", kScript, "generate");
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, "Python's generate failed:\n" + run.output);
    return work().path;
  }();
  return dir;
}

/// "name=1.2e-07 ..." -> 1.2e-07 (infinity when absent).
double printed(const std::string& output, const std::string& name) {
  const auto at = output.find(name + "=");
  return at == std::string::npos ? std::numeric_limits<double>::infinity() : std::stod(output.substr(at + name.size() + 1));
}

/// Largest |a - b| over entries of the same names; both must list the same names in order.
double max_difference(const interop::StateDict& a, const interop::StateDict& b) {
  BOOST_REQUIRE_EQUAL(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    BOOST_REQUIRE_EQUAL(a[i].first, b[i].first);
    worst = std::max(worst, (a[i].second.to(torch::kDouble) - b[i].second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

bool bitwise_equal(const interop::StateDict& a, const interop::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

std::pair<torch::Tensor, torch::Tensor> inputs_and_labels(const fs::path& file) {
  torch::Tensor x, y;
  for (auto& [name, tensor] : interop::read_python_state_dict(file)) (name == "x" ? x : y) = tensor;
  return {x, y};
}

/// Runs script_module_worker; returns its exit status (its output goes to `log`).
int run_worker(const fs::path& model, const fs::path& data, const fs::path& out, const std::string& mode, int batch,
               int epochs, const std::string& checkpoint_args = "") {
  fs::create_directories(out);
  const std::string line = std::string("'") + test_program("script_module_worker") + "' '" + model.string() + "' '" + data.string() + "' '" +
                           out.string() + "' " + mode + " " + std::to_string(batch) + " " + std::to_string(epochs) + " " +
                           checkpoint_args + " > '" + (out / "log.txt").string() + "' 2>&1";
  const int status = std::system(line.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string log_of(const fs::path& out) {
  std::ifstream in(out / "log.txt");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// A TorchScript module written in C++ (no Python needed): one linear layer with a bias buffer.
torch::jit::Module cpp_scripted_linear() {
  torch::manual_seed(3);
  torch::jit::Module module("Linear");
  module.register_attribute("training", c10::BoolType::get(), true);  // what Python's nn.Module has
  module.register_parameter("weight", (torch::randn({3, 4}) * 0.5).requires_grad_(), /*is_buffer=*/false);
  module.register_parameter("bias", torch::zeros({3}, torch::requires_grad()), /*is_buffer=*/false);
  module.register_buffer("offset", torch::full({3}, 0.25));
  module.define(R"JIT(
def forward(self, x):
    return torch.matmul(x, self.weight.t()) + self.bias + self.offset
)JIT");
  return module;
}

}  // namespace

// ---- C++ only ----------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(a_scripted_module_shares_its_tensors_and_trains_in_single_and_dp) {
  auto train = [](auto mode) {
    interop::ScriptModule model(cpp_scripted_linear());
    torch::manual_seed(1);
    auto x = torch::randn({20, 4});
    auto y = torch::randint(0, 3, {20});
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    tl::TrainLoop<interop::ScriptModule, decltype(mode)> loop(model, tl::data::TensorDataset(x, y), {}, optimizer,
                                                              torch::nn::CrossEntropyLoss(),
                                                              tl::TrainLoopOptions().batch_size(10).shuffle(false), mode);
    loop.fit(3);
    return model;
  };
  auto single = train(tl::gpu_mode::Single());
  auto dp = train(tl::gpu_mode::DataParallel::cpu_replicas(2));
  // The mirror holds the scripted module's own tensors: what the optimizer changed is what the
  // scripted code computes with.
  BOOST_TEST(single->named_parameters()["weight"].data_ptr() == single->scripted().attr("weight").toTensor().data_ptr());
  const double difference = max_difference(interop::module_state_dict(*single), interop::module_state_dict(*dp));
  BOOST_TEST_MESSAGE("C++ TorchScript linear, 6 SGD steps: max |single - dp| = " << difference);
  BOOST_TEST(difference <= 1e-6);
  BOOST_TEST(!torch::equal(single->named_parameters()["weight"], cpp_scripted_linear().attr("weight").toTensor()));

  // Saved and loaded back: the trained weights, the same outputs.
  TempDir dir("tl-script-save");
  single->save(dir.path / "linear.pt");
  auto loaded = torch::jit::load((dir.path / "linear.pt").string());
  BOOST_TEST(torch::equal(loaded.attr("weight").toTensor(), single->named_parameters()["weight"]));
  auto input = torch::randn({2, 4});
  BOOST_TEST(torch::equal(loaded.forward({input}).toTensor(), single->forward(input)));
}

BOOST_AUTO_TEST_CASE(train_and_eval_reach_the_scripted_module) {
  interop::ScriptModule model(cpp_scripted_linear());
  model->eval();
  BOOST_TEST(!model->scripted().is_training());
  model->train();
  BOOST_TEST(model->scripted().is_training());
  BOOST_TEST(model->layers_ignoring_mode().empty());
}

BOOST_AUTO_TEST_CASE(files_that_are_not_torchscript_are_clear_errors) {
  TempDir dir("tl-script-bad");
  auto message_of = [](const fs::path& path) {
    try {
      interop::ScriptModule model(path);
    } catch (const tl::Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  const auto missing = message_of(dir.path / "absent.pt");
  BOOST_TEST(missing.find("does not exist") != std::string::npos, missing);
  std::ofstream(dir.path / "notes.txt") << "not a model";
  const auto text = message_of(dir.path / "notes.txt");
  BOOST_TEST(text.find("not a zip archive") != std::string::npos, text);
  // A trainloop checkpoint is a TorchScript-format archive without a forward.
  auto linear = torch::nn::Linear(2, 2);
  torch::serialize::OutputArchive archive;
  linear->save(archive);
  archive.write(tl::detail::kCheckpointKey, torch::zeros({1}));
  archive.save_to((dir.path / "checkpoint.pt").string());
  const auto checkpoint = message_of(dir.path / "checkpoint.pt");
  BOOST_TEST(checkpoint.find("trainloop checkpoint, not a TorchScript model") != std::string::npos, checkpoint);
}

// ---- Against Python ------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(scripted_torchvision_resnet18_trains_like_python_eager, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  interop::ScriptModule model(dir / "resnet18.pt");
  BOOST_TEST(model->is_training() == model->scripted().is_training());  // as saved; the loop sets the mode it needs
  const auto reference = interop::read_python_state_dict(dir / "resnet18_eager_3_steps.pt");
  auto [x, y] = inputs_and_labels(dir / "resnet_data.pt");
  torch::set_num_threads(1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  tl::TrainLoop<interop::ScriptModule> loop(model, tl::data::TensorDataset(x, y), {}, optimizer,
                                            torch::nn::CrossEntropyLoss(),
                                            // Python's eager run is contiguous. In Python 1.13 itself,
                                            // channels-last differs from it by 7e-7 after one step and,
                                            // at lr 0.1 on a batch of 8, by 9e-3 after three.
                                            // One intra-op thread, as Python's: with libtorch 2.11's kernels
                                            // 2 threads reduce in another order (3e-7 after one step, 1e-2
                                            // after three; the same holds for C++ without trainloop).
                                            tl::TrainLoopOptions().batch_size(8).shuffle(false).num_threads(1).memory_format(
                                                tl::MemoryFormat::contiguous));
  loop.fit(3);  // 3 SGD steps on the whole batch, BatchNorm in train mode
  const auto trained = interop::module_state_dict(*model);
  const double difference = max_difference(trained, reference);  // parameters and running statistics, by name
  BOOST_TEST_MESSAGE("scripted resnet18, 3 SGD steps: max |C++ - Python eager| = " << difference << " over "
                                                                                    << trained.size() << " tensors");
  BOOST_TEST(difference <= 2e-5);

  model->save(work().path / "resnet18_trained.pt");
  interop::save_python_state_dict(*model, work().path / "resnet18_trained_state.pt");
  const auto check = run_python_script(work().path, "script_models.py", kScript, "check_saved",
                                       {(work().path / "resnet18_trained.pt").string(),
                                        (work().path / "resnet18_trained_state.pt").string(),
                                        (dir / "resnet18_eager_3_steps.pt").string()});
  BOOST_REQUIRE_MESSAGE(check.exit_code == 0, check.output);
  BOOST_TEST_MESSAGE("Python's torch.jit.load of C++'s file: " << check.output);
  BOOST_TEST(printed(check.output, "saved_vs_cpp") == 0.0);
  BOOST_TEST(printed(check.output, "saved_vs_reference") <= 2e-5);
}

BOOST_AUTO_TEST_CASE(a_scripted_model_trains_alike_in_single_dp_and_ddp, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  const auto model = dir / "smallnet.pt", data = dir / "small_data.pt";
  // 24 samples, 3 epochs: 9 steps of 8 samples (one process, 2 replicas) or 2 ranks x 4.
  BOOST_REQUIRE_MESSAGE(run_worker(model, data, dir / "single", "single", 8, 3) == 0, log_of(dir / "single"));
  BOOST_REQUIRE_MESSAGE(run_worker(model, data, dir / "dp", "dp", 8, 3) == 0, log_of(dir / "dp"));
  BOOST_REQUIRE_MESSAGE(run_worker(model, data, dir / "ddp", "ddp", 4, 3) == 0, log_of(dir / "ddp"));
  const auto single = interop::read_python_state_dict(dir / "single" / "state.pt");
  const double dp = max_difference(single, interop::read_python_state_dict(dir / "dp" / "state.pt"));
  const double ddp = max_difference(single, interop::read_python_state_dict(dir / "ddp" / "state.pt"));
  BOOST_TEST_MESSAGE("scripted SmallNet, 9 SGD steps: max |single - dp| = " << dp << ", max |single - ddp| = " << ddp);
  BOOST_TEST(dp <= 1e-6);
  BOOST_TEST(ddp <= 1e-6);
  // The trained TorchScript file the caller wrote after ddp holds the trained weights.
  interop::ScriptModule reloaded(dir / "ddp" / "model.pt");
  BOOST_TEST(max_difference(interop::module_state_dict(*reloaded), interop::read_python_state_dict(dir / "ddp" / "state.pt")) == 0.0);
}

BOOST_AUTO_TEST_CASE(a_scripted_model_resumes_bit_for_bit, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  const auto model = dir / "smallnet.pt", data = dir / "small_data.pt";
  for (const std::string mode : {"single", "ddp"}) {
    const int batch = mode == "single" ? 8 : 4;
    const auto straight = dir / ("straight_" + mode), halves = dir / ("halves_" + mode);
    BOOST_REQUIRE_MESSAGE(run_worker(model, data, straight, mode, batch, 4) == 0, log_of(straight));
    const std::string checkpoints = "'" + (halves / "checkpoints").string() + "'";
    BOOST_REQUIRE_MESSAGE(run_worker(model, data, halves, mode, batch, 2, checkpoints) == 0, log_of(halves));
    BOOST_REQUIRE_MESSAGE(run_worker(model, data, halves, mode, batch, 2, checkpoints + " resume") == 0, log_of(halves));
    BOOST_TEST(bitwise_equal(interop::read_python_state_dict(straight / "state.pt"),
                             interop::read_python_state_dict(halves / "state.pt")),
               mode << ": 4 epochs straight vs 2 + resumed 2");
  }
}

BOOST_AUTO_TEST_CASE(python_files_of_other_kinds_are_clear_errors, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  try {
    interop::ScriptModule model(dir / "state_dict.pt");
    BOOST_FAIL("a state_dict loaded as a TorchScript model");
  } catch (const tl::CheckpointError& error) {
    BOOST_TEST(std::string(error.what()).find("written by torch.save") != std::string::npos, error.what());
  }
  try {
    interop::ScriptModule model(dir / "two_inputs.pt");
    BOOST_FAIL("a forward of two tensors accepted");
  } catch (const tl::ConfigurationError& error) {
    const std::string message = error.what();
    BOOST_TEST(message.find("Tensor x, Tensor y) -> Tensor") != std::string::npos, message);
    BOOST_TEST(message.find("expected forward(self, x: Tensor) -> Tensor") != std::string::npos, message);
  }
}

BOOST_AUTO_TEST_CASE(a_traced_model_is_named_as_ignoring_train_and_eval, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  interop::ScriptModule traced(dir / "traced.pt");
  BOOST_TEST(traced->layers_ignoring_mode().size() == 20u);  // resnet18's BatchNorm layers
  BOOST_TEST(traced->layers_ignoring_mode().front() == "bn1 (BatchNorm2d)");
  interop::ScriptModule scripted(dir / "resnet18.pt");
  BOOST_TEST(scripted->layers_ignoring_mode().empty());
}
