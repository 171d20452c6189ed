#pragma once
/// @file
/// @brief Making every rank start from the same model: a cross-rank check that all ranks hold
/// the same parameters and buffers (names, shapes, dtypes), then a broadcast of rank 0's values.
///
/// The check exchanges only fixed-size data whose size every rank knows before the collective
/// (first a 3-number fingerprint; on mismatch a table sized by the agreed maximum entry count),
/// so ranks with different models get the same clear error instead of a hang.

#include <trainloop/detail/stable_hash.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::distributed {

namespace detail {

/// One parameter or buffer, as seen by the cross-rank check.
struct StateEntry {
  std::string name;
  torch::Tensor tensor;
  bool is_buffer = false;
};

/// Parameters first, then buffers, both in registration order (identical across ranks that
/// build the same model).
inline std::vector<StateEntry> state_entries(const torch::nn::Module& module) {
  std::vector<StateEntry> entries;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) entries.push_back({item.key(), item.value(), false});
  for (const auto& item : module.named_buffers(/*recurse=*/true)) entries.push_back({item.key(), item.value(), true});
  return entries;
}

using trainloop::detail::stable_hash;

/// Fixed-width description of one entry: kind, dtype, rank (ndim), up to 8 dims, name hash.
/// An absent entry (a rank with fewer entries) is all -1.
inline constexpr std::int64_t kRecordWidth = 12;
inline constexpr std::int64_t kRecordDims = 8;
inline constexpr std::int64_t kUndefinedDtype = -2;

inline std::vector<std::int64_t> entry_record(const StateEntry& entry) {
  std::vector<std::int64_t> record(kRecordWidth, -1);
  record[0] = entry.is_buffer ? 1 : 0;
  record[kRecordWidth - 1] = stable_hash(entry.name);
  if (!entry.tensor.defined()) {  // e.g. an optional buffer left empty
    record[1] = kUndefinedDtype;
    record[2] = 0;
    return record;
  }
  record[1] = static_cast<std::int64_t>(entry.tensor.scalar_type());
  record[2] = entry.tensor.dim();
  for (std::int64_t d = 0; d < std::min<std::int64_t>(entry.tensor.dim(), kRecordDims); ++d) record[3 + d] = entry.tensor.size(d);
  if (entry.tensor.dim() > kRecordDims) {  // fold the remaining dims into the last slot
    std::ostringstream rest;
    for (std::int64_t d = kRecordDims - 1; d < entry.tensor.dim(); ++d) rest << entry.tensor.size(d) << ',';
    record[3 + kRecordDims - 1] = stable_hash(rest.str());
  }
  return record;
}

/// "parameter float [32, 10]" from a record row (accessor over an int64 tensor).
inline std::string describe_record(const torch::TensorAccessor<std::int64_t, 1>& record) {
  if (record[0] < 0) return "nothing (no such entry)";
  std::ostringstream out;
  out << (record[0] == 1 ? "buffer " : "parameter ");
  if (record[1] == kUndefinedDtype) return out.str() + "(undefined tensor)";
  out << c10::toString(static_cast<c10::ScalarType>(record[1])) << " [";
  for (std::int64_t d = 0; d < std::min<std::int64_t>(record[2], kRecordDims); ++d) out << (d ? ", " : "") << record[3 + d];
  if (record[2] > kRecordDims) out << ", ...";
  out << "]";
  return out.str();
}

}  // namespace detail

/// Checks that every rank's module has the same parameters and buffers (count, order, names,
/// shapes, dtypes). Collective: every rank must call it.
/// @throws trainloop::Error on every rank when any rank differs, naming the first rank that
///         differs from rank 0, both ranks' parameter and buffer counts, and the first entry that
///         differs with both descriptions (and its name on this rank).
inline void check_same_parameter_shapes(const torch::nn::Module& module, ProcessGroup& group) {
  const std::vector<detail::StateEntry> entries = detail::state_entries(module);
  std::int64_t parameter_count = 0;
  std::vector<std::int64_t> records;
  std::uint64_t combined = 1469598103934665603ULL;
  for (const auto& entry : entries) {
    parameter_count += entry.is_buffer ? 0 : 1;
    for (std::int64_t value : detail::entry_record(entry)) {
      records.push_back(value);
      combined = (combined ^ static_cast<std::uint64_t>(value)) * 1099511628211ULL;
    }
  }
  const auto entry_count = static_cast<std::int64_t>(entries.size());
  const torch::Tensor fingerprint =
      torch::tensor({parameter_count, entry_count - parameter_count, static_cast<std::int64_t>(combined >> 1)},
                    torch::kInt64);
  const torch::Tensor all_fingerprints = group.all_gather(fingerprint);  // [world, 3]
  if (all_fingerprints.eq(all_fingerprints[0]).all().item<bool>()) return;

  // Somebody differs. Every rank now knows the largest entry count, so all gather a table of
  // exactly that many records: the collective's size agrees even though the models don't.
  const std::int64_t max_entries = (all_fingerprints.select(1, 0) + all_fingerprints.select(1, 1)).max().item<std::int64_t>();
  torch::Tensor table = torch::full({std::max<std::int64_t>(max_entries, 1), detail::kRecordWidth}, -1, torch::kInt64);
  if (entry_count > 0) {
    table.narrow(0, 0, entry_count).copy_(torch::tensor(records, torch::kInt64).view({entry_count, detail::kRecordWidth}));
  }
  const torch::Tensor all_tables = group.all_gather(table);  // [world, max_entries, width]
  const auto fp = all_fingerprints.accessor<std::int64_t, 2>();
  const auto tables = all_tables.accessor<std::int64_t, 3>();

  int differing_rank = 1;
  while (differing_rank < group.world_size() && all_fingerprints[differing_rank].equal(all_fingerprints[0])) ++differing_rank;
  std::int64_t first_entry = 0;
  while (first_entry < max_entries &&
         all_tables[0][first_entry].equal(all_tables[differing_rank][first_entry])) {
    ++first_entry;
  }
  std::ostringstream message;
  message << "trainloop: the ranks hold different models; rank 0 has " << fp[0][0] << " parameters and " << fp[0][1]
          << " buffers, rank " << differing_rank << " has " << fp[differing_rank][0] << " parameters and "
          << fp[differing_rank][1] << " buffers";
  if (first_entry < max_entries) {
    message << "; first difference at entry #" << first_entry << " (parameters, then buffers): rank 0 has "
            << detail::describe_record(tables[0][first_entry]) << ", rank " << differing_rank << " has "
            << detail::describe_record(tables[differing_rank][first_entry]);
    if (tables[0][first_entry][detail::kRecordWidth - 1] != tables[differing_rank][first_entry][detail::kRecordWidth - 1]) {
      message << " (names differ)";
    }
    if (first_entry < entry_count) message << "; on this rank (" << group.rank() << ") it is '" << entries[first_entry].name << "'";
  }
  message << "; expected every rank to construct the same model";
  throw Error(message.str());
}

/// Makes every rank's parameters and buffers equal to `root`'s: first check_same_parameter_shapes
/// (so a mismatch is an error, not a hang), then one broadcast per dtype/device group of flat
/// buffers. Collective: every rank must call it.
inline void broadcast_module_state(torch::nn::Module& module, ProcessGroup& group, int root = 0) {
  check_same_parameter_shapes(module, group);
  std::vector<torch::Tensor> tensors;
  for (const auto& entry : detail::state_entries(module)) {
    if (entry.tensor.defined() && entry.tensor.numel() > 0) tensors.push_back(entry.tensor);
  }
  if (tensors.empty()) return;
  torch::NoGradGuard no_grad;  // parameters are leaves that require grad: copy their data only
  group.broadcast(tensors, root);
}

}  // namespace trainloop::distributed
