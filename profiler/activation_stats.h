// Activation statistics of one FFN neuron set, accumulated from a stream of per-token active sets: counts at batch
// sizes 1/2/4, sparsity distribution, popularity curve, LRU hit-rate curve (Mattson stack distances), gate/up/down
// co-activation and neuron co-activation partners. The engine-independent half of `nflash profile` (unit-testable
// on hand-made streams).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "profiler/profile.h"
#include "runtime/core/thread_pool.h"

namespace nflash::profiler {

// Bins of FfnProfile::active_hist (5% of the layer each).
inline constexpr int kActiveHistBins = 20;

// popularity[i] = share of the total of `counts` held by the round(i * n / (points - 1)) largest entries.
std::vector<float> PopularityCurve(std::span<const uint32_t> counts, int points = kCurvePoints);
// Held-out popularity: curve[i] = share of the total of `eval` held by the round(i * n / (points - 1)) entries that are
// largest in `rank` (ties to the smaller index). With `rank` and `eval` counted on disjoint halves of the tokens it
// measures what pinning the neurons a profile ranks hottest serves on tokens the profile did not see; the in-sample
// curve (PopularityCurve) overstates that when each neuron's count rests on few tokens (an MoE expert's share).
// All zeros when `eval` sums to 0. `rank` and `eval` have the same size.
std::vector<float> HeldOutPopularityCurve(std::span<const uint32_t> rank, std::span<const uint32_t> eval,
                                          int points = kCurvePoints);

// Threshold t such that a share `sparsity` of `values` (absolute activations) is <= t: the nearest-rank quantile;
// 0 for sparsity <= 0 (every nonzero is active). Reorders `values`.
float QuantileThreshold(std::vector<float>* values, double sparsity);

// LRU cache hit rates for every cache size in one pass (Mattson et al. 1970): an access hits an LRU cache of C items
// iff fewer than C distinct other items were accessed since the item's previous access (its stack distance). Stack
// distances come from a Fenwick tree over access times in which only each item's latest access is marked, so an
// access costs O(log T). Times are renumbered (compacted) when the tree is full, so memory stays O(n_items).
// Thread-safety: not thread-safe.
class StackDistanceCounter {
 public:
  explicit StackDistanceCounter(int64_t n_items);
  void Access(int32_t item);
  // One step's set of distinct items, as the offloaded runtime serves it (docs/runtime.md, "Order within a layer"):
  // an item hits a cache of C items iff it was among the C most recent at the step's start (a miss never evicts an
  // item the same step uses). Every item's distance is taken against the stack at the step's start; then the step's
  // items become the most recent ones, keeping their recency order (never accessed ones below the others), so that at
  // every size the step's hits end above its misses, as the runtime leaves them (it orders each class by index).
  void AccessSet(std::span<const int32_t> items);
  uint64_t accesses() const { return accesses_; }
  // Hits of an LRU cache of `capacity` items over all accesses so far.
  uint64_t Hits(int64_t capacity) const;
  // hit_rate[i] for a cache of round(i * n_items / (points - 1)) items; 0 when there were no accesses.
  std::vector<float> HitRateCurve(int points = kCurvePoints) const;

 private:
  void Compact();
  // Counts an access of `item` at its current stack distance (a first access: a miss at every size).
  void Count(int32_t item);
  // Marks `item` as the most recently accessed (compacting the times first when the tree is full).
  void MoveToTop(int32_t item);
  void Add(int64_t pos, int delta);
  int64_t PrefixSum(int64_t pos) const;  // marks in [0, pos)

  int64_t n_items_;
  std::vector<int64_t> last_time_;  // per item, -1: never accessed
  std::vector<int32_t> tree_;       // Fenwick tree over time slots (1-based inside)
  std::vector<int32_t> item_at_;    // time slot -> item marked there, -1 if none
  int64_t next_time_ = 0;
  uint64_t accesses_ = 0;
  std::vector<uint64_t> distance_hist_;  // [d]: accesses with stack distance d (d < n_items)
  std::vector<int32_t> order_;           // AccessSet's scratch
};

// The hit-rate curve of one LRU cache shared by every FFN of a model (keys: FFN x neuron), the runtime's shared cold
// pool: each window's active sets are buffered and replayed in decode order at the next window (or Finish): token by
// token, each token's FFNs in index order (layer-major, experts ascending), whatever order they arrived in (a batched
// window arrives layer by layer).
// Thread-safety: not thread-safe.
class SharedLruStats {
 public:
  SharedLruStats(int64_t n_ffns, int64_t n_neurons);
  // FFN `ffn`'s active set (indices < n_neurons) for the token at position `pos` of window `window` (non-decreasing
  // across calls).
  void Add(int64_t ffn, int64_t window, int64_t pos, std::span<const int32_t> active);
  // hit_rate[i] for a cache of round(i * n_ffns * n_neurons / (points - 1)) entries.
  std::vector<float> Finish(int points = kSharedCurvePoints);

 private:
  void Flush();
  struct Entry {
    int64_t pos, ffn;
    size_t begin;  // the set's first word in bits_
  };
  int64_t n_neurons_, words_;
  int64_t open_window_ = -1;
  std::vector<Entry> entries_;
  // The window's sets as bitsets (n_neurons / 8 bytes each, whatever the sparsity: a window of 256 tokens of a 32-layer
  // 7B buffers 11 MB).
  std::vector<uint64_t> bits_;
  std::vector<int32_t> keys_;  // one set's keys (Flush)
  StackDistanceCounter lru_;
};

struct FfnStatsOptions {
  int64_t ctx = 256;             // positions per window (for the batch-of-2/4 unions)
  int64_t coact_k = 16;          // partners kept per neuron
  int64_t coact_tokens = 1024;   // tokens sampled for co-activation pair counts (bounded memory: n * this bits)
};

// Accumulates the statistics of one FFN. Tokens arrive window by window; window w belongs to batch-of-2 group w / 2
// and batch-of-4 group w / 4: count_bs2[i] counts (group, position) pairs in which neuron i was active for at least
// one of the group's tokens at that position (a batched decode of 2 (4) independent sequences at the same step).
// Thread-safety: not thread-safe.
class FfnStats {
 public:
  FfnStats(int64_t layer, int64_t expert, int64_t n_neurons, float threshold, const FfnStatsOptions& options);

  // One token's active neurons (ascending indices < n_neurons) at position `pos` (< ctx) of window `window`
  // (non-decreasing across calls). `coact_sample`: add the token to the co-activation sample (if room is left).
  void AddToken(std::span<const int32_t> active, int64_t window, int64_t pos, bool coact_sample);
  // Gate/up/down co-activation of one token: of `active` gate-active neurons, `up_ok` had a non-negligible up value
  // and `down_ok` a non-negligible down contribution.
  void AddGateCoactivation(int64_t active, int64_t up_ok, int64_t down_ok);
  // Completes open groups, computes the curves and co-activation partners (parallel over neurons in `pool`).
  FfnProfile Finish(ThreadPool* pool);

  int64_t n_neurons() const { return n_; }
  float threshold() const { return threshold_; }

 private:
  void FlushGroup(int which);

  int64_t layer_, expert_, n_;
  float threshold_;
  FfnStatsOptions opt_;
  int64_t words_;  // 64-bit words per neuron bitset
  int64_t tokens_ = 0;
  // Per neuron, tokens on which it was active, by the window's parity (their sum is FfnProfile::count_bs1) and by the
  // position's (the fallback when every token is in one window): the two halves of FfnProfile::popularity_heldout.
  std::vector<uint32_t> count_window_half_[2], count_pos_half_[2];
  int64_t tokens_window_half_[2] = {0, 0};
  double sum_fraction_ = 0.0;
  std::vector<uint32_t> hist_;
  // Batch unions: [which] for groups of 2 and 4; ctx * words_ bits of the open group and its id.
  std::vector<uint64_t> union_[2];
  std::vector<uint8_t> union_used_[2];  // per position: some token arrived
  int64_t open_group_[2] = {-1, -1};
  std::vector<uint32_t> count_group_[2];
  int64_t groups_[2] = {0, 0};
  StackDistanceCounter lru_;
  int64_t gate_active_ = 0, up_ok_ = 0, down_ok_ = 0;
  // Co-activation sample: per neuron a bitset over sampled tokens.
  int64_t sample_words_;
  int64_t sampled_ = 0;
  std::vector<uint64_t> sample_bits_;
};

}  // namespace nflash::profiler
