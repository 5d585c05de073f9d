// The pipeline's I/O thread: one stream of reads per Start/Append call with per-chunk completion.
#include "runtime/sparse/io_worker.h"

#include <algorithm>

#include "runtime/core/stats.h"

namespace nflash::sparse {

IoWorker::IoWorker(const ReadableFile* file) : file_(file), thread_([this] { Loop(); }) {}

IoWorker::~IoWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  job_cv_.notify_all();
  thread_.join();
}

size_t IoWorker::Start(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends, const char* label) {
  {
    // A chunk is reported done as its last read lands, a moment before the worker finishes its segment's
    // bookkeeping: wait for that, so the worker never counts the old segment against the new job.
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return next_segment_ >= segments_.size(); });
    segments_.clear();
    next_segment_ = 0;
    chunk_end_.clear();
    chunk_done_.clear();
    statuses_.clear();
    read_ns_.clear();
  }
  return Append(requests, chunk_ends, label);
}

size_t IoWorker::Append(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends,
                        const char* label) {
  size_t first = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = chunk_end_.size();
    segments_.push_back(Segment{requests, chunk_end_.size(), chunk_ends.size(), label});
    for (size_t end : chunk_ends) {
      chunk_end_.push_back(end);
      chunk_done_.push_back(0);
      statuses_.push_back(Status::Ok());
      read_ns_.push_back(0);
    }
  }
  job_cv_.notify_one();
  return first;
}

void IoWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Segments run in the order they were added; Start resets the list only once every chunk is done (its
    // contract), so next_segment_ always names the next one to read.
    job_cv_.wait(lock, [&] { return stop_ || next_segment_ < segments_.size(); });
    if (stop_) return;
    const Segment seg = segments_[next_segment_];
    // The segment's chunk ends (relative to its requests), copied so that Append may grow the shared vectors.
    ends_.assign(chunk_end_.begin() + static_cast<std::ptrdiff_t>(seg.first_chunk),
                 chunk_end_.begin() + static_cast<std::ptrdiff_t>(seg.first_chunk + seg.n_chunks));
    lock.unlock();
    remaining_.resize(seg.n_chunks);
    size_t begin = 0;
    for (size_t c = 0; c < seg.n_chunks; ++c) {
      remaining_[c] = ends_[c] - begin;
      begin = ends_[c];
    }
    const uint64_t t0 = SteadyNowNs();
    uint64_t last_done = t0;  // when the last chunk so far was released to the caller
    auto finish_chunk = [&](size_t c) {
      last_done = SteadyNowNs();
      const uint64_t t = last_done - t0;
      std::lock_guard<std::mutex> g(mu_);
      chunk_done_[seg.first_chunk + c] = 1;
      read_ns_[seg.first_chunk + c] = t;
      done_cv_.notify_all();
    };
    for (size_t c = 0; c < seg.n_chunks; ++c) {
      if (remaining_[c] == 0) finish_chunk(c);
    }
    // The whole segment as one stream: the reader keeps its queue full across chunk boundaries, and a chunk is
    // released to the compute thread as soon as its last request lands.
    const Status s = file_->ReadBatchProgress(seg.requests, [&](size_t i) {
      const size_t c = static_cast<size_t>(std::upper_bound(ends_.begin(), ends_.end(), i) - ends_.begin());
      if (c < seg.n_chunks && --remaining_[c] == 0) finish_chunk(c);
    });
    // The stream's end: its last arrival (what the caller waited for), not this thread's return here, which a
    // preemption may delay past the caller's next steps.
    const uint64_t t_end = s.ok() ? last_done : SteadyNowNs();
    lock.lock();
    busy_ns_ += t_end - t0;
    if (trace_ != nullptr) {
      trace_->Add(TraceSpan{seg.label, TraceLane::kIo, t0, t_end, -1, static_cast<int64_t>(seg.requests.size())});
    }
    // A failed read is not reported (the stream goes on with the others): its chunk carries the error, and the caller
    // verifies that chunk's units and re-reads the ones whose bytes are wrong (its counted, single retry).
    const uint64_t t = t_end - t0;
    for (size_t c = 0; c < seg.n_chunks; ++c) {
      if (!chunk_done_[seg.first_chunk + c]) {
        chunk_done_[seg.first_chunk + c] = 1;
        statuses_[seg.first_chunk + c] = s.ok() ? Status::Internal("I/O worker: a read was never reported") : s;
        read_ns_[seg.first_chunk + c] = t;
      }
    }
    ++next_segment_;
    done_cv_.notify_all();
  }
}

Status IoWorker::WaitChunk(size_t i) {
  const uint64_t t0 = SteadyNowNs();
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [&] { return i < chunk_done_.size() && chunk_done_[i]; };
  EventTrace* const trace = done() ? nullptr : trace_;  // a span only when the caller blocks
  if (idle_step_) {
    while (!done()) {
      lock.unlock();
      const bool more = idle_step_();
      lock.lock();
      if (!more) break;
    }
  }
  done_cv_.wait(lock, done);
  const uint64_t t1 = SteadyNowNs();
  wait_ns_ += t1 - t0;
  if (trace != nullptr) trace->Add(TraceSpan{"wait", TraceLane::kCompute, t0, t1, -1, static_cast<int64_t>(i)});
  return statuses_[i];
}

uint64_t IoWorker::busy_ns() {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_ns_;
}

void IoWorker::SetTrace(EventTrace* trace) {
  std::lock_guard<std::mutex> lock(mu_);
  trace_ = trace;
}

uint64_t IoWorker::ChunkReadNs(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  return i < read_ns_.size() ? read_ns_[i] : 0;
}

void IoWorker::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return next_segment_ >= segments_.size(); });
}

}  // namespace nflash::sparse
