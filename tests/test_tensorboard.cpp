#define BOOST_TEST_MODULE test_tensorboard
#include "unit_test.hpp"

// TensorBoardLogger's event file, read back by an independent decoder of the record format:
// every record's two CRCs checked, every Event and Summary.Value parsed.

#include <trainloop/trainloop.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

struct Scalar {
  std::string tag;
  float value = 0;
  int64_t step = 0;
};

/// A protobuf reader for exactly the fields of Event / Summary / Value.
struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; p < end; shift += 7) {
      const uint8_t byte = *p++;
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if (!(byte & 0x80)) break;
    }
    return value;
  }
};

std::vector<Scalar> read_events(const fs::path& path, std::string& file_version) {
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Scalar> scalars;
  size_t at = 0;
  while (at < bytes.size()) {
    BOOST_REQUIRE(at + 12 <= bytes.size());
    uint64_t length = 0;
    uint32_t header_crc = 0, data_crc = 0;
    std::memcpy(&length, &bytes[at], 8);
    std::memcpy(&header_crc, &bytes[at + 8], 4);
    BOOST_REQUIRE(header_crc == tl::detail::masked_crc32c(&bytes[at], 8));
    BOOST_REQUIRE(at + 12 + length + 4 <= bytes.size());
    const uint8_t* data = &bytes[at + 12];
    std::memcpy(&data_crc, data + length, 4);
    BOOST_REQUIRE(data_crc == tl::detail::masked_crc32c(data, length));
    at += 12 + length + 4;
    Reader event{data, data + length};
    int64_t step = 0;
    std::vector<Scalar> in_event;
    while (event.p < event.end) {
      const uint64_t key = event.varint();
      const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
      if (wire == 1) {
        event.p += 8;  // wall_time
      } else if (wire == 0) {
        const uint64_t value = event.varint();
        if (field == 2) step = static_cast<int64_t>(value);
      } else if (wire == 2) {
        const uint64_t size = event.varint();
        if (field == 3) file_version.assign(reinterpret_cast<const char*>(event.p), size);
        if (field == 5) {  // Summary
          Reader summary{event.p, event.p + size};
          while (summary.p < summary.end) {
            summary.varint();  // field 1, wire 2: a Value
            const uint64_t value_size = summary.varint();
            Reader value{summary.p, summary.p + value_size};
            Scalar scalar;
            while (value.p < value.end) {
              const uint64_t value_key = value.varint();
              if ((value_key >> 3) == 1) {
                const uint64_t tag_size = value.varint();
                scalar.tag.assign(reinterpret_cast<const char*>(value.p), tag_size);
                value.p += tag_size;
              } else if ((value_key >> 3) == 2) {
                std::memcpy(&scalar.value, value.p, 4);
                value.p += 4;
              }
            }
            in_event.push_back(scalar);
            summary.p += value_size;
          }
        }
        event.p += size;
      }
    }
    for (auto& scalar : in_event) {
      scalar.step = step;
      scalars.push_back(scalar);
    }
  }
  return scalars;
}

tl::data::TensorDataset blobs(int64_t n, uint64_t seed) {
  auto x = torch::randn({n, 8}, at::detail::createCPUGenerator(seed));
  auto y = x.matmul(torch::randn({8, 3}, at::detail::createCPUGenerator(1234))).argmax(1);
  return tl::data::TensorDataset(x, y, 3);
}

}  // namespace

BOOST_AUTO_TEST_CASE(crc32c_matches_the_published_check_value) {
  const char* text = "123456789";
  BOOST_TEST(tl::detail::crc32c(reinterpret_cast<const uint8_t*>(text), 9) == 0xE3069283u);
}

BOOST_AUTO_TEST_CASE(every_scalar_of_every_epoch_and_step_is_in_the_event_file) {
  const auto dir = fs::temp_directory_path() / ("trainloop_tensorboard_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  torch::manual_seed(1);
  auto net = torch::nn::Linear(8, 3);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<torch::nn::Linear> loop(net, blobs(64, 1), blobs(32, 2), optimizer, torch::nn::CrossEntropyLoss(),
                                        tl::TrainLoopOptions().batch_size(16).metrics({std::make_shared<tl::Accuracy>()}));
  auto logger = std::make_shared<tl::TensorBoardLogger>(dir, 2);
  auto history = loop.fit(3, {logger});
  std::string version;
  const auto scalars = read_events(logger->event_file(), version);
  BOOST_TEST(version == "brain.Event:2");
  BOOST_TEST(logger->event_file().filename().string().rfind("events.out.tfevents.", 0) == 0u);
  std::map<std::string, std::vector<Scalar>> by_tag;
  for (const auto& s : scalars) by_tag[s.tag].push_back(s);
  BOOST_REQUIRE(by_tag["train/loss"].size() == 3u);
  for (size_t e = 0; e < 3; ++e) {
    BOOST_TEST(by_tag["train/loss"][e].value == static_cast<float>(history.epochs[e].train_loss));
    BOOST_TEST(by_tag["train/loss"][e].step == static_cast<int64_t>(4 * (e + 1)));
    BOOST_TEST(by_tag["val/loss"][e].value == static_cast<float>(history.epochs[e].validation->loss));
    BOOST_TEST(by_tag["val/accuracy"][e].value == static_cast<float>(history.epochs[e].validation->metrics.at("accuracy")));
    BOOST_TEST(by_tag["train/accuracy"][e].value == static_cast<float>(history.epochs[e].train_metrics.at("accuracy")));
  }
  BOOST_TEST(by_tag["train/loss_step"].size() == 6u);  // 12 steps, every 2nd
  BOOST_TEST(by_tag["train/lr"].size() == 6u);
  BOOST_TEST(by_tag["train/lr"].front().value == 0.1f);
  BOOST_TEST(by_tag["train/samples_per_second"].size() == 3u);
  fs::remove_all(dir);
}
