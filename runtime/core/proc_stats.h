// What the kernel says about this process: resident memory now and at its peak (/proc/self/status), CPU time.
#pragma once

#include <cstdint>

namespace nflash {

struct ProcessMemory {
  uint64_t rss_bytes = 0;       // VmRSS
  uint64_t peak_rss_bytes = 0;  // VmHWM
};
// Zeros when /proc is not readable.
ProcessMemory ReadProcessMemory();
// User + system CPU time of every thread of this process so far (getrusage), in seconds; 0 when unavailable.
double ProcessCpuSeconds();
// Context switches of every thread of this process so far (getrusage): voluntary (a thread blocked or slept) and
// involuntary (a thread was preempted); zeros when unavailable.
struct ContextSwitches {
  uint64_t voluntary = 0;
  uint64_t involuntary = 0;
};
ContextSwitches ProcessContextSwitches();

}  // namespace nflash
