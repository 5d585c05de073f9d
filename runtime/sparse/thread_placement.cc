// PlanThreadCpus and ThreadPlacement (see thread_placement.h).
#include "runtime/sparse/thread_placement.h"

#include <algorithm>

#include "runtime/core/cpu_affinity.h"

namespace nflash::sparse {

Result<PinThreads> ParsePinThreads(const std::string& name) {
  if (name == "auto") return PinThreads::kAuto;
  if (name == "on") return PinThreads::kOn;
  if (name == "off") return PinThreads::kOff;
  return Status::InvalidArgument("--pin-threads " + name + ": expected auto, on or off");
}

std::optional<ThreadCpuPlan> PlanThreadCpus(PinThreads policy, int compute_threads, std::span<const int> allowed,
                                            std::span<const uint64_t> disk_interrupts) {
  const int cpus = static_cast<int>(allowed.size());
  if (policy == PinThreads::kOff || compute_threads < 1 || cpus < compute_threads) return std::nullopt;
  if (policy == PinThreads::kAuto && (compute_threads < 2 || cpus > compute_threads)) return std::nullopt;
  auto interrupts = [&](int cpu) {
    return cpu >= 0 && static_cast<size_t>(cpu) < disk_interrupts.size() ? disk_interrupts[static_cast<size_t>(cpu)]
                                                                         : uint64_t{0};
  };
  std::vector<int> order(allowed.begin(), allowed.end());
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return interrupts(a) != interrupts(b) ? interrupts(a) < interrupts(b) : a < b;
  });
  ThreadCpuPlan plan;
  plan.caller = order[0];
  for (int i = 1; i < compute_threads; ++i) plan.workers.push_back(order[static_cast<size_t>(i)]);
  plan.io = cpus > compute_threads ? order.back() : order[static_cast<size_t>(compute_threads - 1)];
  return plan;
}

ThreadPlacement::ThreadPlacement(ThreadCpuPlan plan, std::vector<pthread_t> workers, pthread_t io)
    : plan_(std::move(plan)), workers_(std::move(workers)), io_(io) {}

Status ThreadPlacement::Pin(pthread_t thread, int cpu) {
  std::vector<int> before = ThreadCpus(thread);
  if (before.empty()) return Status::Internal("cannot read a thread's CPU affinity");
  const int one[] = {cpu};
  NF_RETURN_IF_ERROR(SetThreadCpus(thread, one));
  saved_.push_back(Saved{thread, std::move(before)});
  return Status::Ok();
}

Status ThreadPlacement::Begin() {
  End();
  Status st = Pin(pthread_self(), plan_.caller);
  for (size_t i = 0; st.ok() && i < workers_.size() && i < plan_.workers.size(); ++i) {
    st = Pin(workers_[i], plan_.workers[i]);
  }
  if (st.ok()) st = Pin(io_, plan_.io);
  if (!st.ok()) End();
  return st;
}

void ThreadPlacement::End() {
  // Newest first: the caller's own list comes back last, after the threads it placed.
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) (void)SetThreadCpus(it->thread, it->cpus);
  saved_.clear();
}

}  // namespace nflash::sparse
