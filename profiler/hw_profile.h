// The hardware profile (`nflash profile-hw`): compute throughput of the runtime's kernels per thread count, memory
// bandwidth, and flash behaviour (io_uring O_DIRECT random reads per request size and queue depth, sequential read
// and write), all measured on this machine. The planner and the packer report read it; the JSON schema (version 1) is
// specified in docs/hw-profile.md.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/status.h"
#include "runtime/core/thread_placement.h"

namespace nflash::profiler {

inline constexpr int kHwProfileVersion = 1;

struct HwProfileOptions {
  std::string dir;           // where the temporary flash test file goes; must exist and be writable
  bool quick = false;        // small matrices, a 256 MiB file and 20 ms cells (< 30 s in total)
  std::vector<int> threads;  // thread counts for the compute section; empty: 1..hardware threads
  // Where each thread count's threads run while timed: the decode's rule for the same policy (PlanThreadCpus), so a
  // count is measured on the CPUs the decode would use (the fastest first on big and little cores).
  PinThreads pin_threads = PinThreads::kAuto;
};

// Runs every measurement and returns the profile as JSON (schema version 1). The temporary file is unlinked right
// after it is created, so nothing is left behind even if the process is killed. Errors name the directory or file.
Result<nlohmann::json> MeasureHardware(const HwProfileOptions& options);

// Human-readable tables of a profile (what the command prints).
std::string FormatHwProfile(const nlohmann::json& profile);

// The filesystem type name ("ext4", "tmpfs", ...) and the mounted device ("/dev/nvme0n1p2") holding `path`, from
// statfs and /proc/self/mountinfo; "unknown" when they cannot be found.
struct FilesystemInfo {
  std::string type = "unknown";
  std::string device = "unknown";
  std::string mount_point = "unknown";
  bool tmpfs = false;
};
FilesystemInfo DescribeFilesystem(const std::string& path);

}  // namespace nflash::profiler
