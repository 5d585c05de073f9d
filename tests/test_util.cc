// Test helpers implementation.
#include "tests/test_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#if defined(__SANITIZE_ADDRESS__)
// The ASan runtime's allocator statistics (sanitizer/allocator_interface.h, which Debian's g++ 12 does not install).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#else
#include <malloc.h>
#endif

namespace nflash::testing {

#if defined(__SANITIZE_ADDRESS__)
size_t HeapInUse() { return __sanitizer_get_current_allocated_bytes(); }
#else
size_t HeapInUse() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;  // chunks in the heap, and the large ones glibc maps on their own
}
#endif

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/nflash-test-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string SharedPath(const std::string& relative) { return std::string(NFLASH_SHARED_DIR) + "/" + relative; }
std::string NflashBinary() { return NFLASH_BINARY; }

CommandResult RunCommand(const std::string& command, bool capture_stderr) {
  CommandResult r;
  std::string full = capture_stderr ? command + " 2>&1" : command;
  FILE* pipe = ::popen(full.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

::testing::AssertionResult FailsAsUsageError(const std::string& command, const std::string& message) {
  const CommandResult r = RunCommand(command);
  if (r.exit_code == 2 && r.output.find(message) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << command << "\nexit code " << r.exit_code << " (want 2), output lacks \""
                                       << message << "\"?\n" << r.output;
}

std::string MakeReluDeployment(const std::string& model, const std::string& profile, const std::string& deploy) {
  const std::string nflash = NflashBinary();
  const std::vector<std::string> commands = {
      nflash + " -q convert " + SharedPath("models/stories260K-relu/stories260K-relu.bin") + " --tokenizer " +
          SharedPath("models/stories260K/tok512.bin") + " --activation relu -o " + model + " --type f32",
      // Calibration text only (the held-out file is for evaluation).
      nflash + " -q profile -m " + model + " -f " + SharedPath("text/tinystories_calib.txt") + " --tokens 4000 -t 2 -o " +
          profile,
      nflash + " -q pack -m " + model + " -p " + profile + " -o " + deploy};
  for (const std::string& c : commands) {
    CommandResult r = RunCommand(c);
    if (r.exit_code != 0) return c + "\n" + r.output;
  }
  return "";
}

int64_t CachedPages(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  void* p = size > 0 ? ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (p == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((static_cast<size_t>(size) + page - 1) / page);
  const int rc = ::mincore(p, static_cast<size_t>(size), vec.data());
  ::munmap(p, static_cast<size_t>(size));
  if (rc != 0) return -1;
  int64_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

void GgufTensorCopy::ZeroData() {
  uint64_t rows = 1;
  for (size_t i = 1; i < dims.size(); ++i) rows *= dims[i];
  bytes.assign(RowBytes(type, dims[0]).value() * rows, 0);
}

std::string RewriteGguf(const std::string& src, const std::string& dst,
                        const std::function<void(std::vector<std::pair<std::string, GgufValue>>*)>& edit_kv,
                        const std::function<void(GgufTensorCopy*)>& edit_tensor) {
  auto f = GgufFile::OpenPath(src, /*use_mmap=*/false);
  if (!f.ok()) return f.status().ToString();
  std::vector<std::pair<std::string, GgufValue>> kv = f->metadata();
  if (edit_kv) edit_kv(&kv);
  std::vector<GgufTensorCopy> tensors;
  for (const GgufTensorInfo& t : f->tensors()) {
    std::vector<uint8_t> scratch;
    auto bytes = f->TensorData(t, &scratch);
    if (!bytes.ok()) return bytes.status().ToString();
    tensors.push_back({t.name, t.type, t.dims, std::vector<uint8_t>(bytes->begin(), bytes->end())});
    if (edit_tensor) edit_tensor(&tensors.back());
  }
  GgufWriter w;
  for (auto& [key, value] : kv) w.Set(key, std::move(value));
  for (const GgufTensorCopy& t : tensors) {
    if (Status s = w.AddTensor(t.name, t.type, t.dims); !s.ok()) return s.ToString();
  }
  if (Status s = w.Begin(dst, /*overwrite=*/true); !s.ok()) return s.ToString();
  for (const GgufTensorCopy& t : tensors) {
    if (Status s = w.WriteTensorData(t.name, t.bytes); !s.ok()) return s.ToString();
  }
  const Status s = w.Finish();
  return s.ok() ? "" : s.ToString();
}

std::string DropFromPageCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot open " + path;
  ::fsync(fd);  // dirty pages (a file just written) cannot be dropped
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (rc != 0) return "posix_fadvise failed on " + path;
  if (CachedPages(path) != 0) return path + " could not be dropped from the page cache";
  return "";
}

void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<float> ReadNpyF32(const std::string& path, size_t expected) {
  std::string raw = ReadText(path);
  EXPECT_EQ(raw.compare(0, 6, "\x93NUMPY"), 0);
  const uint8_t major = static_cast<uint8_t>(raw[6]);
  size_t header_len, data_start;
  if (major == 1) {
    header_len = static_cast<uint8_t>(raw[8]) | (static_cast<uint8_t>(raw[9]) << 8);
    data_start = 10 + header_len;
  } else {
    uint32_t h;
    std::memcpy(&h, raw.data() + 8, 4);
    header_len = h;
    data_start = 12 + header_len;
  }
  std::string header = raw.substr(0, data_start);
  EXPECT_NE(header.find("'descr': '<f4'"), std::string::npos) << header;
  EXPECT_NE(header.find("'fortran_order': False"), std::string::npos) << header;
  std::vector<float> v(expected);
  EXPECT_EQ(raw.size() - data_start, expected * 4);
  std::memcpy(v.data(), raw.data() + data_start, std::min(raw.size() - data_start, expected * 4));
  return v;
}

std::vector<std::string> Lines(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

GgufKvEdit SetGgufKey(std::string key, std::optional<GgufValue> value) {
  return [key = std::move(key), value = std::move(value)](std::vector<std::pair<std::string, GgufValue>>* kv) {
    std::erase_if(*kv, [&](const auto& p) { return p.first == key; });
    if (value) kv->emplace_back(key, *value);
  };
}

GgufKvEdit EditGgufKey(std::string key, std::function<void(GgufValue&)> edit) {
  return [key = std::move(key), edit = std::move(edit)](std::vector<std::pair<std::string, GgufValue>>* kv) {
    for (auto& [k, v] : *kv) {
      if (k == key) edit(v);
    }
  };
}

std::function<void(GgufTensorCopy*)> RetypeGgufTensor(std::string name, GgmlType type) {
  return [name = std::move(name), type](GgufTensorCopy* t) {
    if (t->name != name) return;
    t->type = type;
    t->ZeroData();
  };
}

}  // namespace nflash::testing
