// Trains a small CNN on Fashion-MNIST (Debian's dataset-fashion-mnist) with trainloop and prints
// the final test accuracy. The training mode is chosen at run time: --gpu-mode single|dp|ddp.
//
//   fashion_mnist --epochs 4 --batch-size 64 --device cpu --data /usr/share/datasets/fashion-mnist
//   fashion_mnist --epochs 4 --checkpoint-dir runs/fmnist            # a checkpoint after every epoch
//   fashion_mnist --epochs 4 --checkpoint-dir runs/fmnist --resume   # continue a killed run
//   fashion_mnist --epochs 4 --tensorboard runs/fmnist --plot runs/fmnist/curves.png
//   fashion_mnist --epochs 4 --schedule one-cycle --max-lr 3e-3      # fastai's fit_one_cycle
//   fashion_mnist --lr-find                                            # print a suggested lr and exit
//   fashion_mnist --epochs 4 --precision bf16 --early-stop-patience 2
//   fashion_mnist --epochs 4 --progress live | tee run.log             # the live bar, also into a pipe
//   fashion_mnist --epochs 4 --save-weights runs/fmnist.safetensors     # the trained weights, for Python too
//   fashion_mnist --epochs 4 --save-weights runs/fmnist-hf/             # Hugging Face's sharded form
//   fashion_mnist --epochs 1 --load-weights runs/fmnist.safetensors     # fine-tune saved weights

#include "fashion_net.hpp"

#include <trainloop/interop/dcp_weights.hpp>
#include <trainloop/interop/safetensors_weights.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <iostream>
#include <optional>

int main(int argc, char** argv) {
  CLI::App app{"Train a CNN on Fashion-MNIST with trainloop"};
  std::string gpu_mode = "single";
  int64_t epochs = 4;
  int64_t batch_size = 64;
  std::string device = "cpu";
  std::string data_dir = trainloop::data::FashionMNISTOptions().root().string();
  double learning_rate = 1e-3;
  int64_t workers = 0;
  uint64_t seed = 0;
  std::string history_csv;
  int procs = 0;
  int replicas = 2;
  std::string checkpoint_dir;
  bool resume = false;
  bool async_checkpoint = true;
  int64_t train_samples = 0;
  std::string tensorboard_dir;
  std::string plot_png;
  std::string schedule = "constant";
  double max_lr = 0.0;
  std::string precision = "fp32";
  std::string memory_format = "auto";
  int64_t early_stop_patience = 0;
  bool lr_find = false;
  std::string progress = "auto";
  std::string save_weights;
  uint64_t save_shard_bytes = 0;
  std::string load_weights;
  app.add_option("--gpu-mode", gpu_mode, "single, dp, ddp or fsdp");
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch (per rank in ddp)");
  app.add_option("--device", device, "cpu or cuda:N");
  app.add_option("--data", data_dir, "directory with the Fashion-MNIST *-idx?-ubyte.gz files");
  app.add_option("--lr", learning_rate, "Adam learning rate");
  app.add_option("--workers", workers, "background loader threads");
  app.add_option("--seed", seed, "seed for weights and shuffling");
  app.add_option("--history", history_csv, "write the per-epoch history to this CSV file");
  app.add_option("--procs", procs, "ddp, fsdp: processes on this machine (0: one per GPU, or 2 on the CPU)");
  app.add_option("--replicas", replicas, "dp on the CPU: number of model replicas");
  std::string comm_hook = "none";
  bool zero = false;
  std::string sharding = "none";
  bool elastic = false;
  app.add_flag("--elastic", elastic, "ddp: when a rank other than 0 dies (killed, crashed), the others regroup and "
               "go on from the newest step one of them committed, without a restart (docs/elastic.md)");
  int max_replacements = 1;
  std::string backend = "auto";
  app.add_option("--backend", backend, "ddp, fsdp: the collectives' library: auto (NCCL on CUDA, Gloo on the CPU), gloo "
                 "or nccl (--elastic on CUDA needs gloo)");
  app.add_option("--max-replacements", max_replacements, "with --elastic: how many times a lost rank's place gets a "
                 "replacement process, which joins the running job at a step boundary (0: the others go on alone)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--zero", zero, "ddp: ZeRO-1, each rank keeps the optimizer state of about 1/procs of the parameters "
               "(the same as --sharding optimizer)");
  app.add_option("--sharding", sharding, "ddp, fsdp: what each rank keeps only 1/procs of: none, optimizer (ZeRO-1, "
                 "ddp), gradients (ZeRO-2) or full (ZeRO-3, the parameters too, gathered per layer as it runs; "
                 "gradients and full train with fsdp, also when spelled --gpu-mode ddp)")
      ->check(CLI::IsMember({"none", "optimizer", "gradients", "full"}));
  app.add_option("--comm-hook", comm_hook, "ddp: how gradients travel between ranks: none (fp32), fp16 or bf16 (half the bytes), powersgd[:RANK] (low-rank factors)");
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "write a checkpoint after every epoch into this directory, keeping the best by test accuracy");
  app.add_flag("--resume", resume, "continue from the newest checkpoint in --checkpoint-dir (if there is one)");
  app.add_flag("--async-checkpoint,!--no-async-checkpoint", async_checkpoint,
               "write checkpoints behind training (the default: sharded modes' per-rank ones, and one file of 16 MiB "
               "or more), or make training wait for each (--no-async-checkpoint)");
  app.add_option("--tensorboard", tensorboard_dir, "write TensorBoard scalars (loss, metrics, learning rate) into this directory");
  app.add_option("--plot", plot_png, "draw the training curves into this PNG (and an SVG beside it) when training ends");
  app.add_option("--train-samples", train_samples, "train on the first N training images only (0: all 60000)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", schedule, "learning-rate schedule per step: constant, one-cycle or flat-cos")
      ->check(CLI::IsMember({"constant", "one-cycle", "flat-cos"}));
  app.add_option("--max-lr", max_lr, "peak learning rate of one-cycle / flat-cos (default: --lr)")->check(CLI::NonNegativeNumber);
  app.add_option("--precision", precision, "fp32, bf16 (autocast, CPU or CUDA) or fp16 (autocast + loss scaling, CUDA)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--memory-format", memory_format,
                 "auto (channels-last for convolutional models), contiguous or channels-last")
      ->check(CLI::IsMember({"auto", "contiguous", "channels-last"}));
  app.add_option("--early-stop-patience", early_stop_patience,
                 "stop when test accuracy has not improved for N epochs (0: never)")->check(CLI::NonNegativeNumber);
  app.add_flag("--lr-find", lr_find, "run the learning-rate finder, print the suggested learning rate and exit");
  app.add_option("--progress", progress,
                 "auto (a live bar on a terminal, one line per epoch elsewhere), live (the bar redrawn also into a "
                 "file or pipe, at most every 0.2 s) or epochs (one line per epoch)")
      ->check(CLI::IsMember({"auto", "live", "epochs"}));
  app.add_option("--save-weights", save_weights,
                 "after training, write the model's weights as safetensors (state_dict names): one file, or Hugging "
                 "Face's sharded form (model-0000k-of-0000n.safetensors + model.safetensors.index.json) when the path is a "
                 "directory, ends in '/' or ends in .index.json");
  app.add_option("--save-weights-shard-bytes", save_shard_bytes,
                 "with --save-weights: write the sharded form with at most this many bytes per shard (default for a "
                 "directory: 5e9, Hugging Face's)");
  app.add_option("--load-weights", load_weights,
                 "before training, load weights into the model: safetensors (a .safetensors file, an index .json or a "
                 "directory with either) or a torch.distributed.checkpoint directory (a sharded run's checkpoint, or "
                 "Python's dcp.save({\"model\": ...})); every name, shape and dtype must match");
  CLI11_PARSE(app, argc, argv);

  try {
    // The mode is chosen at run time; every mode then runs the same compiled loop.
    trainloop::gpu_mode::Any mode =
        trainloop::mode_from_flags(trainloop::ModeFlags{.gpu_mode = gpu_mode, .device = device, .procs = procs,
                                                        .replicas = replicas, .comm_hook = comm_hook, .zero = zero,
                                                        .sharding = sharding, .elastic = elastic,
                                                        .max_replacements = max_replacements, .extra = {},
                                                        .backend = backend});
    if (resume && checkpoint_dir.empty()) {
      std::cerr << "--resume needs --checkpoint-dir DIR (the directory to resume from)\n";
      return 2;
    }
    using trainloop::data::FashionMNIST;
    FashionMNIST full_train(FashionMNIST::Split::Train, data_dir);
    FashionMNIST test(FashionMNIST::Split::Test, data_dir);
    trainloop::data::AnyDataset<> train = full_train;
    if (train_samples > 0) {
      const int64_t n = std::min<int64_t>(train_samples, full_train.inputs().size(0));
      train = trainloop::data::TensorDataset(full_train.inputs().narrow(0, 0, n), full_train.targets().narrow(0, 0, n), 10);
    }

    torch::manual_seed(seed);
    FashionNet net;
    // Before the loop places the model: the weights are copied into the model's own tensors.
    if (!load_weights.empty()) {
      if (trainloop::is_sharded_checkpoint(load_weights)) {  // torch.distributed.checkpoint's layout (ours, or dcp.save)
        trainloop::interop::load_dcp_weights(*net, load_weights);
      } else {
        trainloop::interop::load_safetensors(*net, load_weights);
      }
    }
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(learning_rate));
    trainloop::TrainLoop loop(  // TrainLoop<FashionNet, gpu_mode::Any>, from `net` and `mode`
        net, train, test, optimizer, torch::nn::CrossEntropyLoss(),
        trainloop::TrainLoopOptions()
            .batch_size(batch_size)
            .num_workers(workers)
            .seed(seed)
            .precision(trainloop::parse_precision(precision))
            .memory_format(trainloop::parse_memory_format(memory_format))
            .metrics({trainloop::Accuracy()}),
        mode);

    if (lr_find) {
      const auto found = loop.lr_find();
      if (loop.is_main()) {
        std::cout << "lr_find: " << found.learning_rates.size() << " steps from " << found.learning_rates.front() << " to "
                  << found.learning_rates.back() << (found.diverged ? " (stopped: the loss diverged)" : "")
                  << "\nsuggested lr " << found.valley << " (valley); steepest " << found.steepest << ", minimum/10 "
                  << found.minimum_tenth << '\n';
      }
      return 0;
    }

    trainloop::CallbackList callbacks;
    const double peak = max_lr > 0.0 ? max_lr : learning_rate;
    if (schedule == "one-cycle") callbacks.push_back(std::make_shared<trainloop::OneCycle>(trainloop::OneCycleOptions(peak)));
    if (schedule == "flat-cos") callbacks.push_back(std::make_shared<trainloop::FlatCos>(trainloop::FlatCosOptions(peak)));
    if (early_stop_patience > 0) {
      callbacks.push_back(std::make_shared<trainloop::EarlyStopping>(trainloop::EarlyStoppingOptions("val_accuracy")
                                                                         .mode(trainloop::MonitorMode::Max)
                                                                         .patience(early_stop_patience)));
    }
    const std::optional<bool> live =
        progress == "auto" ? std::nullopt : std::optional<bool>(progress == "live");  // auto: is stdout a terminal?
    callbacks.push_back(std::make_shared<trainloop::ProgressBar>(std::cout, live));
    if (!history_csv.empty()) callbacks.push_back(std::make_shared<trainloop::CsvLogger>(history_csv));
    if (!tensorboard_dir.empty()) callbacks.push_back(std::make_shared<trainloop::TensorBoardLogger>(tensorboard_dir));
    if (!plot_png.empty()) callbacks.push_back(std::make_shared<trainloop::TrainingPlot>(plot_png));
    if (!checkpoint_dir.empty()) {
      callbacks.push_back(std::make_shared<trainloop::ModelCheckpoint>(trainloop::ModelCheckpointOptions(checkpoint_dir)
                                                                          .every_n_epochs(1)
                                                                          .keep_last(1)
                                                                          .monitor("val_accuracy")
                                                                          .mode(trainloop::MonitorMode::Max)
                                                                          .keep_best(1)
                                                                          .in_background(async_checkpoint)));
    }
    // With --resume, a run killed in epoch 3 of 4 finishes epochs 3 and 4 from the newest checkpoint.
    auto history = loop.fit(epochs, callbacks, resume ? trainloop::Resume::last() : trainloop::Resume::none());

    // fit() leaves the whole trained model in this process in every mode (ddp and fsdp too).
    if (!save_weights.empty() && loop.is_main()) {
      trainloop::interop::save_safetensors(*net, save_weights, {.max_shard_bytes = save_shard_bytes});
      std::cout << "weights written to " << save_weights << '\n';
    }

    double seconds = 0;
    for (const auto& epoch : history.epochs) seconds += epoch.seconds;  // resumed epochs included
    std::cout << mode.name() << ": test accuracy " << history.validation("accuracy") << " (loss "
              << history.validation_loss() << ", " << history.last().validation->samples << " test images) after "
              << history.epochs.size() << " epochs, " << seconds << " s of training"
              << (history.stop_reason.empty() ? "" : " (" + history.stop_reason + ")") << '\n';
    // The most any rank holds, then each rank's (ZeRO splits the state; without it every rank holds it all).
    const auto& by_rank = history.last().optimizer_state_bytes_by_rank;
    std::cout << "optimizer state per rank: " << history.last().optimizer_state_bytes << " bytes";
    if (by_rank.size() > 1) {
      std::cout << " (";
      for (size_t r = 0; r < by_rank.size(); ++r) std::cout << (r > 0 ? ", " : "") << "rank " << r << ": " << by_rank[r];
      std::cout << ')';
    }
    std::cout << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
