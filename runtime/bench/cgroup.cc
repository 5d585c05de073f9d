// Memory cgroups for the bench's dense-mmap baseline (see cgroup.h).
#include "runtime/bench/cgroup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/sparse/memory_budget.h"

namespace nflash::bench {
namespace {

std::string ReadSmallFile(const std::string& path, bool* ok) {
  std::optional<std::string> text = ReadKernelTextFile(path);
  *ok = text.has_value();
  return text ? std::move(*text) : std::string();
}

bool HasWord(const std::string& list, const std::string& word, char sep) {
  std::stringstream ss(list);
  for (std::string w; std::getline(ss, w, sep);) {
    while (!w.empty() && (w.back() == '\n' || w.back() == ' ')) w.pop_back();
    if (w == word) return true;
  }
  return false;
}

bool HasSpaceWord(const std::string& list, const std::string& word) {
  std::stringstream ss(list);
  for (std::string w; ss >> w;) {
    if (w == word) return true;
  }
  return false;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string w; std::getline(ss, w, sep);) out.push_back(w);
  return out;
}

// `path` of our group as seen from a mount whose root is `mount_root` ("/" usually; a container may mount a subtree).
std::string JoinGroup(const std::string& mount_point, const std::string& mount_root, std::string group) {
  if (mount_root != "/" && group.rfind(mount_root, 0) == 0) group = group.substr(mount_root.size());
  if (group.empty() || group == "/") return mount_point;
  return mount_point + (group.front() == '/' ? "" : "/") + group;
}

Status WriteControl(const std::string& path, const std::string& value) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(path + ": cannot open for writing: " + std::strerror(errno));
  const ssize_t n = ::write(fd, value.data(), value.size());
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(value.size())) {
    return Status::IOError(path + ": writing '" + value + "' failed: " + std::strerror(err));
  }
  return Status::Ok();
}

bool Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

}  // namespace

CgroupSupport DetectMemoryCgroup(const std::string& mountinfo, const std::string& self_cgroup) {
  CgroupSupport out;
  bool ok = false;
  const std::string mounts = ReadSmallFile(mountinfo, &ok);
  if (!ok) {
    out.reason = "cannot read " + mountinfo;
    return out;
  }
  const std::string groups = ReadSmallFile(self_cgroup, &ok);
  if (!ok) {
    out.reason = "cannot read " + self_cgroup;
    return out;
  }
  // Our group per hierarchy: "0::/path" (v2), "4:memory:/path" (v1; the controller list may hold several).
  std::string v2_group, v1_group;
  bool have_v2 = false, have_v1 = false;
  for (const std::string& line : Split(groups, '\n')) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {
      v2_group = path;
      have_v2 = true;
    } else if (HasWord(controllers, "memory", ',')) {
      v1_group = path;
      have_v1 = true;
    }
  }
  // Mount points: "id parent maj:min root mount_point options [optional...] - fstype source super_options".
  std::string v2_mount, v2_root, v1_mount, v1_root;
  for (const std::string& line : Split(mounts, '\n')) {
    std::stringstream ss(line);
    std::vector<std::string> f;
    for (std::string w; ss >> w;) f.push_back(w);
    size_t dash = 0;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash < 5 || dash + 3 >= f.size()) continue;
    const std::string& fstype = f[dash + 1];
    if (fstype == "cgroup2" && v2_mount.empty()) {
      v2_mount = f[4];
      v2_root = f[3];
    } else if (fstype == "cgroup" && HasWord(f[dash + 3], "memory", ',') && v1_mount.empty()) {
      v1_mount = f[4];
      v1_root = f[3];
    }
  }
  std::string why_not;
  if (!v2_mount.empty() && have_v2) {
    const std::string controllers = ReadSmallFile(v2_mount + "/cgroup.controllers", &ok);
    if (!ok || !HasSpaceWord(controllers, "memory")) {
      why_not = "cgroup v2 at " + v2_mount + " has no memory controller";
    } else {
      const std::string own = JoinGroup(v2_mount, v2_root, v2_group);
      const std::string own_subtree = ReadSmallFile(own + "/cgroup.subtree_control", &ok);
      if (ok && HasSpaceWord(own_subtree, "memory") && ::access(own.c_str(), W_OK) == 0) {
        out.version = CgroupVersion::kV2;
        out.parent_dir = own;
        return out;
      }
      const std::string root_subtree = ReadSmallFile(v2_mount + "/cgroup.subtree_control", &ok);
      if (ok && HasSpaceWord(root_subtree, "memory") && ::access(v2_mount.c_str(), W_OK) == 0) {
        out.version = CgroupVersion::kV2;
        out.parent_dir = v2_mount;
        return out;
      }
      why_not = "cgroup v2 memory controller not delegated to " + own + " and " + v2_mount + " is not writable";
    }
  }
  if (!v1_mount.empty() && have_v1) {
    const std::string own = JoinGroup(v1_mount, v1_root, v1_group);
    if (!Exists(own + "/memory.limit_in_bytes")) {
      why_not = own + "/memory.limit_in_bytes not found";
    } else if (::access(own.c_str(), W_OK) != 0) {
      why_not = "cgroup v1 " + own + " is not writable (not root?)";
    } else {
      out.version = CgroupVersion::kV1;
      out.parent_dir = own;
      return out;
    }
  }
  out.reason = !why_not.empty() ? why_not : "no cgroup hierarchy with the memory controller is mounted";
  return out;
}

Result<std::unique_ptr<MemoryCgroup>> MemoryCgroup::Create(const CgroupSupport& support, const std::string& name,
                                                           uint64_t limit_bytes) {
  if (support.version == CgroupVersion::kNone) return Status::Unsupported("no memory cgroup: " + support.reason);
  if (limit_bytes == 0) return Status::InvalidArgument("a memory cgroup needs a limit above 0");
  const std::string dir = support.parent_dir + "/" + name;
  if (Exists(dir)) ::rmdir(dir.c_str());  // left by a killed run; fails harmlessly if still in use
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return Status::IOError("cannot create cgroup " + dir + ": " + std::strerror(errno));
  }
  std::unique_ptr<MemoryCgroup> cg(new MemoryCgroup(support.version, dir, limit_bytes));
  const std::string limit = std::to_string(limit_bytes);
  if (support.version == CgroupVersion::kV2) {
    NF_RETURN_IF_ERROR(WriteControl(dir + "/memory.max", limit));
    // No swap, so the limit bounds RAM (not RAM + swap); absent when the kernel has no swap accounting.
    if (Exists(dir + "/memory.swap.max")) NF_RETURN_IF_ERROR(WriteControl(dir + "/memory.swap.max", "0"));
  } else {
    NF_RETURN_IF_ERROR(WriteControl(dir + "/memory.limit_in_bytes", limit));
    // memsw (RAM + swap) must be >= the RAM limit; equal means no swap. Absent without swap accounting.
    if (Exists(dir + "/memory.memsw.limit_in_bytes")) {
      (void)WriteControl(dir + "/memory.memsw.limit_in_bytes", limit);
    }
    if (Exists(dir + "/memory.swappiness")) (void)WriteControl(dir + "/memory.swappiness", "0");
  }
  return cg;
}

MemoryCgroup::~MemoryCgroup() {
  // The kernel refuses while processes remain; by contract they have exited. Page cache charged to the group moves
  // to the parent.
  ::rmdir(dir_.c_str());
}

Status MemoryCgroup::AddProcess(pid_t pid) const {
  return WriteControl(dir_ + "/cgroup.procs", std::to_string(pid));
}

uint64_t MemoryCgroup::PeakBytes() const {
  bool ok = false;
  const std::string s =
      ReadSmallFile(dir_ + (version_ == CgroupVersion::kV2 ? "/memory.peak" : "/memory.max_usage_in_bytes"), &ok);
  if (!ok) return 0;
  try {
    return std::stoull(s);
  } catch (...) {
    return 0;
  }
}

std::string MemoryCgroup::Describe() const {
  return std::string(version_ == CgroupVersion::kV2 ? "cgroup v2 memory.max=" : "cgroup v1 memory.limit_in_bytes=") +
         sparse::FormatBytes(limit_);
}

Status DropFileCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(path + ": cannot open to drop its cached pages: " + std::strerror(errno));
  ::fdatasync(fd);  // dirty pages are not dropped; a freshly written model may still have some
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (rc != 0) return Status::IOError(path + ": posix_fadvise(DONTNEED) failed: " + std::strerror(rc));
  return Status::Ok();
}

Status DropAllPageCache() {
  ::sync();
  return WriteControl("/proc/sys/vm/drop_caches", "1");
}

}  // namespace nflash::bench
