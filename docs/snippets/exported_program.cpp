// A timm model exported in Python, trained here in any gpu mode, and handed back to Python.
//   python examples/export_timm_model.py resnet18 --classes 10 --size 64 --out resnet18.pt2
//   build/docs/docs_snippet_exported_program resnet18.pt2 ddp
#include <trainloop/interop.hpp>
#include <trainloop/trainloop.hpp>

#include <iostream>

int main(int argc, char** argv) {
  namespace tl = trainloop;
  if (argc < 2) {
    std::cerr << "usage: exported_program MODEL.pt2 [single|dp|ddp]\n";
    return 2;
  }
  tl::interop::ExportedProgram model(argv[1]);  // Python's names: conv1.weight, layer1.0.bn1.running_mean, ...
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({64, 3, 64, 64});
  const torch::Tensor y = torch::randint(0, 10, {64});
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  tl::TrainLoop loop(  // TrainLoop<tl::interop::ExportedProgram, tl::gpu_mode::Any>
      model, tl::data::TensorDataset(x, y, 10), {}, optimizer, torch::nn::CrossEntropyLoss(),
      tl::TrainLoopOptions().batch_size(24), tl::gpu_mode::parse(argc > 2 ? argv[2] : "single"));
  loop.fit(2);  // 64 samples in batches of 24: the last batch of each epoch has 16 (a dynamic batch)
  if (!tl::is_main_process()) return 0;
  model->save("trained.pt2");            // Python: torch.export.load("trained.pt2")
  model->save_state_dict("trained.pt");  // Python: timm_model.load_state_dict(torch.load("trained.pt"), strict=True)
  std::cout << model->program().name() << ": trained and saved\n";
  return 0;
}
