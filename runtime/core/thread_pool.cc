// ThreadPool: a job is published by bumping a generation counter; workers spin on it for a short while, then block.
#include "runtime/core/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace nflash {
namespace {

// Spin iterations before blocking: about 10-50 microseconds, longer than the gap between two kernel calls of one
// decode step, far shorter than the gap between tokens of an interactive session.
constexpr int kSpinIterations = 1 << 11;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

int ThreadPool::HardwareThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads <= 0 ? HardwareThreads() : num_threads) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < kSpinIterations; ++spin) {
      CpuRelax();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      ++sleepers_;
      work_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      --sleepers_;
      gen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    seen = gen;
    // Enter the open job, if any: a worker late for a job the caller already closed skips it (and may enter the
    // next one early, which is harmless: it reads the job only after entering).
    uint32_t e = entry_.load(std::memory_order_acquire);
    bool entered = false;
    while ((e & kClosed) == 0) {
      if (entry_.compare_exchange_weak(e, e + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        entered = true;
        break;
      }
    }
    if (!entered) continue;
    RunChunks(index);
    entry_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::RunChunks(int index) {
  for (;;) {
    const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (c >= job_chunks_) return;
    const int64_t begin = c * job_chunk_;
    (*job_)(begin, std::min(job_n_, begin + job_chunk_), index);
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks_of_grain = (n + grain - 1) / grain;
  if (num_threads_ == 1 || chunks_of_grain == 1) {
    fn(0, n, 0);
    return;
  }
  const int64_t per_thread = (chunks_of_grain + num_threads_ - 1) / num_threads_;
  // entry_ is closed and no worker is inside (the previous call waited for them): nobody reads these now.
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = per_thread * grain;
  job_chunks_ = (n + job_chunk_ - 1) / job_chunk_;
  next_chunk_.store(0, std::memory_order_relaxed);
  entry_.store(0, std::memory_order_release);  // open
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
    if (sleepers_ > 0) work_cv_.notify_all();
  }
  RunChunks(0);
  // Every chunk is claimed: close, then wait only for the workers that entered (they are finishing claimed chunks).
  entry_.fetch_or(kClosed, std::memory_order_acq_rel);
  for (int spin = 0; (entry_.load(std::memory_order_acquire) & ~kClosed) != 0; ++spin) {
    if (spin < kSpinIterations) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
  job_ = nullptr;
}

}  // namespace nflash
