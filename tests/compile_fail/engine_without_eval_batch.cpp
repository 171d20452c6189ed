// Must not compile: a user's gpu_mode whose engine has no eval_batch (the loop calls it).
// ctest's compile_fail builds it (all_cases.cpp) and expects train_loop.hpp's ModeEngineFor text.

#include <trainloop/trainloop.hpp>

namespace compile_fail_engine_without_eval_batch {

template <class Module>
class HalfEngine : public trainloop::OneProcessEngine {  // every member of ModeEngine, train_micro_batch, no eval_batch
 public:
  HalfEngine(const auto&, std::shared_ptr<Module> module) : module_(std::move(module)) {}
  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double, bool, Sink&& sink) {
    auto out = forward(*module_, batch);
    out.loss.backward();
    sink(out);
  }

 private:
  std::shared_ptr<Module> module_;
};

struct HalfMode {
  static constexpr const char* name = "half";
  template <class Module>
  using engine = HalfEngine<Module>;
};

void run() {
  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  trainloop::data::TensorDataset data(torch::zeros({8, 4}), torch::zeros({8}, torch::kLong), 2);
  trainloop::TrainLoop<torch::nn::Linear, HalfMode> loop(model, data, {}, optimizer, torch::nn::CrossEntropyLoss());
  loop.fit(1);
}

}  // namespace compile_fail_engine_without_eval_batch
