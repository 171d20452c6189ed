#pragma once
/// @file
/// @brief torch.export programs as trainloop models: a model written in Python (timm's,
/// torchvision's, your own), exported with `torch.export.export` and saved with
/// `torch.export.save`, trains in every mode, with checkpoints and exact resume, and goes back
/// to Python as a state_dict or as a `.pt2` that `torch.export.load` reads.
///
/// @code
/// auto model = trainloop::interop::ExportedProgram("resnet18.pt2");
/// torch::optim::SGD optimizer(model->parameters(), 0.1);
/// trainloop::TrainLoop<trainloop::interop::ExportedProgram> loop(model, train, test, optimizer, criterion);
/// loop.fit(3);
/// model->save("trained.pt2");                     // Python: torch.export.load("trained.pt2")
/// model->save_state_dict("trained_weights.pt");   // Python: timm_model.load_state_dict(torch.load(...))
/// @endcode
///
/// How: the program's graph (ATen operators) runs node by node through libtorch's dispatcher
/// (serialization::GraphProgram), so autograd records it; its parameters and buffers are
/// registered under their Python names ("layer1.0.bn1.running_mean") in a tree of
/// torch::nn::Module nodes named as the submodules were (from the nodes' nn_module_stack), so
/// the optimizer, checkpoints, `to(device)`, the DDP reducer, the sharding units and fine-tuning
/// by name see an ordinary module. Buffers the graph updates in place (BatchNorm's running
/// statistics and num_batches_tracked) are updated exactly as Python's eager module does.
///
/// Train and eval: export in train mode (`model.train()`, the default of a new timm model); eval
/// mode is derived by switching the training flags (see interpreter/graph_program.hpp).
///
/// Reading runs no code: the archive is JSON and raw bytes, operators come only from the
/// dispatcher's registered ATen and prims schemas, checked against each node's arguments at load.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/interop/python_state_dict.hpp>
#include <trainloop/interop/state_dict.hpp>
#include <trainloop/serialization/export/export_graph.hpp>
#include <trainloop/interpreter/graph_program.hpp>
#include <trainloop/serialization/export/pt2_archive.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::interop {

namespace detail {

/// What saving a trained program needs of the archive it came from: every record but the
/// tensors' (copied as they were), and where each tensor lies in its file.
struct ExportedSource {
  std::filesystem::path path;                                 ///< the archive read
  std::string program;                                        ///< the program's name in it
  std::vector<std::pair<std::string, std::string>> records;   ///< (name, bytes) of the records copied as they are
  struct Placement {
    size_t state = 0;                        ///< index into the program's state
    serialization::Pt2Payload layout;        ///< sizes, strides, offset, dtype in the file (tensor unused)
  };
  std::map<std::string, std::pair<uint64_t, std::vector<Placement>>> files;  ///< tensor file -> (bytes, its tensors)
};

/// The last part of a Python class path ("BatchNorm2d" of "torch.nn.modules.batchnorm.BatchNorm2d").
inline std::string short_class_name(const std::string& qualified) {
  const auto dot = qualified.rfind('.');
  return qualified.empty() ? std::string("Module") : qualified.substr(dot == std::string::npos ? 0 : dot + 1);
}

}  // namespace detail

/// @brief A torch.export program as a torch::nn::Module the loop trains like any other (see the
/// file comment). Use through its holder, `ExportedProgram`.
class ExportedProgramImpl : public torch::nn::Module {
 public:
  /// @brief Loads program `program` of the PT2 archive `path` on the CPU: the only program when
  /// `program` is empty (torch.export.save writes one, named "model").
  /// @throws trainloop::CheckpointError naming the file for a missing or malformed archive, another
  ///         export schema major version (both versions named), a weights config naming a missing
  ///         file, a tensor outside its file, an operator this libtorch lacks, a node whose
  ///         arguments do not match its operator's schema, higher-order operators, custom
  ///         objects; trainloop::ConfigurationError for a program name the archive lacks.
  explicit ExportedProgramImpl(const std::filesystem::path& path, const std::string& program = "")
      : torch::nn::Module("ExportedProgram") {
    serialization::Pt2Archive archive(path);
    const std::string name = choose_program(archive, program);
    const auto graph = serialization::read_export_graph(archive, name);
    program_ = std::make_shared<const serialization::GraphProgram>(graph);
    auto source = std::make_shared<detail::ExportedSource>();
    source->path = path;
    source->program = name;
    load_state(archive, graph, *source);
    source_ = std::move(source);
    if (program_->exported_in_eval_mode()) {
      std::cerr << "trainloop: warning: " << program_->name() << " was exported in eval mode (every BatchNorm/dropout "
                << "flag is off): training runs it so, with BatchNorm on running statistics. Export the model after "
                << "model.train() to train it as in Python's train mode.\n";
    }
  }

  /// @brief Runs the program: in train mode as exported, in eval mode with the training flags switched.
  /// @param input the batch (its sizes must be ones the program was exported for)
  /// @return the program's output
  torch::Tensor forward(torch::Tensor input) { return program_->run(state_, input, !is_training(), memory_budget_); }

  /// @brief The most memory the program's values may hold at once while it runs (bytes; its
  /// replicas keep it). Unset: GraphProgram::default_memory_budget, 1 GiB + 64 x the weights +
  /// 4096 x the input. A node that passes it is a CheckpointError naming the node.
  void set_memory_budget(std::optional<int64_t> bytes) { memory_budget_ = bytes; }

  /// @brief A deep copy on `device`, for gpu_mode::DataParallel's replicas: its own tensors, the
  /// same compiled program.
  std::shared_ptr<ExportedProgramImpl> replicate(const torch::Device& device) const {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> copies;
    for (const auto& tensor : state_) copies.push_back(tensor.detach().clone().requires_grad_(tensor.requires_grad()));
    auto copy = std::shared_ptr<ExportedProgramImpl>(new ExportedProgramImpl(*this, std::move(copies)));
    copy->to(device);
    copy->train(is_training());
    return copy;
  }

  /// @brief The parameters and persistent buffers under their Python names: what Python's
  /// `model.state_dict()` of the exported model holds (non-persistent buffers and constants left out).
  StateDict state_dict_for_python() const {
    StateDict state;
    for (auto& item : module_state_dict(*this)) {
      if (!not_in_state_dict_.count(item.first)) state.push_back(std::move(item));
    }
    for (size_t i = 0; i < names_.size(); ++i) {  // tied tensors' second names, as Python's state_dict lists them
      if (tied_to_[i] >= 0 && !not_in_state_dict_.count(names_[i])) state.emplace_back(names_[i], state_[i]);
    }
    return state;
  }

  /// @brief Writes state_dict_for_python() as `torch.save` would, for
  /// `model.load_state_dict(torch.load(path), strict=True)` of the same Python model (atomically).
  void save_state_dict(const std::filesystem::path& path) const { save_python_state_dict(state_dict_for_python(), path); }

  /// @brief Writes the program with its current weights as a PT2 archive that Python's
  /// `torch.export.load` reads and runs: every record of the archive it was loaded from, with
  /// the tensors' bytes replaced. Atomically: a crash leaves the previous file or the new one.
  /// @throws trainloop::CheckpointError naming the path when it cannot be written.
  void save(const std::filesystem::path& path) const;

  /// @brief The compiled program (its name, how many nodes eval mode changes).
  const serialization::GraphProgram& program() const { return *program_; }
  /// @brief The program's name in its archive ("model").
  const std::string& program_name() const { return source_->program; }

 private:
  /// A replica: the same program and source, `state` as its tensors.
  ExportedProgramImpl(const ExportedProgramImpl& other, std::vector<torch::Tensor> state)
      : torch::nn::Module("ExportedProgram"), program_(other.program_), source_(other.source_),
        names_(other.names_), kinds_(other.kinds_), tied_to_(other.tied_to_), classes_(other.classes_),
        not_in_state_dict_(other.not_in_state_dict_), memory_budget_(other.memory_budget_) {
    // register_state returns the registered tensor (a buffer's is a new, detached one): that is
    // the one to() and the replicas' copies update.
    for (size_t i = 0; i < state.size(); ++i) {
      state_.push_back(tied_to_[i] >= 0 ? state_[static_cast<size_t>(tied_to_[i])] : register_state(names_[i], kinds_[i], state[i]));
    }
  }

  static std::string choose_program(const serialization::Pt2Archive& archive, const std::string& wanted) {
    std::string names;  // the archive's, quoted; the first 16
    for (size_t i = 0; i < archive.programs().size() && i < 16; ++i) {
      names += (i == 0 ? "" : ", ") + serialization::quote_untrusted(archive.programs()[i]);
    }
    if (archive.programs().size() > 16) names += ", ...";
    if (wanted.empty()) {
      if (archive.programs().size() == 1) return archive.programs().front();
      throw ConfigurationError(trainloop::detail::concat("trainloop: ", archive.path().string(), " holds ",
                                                         archive.programs().size(), " programs (", names,
                                                         "); expected the name of the one to train"));
    }
    for (const auto& name : archive.programs()) {
      if (name == wanted) return name;
    }
    throw ConfigurationError(trainloop::detail::concat("trainloop: ", archive.path().string(), " has no program '", wanted,
                                                       "'; expected one of: ", names));
  }

  /// Reads the tensors each placeholder names and registers them in the module tree.
  void load_state(const serialization::Pt2Archive& archive, const serialization::ExportGraph& graph,
                  detail::ExportedSource& source) {
    using Kind = serialization::ExportInput::Kind;
    const std::string weights_config = "data/weights/" + source.program + "_weights_config.json";
    const std::string constants_config = "data/constants/" + source.program + "_constants_config.json";
    std::map<std::string, serialization::Pt2Payload> payloads;
    for (auto& payload : archive.read_payloads(weights_config, "data/weights/")) payloads.emplace(payload.name, std::move(payload));
    for (auto& payload : archive.read_payloads(constants_config, "data/constants/")) payloads.emplace(payload.name, std::move(payload));
    for (const auto& [path, qualified] : graph.module_classes) classes_[path] = detail::short_class_name(qualified);
    for (const auto& input : graph.inputs) {
      if (input.kind == Kind::UserInput) continue;
      const auto found = payloads.find(input.target);
      if (found == payloads.end()) {
        throw CheckpointError(trainloop::detail::concat(
            "trainloop: ", graph.program, " needs the tensor '", serialization::escape_untrusted(input.target), "' (its placeholder ",
            serialization::quote_untrusted(input.graph_name), "), which neither ", serialization::quote_untrusted(weights_config),
            " nor ", serialization::quote_untrusted(constants_config), " describes; expected every parameter, ",
            "buffer and constant of the program in the archive"));
      }
      const auto& payload = found->second;
      const auto traced = graph.state_sizes.find(input.graph_name);
      if (traced != graph.state_sizes.end() && traced->second != payload.tensor.sizes().vec()) {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", graph.program, "'s tensor '", serialization::escape_untrusted(input.target), "' has sizes ",
                                                        payload.tensor.sizes(), "; expected ", c10::IntArrayRef(traced->second),
                                                        ", the sizes its graph was exported with"));
      }
      const bool persistent = input.kind == Kind::Parameter || (input.kind == Kind::Buffer && input.persistent);
      if (!persistent) not_in_state_dict_.insert(input.target);
      names_.push_back(input.target);
      kinds_.push_back(input.kind == Kind::Parameter ? 'p' : 'b');
      // Tied tensors (Python's `b.weight = a.weight`: two names, one file, one layout) are one
      // tensor, registered once, as Python has one Parameter: stepped once, its gradient the sum
      // of both uses. The second name is an alias, written under its name for Python.
      int tied = -1;
      for (const auto& placement : source.files[payload.file].second) {
        const auto& layout = placement.layout;
        if (layout.sizes == payload.sizes && layout.strides == payload.strides &&
            layout.storage_offset == payload.storage_offset && layout.dtype == payload.dtype &&
            kinds_[placement.state] == kinds_.back()) {
          tied = static_cast<int>(placement.state);
        }
      }
      tied_to_.push_back(tied);
      source.files[payload.file].second.push_back({state_.size(), payload});
      state_.push_back(tied >= 0 ? state_[static_cast<size_t>(tied)] : register_state(input.target, kinds_.back(), payload.tensor));
    }
    for (auto& [file, entry] : source.files) {
      entry.first = archive.records().at(file).size;
      for (auto& placement : entry.second) placement.layout.tensor = torch::Tensor();
    }
    // Everything else is copied as it is when saving (other programs' tensors included); the
    // records the zip writer makes itself are not.
    static const std::set<std::string> written_by_writer = {".data/version", ".data/serialization_id", "version", "byteorder"};
    for (const auto& [name, record] : archive.records()) {
      if (source.files.count(name) || written_by_writer.count(name)) continue;
      source.records.emplace_back(name, archive.read(name, record.size));
    }
  }

  /// Registers `tensor` under the dotted `name` in the module tree (made as needed): a
  /// parameter (kind 'p') or a buffer.
  torch::Tensor register_state(const std::string& name, char kind, const torch::Tensor& tensor) {
    torch::nn::Module* node = this;
    std::string path;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; start = dot + 1, dot = name.find('.', start)) {
      const std::string part = name.substr(start, dot - start);
      path += (path.empty() ? "" : ".") + part;
      auto children = node->named_children();
      if (!children.contains(part)) {
        const auto found = classes_.find(path);
        node->register_module(part, std::make_shared<torch::nn::Module>(found == classes_.end() ? "Module" : found->second));
        children = node->named_children();
      }
      node = children[part].get();
    }
    const std::string leaf = name.substr(start);
    if (kind == 'p') return node->register_parameter(leaf, tensor, tensor.requires_grad());
    // A buffer never requires grad (a file that says otherwise would fail at the first step).
    return node->register_buffer(leaf, tensor.detach().requires_grad_(false));
  }

  std::shared_ptr<const serialization::GraphProgram> program_;
  std::shared_ptr<const detail::ExportedSource> source_;
  std::vector<torch::Tensor> state_;       // the placeholders' tensors, in graph order (the registered ones)
  std::vector<std::string> names_;         // their Python names
  std::vector<char> kinds_;                // 'p' parameter, 'b' buffer or constant
  std::vector<int> tied_to_;               // the state it is tied to (one tensor, two names), or -1
  std::map<std::string, std::string> classes_;  // module path -> class name
  std::set<std::string> not_in_state_dict_;     // non-persistent buffers and constants
  std::optional<int64_t> memory_budget_;        // set_memory_budget's, or the program's default
};

/// @brief Holder of ExportedProgramImpl (`ExportedProgram model("model.pt2");`).
TORCH_MODULE(ExportedProgram);

inline void ExportedProgramImpl::save(const std::filesystem::path& path) const {
  trainloop::detail::BasicAtomicFile<CheckpointError> file(path, "the PT2 archive");
  try {
    torch::NoGradGuard no_grad;
    caffe2::serialize::PyTorchStreamWriter writer(file.writer());
    for (const auto& [name, bytes] : source_->records) writer.writeRecord(name, bytes.data(), bytes.size());
    for (const auto& [name, entry] : source_->files) {
      const auto& [bytes, placements] = entry;
      auto storage = torch::zeros({static_cast<int64_t>(bytes)}, torch::kUInt8);
      for (const auto& placement : placements) {
        const auto& layout = placement.layout;
        if (c10::multiply_integers(layout.sizes) == 0) continue;
        const auto item = static_cast<int64_t>(c10::elementSize(layout.dtype));
        auto typed = storage.narrow(0, 0, static_cast<int64_t>(bytes) / item * item).view(layout.dtype);
        typed.as_strided(layout.sizes, layout.strides, layout.storage_offset)
            .copy_(state_[placement.state].detach().to(torch::kCPU, layout.dtype));
      }
      writer.writeRecord(name, storage.data_ptr(), bytes);
    }
    writer.writeEndOfFile();
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(trainloop::detail::concat(
        "trainloop: cannot write the PT2 archive ", path.string(), ": ", detail::first_line(error),
        "; expected a writable directory with free space (the previous file, if any, is unchanged)")));
  }
  file.commit();
}

}  // namespace trainloop::interop
