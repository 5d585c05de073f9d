// Neuron cache: the O(1) slot regions against a brute-force reference LRU on random traces (and a brute-force
// segmented LRU with an overflow pool), pinning, capacity edge cases, the arena layout and config validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "runtime/sparse/neuron_cache.h"

namespace nflash::sparse {
namespace {

// The textbook LRU, written independently of SlotRegion: a list of (key, last use) scanned linearly. An entry used by
// the current token is pinned (not evictable); a miss with no free space and nothing evictable is a bypass.
class ReferenceLru {
 public:
  explicit ReferenceLru(int64_t capacity) : capacity_(capacity) {}
  struct Outcome {
    bool hit = false;
    bool bypass = false;
    int64_t evicted = -1;
  };
  void BeginToken() { token_start_ = clock_ + 1; }
  Outcome Access(int64_t key) {
    Outcome o;
    ++clock_;
    for (auto& e : entries_) {
      if (e.key == key) {
        e.last_use = clock_;
        o.hit = true;
        return o;
      }
    }
    if (static_cast<int64_t>(entries_.size()) < capacity_) {
      entries_.push_back({key, clock_});
      return o;
    }
    int best = -1;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].last_use >= token_start_) continue;  // used by this token: pinned
      if (best < 0 || entries_[i].last_use < entries_[best].last_use) best = static_cast<int>(i);
    }
    if (best < 0) {
      o.bypass = true;
      return o;
    }
    o.evicted = entries_[best].key;
    entries_[best] = {key, clock_};
    return o;
  }

 private:
  struct Entry {
    int64_t key;
    int64_t last_use;
  };
  int64_t capacity_;
  int64_t clock_ = 0;
  int64_t token_start_ = 0;
  std::vector<Entry> entries_;
};

constexpr size_t kBundle = 3 * 288 * 4;  // a stories-sized f32 bundle (gate row, up row, down column): not page-sized

RegionConfig Region(int64_t groups, int64_t units, std::vector<int64_t> per_group, int64_t shared) {
  RegionConfig c;
  c.n_groups = groups;
  c.units_per_group = units;
  c.unit_bytes = kBundle;
  c.slots_per_group = std::move(per_group);
  c.shared_slots = shared;
  return c;
}

// Runs `tokens` random tokens (each a set of active units per group, drawn from a skewed popularity, in random order
// with occasional duplicates) through the region and the references, comparing every outcome.
void RunTrace(const RegionConfig& config, uint64_t seed, int tokens) {
  int64_t n_slots = 0;
  for (int64_t s : config.slots_per_group) n_slots += s;
  if (config.slots_per_group.empty()) n_slots = config.shared_slots;
  std::vector<uint8_t> memory(static_cast<size_t>(n_slots) * AlignSlot(kBundle) + 1);
  auto region = SlotRegion::Create(config, memory.data());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  SlotRegion& r = **region;

  const bool shared = config.slots_per_group.empty();
  std::vector<ReferenceLru> refs;
  if (shared) {
    refs.emplace_back(config.shared_slots);
  } else {
    for (int64_t cap : config.slots_per_group) refs.emplace_back(cap);
  }
  std::map<int64_t, CacheCounters> expect;  // per group
  std::mt19937_64 rng(seed);
  // Skewed popularity: unit u is active with probability ~ 0.6 / (1 + u / 4), so a few units are hot.
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int t = 0; t < tokens; ++t) {
    for (auto& ref : refs) ref.BeginToken();
    std::vector<std::pair<int64_t, int64_t>> accesses;  // (group, unit)
    for (int64_t g = 0; g < config.n_groups; ++g) {
      for (int64_t u = 0; u < config.units_per_group; ++u) {
        if (uni(rng) < 0.6 / (1.0 + u / 4.0)) accesses.emplace_back(g, u);
      }
    }
    std::shuffle(accesses.begin(), accesses.end(), rng);
    if (!accesses.empty() && uni(rng) < 0.3) accesses.push_back(accesses[rng() % accesses.size()]);  // a duplicate
    std::vector<int32_t> held;
    for (auto [g, u] : accesses) {
      const int64_t key = g * config.units_per_group + u;
      ReferenceLru::Outcome want = refs[shared ? 0 : g].Access(key);
      SlotRegion::Lookup got = r.Acquire(g, u);
      SCOPED_TRACE("token " + std::to_string(t) + " group " + std::to_string(g) + " unit " + std::to_string(u));
      ASSERT_EQ(got.hit, want.hit);
      ASSERT_EQ(got.slot < 0, want.bypass);
      if (want.evicted >= 0) {
        ASSERT_EQ(got.evicted_unit, want.evicted % config.units_per_group);
        ++expect[want.evicted / config.units_per_group].evictions;
        ASSERT_EQ(r.Find(want.evicted / config.units_per_group, want.evicted % config.units_per_group), -1);
      } else {
        ASSERT_EQ(got.evicted_unit, -1);
      }
      CacheCounters& c = expect[g];
      if (want.hit) {
        ++c.hits;
      } else {
        ++c.misses;
        c.bytes_loaded += kBundle;
        if (want.bypass) ++c.bypasses;
      }
      if (got.slot >= 0) {
        ASSERT_EQ(r.Find(g, u), got.slot);
        held.push_back(got.slot);
      }
    }
    for (int32_t s : held) r.Release(s);
  }
  for (int64_t g = 0; g < config.n_groups; ++g) {
    const CacheCounters& got = r.counters(g);
    const CacheCounters& want = expect[g];
    EXPECT_EQ(got.hits, want.hits) << "group " << g;
    EXPECT_EQ(got.misses, want.misses) << "group " << g;
    EXPECT_EQ(got.bypasses, want.bypasses) << "group " << g;
    EXPECT_EQ(got.evictions, want.evictions) << "group " << g;
    EXPECT_EQ(got.bytes_loaded, want.bytes_loaded) << "group " << g;
  }
  // The trace must exercise every path, or the comparison proves little.
  const CacheCounters total = r.TotalCounters();
  EXPECT_GT(total.hits, 0u);
  EXPECT_GT(total.misses, 0u);
  if (n_slots > 0) {
    EXPECT_GT(total.evictions, 0u);
  }
}

TEST(NeuronCacheTest, PerGroupBudgetsMatchReferenceLru) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    RunTrace(Region(4, 40, {6, 0, 13, 3}, 0), seed, 60);
  }
}

TEST(NeuronCacheTest, SharedPoolMatchesReferenceLru) {
  for (uint64_t seed = 11; seed <= 15; ++seed) {
    RunTrace(Region(3, 32, {}, 17), seed, 60);
  }
}

TEST(NeuronCacheTest, TinyPoolBypassesWhenEverySlotIsPinned) {
  RunTrace(Region(2, 30, {}, 2), 99, 40);
}

TEST(NeuronCacheTest, ZeroSlotsBypassEveryMiss) {
  auto region = SlotRegion::Create(Region(2, 8, {0, 0}, 0), nullptr);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  for (int i = 0; i < 3; ++i) {
    SlotRegion::Lookup l = (*region)->Acquire(1, 5);
    EXPECT_EQ(l.slot, -1);
    EXPECT_FALSE(l.hit);
  }
  EXPECT_EQ((*region)->counters(1).misses, 3u);
  EXPECT_EQ((*region)->counters(1).bypasses, 3u);
  EXPECT_EQ((*region)->counters(1).bytes_loaded, 3 * kBundle);
  EXPECT_EQ((*region)->counters(0).misses, 0u);
  EXPECT_EQ((*region)->SlotCount(), 0);
}

TEST(NeuronCacheTest, PinnedSlotIsNeverEvicted) {
  std::vector<uint8_t> memory(2 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(Region(1, 10, {}, 2), memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  auto a = r.Acquire(0, 1);
  auto b = r.Acquire(0, 2);
  ASSERT_GE(a.slot, 0);
  ASSERT_GE(b.slot, 0);
  EXPECT_EQ(r.PinCount(a.slot), 1);
  r.Release(b.slot);  // 2 is unpinned, 1 (least recently acquired) stays pinned
  auto c = r.Acquire(0, 3);
  EXPECT_EQ(c.slot, b.slot) << "the only unpinned slot must be the victim";
  EXPECT_EQ(c.evicted_unit, 2);
  EXPECT_EQ(r.Find(0, 1), a.slot);
  auto d = r.Acquire(0, 4);  // both pinned
  EXPECT_EQ(d.slot, -1);
  // A second pin on a slot: it stays pinned until both are released.
  auto a2 = r.Acquire(0, 1);
  EXPECT_TRUE(a2.hit);
  EXPECT_EQ(r.PinCount(a.slot), 2);
  r.Release(a.slot);
  r.Release(c.slot);
  auto e = r.Acquire(0, 5);
  EXPECT_EQ(e.slot, c.slot) << "unit 1 is still pinned once";
  r.Release(a.slot);
  r.Release(e.slot);
  auto f = r.Acquire(0, 6);
  EXPECT_EQ(f.slot, a.slot) << "unit 1 was released before unit 5, so it is the least recently used";
  EXPECT_EQ(f.evicted_unit, 1);
}

TEST(NeuronCacheTest, ReleaseAsLruMakesTheSlotTheNextVictim) {
  std::vector<uint8_t> memory(3 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(Region(1, 10, {}, 3), memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  auto a = r.Acquire(0, 1);
  auto b = r.Acquire(0, 2);
  auto c = r.Acquire(0, 3);
  EXPECT_FALSE(r.CanPlace(0)) << "three slots, three pins";
  r.Release(a.slot);
  EXPECT_TRUE(r.CanPlace(0));
  r.Release(b.slot);
  r.ReleaseAsLru(c.slot);  // released last, but as a guess nobody used: least recently used
  EXPECT_EQ(r.Find(0, 3), c.slot) << "still cached";
  auto d = r.Acquire(0, 4);
  EXPECT_EQ(d.slot, c.slot);
  EXPECT_EQ(d.evicted_unit, 3);
  auto e = r.Acquire(0, 5);
  EXPECT_EQ(e.evicted_unit, 1) << "then plain LRU order";
  // A hit on a slot released as LRU takes it off the list like any other.
  r.Release(d.slot);
  r.Release(e.slot);
  auto f = r.Acquire(0, 2);
  EXPECT_TRUE(f.hit);
  r.ReleaseAsLru(f.slot);
  EXPECT_EQ(r.Acquire(0, 6).evicted_unit, 2);
}

TEST(NeuronCacheTest, AbandonFreesTheSlot) {
  std::vector<uint8_t> memory(AlignSlot(kBundle));
  auto region = SlotRegion::Create(Region(1, 4, {}, 1), memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  auto a = r.Acquire(0, 0);
  ASSERT_EQ(a.slot, 0);
  r.Abandon(a.slot);  // e.g. the read failed its checksum twice
  EXPECT_EQ(r.Find(0, 0), -1);
  auto b = r.Acquire(0, 3);
  EXPECT_EQ(b.slot, 0);
  EXPECT_FALSE(b.hit);
  EXPECT_EQ(b.evicted_unit, -1) << "an abandoned slot is free, not evicted";
  EXPECT_EQ(r.counters(0).evictions, 0u);
  r.Release(b.slot);
  r.Clear();
  EXPECT_EQ(r.Find(0, 3), -1);
}

TEST(NeuronCacheTest, ArenaLayoutIsAlignedAndDisjoint) {
  NeuronCacheConfig config;
  config.hot_cluster_neurons = 8;
  config.hot = Region(2, 5, {}, 3);
  config.hot.unit_bytes = 8 * kBundle;
  config.cold = Region(2, 40, {4, 2}, 0);
  auto cache = NeuronCache::Create(config);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  NeuronCache& c = **cache;
  const size_t hot_stride = AlignSlot(8 * kBundle), cold_stride = AlignSlot(kBundle);
  EXPECT_EQ(hot_stride % 4096, 0u);
  EXPECT_GE(hot_stride, 8 * kBundle);
  EXPECT_EQ(c.arena_bytes(), 3 * hot_stride + 6 * cold_stride);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.arena()) % 4096, 0u);
  std::vector<std::pair<uint8_t*, size_t>> spans;
  for (int32_t s = 0; s < c.hot().SlotCount(); ++s) spans.emplace_back(c.hot().SlotData(s), hot_stride);
  for (int32_t s = 0; s < c.cold().SlotCount(); ++s) spans.emplace_back(c.cold().SlotData(s), cold_stride);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(spans[i].first) % 4096, 0u);
    EXPECT_GE(spans[i].first, c.arena());
    EXPECT_LE(spans[i].first + spans[i].second, c.arena() + c.arena_bytes());
    if (i > 0) {
      EXPECT_GE(spans[i].first, spans[i - 1].first + spans[i - 1].second) << "slots overlap";
    }
  }
  // Writing every slot fully must stay inside the arena (checked by ASan builds) and not disturb other slots.
  for (int32_t s = 0; s < c.cold().SlotCount(); ++s) std::fill_n(c.cold().SlotData(s), cold_stride, uint8_t(s + 1));
  for (int32_t s = 0; s < c.hot().SlotCount(); ++s) EXPECT_EQ(c.hot().SlotData(s)[hot_stride - 1], 0);
  // Per-group budgets: group 0's misses never take group 1's slots.
  for (int u = 0; u < 10; ++u) c.cold().Release(c.cold().Acquire(0, u).slot);
  auto g1 = c.cold().Acquire(1, 0);
  EXPECT_FALSE(g1.hit);
  EXPECT_EQ(g1.evicted_unit, -1) << "group 1 has its own free slots";
  EXPECT_EQ(c.cold().counters(0).evictions, 6u);
}

TEST(NeuronCacheTest, UsesAnExternalArena) {
  NeuronCacheConfig config;
  config.cold = Region(1, 10, {}, 3);
  auto bytes = NeuronCache::ArenaBytes(config);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, 3 * AlignSlot(kBundle));
  std::vector<uint8_t> memory(*bytes + 4096);
  uint8_t* aligned = memory.data() + (4096 - reinterpret_cast<uintptr_t>(memory.data()) % 4096) % 4096;
  auto cache = NeuronCache::Create(config, aligned, *bytes);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  EXPECT_EQ((*cache)->arena(), aligned);
  EXPECT_EQ((*cache)->cold().SlotData(2), aligned + 2 * AlignSlot(kBundle));
  auto small = NeuronCache::Create(config, aligned, *bytes - 1);
  EXPECT_FALSE(small.ok());
  auto misaligned = NeuronCache::Create(config, aligned + 8, *bytes);
  EXPECT_FALSE(misaligned.ok());
}

// A brute-force model of the segmented LRU with per-group partitions and an overflow pool (RegionConfig), written
// from the documented rules with linear scans and no links: entries carry (pool, segment, release time); an entry
// accessed during the current token is pinned until the token's end, when entries are released in access order.
class ReferenceSegmented {
 public:
  struct Outcome {
    bool hit = false;
    bool bypass = false;
    int64_t evicted = -1;
  };
  // capacity[g] per group; pool n_groups is the overflow pool (capacity `overflow`).
  ReferenceSegmented(std::vector<int64_t> capacity, int64_t overflow, double protected_fraction) {
    for (int64_t c : capacity) pools_.push_back({c, static_cast<int64_t>(protected_fraction * static_cast<double>(c))});
    pools_.push_back({overflow, 0});
  }
  Outcome Access(int64_t group, int64_t key) {
    Outcome o;
    for (auto& e : entries_) {
      if (e.key != key) continue;
      o.hit = true;
      e.hit = true;
      if (!e.pinned) {
        e.pinned = true;
        pinned_order_.push_back(key);
      } else {
        // A second access in the token: its release is the later one.
        pinned_order_.erase(std::find(pinned_order_.begin(), pinned_order_.end(), key));
        pinned_order_.push_back(key);
      }
      return o;
    }
    const int64_t own = group, over = static_cast<int64_t>(pools_.size()) - 1;
    int64_t pool = -1;
    if (Count(own) < pools_[own].capacity) {
      pool = own;
    } else if (Count(over) < pools_[over].capacity) {
      pool = over;
    } else {
      const int mine = Victim(own), theirs = Victim(over);
      int v = mine;
      if (theirs >= 0 && (mine < 0 || entries_[theirs].stamp < entries_[mine].stamp)) v = theirs;
      if (v < 0) {
        o.bypass = true;
        return o;
      }
      o.evicted = entries_[v].key;
      pool = entries_[v].pool;
      entries_.erase(entries_.begin() + v);
    }
    entries_.push_back({key, pool, 0, 0, true, false});
    pinned_order_.push_back(key);
    return o;
  }
  void EndToken() {
    for (int64_t key : pinned_order_) {
      for (auto& e : entries_) {
        if (e.key != key) continue;
        e.pinned = false;
        e.stamp = ++clock_;
        e.segment = e.hit ? 1 : 0;
        if (e.segment == 1 && ProtectedCount(e.pool) > pools_[e.pool].protected_cap) {
          int d = -1;  // the pool's least recently released protected entry drops back to probation
          for (size_t i = 0; i < entries_.size(); ++i) {
            const Entry& x = entries_[i];
            if (x.pool == e.pool && !x.pinned && x.segment == 1 && (d < 0 || x.stamp < entries_[d].stamp)) {
              d = static_cast<int>(i);
            }
          }
          entries_[d].segment = 0;
          entries_[d].hit = false;
          entries_[d].stamp = ++clock_;
        }
        break;
      }
    }
    pinned_order_.clear();
  }

 private:
  struct Entry {
    int64_t key, pool;
    int segment;
    uint64_t stamp;
    bool pinned, hit;
  };
  struct Pool {
    int64_t capacity, protected_cap;
  };
  int64_t Count(int64_t pool) const {
    return std::count_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.pool == pool; });
  }
  int64_t ProtectedCount(int64_t pool) const {
    return std::count_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return e.pool == pool && !e.pinned && e.segment == 1; });
  }
  // Least recently released unpinned entry of the probation segment, else of the protected one; -1 if none.
  int Victim(int64_t pool) const {
    for (int segment : {0, 1}) {
      int best = -1;
      for (size_t i = 0; i < entries_.size(); ++i) {
        const Entry& e = entries_[i];
        if (e.pool != pool || e.pinned || e.segment != segment) continue;
        if (best < 0 || e.stamp < entries_[best].stamp) best = static_cast<int>(i);
      }
      if (best >= 0) return best;
    }
    return -1;
  }
  std::vector<Pool> pools_;
  std::vector<Entry> entries_;
  std::vector<int64_t> pinned_order_;
  uint64_t clock_ = 0;
};

// As RunTrace, against ReferenceSegmented: per-group partitions, an overflow pool and a protected share.
void RunSegmentedTrace(RegionConfig config, int64_t overflow, double protected_fraction, uint64_t seed, int tokens) {
  config.overflow_slots = overflow;
  config.protected_fraction = protected_fraction;
  int64_t n_slots = overflow;
  for (int64_t s : config.slots_per_group) n_slots += s;
  std::vector<uint8_t> memory(static_cast<size_t>(n_slots) * AlignSlot(kBundle) + 1);
  auto region = SlotRegion::Create(config, memory.data());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  SlotRegion& r = **region;
  EXPECT_EQ(r.SlotCount(), n_slots);
  ReferenceSegmented ref(config.slots_per_group, overflow, protected_fraction);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  uint64_t hits = 0, evictions = 0, bypasses = 0;
  for (int t = 0; t < tokens; ++t) {
    std::vector<std::pair<int64_t, int64_t>> accesses;
    for (int64_t g = 0; g < config.n_groups; ++g) {
      // Skewed popularity, plus a window of units that moves every few tokens (reuse a little beyond the capacity).
      for (int64_t u = 0; u < config.units_per_group; ++u) {
        const bool window = (u + t / 3) % config.units_per_group < 6;
        if (uni(rng) < 0.5 / (1.0 + u / 4.0) || (window && uni(rng) < 0.7)) accesses.emplace_back(g, u);
      }
    }
    std::shuffle(accesses.begin(), accesses.end(), rng);
    if (!accesses.empty() && uni(rng) < 0.3) accesses.push_back(accesses[rng() % accesses.size()]);
    std::vector<int32_t> held;
    for (auto [g, u] : accesses) {
      const int64_t key = g * config.units_per_group + u;
      const ReferenceSegmented::Outcome want = ref.Access(g, key);
      const SlotRegion::Lookup got = r.Acquire(g, u);
      SCOPED_TRACE("token " + std::to_string(t) + " group " + std::to_string(g) + " unit " + std::to_string(u));
      ASSERT_EQ(got.hit, want.hit);
      ASSERT_EQ(got.slot < 0, want.bypass);
      ASSERT_EQ(got.evicted_unit, want.evicted < 0 ? -1 : want.evicted % config.units_per_group);
      hits += want.hit;
      evictions += want.evicted >= 0;
      bypasses += want.bypass;
      if (got.slot >= 0) held.push_back(got.slot);
    }
    for (int32_t s : held) r.Release(s);
    ref.EndToken();
  }
  EXPECT_EQ(r.TotalCounters().hits, hits);
  EXPECT_EQ(r.TotalCounters().evictions, evictions);
  EXPECT_EQ(r.TotalCounters().bypasses, bypasses);
  EXPECT_GT(hits, 0u);
  EXPECT_GT(evictions, 0u);
}

TEST(NeuronCacheTest, SegmentedLruMatchesReference) {
  for (uint64_t seed = 21; seed <= 24; ++seed) {
    RunSegmentedTrace(Region(3, 40, {8, 3, 12}, 0), 0, 0.5, seed, 50);
    RunSegmentedTrace(Region(3, 40, {8, 3, 12}, 0), 0, 0.8, seed, 50);
  }
}

TEST(NeuronCacheTest, OverflowPoolMatchesReference) {
  for (uint64_t seed = 31; seed <= 34; ++seed) {
    RunSegmentedTrace(Region(3, 40, {8, 0, 12}, 0), 9, 0.0, seed, 50);  // group 1 lives in the pool alone
    RunSegmentedTrace(Region(3, 40, {8, 4, 12}, 0), 9, 0.5, seed, 50);
    RunSegmentedTrace(Region(2, 30, {2, 3}, 0), 2, 0.0, seed, 40);      // tiny: bypasses when all is pinned
  }
}

// NextVictim names the slot the next miss of a group evicts (own partition, overflow pool, segments), and Touch takes
// an unpinned unit out of the way like a use: the offloaded FFN relies on both to keep a token's misses from evicting
// the units the same token hits next.
TEST(NeuronCacheTest, NextVictimIsWhatAMissEvictsAndTouchDefersIt) {
  for (double protected_fraction : {0.0, 0.5}) {
    RegionConfig config = Region(3, 40, {8, 4, 12}, 0);
    config.overflow_slots = 9;
    config.protected_fraction = protected_fraction;
    std::vector<uint8_t> memory(static_cast<size_t>(33) * AlignSlot(kBundle) + 1);
    auto region = SlotRegion::Create(config, memory.data());
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    SlotRegion& r = **region;
    std::mt19937_64 rng(77);
    int checked_evictions = 0, touches = 0;
    for (int t = 0; t < 60; ++t) {
      std::vector<int32_t> held;
      for (int a = 0; a < 6; ++a) {
        const int64_t g = static_cast<int64_t>(rng() % 3);
        const int64_t u = static_cast<int64_t>(rng() % 40);
        const bool miss = r.Find(g, u) < 0;
        int32_t v = r.NextVictim(g);
        if (miss && v >= 0 && rng() % 3 == 0) {
          // Touch: the victim becomes the most recently used; the next one differs (and is still what a miss takes).
          const int64_t vg = r.GroupOf(v), vu = r.UnitOf(v);
          r.Touch(v);
          ++touches;
          EXPECT_EQ(r.Find(vg, vu), v);  // still held
          const int32_t next = r.NextVictim(g);
          EXPECT_NE(next, v);
          v = next;
        }
        const int64_t vg = v >= 0 ? r.GroupOf(v) : -1, vu = v >= 0 ? r.UnitOf(v) : -1;
        const SlotRegion::Lookup l = r.Acquire(g, u);
        if (!miss) {
          EXPECT_TRUE(l.hit);
        } else if (v >= 0) {
          EXPECT_EQ(l.slot, v);
          EXPECT_EQ(l.evicted_unit, vu);
          EXPECT_EQ(r.Find(vg, vu), -1);
          ++checked_evictions;
        } else {
          EXPECT_EQ(l.evicted_unit, -1);  // a free slot, or a bypass
        }
        if (l.slot >= 0) held.push_back(l.slot);
      }
      for (int32_t s : held) r.Release(s);
    }
    EXPECT_GT(checked_evictions, 50);
    EXPECT_GT(touches, 10);
  }
}

// With a protected segment, a touched unit moves there as a hit would: touching the units a token is about to hit
// reaches a victim it does not use. (Kept in probation, the touched units would only rotate among themselves.)
TEST(NeuronCacheTest, TouchedUnitsLeaveProbation) {
  RegionConfig config = Region(1, 16, {8}, 0);
  config.protected_fraction = 0.5;
  std::vector<uint8_t> memory(static_cast<size_t>(8) * AlignSlot(kBundle) + 1);
  auto region = SlotRegion::Create(config, memory.data());
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  SlotRegion& r = **region;
  auto token = [&](std::initializer_list<int64_t> units) {
    std::vector<int32_t> held;
    for (int64_t u : units) held.push_back(r.Acquire(0, u).slot);
    for (int32_t s : held) r.Release(s);
  };
  token({0, 1, 2, 3});
  token({0, 1, 2, 3});  // hit: protected
  token({4, 5, 6, 7});  // probation
  const std::set<int64_t> active = {4, 5, 6, 7};
  int touches = 0;
  int32_t v = r.NextVictim(0);
  while (v >= 0 && active.count(r.UnitOf(v)) != 0 && touches < 16) {
    r.Touch(v);
    ++touches;
    v = r.NextVictim(0);
  }
  EXPECT_EQ(touches, 4);
  ASSERT_GE(v, 0);
  EXPECT_EQ(active.count(r.UnitOf(v)), 0u) << "victim unit " << r.UnitOf(v);
  for (int64_t u = 0; u < 8; ++u) EXPECT_GE(r.Find(0, u), 0) << "unit " << u;  // touching evicts nothing
}

// With protected_fraction 0 the segmented region is the plain LRU (ReferenceLru, the other model).
TEST(NeuronCacheTest, ZeroProtectedShareIsPlainLru) {
  RegionConfig c = Region(4, 40, {6, 0, 13, 3}, 0);
  c.protected_fraction = 0.0;
  RunTrace(c, 7, 60);
}

// The scenario the segmented LRU is for: units reused a few times (hit, so protected) and a stream of units used
// once that would push them out. Per round: 6 warm units twice, then 4 of 14 scan units, through 8 slots. Plain LRU
// loses 2 warm units to each scan, and the first pass then evicts the warm units it is about to use (only the
// second pass hits: 6 a round); with 6 protected slots the scan passes through probation (12 a round after the first).
TEST(NeuronCacheTest, ProtectedSegmentKeepsReusedUnitsThroughAScan) {
  auto hits_for = [](double protected_fraction) {
    RegionConfig c = Region(1, 20, {8}, 0);
    c.protected_fraction = protected_fraction;
    std::vector<uint8_t> memory(8 * AlignSlot(kBundle));
    auto region = SlotRegion::Create(c, memory.data());
    EXPECT_TRUE(region.ok());
    uint64_t hits = 0;
    auto use = [&](int64_t u) {
      auto l = (*region)->Acquire(0, u);
      hits += l.hit;
      (*region)->Release(l.slot);
    };
    for (int round = 0; round < 20; ++round) {
      for (int pass = 0; pass < 2; ++pass) {
        for (int u = 0; u < 6; ++u) use(u);
      }
      for (int k = 0; k < 4; ++k) use(6 + (4 * round + k) % 14);
    }
    return hits;
  };
  const uint64_t lru = hits_for(0.0), slru = hits_for(0.75);
  EXPECT_EQ(lru, 20u * 6u);
  EXPECT_EQ(slru, 6u + 19u * 12u);
}

// A lookahead guess never takes the overflow pool (use_overflow false), which stays room for the layer being computed.
TEST(NeuronCacheTest, OverflowPoolIsOptional) {
  RegionConfig c = Region(2, 10, {1, 1}, 0);
  c.overflow_slots = 2;
  std::vector<uint8_t> memory(4 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(c, memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  auto a = r.Acquire(0, 1, /*use_overflow=*/false);
  ASSERT_GE(a.slot, 0);
  EXPECT_FALSE(r.CanPlace(0));
  EXPECT_EQ(r.Acquire(0, 2, /*use_overflow=*/false).slot, -1) << "partition pinned, pool not allowed";
  auto b = r.Acquire(0, 3);
  EXPECT_GE(b.slot, 2) << "the pool's slots come after the partitions'";
  EXPECT_FALSE(r.CanPlace(0)) << "CanPlace speaks for the partition only";
}

// Lend (batched prefill's buffers in cold slots): the lent slots' units are dropped and the slots are never handed out
// until Reclaim, whichever partition they belong to; pinned slots cannot be lent; after Reclaim every slot serves again.
TEST(NeuronCacheTest, LentSlotsAreOutOfServiceUntilReclaimed) {
  RegionConfig c = Region(2, 10, {3, 3}, 0);
  c.overflow_slots = 2;  // slots 0-2 layer 0, 3-5 layer 1, 6-7 pool
  std::vector<uint8_t> memory(8 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(c, memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  // Fill every slot: units 0-4 of layer 0 (3 in its partition, 2 in the pool), units 0-2 of layer 1.
  std::vector<int32_t> slot_of(8, -1);
  for (int u = 0; u < 5; ++u) slot_of[u] = r.Acquire(0, u).slot;
  for (int u = 0; u < 3; ++u) slot_of[5 + u] = r.Acquire(1, u).slot;
  for (int32_t s : slot_of) ASSERT_GE(s, 0);
  // A pinned slot in the range: refused, nothing changes.
  EXPECT_FALSE(r.Lend(4, 4).ok());
  EXPECT_EQ(r.lent_count(), 0);
  EXPECT_FALSE(r.Lend(7, 2).ok()) << "past the region's end";
  for (int32_t s : slot_of) r.Release(s);
  // Lend the last 4 slots (layer 1's partition from slot 4 and the pool).
  ASSERT_TRUE(r.Lend(4, 4).ok());
  EXPECT_EQ(r.lent_count(), 4);
  EXPECT_FALSE(r.Lend(0, 1).ok()) << "one loan at a time";
  for (int u = 0; u < 5; ++u) {
    for (int g = 0; g < 2; ++g) {
      const int32_t s = r.Find(g, u);
      EXPECT_TRUE(s < 4) << "unit " << g << "/" << u << " still mapped to lent slot " << s;
    }
  }
  // Any number of misses from both layers never lands in a lent slot.
  for (int round = 0; round < 3; ++round) {
    for (int g = 0; g < 2; ++g) {
      for (int u = 0; u < 10; ++u) {
        const auto l = r.Acquire(g, u);
        EXPECT_LT(l.slot, 4) << "layer " << g << " unit " << u;
        if (l.slot >= 0) r.Release(l.slot);
      }
    }
  }
  // Reclaimed: all 8 slots hold units again (10 distinct units of layer 0 over its partition and the pool, 10 of
  // layer 1 over its partition and the pool: every slot gets used).
  r.Reclaim();
  EXPECT_EQ(r.lent_count(), 0);
  std::vector<int> used(8, 0);
  for (int u = 0; u < 10; ++u) {
    for (int g = 0; g < 2; ++g) {
      const auto l = r.Acquire(g, u);
      if (l.slot >= 0) {
        used[static_cast<size_t>(l.slot)] = 1;
        r.Release(l.slot);
      }
    }
  }
  EXPECT_EQ(std::count(used.begin(), used.end(), 1), 8);
}

// A loan that starts at the last slot of one partition: that partition's free slots are rebuilt too (slot 2 below
// is free when lent and must leave layer 0's free stack), so no miss of either layer lands in a lent slot.
TEST(NeuronCacheTest, LoanStartingAtAPartitionsLastSlotTakesItOutOfService) {
  const RegionConfig c = Region(2, 10, {3, 3}, 0);  // slots 0-2 layer 0, 3-5 layer 1; all free
  std::vector<uint8_t> memory(6 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(c, memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  ASSERT_TRUE(r.Lend(2, 2).ok());  // layer 0's last slot and layer 1's first
  for (int round = 0; round < 2; ++round) {
    for (int g = 0; g < 2; ++g) {
      std::vector<int32_t> held;
      for (int u = 0; u < 10; ++u) {
        const auto l = r.Acquire(g, u);
        EXPECT_TRUE(l.slot != 2 && l.slot != 3) << "layer " << g << " unit " << u << " got lent slot " << l.slot;
        if (l.slot >= 0) held.push_back(l.slot);
      }
      // Two slots are left to each layer: the rest of the ten units bypass (every slot is pinned).
      EXPECT_EQ(held.size(), 2u) << "layer " << g;
      for (int32_t s : held) r.Release(s);
    }
  }
}

// The first misses fill the arena front to back (the free stacks are ascending), so that a partly filled overflow
// pool keeps its units in its first slots and batched prefill, which lends the region's last slots, drops none of them.
TEST(NeuronCacheTest, FreeSlotsAreTakenInAscendingOrder) {
  RegionConfig c = Region(1, 10, {2}, 0);
  c.overflow_slots = 4;  // slots 0-1 the layer's, 2-5 the pool
  std::vector<uint8_t> memory(6 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(c, memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  for (int u = 0; u < 4; ++u) {
    const auto l = r.Acquire(0, u);
    EXPECT_EQ(l.slot, u);
    r.Release(l.slot);
  }
  ASSERT_TRUE(r.Lend(4, 2).ok());
  for (int u = 0; u < 4; ++u) EXPECT_EQ(r.Find(0, u), u) << "unit " << u << " dropped by the loan";
}

// A slot released as least recently used counts as older than any other when a miss chooses between its partition's
// victim and the overflow pool's (ReleaseAsLru's stamp 0): the guess nobody used goes, not the pool's oldest unit.
TEST(NeuronCacheTest, ReleasedAsLruIsOlderThanThePoolsVictim) {
  RegionConfig c = Region(1, 10, {2}, 0);
  c.overflow_slots = 2;
  std::vector<uint8_t> memory(4 * AlignSlot(kBundle));
  auto region = SlotRegion::Create(c, memory.data());
  ASSERT_TRUE(region.ok());
  SlotRegion& r = **region;
  const auto a = r.Acquire(0, 1), b = r.Acquire(0, 2);  // the layer's partition
  const auto p = r.Acquire(0, 3), q = r.Acquire(0, 4);  // the pool
  ASSERT_LT(b.slot, 2);
  ASSERT_GE(p.slot, 2);
  r.Release(p.slot);  // the pool's units: released first, the oldest of the ordinary releases
  r.Release(q.slot);
  r.Release(a.slot);
  r.ReleaseAsLru(b.slot);  // released last, but as a guess nobody used
  const auto m = r.Acquire(0, 5);
  EXPECT_EQ(m.slot, b.slot);
  EXPECT_EQ(m.evicted_unit, 2);
}

TEST(NeuronCacheTest, RejectsInvalidConfigs) {
  auto expect_invalid = [](const NeuronCacheConfig& config, const std::string& needle) {
    auto cache = NeuronCache::Create(config);
    ASSERT_FALSE(cache.ok());
    EXPECT_EQ(cache.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(cache.status().message().find(needle), std::string::npos) << cache.status().message();
  };
  NeuronCacheConfig c;
  c.cold = Region(3, 10, {1, 2}, 0);
  expect_invalid(c, "slots_per_group has 2 entries, expected n_groups = 3");
  c.cold = Region(2, 10, {1, -2}, 0);
  expect_invalid(c, "slots_per_group[1] = -2");
  c.cold = Region(2, 10, {}, 4);
  c.cold.slot_stride = 5000;
  expect_invalid(c, "slot_stride 5000 must be a multiple of 512");
  c.cold = Region(2, 10, {}, 4);
  c.cold.slot_stride = 4096;  // < unit_bytes (3456 fits, so use a larger unit)
  c.cold.unit_bytes = 4097;
  expect_invalid(c, ">= unit_bytes 4097");
  c.cold = Region(2, 10, {}, 4);
  c.hot = Region(2, 2, {}, 1);
  c.hot_cluster_neurons = 0;
  expect_invalid(c, "hot_cluster_neurons is 0");
  c.hot = Region(1 << 20, 1 << 12, {}, 0);
  expect_invalid(c, "exceeds 2^31 units");
  c.hot = Region(2, 2, {}, 0);
  c.cold = Region(2, 10, {}, 4);
  c.cold.overflow_slots = 3;
  expect_invalid(c, "overflow_slots needs slots_per_group");
  c.cold = Region(2, 10, {1, 1}, 0);
  c.cold.protected_fraction = 1.0;
  expect_invalid(c, "protected_fraction 1.000000 must be in [0, 1)");
}

}  // namespace
}  // namespace nflash::sparse
