// The memory cgroup of the bench's dense-mmap baseline: detecting whether this machine lets us create a memory-limited
// cgroup (v2 memory.max or v1 memory.limit_in_bytes), creating one child group per bench row, moving the row's process
// into it before the model is loaded, and dropping a model file's pages from the page cache first.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/core/status.h"

namespace nflash::bench {

enum class CgroupVersion { kNone, kV1, kV2 };

// Where memory-limited child groups can be created, or why not.
struct CgroupSupport {
  CgroupVersion version = CgroupVersion::kNone;
  // The directory under which a child group is created: our own memory cgroup (v1, or v2 when its subtree_control
  // delegates memory), or the v2 root. Nesting under our own group keeps the row inside any limit already imposed on
  // us (a container's, a CI job's) instead of escaping it.
  std::string parent_dir;
  std::string reason;  // kNone: why ("no memory controller mounted", "not root", ...)
};

// Reads `mountinfo` (cgroup mount points) and `self_cgroup` (our group per hierarchy) to find a hierarchy with the
// memory controller, then checks the parent directory is writable. Never fails: unreadable files or an unknown layout
// give kNone with the reason. The paths are parameters so tests can feed a fake /proc and /sys.
CgroupSupport DetectMemoryCgroup(const std::string& mountinfo = "/proc/self/mountinfo",
                                 const std::string& self_cgroup = "/proc/self/cgroup");

// One child memory cgroup with a hard limit, removed (rmdir) when destroyed; its processes must have exited by then.
// Thread-safety: not thread-safe.
class MemoryCgroup {
 public:
  // Creates `<support.parent_dir>/<name>` and writes the limit (v2: memory.max, memory.swap.max = 0 when present;
  // v1: memory.limit_in_bytes, memory.memsw.limit_in_bytes when present, swappiness 0) so the limit is on RAM alone.
  static Result<std::unique_ptr<MemoryCgroup>> Create(const CgroupSupport& support, const std::string& name,
                                                      uint64_t limit_bytes);
  ~MemoryCgroup();
  MemoryCgroup(const MemoryCgroup&) = delete;
  MemoryCgroup& operator=(const MemoryCgroup&) = delete;

  // Moves process `pid` into the group (cgroup.procs).
  Status AddProcess(pid_t pid) const;
  // Highest memory use the kernel recorded for the group (v1 memory.max_usage_in_bytes, v2 memory.peak; 0 when the
  // kernel has no such file), page cache included: what the limit was enforced against.
  uint64_t PeakBytes() const;
  // "cgroup v2 memory.max=1.00 GiB"
  std::string Describe() const;
  const std::string& dir() const { return dir_; }

 private:
  MemoryCgroup(CgroupVersion version, std::string dir, uint64_t limit) : version_(version), dir_(std::move(dir)), limit_(limit) {}
  CgroupVersion version_;
  std::string dir_;
  uint64_t limit_;
};

// Drops `path`'s clean pages from the page cache (posix_fadvise DONTNEED after fdatasync), so the row starts cold.
Status DropFileCache(const std::string& path);
// `echo 1 > /proc/sys/vm/drop_caches` (root only): the whole page cache, every file.
Status DropAllPageCache();

}  // namespace nflash::bench
