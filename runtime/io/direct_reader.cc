// DirectReader: O_DIRECT + io_uring reads with registered buffers, bounce buffers for unaligned requests, short-read
// resubmission and one EIO retry; the synchronous pread path; request coalescing.
#include "runtime/io/direct_reader.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "runtime/core/log.h"
#include "runtime/core/round.h"

namespace nflash::io {
namespace {

uint64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

uint64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

AlignedBuffer AllocAligned(size_t alignment, size_t bytes) {
  const size_t rounded = RoundUp(bytes, alignment);
  return AlignedBuffer(static_cast<uint8_t*>(std::aligned_alloc(alignment, std::max(rounded, alignment))));
}

std::string ReadError(const std::string& path, uint64_t offset, size_t size, const std::string& why) {
  return path + ": read of " + std::to_string(size) + " bytes at offset " + std::to_string(offset) + " failed: " + why;
}

Status CheckRange(const std::string& path, uint64_t file_size, uint64_t offset, size_t size) {
  if (offset > file_size || size > file_size - offset) {
    return Status::IOError(ReadError(path, offset, size, "past the end of the file (" + std::to_string(file_size) +
                                                             " bytes)"));
  }
  return Status::Ok();
}

}  // namespace

// One request in flight: the range actually read (aligned when direct), where it lands, and what the caller wants.
struct DirectReader::Op {
  size_t request = 0;          // index in the batch
  uint64_t read_offset = 0;    // file offset of buf[0]
  size_t read_length = 0;      // bytes asked of the kernel in total
  size_t needed = 0;           // bytes that must arrive (read_length may run past EOF for the last block)
  size_t done = 0;
  uint8_t* buf = nullptr;      // caller memory (aligned path) or bounce.get()
  AlignedBuffer bounce;
  size_t copy_from = 0;        // offset in bounce of the caller's first byte
  int fixed_index = -1;        // registered buffer index, or -1
  const ReadRequest* scatter = nullptr;  // an aligned scattered request read with readv straight into its pieces
  std::vector<iovec> iov;                // its pieces from the resume point on
  int eio_retries = 0;
  uint64_t first_submit_ns = 0;
};

size_t QueryDirectAlignment(int fd) {
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) return 0;
  if (!(stx.stx_mask & STATX_DIOALIGN)) return 0;
  return std::max<size_t>(stx.stx_dio_mem_align, stx.stx_dio_offset_align);
}

Result<std::unique_ptr<AlignedArena>> AlignedArena::Create(size_t slot_bytes, size_t num_slots, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument("arena alignment must be a power of two, got " + std::to_string(alignment));
  }
  if (slot_bytes == 0 || num_slots == 0) return Status::InvalidArgument("arena with zero slots or zero-byte slots");
  const size_t slot = RoundUp(slot_bytes, alignment);
  if (num_slots > SIZE_MAX / slot) return Status::ResourceExhausted("arena size overflows");
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(alignment, slot * num_slots));
  if (p == nullptr) {
    return Status::ResourceExhausted("cannot allocate an arena of " + std::to_string(slot * num_slots) + " bytes");
  }
  // Slots are read at random: transparent huge pages (where enabled for madvise) spare a TLB miss per bundle, which
  // in a VM is a two-level page walk (SYNTHETIC 7B at 1392M, 8 interleaved pairs on 2 vCPUs: P50 70.6 ms against
  // 83.5 ms, and no run in the 3-4x slower state that 3 of 8 runs without it fell into; docs/results.md).
  AdviseHugePages(p, slot * num_slots);
  return std::unique_ptr<AlignedArena>(new AlignedArena(p, slot, num_slots));
}

AlignedArena::~AlignedArena() { std::free(data_); }

Result<std::unique_ptr<DirectReader>> DirectReader::Open(const std::string& path, const DirectReaderOptions& options) {
  int fd = -1;
  if (!options.buffered) {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0 && errno == EINVAL) {
      if (!options.allow_buffered_fallback) {
        return Status::Unsupported("the filesystem of " + path + " refuses O_DIRECT (tmpfs?)");
      }
      NF_LOG(Warning) << path << ": the filesystem refuses O_DIRECT; reads go through the page cache";
    } else if (fd < 0) {
      return Status::FromErrno("cannot open " + path, errno);
    }
  }
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("cannot open " + path, errno);
  return FromFd(fd, path, options);
}

Result<std::unique_ptr<DirectReader>> DirectReader::FromFd(int fd, const std::string& name,
                                                           const DirectReaderOptions& options) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno("cannot stat " + name, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(name + " is not a regular file");
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    ::close(fd);
    return Status::InvalidArgument("queue depth must be in [1, 4096], got " + std::to_string(options.queue_depth));
  }
  // One registered buffer may not exceed 1 GiB (kernel limit), so larger arenas are registered in pieces.
  constexpr size_t kMaxRegisteredBuffer = size_t{1} << 30;
  if (options.registered_buffer_bytes == 0 || options.registered_buffer_bytes % 4096 != 0 ||
      options.registered_buffer_bytes > kMaxRegisteredBuffer) {
    ::close(fd);
    return Status::InvalidArgument("registered buffer size must be a multiple of 4096 in (0, 1 GiB], got " +
                                   std::to_string(options.registered_buffer_bytes));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  bool direct = flags >= 0 && (flags & O_DIRECT) != 0;
  if (direct && OnMemoryFilesystem(fd)) {
    if (!options.allow_buffered_fallback) {
      ::close(fd);
      return Status::Unsupported(name + " is on tmpfs/ramfs: O_DIRECT would still read from the page cache");
    }
    NF_LOG(Warning) << name << ": on tmpfs/ramfs, O_DIRECT reads are served from the page cache";
    direct = false;
  }
  size_t alignment = 1;
  if (direct) {
    alignment = QueryDirectAlignment(fd);
    if (alignment == 0) alignment = kDefaultDirectAlignment;
  }
  std::unique_ptr<DirectReader> reader(
      new DirectReader(fd, name, static_cast<uint64_t>(st.st_size), direct, alignment, options));
  NF_RETURN_IF_ERROR(reader->InitRing());
  return reader;
}

DirectReader::DirectReader(int fd, std::string path, uint64_t size, bool direct, size_t alignment,
                           const DirectReaderOptions& opts)
    : fd_(fd), path_(std::move(path)), size_(size), direct_(direct), alignment_(alignment),
      queue_depth_(opts.queue_depth), registered_buffer_bytes_(opts.registered_buffer_bytes),
      hook_(opts.completion_hook), latency_ns_(kLatencySampleCapacity) {}

Status DirectReader::InitRing() {
  ring_ = std::make_unique<io_uring>();
  const int rc = io_uring_queue_init(queue_depth_, ring_.get(), 0);
  if (rc < 0) {
    ring_.reset();
    return Status::FromErrno("io_uring_queue_init(" + std::to_string(queue_depth_) + ") for " + path_, -rc);
  }
  return Status::Ok();
}

DirectReader::~DirectReader() {
  if (ring_) io_uring_queue_exit(ring_.get());
  if (fd_ >= 0) ::close(fd_);
}

bool DirectReader::IsAligned(uint64_t offset, size_t size, const void* dst) const {
  if (!direct_) return true;
  const uint64_t mask = alignment_ - 1;
  return (offset & mask) == 0 && (size & mask) == 0 && (reinterpret_cast<uintptr_t>(dst) & mask) == 0;
}

bool DirectReader::IsAligned(const ReadRequest& r) const {
  if (r.n_pieces == 0) return IsAligned(r.offset, r.size, r.dst);
  if (!IsAligned(r.offset, 0, nullptr)) return false;
  for (uint32_t i = 0; i < r.n_pieces; ++i) {
    if (!IsAligned(0, r.pieces[i].size, r.pieces[i].dst)) return false;
  }
  return true;
}

Result<std::unique_ptr<AlignedArena>> DirectReader::CreateArena(size_t slot_bytes, size_t num_slots) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_ != nullptr) return Status::InvalidArgument(path_ + ": an arena is already registered");
  NF_ASSIGN_OR_RETURN(std::unique_ptr<AlignedArena> arena,
                      AlignedArena::Create(slot_bytes, num_slots, std::max(alignment_, kDefaultDirectAlignment)));
  std::vector<iovec> iovs;
  for (size_t off = 0; off < arena->size(); off += registered_buffer_bytes_) {
    iovs.push_back({arena->data() + off, std::min(registered_buffer_bytes_, arena->size() - off)});
  }
  const int rc = io_uring_register_buffers(ring_.get(), iovs.data(), static_cast<unsigned>(iovs.size()));
  if (rc < 0) {
    // Usually RLIMIT_MEMLOCK on older kernels: reads into the arena still work, only without fixed buffers.
    NF_LOG(Warning) << path_ << ": cannot register the I/O arena with io_uring (" << std::strerror(-rc)
                    << "); reading without fixed buffers";
  } else {
    registered_ = arena.get();
  }
  return arena;
}

Status DirectReader::ReadAt(uint64_t offset, size_t size, void* dst) const {
  ReadRequest r{offset, size, dst};
  return ReadBatch(std::span<const ReadRequest>(&r, 1));
}

Status DirectReader::CheckRequest(const ReadRequest& r) const {
  NF_RETURN_IF_ERROR(CheckRange(path_, size_, r.offset, r.size));
  if (r.n_pieces == 0) return Status::Ok();
  if (r.n_pieces > kMaxScatterPieces) {
    return Status::InvalidArgument(path_ + ": scattered read at offset " + std::to_string(r.offset) + " has " +
                                   std::to_string(r.n_pieces) + " pieces, at most " +
                                   std::to_string(kMaxScatterPieces));
  }
  size_t sum = 0;
  for (uint32_t i = 0; i < r.n_pieces; ++i) sum += r.pieces[i].size;
  if (sum != r.size) {
    return Status::InvalidArgument(path_ + ": scattered read at offset " + std::to_string(r.offset) + ": pieces sum to " +
                                   std::to_string(sum) + " bytes, expected " + std::to_string(r.size));
  }
  return Status::Ok();
}

Status DirectReader::ReadBatch(std::span<const ReadRequest> requests) const {
  for (const ReadRequest& r : requests) NF_RETURN_IF_ERROR(CheckRequest(r));
  std::lock_guard<std::mutex> lock(mu_);
  return RunBatchLocked(requests);
}

Status DirectReader::ReadBatchProgress(std::span<const ReadRequest> requests,
                                       const std::function<void(size_t)>& done) const {
  for (const ReadRequest& r : requests) NF_RETURN_IF_ERROR(CheckRequest(r));
  std::lock_guard<std::mutex> lock(mu_);
  return RunBatchLocked(requests, &done);
}

Status DirectReader::RunBatchLocked(std::span<const ReadRequest> requests,
                                    const std::function<void(size_t)>* done) const {
  io_uring* ring = ring_.get();
  std::vector<Op> ops(queue_depth_);
  std::vector<int> free_slots;
  for (int i = static_cast<int>(queue_depth_) - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<int> resubmit;  // slots whose remainder (or retry) must be submitted again
  size_t next = 0;
  size_t in_flight = 0;
  Status first_error;

  auto prep = [&](int slot) {
    Op& op = ops[slot];
    io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: at most queue_depth_ ops are in flight
    // O_DIRECT resumes must stay aligned: restart a short read at the block boundary below what arrived.
    const size_t resume = ResumePoint(op.done);
    op.done = resume;
    const unsigned len = static_cast<unsigned>(op.read_length - resume);
    if (op.scatter != nullptr) {
      op.iov.clear();
      size_t skip = resume;
      for (uint32_t i = 0; i < op.scatter->n_pieces; ++i) {
        const ReadPiece& p = op.scatter->pieces[i];
        if (skip >= p.size) {
          skip -= p.size;
          continue;
        }
        op.iov.push_back(iovec{static_cast<uint8_t*>(p.dst) + skip, p.size - skip});
        skip = 0;
      }
      io_uring_prep_readv(sqe, fd_, op.iov.data(), static_cast<unsigned>(op.iov.size()), op.read_offset + resume);
    } else if (op.fixed_index >= 0) {
      io_uring_prep_read_fixed(sqe, fd_, op.buf + resume, len, op.read_offset + resume, op.fixed_index);
    } else {
      io_uring_prep_read(sqe, fd_, op.buf + resume, len, op.read_offset + resume);
    }
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
    if (op.first_submit_ns == 0) op.first_submit_ns = NowNs();
  };

  auto start = [&](size_t index, int slot) {
    const ReadRequest& r = requests[index];
    Op& op = ops[slot];
    std::vector<iovec> iov = std::move(op.iov);  // keeps its capacity across requests
    op = Op{};
    op.iov = std::move(iov);
    op.request = index;
    if (r.n_pieces > 0 && IsAligned(r)) {
      op.read_offset = r.offset;
      op.read_length = op.needed = r.size;
      op.scatter = &r;
      ++counters_.scattered_requests;
    } else if (r.n_pieces == 0 && IsAligned(r.offset, r.size, r.dst)) {
      op.read_offset = r.offset;
      op.read_length = op.needed = r.size;
      op.buf = static_cast<uint8_t*>(r.dst);
      if (registered_ != nullptr && registered_->Contains(r.dst, r.size)) {
        const size_t rel = op.buf - registered_->data();
        if (rel / registered_buffer_bytes_ == (rel + r.size - 1) / registered_buffer_bytes_) {
          op.fixed_index = static_cast<int>(rel / registered_buffer_bytes_);
          ++counters_.fixed_reads;
        }
      }
    } else {
      const uint64_t begin = r.offset & ~uint64_t{alignment_ - 1};
      const uint64_t end = (r.offset + r.size + alignment_ - 1) & ~uint64_t{alignment_ - 1};
      op.read_offset = begin;
      op.read_length = end - begin;
      op.needed = r.offset + r.size - begin;
      op.copy_from = r.offset - begin;
      op.bounce = AllocAligned(alignment_, op.read_length);
      op.buf = op.bounce.get();
      ++counters_.bounce_reads;
    }
  };

  while (next < requests.size() || in_flight > 0 || !resubmit.empty()) {
    for (int slot : resubmit) {
      prep(slot);
    }
    resubmit.clear();
    // Plain batches stop at the first error; a progress batch goes on (its caller learns which requests arrived).
    while ((first_error.ok() || done != nullptr) && next < requests.size() && !free_slots.empty()) {
      if (requests[next].size == 0) {
        if (done != nullptr) (*done)(next);
        ++next;
        continue;
      }
      const int slot = free_slots.back();
      free_slots.pop_back();
      start(next++, slot);
      prep(slot);
      ++in_flight;
    }
    // Submits everything prepared, including entries a previous partial or refused submit left in the queue.
    if (io_uring_sq_ready(ring) > 0) {
      const uint64_t cpu0 = ThreadCpuNs();
      int rc;
      do {
        rc = io_uring_submit(ring);
      } while (rc == -EINTR);
      counters_.submit_cpu_ns += ThreadCpuNs() - cpu0;
      ++counters_.submit_calls;
      // EAGAIN/EBUSY: the kernel is short of resources or the completion queue is full; the entries stay queued and
      // are submitted again after the completions below are reaped. Anything else means the ring we set up is
      // broken while reads may be in flight into memory we cannot safely release: an internal invariant, so abort.
      if (rc < 0 && rc != -EAGAIN && rc != -EBUSY) {
        NF_LOG(Error) << path_ << ": io_uring_submit failed: " << std::strerror(-rc);
        std::abort();
      }
    }
    if (in_flight == 0) break;

    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(ring, &cqe);
    while (rc == -EINTR) rc = io_uring_wait_cqe(ring, &cqe);
    if (rc < 0) {  // as for submit: reads are in flight into our buffers, so returning would be unsafe
      NF_LOG(Error) << path_ << ": io_uring_wait_cqe failed: " << std::strerror(-rc);
      std::abort();
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
      Op& op = ops[slot];
      const ReadRequest& r = requests[op.request];
      const size_t asked = op.read_length - op.done;
      int res = cqe->res;
      if (hook_) res = hook_(op.read_offset + op.done, asked, res);
      auto fail = [&](Status s) {
        if (first_error.ok()) first_error = std::move(s);
        op.bounce.reset();
        free_slots.push_back(slot);
        --in_flight;
      };
      if (res == -EAGAIN || res == -EINTR) {
        resubmit.push_back(slot);
      } else if (res == -EIO && op.eio_retries == 0 && (first_error.ok() || done != nullptr)) {
        ++op.eio_retries;
        ++counters_.retries;
        NF_LOG(Warning) << ReadError(path_, r.offset, r.size, "EIO") << "; retrying once";
        resubmit.push_back(slot);
      } else if (res < 0) {
        fail(Status::IOError(ReadError(path_, r.offset, r.size, std::strerror(-res)) +
                             (op.eio_retries > 0 ? " (after 1 retry)" : "")));
      } else if (ResumePoint(op.done + static_cast<size_t>(res)) == op.done &&
                 op.done + static_cast<size_t>(res) < op.needed) {
        // No data, or (O_DIRECT) less than the block the read started at (op.done is a resume point): the file ends
        // there (it shrank under the reader), and resubmitting from the same offset would get the same answer for ever.
        fail(Status::IOError(ReadError(path_, r.offset, r.size,
                                       "unexpected end of file at offset " +
                                           std::to_string(op.read_offset + op.done + static_cast<size_t>(res)))));
      } else {
        op.done += static_cast<size_t>(res);
        if (op.done < op.needed && (first_error.ok() || done != nullptr)) {
          ++counters_.short_reads;
          resubmit.push_back(slot);
        } else {
          if (op.done >= op.needed) {
            if (op.bounce) ScatterInto(r, op.bounce.get() + op.copy_from);
            ++counters_.requests;
            counters_.bytes += r.size;
            const uint64_t lat = NowNs() - op.first_submit_ns;
            latency_ns_[latency_next_] = static_cast<uint32_t>(std::min<uint64_t>(lat, UINT32_MAX));
            latency_next_ = (latency_next_ + 1) % latency_ns_.size();
            ++latency_count_;
            if (done != nullptr) (*done)(op.request);
          }
          op.bounce.reset();
          free_slots.push_back(slot);
          --in_flight;
        }
      }
    }
    io_uring_cq_advance(ring, seen);
    // After an error, a plain batch drains its in-flight reads (their buffers must stay valid) but starts nothing new,
    // not even a retry or the rest of a short read; a progress batch goes on with both (as it does with new requests).
    if (!first_error.ok() && done == nullptr && !resubmit.empty()) {
      for (int slot : resubmit) {
        ops[slot].bounce.reset();
        free_slots.push_back(slot);
        --in_flight;
      }
      resubmit.clear();
    }
  }
  return first_error;
}

Status DirectReader::PreadAt(uint64_t offset, size_t size, void* dst) const {
  NF_RETURN_IF_ERROR(CheckRange(path_, size_, offset, size));
  uint64_t read_offset = offset;
  size_t read_length = size;
  size_t needed = size;
  uint8_t* buf = static_cast<uint8_t*>(dst);
  AlignedBuffer bounce;
  if (!IsAligned(offset, size, dst)) {
    read_offset = offset & ~uint64_t{alignment_ - 1};
    read_length = ((offset + size + alignment_ - 1) & ~uint64_t{alignment_ - 1}) - read_offset;
    needed = offset + size - read_offset;
    bounce = AllocAligned(alignment_, read_length);
    buf = bounce.get();
  }
  size_t done = 0;
  int eio_retries = 0;
  while (done < needed) {
    ssize_t n = ::pread(fd_, buf + done, read_length - done, static_cast<off_t>(read_offset + done));
    int err = n < 0 ? errno : 0;
    if (hook_) {
      const int res = hook_(read_offset + done, read_length - done, n < 0 ? -err : static_cast<int>(n));
      n = res < 0 ? -1 : res;
      err = res < 0 ? -res : 0;
    }
    if (n < 0 && err == EINTR) continue;
    if (n < 0 && err == EIO && eio_retries++ == 0) continue;
    if (n < 0) {
      return Status::IOError(ReadError(path_, offset, size, std::strerror(err)) +
                             (eio_retries > 1 ? " (after 1 retry)" : ""));
    }
    const size_t before = done;
    done += static_cast<size_t>(n);
    if (done < needed) done = ResumePoint(done);
    if (done == before) {  // no data, or (O_DIRECT) less than a block where a block was asked: the file ends there
      return Status::IOError(ReadError(path_, offset, size,
                                       "unexpected end of file at offset " +
                                           std::to_string(read_offset + before + static_cast<size_t>(n))));
    }
  }
  if (bounce) std::memcpy(dst, bounce.get() + (offset - read_offset), size);
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.pread_requests;
  counters_.pread_bytes += size;
  counters_.retries += static_cast<uint64_t>(eio_retries);
  return Status::Ok();
}

IoCounters DirectReader::Counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::vector<uint32_t> DirectReader::LatencySampleNs() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = static_cast<size_t>(std::min<uint64_t>(latency_count_, latency_ns_.size()));
  std::vector<uint32_t> out;
  out.reserve(n);
  const size_t first = (latency_next_ + latency_ns_.size() - n) % latency_ns_.size();
  for (size_t i = 0; i < n; ++i) out.push_back(latency_ns_[(first + i) % latency_ns_.size()]);
  return out;
}

void DirectReader::ResetCounters() {
  std::lock_guard<std::mutex> lock(mu_);
  counters_ = IoCounters{};
  latency_next_ = 0;
  latency_count_ = 0;
}

std::vector<ReadRequest> CoalesceRequests(std::span<const ReadRequest> requests, size_t max_bytes) {
  std::vector<ReadRequest> out;
  for (const ReadRequest& r : requests) {
    if (!out.empty()) {
      ReadRequest& last = out.back();
      const bool file_adjacent = last.offset + last.size == r.offset;
      const bool memory_adjacent = static_cast<uint8_t*>(last.dst) + last.size == r.dst;
      const bool plain = last.n_pieces == 0 && r.n_pieces == 0;
      if (plain && file_adjacent && memory_adjacent && last.size + r.size <= max_bytes) {
        last.size += r.size;
        continue;
      }
    }
    out.push_back(r);
  }
  return out;
}

void RequestBuilder::Reset(size_t max_bytes, bool scatter, void* gap_sink, size_t gap_bytes) {
  max_bytes_ = max_bytes;
  scatter_ = scatter;
  gap_sink_ = scatter ? gap_sink : nullptr;
  gap_bytes_ = gap_sink_ != nullptr ? gap_bytes : 0;
  last_mergeable_ = false;
  requests_.clear();
  pieces_.clear();
  first_piece_.clear();
}

size_t RequestBuilder::Add(uint64_t offset, size_t size, void* dst, bool mergeable) {
  if (mergeable && last_mergeable_) {
    ReadRequest& last = requests_.back();
    ReadPiece& piece = pieces_.back();
    const size_t n_pieces = pieces_.size() - first_piece_.back();
    if (last.offset + last.size == offset && last.size + size <= max_bytes_) {
      if (static_cast<uint8_t*>(piece.dst) + piece.size == dst) {
        piece.size += size;
        last.size += size;
        return requests_.size() - 1;
      }
      if (scatter_ && n_pieces < kMaxScatterPieces) {
        pieces_.push_back(ReadPiece{dst, size});
        last.size += size;
        return requests_.size() - 1;
      }
    }
    const uint64_t end = last.offset + last.size;
    if (offset > end && offset - end <= gap_bytes_ && last.size + (offset - end) + size <= max_bytes_ &&
        n_pieces + 2 <= kMaxScatterPieces) {
      const size_t gap = static_cast<size_t>(offset - end);
      pieces_.push_back(ReadPiece{gap_sink_, gap});
      pieces_.push_back(ReadPiece{dst, size});
      last.size += gap + size;
      return requests_.size() - 1;
    }
  }
  first_piece_.push_back(static_cast<uint32_t>(pieces_.size()));
  pieces_.push_back(ReadPiece{dst, size});
  requests_.push_back(ReadRequest{offset, size, dst});
  last_mergeable_ = mergeable;
  return requests_.size() - 1;
}

const std::vector<ReadRequest>& RequestBuilder::Finish() {
  for (size_t i = 0; i < requests_.size(); ++i) {
    const size_t first = first_piece_[i];
    const size_t end = i + 1 < requests_.size() ? first_piece_[i + 1] : pieces_.size();
    ReadRequest& r = requests_[i];
    if (end - first == 1) {
      r.dst = pieces_[first].dst;
      r.pieces = nullptr;
      r.n_pieces = 0;
    } else {
      r.dst = nullptr;
      r.pieces = pieces_.data() + first;
      r.n_pieces = static_cast<uint32_t>(end - first);
    }
  }
  return requests_;
}

}  // namespace nflash::io
