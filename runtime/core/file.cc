// Implementations of the File abstraction: pread, mmap, in-memory, fault-injecting, atomic writer.
#include "runtime/core/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "runtime/core/round.h"

namespace nflash {
namespace {

// Writes are staged in a buffer of this size: large enough that syscalls cost nothing next to the copy.
constexpr size_t kWriteBufferBytes = size_t{4} << 20;

Status CheckRange(const std::string& path, uint64_t file_size, uint64_t offset, size_t size) {
  if (offset > file_size || size > file_size - offset) {
    return Status::IOError(path + ": read of " + std::to_string(size) + " bytes at offset " + std::to_string(offset) +
                           " goes past the end of the file (" + std::to_string(file_size) + " bytes)");
  }
  return Status::Ok();
}

class PreadFile final : public ReadableFile {
 public:
  // `uncached`: no readahead, and the pages of each read dropped after it (OpenUncachedPreadFile).
  PreadFile(std::string path, int fd, uint64_t size, bool uncached = false)
      : path_(std::move(path)), fd_(fd), size_(size), uncached_(uncached) {
    if (uncached_) (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
  }
  ~PreadFile() override { ::close(fd_); }
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override {
    NF_RETURN_IF_ERROR(CheckRange(path_, size_, offset, size));
    auto* out = static_cast<uint8_t*>(dst);
    size_t done = 0;
    while (done < size) {
      ssize_t n = ::pread(fd_, out + done, size - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(path_ + ": pread at offset " + std::to_string(offset + done), errno);
      }
      if (n == 0) {
        return Status::IOError(path_ + ": unexpected end of file at offset " + std::to_string(offset + done));
      }
      done += static_cast<size_t>(n);
    }
    if (uncached_) {
      // Whole pages: DONTNEED leaves the partial pages at a range's ends.
      static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
      const uint64_t begin = offset / page * page, end = RoundUp<uint64_t>(offset + size, page);
      (void)::posix_fadvise(fd_, static_cast<off_t>(begin), static_cast<off_t>(end - begin), POSIX_FADV_DONTNEED);
    }
    return Status::Ok();
  }
  uint64_t Size() const override { return size_; }
  const std::string& Path() const override { return path_; }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
  bool uncached_;
};

// A file's bytes in a mapping owned by this object: the file itself (mmap), or anonymous memory it was read into
// (ReadFileDirect: the data may start past the mapping's base, aligned).
class MappedFile final : public ReadableFile {
 public:
  MappedFile(std::string path, void* base, size_t mapped, const uint8_t* data, uint64_t size)
      : path_(std::move(path)), base_(base), mapped_(mapped), data_(data), size_(size) {}
  ~MappedFile() override {
    if (mapped_ > 0) ::munmap(base_, mapped_);
  }
  // Bytes not in memory (page-aligned, sorted), read through `source` when asked for.
  void SetHoles(std::vector<ByteRange> holes, std::unique_ptr<ReadableFile> source) {
    holes_ = std::move(holes);
    hole_source_ = std::move(source);
  }
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override {
    NF_RETURN_IF_ERROR(CheckRange(path_, size_, offset, size));
    auto* out = static_cast<uint8_t*>(dst);
    const uint64_t end = offset + size;
    uint64_t at = offset;
    for (const ByteRange& h : holes_) {
      if (h.offset + h.size <= at) continue;
      if (h.offset >= end) break;
      if (h.offset > at) std::memcpy(out + (at - offset), data_ + at, static_cast<size_t>(h.offset - at));
      at = std::max(at, h.offset);
      const uint64_t stop = std::min(end, h.offset + h.size);
      NF_RETURN_IF_ERROR(hole_source_->ReadAt(at, static_cast<size_t>(stop - at), out + (at - offset)));
      at = stop;
    }
    if (at < end) std::memcpy(out + (at - offset), data_ + at, static_cast<size_t>(end - at));
    return Status::Ok();
  }
  uint64_t Size() const override { return size_; }
  const std::string& Path() const override { return path_; }
  const uint8_t* Data() const override { return data_; }

 private:
  std::string path_;
  void* base_;
  size_t mapped_;
  const uint8_t* data_;
  uint64_t size_;
  std::vector<ByteRange> holes_;  // not in memory (page-aligned, PROT_NONE)
  std::unique_ptr<ReadableFile> hole_source_;
};

Result<std::pair<int, uint64_t>> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("cannot open " + path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Status::FromErrno("cannot stat " + path, err);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is a directory, expected a file");
  }
  return std::make_pair(fd, static_cast<uint64_t>(st.st_size));
}

}  // namespace

void ScatterInto(const ReadRequest& r, const uint8_t* src) {
  if (r.n_pieces == 0) {
    std::memcpy(r.dst, src, r.size);
    return;
  }
  for (uint32_t i = 0; i < r.n_pieces; ++i) {
    std::memcpy(r.pieces[i].dst, src, r.pieces[i].size);
    src += r.pieces[i].size;
  }
}

namespace {

// One request through ReadAt: a scattered one piece by piece at consecutive offsets.
Status ReadRequestAt(const ReadableFile& file, const ReadRequest& r) {
  if (r.n_pieces == 0) return file.ReadAt(r.offset, r.size, r.dst);
  uint64_t offset = r.offset;
  for (uint32_t i = 0; i < r.n_pieces; ++i) {
    NF_RETURN_IF_ERROR(file.ReadAt(offset, r.pieces[i].size, r.pieces[i].dst));
    offset += r.pieces[i].size;
  }
  return Status::Ok();
}

}  // namespace

Status ReadableFile::ReadBatch(std::span<const ReadRequest> requests) const {
  for (const ReadRequest& r : requests) NF_RETURN_IF_ERROR(ReadRequestAt(*this, r));
  return Status::Ok();
}

Status ReadableFile::ReadBatchProgress(std::span<const ReadRequest> requests,
                                       const std::function<void(size_t)>& done) const {
  Status first;
  for (size_t i = 0; i < requests.size(); ++i) {
    Status s = ReadRequestAt(*this, requests[i]);
    if (s.ok()) {
      done(i);
    } else if (first.ok()) {
      first = std::move(s);
    }
  }
  return first;
}

Result<std::unique_ptr<ReadableFile>> OpenPreadFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto fd_size, OpenForRead(path));
  return std::unique_ptr<ReadableFile>(new PreadFile(path, fd_size.first, fd_size.second));
}

namespace {
constexpr long kTmpfsMagic = 0x01021994;
constexpr long kRamfsMagic = 0x858458f6;
bool IsMemoryFilesystem(const struct statfs& sfs) { return sfs.f_type == kTmpfsMagic || sfs.f_type == kRamfsMagic; }
}  // namespace

bool OnMemoryFilesystem(int fd) {
  struct statfs sfs {};
  return ::fstatfs(fd, &sfs) == 0 && IsMemoryFilesystem(sfs);
}

bool OnMemoryFilesystem(const std::string& path) {
  struct statfs sfs {};
  return ::statfs(path.c_str(), &sfs) == 0 && IsMemoryFilesystem(sfs);
}

Result<std::unique_ptr<ReadableFile>> OpenUncachedPreadFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto fd_size, OpenForRead(path));
  return std::unique_ptr<ReadableFile>(new PreadFile(path, fd_size.first, fd_size.second, /*uncached=*/true));
}

Result<std::unique_ptr<ReadableFile>> OpenMmapFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto fd_size, OpenForRead(path));
  auto [fd, size] = fd_size;
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return Status::FromErrno("cannot mmap " + path, err);
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file referenced
  return std::unique_ptr<ReadableFile>(new MappedFile(path, const_cast<uint8_t*>(data), size, data, size));
}

namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kDirectBlockBytes = 4096;
constexpr size_t kDirectChunkBytes = size_t{8} << 20;

// The whole of `fd` (`size` bytes; `direct`: opened O_DIRECT, so reads are whole blocks into aligned memory) read
// into anonymous memory, 2 MiB-aligned when large so that huge pages can back it; the whole blocks inside `holes`
// are skipped (ReadFileDirect).
Result<std::unique_ptr<ReadableFile>> ReadWholeFd(const std::string& path, int fd, uint64_t size, bool direct,
                                                  std::span<const ByteRange> holes = {}) {
  // Whole blocks (O_DIRECT reads end on one), plus room to align the start to a huge page.
  const size_t length = RoundUp(size, kDirectBlockBytes);
  const size_t mapped = length == 0 ? 0 : length + (length >= kHugePageBytes ? kHugePageBytes : 0);
  void* base = nullptr;
  uint8_t* data = nullptr;
  if (mapped > 0) {
    base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      return Status::FromErrno("cannot allocate " + std::to_string(mapped) + " bytes to hold " + path, err);
    }
    const uintptr_t align = length >= kHugePageBytes ? kHugePageBytes : kDirectBlockBytes;
    data = reinterpret_cast<uint8_t*>(RoundUp(reinterpret_cast<uintptr_t>(base), align));
    AdviseHugePages(data, length);
  }
  // The holes' whole blocks, in file order.
  std::vector<ByteRange> skip;
  uint64_t prev_end = 0;
  for (const ByteRange& h : holes) {
    if (h.offset < prev_end || h.offset + h.size > size) {
      return Status::InvalidArgument(path + ": hole [" + std::to_string(h.offset) + ", " +
                                     std::to_string(h.offset + h.size) + ") is out of order or beyond the file's " +
                                     std::to_string(size) + " bytes");
    }
    prev_end = h.offset + h.size;
    const ByteRange inner = InnerBlocks(h, kDirectBlockBytes);
    if (inner.size > 0) skip.push_back(inner);
  }
  for (const ByteRange& h : skip) {
    // Never huge pages (a 2 MiB page at an edge would make part of the hole resident), never accessible.
    (void)::madvise(data + h.offset, h.size, MADV_NOHUGEPAGE);
    if (::mprotect(data + h.offset, h.size, PROT_NONE) != 0) {
      const int err = errno;
      ::munmap(base, mapped);
      return Status::FromErrno(path + ": cannot protect the bytes left out of memory", err);
    }
  }
  auto file = std::make_unique<MappedFile>(path, base, mapped, data, size);
  if (!skip.empty()) {
    NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> source, OpenUncachedPreadFile(path));
    file->SetHoles(skip, std::move(source));
  }
  size_t done = 0;
  size_t next_hole = 0;
  while (done < size) {
    if (next_hole < skip.size() && done >= skip[next_hole].offset) {
      done = static_cast<size_t>(skip[next_hole].offset + skip[next_hole].size);
      ++next_hole;
      continue;
    }
    const size_t until = next_hole < skip.size() ? static_cast<size_t>(skip[next_hole].offset) : length;
    const size_t want = std::min(kDirectChunkBytes, until - done);
    const ssize_t n = ::pread(fd, data + done, want, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      return Status::FromErrno(path + ": " + (direct ? "O_DIRECT " : "") + "read at offset " + std::to_string(done),
                               err);
    }
    if (n == 0) {
      return Status::IOError(path + ": unexpected end of file at offset " + std::to_string(done) + " (size " +
                             std::to_string(size) + ")");
    }
    const size_t before = done;
    done += static_cast<size_t>(n);
    // A short O_DIRECT read ends on a block boundary unless it reached the end of the file.
    if (direct && done < size) done &= ~(kDirectBlockBytes - 1);
    if (done == before) {  // less than a block where the data should go on: the file shrank after it was opened
      return Status::IOError(path + ": unexpected end of file at offset " +
                             std::to_string(before + static_cast<size_t>(n)) + " (size " + std::to_string(size) + ")");
    }
  }
  return std::unique_ptr<ReadableFile>(std::move(file));
}

}  // namespace

void AdviseHugePages(void* p, size_t bytes) {
  const uintptr_t begin = RoundUp<uintptr_t>(reinterpret_cast<uintptr_t>(p), kHugePageBytes);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / kHugePageBytes * kHugePageBytes;
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

Result<std::unique_ptr<ReadableFile>> ReadFileDirect(const std::string& path) { return ReadFileDirect(path, {}); }

Result<std::unique_ptr<ReadableFile>> ReadFileDirect(const std::string& path, std::span<const ByteRange> holes) {
  NF_ASSIGN_OR_RETURN(auto fd_size, OpenForRead(path));
  const auto [fd, size] = fd_size;
  // O_DIRECT where the filesystem takes it; tmpfs refuses it (EINVAL) and is read buffered.
  const int flags = ::fcntl(fd, F_GETFL);
  const bool direct = flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
  Result<std::unique_ptr<ReadableFile>> file = ReadWholeFd(path, fd, size, direct, holes);
  ::close(fd);
  return file;
}

Result<std::unique_ptr<ReadableFile>> ReadFileToMemory(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return std::unique_ptr<ReadableFile>(new MemoryFile(path, std::move(bytes)));
}

Result<std::vector<uint8_t>> ReadWholeFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto f, OpenPreadFile(path));
  std::vector<uint8_t> bytes(f->Size());
  NF_RETURN_IF_ERROR(f->ReadAt(0, bytes.size(), bytes.data()));
  return bytes;
}

bool FileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::optional<std::string> ReadKernelTextFile(const std::string& path, size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0 || text.size() >= max_bytes) break;
    text.append(buf, std::min(static_cast<size_t>(n), max_bytes - text.size()));
  }
  ::close(fd);
  return text;
}

std::string ReadKernelWord(const std::string& path) {
  const std::optional<std::string> text = ReadKernelTextFile(path, 4096);
  if (!text) return "";
  const size_t b = text->find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  const size_t e = text->find_first_of(" \t\n", b);
  return text->substr(b, e == std::string::npos ? std::string::npos : e - b);
}

Status MemoryFile::ReadAt(uint64_t offset, size_t size, void* dst) const {
  NF_RETURN_IF_ERROR(CheckRange(path_, bytes_.size(), offset, size));
  if (size > 0) std::memcpy(dst, bytes_.data() + offset, size);
  return Status::Ok();
}

struct FaultInjectingFile::State {
  std::mutex mu;                    // guards remaining
  std::vector<int> remaining;       // per rule: faults left (-1: unlimited)
  std::atomic<int64_t> injected{0};
};

FaultInjectingFile::~FaultInjectingFile() = default;

void FaultInjectingFile::AddRule(const Rule& rule) {
  if (!state_) state_ = std::make_shared<State>();
  rules_.push_back(rule);
  state_->remaining.push_back(rule.count);
}

void FaultInjectingFile::ClearFaults() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  std::fill(state_->remaining.begin(), state_->remaining.end(), 0);
}

int64_t FaultInjectingFile::InjectedCount() const { return state_ ? state_->injected.load() : 0; }

Status FaultInjectingFile::ReadAt(uint64_t offset, size_t size, void* dst) const {
  int hit = -1;
  if (state_) {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (size_t i = 0; i < rules_.size(); ++i) {
      const Rule& r = rules_[i];
      bool overlaps = offset < r.offset + std::min(r.length, UINT64_MAX - r.offset) && r.offset < offset + size;
      if (!overlaps || state_->remaining[i] == 0) continue;
      if (state_->remaining[i] > 0) --state_->remaining[i];
      hit = static_cast<int>(i);
      break;
    }
    if (hit >= 0) state_->injected.fetch_add(1);
  }
  if (hit < 0) return base_->ReadAt(offset, size, dst);
  const Rule& r = rules_[hit];
  switch (r.fault) {
    case Fault::kEio:
      return Status::FromErrno(Path() + ": pread at offset " + std::to_string(offset) + " (injected)", EIO);
    case Fault::kShortRead: {
      size_t got = size / 2;
      NF_RETURN_IF_ERROR(base_->ReadAt(offset, got, dst));
      return Status::IOError(Path() + ": short read at offset " + std::to_string(offset) + ": got " +
                             std::to_string(got) + " of " + std::to_string(size) + " bytes (injected)");
    }
    case Fault::kBitFlip: {
      NF_RETURN_IF_ERROR(base_->ReadAt(offset, size, dst));
      uint64_t at = std::max(offset, r.offset) - offset;  // first byte of the read inside the rule's range
      if (at < size) static_cast<uint8_t*>(dst)[at] ^= 0x10;
      return Status::Ok();
    }
  }
  return Status::Internal("unknown fault kind");
}

Result<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Create(const std::string& path, bool overwrite) {
  if (!overwrite && FileExists(path)) {
    return Status::InvalidArgument(path + " exists; pass --force to overwrite it");
  }
  std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno("cannot create " + tmp, errno);
  auto w = std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, tmp, fd));
  w->buffer_.reserve(kWriteBufferBytes);
  return w;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

Status AtomicFileWriter::FlushBuffer() {
  size_t done = 0;
  while (done < buffer_.size()) {
    ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno("write to " + tmp_path_, errno);
    }
    done += static_cast<size_t>(n);
  }
  buffer_.clear();
  return Status::Ok();
}

Status AtomicFileWriter::Append(const void* data, size_t size) {
  if (committed_ || fd_ < 0) return Status::Internal("append to a closed writer for " + path_);
  const auto* p = static_cast<const uint8_t*>(data);
  offset_ += size;
  if (buffer_.size() + size > kWriteBufferBytes) {
    NF_RETURN_IF_ERROR(FlushBuffer());
    if (size >= kWriteBufferBytes) {  // large block: write through
      buffer_.assign(p, p + size);
      Status s = FlushBuffer();
      buffer_.reserve(kWriteBufferBytes);
      return s;
    }
  }
  buffer_.insert(buffer_.end(), p, p + size);
  return Status::Ok();
}

Status AtomicFileWriter::PadTo(uint64_t alignment) {
  if (alignment == 0) return Status::Internal("PadTo(0)");
  static const uint8_t kZeros[256] = {};
  uint64_t pad = (alignment - offset_ % alignment) % alignment;
  while (pad > 0) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(pad, sizeof(kZeros)));
    NF_RETURN_IF_ERROR(Append(kZeros, n));
    pad -= n;
  }
  return Status::Ok();
}

Status AtomicFileWriter::WriteAt(uint64_t offset, const void* data, size_t size) {
  if (offset + size > offset_) return Status::Internal("WriteAt past the written end of " + path_);
  NF_RETURN_IF_ERROR(FlushBuffer());
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(fd_, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno("pwrite to " + tmp_path_, errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status AtomicFileWriter::Commit() {
  if (committed_) return Status::Ok();
  NF_RETURN_IF_ERROR(FlushBuffer());
  if (::fsync(fd_) != 0) return Status::FromErrno("fsync " + tmp_path_, errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    return Status::FromErrno("close " + tmp_path_, errno);
  }
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    return Status::FromErrno("rename " + tmp_path_ + " to " + path_, errno);
  }
  committed_ = true;
  return Status::Ok();
}

bool IsDecimal(std::string_view s) {
  return !s.empty() && s.size() <= 20 && s.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace nflash
