#pragma once
/// @file
/// @brief OpenBLAS's thread count, which at::set_num_threads does not reach.
///
/// Debian's libtorch runs matrix products through the system BLAS, OpenBLAS's pthread build by
/// default. That build has one process-wide pool of helper threads: when several threads call
/// sgemm at once (DataParallel's CPU replicas), each caller busy-waits in exec_blas_async for
/// helpers the others hold. Measured here: 2 CPU replicas spent 12x the CPU time of one device
/// (49% of it in exec_blas_async) until OpenBLAS was told to use the per-replica thread count.
/// OpenBLAS is found at run time (dlsym), so nothing changes where libtorch uses MKL or no OpenBLAS
/// (MKL's count is per thread and at::set_num_threads already sets it).

#include <dlfcn.h>

namespace trainloop::detail {

/// OpenBLAS's `openblas_get_num_threads` / `openblas_set_num_threads`, when OpenBLAS is loaded.
class OpenBlasThreads {
 public:
  /// The functions of the OpenBLAS loaded in this process (looked up once).
  static const OpenBlasThreads& loaded() {
    static const OpenBlasThreads instance;
    return instance;
  }
  /// True when this process has OpenBLAS loaded.
  bool available() const { return get_ != nullptr && set_ != nullptr; }
  /// OpenBLAS's current thread count (process-wide); 0 when OpenBLAS is not loaded.
  int get() const { return available() ? get_() : 0; }
  /// Sets OpenBLAS's thread count for the whole process; no-op without OpenBLAS.
  void set(int threads) const {
    if (available()) set_(threads);
  }

 private:
  OpenBlasThreads()
      : get_(reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"))),
        set_(reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {}
  int (*get_)();
  void (*set_)(int);
};

/// Sets OpenBLAS's thread count for a scope (a DataParallel batch) and restores it afterwards, so
/// the caller's own BLAS calls between batches keep their thread count.
class ScopedBlasThreads {
 public:
  /// @param threads the count inside the scope; 0 leaves OpenBLAS alone
  explicit ScopedBlasThreads(int threads) {
    const auto& blas = OpenBlasThreads::loaded();
    if (threads <= 0 || !blas.available()) return;
    previous_ = blas.get();
    if (previous_ != threads) blas.set(threads);
    else previous_ = 0;
  }
  ~ScopedBlasThreads() {
    if (previous_ > 0) OpenBlasThreads::loaded().set(previous_);
  }
  ScopedBlasThreads(const ScopedBlasThreads&) = delete;
  ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;

 private:
  int previous_ = 0;  // 0: nothing to restore
};

}  // namespace trainloop::detail
