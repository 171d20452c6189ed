// Three of trainloop's seams, each a class of your own (no edit of trainloop): a metric, a
// callback with state, and a gpu mode.
#include <trainloop/trainloop.hpp>

#include <iostream>

namespace tl = trainloop;

// A metric: sums per batch (here: of the top softmax probability, and the count); the loop adds
// them over batches, replicas and ranks, then compute() turns the totals into the value.
class Confidence : public tl::Metric {
 public:
  std::string name() const override { return "confidence"; }
  int64_t num_statistics() const override { return 2; }
  torch::Tensor statistics(const torch::Tensor& output, const torch::Tensor& /*target*/) const override {
    const torch::Tensor top = std::get<0>(output.to(torch::kFloat64).softmax(1).max(1));
    return torch::stack({top.sum(), torch::full({}, static_cast<double>(top.size(0)), top.options())});
  }
  double compute(const torch::Tensor& totals) const override {
    const torch::Tensor sums = totals.cpu();
    return sums[1].item<double>() > 0 ? sums[0].item<double>() / sums[1].item<double>() : 0.0;
  }
};

// A callback: any hooks of callbacks/callback.hpp. Its state travels in checkpoints (and back from
// spawned DDP ranks); request_stop() is agreed by every rank.
class StopWhenConfident : public tl::Callback {
 public:
  explicit StopWhenConfident(double target) : target_(target) {}
  void on_epoch_end(tl::TrainState& state, const tl::EpochRecord& record) override {
    ++epochs_seen_;
    if (record.train_metrics.at("confidence") >= target_) state.request_stop("confident enough");
  }
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("epochs_seen", torch::tensor(epochs_seen_));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor value;
    archive.read("epochs_seen", value);
    epochs_seen_ = value.item<int64_t>();
  }

 private:
  double target_;
  int64_t epochs_seen_ = 0;
};

// A gpu mode: a policy type naming an engine, which implements the ModeEngine members
// (engine/mode_engine.hpp); a one-process engine takes the identity ones (rank 0 of 1, collectives
// that return their input) from OneProcessEngine and writes only its real work. This one runs
// each micro-batch as `parts` chunks on one device, each chunk's loss weighted by its share: the
// gradients of one pass, a chunk's activations in memory.
template <class Module>
class ChunkedEngine;
struct Chunked {
  static constexpr const char* name = "chunked";
  template <class Module>
  using engine = ChunkedEngine<Module>;
  int64_t parts = 4;
};
template <class Module>
class ChunkedEngine : public tl::OneProcessEngine {
 public:
  ChunkedEngine(const Chunked& mode, std::shared_ptr<Module> module) : parts_(mode.parts), module_(std::move(module)) {}
  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool /*sync*/, Sink&& sink) {
    const auto n = static_cast<double>(batch.data.size(0));
    for (const auto& chunk : chunks(batch)) {
      const tl::StepOutput out = forward(*module_, chunk);
      (out.loss * (loss_scale * static_cast<double>(out.samples) / n)).backward();
      sink(out);
    }
  }
  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    torch::NoGradGuard no_grad;
    for (const auto& chunk : chunks(batch)) sink(forward(*module_, chunk));
  }

 private:
  std::vector<torch::data::Example<>> chunks(const torch::data::Example<>& batch) const {
    const auto inputs = batch.data.chunk(parts_);
    const auto targets = batch.target.chunk(parts_);
    std::vector<torch::data::Example<>> result;
    for (size_t i = 0; i < inputs.size(); ++i) result.push_back({inputs[i], targets[i]});
    return result;
  }
  int64_t parts_;
  std::shared_ptr<Module> module_;
};

int main() {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({256, 8});
  const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  torch::nn::Sequential net(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 2));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop<torch::nn::Sequential, Chunked> loop(
      net, tl::data::TensorDataset(x, y), {}, optimizer, torch::nn::CrossEntropyLoss(),
      tl::TrainLoopOptions().batch_size(64).metrics({std::make_shared<Confidence>()}), Chunked{.parts = 4});
  const tl::History history = loop.fit(20, {StopWhenConfident(0.9)});
  std::cout << history.epochs.size() << " epochs, confidence " << history.last().train_metrics.at("confidence")
            << (history.stop_reason.empty() ? "" : " (" + history.stop_reason + ")") << '\n';
  return 0;
}
