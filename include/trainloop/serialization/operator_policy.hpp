#pragma once
/// @file
/// @brief Which registered operators an exported program from a stranger may call. Being in the
/// dispatcher is not enough: a few ATen operators reach outside the tensor's bytes by design —
/// `aten.from_file` maps a file (a node with `shared=True` writes into it), `aten._reshape_alias`
/// makes a view without checking it against its storage (a read or write past it), `set_` and
/// `resize_` rebind or regrow a tensor's storage. So:
///
/// - public ATen names (no leading underscore) are allowed, but for the storage-rebinding and
///   file-reading ones listed here;
/// - private names (a leading underscore) only when torch.export's graphs use them and they check
///   their arguments as the public ones do (batch norm's and softmax's implementations, `_to_copy`,
///   `_unsafe_view` — unsafe only for autograd's aliasing, it checks the sizes —, the attention
///   kernels, the assertions);
/// - prims the same way as public ATen names (libtorch registers few of them in C++).
///
/// An operator refused here is a CheckpointError at load naming the node and this reason.

#include <set>
#include <string>

namespace trainloop::serialization {

/// @brief Why `space::name` may not be called from a file, or "" when it may.
inline std::string refused_operator_reason(const std::string& space, const std::string& name) {
  static const std::set<std::string> storage_or_files = {
      "from_file",   "set_",          "set",           "resize_",         "resize_as_",   "resize_as_sparse_",
      "sparse_resize_", "sparse_resize_and_clear_", "as_strided_", "record_stream", "set_data", "share_memory_",
      "_reshape_alias", "_copy_from", "_copy_from_and_resize", "_resize_output_", "_set_storage_offset"};
  static const std::set<std::string> private_allowed = {
      "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
      "_to_copy", "_unsafe_view", "_log_softmax", "_softmax", "_safe_softmax", "_masked_softmax",
      "_log_softmax_backward_data", "_softmax_backward_data", "_assert_scalar", "_assert_tensor_metadata",
      "_assert_async", "_functional_assert_scalar", "_local_scalar_dense", "_unsafe_index", "_unsafe_index_put",
      "_unsafe_masked_index", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
      "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention", "_adaptive_avg_pool2d",
      "_adaptive_avg_pool3d", "_reshape_copy", "_weight_norm_interface", "_pdist_forward", "_cdist_forward",
      "_embedding_bag", "_prelu_kernel", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
      "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_convolution",
      "_conv_depthwise2d", "_fused_moving_avg_obs_fq_helper"};
  if (storage_or_files.count(name)) {
    return "reads a file or rebinds a tensor's storage, which no exported model needs and a file from a stranger "
           "must not do";
  }
  if (!name.empty() && name.front() == '_' && !private_allowed.count(name)) {
    return "is a private " + space + " operator that torch.export's training graphs do not use (private operators "
           "may skip the checks of public ones); expected public ATen operators";
  }
  return {};
}

}  // namespace trainloop::serialization
