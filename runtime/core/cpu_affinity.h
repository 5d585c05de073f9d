// CPU affinity of threads (Linux): which CPUs a thread may run on, read, set and restored; how fast each CPU is.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/status.h"

namespace nflash {

// The CPUs `thread` may run on, ascending (pthread_getaffinity_np); empty when it cannot be read.
std::vector<int> ThreadCpus(pthread_t thread);
// Restricts `thread` to `cpus` (pthread_setaffinity_np). InvalidArgument for an empty list or a CPU outside
// [0, CPU_SETSIZE); the system's error (e.g. a CPU outside the process's cpuset) otherwise.
Status SetThreadCpus(pthread_t thread, std::span<const int> cpus);

// How fast each of `cpus` is relative to the others (index: CPU number; 0 for CPUs not listed), from sysfs under
// `root`: cpuN/cpu_capacity (arm64 and RISC-V kernels, x86 since 6.x: the scheduler's 0-1024 scale, the biggest core
// 1024) when every listed CPU has it, else cpuN/cpufreq/cpuinfo_max_freq (kHz: older arm kernels, x86 hybrid parts)
// when every one has that. Empty when neither source covers them all (nothing to tell them apart by).
std::vector<uint64_t> CpuCapacities(std::span<const int> cpus, const std::string& root = "/sys/devices/system/cpu");

}  // namespace nflash
