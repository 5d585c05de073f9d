// Thread placement for the offloaded decode: the CPU plan's rule on made-up CPU sets, and pinning real threads (the
// caller, a pool worker, the I/O thread) for one evaluation and restoring them, checked through the kernel's view
// (pthread_getaffinity_np, sched_getcpu).
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <thread>
#include <vector>

#include "runtime/core/cpu_affinity.h"
#include "runtime/core/file.h"
#include "runtime/core/thread_pool.h"
#include "runtime/sparse/io_worker.h"
#include "runtime/sparse/thread_placement.h"

namespace nflash::sparse {
namespace {

TEST(ThreadPlacementTest, PlanFollowsTheRule) {
  const std::vector<int> two = {0, 1};
  // auto on 2 CPUs with 2 compute threads: caller 0, worker 1, the I/O thread beside the worker.
  auto p = PlanThreadCpus(PinThreads::kAuto, 2, two);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 0);
  EXPECT_EQ(p->workers, std::vector<int>{1});
  EXPECT_EQ(p->io, 1);
  // auto leaves the scheduler alone with a CPU to spare, with one compute thread, or with too few CPUs.
  const std::vector<int> four = {2, 3, 5, 7};
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kAuto, 2, four).has_value());
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kAuto, 1, std::vector<int>{4}).has_value());
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kAuto, 3, two).has_value());
  // on: the allowed CPUs in order, the I/O thread on the last one left over.
  p = PlanThreadCpus(PinThreads::kOn, 2, four);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 2);
  EXPECT_EQ(p->workers, std::vector<int>{3});
  EXPECT_EQ(p->io, 7);
  p = PlanThreadCpus(PinThreads::kAuto, 4, four);  // every CPU computes: beside the last worker
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 2);
  EXPECT_EQ(p->workers, (std::vector<int>{3, 5, 7}));
  EXPECT_EQ(p->io, 7);
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kOn, 5, four).has_value()) << "a CPU per compute thread or nothing";
  // The disk's interrupts: the caller where fewest arrive, the I/O thread where most do.
  const std::vector<uint64_t> on_cpu0 = {9000, 12};
  p = PlanThreadCpus(PinThreads::kAuto, 2, two, on_cpu0);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 1);
  EXPECT_EQ(p->workers, std::vector<int>{0});
  EXPECT_EQ(p->io, 0);
  const std::vector<uint64_t> on_cpu1 = {12, 9000};
  p = PlanThreadCpus(PinThreads::kAuto, 2, two, on_cpu1);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 0);
  EXPECT_EQ(p->io, 1);
  // CPUs 2, 3, 5, 7 with interrupts on 3 (counts beyond the list's end are 0): 2 threads compute on 2 and 5, the I/O
  // thread goes to 3.
  const std::vector<uint64_t> on_cpu3 = {0, 0, 0, 500};
  p = PlanThreadCpus(PinThreads::kOn, 2, four, on_cpu3);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 2);
  EXPECT_EQ(p->workers, std::vector<int>{5});
  EXPECT_EQ(p->io, 3);
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kOff, 2, two).has_value());
  EXPECT_EQ(*ParsePinThreads("auto"), PinThreads::kAuto);
  EXPECT_EQ(*ParsePinThreads("off"), PinThreads::kOff);
  EXPECT_FALSE(ParsePinThreads("yes").ok());
}

TEST(ThreadPlacementTest, SetThreadCpusRejectsBadListsAndPinsARealThread) {
  const pthread_t self = pthread_self();
  EXPECT_FALSE(SetThreadCpus(self, std::vector<int>{}).ok());
  EXPECT_FALSE(SetThreadCpus(self, std::vector<int>{-1}).ok());
  EXPECT_FALSE(SetThreadCpus(self, std::vector<int>{CPU_SETSIZE}).ok());
  const std::vector<int> allowed = ThreadCpus(self);
  ASSERT_FALSE(allowed.empty());
  const int last = allowed.back();
  std::atomic<int> ran_on{-2};
  std::atomic<bool> pinned{false};
  std::thread t([&] {
    while (!pinned.load()) std::this_thread::yield();
    std::this_thread::yield();  // the kernel moves a thread off a CPU it may no longer use before it runs again
    ran_on.store(sched_getcpu());
  });
  const int one[] = {last};
  ASSERT_TRUE(SetThreadCpus(t.native_handle(), one).ok());
  EXPECT_EQ(ThreadCpus(t.native_handle()), std::vector<int>{last});
  pinned.store(true);
  t.join();
  EXPECT_EQ(ran_on.load(), last);
}

// One evaluation's placement on this machine's CPUs (2 compute threads when there are 2 CPUs or more): the caller, the
// pool's worker and the I/O thread each on their planned CPU during it, every CPU list as before after it.
TEST(ThreadPlacementTest, BeginPinsEveryThreadAndEndRestoresThem) {
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  ASSERT_FALSE(allowed.empty());
  const int threads = allowed.size() >= 2 ? 2 : 1;
  ThreadPool pool(threads);
  MemoryFile file("mem", std::vector<uint8_t>(4096, 1));
  IoWorker io(&file);
  std::optional<ThreadCpuPlan> plan = PlanThreadCpus(PinThreads::kOn, threads, allowed);
  ASSERT_TRUE(plan.has_value());
  const std::vector<pthread_t> workers = pool.WorkerHandles();
  ASSERT_EQ(workers.size(), static_cast<size_t>(threads - 1));
  const std::vector<int> before_io = ThreadCpus(io.ThreadHandle());
  ThreadPlacement placement(*plan, workers, io.ThreadHandle());
  ASSERT_TRUE(placement.Begin().ok());
  EXPECT_EQ(ThreadCpus(pthread_self()), std::vector<int>{plan->caller});
  EXPECT_EQ(ThreadCpus(io.ThreadHandle()), std::vector<int>{plan->io});
  for (size_t i = 0; i < workers.size(); ++i) EXPECT_EQ(ThreadCpus(workers[i]), std::vector<int>{plan->workers[i]});
  // The pool's chunks run where their thread is pinned (thread_index 0 is the caller).
  std::vector<std::atomic<int>> cpu_of_thread(static_cast<size_t>(threads));
  for (auto& c : cpu_of_thread) c.store(-1);
  std::this_thread::yield();
  pool.ParallelFor(1 << 12, 1, [&](int64_t, int64_t, int t) {
    cpu_of_thread[static_cast<size_t>(t)].store(sched_getcpu());
  });
  EXPECT_EQ(cpu_of_thread[0].load(), plan->caller);
  for (int t = 1; t < threads; ++t) {
    const int cpu = cpu_of_thread[static_cast<size_t>(t)].load();
    if (cpu >= 0) EXPECT_EQ(cpu, plan->workers[static_cast<size_t>(t - 1)]) << "worker " << t;  // if it took a chunk
  }
  placement.End();
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed);
  EXPECT_EQ(ThreadCpus(io.ThreadHandle()), before_io);
  for (pthread_t w : workers) EXPECT_EQ(ThreadCpus(w), allowed) << "workers inherit the creator's list";
  placement.End();  // a second End is harmless
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed);
}

}  // namespace
}  // namespace nflash::sparse
