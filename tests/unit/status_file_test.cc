// Tests of Status/Result and the File abstraction (pread, mmap, memory, fault injection, atomic writer).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/core/block_device.h"
#include "runtime/core/file.h"
#include "runtime/core/proc_stats.h"
#include "runtime/core/round.h"
#include "runtime/core/status.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Status QuarterInto(int x, int* out) {
  NF_ASSIGN_OR_RETURN(int h, Half(x));
  NF_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(StatusTest, CodesAndMessages) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = Status::Corruption("bad magic");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(s.ToString(), "Corruption: bad magic");
  EXPECT_EQ(s.WithContext("model.gguf").message(), "model.gguf: bad magic");
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
  EXPECT_NE(Status::FromErrno("open x", ENOENT).message().find("No such file"), std::string::npos);
}

// Every code reads differently in a message (the name before the colon is how a user tells a usage error from a
// corrupt file from a disk error); OK alone has no colon; FromErrno is "<what>: <strerror>" as an I/O error (status.h).
TEST(StatusTest, EachCodeHasItsOwnNameInMessages) {
  const std::vector<Status> all = {Status::InvalidArgument("m"), Status::NotFound("m"),          Status::Corruption("m"),
                                   Status::IOError("m"),         Status::Unsupported("m"),       Status::ResourceExhausted("m"),
                                   Status::Internal("m")};
  std::set<std::string> names = {StatusCodeName(StatusCode::kOk)};
  for (const Status& st : all) {
    const std::string name = StatusCodeName(st.code());
    SCOPED_TRACE(name);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(name, "Unknown");
    EXPECT_FALSE(name.empty());
    EXPECT_TRUE(names.insert(name).second) << "two codes named alike";
    EXPECT_EQ(st.ToString(), name + ": m");
  }
  EXPECT_EQ(names.size(), all.size() + 1);
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  const Status e = Status::FromErrno("open x", ENOENT);
  EXPECT_EQ(e.code(), StatusCode::kIOError);
  EXPECT_EQ(e.message(), std::string("open x: ") + std::strerror(ENOENT));
}

TEST(StatusTest, ResultAndMacros) {
  int out = 0;
  EXPECT_TRUE(QuarterInto(12, &out).ok());
  EXPECT_EQ(out, 3);
  Status s = QuarterInto(6, &out);  // 6 -> 3 -> odd
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
  Result<int> from_ok_status = Status::Ok();
  EXPECT_FALSE(from_ok_status.ok());
  EXPECT_EQ(from_ok_status.status().code(), StatusCode::kInternal);
}

std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7 + 3);
  return v;
}

TEST(RoundTest, RoundUpToMultiples) {
  EXPECT_EQ(RoundUp<uint64_t>(0, 4096), 0u);
  EXPECT_EQ(RoundUp<uint64_t>(1, 4096), 4096u);
  EXPECT_EQ(RoundUp<uint64_t>(4096, 4096), 4096u);
  EXPECT_EQ(RoundUp<uint64_t>(6912, 512), 7168u);  // a 7B Q4_0 bundle at the disk's 512-byte alignment: 14 * 512
  EXPECT_EQ(RoundUp<int64_t>(33, 32), 64);
  EXPECT_EQ(RoundUp<uint64_t>(uint64_t{1} << 40 | 1, 2u << 20), (uint64_t{1} << 40) + (2u << 20));
  static_assert(RoundUp(10, 3) == 12);
}

TEST(FileTest, PreadMmapAndMemoryAgree) {
  testing::TempDir dir;
  std::string path = dir.File("data.bin");
  auto bytes = Pattern(10000);
  testing::WriteBytes(path, bytes);
  auto pread = OpenPreadFile(path);
  auto mmap = OpenMmapFile(path);
  auto mem = ReadFileToMemory(path);
  ASSERT_TRUE(pread.ok() && mmap.ok() && mem.ok());
  for (ReadableFile* f : {pread->get(), mmap->get(), mem->get()}) {
    EXPECT_EQ(f->Size(), bytes.size());
    std::vector<uint8_t> got(100);
    ASSERT_TRUE(f->ReadAt(9900, 100, got.data()).ok());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), bytes.begin() + 9900));
    Status past = f->ReadAt(9950, 100, got.data());
    EXPECT_EQ(past.code(), StatusCode::kIOError);
    EXPECT_NE(past.message().find(path), std::string::npos);
    EXPECT_NE(past.message().find("9950"), std::string::npos);
  }
  EXPECT_EQ(pread.value()->Data(), nullptr);
  ASSERT_NE(mmap.value()->Data(), nullptr);
  EXPECT_EQ(mmap.value()->Data()[1234], bytes[1234]);

  std::vector<uint8_t> a(10), b(20);
  std::vector<ReadRequest> batch = {{0, 10, a.data()}, {500, 20, b.data()}};
  ASSERT_TRUE(pread.value()->ReadBatch(batch).ok());
  EXPECT_EQ(a[9], bytes[9]);
  EXPECT_EQ(b[19], bytes[519]);
}

TEST(FileTest, OpenErrorsNameThePath) {
  auto missing = OpenPreadFile("/nonexistent/nflash/x.bin");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("cannot open /nonexistent/nflash/x.bin"), std::string::npos)
      << missing.status().message();
  testing::TempDir dir;
  auto is_dir = OpenMmapFile(dir.path());
  ASSERT_FALSE(is_dir.ok());
  EXPECT_NE(is_dir.status().message().find("directory"), std::string::npos);
}

// A file that shrinks after it was opened: the read that finds no more data is an error naming where the data ended,
// not a loop asking for it again.
TEST(FileTest, PreadOfAFileTruncatedAfterOpenIsAnError) {
  testing::TempDir dir;
  const std::string path = dir.File("shrinks.bin");
  testing::WriteBytes(path, Pattern(8192));
  auto f = OpenPreadFile(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(::truncate(path.c_str(), 5000), 0);
  std::vector<uint8_t> buf(8192);
  const Status s = (*f)->ReadAt(0, 8192, buf.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("unexpected end of file at offset 5000"), std::string::npos) << s.message();
}

// The writer's misuse and an uncreatable temporary file are errors with their own messages.
TEST(FileTest, AtomicWriterRefusesMisuse) {
  auto nowhere = AtomicFileWriter::Create("/nonexistent/nflash/out.bin", true);
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.status().message().find("cannot create /nonexistent/nflash/out.bin"), std::string::npos)
      << nowhere.status().message();
  testing::TempDir dir;
  auto w = AtomicFileWriter::Create(dir.File("out.bin"), false);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append("abcd", 4).ok());
  Status s = (*w)->PadTo(0);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("PadTo(0)"), std::string::npos) << s.message();
  s = (*w)->WriteAt(2, "xyz", 3);  // 2 + 3 > the 4 bytes written
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("WriteAt past the written end"), std::string::npos) << s.message();
  ASSERT_TRUE((*w)->WriteAt(1, "xyz", 3).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  s = (*w)->Append("e", 1);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("append to a closed writer"), std::string::npos) << s.message();
  auto got = ReadWholeFile(dir.File("out.bin"));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(got->begin(), got->end()), "axyz");
}

TEST(FileTest, FaultInjection) {
  auto base = std::make_shared<MemoryFile>("mem.bin", Pattern(4096));
  FaultInjectingFile f(base);
  f.AddRule({FaultInjectingFile::Fault::kEio, 1000, 10, 1});       // fails once
  f.AddRule({FaultInjectingFile::Fault::kShortRead, 2000, 1, -1});  // always short
  f.AddRule({FaultInjectingFile::Fault::kBitFlip, 3000, 1, -1});    // silent corruption
  std::vector<uint8_t> buf(64);
  EXPECT_TRUE(f.ReadAt(0, 64, buf.data()).ok());
  Status eio = f.ReadAt(990, 64, buf.data());
  EXPECT_EQ(eio.code(), StatusCode::kIOError);
  EXPECT_NE(eio.message().find("Input/output error"), std::string::npos);
  EXPECT_TRUE(f.ReadAt(990, 64, buf.data()).ok()) << "count=1: the retry succeeds";
  EXPECT_FALSE(f.ReadAt(1990, 64, buf.data()).ok());
  EXPECT_FALSE(f.ReadAt(1990, 64, buf.data()).ok());
  ASSERT_TRUE(f.ReadAt(2990, 64, buf.data()).ok());
  EXPECT_NE(buf[10], base->bytes()[3000]) << "the byte at the rule's offset is flipped";
  EXPECT_EQ(buf[11], base->bytes()[3001]);
  EXPECT_EQ(f.InjectedCount(), 4);
}

TEST(FileTest, AtomicWriterRenamesOnlyOnCommit) {
  testing::TempDir dir;
  std::string path = dir.File("out.bin");
  {
    auto w = AtomicFileWriter::Create(path, false);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append("abc", 3).ok());
    EXPECT_FALSE(FileExists(path)) << "nothing at the final name before Commit";
  }
  EXPECT_FALSE(FileExists(path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the temporary file is removed";

  auto w = AtomicFileWriter::Create(path, false);
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> big = Pattern(5 << 20);  // larger than the write buffer
  ASSERT_TRUE((*w)->Append("hdr!", 4).ok());
  ASSERT_TRUE((*w)->PadTo(32).ok());
  EXPECT_EQ((*w)->Offset(), 32u);
  ASSERT_TRUE((*w)->Append(big.data(), big.size()).ok());
  ASSERT_TRUE((*w)->WriteAt(0, "HDR", 3).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  auto got = ReadWholeFile(path);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 32 + big.size());
  EXPECT_EQ(std::string(got->begin(), got->begin() + 4), "HDR!");
  EXPECT_EQ((*got)[5], 0);
  EXPECT_TRUE(std::equal(big.begin(), big.end(), got->begin() + 32));

  auto again = AtomicFileWriter::Create(path, false);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("--force"), std::string::npos);
  EXPECT_TRUE(AtomicFileWriter::Create(path, true).ok());
}

}  // namespace
}  // namespace nflash

namespace nflash {
namespace {

// The active scheduler is the bracketed entry of sysfs's queue/scheduler line.
TEST(BlockDeviceTest, ActiveSchedulerIsTheBracketedEntry) {
  EXPECT_EQ(ActiveScheduler("[mq-deadline] kyber bfq none\n"), "mq-deadline");
  EXPECT_EQ(ActiveScheduler("mq-deadline kyber bfq [none]\n"), "none");
  EXPECT_EQ(ActiveScheduler("none\n"), "none");
  EXPECT_EQ(ActiveScheduler("mq-deadline none"), "");  // nothing marked
  EXPECT_EQ(ActiveScheduler("[none"), "");               // malformed
  EXPECT_EQ(ActiveScheduler(""), "");
}

// The test binary's own file: on a block device, DescribeBlockQueue names the disk and the scheduler its queue file
// marks, read here through /sys/block/<disk>/queue/scheduler (the disk's own directory, not the /sys/dev/block link
// the code follows); on none (overlay, tmpfs), both fields are empty and sysfs has no entry for its device number.
TEST(BlockDeviceTest, DescribesTheDiskOfAFile) {
  const std::string exe = std::filesystem::canonical("/proc/self/exe").string();
  const BlockQueueInfo info = DescribeBlockQueue(exe);
  if (info.device.empty()) {
    EXPECT_TRUE(info.scheduler.empty());
    struct stat st {};
    ASSERT_EQ(::stat(exe.c_str(), &st), 0);
    const std::string link =
        "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
    EXPECT_FALSE(std::filesystem::exists(link + "/queue/scheduler") ||
                 std::filesystem::exists(link + "/../queue/scheduler"))
        << link << " has a queue, yet no disk was found for " << exe;
  } else {
    std::ifstream in("/sys/block/" + info.device + "/queue/scheduler");
    ASSERT_TRUE(in) << info.device;
    std::string line;
    std::getline(in, line);
    EXPECT_NE(line.find(info.scheduler), std::string::npos) << line << " vs " << info.scheduler;
    EXPECT_EQ(ActiveScheduler(line), info.scheduler);
  }
  EXPECT_TRUE(DescribeBlockQueue("/proc/self/status").device.empty()) << "procfs is on no disk";
}

TEST(BlockDeviceTest, ParsesPerCpuCounts) {
  EXPECT_EQ(ParsePerCpuCounts("0,11521331\n"), (std::vector<uint64_t>{0, 11521331}));
  EXPECT_EQ(ParsePerCpuCounts("7"), std::vector<uint64_t>{7});
  EXPECT_EQ(ParsePerCpuCounts("3,4 \n"), (std::vector<uint64_t>{3, 4})) << "trailing blanks are not a field";
  EXPECT_TRUE(ParsePerCpuCounts("").empty());
  EXPECT_TRUE(ParsePerCpuCounts("1,,2").empty());
  EXPECT_TRUE(ParsePerCpuCounts("1,x").empty());
}

// The per-CPU interrupt counts of the test binary's disk, against /proc/interrupts read before and after (counts only
// grow), for the interrupt lines found here another way: the msi_irqs of the PCI function that /sys/block/<disk>/device
// leads to. No such lines (no disk, or not a PCI device): the function finds none either.
TEST(BlockDeviceTest, DiskInterruptsMatchProcInterrupts) {
  namespace fs = std::filesystem;
  const std::string exe = fs::canonical("/proc/self/exe").string();
  const BlockQueueInfo info = DescribeBlockQueue(exe);
  std::vector<int> irqs;
  std::error_code ec;
  if (!info.device.empty()) {
    const fs::path device = fs::canonical("/sys/block/" + info.device + "/device", ec);
    for (fs::path d = device; !ec && d.string().size() > 12; d = d.parent_path()) {
      std::error_code missing;
      if (fs::is_directory(d / "msi_irqs", missing)) {
        for (const auto& e : fs::directory_iterator(d / "msi_irqs")) irqs.push_back(std::stoi(e.path().filename()));
        break;
      }
    }
  }
  // Per CPU: the sum over `irqs` of their /proc/interrupts columns.
  auto proc_counts = [&] {
    std::ifstream in("/proc/interrupts");
    std::string header;
    std::getline(in, header);
    std::vector<int> cpus;
    std::istringstream hs(header);
    for (std::string w; hs >> w;) cpus.push_back(std::stoi(w.substr(3)));  // "CPU0"
    std::vector<uint64_t> sum(cpus.empty() ? 0 : static_cast<size_t>(cpus.back()) + 1, 0);
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::string label;
      ls >> label;
      if (label.empty() || label.back() != ':' || label.find_first_not_of("0123456789:") != std::string::npos) continue;
      const int irq = std::stoi(label);
      if (std::find(irqs.begin(), irqs.end(), irq) == irqs.end()) continue;
      for (int c : cpus) {
        uint64_t n = 0;
        ls >> n;
        sum[static_cast<size_t>(c)] += n;
      }
    }
    return sum;
  };
  const std::vector<uint64_t> before = proc_counts();
  const std::vector<uint64_t> got = DiskInterruptsPerCpu(exe);
  const std::vector<uint64_t> after = proc_counts();
  if (irqs.empty()) {
    EXPECT_TRUE(got.empty()) << info.device;
    return;
  }
  ASSERT_EQ(got.size(), before.size()) << "one count per CPU";
  for (size_t c = 0; c < got.size(); ++c) {
    EXPECT_LE(before[c], got[c]) << "CPU " << c;
    EXPECT_LE(got[c], after[c]) << "CPU " << c;
  }
}

// Kernel-generated files report a size of 0 to stat; ReadKernelTextFile reads them to EOF. Checked against a regular
// file written here (exact bytes, the cap), against /proc/self/status (stat size 0, yet the text has this process's
// pid), and on a missing path.
TEST(FileTest, ReadsKernelTextFilesToTheirEnd) {
  testing::TempDir dir;
  const std::string path = dir.File("kernel_text.txt");
  std::string body = "  32768K\nsecond line\n";
  body += std::string(10000, 'x');  // longer than one read() of the reader's buffer
  { std::ofstream(path) << body; }
  const std::optional<std::string> whole = ReadKernelTextFile(path);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(*whole, body);
  const std::optional<std::string> capped = ReadKernelTextFile(path, 5000);
  ASSERT_TRUE(capped.has_value());
  EXPECT_EQ(*capped, body.substr(0, 5000));
  EXPECT_EQ(ReadKernelWord(path), "32768K");

  struct stat st {};
  ASSERT_EQ(::stat("/proc/self/status", &st), 0);
  EXPECT_EQ(st.st_size, 0) << "procfs files have no size: the reason the reader reads to EOF";
  const std::optional<std::string> status = ReadKernelTextFile("/proc/self/status");
  ASSERT_TRUE(status.has_value());
  EXPECT_NE(status->find("Pid:\t" + std::to_string(::getpid()) + "\n"), std::string::npos) << *status;

  EXPECT_FALSE(ReadKernelTextFile(dir.File("no_such_file")).has_value());
  EXPECT_EQ(ReadKernelWord(dir.File("no_such_file")), "");
  { std::ofstream(path) << " \n\t"; }
  EXPECT_EQ(ReadKernelWord(path), "");
}

// The process's figures against the kernel's other accounts of them: the peak RSS (VmHWM) equals getrusage's
// ru_maxrss and stays at a 64 MiB block's pages after the block is unmapped (VmRSS falls back); the CPU time counts
// the kernel's time too (against CLOCK_PROCESS_CPUTIME_ID over a loop of reads from /dev/zero, nearly all system
// time); sleeping adds voluntary context switches.
TEST(ProcStatsTest, PeakRssIsTheHighWaterMarkInBytes) {
  const ProcessMemory before = ReadProcessMemory();
  ASSERT_GT(before.rss_bytes, 0u);
  constexpr size_t kBlock = size_t{64} << 20;
  void* p = ::mmap(nullptr, kBlock, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 1, kBlock);
  const ProcessMemory touched = ReadProcessMemory();
  ASSERT_EQ(::munmap(p, kBlock), 0);
  const ProcessMemory after = ReadProcessMemory();
  EXPECT_GE(touched.rss_bytes + (size_t{1} << 20), before.rss_bytes + kBlock);
  EXPECT_LE(after.rss_bytes + kBlock / 2, touched.rss_bytes) << "the block's pages left with it";
  // The kernel's RSS counters are batched per CPU (a few hundred KiB apart at any moment): 1 MiB of slack.
  EXPECT_GE(after.peak_rss_bytes + (size_t{1} << 20), touched.rss_bytes) << "the peak keeps them";
  rusage ru{};
  ASSERT_EQ(::getrusage(RUSAGE_SELF, &ru), 0);
  // ru_maxrss (KiB) is the same high-water mark, read a moment later.
  const uint64_t maxrss = static_cast<uint64_t>(ru.ru_maxrss) * 1024;
  EXPECT_LE(after.peak_rss_bytes, maxrss);
  EXPECT_LE(maxrss - after.peak_rss_bytes, uint64_t{512} << 10) << after.peak_rss_bytes << " vs " << maxrss;
}

TEST(ProcStatsTest, CpuTimeCountsKernelTimeAndSleepsAreVoluntarySwitches) {
  auto process_clock = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
  };
  const int fd = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<char> buf(size_t{1} << 20);
  const double cpu0 = ProcessCpuSeconds(), clock0 = process_clock();
  // The kernel clears the buffer on every read: ~0.1-0.3 s of system time, next to no user time.
  while (process_clock() - clock0 < 0.2) {
    for (int i = 0; i < 64; ++i) ASSERT_EQ(::read(fd, buf.data(), buf.size()), static_cast<ssize_t>(buf.size()));
  }
  const double cpu = ProcessCpuSeconds() - cpu0, clock = process_clock() - clock0;
  ::close(fd);
  // getrusage's split into user and system time is sampled, its sum is not: within 20 ms of the clock's.
  EXPECT_NEAR(cpu, clock, 0.02 + 0.1 * clock);
  const ContextSwitches s0 = ProcessContextSwitches();
  for (int i = 0; i < 20; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const ContextSwitches s1 = ProcessContextSwitches();
  EXPECT_GE(s1.voluntary - s0.voluntary, 20u);
  EXPECT_LT(s1.involuntary - s0.involuntary, 20u);
}

}  // namespace
}  // namespace nflash
