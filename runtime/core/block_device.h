// The block device a file lives on, from sysfs: its request queue's I/O scheduler (the sparse runtime's scattered
// reads wait less with no scheduler in the way: docs/runtime.md, "The disk's I/O scheduler") and the CPUs its
// interrupts arrive on (where the runtime puts its I/O thread: "Thread placement").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace nflash {

struct BlockQueueInfo {
  std::string device;     // the disk's name in /sys/block ("vda", "nvme0n1"; a partition's disk); empty: unknown
  std::string scheduler;  // its queue's active I/O scheduler ("none", "mq-deadline", ...); empty: unknown
};

// The disk holding `path` (its st_dev through /sys/dev/block) and its queue's scheduler. Empty fields when the file
// is on no block device (tmpfs, overlay of several, ...) or sysfs cannot be read.
BlockQueueInfo DescribeBlockQueue(const std::string& path);

// The active entry of a queue/scheduler line, the one in brackets ("mq-deadline kyber [none]" -> "none"); a line of
// one bare name is that name; empty when no entry is marked.
std::string ActiveScheduler(std::string_view line);

// Interrupts the disk holding `path` has raised on each CPU since boot (index: CPU number), summed over the interrupt
// lines of the device it belongs to: the `msi_irqs` of the nearest directory above the disk's in sysfs that has them
// (a PCI virtio or NVMe function), else that directory's `irq`; counts from /sys/kernel/irq/N/per_cpu_count. Empty
// when unknown (no block device, no interrupt found, no such sysfs files).
std::vector<uint64_t> DiskInterruptsPerCpu(const std::string& path);

// A per_cpu_count line ("0,11521331"): one count per CPU; empty when malformed.
std::vector<uint64_t> ParsePerCpuCounts(std::string_view line);

}  // namespace nflash
