// A fixed-size thread pool for data-parallel loops. Passed explicitly to whatever computes; never a singleton.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace nflash {

// Thread-safety: ParallelFor may be called from one thread at a time (it is not re-entrant); the calling thread takes
// part in the work, so a pool of N threads starts N-1 workers.
// Decode calls ParallelFor a few hundred times per token with microseconds of work each, so waking workers through a
// condition variable alone (tens of microseconds per wake-up) would cost more than the work: workers and the caller
// spin briefly on atomics first and only then block.
// Chunks are claimed, not assigned: whoever is running takes the next chunk, and the caller never waits for a worker
// that has not started. On a machine with as many cores as pool threads and another busy thread (the offloaded
// runtime's I/O thread), a worker is often descheduled for a whole time slice; with fixed assignment every parallel
// loop then waited for it (measured: 2 compute threads were no faster than 1 on the 2-core host).
class ThreadPool {
 public:
  // `num_threads` <= 0 means all hardware threads.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int NumThreads() const { return num_threads_; }
  // The workers' threads (NumThreads() - 1 of them; worker i runs thread_index i + 1), e.g. to set their CPU affinity.
  std::vector<std::thread::native_handle_type> WorkerHandles() {
    std::vector<std::thread::native_handle_type> h;
    for (auto& t : workers_) h.push_back(t.native_handle());
    return h;
  }
  // Calls fn(begin, end, thread_index) over a partition of [0, n) into at most NumThreads() contiguous chunks whose
  // sizes are multiples of `grain` (except the last); the partition depends only on n, grain and NumThreads(). Each
  // chunk runs once, on whichever thread claims it: one thread may run several chunks (one after the other, with its
  // own thread_index < NumThreads(), so per-thread scratch indexed by it is safe; per-thread results must be
  // accumulated, not assigned). Returns when every chunk is done.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn);
  static int HardwareThreads();

 private:
  void WorkerLoop(int index);
  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;                 // guards sleeping workers and stop_ for the condition variable
  std::condition_variable work_cv_;
  int sleepers_ = 0;              // workers blocked on work_cv_ (guarded by mu_)
  bool stop_ = false;             // guarded by mu_; also published through generation_
  void RunChunks(int index);
  // The current job: written by the caller while entry_ is closed, read by a worker after it entered (acquire).
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_chunk_ = 0;
  int64_t job_chunks_ = 0;
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<uint64_t> generation_{0};  // bumped per job: wakes the workers
  // kClosed | number of workers inside the current job. A worker enters only while the job is open; the caller
  // closes it once every chunk is claimed and then waits for the workers inside, never for the others.
  static constexpr uint32_t kClosed = 1u << 31;
  std::atomic<uint32_t> entry_{kClosed};
};

}  // namespace nflash
