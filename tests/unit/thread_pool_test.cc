// Tests of ThreadPool::ParallelFor: coverage of the range, grain, thread indices, reuse.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "runtime/core/thread_pool.h"

namespace nflash {
namespace {

TEST(ThreadPoolTest, CoversRangeExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.NumThreads(), threads);
    for (int64_t n : {1, 7, 64, 1000, 1001}) {
      for (int64_t grain : {1, 8, 32}) {
        std::vector<std::atomic<int>> hits(n);
        std::mutex mu;
        std::set<int64_t> starts;
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e, int t) {
          EXPECT_LT(b, e);
          EXPECT_TRUE(b % grain == 0) << "chunks start at multiples of the grain";
          for (int64_t i = b; i < e; ++i) hits[i]++;
          std::lock_guard<std::mutex> lock(mu);
          starts.insert(b);
          EXPECT_GE(t, 0);
          EXPECT_LT(t, threads);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
        // At most one chunk per thread, of ceil(chunks of grain / threads) grains each: the partition does not
        // depend on timing.
        const int64_t per = ((n + grain - 1) / grain + threads - 1) / threads * grain;
        EXPECT_EQ(static_cast<int64_t>(starts.size()), (n + per - 1) / per);
      }
    }
  }
}

TEST(ThreadPoolTest, RunsConcurrentlyAndIsReusable) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  for (int rep = 0; rep < 200; ++rep) {
    pool.ParallelFor(100, 1, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
  }
  EXPECT_EQ(sum.load(), 200 * 4950);
  pool.ParallelFor(0, 1, [&](int64_t, int64_t, int) { FAIL() << "empty range runs nothing"; });
}

// Chunks are claimed by whoever runs: a thread index may run several chunks, but never two at once (per-thread
// scratch indexed by it stays private), and many short jobs in a row with workers arriving late still cover every
// item exactly once.
TEST(ThreadPoolTest, ThreadIndexIsNeverUsedConcurrentlyAcrossManyJobs) {
  for (int threads : {2, 3, 4}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> busy(threads);
    std::atomic<int64_t> total{0};
    std::atomic<int> overlaps{0};
    for (int rep = 0; rep < 3000; ++rep) {
      const int64_t n = 1 + rep % 37;
      pool.ParallelFor(n, 1, [&](int64_t b, int64_t e, int t) {
        if (busy[t].fetch_add(1) != 0) overlaps++;
        for (int64_t i = b; i < e; ++i) total += i + 1;
        if (rep % 7 == 0) std::this_thread::yield();  // let workers fall behind
        busy[t].fetch_sub(1);
      });
    }
    int64_t expect = 0;
    for (int rep = 0; rep < 3000; ++rep) {
      const int64_t n = 1 + rep % 37;
      expect += n * (n + 1) / 2;
    }
    EXPECT_EQ(total.load(), expect) << threads;
    EXPECT_EQ(overlaps.load(), 0) << threads;
  }
}

// 0 (or less) threads means one per hardware thread, as std::thread counts them; the pool starts one fewer workers.
TEST(ThreadPoolTest, NoThreadCountMeansEveryHardwareThread) {
  const unsigned hw = std::thread::hardware_concurrency();
  const int expected = hw == 0 ? 1 : static_cast<int>(hw);
  for (int n : {0, -3}) {
    ThreadPool pool(n);
    EXPECT_EQ(pool.NumThreads(), expected) << n;
    EXPECT_EQ(pool.WorkerHandles().size(), static_cast<size_t>(expected - 1)) << n;
  }
}

}  // namespace
}  // namespace nflash
