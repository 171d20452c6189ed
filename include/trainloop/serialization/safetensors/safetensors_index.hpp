#pragma once
/// @file
/// @brief Hugging Face's sharded safetensors: `model-0000k-of-0000n.safetensors` files and
/// `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name:
/// shard file}} in one directory. write_safetensors_sharded() writes that form (tensors never
/// split, each shard atomically, the index last); SafetensorsSource reads a single .safetensors,
/// an index, or a directory holding either, and reads tensors (or flat ranges) by name.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/serialization/json_sax_reader.hpp>
#include <trainloop/serialization/nesting_depth.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/regular_file.hpp>
#include <trainloop/serialization/safetensors/safetensors_reader.hpp>
#include <trainloop/serialization/safetensors/safetensors_writer.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace trainloop::serialization {

/// @brief The index's file name that Hugging Face's `from_pretrained` looks for.
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";
/// @brief The single file's name that Hugging Face's `from_pretrained` looks for.
inline constexpr const char* kSafetensorsSingleName = "model.safetensors";

/// @brief Shard k of n's file name, as Hugging Face names it: "model-00001-of-00003.safetensors".
inline std::string safetensors_shard_name(size_t k, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k, n);
  return name;
}

/// @brief Writes `specs` as Hugging Face's sharded form into directory `directory` (created if
/// missing): shards of at most `max_shard_bytes` of tensor data each (a larger tensor gets a
/// shard of its own; tensors are never split), filled in order, then the index `index_name`,
/// last. Every file is written atomically; shards of an earlier save into that directory that
/// this one does not use (another n) are removed after the index is written.
/// @param directory where the shards and the index go
/// @param specs every tensor's name, dtype and shape, in order
/// @param produce returns tensor i (see write_safetensors()); called once per tensor, in order
/// @param max_shard_bytes the most tensor bytes per shard (> 0; Hugging Face's default is 5 GB)
/// @param metadata every shard's `__metadata__`
/// @param index_name the index's file name
/// @return the index's path
/// @throws trainloop::ConfigurationError for bad specs or max_shard_bytes == 0;
///         trainloop::CheckpointError naming the file that cannot be written.
inline std::filesystem::path write_safetensors_sharded(const std::filesystem::path& directory,
                                                       const std::vector<SafetensorsSpec>& specs,
                                                       const SafetensorsProducer& produce, uint64_t max_shard_bytes,
                                                       const std::map<std::string, std::string>& metadata =
                                                           safetensors_pt_metadata(),
                                                       const std::string& index_name = kSafetensorsIndexName) {
  TRAINLOOP_CHECK(max_shard_bytes > 0, "max_shard_bytes is 0; expected > 0");
  detail::plan_safetensors(specs, (directory / index_name).string());  // names and dtypes checked before anything is written
  std::vector<std::vector<size_t>> shards;  // the spec indices of each shard
  uint64_t total = 0, in_shard = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t bytes = safetensors_spec_bytes(specs[i]);
    if (shards.empty() || (in_shard > 0 && in_shard + bytes > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }
  if (shards.empty()) shards.emplace_back();  // a model without tensors: one empty shard
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::set<std::string> written;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = safetensors_shard_name(k + 1, shards.size());
    std::vector<SafetensorsSpec> shard_specs;
    for (const auto i : shards[k]) {
      shard_specs.push_back(specs[i]);
      weight_map[specs[i].name] = name;
    }
    write_safetensors(directory / name, shard_specs, [&](size_t j) { return produce(shards[k][j]); }, metadata);
    written.insert(name);
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const auto index_path = directory / index_name;
  trainloop::detail::BasicAtomicFile<CheckpointError> file(index_path, "the safetensors index");
  file.write(index.dump(2) + "\n");
  file.commit();
  // Shards of an earlier save with another shard count would be mistaken for this one's by eye.
  static const std::regex shard_pattern("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    const std::string file_name = it->path().filename().string();
    std::error_code ignored;
    if (std::regex_match(file_name, shard_pattern) && !written.count(file_name)) std::filesystem::remove(it->path(), ignored);
  }
  return index_path;
}

/// @brief Safetensors weights to read by name: one .safetensors file, or Hugging Face's sharded
/// form through its index (each shard opened and checked up front), or a directory holding
/// `model.safetensors.index.json` or `model.safetensors`. Reads are `const` and thread-safe.
class SafetensorsSource {
 public:
  /// @brief Opens `path`: a file ending in ".json" is an index, another file a .safetensors, a
  /// directory the index or single file inside it.
  /// @throws trainloop::CheckpointError naming the file: none of these, an index that is not
  ///         {"weight_map": {name: file}} or names a file outside its directory, a shard that is
  ///         missing or bad (see SafetensorsFile), or that disagrees with the index.
  explicit SafetensorsSource(std::filesystem::path path) {
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      if (std::filesystem::exists(path / kSafetensorsIndexName, error)) {
        path /= kSafetensorsIndexName;
      } else if (std::filesystem::exists(path / kSafetensorsSingleName, error)) {
        path /= kSafetensorsSingleName;
      } else {
        throw CheckpointError("trainloop: directory " + path.string() + " holds neither " + kSafetensorsIndexName + " nor " +
                              kSafetensorsSingleName + "; expected safetensors weights");
      }
    }
    path_ = path;
    if (path.extension() != ".json") {
      files_.emplace_back(path);
      for (size_t i = 0; i < files_[0].entries().size(); ++i) add(0, i);
      return;
    }
    const auto weight_map = read_index(path);
    std::map<std::string, size_t> shard_index;  // shard file name -> files_ index, opened in name order
    for (const auto& [name, shard] : weight_map) shard_index.emplace(shard, 0);
    for (auto& [shard, index] : shard_index) {
      index = files_.size();
      files_.emplace_back(path.parent_path() / shard);
    }
    std::set<std::string> mapped;
    for (const auto& [name, shard] : weight_map) {
      const auto& file = files_[shard_index.at(shard)];
      if (!file.contains(name)) {
        throw index_error(path, "maps tensor " + quote_untrusted(name) + " to " + quote_untrusted(shard) +
                                    ", which has no such tensor; expected the index of these shards");
      }
      mapped.insert(name);
    }
    for (size_t f = 0; f < files_.size(); ++f) {
      for (size_t i = 0; i < files_[f].entries().size(); ++i) {
        const auto& name = files_[f].entries()[i].name;
        if (!mapped.count(name) || by_name_.count(name)) {
          throw index_error(path, "does not map tensor " + quote_untrusted(name) + " to " +
                                      quote_untrusted(files_[f].path().filename().string()) +
                                      ", which holds it; expected every shard's tensors in the weight_map once");
        }
        add(f, i);
      }
    }
  }

  SafetensorsSource(const SafetensorsSource&) = delete;  // entries() points into the files
  SafetensorsSource& operator=(const SafetensorsSource&) = delete;
  /// @brief Moves the open files (entries() stays valid: the files' vectors move with them).
  SafetensorsSource(SafetensorsSource&&) = default;
  /// @brief Moves the open files.
  SafetensorsSource& operator=(SafetensorsSource&&) = default;

  /// @brief What was opened: the .safetensors file or the index.
  const std::filesystem::path& path() const { return path_; }
  /// @brief Every tensor's entry, shard by shard, each in the order of its data.
  const std::vector<const SafetensorsEntry*>& entries() const { return order_; }
  /// @brief Whether a tensor of this name is there.
  bool contains(const std::string& name) const { return by_name_.count(name) != 0; }
  /// @brief The entry of tensor `name`. @throws trainloop::CheckpointError naming the path when there is none.
  const SafetensorsEntry& entry(const std::string& name) const { return file_of(name).entry(name); }
  /// @brief The file that holds tensor `name`. @throws trainloop::CheckpointError naming the path when there is none.
  const SafetensorsFile& file_of(const std::string& name) const {
    const auto found = by_name_.find(name);
    if (found == by_name_.end()) {
      throw CheckpointError("trainloop: safetensors weights " + path_.string() + " have no tensor " + quote_untrusted(name) +
                            "; expected one");
    }
    return files_[found->second];
  }
  /// @brief Reads tensor `name` (see SafetensorsFile::read()).
  torch::Tensor read(const std::string& name) const { return file_of(name).read(name); }
  /// @brief Reads elements [begin, end) of tensor `name` flattened (see SafetensorsFile::read_flat()).
  torch::Tensor read_flat(const std::string& name, int64_t begin, int64_t end) const {
    return file_of(name).read_flat(name, begin, end);
  }

 private:
  static CheckpointError index_error(const std::filesystem::path& path, const std::string& what) {
    return CheckpointError("trainloop: safetensors index " + path.string() + " " + what);
  }

  /// The index's weight_map, each file checked to be a plain name in the index's directory.
  static std::map<std::string, std::string> read_index(const std::filesystem::path& path) {
    std::string problem;
    const RegularFile file = open_regular_file(path, problem);  // a FIFO or /dev/zero is refused, not read
    if (!file.fd) throw index_error(path, problem + "; expected an index file");
    if (file.size > kSafetensorsMaxHeaderBytes) {
      throw index_error(path, trainloop::detail::concat("is ", file.size, " bytes long; expected at most ", kSafetensorsMaxHeaderBytes));
    }
    std::string text(file.size, '\0');
    if (!read_exactly(*file.fd, 0, text.data(), file.size, problem)) {
      throw index_error(path, "could not be read (" + problem + "); expected a file that does not change while it is read");
    }
    if (json_depth_beyond(text, 3) != 0) {  // linear time: nesting_depth.hpp says why
      throw index_error(path, "nests JSON deeper than 3 levels; expected {\"weight_map\": {name: file}}");
    }
    IndexReader reader(path);
    if (!nlohmann::json::sax_parse(text.begin(), text.end(), &reader)) {
      throw index_error(path, "is not JSON (" + escape_untrusted(reader.parse_failure()) + "); expected {\"weight_map\": {name: file}}");
    }
    return reader.take();
  }

  /// Reads the index as it is parsed (json_sax_reader.hpp says why not a DOM): the weight_map's
  /// strings straight into the map, "metadata" and anything else skipped unheld.
  class IndexReader final : public JsonSaxReader {
   public:
    explicit IndexReader(const std::filesystem::path& path) : path_(path) {}
    /// The weight_map read; throws when the document had none.
    std::map<std::string, std::string> take() {
      if (!has_map_) throw index_error(path_, "has no weight_map object; expected {\"weight_map\": {name: file}}");
      return std::move(map_);
    }

   private:
    enum class Place { Top, Root, Map, Done };
    /// Bounds the map's memory (~100 bytes an entry, whatever the names' length) at ~100 MB.
    static constexpr size_t kMaxIndexEntries = 1000000;
    bool enter_object() override {
      if (place_ == Place::Top) {
        place_ = Place::Root;
        return true;
      }
      if (place_ == Place::Root && key_ == "weight_map") {
        place_ = Place::Map;
        has_map_ = true;
        return true;
      }
      return false;
    }
    void leave_object() override { place_ = place_ == Place::Map ? Place::Root : Place::Done; }
    void on_key(std::string key) override { key_ = std::move(key); }
    // Only the weight_map's values are wanted: anything else under the root ("metadata") is skipped.
    bool skip_value() const override { return place_ == Place::Root && key_ != "weight_map"; }
    void on_string(std::string& shard) override {
      if (place_ != Place::Map) return on_value(nlohmann::json(std::move(shard)));
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
          shard.find('\0') != std::string::npos) {
        return on_value(nlohmann::json(std::move(shard)));
      }
      if (map_.size() >= kMaxIndexEntries && !map_.count(key_)) {
        throw index_error(path_, trainloop::detail::concat("maps more than ", kMaxIndexEntries, " tensors; expected a model's ",
                                                          "tensors (the largest models have a few thousand)"));
      }
      map_[key_] = std::move(shard);
    }
    void on_value(const nlohmann::json& value) override {
      if (place_ == Place::Top || (place_ == Place::Root && key_ == "weight_map")) {
        throw index_error(path_, "has no weight_map object; expected {\"weight_map\": {name: file}}");
      }
      if (place_ == Place::Map) {
        throw index_error(path_, "maps tensor " + quote_untrusted(key_) + " to " + detail::json_text(value) +
                                     "; expected a file name in the index's directory");
      }
    }

    const std::filesystem::path& path_;
    Place place_ = Place::Top;
    std::string key_;
    bool has_map_ = false;
    std::map<std::string, std::string> map_;
  };

  void add(size_t file, size_t entry) {
    const auto& found = files_[file].entries()[entry];
    by_name_[found.name] = file;
    order_.push_back(&found);
  }

  std::filesystem::path path_;
  std::vector<SafetensorsFile> files_;
  std::unordered_map<std::string, size_t> by_name_;      // tensor name -> files_ index
  std::vector<const SafetensorsEntry*> order_;
};

}  // namespace trainloop::serialization
