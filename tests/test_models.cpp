#define BOOST_TEST_MODULE test_models
#include "unit_test.hpp"

#include <trainloop/models.hpp>

#include <cmath>
#include <map>
#include <regex>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace models = trainloop::models;

namespace {

// Every parameter and buffer by name: what Python's state_dict() holds.
std::map<std::string, torch::Tensor> state_dict(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> entries;
  for (const auto& parameter : module.named_parameters()) entries.emplace(parameter.key(), parameter.value());
  for (const auto& buffer : module.named_buffers()) entries.emplace(buffer.key(), buffer.value());
  return entries;
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const auto& parameter : module.parameters()) count += parameter.numel();
  return count;
}

// Checks that every (name, shape) is in `entries`.
void check_entries(const std::map<std::string, torch::Tensor>& entries,
                   const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected) {
  for (const auto& [name, shape] : expected) {
    const auto found = entries.find(name);
    BOOST_TEST_CONTEXT(name) {
      BOOST_REQUIRE(found != entries.end());
      BOOST_TEST(found->second.sizes().vec() == shape);
    }
  }
}

// Copies every parameter and buffer of `from` into the entry of the same name of `to`.
void copy_state(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto target = state_dict(to);
  for (const auto& [name, tensor] : state_dict(from)) target.at(name).copy_(tensor);
}

// Counts the batch norms of each kind.
std::pair<int, int> batch_norm_kinds(const torch::nn::Module& module) {
  int plain = 0, sync = 0;
  for (const auto& child : module.modules(/*include_self=*/false)) {
    plain += child->as<torch::nn::BatchNorm2d>() != nullptr;
    sync += child->as<trainloop::nn::SyncBatchNorm>() != nullptr;
  }
  return {plain, sync};
}

}  // namespace

BOOST_AUTO_TEST_CASE(parameter_counts_at_1000_classes_are_torchvisions_and_fastais) {
  // torchvision's published counts; fastai's are torchvision's plus 19,232 for the stem
  // (3x3 convolutions 3->32, 32->32, 32->64 and their batch norms instead of a 7x7 3->64).
  const std::vector<std::pair<std::string, int64_t>> expected{
      {"resnet18", 11'689'512},  {"resnet34", 21'797'672},  {"resnet50", 25'557'032},  {"resnet101", 44'549'160},
      {"xresnet18", 11'708'744}, {"xresnet34", 21'816'904}, {"xresnet50", 25'576'264},
  };
  for (const auto& [name, count] : expected) {
    BOOST_TEST_CONTEXT(name) { BOOST_TEST(parameter_count(*models::ImageClassifier(name)) == count); }
  }
  // The family types build the same networks.
  BOOST_TEST(parameter_count(*models::resnet18()) == 11'689'512);
  BOOST_TEST(parameter_count(*models::xresnet18()) == 11'708'744);
}

BOOST_AUTO_TEST_CASE(resnet_state_dict_has_torchvisions_names) {
  // resnet18: 20 convolutions and 20 batch norms (1 stem, 16 in blocks, 3 downsample) and fc:
  // 20 + 2 * 20 + 2 = 62 parameters and 3 * 20 = 60 buffers.
  const auto resnet18 = state_dict(*models::ImageClassifier("resnet18"));
  BOOST_TEST(resnet18.size() == 122u);
  check_entries(resnet18, {{"conv1.weight", {64, 3, 7, 7}},
                           {"bn1.weight", {64}},
                           {"bn1.bias", {64}},
                           {"bn1.running_mean", {64}},
                           {"bn1.running_var", {64}},
                           {"bn1.num_batches_tracked", {}},
                           {"layer1.0.conv1.weight", {64, 64, 3, 3}},
                           {"layer1.1.bn2.running_var", {64}},
                           {"layer2.0.conv1.weight", {128, 64, 3, 3}},
                           {"layer2.0.downsample.0.weight", {128, 64, 1, 1}},
                           {"layer2.0.downsample.1.num_batches_tracked", {}},
                           {"layer4.0.downsample.0.weight", {512, 256, 1, 1}},
                           {"layer4.1.conv2.weight", {512, 512, 3, 3}},
                           {"fc.weight", {1000, 512}},
                           {"fc.bias", {1000}}});
  BOOST_TEST(resnet18.count("layer1.0.downsample.0.weight") == 0u);  // layer1 keeps 64 channels
  BOOST_TEST(resnet18.count("layer4.1.downsample.0.weight") == 0u);  // only a stage's first block

  // resnet50: 53 convolutions and batch norms (1 stem, 48 in blocks, 4 downsample) and fc:
  // 53 + 2 * 53 + 2 = 161 parameters and 3 * 53 = 159 buffers.
  models::ImageClassifier resnet50("resnet50");
  const auto entries = state_dict(*resnet50);
  BOOST_TEST(entries.size() == 320u);
  check_entries(entries, {{"conv1.weight", {64, 3, 7, 7}},
                          {"bn1.num_batches_tracked", {}},
                          {"layer1.0.conv1.weight", {64, 64, 1, 1}},
                          {"layer1.0.conv3.weight", {256, 64, 1, 1}},
                          {"layer1.0.downsample.0.weight", {256, 64, 1, 1}},
                          {"layer2.0.conv2.weight", {128, 128, 3, 3}},
                          {"layer3.5.bn3.running_var", {1024}},
                          {"layer4.0.downsample.0.weight", {2048, 1024, 1, 1}},
                          {"layer4.0.downsample.1.running_mean", {2048}},
                          {"layer4.2.bn3.weight", {2048}},
                          {"fc.weight", {1000, 2048}},
                          {"fc.bias", {1000}}});
  BOOST_TEST(entries.count("layer4.1.downsample.0.weight") == 0u);
  // v1.5: the stride is on the 3x3 convolution, not on the first 1x1.
  const auto modules = resnet50->named_modules();
  BOOST_TEST(modules["layer2.0.conv1"]->as<torch::nn::Conv2d>()->options.stride()->at(0) == 1);
  BOOST_TEST(modules["layer2.0.conv2"]->as<torch::nn::Conv2d>()->options.stride()->at(0) == 2);
  BOOST_TEST(modules["layer2.0.downsample.0"]->as<torch::nn::Conv2d>()->options.stride()->at(0) == 2);
}

BOOST_AUTO_TEST_CASE(xresnet_state_dict_has_fastais_names) {
  // xresnet18: 22 ConvLayers (3 stem, 16 in blocks, 3 idpath) and the Linear:
  // 22 + 2 * 22 + 2 = 68 parameters and 3 * 22 = 66 buffers.
  const auto xresnet18 = state_dict(*models::ImageClassifier("xresnet18"));
  BOOST_TEST(xresnet18.size() == 134u);
  check_entries(xresnet18, {{"0.0.weight", {32, 3, 3, 3}},
                            {"0.1.weight", {32}},
                            {"0.1.num_batches_tracked", {}},
                            {"1.0.weight", {32, 32, 3, 3}},
                            {"2.0.weight", {64, 32, 3, 3}},
                            {"2.1.running_var", {64}},
                            {"4.0.convpath.0.0.weight", {64, 64, 3, 3}},
                            {"4.0.convpath.1.1.weight", {64}},
                            {"4.1.convpath.1.0.weight", {64, 64, 3, 3}},
                            {"5.0.convpath.0.0.weight", {128, 64, 3, 3}},
                            {"5.0.idpath.1.0.weight", {128, 64, 1, 1}},  // idpath.0 is the AvgPool2d
                            {"5.0.idpath.1.1.running_mean", {128}},
                            {"7.1.convpath.1.1.bias", {512}},
                            {"11.weight", {1000, 512}},
                            {"11.bias", {1000}}});
  BOOST_TEST(xresnet18.count("4.0.idpath.0.0.weight") == 0u);  // stage 1 keeps 64 channels: identity

  // xresnet50: 55 ConvLayers (3 stem, 48 in blocks, 4 idpath): 167 parameters, 165 buffers.
  const auto xresnet50 = state_dict(*models::ImageClassifier("xresnet50"));
  BOOST_TEST(xresnet50.size() == 332u);
  check_entries(xresnet50, {{"0.0.weight", {32, 3, 3, 3}},
                            {"4.0.convpath.0.0.weight", {64, 64, 1, 1}},
                            {"4.0.convpath.1.0.weight", {64, 64, 3, 3}},
                            {"4.0.convpath.2.0.weight", {256, 64, 1, 1}},
                            {"4.0.convpath.2.1.weight", {256}},
                            {"4.0.idpath.0.0.weight", {256, 64, 1, 1}},  // stride 1: no pool
                            {"5.0.idpath.1.0.weight", {512, 256, 1, 1}},
                            {"6.5.convpath.2.1.running_var", {1024}},
                            {"7.2.convpath.2.1.weight", {2048}},
                            {"11.weight", {1000, 2048}},
                            {"11.bias", {1000}}});
}

BOOST_AUTO_TEST_CASE(forward_gives_one_row_of_logits_per_image_at_any_size) {
  torch::NoGradGuard no_grad;
  for (const std::string name : {"resnet18", "xresnet18"}) {
    for (const int64_t channels : {1, 3}) {
      models::ImageClassifier model(name, models::ImageModelOptions().num_classes(10).in_channels(channels));
      model->eval();
      for (const int64_t size : {32, 64, 128, 160, 200, 224}) {
        BOOST_TEST_CONTEXT(name << ", " << channels << " channels, " << size << " px") {
          const auto output = model->forward(torch::randn({2, channels, size, size}));
          BOOST_TEST(output.sizes().vec() == (std::vector<int64_t>{2, 10}));
          BOOST_TEST(output.isfinite().all().item<bool>());
        }
      }
    }
  }
  // The deeper ones at one size, alternating the input channels.
  const std::vector<std::pair<std::string, int64_t>> deeper{
      {"resnet34", 1}, {"resnet50", 3}, {"resnet101", 1}, {"xresnet34", 3}, {"xresnet50", 1}};
  for (const auto& [name, channels] : deeper) {
    models::ImageClassifier model(name, models::ImageModelOptions().num_classes(10).in_channels(channels));
    model->eval();
    BOOST_TEST_CONTEXT(name) {
      BOOST_TEST(model->forward(torch::randn({2, channels, 64, 64})).sizes().vec() == (std::vector<int64_t>{2, 10}));
    }
  }
}

BOOST_AUTO_TEST_CASE(initialisation_is_torchvisions_and_fastais) {
  // fastai: the batch norm closing each block's convpath starts at weight 0 (BatchZero), every
  // other at 1, and init_cnn sets every bias to 0.
  for (const std::string name : {"xresnet18", "xresnet50"}) {
    models::ImageClassifier model(name);
    // The batch norm (child 1) of a block's last ConvLayer: convpath.1 (expansion 1) or convpath.2 (4).
    const std::regex last_of_block(name == "xresnet18" ? R"([4-7]\.\d+\.convpath\.1\.1)"
                                                       : R"([4-7]\.\d+\.convpath\.2\.1)");
    int zero = 0, one = 0;
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      const auto* norm = item.value()->as<torch::nn::BatchNorm2d>();
      if (norm == nullptr) continue;
      const bool last = std::regex_match(item.key(), last_of_block);
      BOOST_TEST_CONTEXT(name << " " << item.key()) {
        BOOST_TEST(torch::equal(norm->weight, torch::full_like(norm->weight, last ? 0.0 : 1.0)));
        BOOST_TEST(torch::equal(norm->bias, torch::zeros_like(norm->bias)));
      }
      (last ? zero : one) += 1;
    }
    BOOST_TEST(zero == (name == "xresnet18" ? 8 : 16));  // one per block
    BOOST_TEST(one == (name == "xresnet18" ? 14 : 39));
    // kaiming_normal_ with its defaults (fan_in): std sqrt(2 / fan_in), on the Linear too.
    const auto entries = state_dict(*model);
    const auto conv = entries.at(name == "xresnet18" ? "7.0.convpath.0.0.weight" : "7.0.convpath.1.0.weight");
    const double fan_in = static_cast<double>(conv.size(1) * conv.size(2) * conv.size(3));
    BOOST_TEST(conv.std().item<double>() == std::sqrt(2.0 / fan_in), boost::test_tools::tolerance(0.02));
    const auto& linear = entries.at("11.weight");
    BOOST_TEST(linear.std().item<double>() == std::sqrt(2.0 / linear.size(1)), boost::test_tools::tolerance(0.02));
    BOOST_TEST(torch::equal(entries.at("11.bias"), torch::zeros({1000})));
  }

  // torchvision: batch norms at weight 1 and bias 0; convolutions kaiming_normal_(fan_out, relu);
  // fc keeps nn.Linear's default uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) bias.
  models::ImageClassifier resnet18("resnet18");
  int norms = 0;
  for (const auto& module : resnet18->modules(/*include_self=*/false)) {
    if (const auto* norm = module->as<torch::nn::BatchNorm2d>()) {
      BOOST_TEST(torch::equal(norm->weight, torch::ones_like(norm->weight)));
      BOOST_TEST(torch::equal(norm->bias, torch::zeros_like(norm->bias)));
      ++norms;
    }
  }
  BOOST_TEST(norms == 20);
  const auto entries = state_dict(*resnet18);
  const auto& conv = entries.at("layer4.0.conv1.weight");  // [512, 256, 3, 3]: fan_out 4608, fan_in 2304
  BOOST_TEST(conv.std().item<double>() == std::sqrt(2.0 / (512 * 9)), boost::test_tools::tolerance(0.02));
  const auto& bias = entries.at("fc.bias");
  BOOST_TEST(bias.abs().max().item<double>() <= 1.0 / std::sqrt(512.0));
  BOOST_TEST(bias.abs().min().item<double>() > 0.0);
}

BOOST_AUTO_TEST_CASE(sync_batchnorm_changes_the_layer_kind_only) {
  for (const std::string name : {"resnet18", "xresnet18"}) {
    BOOST_TEST_CONTEXT(name) {
      const auto options = models::ImageModelOptions().num_classes(10);
      models::ImageClassifier plain(name, options);
      models::ImageClassifier sync(name, models::ImageModelOptions(options).sync_batchnorm(true));
      const int norms = name == "resnet18" ? 20 : 22;
      BOOST_TEST((batch_norm_kinds(*plain) == std::make_pair(norms, 0)));
      BOOST_TEST((batch_norm_kinds(*sync) == std::make_pair(0, norms)));
      // Same names and shapes: checkpoints of one load into the other.
      const auto plain_entries = state_dict(*plain), sync_entries = state_dict(*sync);
      BOOST_REQUIRE(plain_entries.size() == sync_entries.size());
      for (const auto& [key, tensor] : plain_entries) {
        BOOST_TEST_CONTEXT(key) {
          BOOST_REQUIRE(sync_entries.count(key) == 1u);
          BOOST_TEST(sync_entries.at(key).sizes().vec() == tensor.sizes().vec());
        }
      }
      // Outside DDP both are torch's batch norm: equal outputs on equal weights, in evaluation
      // and in training (where both also update their running statistics alike).
      copy_state(*plain, *sync);
      const auto input = torch::randn({2, 3, 64, 64});
      plain->eval();
      sync->eval();
      {
        torch::NoGradGuard no_grad;
        BOOST_TEST(torch::equal(plain->forward(input), sync->forward(input)));
      }
      plain->train();
      sync->train();
      BOOST_TEST(torch::equal(plain->forward(input), sync->forward(input)));
      const auto plain_after = state_dict(*plain), sync_after = state_dict(*sync);
      for (const auto& [key, tensor] : plain_after) {
        BOOST_TEST_CONTEXT(key) { BOOST_TEST(torch::equal(tensor, sync_after.at(key))); }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(clone_gives_an_equal_independent_copy) {
  const auto options = models::ImageModelOptions().num_classes(10).in_channels(1);
  // Every model type, and both kinds of batch norm (DataParallel replicates with clone()).
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> originals{
      {"ImageClassifier resnet18", models::ImageClassifier("resnet18", options).ptr()},
      {"ImageClassifier xresnet18 sync",
       models::ImageClassifier("xresnet18", models::ImageModelOptions(options).sync_batchnorm(true)).ptr()},
      {"ResNet resnet18", models::resnet18(options).ptr()},
      {"XResNet xresnet18", models::xresnet18(options).ptr()},
  };
  const auto input = torch::randn({2, 1, 32, 32});
  auto forward = [&input](const std::shared_ptr<torch::nn::Module>& module) {
    torch::NoGradGuard no_grad;
    if (auto* classifier = module->as<models::ImageClassifier>()) return classifier->forward(input);
    if (auto* resnet = module->as<models::ResNet>()) return resnet->forward(input);
    return module->as<models::XResNet>()->forward(input);
  };
  for (const auto& [label, original] : originals) {
    BOOST_TEST_CONTEXT(label) {
      original->eval();
      const auto copy = original->clone();
      BOOST_TEST((typeid(*copy) == typeid(*original)));
      BOOST_TEST(!copy->is_training());
      const auto before = state_dict(*original), copied = state_dict(*copy);
      BOOST_REQUIRE(copied.size() == before.size());
      for (const auto& [key, tensor] : before) {
        BOOST_TEST_CONTEXT(key) {
          BOOST_REQUIRE(copied.count(key) == 1u);
          BOOST_TEST(torch::equal(copied.at(key), tensor));
          BOOST_TEST(copied.at(key).data_ptr() != tensor.data_ptr());
        }
      }
      BOOST_TEST((batch_norm_kinds(*copy) == batch_norm_kinds(*original)));
      const auto output = forward(original);
      BOOST_TEST(torch::equal(forward(copy), output));
      // Changing the copy changes the copy's outputs (its forward uses its own layers) and not the original.
      {
        torch::NoGradGuard no_grad;
        for (auto& parameter : copy->parameters()) parameter.add_(0.5);
      }
      BOOST_TEST(!torch::equal(forward(copy), output));
      BOOST_TEST(torch::equal(forward(original), output));
      for (const auto& [key, tensor] : state_dict(*original)) {
        BOOST_TEST_CONTEXT(key) { BOOST_TEST(torch::equal(tensor, before.at(key))); }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_training_step_gives_every_parameter_a_gradient) {
  for (const std::string name : {"resnet18", "xresnet18"}) {
    BOOST_TEST_CONTEXT(name) {
      models::ImageClassifier model(name, models::ImageModelOptions().num_classes(10));
      model->train();
      const auto loss = torch::cross_entropy_loss(model->forward(torch::randn({4, 3, 32, 32})),
                                                  torch::tensor({0, 1, 2, 3}, torch::kLong));
      loss.backward();
      for (const auto& parameter : model->named_parameters()) {
        BOOST_TEST_CONTEXT(parameter.key()) {
          BOOST_REQUIRE(parameter.value().grad().defined());
          BOOST_TEST(parameter.value().grad().isfinite().all().item<bool>());
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(an_unknown_architecture_names_itself_and_the_known_ones) {
  const std::vector<std::string> names{"resnet18",  "resnet34",  "resnet50", "resnet101",
                                       "xresnet18", "xresnet34", "xresnet50"};
  BOOST_TEST(models::available() == names, boost::test_tools::per_element());
  BOOST_CHECK_EXCEPTION(models::ImageClassifier("resnt18"), trainloop::ConfigurationError,
                        [](const trainloop::ConfigurationError& error) {
                          const std::string message = error.what();
                          BOOST_TEST_MESSAGE(message);
                          return message ==
                                 "trainloop: architecture is \"resnt18\"; expected one of resnet18, resnet34, "
                                 "resnet50, resnet101, xresnet18, xresnet34, xresnet50";
                        });
  BOOST_CHECK_THROW(models::ImageClassifier("resnet18", models::ImageModelOptions().num_classes(0)),
                    trainloop::ConfigurationError);
  BOOST_CHECK_THROW(models::ImageClassifier("xresnet18", models::ImageModelOptions().in_channels(0)),
                    trainloop::ConfigurationError);
}
