// DescribeBlockQueue: /sys/dev/block/MAJOR:MINOR is the device's sysfs directory; a partition's queue is its disk's.
#include "runtime/core/block_device.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <filesystem>

#include "runtime/core/file.h"

namespace nflash {

std::string ActiveScheduler(std::string_view line) {
  const size_t open = line.find('[');
  if (open != std::string_view::npos) {
    const size_t close = line.find(']', open);
    if (close == std::string_view::npos) return "";
    return std::string(line.substr(open + 1, close - open - 1));
  }
  const size_t b = line.find_first_not_of(" \t\n");
  if (b == std::string_view::npos) return "";
  const size_t e = line.find_first_of(" \t\n", b);
  const std::string_view word = line.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b);
  // Several bare names: none is marked active.
  if (e != std::string_view::npos && line.find_first_not_of(" \t\n", e) != std::string_view::npos) return "";
  return std::string(word);
}

BlockQueueInfo DescribeBlockQueue(const std::string& path) {
  BlockQueueInfo info;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return info;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir = fs::canonical("/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                                   std::to_string(minor(st.st_dev)),
                               ec);
  if (ec) return info;  // no block device (tmpfs, btrfs subvolume's anonymous device, ...)
  if (fs::exists(dir / "partition", ec)) dir = dir.parent_path();
  const std::optional<std::string> text = ReadKernelTextFile(dir / "queue" / "scheduler");
  if (!text) return info;
  info.device = dir.filename().string();
  info.scheduler = ActiveScheduler(std::string_view(*text).substr(0, text->find('\n')));
  return info;
}

}  // namespace nflash
