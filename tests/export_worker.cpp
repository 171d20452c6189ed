// Trains a torch.export program (interop::ExportedProgram) through TrainLoop in the mode its
// flags name, for test_exported_program: the same program is the single process, the DataParallel
// process and every DDP rank (ranks re-run it), so each mode trains exactly what the others do.
//
//   export_worker MODEL.pt2 DATA.pt OUT_DIR MODE BATCH STEPS OPTIMIZER [OPTION...]
//
// DATA.pt: a Python state_dict file with "x" (inputs), "y" (labels) and "xe" (inputs whose
// eval-mode logits are written). MODE: single, dp or ddp (2 ranks or replicas). OPTIMIZER: sgd
// (lr 0.05, momentum 0.9, weight decay 1e-4) or adamw (lr 1e-3, weight decay 0.05). No shuffling;
// STEPS steps of BATCH samples per rank (the data must hold STEPS x BATCH x ranks samples);
// contiguous memory format unless an option says otherwise. Options:
//   sharding=LEVEL          ddp's sharding level (none, optimizer, gradients, full)
//   bf16                    bf16 autocast
//   channels-last           channels-last memory format
//   freeze=PREFIX           parameters whose names start with PREFIX frozen (requires_grad false)
//   checkpoints=DIR         a checkpoint per epoch in DIR; `resume` resumes from its last
//   epochs=N                N epochs of STEPS steps (a resumed run: N more after its checkpoint)
// Writes, from the caller's process: OUT_DIR/state.pt (the trained weights, a Python state_dict),
// OUT_DIR/eval_logits.pt ("logits": the eval-mode output for xe), OUT_DIR/trained.pt2.

#include <trainloop/interop.hpp>
#include <trainloop/trainloop.hpp>

#include <iostream>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace interop = trainloop::interop;

int main(int argc, char** argv) {
  if (argc < 8) {
    std::cerr << "usage: export_worker MODEL.pt2 DATA.pt OUT_DIR MODE BATCH STEPS OPTIMIZER [OPTION...]\n";
    return 2;
  }
  const std::string model_path = argv[1], data_path = argv[2], out_dir = argv[3], mode = argv[4], optimizer_name = argv[7];
  const int64_t batch = std::stoll(argv[5]), steps = std::stoll(argv[6]);
  tl::ModeFlags flags{mode, "cpu", /*procs=*/2, /*replicas=*/2};
  // One thread: the same summation order as the Python reference (torch.set_num_threads(1)).
  auto options =
      tl::TrainLoopOptions().batch_size(batch).shuffle(false).memory_format(tl::MemoryFormat::contiguous).num_threads(1);
  std::string checkpoint_dir, freeze;
  bool resume = false;
  int64_t epochs = 1;
  for (int i = 8; i < argc; ++i) {
    const std::string option = argv[i];
    const auto value = option.substr(option.find('=') + 1);
    if (option.rfind("sharding=", 0) == 0) flags.sharding = value;
    else if (option == "bf16") options.precision(tl::Precision::bf16);
    else if (option == "channels-last") options.memory_format(tl::MemoryFormat::channels_last);
    else if (option.rfind("freeze=", 0) == 0) freeze = value;
    else if (option.rfind("checkpoints=", 0) == 0) checkpoint_dir = value;
    else if (option == "resume") resume = true;
    else if (option.rfind("epochs=", 0) == 0) epochs = std::stoll(value);
    else {
      std::cerr << "export_worker: option '" << option << "'; expected sharding=, bf16, channels-last, freeze=, "
                << "checkpoints=, resume or epochs=\n";
      return 2;
    }
  }
  try {
    torch::set_num_threads(1);
    interop::ExportedProgram model(model_path);
    torch::Tensor x, y, xe;
    for (auto& [name, tensor] : interop::read_python_state_dict(data_path)) (name == "x" ? x : name == "y" ? y : xe) = tensor;
    for (auto& parameter : model->named_parameters()) {
      if (!freeze.empty() && parameter.key().rfind(freeze, 0) == 0) parameter.value().requires_grad_(false);
    }
    std::vector<torch::Tensor> trained;
    for (const auto& parameter : model->parameters()) {
      if (parameter.requires_grad()) trained.push_back(parameter);
    }
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (optimizer_name == "sgd") {
      optimizer = std::make_unique<torch::optim::SGD>(trained, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(trained, torch::optim::AdamWOptions(1e-3).weight_decay(0.05));
    }
    const int64_t ranks = mode == "ddp" ? 2 : 1;  // dp splits each batch among its replicas
    const int64_t samples = steps * batch * ranks;
    tl::TrainLoop<interop::ExportedProgram, tl::gpu_mode::Any> loop(
        model, tl::data::TensorDataset(x.narrow(0, 0, samples), y.narrow(0, 0, samples)),
        {}, *optimizer, torch::nn::CrossEntropyLoss(), options, tl::mode_from_flags(flags));
    tl::CallbackList callbacks;
    if (!checkpoint_dir.empty()) callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(checkpoint_dir)));
    loop.fit(epochs, callbacks, resume ? "last" : "");
    if (tl::is_main_process()) {
      model->save_state_dict(out_dir + "/state.pt");
      model->save(out_dir + "/trained.pt2");
      model->eval();
      torch::NoGradGuard no_grad;
      interop::save_python_state_dict(interop::StateDict{{"logits", model->forward(xe)}}, out_dir + "/eval_logits.pt");
    }
  } catch (const std::exception& error) {
    std::cerr << "export_worker: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
