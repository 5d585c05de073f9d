// What the kernel says about this process: resident memory now and at its peak (/proc/self/status).
#pragma once

#include <cstdint>

namespace nflash {

struct ProcessMemory {
  uint64_t rss_bytes = 0;       // VmRSS
  uint64_t peak_rss_bytes = 0;  // VmHWM
};
// Zeros when /proc is not readable.
ProcessMemory ReadProcessMemory();

}  // namespace nflash
