// Where the decode's threads run when the compute threads take every CPU or the CPUs differ in speed (docs/runtime.md,
// "Thread placement").
//
// The offloaded runtime has three kinds of threads: the one calling InferenceContext::Eval (it runs every serial step:
// the predictor's choice, the cache lookups, submitting reads, the lookahead, and takes part in every parallel loop),
// the pool's workers, and the I/O thread. With as many compute threads as CPUs, the scheduler places the I/O thread
// wherever it wakes it, often on the caller's CPU, preempting the serial steps everyone else waits for. Pinned, the
// caller has a CPU of its own and the I/O thread shares the last worker's, whose loop chunks the caller takes over
// while it is preempted (ThreadPool claims chunks, it does not assign them).
#pragma once

#include <pthread.h>

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/status.h"

namespace nflash {

enum class PinThreads : uint8_t {
  kAuto,  // pin when the compute threads take every allowed CPU (and there are at least 2), or when the CPUs differ in
          // speed (big and little cores) and the compute threads fit on them
  kOn,    // pin whenever every compute thread can have a CPU of its own
  kOff,   // leave every thread to the scheduler
};
Result<PinThreads> ParsePinThreads(const std::string& name);
// "auto", "on", "off": the name ParsePinThreads reads.
const char* PinThreadsName(PinThreads policy);

// One CPU per thread: the caller, the pool's workers (thread_index 1, 2, ...), the I/O thread.
struct ThreadCpuPlan {
  int caller = -1;
  std::vector<int> workers;
  int io = -1;
};

// CPUs whose capacities (CpuCapacities) differ by less than this share of the largest count as alike: AMD's preferred
// cores differ by ~5% in cpuinfo_max_freq and are not worth a placement; a phone's little cores have 20-40% of a big
// one's capacity, its middle cores 50-90%.
inline constexpr double kAlikeCapacityShare = 0.1;

// The plan for `compute_threads` threads (caller + workers) and an I/O thread on the CPUs the process may use
// (`allowed`). The CPUs are taken fastest first (`capacity`, per CPU number, e.g. CpuCapacities; CPUs within
// kAlikeCapacityShare of each other count as alike; empty or missing: all alike), then in order of the flash disk's
// interrupts on them (`disk_interrupts`, per CPU number, e.g. DiskInterruptsPerCpu; fewest first, ties and CPUs it
// does not cover in ascending order): the caller on the first (it runs every serial step, so the fastest core), worker
// i on the i-th, the I/O thread on the CPU left over with the most interrupts (the fastest of those), else beside the
// last worker. So the compute threads run on the big cores, the I/O thread, which the completions wake, where they
// arrive, and the caller away from them (on the development VM, with its disk's interrupts on CPU 1: caller on CPU 0
// +6.6% over the reverse, 6 ABBA pairs).
// Empty: no pinning (policy off; fewer CPUs than compute threads; auto on CPUs alike with a CPU to spare or fewer than
// 2 compute threads).
std::optional<ThreadCpuPlan> PlanThreadCpus(PinThreads policy, int compute_threads, std::span<const int> allowed,
                                            std::span<const uint64_t> disk_interrupts = {},
                                            std::span<const uint64_t> capacity = {});

// Applies a plan around one Eval (or a whole run) and puts every thread back where it was allowed to run before.
// Thread-safety: Begin and End are called by the caller thread only, in pairs.
class ThreadPlacement {
 public:
  // `io`: the I/O thread, or nullopt when there is none (the in-memory engine; plan.io is then not used).
  ThreadPlacement(ThreadCpuPlan plan, std::vector<pthread_t> workers, std::optional<pthread_t> io);
  // Pins the calling thread, the workers and the I/O thread, saving their CPU lists first. On failure, restores what
  // it pinned and returns the error.
  Status Begin();
  // Restores the saved CPU lists (no-op without a successful Begin).
  void End();
  const ThreadCpuPlan& plan() const { return plan_; }

 private:
  struct Saved {
    pthread_t thread;
    std::vector<int> cpus;
  };
  Status Pin(pthread_t thread, int cpu);
  ThreadCpuPlan plan_;
  std::vector<pthread_t> workers_;
  std::optional<pthread_t> io_;
  std::vector<Saved> saved_;
};

}  // namespace nflash
