// Flash reads for the sparse runtime: a file opened with O_DIRECT and read through one io_uring (liburing) with
// registered buffers, batched submission and completion harvesting, plus a synchronous pread path (the "llmflash"
// baseline), request coalescing and a completion hook that tests use to inject faults.
//
// Alignment: O_DIRECT needs the file offset, the length and the memory address aligned to the device's logical block
// size. The reader asks statx(STATX_DIOALIGN) and otherwise assumes kDefaultDirectAlignment. A request that is not
// aligned is served by reading the enclosing aligned range into a bounce buffer and copying the wanted bytes out (a
// cost, not an error); aligned requests land directly in their destination (the cache slots of an AlignedArena).
//
// When the filesystem refuses O_DIRECT (tmpfs, some overlay setups), the file is opened without it, a warning is
// logged and direct_io() is false: reads then go through the page cache, and callers must say so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/status.h"

struct io_uring;  // liburing, kept out of this header

namespace nflash::io {

// 4096 bytes: the logical block size of NVMe/UFS/eMMC flash and of the page cache, so an O_DIRECT read aligned to it
// is accepted by every device we target even when statx cannot tell us the real (possibly 512-byte) requirement.
inline constexpr size_t kDefaultDirectAlignment = 4096;
// 32: enough outstanding reads to saturate a phone's UFS or a desktop NVMe for 4-64 KiB requests (PowerInfer-2 uses
// similar depths); the profiler measures the curve to pick the real value.
inline constexpr unsigned kDefaultQueueDepth = 32;
// The latency sample keeps the last 65536 completions: enough for a stable P99 over one profiler cell, 256 KiB.
inline constexpr size_t kLatencySampleCapacity = 65536;
// A scattered request's pieces become one readv: at most IOV_MAX (1024 on Linux) iovecs.
inline constexpr uint32_t kMaxScatterPieces = 1024;

// Memory aligned for O_DIRECT, cut into `num_slots` slots of `slot_bytes` (rounded up to the alignment). Obtained
// from DirectReader::CreateArena, which registers it with the ring as a fixed buffer so reads into it skip the
// per-request page pinning. Thread-safety: the object is immutable after creation; the bytes are the caller's.
class AlignedArena {
 public:
  static Result<std::unique_ptr<AlignedArena>> Create(size_t slot_bytes, size_t num_slots, size_t alignment);
  ~AlignedArena();
  AlignedArena(const AlignedArena&) = delete;
  AlignedArena& operator=(const AlignedArena&) = delete;

  uint8_t* Slot(size_t index) const { return data_ + index * slot_bytes_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t num_slots() const { return num_slots_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return slot_bytes_ * num_slots_; }
  bool Contains(const void* p, size_t n) const {
    auto* b = static_cast<const uint8_t*>(p);
    return b >= data_ && b + n <= data_ + size();
  }

 private:
  AlignedArena(uint8_t* data, size_t slot_bytes, size_t num_slots)
      : data_(data), slot_bytes_(slot_bytes), num_slots_(num_slots) {}
  uint8_t* data_;
  size_t slot_bytes_;
  size_t num_slots_;
};

// What the reader did so far. All counts cover the io_uring path except pread_* (the synchronous path).
struct IoCounters {
  uint64_t requests = 0;        // caller requests completed (after coalescing by the caller, before splitting)
  uint64_t bytes = 0;           // bytes delivered to callers
  uint64_t submit_calls = 0;    // io_uring_submit calls
  uint64_t submit_cpu_ns = 0;   // thread CPU time spent inside io_uring_submit
  uint64_t short_reads = 0;     // completions with fewer bytes than asked, resubmitted for the remainder
  uint64_t retries = 0;         // EIO completions retried
  uint64_t bounce_reads = 0;    // unaligned requests read through a bounce buffer
  uint64_t scattered_requests = 0;  // aligned scattered requests read with one readv into their pieces
  uint64_t pread_requests = 0;  // synchronous reads
  uint64_t pread_bytes = 0;
  uint64_t fixed_reads = 0;     // requests read into a registered (fixed) buffer
};

// Called on every io_uring completion, and after every pread(2) of PreadAt, before the reader looks at it: returns
// the result to use instead of `res` (bytes read, or -errno). Tests return -EIO or a smaller count to exercise retries
// and short reads; it runs on the thread that called ReadBatch or PreadAt.
using CompletionHook = std::function<int(uint64_t offset, size_t size, int res)>;

struct DirectReaderOptions {
  unsigned queue_depth = kDefaultQueueDepth;
  // false: fail instead of falling back to the page cache when O_DIRECT is refused.
  bool allow_buffered_fallback = true;
  // true: never ask for O_DIRECT (a page-cache baseline).
  bool buffered = false;
  CompletionHook completion_hook;  // tests only
  // The arena is registered with io_uring in buffers of at most this many bytes (a multiple of 4096): the kernel
  // refuses buffers over 1 GiB. Smaller in tests, so that an arena of a few pages has several.
  size_t registered_buffer_bytes = size_t{1} << 30;
};

// Reads one file at explicit offsets. ReadAt/ReadBatch go through the io_uring; PreadAt is the synchronous path.
// Thread-safety: one I/O thread is meant to own a reader (the ring is single-issuer); calls from several threads are
// nevertheless correct because a mutex serializes every ring operation (ReadableFile's contract). PreadAt takes no
// lock and may run concurrently with anything. Counters() is a snapshot taken under the lock.
class DirectReader final : public ReadableFile {
 public:
  static Result<std::unique_ptr<DirectReader>> Open(const std::string& path, const DirectReaderOptions& options = {});
  // Takes ownership of an open file descriptor (e.g. of a file already unlinked); `name` is used in messages. The
  // descriptor's O_DIRECT flag decides direct_io().
  static Result<std::unique_ptr<DirectReader>> FromFd(int fd, const std::string& name,
                                                      const DirectReaderOptions& options = {});
  ~DirectReader() override;

  // ReadableFile. ReadBatch keeps up to queue_depth reads in flight, submitting each round with one io_uring_submit;
  // a batch may hold any number of requests. Stops at the first failed request (the others may or may not be done).
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override;
  Status ReadBatch(std::span<const ReadRequest> requests) const override;
  // The whole span in one queue (kept at queue_depth), done(i) as each request completes.
  Status ReadBatchProgress(std::span<const ReadRequest> requests,
                           const std::function<void(size_t)>& done) const override;
  uint64_t Size() const override { return size_; }
  const std::string& Path() const override { return path_; }

  // Synchronous read with pread(2) on the same (O_DIRECT) descriptor; same alignment handling as ReadBatch.
  Status PreadAt(uint64_t offset, size_t size, void* dst) const;

  // An arena aligned for this file, registered with the ring (fixed buffers). At most one arena is registered at a
  // time; a second call fails. The arena must outlive its use by this reader.
  Result<std::unique_ptr<AlignedArena>> CreateArena(size_t slot_bytes, size_t num_slots);

  bool direct_io() const { return direct_; }
  // Whether CreateArena's arena is registered with the ring (reads into it use fixed buffers).
  bool arena_registered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return registered_ != nullptr;
  }
  size_t alignment() const { return alignment_; }
  unsigned queue_depth() const { return queue_depth_; }
  IoCounters Counters() const;
  // Latencies (nanoseconds, submission to completion) of the most recent completions, oldest first.
  std::vector<uint32_t> LatencySampleNs() const;
  void ResetCounters();

 private:
  struct Op;
  DirectReader(int fd, std::string path, uint64_t size, bool direct, size_t alignment, const DirectReaderOptions& opts);
  Status InitRing();
  // Where a read that has `done` bytes resumes: with O_DIRECT, at the block boundary below them.
  size_t ResumePoint(size_t done) const { return direct_ ? done & ~(alignment_ - 1) : done; }
  bool IsAligned(uint64_t offset, size_t size, const void* dst) const;
  bool IsAligned(const ReadRequest& r) const;  // offset, size and every destination (each piece of a scattered one)
  Status CheckRequest(const ReadRequest& r) const;
  Status RunBatchLocked(std::span<const ReadRequest> requests,
                        const std::function<void(size_t)>* done = nullptr) const;

  int fd_;
  std::string path_;
  uint64_t size_;
  bool direct_;
  size_t alignment_;
  unsigned queue_depth_;
  size_t registered_buffer_bytes_;
  CompletionHook hook_;
  mutable std::mutex mu_;  // guards the ring, the counters and the latency sample
  std::unique_ptr<io_uring> ring_;
  const AlignedArena* registered_ = nullptr;
  mutable IoCounters counters_;
  mutable std::vector<uint32_t> latency_ns_;  // circular, kLatencySampleCapacity
  mutable size_t latency_next_ = 0;
  mutable uint64_t latency_count_ = 0;
};

// Merges requests whose file ranges are adjacent and whose destinations are adjacent in memory (so one read fills
// both) into one, in the order given, never exceeding `max_bytes` per merged request. Requests that cannot merge pass
// through unchanged. Sort by offset first to merge more.
std::vector<ReadRequest> CoalesceRequests(std::span<const ReadRequest> requests, size_t max_bytes);

// Builds the read requests for ranges added in file order. A range that starts where the previous request ends joins
// it (up to `max_bytes` per request): it extends the request's last piece when its destination follows that piece in
// memory, else it becomes a new piece of a scattered read (if `scatter`; else a request of its own). Requests with
// one piece come out plain (n_pieces 0). Thread-safety: not thread-safe.
class RequestBuilder {
 public:
  // `gap_sink` (with `scatter`): a range that starts at most `gap_bytes` after the previous one ends still merges with
  // it, the bytes between read into gap_sink (a piece of its own: memory nobody reads, which every request may share).
  void Reset(size_t max_bytes, bool scatter, void* gap_sink = nullptr, size_t gap_bytes = 0);
  // `mergeable` false keeps the range a request of its own, e.g. a page read that must end where the page does.
  // Returns the index of the request the range went to.
  size_t Add(uint64_t offset, size_t size, void* dst, bool mergeable = true);
  // The requests, pointing into this builder's pieces: valid until the next Reset.
  const std::vector<ReadRequest>& Finish();

 private:
  size_t max_bytes_ = 0;
  bool scatter_ = true;
  bool last_mergeable_ = false;
  void* gap_sink_ = nullptr;
  size_t gap_bytes_ = 0;
  std::vector<ReadRequest> requests_;
  std::vector<ReadPiece> pieces_;
  std::vector<uint32_t> first_piece_;  // per request: its first piece in pieces_
};

// The I/O alignment statx reports for O_DIRECT on `fd` (max of memory and offset alignment), or 0 when unknown.
size_t QueryDirectAlignment(int fd);

}  // namespace nflash::io
