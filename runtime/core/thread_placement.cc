// PlanThreadCpus and ThreadPlacement (see thread_placement.h).
#include "runtime/core/thread_placement.h"

#include <algorithm>

#include "runtime/core/cpu_affinity.h"

namespace nflash {

Result<PinThreads> ParsePinThreads(const std::string& name) {
  if (name == "auto") return PinThreads::kAuto;
  if (name == "on") return PinThreads::kOn;
  if (name == "off") return PinThreads::kOff;
  return Status::InvalidArgument("--pin-threads " + name + ": expected auto, on or off");
}

const char* PinThreadsName(PinThreads policy) {
  switch (policy) {
    case PinThreads::kOn:
      return "on";
    case PinThreads::kOff:
      return "off";
    case PinThreads::kAuto:
      break;
  }
  return "auto";
}

std::optional<ThreadCpuPlan> PlanThreadCpus(PinThreads policy, int compute_threads, std::span<const int> allowed,
                                            std::span<const uint64_t> disk_interrupts,
                                            std::span<const uint64_t> capacity) {
  const int cpus = static_cast<int>(allowed.size());
  if (policy == PinThreads::kOff || compute_threads < 1 || cpus < compute_threads) return std::nullopt;
  auto count = [](std::span<const uint64_t> per_cpu, int cpu) {
    return cpu >= 0 && static_cast<size_t>(cpu) < per_cpu.size() ? per_cpu[static_cast<size_t>(cpu)] : uint64_t{0};
  };
  // Capacity classes: each CPU's capacity in steps of kAlikeCapacityShare of the largest (counted down from it, so the
  // largest and everything within one step of it share class 0); all 0 when the capacities are unknown.
  uint64_t top = 0;
  for (int c : allowed) top = std::max(top, count(capacity, c));
  auto slower = [&](int cpu) -> int64_t {
    if (top == 0) return 0;
    const double share = static_cast<double>(top - count(capacity, cpu)) / static_cast<double>(top);
    return static_cast<int64_t>(share / kAlikeCapacityShare);
  };
  const bool mixed = std::any_of(allowed.begin(), allowed.end(), [&](int c) { return slower(c) > 0; });
  if (policy == PinThreads::kAuto && !mixed && (compute_threads < 2 || cpus > compute_threads)) return std::nullopt;
  std::vector<int> order(allowed.begin(), allowed.end());
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (slower(a) != slower(b)) return slower(a) < slower(b);
    const uint64_t ia = count(disk_interrupts, a), ib = count(disk_interrupts, b);
    return ia != ib ? ia < ib : a < b;
  });
  ThreadCpuPlan plan;
  plan.caller = order[0];
  for (int i = 1; i < compute_threads; ++i) plan.workers.push_back(order[static_cast<size_t>(i)]);
  plan.io = order[static_cast<size_t>(compute_threads - 1)];
  if (cpus > compute_threads) {
    // Left over: the most interrupts, then the fastest, then the highest number (the last in order).
    plan.io = *std::max_element(order.begin() + compute_threads, order.end(), [&](int a, int b) {
      const uint64_t ia = count(disk_interrupts, a), ib = count(disk_interrupts, b);
      if (ia != ib) return ia < ib;
      return slower(a) != slower(b) ? slower(a) > slower(b) : a < b;
    });
  }
  return plan;
}

ThreadPlacement::ThreadPlacement(ThreadCpuPlan plan, std::vector<pthread_t> workers, std::optional<pthread_t> io)
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
  if (st.ok() && io_) st = Pin(*io_, plan_.io);
  if (!st.ok()) End();
  return st;
}

void ThreadPlacement::End() {
  // Newest first: the caller's own list comes back last, after the threads it placed.
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) (void)SetThreadCpus(it->thread, it->cpus);
  saved_.clear();
}

}  // namespace nflash
