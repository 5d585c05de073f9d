// Thread placement for the offloaded decode: the CPU plan's rule on made-up CPU sets, and pinning real threads (the
// caller, a pool worker, the I/O thread) for one evaluation and restoring them, checked through the kernel's view
// (pthread_getaffinity_np, sched_getcpu).
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>
#include <vector>

#include "runtime/core/cpu_affinity.h"
#include "runtime/core/file.h"
#include "runtime/core/thread_pool.h"
#include "runtime/sparse/io_worker.h"
#include "runtime/core/thread_placement.h"
#include "tests/test_util.h"

namespace nflash {
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
  EXPECT_EQ(*ParsePinThreads("on"), PinThreads::kOn);
  EXPECT_FALSE(ParsePinThreads("yes").ok());
  // The names the JSON reports are the ones the flag reads.
  EXPECT_STREQ(PinThreadsName(PinThreads::kAuto), "auto");
  EXPECT_STREQ(PinThreadsName(PinThreads::kOn), "on");
  EXPECT_STREQ(PinThreadsName(PinThreads::kOff), "off");
}

TEST(ThreadPlacementTest, PlanPutsComputeOnTheFastestCpus) {
  // A phone's CPUs: 0-3 little (capacity 325), 4-6 middle (870), 7 big (1024); its flash's interrupts on CPU 0.
  const std::vector<int> eight = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<uint64_t> phone = {325, 325, 325, 325, 870, 870, 870, 1024};
  const std::vector<uint64_t> on_cpu0 = {9000, 0, 0, 0, 0, 0, 0, 0};
  // auto pins on mixed CPUs even with CPUs to spare: the caller on the big core, the workers on the middle ones, the
  // I/O thread where the interrupts arrive.
  auto p = PlanThreadCpus(PinThreads::kAuto, 4, eight, on_cpu0, phone);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 7);
  EXPECT_EQ(p->workers, (std::vector<int>{4, 5, 6}));
  EXPECT_EQ(p->io, 0);
  // Interrupts unknown: the I/O thread on the fastest CPU left over (the last middle core).
  p = PlanThreadCpus(PinThreads::kAuto, 2, eight, {}, phone);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 7);
  EXPECT_EQ(p->workers, std::vector<int>{4});
  EXPECT_EQ(p->io, 6);
  // One compute thread: pinned to the big core too.
  p = PlanThreadCpus(PinThreads::kAuto, 1, eight, on_cpu0, phone);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 7);
  EXPECT_TRUE(p->workers.empty());
  EXPECT_EQ(p->io, 0);
  // Among the little cores only (a cpuset), nothing to choose: auto leaves them to the scheduler.
  const std::vector<int> little = {0, 1, 2, 3};
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kAuto, 2, little, on_cpu0, phone).has_value());
  // Interrupts on a middle core: within the middle cores the caller avoids it, and the I/O thread takes it when left.
  const std::vector<uint64_t> on_cpu4 = {0, 0, 0, 0, 700, 0, 0, 0};
  p = PlanThreadCpus(PinThreads::kAuto, 3, eight, on_cpu4, phone);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 7);
  EXPECT_EQ(p->workers, (std::vector<int>{5, 6}));
  EXPECT_EQ(p->io, 4);
  // Capacities within 10% of the largest are alike (AMD's preferred cores: 5.7 against 5.3 GHz): the rule without
  // capacities, so auto with a CPU to spare does not pin, and on keeps the interrupts' order.
  const std::vector<int> two = {0, 1};
  const std::vector<uint64_t> preferred = {5300000, 5700000};
  EXPECT_FALSE(PlanThreadCpus(PinThreads::kAuto, 1, two, {}, preferred).has_value());
  p = PlanThreadCpus(PinThreads::kAuto, 2, two, std::vector<uint64_t>{12, 9000}, preferred);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 0);
  EXPECT_EQ(p->io, 1);
  // 11% slower is another class: the faster CPU computes.
  const std::vector<uint64_t> hybrid = {5700000, 5070000};
  p = PlanThreadCpus(PinThreads::kAuto, 1, two, {}, hybrid);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 0);
  EXPECT_EQ(p->io, 1);
  // Capacities cover the listed CPUs only (a CPU beyond the vector counts as 0, i.e. the slowest).
  p = PlanThreadCpus(PinThreads::kOn, 1, std::vector<int>{1, 3}, {}, std::vector<uint64_t>{0, 500});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->caller, 1);
  EXPECT_EQ(p->io, 3);
}

TEST(ThreadPlacementTest, CpuCapacitiesReadsSysfsFiles) {
  testing::TempDir dir;
  auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(dir.File(rel)).parent_path());
    std::ofstream(dir.File(rel)) << text;
  };
  put("cpu0/cpu_capacity", "1024\n");
  put("cpu1/cpu_capacity", "446\n");
  put("cpu0/cpufreq/cpuinfo_max_freq", "3000000\n");
  put("cpu1/cpufreq/cpuinfo_max_freq", "1800000\n");
  put("cpu2/cpufreq/cpuinfo_max_freq", "2400000\n");
  EXPECT_EQ(CpuCapacities(std::vector<int>{0, 1}, dir.path()), (std::vector<uint64_t>{1024, 446}));
  // Only the listed CPUs: index = CPU number, 0 for the others.
  EXPECT_EQ(CpuCapacities(std::vector<int>{1}, dir.path()), (std::vector<uint64_t>{0, 446}));
  // cpu2 has no cpu_capacity: the maximum frequencies of all three instead (one source for every CPU).
  EXPECT_EQ(CpuCapacities(std::vector<int>{0, 1, 2}, dir.path()), (std::vector<uint64_t>{3000000, 1800000, 2400000}));
  // cpu3 has neither, cpu4 garbage, cpu5 a zero: nothing to tell them apart by.
  put("cpu4/cpu_capacity", "fast\n");
  put("cpu5/cpu_capacity", "0\n");
  EXPECT_TRUE(CpuCapacities(std::vector<int>{0, 3}, dir.path()).empty());
  EXPECT_TRUE(CpuCapacities(std::vector<int>{0, 4}, dir.path()).empty());
  EXPECT_TRUE(CpuCapacities(std::vector<int>{0, 5}, dir.path()).empty());
  // cpu6's value is 20 digits, beyond what a uint64_t holds: unreadable like garbage, not a crash.
  put("cpu6/cpu_capacity", "99999999999999999999\n");
  EXPECT_TRUE(CpuCapacities(std::vector<int>{0, 6}, dir.path()).empty());
  EXPECT_TRUE(CpuCapacities(std::vector<int>{}, dir.path()).empty());
  EXPECT_TRUE(CpuCapacities(std::vector<int>{-1}, dir.path()).empty());
  // This machine: what the kernel says, read here with plain streams (or nothing, when a CPU lacks both files).
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  const std::vector<uint64_t> got = CpuCapacities(allowed);
  bool every_cpu_has_capacity = true;
  for (int c : allowed) {
    std::ifstream f("/sys/devices/system/cpu/cpu" + std::to_string(c) + "/cpu_capacity");
    uint64_t v = 0;
    if (!(f >> v) || v == 0) every_cpu_has_capacity = false;
    if (every_cpu_has_capacity) {
      ASSERT_LT(static_cast<size_t>(c), got.size());
      EXPECT_EQ(got[static_cast<size_t>(c)], v) << "CPU " << c;
    }
  }
  if (!every_cpu_has_capacity) {
    std::cout << "this machine's CPUs lack cpu_capacity; CpuCapacities gave " << got.size() << " entries\n";
  }
}

TEST(ThreadPlacementTest, SetThreadCpusRejectsBadListsAndPinsARealThread) {
  const pthread_t self = pthread_self();
  EXPECT_FALSE(SetThreadCpus(self, std::vector<int>{}).ok());
  EXPECT_FALSE(SetThreadCpus(self, std::vector<int>{-1}).ok());
  const Status beyond = SetThreadCpus(self, std::vector<int>{CPU_SETSIZE});
  EXPECT_FALSE(beyond.ok());
  EXPECT_NE(beyond.message().find("CPU " + std::to_string(CPU_SETSIZE) + " outside [0, " + std::to_string(CPU_SETSIZE) +
                                  ")"),
            std::string::npos)
      << beyond.message();
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
  sparse::IoWorker io(&file);
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
    if (cpu >= 0) {  // if it took a chunk
      EXPECT_EQ(cpu, plan->workers[static_cast<size_t>(t - 1)]) << "worker " << t;
    }
  }
  placement.End();
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed);
  EXPECT_EQ(ThreadCpus(io.ThreadHandle()), before_io);
  for (pthread_t w : workers) EXPECT_EQ(ThreadCpus(w), allowed) << "workers inherit the creator's list";
  placement.End();  // a second End is harmless
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed);
}

// A placement that cannot be applied (the I/O thread's CPU does not exist) fails naming the CPU and leaves nothing
// pinned: the threads it had pinned before the failure get their lists back.
TEST(ThreadPlacementTest, BeginThatFailsUnpinsWhatItPinned) {
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  ASSERT_FALSE(allowed.empty());
  MemoryFile file("mem", std::vector<uint8_t>(4096, 1));
  sparse::IoWorker io(&file);
  const std::vector<int> before_io = ThreadCpus(io.ThreadHandle());
  ThreadCpuPlan plan;
  plan.caller = allowed.front();
  plan.io = CPU_SETSIZE - 1;  // beyond any CPU this machine has: the kernel refuses an empty set
  ASSERT_EQ(std::find(allowed.begin(), allowed.end(), plan.io), allowed.end());
  ThreadPlacement placement(plan, {}, io.ThreadHandle());
  const Status st = placement.Begin();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("CPU " + std::to_string(CPU_SETSIZE - 1)), std::string::npos) << st.message();
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed) << "the caller was pinned before the failure: restored";
  EXPECT_EQ(ThreadCpus(io.ThreadHandle()), before_io);
}

// Begin twice (a plan applied per evaluation, End forgotten once) still restores the lists from before the first:
// the second Begin ends the first placement before saving.
TEST(ThreadPlacementTest, BeginTwiceThenEndRestoresTheFirstLists) {
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  ASSERT_FALSE(allowed.empty());
  ThreadCpuPlan plan;
  plan.caller = allowed.back();
  ThreadPlacement placement(plan, {}, std::nullopt);
  ASSERT_TRUE(placement.Begin().ok());
  ASSERT_TRUE(placement.Begin().ok());
  EXPECT_EQ(ThreadCpus(pthread_self()), std::vector<int>{plan.caller});
  placement.End();
  EXPECT_EQ(ThreadCpus(pthread_self()), allowed);
}

}  // namespace
}  // namespace nflash
