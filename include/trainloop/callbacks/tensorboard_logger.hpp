#pragma once
/// @file
/// @brief TensorBoardLogger: scalars per step and per epoch in TensorBoard's event file format,
/// written from the main process only.
///
/// @code
/// loop.fit(10, {std::make_shared<trainloop::TensorBoardLogger>("runs/fmnist")});
/// // tensorboard --logdir runs
/// @endcode
///
/// Tags: per step (every `every_n_steps`) `train/loss_step` and `train/lr` (one per param group:
/// `train/lr`, `train/lr_group1`, ...) and `train/momentum` (SGD momentum or Adam beta1, if any); per epoch `train/loss`, `train/<metric>`, `val/loss`,
/// `val/<metric>`, `train/samples_per_second`, `train/data_wait_fraction` (of the epoch's training time spent waiting
/// for the loader); the step axis is the global optimizer step.
///
/// The format (hand-written: no Debian package writes it, and it is small): a file
/// `events.out.tfevents.<seconds>.<host>` of records, each `uint64 length, uint32 masked CRC32C of
/// the length, the bytes, uint32 masked CRC32C of the bytes` (TFRecord), whose bytes are a protobuf
/// `Event { double wall_time = 1; int64 step = 2; string file_version = 3 (first record) |
/// Summary summary = 5 }`, `Summary { repeated Value value = 1 }`, `Value { string tag = 1;
/// float simple_value = 2 }`. Records are appended and flushed at every epoch end and at the end
/// of fit(); a reader (tests/test_tensorboard.cpp, or TensorBoard) sees complete records only.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/optim/hyperparameters.hpp>
#include <trainloop/error.hpp>

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

namespace detail {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven: what TFRecord checksums use.
inline uint32_t crc32c(const uint8_t* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t crc = i;
      for (int k = 0; k < 8; ++k) crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
      t[i] = crc;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant (so CRCs of CRCs stay useful).
inline uint32_t masked_crc32c(const uint8_t* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

/// The few protobuf wire-format pieces an Event needs.
class ProtoWriter {
 public:
  void varint(uint64_t value) {
    while (value >= 0x80) {
      bytes_.push_back(static_cast<uint8_t>(value | 0x80));
      value >>= 7;
    }
    bytes_.push_back(static_cast<uint8_t>(value));
  }
  void tag(int field, int wire_type) { varint(static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type)); }
  void double_field(int field, double value) {
    tag(field, 1);
    append_little_endian(value);
  }
  void float_field(int field, float value) {
    tag(field, 5);
    append_little_endian(value);
  }
  void int64_field(int field, int64_t value) {
    tag(field, 0);
    varint(static_cast<uint64_t>(value));
  }
  void bytes_field(int field, const std::string& value) {
    tag(field, 2);
    varint(value.size());
    bytes_.insert(bytes_.end(), value.begin(), value.end());
  }
  void message_field(int field, const ProtoWriter& message) {
    tag(field, 2);
    varint(message.bytes_.size());
    bytes_.insert(bytes_.end(), message.bytes_.begin(), message.bytes_.end());
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  template <class T>
  void append_little_endian(T value) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));  // x86-64 and aarch64 are little-endian, as the format
    bytes_.insert(bytes_.end(), raw, raw + sizeof(T));
  }
  std::vector<uint8_t> bytes_;
};

/// Appends TFRecord-framed Events to one event file.
class EventFileWriter {
 public:
  /// Creates `<directory>/events.out.tfevents.<seconds>.<host>` and writes the file_version record.
  explicit EventFileWriter(const std::filesystem::path& directory) {
    std::error_code error;
    std::filesystem::create_directories(directory, error);
    TRAINLOOP_CHECK(!error && std::filesystem::is_directory(directory), "cannot create the TensorBoard directory ",
                    directory.string(), " (", error.message(), "); expected a writable location");
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    path_ = directory / ("events.out.tfevents." + std::to_string(seconds) + "." + host);
    out_.open(path_, std::ios::binary | std::ios::app);
    TRAINLOOP_CHECK(out_.good(), "cannot write the TensorBoard event file ", path_.string());
    ProtoWriter event;
    event.double_field(1, wall_time());
    event.bytes_field(3, "brain.Event:2");
    write_record(event);
    flush();
  }
  /// The event file.
  const std::filesystem::path& path() const { return path_; }

  /// One scalar at a step.
  void scalar(const std::string& tag, double value, int64_t step) {
    ProtoWriter value_message;
    value_message.bytes_field(1, tag);
    value_message.float_field(2, static_cast<float>(value));
    ProtoWriter summary;
    summary.message_field(1, value_message);
    ProtoWriter event;
    event.double_field(1, wall_time());
    event.int64_field(2, step);
    event.message_field(5, summary);
    write_record(event);
  }
  /// Pushes the records to the file.
  void flush() {
    out_.flush();
    TRAINLOOP_CHECK(out_.good(), "writing the TensorBoard event file ", path_.string(), " failed");
  }

 private:
  static double wall_time() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  void write_record(const ProtoWriter& event) {
    const auto& data = event.bytes();
    const uint64_t length = data.size();
    uint8_t header[8];
    std::memcpy(header, &length, 8);
    const uint32_t header_crc = masked_crc32c(header, 8), data_crc = masked_crc32c(data.data(), data.size());
    out_.write(reinterpret_cast<const char*>(header), 8);
    out_.write(reinterpret_cast<const char*>(&header_crc), 4);
    out_.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    out_.write(reinterpret_cast<const char*>(&data_crc), 4);
  }
  std::filesystem::path path_;
  std::ofstream out_;
};

}  // namespace detail

/// @brief Writes loss, metrics, learning rates and throughput as TensorBoard scalars (see the file comment).
class TensorBoardLogger : public Callback {
 public:
  /// @param directory where the event file goes (created if missing), e.g. "runs/fmnist"
  /// @param every_n_steps per-step scalars every N optimizer steps (0: none)
  explicit TensorBoardLogger(std::filesystem::path directory, int64_t every_n_steps = 10)
      : directory_(std::move(directory)), every_n_steps_(every_n_steps) {
    TRAINLOOP_CHECK(every_n_steps_ >= 0, "TensorBoardLogger every_n_steps is ", every_n_steps_, "; expected 0 or more");
  }
  /// Writes files: the main process only.
  bool main_process_only() const override { return true; }
  /// @brief The event file being written (empty before the first fit()).
  std::filesystem::path event_file() const { return writer_ ? writer_->path() : std::filesystem::path(); }

  void on_fit_begin(TrainState&) override {
    if (!writer_) writer_ = std::make_unique<detail::EventFileWriter>(directory_);
  }
  void on_step_end(TrainState& state) override {
    if (every_n_steps_ == 0 || state.global_step % every_n_steps_ != 0) return;
    writer_->scalar("train/loss_step", state.last_loss(), state.global_step);
    const auto rates = state.learning_rates();
    for (size_t g = 0; g < rates.size(); ++g) {
      writer_->scalar(g == 0 ? "train/lr" : "train/lr_group" + std::to_string(g), rates[g], state.global_step);
    }
    if (auto momentum = momentum_of(*state.optimizer)) writer_->scalar("train/momentum", *momentum, state.global_step);
  }
  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    const int64_t step = state.global_step;
    writer_->scalar("train/loss", record.train_loss, step);
    for (const auto& [name, value] : record.train_metrics) writer_->scalar("train/" + name, value, step);
    if (record.validation) {
      writer_->scalar("val/loss", record.validation->loss, step);
      for (const auto& [name, value] : record.validation->metrics) writer_->scalar("val/" + name, value, step);
    }
    writer_->scalar("train/samples_per_second", record.samples_per_second, step);
    if (record.seconds > 0) writer_->scalar("train/data_wait_fraction", record.data_wait_seconds / record.seconds, step);
    writer_->scalar("epoch", static_cast<double>(record.epoch), step);
    writer_->flush();
  }
  void on_fit_finally(TrainState&, const std::exception_ptr&) override {
    if (writer_) writer_->flush();
  }

 private:
  std::filesystem::path directory_;
  int64_t every_n_steps_;
  std::unique_ptr<detail::EventFileWriter> writer_;
};

}  // namespace trainloop
