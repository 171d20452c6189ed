#pragma once
// A small disk that really fills up, for the tests of full-disk checkpoint writes. Include after
// unit_test.hpp (the precondition is Boost.Test's).

#include "test_support.hpp"
#include "unit_test.hpp"

#include <sys/mount.h>

#include <cerrno>
#include <cstring>

/// A tmpfs of `bytes` mounted on a fresh directory, unmounted (and the directory removed) at
/// scope exit: a small disk that really fills up. Mounting needs root (CAP_SYS_ADMIN); `mounted`
/// says whether it worked and `why_not` why not.
struct SmallTmpfs {
  TempDir dir{"tl-tmpfs"};
  bool mounted = false;
  std::string why_not;
  explicit SmallTmpfs(size_t bytes) {
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir.path.c_str(), "tmpfs", 0, options.c_str()) == 0) {
      mounted = true;
    } else {
      why_not = std::string("mounting a tmpfs failed: ") + std::strerror(errno);
    }
  }
  ~SmallTmpfs() {
    if (mounted) ::umount2(dir.path.c_str(), MNT_DETACH);
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
};

/// Boost.Test precondition: the case is reported as skipped (with the reason) where no tmpfs
/// can be mounted (not root, or a container without CAP_SYS_ADMIN).
inline boost::test_tools::assertion_result can_mount_tmpfs(boost::unit_test::test_unit_id) {
  SmallTmpfs probe(1 << 20);
  boost::test_tools::assertion_result result(probe.mounted);
  result.message() << probe.why_not << " (needs root: CAP_SYS_ADMIN)";
  return result;
}
