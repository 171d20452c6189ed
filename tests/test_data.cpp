#define BOOST_TEST_MODULE test_data
#include "unit_test.hpp"

#include "test_support.hpp"

#include <trainloop/data/fashion_mnist.hpp>
#include <trainloop/data/idx_reader.hpp>
#include <trainloop/data/tensor_dataset.hpp>

#include <torch/torch.h>
#include <zlib.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using trainloop::data::FashionMNIST;
using trainloop::data::TensorDataset;

namespace {

const fs::path kDebianDir = trainloop::data::FashionMNISTOptions::default_root();


bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}


void write_gzip(const fs::path& path, const std::vector<unsigned char>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  BOOST_REQUIRE(file != nullptr);
  BOOST_REQUIRE_EQUAL(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())),
                      static_cast<int>(bytes.size()));
  gzclose(file);
}

void append_big_endian(std::vector<unsigned char>& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back((value >> shift) & 0xFF);
}

/// An MNIST-style label file: magic 2049, count, one byte per label.
std::vector<unsigned char> idx_labels(const std::vector<unsigned char>& labels) {
  std::vector<unsigned char> out;
  append_big_endian(out, 2049);
  append_big_endian(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

}  // namespace

// ---------------------------------------------------------------- TensorDataset

BOOST_AUTO_TEST_CASE(tensor_dataset_get_batch_returns_exactly_the_selected_rows) {
  const auto inputs = torch::arange(60, torch::kFloat32).reshape({20, 3});
  const auto targets = torch::arange(20, torch::kInt64).remainder(4);
  TensorDataset dataset(inputs, targets, 4);
  BOOST_TEST(*dataset.size() == 20u);
  BOOST_TEST(*dataset.num_classes() == 4);

  const std::vector<size_t> chosen{7, 0, 19, 7};
  const auto batch = dataset.get_batch(chosen);
  BOOST_TEST(batch.data.sizes() == torch::IntArrayRef({4, 3}));
  BOOST_TEST(batch.target.sizes() == torch::IntArrayRef({4}));
  for (size_t row = 0; row < chosen.size(); ++row) {
    const auto i = static_cast<int64_t>(chosen[row]);
    for (int64_t col = 0; col < 3; ++col) {
      BOOST_TEST(batch.data[row][col].item<float>() == static_cast<float>(3 * i + col));
    }
    BOOST_TEST(batch.target[row].item<int64_t>() == i % 4);
  }

  const auto single = dataset.get(5);
  BOOST_TEST(single.data.equal(inputs[5]));
  BOOST_TEST(single.target.item<int64_t>() == 1);
}

BOOST_AUTO_TEST_CASE(tensor_dataset_rejects_mismatched_or_empty_tensors) {
  const auto message = error_of(
      [] { TensorDataset(torch::zeros({10, 2}), torch::zeros({9}, torch::kLong)); });
  BOOST_TEST(contains(message, "10"));
  BOOST_TEST(contains(message, "9"));
  BOOST_TEST(contains(error_of([] { TensorDataset(torch::zeros({0, 2}), torch::zeros({0})); }),
                      "0 samples"));
  BOOST_TEST(contains(error_of([] { TensorDataset(torch::Tensor(), torch::zeros({3})); }),
                      "undefined inputs"));
}

BOOST_AUTO_TEST_CASE(tensor_dataset_label_range_error_names_value_index_and_range) {
  auto labels = torch::arange(10, torch::kInt64).remainder(10);
  labels[7] = 12;
  const auto message =
      error_of([&] { TensorDataset(torch::zeros({10, 2}), labels, /*num_classes=*/10); });
  BOOST_TEST(contains(message, "label 12"), message);
  BOOST_TEST(contains(message, "index 7"), message);
  BOOST_TEST(contains(message, "[0, 10)"), message);

  labels[7] = 3;
  labels[2] = -1;
  BOOST_TEST(contains(error_of([&] { TensorDataset(torch::zeros({10, 2}), labels, 10); }),
                      "label -1 at index 2"));
  BOOST_TEST(contains(error_of([] {
                        TensorDataset(torch::zeros({4, 2}), torch::zeros({4}), 10);
                      }),
                      "integer"));
  BOOST_CHECK_NO_THROW(TensorDataset(torch::zeros({10, 2}), labels.clamp_min(0), 10));
}

BOOST_AUTO_TEST_CASE(tensor_dataset_rejects_an_out_of_range_batch_index) {
  TensorDataset dataset(torch::zeros({5, 2}), torch::zeros({5}));
  const std::vector<size_t> bad{1, 5};
  const auto message = error_of([&] { dataset.get_batch(bad); });
  BOOST_TEST(contains(message, "index 5"), message);
  BOOST_TEST(contains(error_of([&] { dataset.get(7); }), "index 7"));
}

// ---------------------------------------------------------------- IDX reader

BOOST_AUTO_TEST_CASE(idx_reader_reads_multibyte_big_endian_values_gzipped_or_plain) {
  std::vector<unsigned char> bytes;
  append_big_endian(bytes, 0x00000C02);  // int32, 2 dimensions
  append_big_endian(bytes, 2);
  append_big_endian(bytes, 3);
  const std::vector<int32_t> values{0, 1, -1, 70000, -70000, 2147483647};
  for (int32_t v : values) append_big_endian(bytes, static_cast<uint32_t>(v));

  TempDir dir;
  write_gzip(dir.path / "values.gz", bytes);
  std::ofstream(dir.path / "values.idx", std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));

  for (const auto* name : {"values.gz", "values.idx"}) {
    const auto tensor = trainloop::data::read_idx(dir.path / name);
    BOOST_TEST(tensor.scalar_type() == torch::kInt32);
    BOOST_TEST(tensor.sizes() == torch::IntArrayRef({2, 3}));
    const auto flat = tensor.reshape({-1});
    for (size_t i = 0; i < values.size(); ++i) {
      BOOST_TEST(flat[static_cast<int64_t>(i)].item<int32_t>() == values[i]);
    }
  }
}

BOOST_AUTO_TEST_CASE(idx_reader_names_the_file_on_wrong_magic_and_extra_bytes) {
  TempDir dir;
  const auto labels = dir.path / "labels.gz";
  write_gzip(labels, idx_labels({1, 2, 3}));
  const auto message = error_of(
      [&] { trainloop::data::read_idx(labels, trainloop::data::kIdxImagesMagic); });
  BOOST_TEST(contains(message, labels.string()), message);
  BOOST_TEST(contains(message, "magic number 2049; expected 2051"), message);

  auto too_long = idx_labels({1, 2, 3});
  too_long.push_back(4);
  write_gzip(labels, too_long);
  BOOST_TEST(contains(error_of([&] { trainloop::data::read_idx(labels); }), "more bytes"));
}

// ---------------------------------------------------------------- Fashion-MNIST

BOOST_AUTO_TEST_CASE(fashion_mnist_train_split_matches_the_published_dataset) {
  FashionMNIST train(FashionMNIST::Split::Train);
  BOOST_TEST(*train.size() == 60000u);
  BOOST_TEST(train.inputs().sizes() == torch::IntArrayRef({60000, 1, 28, 28}));
  BOOST_TEST(train.inputs().scalar_type() == torch::kFloat32);
  BOOST_TEST(train.targets().sizes() == torch::IntArrayRef({60000}));
  BOOST_TEST(train.targets().scalar_type() == torch::kInt64);

  const auto histogram = torch::bincount(train.targets(), {}, 10);
  for (int64_t c = 0; c < 10; ++c) BOOST_TEST(histogram[c].item<int64_t>() == 6000);

  const double mean = train.inputs().mean().item<double>();
  const double std = train.inputs().std().item<double>();
  BOOST_TEST(std::abs(mean) < 0.01, "normalized mean " << mean);
  BOOST_TEST(std::abs(std - 1.0) < 0.02, "normalized std " << std);

  // Usable as a TensorDataset: one gather per batch.
  const std::vector<size_t> rows{0, 59999};
  const auto batch = train.get_batch(rows);
  BOOST_TEST(batch.data.sizes() == torch::IntArrayRef({2, 1, 28, 28}));
  BOOST_TEST(batch.data[1].equal(train.inputs()[59999]));
}

BOOST_AUTO_TEST_CASE(fashion_mnist_test_split_unnormalized_pixels_are_in_unit_range) {
  FashionMNIST test(FashionMNIST::Split::Test, kDebianDir, /*normalize=*/false);
  BOOST_TEST(*test.size() == 10000u);
  BOOST_TEST((test.split() == FashionMNIST::Split::Test));
  const auto histogram = torch::bincount(test.targets(), {}, 10);
  for (int64_t c = 0; c < 10; ++c) BOOST_TEST(histogram[c].item<int64_t>() == 1000);
  BOOST_TEST(test.inputs().min().item<float>() == 0.0f);
  BOOST_TEST(test.inputs().max().item<float>() == 1.0f);
  // The test split's own pixel statistics, close to the training split's constants.
  BOOST_TEST(std::abs(test.inputs().mean().item<double>() - FashionMNIST::kMean) < 0.002);
}

BOOST_AUTO_TEST_CASE(fashion_mnist_missing_directory_names_path_and_debian_package) {
  const fs::path missing = "/nonexistent/trainloop-fmnist";
  const auto message = error_of([&] {
    FashionMNIST(FashionMNIST::Split::Train, trainloop::data::FashionMNISTOptions().root(missing));
  });
  BOOST_TEST(contains(message, (missing / "train-images-idx3-ubyte.gz").string()), message);
  BOOST_TEST(contains(message, "dataset-fashion-mnist"), message);
  BOOST_TEST(contains(message, "apt-get install dataset-fashion-mnist"), message);
  BOOST_TEST(contains(message, "root("), message);
}

BOOST_AUTO_TEST_CASE(fashion_mnist_truncated_gzip_names_the_file_and_what_was_expected) {
  TempDir dir;
  fs::copy_file(kDebianDir / "t10k-labels-idx1-ubyte.gz", dir.path / "t10k-labels-idx1-ubyte.gz");
  const auto images = dir.path / "t10k-images-idx3-ubyte.gz";
  {
    std::ifstream in(kDebianDir / "t10k-images-idx3-ubyte.gz", std::ios::binary);
    std::vector<char> head(100000);
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream(images, std::ios::binary).write(head.data(), in.gcount());
  }
  const auto message = error_of([&] { FashionMNIST(FashionMNIST::Split::Test, dir.path); });
  BOOST_TEST(contains(message, images.string()), message);
  BOOST_TEST(contains(message, "truncated or corrupt"), message);
  BOOST_TEST(contains(message, "of 7840000 bytes"), message);
  BOOST_TEST(contains(message, "10000x28x28"), message);

  // Only the gzip trailer missing: all data is there, the CRC/length check still fails.
  const auto full = fs::file_size(kDebianDir / "t10k-images-idx3-ubyte.gz");
  fs::copy_file(kDebianDir / "t10k-images-idx3-ubyte.gz", images,
                fs::copy_options::overwrite_existing);
  fs::resize_file(images, full - 4);
  const auto trailer = error_of([&] { FashionMNIST(FashionMNIST::Split::Test, dir.path); });
  BOOST_TEST(contains(trailer, images.string()), trailer);
  BOOST_TEST(contains(trailer, "gzip trailer"), trailer);

  // A damaged CRC: zlib's check fails and the message says so.
  fs::resize_file(images, full);
  fs::copy_file(kDebianDir / "t10k-images-idx3-ubyte.gz", images,
                fs::copy_options::overwrite_existing);
  {
    std::fstream patch(images, std::ios::binary | std::ios::in | std::ios::out);
    patch.seekp(static_cast<std::streamoff>(full) - 6);
    patch.put('\x5a');
  }
  const auto crc = error_of([&] { FashionMNIST(FashionMNIST::Split::Test, dir.path); });
  BOOST_TEST(contains(crc, images.string()), crc);
  BOOST_TEST(contains(crc, "incorrect data check"), crc);
}

BOOST_AUTO_TEST_CASE(fashion_mnist_rejects_bad_labels_and_count_mismatch) {
  TempDir dir;
  fs::copy_file(kDebianDir / "t10k-images-idx3-ubyte.gz", dir.path / "t10k-images-idx3-ubyte.gz");
  const auto labels = dir.path / "t10k-labels-idx1-ubyte.gz";
  write_gzip(labels, idx_labels({1, 2, 3}));
  const auto mismatch = error_of([&] { FashionMNIST(FashionMNIST::Split::Test, dir.path); });
  BOOST_TEST(contains(mismatch, "10000 images"), mismatch);
  BOOST_TEST(contains(mismatch, "3 labels"), mismatch);

  std::vector<unsigned char> values(10000, 4);
  values[1234] = 10;
  write_gzip(labels, idx_labels(values));
  const auto bad = error_of([&] { FashionMNIST(FashionMNIST::Split::Test, dir.path); });
  BOOST_TEST(contains(bad, labels.string()), bad);
  BOOST_TEST(contains(bad, "label 10 at index 1234"), bad);
}
