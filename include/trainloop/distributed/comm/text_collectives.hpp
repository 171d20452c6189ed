#pragma once
/// @file
/// @brief Text between the ranks of a group: one rank's to all, and every rank's to all. Small
/// texts of elastic training's decisions (directory names, file lists) and the end of a spawned
/// fit (which rank writes for its launcher).

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// `text` from `root` to every rank of `group` (its length first).
inline std::string broadcast_text(ProcessGroup& group, const std::string& text, int root) {
  torch::Tensor length = torch::full({1}, static_cast<int64_t>(text.size()), torch::kInt64);
  group.broadcast(length, root);
  torch::Tensor bytes = torch::empty({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) group.broadcast(bytes, root);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

/// Every rank's `text` on every rank of `group`, in rank order (a gather to rank 0, then its broadcast).
inline std::vector<std::string> all_texts(ProcessGroup& group, const std::string& text) {
  torch::Tensor row = torch::empty({static_cast<std::int64_t>(text.size())}, torch::kUInt8);
  if (!text.empty()) std::memcpy(row.data_ptr(), text.data(), text.size());
  const std::vector<torch::Tensor> rows = group.gather_rows_to(row, 0);
  std::string joined;  // on rank 0: "<length>\n<text>" for each rank
  for (const torch::Tensor& gathered : rows) {
    joined += std::to_string(gathered.numel()) + "\n";
    joined.append(static_cast<const char*>(gathered.data_ptr()), static_cast<size_t>(gathered.numel()));
  }
  joined = broadcast_text(group, joined, 0);
  std::vector<std::string> texts;
  std::istringstream in(joined);
  for (std::size_t length = 0; in >> length && in.get() == '\n';) {
    std::string item(length, '\0');
    in.read(item.data(), static_cast<std::streamsize>(length));
    texts.push_back(std::move(item));
  }
  TRAINLOOP_CHECK(static_cast<int>(texts.size()) == group.world_size(), "gathered ", texts.size(), " texts from ",
                  group.world_size(), " ranks; expected one each");
  return texts;
}

}  // namespace trainloop::distributed
