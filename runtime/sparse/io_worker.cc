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
    requests_ = requests;
    chunk_ends_.assign(chunk_ends.begin(), chunk_ends.end());
    statuses_.assign(chunk_ends.size(), Status::Ok());
    done_ = 0;
    ++job_id_;
  }
  job_cv_.notify_one();
}

void IoWorker::Loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    job_cv_.wait(lock, [&] { return stop_ || job_id_ != seen; });
    if (stop_) return;
    seen = job_id_;
    size_t begin = 0;
    for (size_t i = 0; i < chunk_ends_.size(); ++i) {
      const std::span<const ReadRequest> chunk = requests_.subspan(begin, chunk_ends_[i] - begin);
      begin = chunk_ends_[i];
      lock.unlock();
      Status s = file_->ReadBatch(chunk);
      lock.lock();
      statuses_[i] = std::move(s);
      done_ = i + 1;
      done_cv_.notify_all();
    }
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

void IoWorker::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ >= chunk_ends_.size(); });
}

}  // namespace nflash::sparse
