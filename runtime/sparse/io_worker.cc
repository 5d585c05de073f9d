// The pipeline's I/O thread: chunked batched reads with per-chunk completion.
#include "runtime/sparse/io_worker.h"

#include <chrono>

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

void IoWorker::Start(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_.clear();
    statuses_.clear();
    read_ns_.clear();
    done_ = 0;
  }
  Append(requests, chunk_ends);
}

void IoWorker::Append(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_t begin = 0;
    for (size_t end : chunk_ends) {
      chunks_.push_back(requests.subspan(begin, end - begin));
      statuses_.push_back(Status::Ok());
      read_ns_.push_back(0);
      begin = end;
    }
  }
  job_cv_.notify_one();
}

void IoWorker::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Chunks run in the order they were added; Start resets the list only once every chunk is done (its contract),
    // so done_ always names the next chunk to read.
    job_cv_.wait(lock, [&] { return stop_ || done_ < chunks_.size(); });
    if (stop_) return;
    const size_t i = done_;
    const std::span<const ReadRequest> chunk = chunks_[i];
    lock.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    Status s = file_->ReadBatch(chunk);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    lock.lock();
    statuses_[i] = std::move(s);
    read_ns_[i] = static_cast<uint64_t>(ns);
    done_ = i + 1;
    done_cv_.notify_all();
  }
}

Status IoWorker::WaitChunk(size_t i) {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ > i; });
  wait_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  return statuses_[i];
}

uint64_t IoWorker::ChunkReadNs(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  return i < read_ns_.size() ? read_ns_[i] : 0;
}

void IoWorker::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ >= chunks_.size(); });
}

}  // namespace nflash::sparse
