// A run killed in epoch 3 of 4 and started again continues from its newest checkpoint, and ends
// with exactly the weights of a run that was never interrupted.
#include <trainloop/trainloop.hpp>

#include <filesystem>
#include <iostream>
#include <stdexcept>

namespace tl = trainloop;

// Stands in for a kill: throws when epoch `at` begins (after epoch at-1's checkpoint was written).
struct Crash : tl::Callback {
  explicit Crash(int64_t epoch) : at(epoch) {}
  void on_epoch_begin(tl::TrainState& state) override {
    if (state.epoch == at) throw std::runtime_error("killed in epoch " + std::to_string(at));
  }
  int64_t at;
};

// One start of the program: 4 epochs, a checkpoint after each in `dir`, resumed from it if there is one.
torch::Tensor train(const std::filesystem::path& dir, int64_t crash_at = 0) {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({256, 8});
  const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  torch::nn::Sequential net(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Dropout(0.2), torch::nn::Linear(32, 2));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop loop(net, tl::data::TensorDataset(x, y), {}, optimizer, torch::nn::CrossEntropyLoss(),
                     tl::TrainLoopOptions().batch_size(32));

  auto checkpoints = std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir).every_n_epochs(1).keep_last(2));
  tl::CallbackList callbacks{checkpoints};
  if (crash_at > 0) callbacks.push_back(std::make_shared<Crash>(crash_at));
  loop.fit(4, callbacks, tl::Resume::last());  // the newest checkpoint in dir; none yet: start fresh
  return torch::nn::utils::parameters_to_vector(net->parameters()).detach();
}

int main() {
  const auto root = std::filesystem::temp_directory_path() / "trainloop-docs-checkpoints";
  std::filesystem::remove_all(root);
  const torch::Tensor uninterrupted = train(root / "straight");
  try {
    train(root / "run", /*crash_at=*/3);
  } catch (const std::exception& error) {
    std::cout << "first start: " << error.what() << '\n';
  }
  const torch::Tensor resumed = train(root / "run");  // the same program, started again
  const bool same = torch::equal(resumed, uninterrupted);
  std::cout << "resumed run equals the uninterrupted one bit for bit: " << std::boolalpha << same << '\n';
  std::filesystem::remove_all(root);
  return same ? 0 : 1;
}
