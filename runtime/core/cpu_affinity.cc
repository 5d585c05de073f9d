// pthread_{get,set}affinity_np over lists of CPU numbers.
#include "runtime/core/cpu_affinity.h"

#include <algorithm>
#include <string>

#include "runtime/core/file.h"

namespace nflash {

std::vector<int> ThreadCpus(pthread_t thread) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (pthread_getaffinity_np(thread, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

Status SetThreadCpus(pthread_t thread, std::span<const int> cpus) {
  if (cpus.empty()) return Status::InvalidArgument("no CPU to run the thread on");
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) {
      return Status::InvalidArgument("CPU " + std::to_string(c) + " outside [0, " + std::to_string(CPU_SETSIZE) + ")");
    }
    CPU_SET(c, &set);
  }
  if (const int err = pthread_setaffinity_np(thread, sizeof set, &set); err != 0) {
    const std::string more = cpus.size() > 1 ? " and " + std::to_string(cpus.size() - 1) + " more" : "";
    return Status::FromErrno("pthread_setaffinity_np to CPU " + std::to_string(cpus.front()) + more, err);
  }
  return Status::Ok();
}

std::vector<uint64_t> CpuCapacities(std::span<const int> cpus, const std::string& root) {
  if (cpus.empty()) return {};
  const int top = *std::max_element(cpus.begin(), cpus.end());
  if (top < 0 || top >= CPU_SETSIZE) return {};
  for (const char* leaf : {"cpu_capacity", "cpufreq/cpuinfo_max_freq"}) {
    std::vector<uint64_t> capacity(static_cast<size_t>(top) + 1, 0);
    bool all = true;
    for (int c : cpus) {
      const std::string word = ReadKernelWord(root + "/cpu" + std::to_string(c) + "/" + leaf);
      // 19 digits at most: a value std::stoull cannot overflow on (no real capacity or kHz comes near).
      const uint64_t value = c >= 0 && IsDecimal(word) && word.size() <= 19 ? std::stoull(word) : 0;
      if (value == 0) {
        all = false;
        break;
      }
      capacity[static_cast<size_t>(c)] = value;
    }
    if (all) return capacity;
  }
  return {};
}

}  // namespace nflash
