// Timing of profile-hw's cells: median seconds per call, several variants (thread counts) timed in turns.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

namespace nflash::profiler {

inline double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Median seconds per call of each of fn(0) .. fn(n - 1), timed in turns (0, 1, .., n - 1, 0, 1, ..) after one
// warm-up call each, until n x `budget` seconds have passed (at least one timed call each). Turns put a drift of the
// host's load or clock under every variant alike, so their ratio is measured side by side: the thread counts of one
// cell timed one after the other came out inverted on this project's shared 2-vCPU machine (Q4_0 GEMV 30.7 GB/s on
// one thread, 26.9 on two, while a 2-thread decode ran 1.1x faster), and the planner chose one compute thread.
// `prepare(i)`, untimed, runs before every call of fn(i) (e.g. moving the calling thread to variant i's CPU).
template <typename Fn, typename Prepare>
std::vector<double> MedianSecondsEach(double budget, size_t n, Fn&& fn, Prepare&& prepare) {
  using Clock = std::chrono::steady_clock;
  for (size_t i = 0; i < n; ++i) {
    prepare(i);
    fn(i);
  }
  std::vector<std::vector<double>> times(n);
  const auto start = Clock::now();
  do {
    for (size_t i = 0; i < n; ++i) {
      prepare(i);
      const auto t0 = Clock::now();
      fn(i);
      times[i].push_back(Seconds(t0, Clock::now()));
    }
  } while (Seconds(start, Clock::now()) < budget * static_cast<double>(n));
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

template <typename Fn>
std::vector<double> MedianSecondsEach(double budget, size_t n, Fn&& fn) {
  return MedianSecondsEach(budget, n, fn, [](size_t) {});
}

// Runs fn at least twice (the first is a warm-up) and until `budget` seconds have passed; returns the median seconds
// per call of the timed runs.
template <typename Fn>
double MedianSeconds(double budget, Fn&& fn) {
  return MedianSecondsEach(budget, 1, [&](size_t) { fn(); })[0];
}

}  // namespace nflash::profiler
