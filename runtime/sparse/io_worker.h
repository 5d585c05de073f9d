// The I/O thread of the neuron-cluster pipeline: reads a list of requests on its own thread as one stream (the
// reader keeps its queue full across chunk boundaries) and lets the compute thread wait for each chunk separately, so
// compute on chunk i (and on cache hits) overlaps the reads of chunks i+1, i+2, ...
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/status.h"
#include "runtime/sparse/event_trace.h"

namespace nflash::sparse {

// Thread-safety: Start, WaitChunk and Drain are called by one thread (the compute thread that owns the job); the
// worker thread only reads the file. The request memory and destinations must stay valid until Drain returns or the
// last chunk was waited for.
class IoWorker {
 public:
  explicit IoWorker(const ReadableFile* file);
  ~IoWorker();
  IoWorker(const IoWorker&) = delete;
  IoWorker& operator=(const IoWorker&) = delete;
  // The I/O thread, e.g. to set its CPU affinity.
  std::thread::native_handle_type ThreadHandle() { return thread_.native_handle(); }

  // Starts reading requests[0, chunk_ends[0]), [chunk_ends[0], chunk_ends[1]), ... as one ReadBatchProgress stream;
  // chunk i is done when its last request has arrived (chunks may complete out of order). Returns at once. The
  // previous job must be fully waited for (Drain). Returns 0 (the first chunk's index).
  // `label` names the stream in the event trace (a string literal).
  size_t Start(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends, const char* label = "reads");
  // Adds chunks to the current job (numbered after its existing ones), e.g. reads that depend on data an earlier
  // chunk brought (two-phase loading: up+down parts after the gate page). `chunk_ends` index into `requests`, which
  // must stay valid like Start's. Not after Drain. Returns the index of its first chunk.
  size_t Append(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends,
                const char* label = "reads");
  // Blocks until chunk `i` is read; its status. With idle work set, the caller first runs it, one step at a time,
  // for as long as the chunk is not done and the work has steps left, then blocks.
  Status WaitChunk(size_t i);
  // Work for the waiting caller instead of sleeping (e.g. warming the CPU caches with the weights computed next):
  // each call does one short step (microseconds: the chunk's arrival is noticed only between steps) and returns
  // whether more steps are left. Empty: WaitChunk only blocks. Set by the caller's thread between waits.
  void SetIdleWork(std::function<bool()> step) { idle_step_ = std::move(step); }
  // Blocks until every chunk of the current job is done (used before reusing buffers after an error).
  void Drain();
  // Nanoseconds the caller spent blocked in WaitChunk/Drain since construction.
  uint64_t wait_ns() const { return wait_ns_; }
  // Nanoseconds the I/O thread had a stream in progress (reads submitted and not all arrived) since construction:
  // the streams run one after the other, so this is the time the file had reads in flight from this worker.
  uint64_t busy_ns();
  // Spans go to `trace` from now on (nullptr: none): each stream on the I/O lane ("reads", or the label given to
  // Start/Append), each WaitChunk that blocked on the compute lane ("wait"). The trace must outlive its use.
  void SetTrace(EventTrace* trace);
  // Nanoseconds from the start of chunk `i`'s stream (its Start/Append call's reads) to its last arrival; call after
  // WaitChunk(i).
  uint64_t ChunkReadNs(size_t i);

 private:
  void Loop();
  const ReadableFile* file_;
  std::mutex mu_;
  std::condition_variable job_cv_, done_cv_;
  // One Start or Append call: its requests are read as one stream.
  struct Segment {
    std::span<const ReadRequest> requests;
    size_t first_chunk = 0, n_chunks = 0;
    const char* label = "reads";
  };
  // Guarded by mu_.
  bool stop_ = false;
  std::vector<Segment> segments_;
  size_t next_segment_ = 0;         // segments fully read
  std::vector<size_t> chunk_end_;   // per chunk: end index into its segment's requests
  std::vector<uint8_t> chunk_done_; // per chunk: every request arrived (or the segment failed)
  std::vector<Status> statuses_;    // per chunk
  std::vector<uint64_t> read_ns_;   // per chunk: from the start of its segment's stream to its last arrival
  uint64_t busy_ns_ = 0;
  EventTrace* trace_ = nullptr;
  // Worker thread only.
  std::vector<size_t> ends_, remaining_;
  uint64_t wait_ns_ = 0;          // caller thread only
  std::function<bool()> idle_step_;  // caller thread only
  std::thread thread_;
};

}  // namespace nflash::sparse
