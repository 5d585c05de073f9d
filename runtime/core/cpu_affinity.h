// CPU affinity of threads (Linux): which CPUs a thread may run on, read, set and restored.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <span>
#include <vector>

#include "runtime/core/status.h"

namespace nflash {

// The CPUs `thread` may run on, ascending (pthread_getaffinity_np); empty when it cannot be read.
std::vector<int> ThreadCpus(pthread_t thread);
// Restricts `thread` to `cpus` (pthread_setaffinity_np). InvalidArgument for an empty list or a CPU outside
// [0, CPU_SETSIZE); the system's error (e.g. a CPU outside the process's cpuset) otherwise.
Status SetThreadCpus(pthread_t thread, std::span<const int> cpus);

}  // namespace nflash
