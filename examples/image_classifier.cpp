// The fastai multi-GPU blog's program in C++: a model of the zoo (xresnet50 by default) trained on
// an image folder with RandomResizedCrop(size, scale 0.35-1) + flip + ImageNet normalisation,
// MixUp(0.1), flat-cos at 1e-3, accuracy and top-5, in any precision and gpu mode. fastai:
//
//   dls = get_dls(bs, size)   # RandomResizedCrop(size, min_scale=0.35), Flip, Normalize(imagenet)
//   learn = Learner(dls, xresnet50(n_out=10), metrics=[accuracy, top_k_accuracy]).to_fp16()
//   with learn.distrib_ctx(): learn.fit_flat_cos(2, 1e-3, cbs=MixUp(0.1))
//
// Here:
//   image_classifier --data ROOT --size 128 --epochs 2 --precision bf16 --gpu-mode ddp
//   image_classifier --data ROOT --arch resnet18 --pretrained resnet18.pth --epochs 0   # evaluate only
//   image_classifier --data ROOT --exported model.pt2 --export trained.pt2                # a Python model
//   image_classifier --data ROOT --scripted model.pt --export trained.pt                  # ... from TorchScript
//
// --exported takes a torch.export program (examples/export_timm_model.py writes one from a timm model).
//
// ROOT/train/<class>/<image> and ROOT/test/<class>/<image> as torchvision's ImageFolder reads them
// (scripts/export-fashion-mnist-images.sh writes Fashion-MNIST so, in RGB at any size).


#include <trainloop/interop.hpp>
#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <iostream>

namespace {

struct Arguments {
  std::string data, arch = "xresnet50", pretrained, exported, scripted, export_to, precision = "fp32";
  std::string memory_format = "auto";
  int64_t size = 128, epochs = 2, batch_size = 64, workers = 2;
  double lr = 1e-3;
  uint64_t seed = 0;
  trainloop::ModeFlags mode;
};

/// Trains (unless --epochs 0), evaluates on ROOT/test and exports: the same program for a zoo
/// model, a torch.export program and a TorchScript one.
template <class Model>
void train_and_evaluate(Model model, const Arguments& args, const trainloop::data::ImageFolder& train,
                        const trainloop::data::ImageFolder& test) {
  using namespace trainloop;
  torch::optim::AdamW optimizer(model->parameters(),  // fastai's default: Adam, decoupled weight decay 0.01
                                torch::optim::AdamWOptions(args.lr).betas({0.9, 0.99}).eps(1e-5).weight_decay(0.01));
  const auto classes = static_cast<int64_t>(train.classes().size());
  const MetricList metrics = classes > 5 ? MetricList{Accuracy(), TopKAccuracy(5)} : MetricList{Accuracy()};
  TrainLoop loop(model, train, test, optimizer, torch::nn::CrossEntropyLoss(),  // TrainLoop<Model, gpu_mode::Any>
                 TrainLoopOptions().batch_size(args.batch_size).num_workers(args.workers)
                     .seed(args.seed).precision(parse_precision(args.precision))
                     .memory_format(parse_memory_format(args.memory_format)).metrics(metrics),
                 mode_from_flags(args.mode));
  if (args.epochs > 0) loop.fit(args.epochs, {FlatCos(args.lr), MixUp(0.1), ProgressBar()});
  const EvalResult result = loop.evaluate(test);
  if (!is_main_process()) return;
  std::cout << args.mode.gpu_mode << ": test accuracy " << result.metrics.at("accuracy") << " (loss " << result.loss;
  if (classes > 5) std::cout << ", top-5 " << result.metrics.at("top5_accuracy");
  std::cout << ", " << result.samples << " test images)\n";
  if (args.export_to.empty()) return;
  if constexpr (std::is_same_v<Model, interop::ScriptModule>) {
    model->save(args.export_to);  // Python: torch.jit.load(path)
  } else if constexpr (std::is_same_v<Model, interop::ExportedProgram>) {
    if (std::filesystem::path(args.export_to).extension() == ".pt2") {
      model->save(args.export_to);  // Python: torch.export.load(path)
    } else {
      model->save_state_dict(args.export_to);  // Python: timm_model.load_state_dict(torch.load(path))
    }
  } else {
    interop::save_python_state_dict(*model, args.export_to);  // Python: model.load_state_dict(torch.load(path))
  }
  std::cout << "exported to " << args.export_to << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a zoo, torch.export or TorchScript image classifier on an image folder (the fastai blog's program)"};
  Arguments args;
  app.add_option("--data", args.data, "ROOT holding train/<class>/<image> and test/<class>/<image>")->required();
  app.add_option("--size", args.size, "training crop and test size in pixels")->check(CLI::PositiveNumber);
  std::string zoo;
  for (const auto& name : trainloop::models::available()) zoo += (zoo.empty() ? "" : ", ") + name;
  app.add_option("--arch", args.arch, "a model of the zoo: " + zoo);
  app.add_option("--pretrained", args.pretrained, "start from a Python state_dict of that architecture (torch.save)");
  app.add_option("--exported", args.exported, "train this torch.export program (torch.export.save, a .pt2) instead");
  app.add_option("--scripted", args.scripted, "train this TorchScript model (torch.jit.script(model).save) instead");
  app.add_option("--export", args.export_to, "after training, write the weights for Python: a state_dict (--exported: a "
                                             ".pt2 path writes the program; --scripted: TorchScript)");
  app.add_option("--epochs", args.epochs, "training epochs; 0: evaluate the (loaded) model only")->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", args.batch_size, "samples per batch (per rank in ddp)")->check(CLI::PositiveNumber);
  app.add_option("--lr", args.lr, "peak learning rate of the flat-cos schedule");
  app.add_option("--workers", args.workers, "loader threads decoding and augmenting images")->check(CLI::NonNegativeNumber);
  app.add_option("--precision", args.precision, "fp32, bf16 (autocast) or fp16 (autocast + loss scaling, CUDA)");
  app.add_option("--memory-format", args.memory_format, "auto (channels-last for convolutional models), contiguous or channels-last")
      ->check(CLI::IsMember({"auto", "contiguous", "channels-last"}));
  app.add_option("--seed", args.seed, "seed for weights, shuffling and augmentation");
  app.add_option("--gpu-mode", args.mode.gpu_mode, "single, dp, ddp or fsdp");
  app.add_option("--device", args.mode.device, "cpu or cuda:N");
  app.add_option("--procs", args.mode.procs, "ddp: processes on this machine");
  app.add_option("--replicas", args.mode.replicas, "dp on the CPU: model replicas");
  CLI11_PARSE(app, argc, argv);

  try {
    namespace data = trainloop::data;
    TRAINLOOP_CHECK(int(!args.pretrained.empty()) + int(!args.exported.empty()) + int(!args.scripted.empty()) <= 1,
                    "--pretrained is '", args.pretrained, "', --exported '", args.exported, "' and --scripted '",
                    args.scripted, "'; expected at most one of them");
    const std::vector<double> mean{0.485, 0.456, 0.406}, std{0.229, 0.224, 0.225};  // ImageNet's, as fastai's
    const auto options = data::ImageFolderOptions().channels(3).seed(args.seed);
    const std::filesystem::path root(args.data);
    data::ImageFolder train(root / "train", data::Transforms().random_resized_crop(args.size, {0.35, 1.0})
                                                .random_horizontal_flip().normalize(mean, std), options);
    data::ImageFolder test(root / "test", data::Transforms().resize(args.size).center_crop(args.size).normalize(mean, std),
                           options);
    TRAINLOOP_CHECK(train.classes() == test.classes(), "train/ has ", train.classes().size(), " classes and test/ ",
                    test.classes().size(), "; expected the same class directories in both");
    torch::manual_seed(args.seed);
    if (!args.exported.empty()) {
      train_and_evaluate(trainloop::interop::ExportedProgram(args.exported), args, train, test);
    } else if (!args.scripted.empty()) {
      train_and_evaluate(trainloop::interop::ScriptModule(args.scripted), args, train, test);
    } else {
      trainloop::models::ImageClassifier model(
          args.arch, trainloop::models::ImageModelOptions().num_classes(static_cast<int64_t>(train.classes().size())));
      if (!args.pretrained.empty()) trainloop::interop::load_state_dict(*model, args.pretrained);
      train_and_evaluate(model, args, train, test);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
