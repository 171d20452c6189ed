#pragma once
/// @file
/// @brief TorchScript models as trainloop models: a model written in Python (timm, torchvision,
/// your own) and saved with `torch.jit.script(model).save(path)` trains in every mode, with
/// checkpoints and exact resume, and saves back as a file Python's `torch.jit.load` reads.
///
/// @code
/// auto model = trainloop::interop::ScriptModule("resnet18_scripted.pt");
/// torch::optim::SGD optimizer(model->parameters(), 0.1);
/// trainloop::TrainLoop<trainloop::interop::ScriptModule> loop(model, train, test, optimizer, criterion);
/// loop.fit(3);
/// model->save("trained.pt");  // Python: torch.jit.load("trained.pt")
/// @endcode
///
/// How: the scripted module's parameters and buffers are registered, as the same tensors, in a
/// tree of torch::nn::Module nodes with the scripted module's names ("layer1.0.bn1.weight"), so
/// the optimizer, the checkpoints, `to(device)`, the DDP reducer and state_dict interop see an
/// ordinary module while the scripted code computes with the very same storage.
///
/// train()/eval() reach the scripted module: a module from `torch::jit::load` starts in eval
/// mode, and the loop sets the mode each phase needs. A *traced* model (`torch.jit.trace`) has
/// its BatchNorm and Dropout behaviour frozen at the mode it was traced in, whatever mode is set
/// later; such layers are detected (their code never reads `training`) and named in a warning.
/// Script the model instead (`torch.jit.script`) to train it.

#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/error.hpp>
#include <trainloop/interop/python_state_dict.hpp>

#include <torch/csrc/jit/serialization/export.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::interop {

namespace detail {

/// The unqualified class name of a scripted module ("BatchNorm2d" for
/// `__torch__.torch.nn.modules.batchnorm.BatchNorm2d`).
inline std::string script_class_name(const torch::jit::Module& module) {
  const auto& qualified = module.type()->name();
  return qualified ? qualified->name() : std::string("ScriptModule");
}

/// Registers `from`'s parameters, buffers and children in `into` under the same names, sharing
/// the tensors (not copies): an update through either is seen by both.
inline void mirror_script_module(torch::nn::Module& into, const torch::jit::Module& from) {
  for (const auto& parameter : from.named_parameters(/*recurse=*/false)) {
    if (parameter.value.defined()) into.register_parameter(parameter.name, parameter.value, parameter.value.requires_grad());
  }
  for (const auto& buffer : from.named_buffers(/*recurse=*/false)) {
    if (buffer.value.defined()) into.register_buffer(buffer.name, buffer.value);
  }
  for (const auto& child : from.named_children()) {
    auto node = std::make_shared<torch::nn::Module>(script_class_name(child.value));
    mirror_script_module(*node, child.value);
    into.register_module(child.name, node);
  }
}

/// True when `method`'s code reads the module's `training` attribute.
inline bool reads_training_flag(const torch::jit::Method& method) {
  for (const auto* node : method.graph()->nodes()) {
    if (node->kind() == c10::prim::GetAttr && node->s(c10::attr::name) == "training") return true;
  }
  return false;
}

/// The layers whose behaviour depends on train()/eval() in eager PyTorch but whose scripted code
/// never reads `training`: what torch.jit.trace leaves of BatchNorm and Dropout.
inline std::vector<std::string> layers_ignoring_mode(const torch::jit::Module& root) {
  std::vector<std::string> frozen;
  for (const auto& item : root.named_modules()) {
    const std::string kind = script_class_name(item.value);
    const bool mode_dependent = kind.find("BatchNorm") != std::string::npos || kind.find("Dropout") != std::string::npos;
    if (!mode_dependent) continue;
    auto forward = item.value.find_method("forward");
    if (forward && !reads_training_flag(*forward)) frozen.push_back(item.name.empty() ? kind : item.name + " (" + kind + ")");
  }
  return frozen;
}

/// Checks the scripted forward takes one tensor and returns one, as the loop calls it.
inline void check_forward_signature(const torch::jit::Module& module, const std::filesystem::path& path) {
  auto forward = module.find_method("forward");
  if (!forward && module.hasattr(trainloop::detail::kCheckpointKey)) {
    throw CheckpointError(trainloop::detail::concat(
        "trainloop: ", path.string(), " is a trainloop checkpoint, not a TorchScript model; expected a TorchScript file "
        "written by torch.jit.script(model).save(path) (load a checkpoint's weights with interop::load_state_dict)"));
  }
  if (!forward) {
    throw ConfigurationError(trainloop::detail::concat("trainloop: the TorchScript model ", path.string(),
                                                       " has no forward method; expected forward(self, x: Tensor) -> Tensor"));
  }
  const auto& schema = forward->function().getSchema();
  const auto& arguments = schema.arguments();  // arguments[0] is self
  size_t required = 0;
  for (size_t i = 1; i < arguments.size(); ++i) required += arguments[i].default_value() ? 0 : 1;
  const bool takes_tensor = arguments.size() >= 2 && required <= 1 && arguments[1].type()->kind() == c10::TypeKind::TensorType;
  const auto& returns = schema.returns();
  const bool returns_tensor = returns.size() == 1 && returns[0].type()->kind() == c10::TypeKind::TensorType;
  if (!takes_tensor || !returns_tensor) {
    std::ostringstream signature;
    signature << schema;
    throw ConfigurationError(trainloop::detail::concat(
        "trainloop: the TorchScript model ", path.string(), "'s forward is ", signature.str(),
        "; expected forward(self, x: Tensor) -> Tensor (one tensor in, one tensor out) for the (input, target) "
        "contract. Wrap the model in Python in a module whose forward has that signature, or train it through a C++ "
        "module that defines batch_loss/batch_predictions and calls the scripted methods"));
  }
}

/// Loads a TorchScript archive, with errors that say what the file is instead.
inline torch::jit::Module load_script_archive(const std::filesystem::path& path) {
  constexpr const char* expected = "expected a TorchScript file written by torch.jit.script(model).save(path)";
  {
    // open_archive names a missing file, a legacy pickle or a non-zip; a torch.save archive is
    // told apart by its missing compiled code.
    auto archive = detail::open_archive(path);
    if (!archive.is_torchscript()) {
      throw CheckpointError(trainloop::detail::concat(
          "trainloop: ", path.string(), " is a file written by torch.save (a state_dict or a pickled object), not a ",
          "TorchScript model; ", expected, " (load a state_dict into a zoo model with interop::load_state_dict)"));
    }
    // The model's code runs, as with torch.jit.load; its pickles are first read by the safe
    // unpickler, so no nesting or declared size in them reaches libtorch's.
    archive.check_pickles();
    archive.check_code_nesting();  // libtorch's parser recurses once per bracket level, unbounded
  }
  try {
    return torch::jit::load(path.string(), torch::kCPU);
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(trainloop::detail::concat(
        "trainloop: ", path.string(), " could not be loaded as a TorchScript model (", detail::first_line(error), "); ",
        expected)));
  }
}

}  // namespace detail

/// @brief A TorchScript model as a torch::nn::Module the loop trains like any other (see the
/// file comment). Use through its holder, `ScriptModule`.
class ScriptModuleImpl : public torch::nn::Module {
 public:
  /// @brief Loads `path` (written by `torch.jit.script(model).save(path)`) on the CPU.
  /// @param path the TorchScript file
  /// @throws CheckpointError for a missing file or one that is not a TorchScript model (a
  ///         state_dict, a checkpoint, anything else), libtorch's error nested;
  ///         ConfigurationError when forward does not take and return one tensor.
  explicit ScriptModuleImpl(const std::filesystem::path& path) : ScriptModuleImpl(detail::load_script_archive(path), path) {}

  /// @brief Wraps a module already loaded (shares it: its tensors are the trained ones).
  /// @param scripted the TorchScript module (from torch::jit::load, or built in C++)
  /// @param origin where it came from, for messages
  explicit ScriptModuleImpl(torch::jit::Module scripted, const std::filesystem::path& origin = "<in memory>")
      : torch::nn::Module(detail::script_class_name(scripted)), scripted_(std::move(scripted)) {
    detail::check_forward_signature(scripted_, origin);
    detail::mirror_script_module(*this, scripted_);
    torch::nn::Module::train(scripted_.is_training());
    ignoring_mode_ = detail::layers_ignoring_mode(scripted_);
    if (!ignoring_mode_.empty()) {
      std::cerr << "trainloop: warning: " << origin.string() << " looks traced (torch.jit.trace): its "
                << ignoring_mode_.size() << " BatchNorm/Dropout layers (" << ignoring_mode_.front()
                << (ignoring_mode_.size() > 1 ? ", ..." : "")
                << ") behave as they did when it was traced, whatever train()/eval() says; training and evaluation "
                   "will not switch them. Save it with torch.jit.script(model) to train it.\n";
    }
  }

  /// @brief Runs the scripted forward.
  /// @param input the batch
  /// @return the scripted forward's output
  torch::Tensor forward(torch::Tensor input) {
    auto output = scripted_.forward({std::move(input)});
    return output.toTensor();
  }

  /// @brief Sets train or eval mode here and in the scripted module (which keeps the mode it was
  /// saved in when loaded).
  /// @param on true: train mode; false: eval mode
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    scripted_.train(on);
  }

  /// @brief A deep copy on `device`, for gpu_mode::DataParallel's replicas: its own tensors and
  /// the same code.
  /// @param device where the copy lives
  std::shared_ptr<ScriptModuleImpl> replicate(const torch::Device& device) const {
    torch::NoGradGuard no_grad;
    auto copy = std::make_shared<ScriptModuleImpl>(scripted_.deepcopy(), "a replica");
    copy->to(device);
    copy->train(is_training());
    return copy;
  }

  /// @brief Writes the model, with its current weights, as a TorchScript file Python's
  /// `torch.jit.load` reads; atomically (a crash leaves the previous file or the complete new one).
  /// @param path the file to write
  /// @throws CheckpointError naming the path when it cannot be written.
  void save(const std::filesystem::path& path) const {
    trainloop::detail::BasicAtomicFile<CheckpointError> file(path, "the TorchScript file");
    try {
      torch::jit::ExportModule(scripted_, file.writer());
    } catch (const c10::Error& error) {
      std::throw_with_nested(CheckpointError(trainloop::detail::concat(
          "trainloop: cannot write the TorchScript file ", path.string(), ": ", detail::first_line(error),
          "; expected a writable directory with free space (the previous file, if any, is unchanged)")));
    }
    file.commit();
  }

  /// @brief The scripted module itself (for its other methods and attributes).
  torch::jit::Module& scripted() { return scripted_; }
  /// @brief The scripted module itself.
  const torch::jit::Module& scripted() const { return scripted_; }

  /// @brief BatchNorm/Dropout layers whose code ignores train()/eval() (a traced model); empty
  /// for a scripted one.
  const std::vector<std::string>& layers_ignoring_mode() const { return ignoring_mode_; }

 private:
  torch::jit::Module scripted_;
  std::vector<std::string> ignoring_mode_;
};

/// @brief Holder of ScriptModuleImpl (`ScriptModule model("model.pt");`).
TORCH_MODULE(ScriptModule);

}  // namespace trainloop::interop
