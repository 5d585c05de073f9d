// Reads VmRSS / VmHWM from /proc/self/status.
#include "runtime/core/proc_stats.h"

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

}  // namespace nflash
