// Spans of the decode pipeline over time, for a timeline view (`nflash offload --trace-events FILE`): when each
// layer's attention and FFN ran on the compute thread, when that thread blocked for reads, and when the I/O thread had
// reads in flight. Written in the Chrome Trace Event Format (complete "X" events), which chrome://tracing and
// https://ui.perfetto.dev open; scripts/trace_summary.py prints per-token shares from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace nflash::sparse {

// The thread a span ran on (the trace's tid).
enum class TraceLane : uint8_t { kCompute = 1, kIo = 2 };

struct TraceSpan {
  const char* name = "";  // a string literal: "token", "attention", "ffn", "wait", "reads", "reads ahead"
  TraceLane lane = TraceLane::kCompute;
  uint64_t begin_ns = 0;  // steady clock (SteadyNowNs)
  uint64_t end_ns = 0;
  int64_t layer = -1;     // attention / ffn: the layer (MoE: the FFN's group); else -1
  int64_t count = -1;     // token: its step; ffn: its reads; reads: requests in the stream; wait: the chunk
};

// Thread-safety: Add may be called from any thread (the compute and I/O threads add concurrently). The spans are
// kept in memory, up to `capacity` (the rest counted as dropped), and written once at the end.
class EventTrace {
 public:
  explicit EventTrace(size_t capacity = size_t{1} << 20);
  void Add(const TraceSpan& span);
  std::vector<TraceSpan> Spans() const;
  size_t dropped() const;
  // The trace as Chrome Trace Event Format JSON: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}},
  // times in microseconds from the first span's begin.
  std::string ToJson() const;

 private:
  mutable std::mutex mu_;
  size_t capacity_;
  size_t dropped_ = 0;
  std::vector<TraceSpan> spans_;
};

}  // namespace nflash::sparse
