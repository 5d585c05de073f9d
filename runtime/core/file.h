// File abstraction: positional reads (pread or mmap), an in-memory file and a fault-injecting wrapper for tests,
// and an atomic writer (temporary name, renamed on Commit) for every output nflash produces.
// io_uring / O_DIRECT readers (sparse runtime) implement the same ReadableFile interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/round.h"
#include "runtime/core/status.h"

namespace nflash {

// Where part of a scattered read lands.
struct ReadPiece {
  void* dst = nullptr;
  size_t size = 0;
};

// One read of a batch: `size` bytes at `offset` into `dst`; or, when `n_pieces` > 0, a scattered read: the same
// `size` bytes go in order to pieces[0], pieces[1], ... (their sizes sum to `size`; `dst` is unused). A scattered
// read is one request to the device (readv), e.g. neurons adjacent on flash whose cache slots are not adjacent in
// memory. The pieces must stay valid as long as the request.
struct ReadRequest {
  uint64_t offset = 0;
  size_t size = 0;
  void* dst = nullptr;
  const ReadPiece* pieces = nullptr;
  uint32_t n_pieces = 0;
};

// Copies `src` (the request's `size` bytes, in file order) to where the request wants them.
void ScatterInto(const ReadRequest& r, const uint8_t* src);

// A file read at explicit offsets. Thread-safety: ReadAt/ReadBatch may be called concurrently (implementations keep no
// cursor); the object must outlive all calls.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads exactly `size` bytes at `offset`; a read past the end or a short read is an error naming path and offset.
  virtual Status ReadAt(uint64_t offset, size_t size, void* dst) const = 0;
  // Reads every request; the default issues them one by one (a scattered one piece by piece). Stops at the first
  // error.
  virtual Status ReadBatch(std::span<const ReadRequest> requests) const;
  // As ReadBatch, calling done(i) on the calling thread as soon as request i has arrived (in any order), so that a
  // caller can use early arrivals while later ones are in flight; an implementation with a queue keeps it full across
  // the whole span. A failed request is not reported and does not stop the others; the first error is returned. The
  // default reads them one by one.
  virtual Status ReadBatchProgress(std::span<const ReadRequest> requests,
                                   const std::function<void(size_t)>& done) const;
  virtual uint64_t Size() const = 0;
  virtual const std::string& Path() const = 0;
  // The whole file as memory when it is mapped or in memory, else nullptr. Valid while the object lives.
  virtual const uint8_t* Data() const { return nullptr; }
};

// pread(2) on a file descriptor.
Result<std::unique_ptr<ReadableFile>> OpenPreadFile(const std::string& path);
// Whether the file system holding `fd` / `path` keeps its files in memory (tmpfs, ramfs): O_DIRECT is accepted there on
// recent kernels, but the data still lives in the page cache. False when it cannot tell.
bool OnMemoryFilesystem(int fd);
bool OnMemoryFilesystem(const std::string& path);
// pread(2) that leaves nothing of the file in the page cache: no readahead (POSIX_FADV_RANDOM), and the pages of each
// read dropped after it (POSIX_FADV_DONTNEED; clean pages of the same range cached by anyone else go too). For the
// metadata of files whose contents are read with O_DIRECT (a GGUF's directory before ReadFileDirect).
Result<std::unique_ptr<ReadableFile>> OpenUncachedPreadFile(const std::string& path);
// Read-only, private mmap(2) of the whole file: Data() is non-null.
Result<std::unique_ptr<ReadableFile>> OpenMmapFile(const std::string& path);
// Reads the whole file with O_DIRECT (never through the page cache; buffered when the filesystem refuses O_DIRECT,
// e.g. tmpfs) into anonymous memory advised for transparent huge pages: Data() is non-null. For weights that must stay
// resident: the pages cannot be dropped and re-read behind the process's back as mapped file pages can, and 2 MiB
// pages spare the TLB misses of scattered row reads.
Result<std::unique_ptr<ReadableFile>> ReadFileDirect(const std::string& path);
// A byte range of a file.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t size = 0;
};
// The whole `block`-byte blocks inside `r` (size 0 when there are none): what ReadFileDirect leaves out for a hole.
inline ByteRange InnerBlocks(ByteRange r, uint64_t block = 4096) {
  const uint64_t b = RoundUp(r.offset, block);
  const uint64_t e = (r.offset + r.size) / block * block;
  return e > b ? ByteRange{b, e - b} : ByteRange{b, 0};
}
// ReadFileDirect, except the whole 4 KiB blocks inside each of `holes` (e.g. a tensor the caller reads from the file
// on demand): never read into memory, never resident. Data() still spans the whole file, but those pages are
// inaccessible (PROT_NONE: a stray access faults instead of reading zeros); ReadAt reads bytes there from the file
// (pread). Holes must be sorted and disjoint.
Result<std::unique_ptr<ReadableFile>> ReadFileDirect(const std::string& path, std::span<const ByteRange> holes);
// Advises transparent huge pages (madvise MADV_HUGEPAGE) for the 2 MiB-aligned part of [p, p + bytes): for memory read
// at scattered places. Advice only: where THP is off or the kernel refuses, nothing changes.
void AdviseHugePages(void* p, size_t bytes);
// Reads the whole file into memory (Data() is non-null, no mapping kept).
Result<std::unique_ptr<ReadableFile>> ReadFileToMemory(const std::string& path);

// A file held in memory (tests, synthetic inputs). `path` is only used in messages.
class MemoryFile final : public ReadableFile {
 public:
  MemoryFile(std::string path, std::vector<uint8_t> bytes) : path_(std::move(path)), bytes_(std::move(bytes)) {}
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override;
  uint64_t Size() const override { return bytes_.size(); }
  const std::string& Path() const override { return path_; }
  const uint8_t* Data() const override { return bytes_.data(); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
};

// Wraps a file and injects faults into reads that touch [offset, offset + length): an EIO error, a short read (the
// read returns fewer bytes: reported as an error by ReadAt), or flipped bits in the returned data (silent corruption,
// to be caught by checksums). `count` limits how many reads are affected (-1: every one), so "fails once, then the
// retry succeeds" can be tested. Data() is always nullptr so that callers go through ReadAt.
// Thread-safety: as ReadableFile; the fault counters are atomic.
class FaultInjectingFile final : public ReadableFile {
 public:
  enum class Fault : uint8_t { kEio, kShortRead, kBitFlip };
  struct Rule {
    Fault fault = Fault::kEio;
    uint64_t offset = 0;
    uint64_t length = UINT64_MAX;
    int count = -1;
  };
  explicit FaultInjectingFile(std::shared_ptr<const ReadableFile> base) : base_(std::move(base)) {}
  ~FaultInjectingFile() override;
  void AddRule(const Rule& rule);
  // Every rule stops injecting: the file is healthy from now on (e.g. to check what a failure left behind). Safe
  // while reads are in flight.
  void ClearFaults();
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override;
  uint64_t Size() const override { return base_->Size(); }
  const std::string& Path() const override { return base_->Path(); }
  // Number of reads a fault was injected into so far.
  int64_t InjectedCount() const;

 private:
  struct State;
  std::shared_ptr<const ReadableFile> base_;
  std::vector<Rule> rules_;
  std::shared_ptr<State> state_;  // shared_ptr: State is defined in file.cc
};

// Writes a new file under a temporary name beside `path` ("<path>.tmp-<pid>") and renames it over `path` on Commit().
// Destroying an uncommitted writer removes the temporary file, so a failed run never leaves a partial output.
// Thread-safety: not thread-safe.
class AtomicFileWriter {
 public:
  // Fails if `path` exists and `overwrite` is false ("<path> exists; pass --force to overwrite").
  static Result<std::unique_ptr<AtomicFileWriter>> Create(const std::string& path, bool overwrite);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  Status Append(const void* data, size_t size);
  // Appends zero bytes until Offset() is a multiple of `alignment`.
  Status PadTo(uint64_t alignment);
  // Overwrites bytes already written (e.g. a header completed at the end).
  Status WriteAt(uint64_t offset, const void* data, size_t size);
  uint64_t Offset() const { return offset_; }
  const std::string& path() const { return path_; }
  // Flushes, fsyncs and renames the temporary file to the final path.
  Status Commit();

 private:
  AtomicFileWriter(std::string path, std::string tmp_path, int fd) : path_(std::move(path)), tmp_path_(std::move(tmp_path)), fd_(fd) {}
  Status FlushBuffer();
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  std::vector<uint8_t> buffer_;
  bool committed_ = false;
};

// Convenience: the whole file as bytes.
Result<std::vector<uint8_t>> ReadWholeFile(const std::string& path);
bool FileExists(const std::string& path);

// A small text file the kernel generates (sysfs, procfs, cgroupfs), read to its end: such files report a size of 0,
// so the bytes are read until EOF rather than sized by stat. Empty optional when the file cannot be opened or read;
// at most `max_bytes` are kept.
std::optional<std::string> ReadKernelTextFile(const std::string& path, size_t max_bytes = 1 << 20);
// Its first whitespace-separated word ("3", "Unified", "32768K"); empty when there is none or no file.
std::string ReadKernelWord(const std::string& path);
// A non-negative decimal of at most 20 digits, as such files hold them (a count, an interrupt number, a frequency).
bool IsDecimal(std::string_view s);

}  // namespace nflash
