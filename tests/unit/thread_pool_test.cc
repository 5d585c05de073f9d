// Tests of ThreadPool::ParallelFor: coverage of the range, grain, thread indices, reuse.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>

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
        std::set<int> indices;
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e, int t) {
          EXPECT_LT(b, e);
          EXPECT_TRUE(b % grain == 0) << "chunks start at multiples of the grain";
          for (int64_t i = b; i < e; ++i) hits[i]++;
          std::lock_guard<std::mutex> lock(mu);
          EXPECT_TRUE(indices.insert(t).second) << "one chunk per thread index";
          EXPECT_LT(t, threads);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
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

}  // namespace
}  // namespace nflash
