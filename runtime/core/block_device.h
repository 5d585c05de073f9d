// The block device a file lives on and its request queue's I/O scheduler, from sysfs: the sparse runtime's scattered
// reads wait less with no scheduler in the way (docs/runtime.md, "The disk's I/O scheduler").
#pragma once

#include <string>
#include <string_view>

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

}  // namespace nflash
