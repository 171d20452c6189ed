#define BOOST_TEST_MODULE test_python_weights
#include "unit_test.hpp"

// Weights to and from Python (include/trainloop/interop.hpp), against the real thing: Python's
// torch and torchvision write state_dicts that C++ reads, and read back what C++ writes. Cases
// that need Python are skipped (TRAINLOOP_TEST_SKIPPED, ctest: Skipped) where no python3 imports
// torch and torchvision; the C++-only cases (round trip, strict errors, bad files) always run.

#include "python_reference.hpp"
#include "test_support.hpp"

#include <trainloop/interop.hpp>
#include <trainloop/models/resnet.hpp>

#include <c10/util/Exception.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace interop = trainloop::interop;

namespace {

// ---- Python ---------------------------------------------------------------------------------------

/// Everything Python does for these tests, one script with a command per step.
constexpr const char* kScript = R"PY(
import sys, os, collections
import torch, torch.nn as nn, torchvision
torch.set_num_threads(1)
command, out = sys.argv[1], sys.argv[2]

class SmallNet(nn.Module):  # mirrored by SmallNetImpl in C++: torchvision-style names
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)
    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))

def perturb_batch_norms(model):  # eval-mode logits then depend on every buffer
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.num_batches_tracked.fill_(7)

def manifest(state, path, raw_dir=None):  # name dtype shape per line; raw bytes per tensor
    with open(path, 'w') as f:
        for i, (name, t) in enumerate(state.items()):
            shape = ','.join(str(s) for s in t.shape) or '-'
            f.write(f'{name} {t.dtype} {shape}\n')
            if raw_dir is not None:
                flat = t.detach().contiguous().reshape(-1)
                raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
                with open(os.path.join(raw_dir, f'{i}.bin'), 'wb') as b:
                    b.write(raw.numpy().tobytes())

def every_dtype():
    g = torch.Generator().manual_seed(1)
    class Dtypes(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.tied = nn.Linear(4, 3, bias=False)
            self.tied.weight = self.linear.weight              # one parameter, two names
            base = torch.randn(6, 5, generator=g, dtype=torch.float64)
            self.register_buffer('base', base)
            self.register_buffer('slice', base[1:4, ::2])       # view: offset 5, strides (5, 2)
            self.register_buffer('transposed', base.t())
            for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16]:
                self.register_buffer('b_' + str(dtype)[6:], torch.randn(3, 4, generator=g).to(dtype))
            for dtype in [torch.int64, torch.int32, torch.int8]:
                self.register_buffer('b_' + str(dtype)[6:], torch.randint(-2**7, 2**7 - 1, (2, 3), generator=g).to(dtype))
            self.register_buffer('b_big', torch.tensor([2**40 + 3, -2**35], dtype=torch.int64))
            self.register_buffer('b_uint8', torch.randint(0, 256, (5,), generator=g).to(torch.uint8))
            self.register_buffer('b_bool', torch.randint(0, 2, (2, 2), generator=g).bool())
            self.register_buffer('scalar', torch.tensor(7, dtype=torch.int64))
            self.register_buffer('empty', torch.zeros(0, 3))
    return Dtypes().state_dict()

if command == 'generate':
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    torch.save(model.state_dict(), f'{out}/resnet18.pt')
    manifest(model.state_dict(), f'{out}/resnet18.txt')
    perturb_batch_norms(model)
    model.eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    torch.save(model.state_dict(), f'{out}/resnet18_stats.pt')
    with torch.no_grad():
        torch.save({'x': x, 'logits': model(x)}, f'{out}/resnet18_io.pt')

    os.makedirs(f'{out}/dtypes_raw', exist_ok=True)
    state = every_dtype()
    torch.save(state, f'{out}/dtypes.pt')
    manifest(state, f'{out}/dtypes.txt', f'{out}/dtypes_raw')

    torch.manual_seed(1)
    small = SmallNet()
    perturb_batch_norms(small)
    small.eval()
    torch.save(small.state_dict(), f'{out}/small.pt')
    with torch.no_grad():
        torch.save({'x': x, 'logits': small(x)}, f'{out}/small_io.pt')

    torch.save(small.state_dict(), f'{out}/protocol4.pt', pickle_protocol=4)  # FRAME, MEMOIZE, STACK_GLOBAL
    torch.save(small.state_dict(), f'{out}/legacy.pt', _use_new_zipfile_serialization=False)
    torch.save({'model': small.state_dict(), 'epoch': 3}, f'{out}/nested.pt')
    torch.jit.save(torch.jit.script(small), f'{out}/torchscript.pt')

elif command in ('check_small', 'check_resnet'):  # argv[3]: C++'s weights; argv[4]: C++'s logits
    model = SmallNet() if command == 'check_small' else torchvision.models.resnet18(num_classes=10)
    state = torch.load(sys.argv[3], weights_only=True)  # what PyTorch >= 2.6 does by default
    assert type(state) in (dict, collections.OrderedDict), type(state)
    model.load_state_dict(state)  # strict
    model.eval()
    x = torch.load(f'{out}/resnet18_io.pt', weights_only=True)['x']
    with torch.no_grad():
        logits = model(x)
    expected = torch.load(sys.argv[4], weights_only=True)['logits']
    diff = (logits - expected).abs().max().item()
    print(f'max_abs_diff={diff:.3e} num_batches_tracked={int(state["bn1.num_batches_tracked"])}')
    sys.exit(0 if diff <= 1e-5 else 1)

elif command == 'check_dtypes':  # argv[3]: C++'s file; its tensors' bytes, for C++ to compare
    state = torch.load(sys.argv[3], weights_only=True)
    os.makedirs(f'{out}/cpp_raw', exist_ok=True)
    manifest(state, f'{out}/cpp_dtypes.txt', f'{out}/cpp_raw')
    def storage(t): return t.storage().data_ptr()
    shared = (state['linear.weight'].data_ptr() == state['tied.weight'].data_ptr()
              and storage(state['slice']) == storage(state['base']) == storage(state['transposed']))
    print('shared' if shared else 'not shared')
)PY";

/// A temporary directory holding the script and everything Python writes, made once.
TempDir& work() {
  static TempDir dir("tl-python-weights");
  return dir;
}

/// Runs `command` of the script with the work directory and `args`.
PythonRun run_python(const std::string& command, const std::vector<std::string>& args = {}) {
  return run_python_script(work().path, "weights.py", kScript, command, args);
}

/// The files Python's `generate` writes, made by the first case that needs them.
const fs::path& python_files() {
  static const fs::path dir = [] {
    const auto run = run_python("generate");
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, "Python's generate failed:\n" + run.output);
    return work().path;
  }();
  return dir;
}

// ---- Helpers --------------------------------------------------------------------------------------

/// Python's name of a dtype ("torch.float32").
std::string python_dtype(torch::ScalarType dtype) {
  static const std::map<torch::ScalarType, std::string> names{
      {torch::kFloat, "torch.float32"}, {torch::kDouble, "torch.float64"}, {torch::kHalf, "torch.float16"},
      {torch::kBFloat16, "torch.bfloat16"}, {torch::kLong, "torch.int64"}, {torch::kInt, "torch.int32"},
      {torch::kShort, "torch.int16"}, {torch::kChar, "torch.int8"}, {torch::kByte, "torch.uint8"},
      {torch::kBool, "torch.bool"}};
  return names.at(dtype);
}

/// The manifest line Python writes for a tensor: "name dtype d0,d1" ("-" for no dimensions).
std::string manifest_line(const std::string& name, const torch::Tensor& t) {
  std::string shape;
  for (auto size : t.sizes()) {
    if (!shape.empty()) shape += ',';
    shape += std::to_string(size);
  }
  return name + " " + python_dtype(t.scalar_type()) + " " + (shape.empty() ? "-" : shape);
}

std::vector<std::string> lines_of(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// The tensor's elements as raw bytes, in row-major order (what Python's manifest() writes).
std::string raw_bytes(const torch::Tensor& t) {
  const auto c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

torch::Tensor entry(const interop::StateDict& state, const std::string& name) {
  for (const auto& [key, tensor] : state) {
    if (key == name) return tensor;
  }
  BOOST_FAIL("no entry " + name);
  return {};
}

bool same_storage(const torch::Tensor& a, const torch::Tensor& b) {
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

/// The C++ mirror of the script's SmallNet: torchvision-style names (conv1, bn1, fc).
struct SmallNetImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Linear fc{nullptr};
  explicit SmallNetImpl(int64_t in_channels = 3) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, 8, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(8));
    fc = register_module("fc", torch::nn::Linear(8, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn1(conv1(x)));
    return fc(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
};
TORCH_MODULE(SmallNet);

/// Every parameter and buffer of the model, cloned: to compare before and after.
interop::StateDict snapshot(const torch::nn::Module& module) {
  interop::StateDict copy;
  for (const auto& [name, tensor] : interop::module_state_dict(module)) copy.emplace_back(name, tensor.clone());
  return copy;
}

bool equal_states(const interop::StateDict& a, const interop::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

/// Three SGD steps (lr 0.1) in train mode on seeded random data.
template <class Model>
void train_three_steps(Model& model) {
  torch::manual_seed(11);
  model->train();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 3, 64, 64});
    auto y = torch::randint(0, 10, {4}, torch::kLong);
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    optimizer.step();
  }
}

/// "max_abs_diff=1.2e-07 ..." -> 1.2e-07 (or infinity when Python printed none).
double printed_difference(const std::string& output) {
  const auto at = output.find("max_abs_diff=");
  return at == std::string::npos ? std::numeric_limits<double>::infinity() : std::stod(output.substr(at + 13));
}

/// Python's weights in `model` give Python's logits; 3 C++ SGD steps later, Python given C++'s
/// weights gives C++'s logits. `io`: Python's input and logits; `check`: the script's command.
template <class Model>
void check_both_directions(Model& model, const std::string& weights, const std::string& io, const std::string& check) {
  const auto report = interop::load_state_dict(*model, python_files() / weights);
  BOOST_TEST(report.complete());
  const auto python_io = interop::read_python_state_dict(python_files() / io);
  const auto x = entry(python_io, "x");
  auto eval_logits = [&] {
    torch::NoGradGuard no_grad;
    model->eval();
    return model->forward(x);
  };
  const double from_python = (eval_logits() - entry(python_io, "logits")).abs().max().template item<double>();
  std::cout << weights << ": max |C++ logits - Python logits| = " << from_python << std::endl;
  BOOST_TEST(from_python <= 1e-5);

  train_three_steps(model);
  const auto logits = eval_logits();
  BOOST_REQUIRE(torch::isfinite(logits).all().template item<bool>());
  // Training moved the weights, so Python below checks C++'s weights, not its own coming back.
  BOOST_TEST((logits - entry(python_io, "logits")).abs().max().template item<double>() > 1e-3);
  const auto cpp_weights = work().path / ("cpp_" + weights);
  const auto cpp_logits = work().path / ("cpp_logits_" + weights);
  interop::save_python_state_dict(*model, cpp_weights);
  interop::save_python_state_dict(interop::StateDict{{"logits", logits}}, cpp_logits);
  const auto run = run_python(check, {cpp_weights.string(), cpp_logits.string()});
  std::cout << check << ": " << run.output;
  BOOST_TEST(run.exit_code == 0, run.output);
  BOOST_TEST(printed_difference(run.output) <= 1e-5);
  BOOST_TEST(run.output.find("num_batches_tracked=10") != std::string::npos);  // 7 from Python + 3 steps
}

/// A state_dict of every dtype the reader supports, with a tied tensor and views of one storage.
interop::StateDict every_dtype_state() {
  torch::manual_seed(2);
  const auto base = torch::randn({6, 5}, torch::kDouble);
  const auto weight = torch::randn({3, 4});
  return {{"linear.weight", weight},
          {"tied.weight", weight},
          {"base", base},
          {"slice", base.slice(0, 1, 4).slice(1, 0, 5, 2)},
          {"transposed", base.t()},
          {"float32", torch::randn({3, 4})},
          {"float16", torch::randn({3, 4}).to(torch::kHalf)},
          {"bfloat16", torch::randn({3, 4}).to(torch::kBFloat16)},
          {"int64", torch::tensor({int64_t(1) << 40, -(int64_t(1) << 35), int64_t(3)})},
          {"int32", torch::randint(-1000, 1000, {2, 3}, torch::kInt)},
          {"int8", torch::randint(-128, 127, {2, 3}, torch::kChar)},
          {"uint8", torch::randint(0, 256, {5}, torch::kByte)},
          {"bool", torch::randint(0, 2, {2, 2}).to(torch::kBool)},
          {"scalar", torch::tensor(int64_t(7))},
          {"empty", torch::zeros({0, 3})}};
}

}  // namespace

// ---- Python writes, C++ reads ---------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(reads_torchvision_resnet18_state_dict, *boost::unit_test::precondition(python_present)) {
  const auto state = interop::read_python_state_dict(python_files() / "resnet18.pt");
  const auto expected = lines_of(python_files() / "resnet18.txt");
  BOOST_TEST(expected.size() == 122u);  // 62 parameters, 60 batch-norm buffers
  BOOST_REQUIRE(state.size() == expected.size());
  for (size_t i = 0; i < state.size(); ++i) BOOST_TEST(manifest_line(state[i].first, state[i].second) == expected[i]);
}

BOOST_AUTO_TEST_CASE(reads_every_dtype_and_shared_storage_exactly, *boost::unit_test::precondition(python_present)) {
  const auto state = interop::read_python_state_dict(python_files() / "dtypes.pt");
  const auto expected = lines_of(python_files() / "dtypes.txt");
  BOOST_REQUIRE(state.size() == expected.size());
  for (size_t i = 0; i < state.size(); ++i) {
    BOOST_TEST(manifest_line(state[i].first, state[i].second) == expected[i]);
    BOOST_TEST(raw_bytes(state[i].second) == bytes_of(python_files() / "dtypes_raw" / (std::to_string(i) + ".bin")),
               state[i].first << " differs from Python's values");
  }
  // Tied and viewed tensors are views of one storage again, at Python's offsets and strides.
  BOOST_TEST(entry(state, "linear.weight").data_ptr() == entry(state, "tied.weight").data_ptr());
  const auto base = entry(state, "base");
  const auto slice = entry(state, "slice");
  BOOST_TEST(same_storage(slice, base));
  BOOST_TEST(same_storage(entry(state, "transposed"), base));
  BOOST_TEST(slice.storage_offset() == 5);
  BOOST_TEST((slice.strides() == c10::IntArrayRef{5, 2}));
  BOOST_TEST(torch::equal(slice, base.slice(0, 1, 4).slice(1, 0, 5, 2)));
  BOOST_TEST(entry(state, "scalar").dim() == 0);
  BOOST_TEST(entry(state, "scalar").item<int64_t>() == 7);
}

BOOST_AUTO_TEST_CASE(small_model_both_directions, *boost::unit_test::precondition(python_present)) {
  SmallNet model;
  check_both_directions(model, "small.pt", "small_io.pt", "check_small");
}

BOOST_AUTO_TEST_CASE(resnet18_both_directions, *boost::unit_test::precondition(python_present)) {
  auto model = trainloop::models::resnet18(trainloop::models::ImageModelOptions().num_classes(10));
  check_both_directions(model, "resnet18_stats.pt", "resnet18_io.pt", "check_resnet");
}

// ---- C++ writes, Python reads ---------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(python_reads_every_dtype_and_shared_storage, *boost::unit_test::precondition(python_present)) {
  const auto state = every_dtype_state();
  const auto file = work().path / "cpp_dtypes.pt";
  interop::save_python_state_dict(state, file);
  const auto run = run_python("check_dtypes", {file.string()});
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.output.find("not shared") == std::string::npos, run.output);
  const auto lines = lines_of(work().path / "cpp_dtypes.txt");
  BOOST_REQUIRE(lines.size() == state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    BOOST_TEST(lines[i] == manifest_line(state[i].first, state[i].second));
    BOOST_TEST(raw_bytes(state[i].second) == bytes_of(work().path / "cpp_raw" / (std::to_string(i) + ".bin")),
               state[i].first << " differs in Python");
  }
}

// ---- C++ only ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(round_trip_in_cpp_keeps_values_dtypes_and_sharing) {
  TempDir dir;
  const auto state = every_dtype_state();
  interop::save_python_state_dict(state, dir.path / "state.pt");
  const auto back = interop::read_python_state_dict(dir.path / "state.pt");
  BOOST_REQUIRE(back.size() == state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    BOOST_TEST(back[i].first == state[i].first);
    BOOST_TEST(manifest_line(back[i].first, back[i].second) == manifest_line(state[i].first, state[i].second));
    BOOST_TEST(raw_bytes(back[i].second) == raw_bytes(state[i].second), state[i].first);
  }
  BOOST_TEST(entry(back, "linear.weight").data_ptr() == entry(back, "tied.weight").data_ptr());
  BOOST_TEST(same_storage(entry(back, "slice"), entry(back, "base")));
  BOOST_TEST(same_storage(entry(back, "transposed"), entry(back, "base")));
  // A module: parameters and buffers (num_batches_tracked, int64) by Python's names and order.
  SmallNet model;
  interop::save_python_state_dict(*model, dir.path / "model.pt");
  const auto names = interop::read_python_state_dict(dir.path / "model.pt");
  std::vector<std::string> keys;
  for (const auto& [name, tensor] : names) keys.push_back(name);
  BOOST_TEST(keys == (std::vector<std::string>{"conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean",
                                               "bn1.running_var", "bn1.num_batches_tracked", "fc.weight", "fc.bias"}),
             boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(strict_load_lists_every_difference_and_changes_nothing) {
  TempDir dir;
  // A state_dict of a 1-channel SmallNet, without fc and with an entry the model lacks.
  SmallNet other(1);
  interop::StateDict state;
  for (const auto& [name, tensor] : interop::module_state_dict(*other)) {
    if (name.rfind("fc.", 0) != 0) state.emplace_back(name, tensor);
  }
  state.emplace_back("classifier.weight", torch::zeros({10, 8}));
  const auto file = dir.path / "resnet18.pt";
  interop::save_python_state_dict(state, file);

  SmallNet model;
  const auto before = snapshot(*model);
  const std::string message = error_of([&] { interop::load_state_dict(*model, file); });
  BOOST_TEST(message == "trainloop: state_dict " + file.string() + " does not fit the model: 2 missing (fc.weight, "
                        "fc.bias), 1 unexpected (classifier.weight), 1 wrong shape (conv1.weight is [8, 1, 3, 3] in the "
                        "file; expected [8, 3, 3, 3]); expected a state_dict of this model (nothing was loaded; "
                        "LoadOptions{.strict = false} loads what fits)");
  BOOST_TEST(equal_states(snapshot(*model), before));  // all or nothing: bn1 was not copied either
  BOOST_CHECK_THROW(interop::load_state_dict(*model, state), trainloop::CheckpointError);
  BOOST_TEST(equal_states(snapshot(*model), before));

  // Not strict: what fits is copied (bn1), the rest reported and left as it was.
  const auto report = interop::load_state_dict(*model, file, interop::LoadOptions{.strict = false});
  BOOST_TEST(!report.complete());
  BOOST_TEST(report.missing == (std::vector<std::string>{"fc.weight", "fc.bias"}), boost::test_tools::per_element());
  BOOST_TEST(report.unexpected == (std::vector<std::string>{"classifier.weight"}), boost::test_tools::per_element());
  BOOST_REQUIRE(report.mismatched.size() == 1u);
  BOOST_TEST(report.mismatched[0].name == "conv1.weight");
  BOOST_TEST(report.mismatched[0].in_file == (std::vector<int64_t>{8, 1, 3, 3}), boost::test_tools::per_element());
  BOOST_TEST(report.mismatched[0].in_model == (std::vector<int64_t>{8, 3, 3, 3}), boost::test_tools::per_element());
  BOOST_TEST(report.loaded.size() == 5u);  // bn1: weight, bias, running_mean, running_var, num_batches_tracked
  BOOST_TEST(torch::equal(model->bn1->running_var, other->bn1->running_var));
  BOOST_TEST(torch::equal(model->conv1->weight, entry(before, "conv1.weight")));
  BOOST_TEST(torch::equal(model->fc->weight, entry(before, "fc.weight")));
}

BOOST_AUTO_TEST_CASE(load_converts_dtype_and_reads_a_trainloop_checkpoint) {
  TempDir dir;
  SmallNet source;
  {
    torch::NoGradGuard no_grad;
    source->bn1->running_mean.uniform_(-1, 1);
    source->bn1->num_batches_tracked.fill_(5);
  }
  // A double-precision copy of the state: loading converts to the model's float.
  interop::StateDict doubles;
  for (const auto& [name, tensor] : interop::module_state_dict(*source)) {
    doubles.emplace_back(name, tensor.is_floating_point() ? tensor.to(torch::kDouble) : tensor);
  }
  SmallNet model;
  BOOST_TEST(interop::load_state_dict(*model, doubles).complete());
  BOOST_TEST(model->conv1->weight.scalar_type() == torch::kFloat);
  BOOST_TEST(torch::equal(model->conv1->weight, source->conv1->weight));
  BOOST_TEST(model->bn1->num_batches_tracked.item<int64_t>() == 5);

  // A trainloop checkpoint's layout (checkpoint/checkpoint_file.hpp): the model as torch::save
  // writes it, trainloop's state under its own key, which is not part of the model.
  torch::serialize::OutputArchive archive;
  source->save(archive);
  torch::serialize::OutputArchive ours;
  ours.write("format_version", c10::IValue(int64_t(1)));
  ours.write("rng", torch::zeros({4}));
  archive.write(trainloop::detail::kCheckpointKey, ours);
  archive.save_to((dir.path / "last.ckpt").string());
  SmallNet restored;
  BOOST_TEST(interop::load_state_dict(*restored, dir.path / "last.ckpt").complete());
  BOOST_TEST(equal_states(snapshot(*restored), snapshot(*source)));
}

BOOST_AUTO_TEST_CASE(files_that_are_not_state_dicts_say_what_they_are) {
  TempDir dir;
  SmallNet model;
  const auto missing = dir.path / "missing.pt";
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(missing); }) ==
             "trainloop: state_dict file " + missing.string() + " does not exist; expected a file written by Python's "
             "torch.save(model.state_dict(), path) (the zip format, PyTorch >= 1.6)");
  const auto text = dir.path / "notes.txt";
  std::ofstream(text) << "not weights\n";
  BOOST_TEST(error_of([&] { interop::load_state_dict(*model, text); }).find(text.string() + " is not a zip archive, so "
                                                                              "not a torch archive; expected") !=
             std::string::npos);
  // The start of every legacy (pre-1.6) torch.save file: a pickled magic number.
  const auto legacy = dir.path / "legacy.pt";
  std::ofstream(legacy, std::ios::binary) << std::string("\x80\x02\x8a\x0al\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(legacy); }).find(" is a legacy torch.save file") !=
             std::string::npos);
  // A TorchScript archive (torch::save of a module) without trainloop's state.
  const auto scripted = dir.path / "module.pt";
  torch::save(model, scripted.string());
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(scripted); }).find(" is a TorchScript archive") !=
             std::string::npos);
  // load_state_dict reads its module's tensors by name, with trainloop's own unpickler: no code
  // of the archive is compiled or run.
  SmallNet from_archive;
  BOOST_TEST(interop::load_state_dict(*from_archive, scripted).complete());
  BOOST_TEST(equal_states(snapshot(*from_archive), snapshot(*model)));
  // A truncated file: its zip directory is gone, which is found before libtorch reads anything.
  interop::save_python_state_dict(*model, dir.path / "whole.pt");
  const auto whole = bytes_of(dir.path / "whole.pt");
  const auto truncated = dir.path / "truncated.pt";
  std::ofstream(truncated, std::ios::binary) << whole.substr(0, whole.size() / 2);
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(truncated); })
                 .find(truncated.string() + " is truncated or corrupt (a zip archive with no end-of-central-directory record") !=
             std::string::npos);
}

BOOST_AUTO_TEST_CASE(python_files_that_are_not_state_dicts, *boost::unit_test::precondition(python_present)) {
  const auto& dir = python_files();
  SmallNet model;
  BOOST_TEST(error_of([&] { interop::load_state_dict(*model, dir / "legacy.pt"); })
                 .find(" is a legacy torch.save file (a bare pickle") != std::string::npos);
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(dir / "torchscript.pt"); })
                 .find(" is a TorchScript archive") != std::string::npos);
  BOOST_TEST(error_of([&] { interop::read_python_state_dict(dir / "nested.pt"); })
                 .find("holds a dict under \"model\"; expected a tensor") != std::string::npos);
  // Protocol 4 (torch.save(..., pickle_protocol=4)) reads as the default protocol 2 does.
  BOOST_TEST(interop::load_state_dict(*model, dir / "protocol4.pt").loaded.size() == 8u);
  BOOST_TEST(equal_states(interop::read_python_state_dict(dir / "protocol4.pt"),
                          interop::read_python_state_dict(dir / "small.pt")));
}
