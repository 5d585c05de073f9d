// Activation statistics of one FFN from per-token active sets (see activation_stats.h).
#include "profiler/activation_stats.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

namespace nflash::profiler {
namespace {

// Number of curve points' neurons: round(i * n / (points - 1)).
int64_t CurveSize(int i, int points, int64_t n) {
  return static_cast<int64_t>(std::llround(static_cast<double>(i) * static_cast<double>(n) / (points - 1)));
}

// Joint activations of two neurons in the co-activation sample: popcount of the AND of their bitsets. The release
// build targets baseline x86-64, whose std::popcount is a ~12-instruction bit trick; the POPCNT instruction (every
// x86-64 CPU since 2008) makes the O(n^2) partner search several times faster, so it is selected at run time.
uint32_t JointCountGeneric(const uint64_t* a, const uint64_t* b, int64_t words) {
  uint32_t c = 0;
  for (int64_t w = 0; w < words; ++w) c += static_cast<uint32_t>(std::popcount(a[w] & b[w]));
  return c;
}
#if defined(__x86_64__)
__attribute__((target("popcnt"))) uint32_t JointCountPopcnt(const uint64_t* a, const uint64_t* b, int64_t words) {
  uint32_t c = 0;
  for (int64_t w = 0; w < words; ++w) c += static_cast<uint32_t>(__builtin_popcountll(a[w] & b[w]));
  return c;
}
#endif
using JointCountFn = uint32_t (*)(const uint64_t*, const uint64_t*, int64_t);
JointCountFn SelectJointCount() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("popcnt")) return JointCountPopcnt;
#endif
  return JointCountGeneric;
}

}  // namespace

std::vector<float> HeldOutPopularityCurve(std::span<const uint32_t> rank, std::span<const uint32_t> eval, int points) {
  std::vector<int32_t> order(rank.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rank[a] > rank[b]; });
  std::vector<uint64_t> prefix(order.size() + 1, 0);
  for (size_t i = 0; i < order.size(); ++i) prefix[i + 1] = prefix[i] + eval[static_cast<size_t>(order[i])];
  const double total = static_cast<double>(prefix.back());
  std::vector<float> curve(static_cast<size_t>(points), 0.0f);
  for (int i = 0; i < points; ++i) {
    const int64_t k = CurveSize(i, points, static_cast<int64_t>(order.size()));
    curve[i] = total > 0 ? static_cast<float>(static_cast<double>(prefix[k]) / total) : 0.0f;
  }
  return curve;
}

std::vector<float> PopularityCurve(std::span<const uint32_t> counts, int points) {
  // Ranked and measured on the same counts: the i largest entries' share (ties hold equal counts, so their order does
  // not matter).
  return HeldOutPopularityCurve(counts, counts, points);
}

float QuantileThreshold(std::vector<float>* values, double sparsity) {
  if (sparsity <= 0.0 || values->empty()) return 0.0f;
  // Nearest rank: the smallest value with at least `sparsity` of the values <= it.
  size_t rank = static_cast<size_t>(std::ceil(sparsity * static_cast<double>(values->size())));
  rank = std::clamp<size_t>(rank, 1, values->size()) - 1;
  std::nth_element(values->begin(), values->begin() + static_cast<ptrdiff_t>(rank), values->end());
  return (*values)[rank];
}

// ---- StackDistanceCounter ----

StackDistanceCounter::StackDistanceCounter(int64_t n_items)
    : n_items_(n_items),
      last_time_(static_cast<size_t>(n_items), -1),
      // 4 slots per item (plus a floor for tiny layers) make compaction, O(slots), run at most once per
      // 3 * n_items accesses: amortised O(1) per access.
      tree_(static_cast<size_t>(4 * n_items + 1024) + 1, 0),
      item_at_(static_cast<size_t>(4 * n_items + 1024), -1),
      distance_hist_(static_cast<size_t>(n_items), 0) {}

void StackDistanceCounter::Add(int64_t pos, int delta) {
  for (int64_t i = pos + 1; i < static_cast<int64_t>(tree_.size()); i += i & -i) tree_[i] += delta;
}

int64_t StackDistanceCounter::PrefixSum(int64_t pos) const {
  int64_t s = 0;
  for (int64_t i = pos; i > 0; i -= i & -i) s += tree_[i];
  return s;
}

void StackDistanceCounter::Compact() {
  // Live marks keep their order; they move to slots 0..live-1.
  std::vector<int32_t> items;
  items.reserve(static_cast<size_t>(n_items_));
  for (int32_t item : item_at_) {
    if (item >= 0) items.push_back(item);
  }
  std::fill(tree_.begin(), tree_.end(), 0);
  std::fill(item_at_.begin(), item_at_.end(), -1);
  for (size_t t = 0; t < items.size(); ++t) {
    item_at_[t] = items[t];
    last_time_[items[t]] = static_cast<int64_t>(t);
    Add(static_cast<int64_t>(t), 1);
  }
  next_time_ = static_cast<int64_t>(items.size());
}

void StackDistanceCounter::Count(int32_t item) {
  ++accesses_;
  const int64_t last = last_time_[item];
  // Distinct items accessed after `last`: the marks in (last, now).
  if (last >= 0) ++distance_hist_[static_cast<size_t>(PrefixSum(next_time_) - PrefixSum(last + 1))];
}

void StackDistanceCounter::MoveToTop(int32_t item) {
  if (next_time_ == static_cast<int64_t>(item_at_.size())) Compact();
  const int64_t last = last_time_[item];
  if (last >= 0) {
    Add(last, -1);
    item_at_[last] = -1;
  }
  Add(next_time_, 1);
  item_at_[next_time_] = item;
  last_time_[item] = next_time_++;
}

void StackDistanceCounter::Access(int32_t item) {
  Count(item);
  MoveToTop(item);
}

void StackDistanceCounter::AccessSet(std::span<const int32_t> items) {
  // 1. Every item's distance against the stack as it stands at the step's start.
  for (int32_t item : items) Count(item);
  // 2. The items to the top: never accessed first (in the given order), then the others from least to most recently
  // accessed, so that their recency order stays as it was (Compact, when it runs in between, keeps the order too).
  order_.assign(items.begin(), items.end());
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int32_t a, int32_t b) { return last_time_[a] < last_time_[b]; });
  for (int32_t item : order_) MoveToTop(item);
}

uint64_t StackDistanceCounter::Hits(int64_t capacity) const {
  uint64_t hits = 0;
  for (int64_t d = 0; d < std::min(capacity, n_items_); ++d) hits += distance_hist_[d];
  return hits;
}

std::vector<float> StackDistanceCounter::HitRateCurve(int points) const {
  std::vector<float> curve(static_cast<size_t>(points), 0.0f);
  if (accesses_ == 0) return curve;
  uint64_t hits = 0;
  int64_t d = 0;
  for (int i = 0; i < points; ++i) {
    const int64_t capacity = CurveSize(i, points, n_items_);
    for (; d < capacity; ++d) hits += distance_hist_[d];
    curve[i] = static_cast<float>(static_cast<double>(hits) / static_cast<double>(accesses_));
  }
  return curve;
}

// ---- SharedLruStats ----

SharedLruStats::SharedLruStats(int64_t n_ffns, int64_t n_neurons)
    : n_neurons_(n_neurons), words_((n_neurons + 63) / 64), lru_(n_ffns * n_neurons) {}

void SharedLruStats::Add(int64_t ffn, int64_t window, int64_t pos, std::span<const int32_t> active) {
  if (window != open_window_) {
    Flush();
    open_window_ = window;
  }
  const size_t begin = bits_.size();
  bits_.resize(begin + static_cast<size_t>(words_), 0);
  for (int32_t i : active) bits_[begin + static_cast<size_t>(i >> 6)] |= uint64_t{1} << (i & 63);
  entries_.push_back(Entry{pos, ffn, begin});
}

void SharedLruStats::Flush() {
  std::stable_sort(entries_.begin(), entries_.end(),
                   [](const Entry& a, const Entry& b) { return a.pos != b.pos ? a.pos < b.pos : a.ffn < b.ffn; });
  for (const Entry& e : entries_) {
    const int64_t base = e.ffn * n_neurons_;
    keys_.clear();
    for (int64_t w = 0; w < words_; ++w) {
      for (uint64_t b = bits_[e.begin + static_cast<size_t>(w)]; b != 0; b &= b - 1) {
        keys_.push_back(static_cast<int32_t>(base + w * 64 + std::countr_zero(b)));  // ascending, as the active lists
      }
    }
    lru_.AccessSet(keys_);
  }
  entries_.clear();
  bits_.clear();
}

std::vector<float> SharedLruStats::Finish(int points) {
  Flush();
  return lru_.HitRateCurve(points);
}

// ---- FfnStats ----

FfnStats::FfnStats(int64_t layer, int64_t expert, int64_t n_neurons, float threshold, const FfnStatsOptions& options)
    : layer_(layer),
      expert_(expert),
      n_(n_neurons),
      threshold_(threshold),
      opt_(options),
      words_((n_neurons + 63) / 64),
      count_window_half_{std::vector<uint32_t>(static_cast<size_t>(n_neurons), 0),
                         std::vector<uint32_t>(static_cast<size_t>(n_neurons), 0)},
      count_pos_half_{std::vector<uint32_t>(static_cast<size_t>(n_neurons), 0),
                      std::vector<uint32_t>(static_cast<size_t>(n_neurons), 0)},
      hist_(kActiveHistBins, 0),
      lru_(n_neurons),
      sample_words_((options.coact_tokens + 63) / 64) {
  for (int w = 0; w < 2; ++w) {
    union_[w].assign(static_cast<size_t>(opt_.ctx * words_), 0);
    union_used_[w].assign(static_cast<size_t>(opt_.ctx), 0);
    count_group_[w].assign(static_cast<size_t>(n_), 0);
  }
  if (opt_.coact_k > 0) sample_bits_.assign(static_cast<size_t>(n_ * sample_words_), 0);
}

void FfnStats::FlushGroup(int which) {
  for (int64_t p = 0; p < opt_.ctx; ++p) {
    if (!union_used_[which][p]) continue;
    ++groups_[which];
    uint64_t* row = &union_[which][static_cast<size_t>(p * words_)];
    for (int64_t w = 0; w < words_; ++w) {
      for (uint64_t bits = row[w]; bits != 0; bits &= bits - 1) {
        ++count_group_[which][static_cast<size_t>(w * 64 + std::countr_zero(bits))];
      }
      row[w] = 0;
    }
    union_used_[which][p] = 0;
  }
}

void FfnStats::AddToken(std::span<const int32_t> active, int64_t window, int64_t pos, bool coact_sample) {
  ++tokens_;
  ++tokens_window_half_[window % 2];
  std::vector<uint32_t>& by_window = count_window_half_[window % 2];
  std::vector<uint32_t>& by_pos = count_pos_half_[pos % 2];
  for (int32_t i : active) {
    ++by_window[i];
    ++by_pos[i];
  }
  const double fraction = static_cast<double>(active.size()) / static_cast<double>(n_);
  sum_fraction_ += fraction;
  ++hist_[std::min<int64_t>(kActiveHistBins - 1, static_cast<int64_t>(fraction * kActiveHistBins))];
  static constexpr int64_t kGroupSize[2] = {2, 4};
  for (int which = 0; which < 2; ++which) {
    const int64_t group = window / kGroupSize[which];
    if (group != open_group_[which]) {
      FlushGroup(which);
      open_group_[which] = group;
    }
    union_used_[which][pos] = 1;
    uint64_t* row = &union_[which][static_cast<size_t>(pos * words_)];
    for (int32_t i : active) row[i >> 6] |= uint64_t{1} << (i & 63);
  }
  lru_.AccessSet(active);
  if (coact_sample && opt_.coact_k > 0 && sampled_ < opt_.coact_tokens) {
    const int64_t s = sampled_++;
    for (int32_t i : active) sample_bits_[static_cast<size_t>(i * sample_words_ + s / 64)] |= uint64_t{1} << (s & 63);
  }
}

void FfnStats::AddGateCoactivation(int64_t active, int64_t up_ok, int64_t down_ok) {
  gate_active_ += active;
  up_ok_ += up_ok;
  down_ok_ += down_ok;
}

FfnProfile FfnStats::Finish(ThreadPool* pool) {
  FlushGroup(0);
  FlushGroup(1);
  FfnProfile f;
  f.layer = layer_;
  f.expert = expert_;
  f.n_neurons = n_;
  f.threshold = threshold_;
  f.tokens = tokens_;
  f.count_bs1.resize(static_cast<size_t>(n_));
  for (size_t i = 0; i < f.count_bs1.size(); ++i) f.count_bs1[i] = count_window_half_[0][i] + count_window_half_[1][i];
  f.count_bs2 = count_group_[0];
  f.count_bs4 = count_group_[1];
  f.groups2 = groups_[0];
  f.groups4 = groups_[1];
  f.active_hist = hist_;
  f.mean_active_fraction = tokens_ > 0 ? sum_fraction_ / static_cast<double>(tokens_) : 0.0;
  f.popularity = PopularityCurve(f.count_bs1);
  // Ranked on one half of the tokens, measured on the other, both ways, averaged. Halves by window (windows are
  // independent stretches of text), or by position when every token came in one window.
  const bool by_window = tokens_window_half_[0] > 0 && tokens_window_half_[1] > 0;
  const std::vector<uint32_t>* half = by_window ? count_window_half_ : count_pos_half_;
  if (tokens_ >= 2) {
    const std::vector<float> a = HeldOutPopularityCurve(half[0], half[1]);
    const std::vector<float> b = HeldOutPopularityCurve(half[1], half[0]);
    f.popularity_heldout.resize(a.size());
    for (size_t i = 0; i < a.size(); ++i) f.popularity_heldout[i] = 0.5f * (a[i] + b[i]);
  }
  f.lru_hit_rate = lru_.HitRateCurve();
  if (gate_active_ > 0) {
    f.up_given_gate = static_cast<double>(up_ok_) / static_cast<double>(gate_active_);
    f.down_given_gate = static_cast<double>(down_ok_) / static_cast<double>(gate_active_);
  }
  const int64_t k = std::min(opt_.coact_k, n_ - 1);
  f.coact_k = std::max<int64_t>(k, 0);
  f.coact_partner.assign(static_cast<size_t>(n_ * f.coact_k), -1);
  f.coact_count.assign(static_cast<size_t>(n_ * f.coact_k), 0);
  if (f.coact_k == 0 || sampled_ == 0) return f;
  const int64_t sw = (sampled_ + 63) / 64;  // only the words holding samples
  // Neurons never active in the sample have no partners; skipping them makes the O(n^2) pass O(n_seen^2).
  std::vector<int32_t> seen;
  for (int64_t i = 0; i < n_; ++i) {
    const uint64_t* a = &sample_bits_[static_cast<size_t>(i * sample_words_)];
    if (std::any_of(a, a + sw, [](uint64_t x) { return x != 0; })) seen.push_back(static_cast<int32_t>(i));
  }
  const JointCountFn joint_count = SelectJointCount();
  // Samples each neuron is active in (its own joint count with itself).
  std::vector<uint32_t> own(static_cast<size_t>(n_), 0);
  for (int32_t i : seen) {
    const uint64_t* a = &sample_bits_[static_cast<size_t>(i * sample_words_)];
    own[static_cast<size_t>(i)] = joint_count(a, a, sw);
  }
  // Partners rank by Jaccard similarity c / (n_i + n_j - c), not by the joint count c: raw counts favour popular
  // neurons (every neuron's top partners are the hottest ones), so chains built from them just repeat popularity
  // order. Compared exactly in integers; ties to the larger count, then the smaller index.
  struct Partner {
    uint32_t joint, uni;
    int32_t j;
  };
  auto better = [](const Partner& x, const Partner& y) {
    const uint64_t lhs = uint64_t{x.joint} * y.uni, rhs = uint64_t{y.joint} * x.uni;
    if (lhs != rhs) return lhs > rhs;
    if (x.joint != y.joint) return x.joint > y.joint;
    return x.j < y.j;
  };
  pool->ParallelFor(static_cast<int64_t>(seen.size()), 16, [&](int64_t begin, int64_t end, int) {
    std::vector<Partner> top;
    for (int64_t s = begin; s < end; ++s) {
      const int32_t i = seen[s];
      const uint64_t* a = &sample_bits_[static_cast<size_t>(i * sample_words_)];
      top.clear();
      for (int32_t j : seen) {
        if (j == i) continue;
        const uint64_t* b = &sample_bits_[static_cast<size_t>(j * sample_words_)];
        const uint32_t c = joint_count(a, b, sw);
        if (c == 0) continue;
        top.push_back(Partner{c, own[static_cast<size_t>(i)] + own[static_cast<size_t>(j)] - c, j});
      }
      const size_t keep = std::min<size_t>(top.size(), static_cast<size_t>(f.coact_k));
      std::partial_sort(top.begin(), top.begin() + static_cast<ptrdiff_t>(keep), top.end(), better);
      for (size_t r = 0; r < keep; ++r) {
        f.coact_partner[static_cast<size_t>(i * f.coact_k) + r] = top[r].j;
        f.coact_count[static_cast<size_t>(i * f.coact_k) + r] = top[r].joint;
      }
    }
  });
  return f;
}

}  // namespace nflash::profiler
