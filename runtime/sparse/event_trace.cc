#include "runtime/sparse/event_trace.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace nflash::sparse {

EventTrace::EventTrace(size_t capacity) : capacity_(capacity) { spans_.reserve(std::min<size_t>(capacity, 65536)); }

void EventTrace::Add(const TraceSpan& span) {
  std::lock_guard<std::mutex> lock(mu_);
  if (spans_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  spans_.push_back(span);
}

std::vector<TraceSpan> EventTrace::Spans() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spans_;
}

size_t EventTrace::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

std::string EventTrace::ToJson() const {
  std::vector<TraceSpan> spans = Spans();
  std::stable_sort(spans.begin(), spans.end(),
                   [](const TraceSpan& a, const TraceSpan& b) { return a.begin_ns < b.begin_ns; });
  const uint64_t origin = spans.empty() ? 0 : spans.front().begin_ns;
  nlohmann::json events = nlohmann::json::array();
  // Thread names first (metadata events), so that viewers label the two lanes.
  for (const auto& [lane, name] : {std::pair{TraceLane::kCompute, "compute"}, std::pair{TraceLane::kIo, "io"}}) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 1}, {"tid", static_cast<int>(lane)},
                      {"args", {{"name", name}}}});
  }
  for (const TraceSpan& s : spans) {
    nlohmann::json args = nlohmann::json::object();
    if (s.layer >= 0) args["layer"] = s.layer;
    if (s.count >= 0) args["count"] = s.count;
    events.push_back({{"ph", "X"},
                      {"name", s.name},
                      {"pid", 1},
                      {"tid", static_cast<int>(s.lane)},
                      {"ts", static_cast<double>(s.begin_ns - origin) / 1e3},
                      {"dur", static_cast<double>(s.end_ns - std::min(s.end_ns, s.begin_ns)) / 1e3},
                      {"args", std::move(args)}});
  }
  const nlohmann::json j = {{"traceEvents", std::move(events)},
                            {"displayTimeUnit", "ms"},
                            {"otherData", {{"dropped_spans", dropped()}}}};
  return j.dump();
}

}  // namespace nflash::sparse
