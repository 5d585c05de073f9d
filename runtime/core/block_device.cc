// /sys/dev/block/MAJOR:MINOR is the device's sysfs directory; a partition's queue and interrupts are its disk's.
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

namespace {

// The disk's directory in sysfs (a partition's disk), or empty: no block device (tmpfs, btrfs subvolume's anonymous
// device, ...).
std::filesystem::path DiskDir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir = fs::canonical("/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                                   std::to_string(minor(st.st_dev)),
                               ec);
  if (ec) return {};
  if (fs::exists(dir / "partition", ec)) dir = dir.parent_path();
  return dir;
}

}  // namespace

std::vector<uint64_t> ParsePerCpuCounts(std::string_view line) {
  std::vector<uint64_t> counts;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.remove_suffix(1);
  if (line.empty()) return counts;
  size_t at = 0;
  for (;;) {
    const size_t comma = line.find(',', at);
    const std::string_view field =
        line.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    if (!IsDecimal(field)) return {};
    counts.push_back(std::stoull(std::string(field)));
    if (comma == std::string_view::npos) return counts;
    at = comma + 1;
  }
}

std::vector<uint64_t> DiskInterruptsPerCpu(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path disk = DiskDir(path);
  if (disk.empty()) return {};
  std::error_code ec;
  std::vector<int> irqs;
  // Up from the disk (vda -> block -> virtio1 -> 0000:00:02.0): the first directory naming interrupts.
  for (fs::path dir = disk; irqs.empty() && dir.has_relative_path() && dir != "/sys/devices"; dir = dir.parent_path()) {
    if (fs::is_directory(dir / "msi_irqs", ec)) {
      for (const auto& e : fs::directory_iterator(dir / "msi_irqs", ec)) {
        const std::string name = e.path().filename().string();
        if (IsDecimal(name) && name.size() < 10) irqs.push_back(std::stoi(name));
      }
    } else if (const std::string irq = ReadKernelWord((dir / "irq").string());
               IsDecimal(irq) && irq.size() < 10 && irq != "0") {
      irqs.push_back(std::stoi(irq));
    }
  }
  std::vector<uint64_t> total;
  for (int irq : irqs) {
    // The whole line (ReadKernelWord keeps 4 KiB at most, which could cut a many-CPU machine's last count short).
    const std::optional<std::string> line =
        ReadKernelTextFile("/sys/kernel/irq/" + std::to_string(irq) + "/per_cpu_count");
    const std::vector<uint64_t> c = line ? ParsePerCpuCounts(*line) : std::vector<uint64_t>{};
    if (c.size() > total.size()) total.resize(c.size(), 0);
    for (size_t i = 0; i < c.size(); ++i) total[i] += c[i];
  }
  return total;
}

BlockQueueInfo DescribeBlockQueue(const std::string& path) {
  BlockQueueInfo info;
  const std::filesystem::path dir = DiskDir(path);
  if (dir.empty()) return info;
  const std::optional<std::string> text = ReadKernelTextFile(dir / "queue" / "scheduler");
  if (!text) return info;
  info.device = dir.filename().string();
  info.scheduler = ActiveScheduler(std::string_view(*text).substr(0, text->find('\n')));
  return info;
}

}  // namespace nflash
