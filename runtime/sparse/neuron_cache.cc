// The segmented neuron cache: slot regions with O(1) lookup and eviction over one preallocated arena.
#include "runtime/sparse/neuron_cache.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace nflash::sparse {

CacheCounters& CacheCounters::operator+=(const CacheCounters& o) {
  hits += o.hits;
  misses += o.misses;
  bypasses += o.bypasses;
  evictions += o.evictions;
  bytes_loaded += o.bytes_loaded;
  return *this;
}

namespace {

Status CheckRegion(const RegionConfig& c, const char* name, int64_t* total_slots) {
  auto bad = [&](const std::string& what) { return Status::InvalidArgument(std::string("neuron cache ") + name + " region: " + what); };
  if (c.n_groups < 0 || c.units_per_group < 0) {
    return bad("n_groups " + std::to_string(c.n_groups) + " and units_per_group " + std::to_string(c.units_per_group) +
               " must be >= 0");
  }
  // Lookup tables and slot links are int32: 2^31 units is far beyond any model (a 70B model has ~2.3M FFN neurons).
  if (c.n_groups != 0 && c.units_per_group > std::numeric_limits<int32_t>::max() / c.n_groups) {
    return bad("n_groups x units_per_group = " + std::to_string(c.n_groups) + " x " + std::to_string(c.units_per_group) +
               " exceeds 2^31 units");
  }
  if (!(c.protected_fraction >= 0.0 && c.protected_fraction < 1.0)) {
    return bad("protected_fraction " + std::to_string(c.protected_fraction) + " must be in [0, 1)");
  }
  int64_t slots = 0;
  if (!c.slots_per_group.empty()) {
    if (static_cast<int64_t>(c.slots_per_group.size()) != c.n_groups) {
      return bad("slots_per_group has " + std::to_string(c.slots_per_group.size()) + " entries, expected n_groups = " +
                 std::to_string(c.n_groups));
    }
    for (size_t g = 0; g < c.slots_per_group.size(); ++g) {
      if (c.slots_per_group[g] < 0) {
        return bad("slots_per_group[" + std::to_string(g) + "] = " + std::to_string(c.slots_per_group[g]) + " is negative");
      }
      slots += c.slots_per_group[g];
      if (slots > std::numeric_limits<int32_t>::max()) return bad("more than 2^31 slots");
    }
    if (c.overflow_slots < 0 || slots + c.overflow_slots > std::numeric_limits<int32_t>::max()) {
      return bad("overflow_slots " + std::to_string(c.overflow_slots) + " is negative or makes more than 2^31 slots");
    }
    slots += c.overflow_slots;
  } else {
    if (c.overflow_slots != 0) return bad("overflow_slots needs slots_per_group (one partition per group)");
    if (c.shared_slots < 0 || c.shared_slots > std::numeric_limits<int32_t>::max()) {
      return bad("shared_slots " + std::to_string(c.shared_slots) + " is outside [0, 2^31)");
    }
    slots = c.shared_slots;
  }
  if (slots > 0 && c.unit_bytes == 0) return bad("unit_bytes is 0 but the region has " + std::to_string(slots) + " slots");
  if (c.slot_stride % kMinSlotAlignment != 0 || (c.slot_stride != 0 && c.slot_stride < c.unit_bytes)) {
    return bad("slot_stride " + std::to_string(c.slot_stride) + " must be a multiple of " +
               std::to_string(kMinSlotAlignment) + " and >= unit_bytes " + std::to_string(c.unit_bytes));
  }
  *total_slots = slots;
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SlotRegion>> SlotRegion::Create(const RegionConfig& config, uint8_t* arena) {
  int64_t n_slots = 0;
  NF_RETURN_IF_ERROR(CheckRegion(config, "slot", &n_slots));
  std::unique_ptr<SlotRegion> r(new SlotRegion());
  r->config_ = config;
  if (r->config_.slot_stride == 0) r->config_.slot_stride = AlignSlot(config.unit_bytes);
  if (n_slots > 0 && arena == nullptr) return Status::InvalidArgument("neuron cache region: no arena for its slots");
  r->arena_ = arena;
  r->slot_of_key_.assign(static_cast<size_t>(config.n_groups * config.units_per_group), -1);
  r->slots_.resize(static_cast<size_t>(n_slots));
  r->counters_.resize(static_cast<size_t>(config.n_groups));
  if (config.slots_per_group.empty()) {
    r->partitions_.resize(1);
    r->partitions_[0].n_slots = n_slots;
  } else {
    r->partitions_.resize(config.slots_per_group.size());
    int64_t first = 0;
    for (size_t g = 0; g < config.slots_per_group.size(); ++g) {
      r->partitions_[g].first_slot = first;
      r->partitions_[g].n_slots = config.slots_per_group[g];
      first += config.slots_per_group[g];
    }
    if (config.overflow_slots > 0) {
      r->overflow_ = static_cast<int32_t>(r->partitions_.size());
      r->partitions_.emplace_back();
      r->partitions_.back().first_slot = first;
      r->partitions_.back().n_slots = config.overflow_slots;
    }
  }
  for (size_t p = 0; p < r->partitions_.size(); ++p) {
    r->partitions_[p].protected_cap =
        static_cast<int32_t>(p) == r->overflow_
            ? 0
            : static_cast<int64_t>(config.protected_fraction * static_cast<double>(r->partitions_[p].n_slots));
    for (int64_t s = r->partitions_[p].first_slot; s < r->partitions_[p].first_slot + r->partitions_[p].n_slots; ++s) {
      r->slots_[s].partition = static_cast<int32_t>(p);
    }
  }
  r->Clear();
  return r;
}

void SlotRegion::Clear() {
  for (auto& s : slots_) {
    if (s.pins != 0) std::abort();  // a pinned slot is being filled or read: clearing it would be a use-after-free
    if (s.key >= 0) slot_of_key_[s.key] = -1;
    s.key = -1;
    s.prev = -1;
    s.segment = 0;
    s.hit = false;
    s.stamp = 0;
  }
  for (auto& p : partitions_) {
    p.list[0] = p.list[1] = List{};
    RebuildFree(p);
  }
}

void SlotRegion::RebuildFree(Partition& p) {
  // Free stack in ascending slot order so that the first misses fill the arena front to back.
  p.free_top = -1;
  for (int64_t s = p.first_slot + p.n_slots - 1; s >= p.first_slot; --s) {
    if (slots_[s].key >= 0 || IsLent(s)) continue;
    slots_[s].next = p.free_top;
    p.free_top = static_cast<int32_t>(s);
  }
}

void SlotRegion::RebuildFreeOverlapping(int64_t first, int64_t end) {
  for (auto& p : partitions_) {
    if (p.first_slot < end && p.first_slot + p.n_slots > first) RebuildFree(p);
  }
}

Status SlotRegion::Lend(int32_t first, int32_t count) {
  if (lent_count_ > 0) {
    return Status::Internal("neuron cache: " + std::to_string(lent_count_) + " slots are lent already");
  }
  if (first < 0 || count <= 0 || static_cast<int64_t>(first) + count > SlotCount()) {
    return Status::InvalidArgument("neuron cache: cannot lend slots [" + std::to_string(first) + ", " +
                                   std::to_string(static_cast<int64_t>(first) + count) + ") of " +
                                   std::to_string(SlotCount()));
  }
  for (int32_t s = first; s < first + count; ++s) {
    if (slots_[s].pins != 0) {
      return Status::Internal("neuron cache: slot " + std::to_string(s) + " to lend is pinned");
    }
  }
  for (int32_t s = first; s < first + count; ++s) {
    Slot& x = slots_[s];
    if (x.key < 0) continue;
    slot_of_key_[x.key] = -1;
    Unlink(s);
    x.key = -1;
    x.segment = 0;
  }
  lent_first_ = first;
  lent_count_ = count;
  RebuildFreeOverlapping(first, first + count);
  return Status::Ok();
}

void SlotRegion::Reclaim() {
  if (lent_count_ == 0) return;
  const int64_t end = static_cast<int64_t>(lent_first_) + lent_count_;
  lent_count_ = 0;
  RebuildFreeOverlapping(lent_first_, end);
}

void SlotRegion::Unlink(int32_t s) {
  Slot& x = slots_[s];
  List& l = partitions_[x.partition].list[x.segment];
  if (x.prev >= 0) slots_[x.prev].next = x.next; else l.head = x.next;
  if (x.next >= 0) slots_[x.next].prev = x.prev; else l.tail = x.prev;
  x.prev = x.next = -1;
  --l.size;
}

void SlotRegion::PushMru(int32_t s, int segment) {
  Slot& x = slots_[s];
  Partition& p = partitions_[x.partition];
  List& l = p.list[segment];
  x.segment = static_cast<uint8_t>(segment);
  x.stamp = ++clock_;
  x.next = -1;
  x.prev = l.tail;
  if (l.tail >= 0) slots_[l.tail].next = s; else l.head = s;
  l.tail = s;
  ++l.size;
  if (segment == 1 && l.size > p.protected_cap) {
    // Over its share: the protected segment's least recently used unit drops back to probation, as most recent there.
    const int32_t d = l.head;
    Unlink(d);
    slots_[d].hit = false;
    PushMru(d, 0);
  }
}

size_t SlotRegion::Source(int64_t group, bool use_overflow) const {
  const size_t own_index = static_cast<size_t>(PartitionOf(group));
  const Partition& own = partitions_[own_index];
  // Where the slot comes from: the partition's free stack, else the overflow pool's, else the older of the two
  // least recently used units (the pool's alone when every slot of the partition is pinned).
  if (own.free_top < 0 && use_overflow && overflow_ >= 0) {
    const Partition& pool = partitions_[static_cast<size_t>(overflow_)];
    const int32_t mine = Victim(own), theirs = Victim(pool);
    if (pool.free_top >= 0 || (theirs >= 0 && (mine < 0 || slots_[theirs].stamp < slots_[mine].stamp))) {
      return static_cast<size_t>(overflow_);
    }
  }
  return own_index;
}

int32_t SlotRegion::NextVictim(int64_t group, bool use_overflow) const {
  const Partition& p = partitions_[Source(group, use_overflow)];
  return p.free_top >= 0 ? -1 : Victim(p);
}

void SlotRegion::Touch(int32_t s) {
  Slot& x = slots_[static_cast<size_t>(s)];
  if (x.pins != 0 || x.key < 0 || IsLent(s)) std::abort();  // only a held, unpinned unit is on a list
  Unlink(s);
  // As a hit: into the protected segment (whose least recently used unit, when it is over its share, drops back to
  // probation as its most recent), so that the next victim is not the touched unit's probation neighbour again.
  x.hit = true;
  PushMru(s, 1);
}

SlotRegion::Lookup SlotRegion::Acquire(int64_t group, int64_t unit, bool use_overflow) {
  const int64_t key = group * config_.units_per_group + unit;
  Lookup out;
  CacheCounters& c = counters_[group];
  int32_t s = slot_of_key_[key];
  if (s >= 0) {
    // Pinned slots are off the LRU list (so the list head is always evictable); the first pin unlinks it.
    if (slots_[s].pins++ == 0) Unlink(s);
    slots_[s].hit = true;
    ++c.hits;
    out.slot = s;
    out.hit = true;
    return out;
  }
  ++c.misses;
  c.bytes_loaded += config_.unit_bytes;
  Partition& p = partitions_[Source(group, use_overflow)];
  const int32_t victim = Victim(p);
  if (p.free_top >= 0) {
    s = p.free_top;
    p.free_top = slots_[s].next;
    slots_[s].next = -1;
  } else if (victim >= 0) {
    s = victim;
    Unlink(s);
    const int64_t old = slots_[s].key;
    slot_of_key_[old] = -1;
    ++counters_[old / config_.units_per_group].evictions;
    out.evicted_unit = old % config_.units_per_group;
  } else {
    ++c.bypasses;
    return out;
  }
  slots_[s].key = key;
  slots_[s].pins = 1;
  slots_[s].hit = false;
  slot_of_key_[key] = s;
  out.slot = s;
  return out;
}

void SlotRegion::Release(int32_t s) {
  Slot& x = slots_[s];
  if (x.pins <= 0) std::abort();  // unbalanced Release: the LRU list would be corrupted
  if (--x.pins == 0) PushMru(s, x.hit ? 1 : 0);
}

void SlotRegion::ReleaseAsLru(int32_t s) {
  Slot& x = slots_[s];
  if (x.pins <= 0) std::abort();
  if (--x.pins != 0) return;
  List& l = partitions_[x.partition].list[0];
  x.segment = 0;
  x.hit = false;
  x.stamp = 0;
  x.prev = -1;
  x.next = l.head;
  if (l.head >= 0) slots_[l.head].prev = s; else l.tail = s;
  l.head = s;
  ++l.size;
}

void SlotRegion::Abandon(int32_t s) {
  Slot& x = slots_[s];
  if (x.pins != 1) std::abort();  // only the filler (sole pin holder) may abandon a slot
  slot_of_key_[x.key] = -1;
  x.key = -1;
  x.pins = 0;
  Partition& p = partitions_[x.partition];
  x.next = p.free_top;
  p.free_top = s;
}

CacheCounters SlotRegion::TotalCounters() const {
  CacheCounters t;
  for (const auto& c : counters_) t += c;
  return t;
}

void SlotRegion::ResetCounters() {
  for (auto& c : counters_) c = CacheCounters();
}

namespace {

struct ArenaLayout {
  int64_t hot_slots = 0, cold_slots = 0;
  size_t hot_bytes = 0, total = 0;
};

Result<ArenaLayout> LayoutArena(const NeuronCacheConfig& config) {
  ArenaLayout a;
  NF_RETURN_IF_ERROR(CheckRegion(config.hot, "hot", &a.hot_slots));
  NF_RETURN_IF_ERROR(CheckRegion(config.cold, "cold", &a.cold_slots));
  if (a.hot_slots > 0 && config.hot_cluster_neurons <= 0) {
    return Status::InvalidArgument("neuron cache: hot region has slots but hot_cluster_neurons is " +
                                   std::to_string(config.hot_cluster_neurons));
  }
  const size_t hot_stride = config.hot.slot_stride ? config.hot.slot_stride : AlignSlot(config.hot.unit_bytes);
  const size_t cold_stride = config.cold.slot_stride ? config.cold.slot_stride : AlignSlot(config.cold.unit_bytes);
  size_t cold_bytes = 0;
  if (__builtin_mul_overflow(static_cast<size_t>(a.hot_slots), hot_stride, &a.hot_bytes) ||
      __builtin_mul_overflow(static_cast<size_t>(a.cold_slots), cold_stride, &cold_bytes) ||
      __builtin_add_overflow(a.hot_bytes, cold_bytes, &a.total)) {
    return Status::InvalidArgument("neuron cache: arena size overflows");
  }
  return a;
}

}  // namespace

Result<size_t> NeuronCache::ArenaBytes(const NeuronCacheConfig& config) {
  NF_ASSIGN_OR_RETURN(ArenaLayout a, LayoutArena(config));
  return a.total;
}

Result<std::unique_ptr<NeuronCache>> NeuronCache::Create(const NeuronCacheConfig& config, uint8_t* external,
                                                         size_t external_bytes) {
  NF_ASSIGN_OR_RETURN(ArenaLayout a, LayoutArena(config));
  std::unique_ptr<NeuronCache> cache(new NeuronCache());
  if (external != nullptr) {
    if (external_bytes < a.total || reinterpret_cast<uintptr_t>(external) % kSlotAlignment != 0) {
      return Status::InvalidArgument("neuron cache: the given arena (" + std::to_string(external_bytes) +
                                     " bytes) must hold " + std::to_string(a.total) + " bytes and be aligned to " +
                                     std::to_string(kSlotAlignment));
    }
    cache->arena_ = external;
  } else if (a.total > 0) {
    cache->arena_ = static_cast<uint8_t*>(std::aligned_alloc(kSlotAlignment, AlignSlot(a.total)));
    if (cache->arena_ == nullptr) {
      return Status::ResourceExhausted("neuron cache: cannot allocate an arena of " + std::to_string(a.total) +
                                       " bytes");
    }
    cache->owns_arena_ = true;
  }
  // Touch every page now: the memory budget counts the arena as resident, and first-touch faults during decode
  // would add latency to the first tokens.
  if (a.total > 0) std::memset(cache->arena_, 0, a.total);
  cache->arena_bytes_ = a.total;
  cache->hot_cluster_neurons_ = config.hot_cluster_neurons;
  NF_ASSIGN_OR_RETURN(cache->hot_, SlotRegion::Create(config.hot, a.hot_slots ? cache->arena_ : nullptr));
  NF_ASSIGN_OR_RETURN(cache->cold_,
                      SlotRegion::Create(config.cold, a.cold_slots ? cache->arena_ + a.hot_bytes : nullptr));
  return cache;
}

NeuronCache::~NeuronCache() {
  hot_.reset();
  cold_.reset();
  if (owns_arena_) std::free(arena_);
}

}  // namespace nflash::sparse
