// Trains a TorchScript model (interop::ScriptModule) through TrainLoop in the mode its flags name,
// for test_script_module: the same program is the single process, the DataParallel process and
// every DDP rank (ranks re-run it), so each mode trains exactly what the others do.
//
//   script_module_worker MODEL.pt DATA.pt OUT_DIR MODE BATCH EPOCHS [CHECKPOINT_DIR [resume]]
//
// DATA.pt: a Python state_dict file with "x" (inputs) and "y" (labels). SGD lr 0.1, momentum 0.9,
// no shuffling. Writes OUT_DIR/state.pt (the trained weights, a Python state_dict) and
// OUT_DIR/model.pt (the trained TorchScript model) from the caller's process.

#include <trainloop/interop.hpp>
#include <trainloop/trainloop.hpp>

#include <iostream>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace interop = trainloop::interop;

int main(int argc, char** argv) {
  if (argc < 7) {
    std::cerr << "usage: script_module_worker MODEL.pt DATA.pt OUT_DIR MODE BATCH EPOCHS [CHECKPOINT_DIR [resume]]\n";
    return 2;
  }
  const std::string model_path = argv[1], data_path = argv[2], out_dir = argv[3], mode = argv[4];
  const int64_t batch = std::stoll(argv[5]), epochs = std::stoll(argv[6]);
  const std::string checkpoint_dir = argc > 7 ? argv[7] : "";
  const bool resume = argc > 8 && std::string(argv[8]) == "resume";
  try {
    torch::set_num_threads(1);
    interop::ScriptModule model(model_path);
    torch::Tensor x, y;
    for (auto& [name, tensor] : interop::read_python_state_dict(data_path)) (name == "x" ? x : y) = tensor;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    tl::TrainLoop<interop::ScriptModule, tl::gpu_mode::Any> loop(
        model, tl::data::TensorDataset(x, y), {}, optimizer, torch::nn::CrossEntropyLoss(),
        tl::TrainLoopOptions().batch_size(batch).shuffle(false),
        tl::mode_from_flags(tl::ModeFlags{mode, "cpu", /*procs=*/2, /*replicas=*/2}));
    tl::CallbackList callbacks;
    if (!checkpoint_dir.empty()) callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(checkpoint_dir)));
    loop.fit(epochs, callbacks, resume ? "last" : "");
    if (tl::is_main_process()) {
      interop::save_python_state_dict(*model, out_dir + "/state.pt");
      model->save(out_dir + "/model.pt");
    }
  } catch (const std::exception& error) {
    std::cerr << "script_module_worker: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
