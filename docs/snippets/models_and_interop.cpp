// A zoo ResNet fine-tuned the fastai way, then written for Python's torch.load and read back.
#include <trainloop/interop.hpp>
#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <filesystem>
#include <iostream>

int main() {
  namespace tl = trainloop;
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({32, 3, 32, 32});
  const torch::Tensor y = torch::randint(0, 4, {32});
  const auto options = tl::models::ImageModelOptions().num_classes(4);

  tl::models::ImageClassifier model("resnet18", options);  // torchvision's names: conv1, layer1.0.bn1, ..., fc
  // Pretrained weights saved by Python (torch.save(model.state_dict(), path)) would load here:
  //   tl::interop::load_state_dict(*model, "resnet18.pt");   // strict: every name and shape must match
  tl::ParameterGroups groups(*model, tl::models::fastai_split("resnet18"));  // stem | layer3-4 | fc
  auto optimizer = groups.make_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(2e-3));
  tl::TrainLoop loop(model, tl::data::TensorDataset(x, y, 4), {}, optimizer, torch::nn::CrossEntropyLoss(),
                     tl::TrainLoopOptions().batch_size(16));
  tl::fine_tune(loop, groups, /*epochs=*/1, /*base_lr=*/2e-3);  // an epoch with the body frozen, then one more

  // A file Python reads: model.load_state_dict(torch.load(path, weights_only=True)).
  const auto path = std::filesystem::temp_directory_path() / "trainloop-docs-resnet18.pt";
  tl::interop::save_python_state_dict(*model, path);
  tl::models::ImageClassifier copy("resnet18", options);
  const tl::interop::LoadReport report = tl::interop::load_state_dict(*copy, path);  // runs nothing from the file
  std::filesystem::remove(path);

  const auto trained = model->named_parameters();
  bool same = report.complete();
  for (const auto& item : copy->named_parameters()) same = same && torch::equal(item.value(), trained[item.key()]);
  std::cout << report.loaded.size() << " tensors loaded (parameters and buffers); equal to the trained ones: "
            << std::boolalpha << same << '\n';
  return same ? 0 : 1;
}
