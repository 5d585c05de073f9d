// Reads VmRSS / VmHWM from /proc/self/status and the CPU time from getrusage.
#include "runtime/core/proc_stats.h"

#include <sys/resource.h>

#include <cstdio>
#include <cstring>

namespace nflash {

ProcessMemory ReadProcessMemory() {
  ProcessMemory m;
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return m;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long long kb = 0;
    if (std::sscanf(line, "VmRSS: %llu kB", &kb) == 1) m.rss_bytes = kb * 1024;
    if (std::sscanf(line, "VmHWM: %llu kB", &kb) == 1) m.peak_rss_bytes = kb * 1024;
  }
  std::fclose(f);
  return m;
}

double ProcessCpuSeconds() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) return 0.0;
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

ContextSwitches ProcessContextSwitches() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) return {};
  return {static_cast<uint64_t>(ru.ru_nvcsw), static_cast<uint64_t>(ru.ru_nivcsw)};
}

}  // namespace nflash
