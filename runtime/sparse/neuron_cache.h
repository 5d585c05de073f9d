// The segmented neuron cache of the sparse runtime (PowerInfer-2 section "neuron cache"): a hot region of clusters of
// consecutive hot neurons (loaded as a unit, LRU per cluster) and a cold region of single neuron bundles (LRU per
// neuron), both carved out of one aligned arena allocated once, so that the I/O reader can register it as fixed
// buffers and no memory is allocated per token. The fixed region (resident weights, KV cache) is accounted by
// memory_budget.h, not managed here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/core/round.h"
#include "runtime/core/status.h"

namespace nflash::sparse {

// O_DIRECT needs buffers, offsets and sizes aligned to the logical block size; 4 KiB is the page size and covers every
// block device this project targets (512 B and 4 KiB sectors): the default slot alignment, and the arena's.
inline constexpr size_t kSlotAlignment = 4096;
// The smallest slot stride unit: 512 B, the smallest logical block size, where the device's direct-I/O alignment
// (statx STATX_DIOALIGN) allows it (OffloadFfn's cold slots: ColdReadBytes).
inline constexpr size_t kMinSlotAlignment = 512;

// Hit/miss accounting of one group (a layer, or one expert of a layer) of one region.
struct CacheCounters {
  uint64_t hits = 0;
  uint64_t misses = 0;        // includes bypasses
  uint64_t bypasses = 0;      // misses that got no slot (0 capacity, or every slot pinned): read into scratch
  uint64_t evictions = 0;
  uint64_t bytes_loaded = 0;  // payload bytes of every miss (what had to come from flash)
  CacheCounters& operator+=(const CacheCounters& o);
  double HitRate() const { return hits + misses == 0 ? 0.0 : static_cast<double>(hits) / (hits + misses); }
};

// Shape and capacity of one region. A "unit" is what one slot holds: a neuron bundle (cold region) or a cluster of
// consecutive hot neurons (hot region). Units are named (group, index) with group = layer * max(1, n_experts) + expert.
struct RegionConfig {
  int64_t n_groups = 0;         // layers x experts
  int64_t units_per_group = 0;  // neurons (cold) or clusters (hot) per group
  size_t unit_bytes = 0;        // payload bytes of a unit (counted as loaded on a miss)
  size_t slot_stride = 0;       // bytes between slots: >= unit_bytes, a multiple of kSlotAlignment; 0: rounded up
  // Capacity, in slots: either a budget per group (size n_groups; the planner decides cold-cache bytes per layer) or,
  // when empty, one pool of `shared_slots` slots that every group competes for.
  std::vector<int64_t> slots_per_group;
  int64_t shared_slots = 0;
  // Segmented LRU: the share of each partition's slots kept for units that were hit at least once since they were
  // loaded (the protected segment); the others (the probation segment) hold units loaded and not yet reused, and
  // evictions take the least recently used of probation first. 0: plain LRU (one list).
  double protected_fraction = 0.0;
  // With slots_per_group: an overflow pool of this many more slots shared by every group, after the partitions'.
  // A miss whose partition has no free slot takes the older of its partition's least recently used unit and the
  // pool's (a free pool slot first); when every slot of its partition is pinned, the pool's. So the pool serves as
  // cache for whichever layers used it last, and also as the room for a layer whose active set is larger than its
  // partition (the runtime sizes it n_ff minus the smallest partition, the staging it would otherwise reserve).
  int64_t overflow_slots = 0;
};

// One region: a lookup table (group, unit) -> slot, and one LRU list per partition (a partition is a group with its own
// budget, or the shared pool), split in two segments with protected_fraction > 0 (segmented LRU: a unit enters the
// probation segment when loaded and moves to the protected one when it is hit; the protected segment's least recently
// used unit drops back to probation's most recently used end when the segment is over its share; evictions take
// probation's least recently used unit, the protected one's only when probation is empty). Plain LRU thrashes when a
// layer's working set over a few tokens is a little larger than its partition (every unit is evicted just before
// its reuse); units hit once stay in the protected segment instead. Slots live at fixed places of the arena given to
// it.
//
// Pinning: Acquire pins the slot it returns (a slot being filled by I/O or read by the current token's compute), and a
// pinned slot is never evicted. A pinned slot is taken off its LRU list and put back at the most-recently-used end when
// its last pin is released; a caller that releases a token's slots in the order it acquired them (as the runtime does
// at the end of a token) therefore gets exact least-recently-used order by access.
//
// Thread-safety: not thread-safe: one thread (the runtime's scheduler) calls every method. Slot memory may be written
// by another thread (the I/O thread) between Acquire and Release: pinning guarantees the slot is not handed out again.
class SlotRegion {
 public:
  // What Acquire found.
  struct Lookup {
    int32_t slot = -1;  // -1: no slot (bypass: 0 capacity, or every slot of the partition pinned)
    bool hit = false;   // true: the slot already holds the unit's data; false: the caller must fill it (or bypass)
    // The unit whose data the slot held before (evicted), or -1; the caller may need to know (e.g. tracing).
    int64_t evicted_unit = -1;
  };

  // Validates `config` (InvalidArgument naming the field). `arena` must hold SlotCount() * slot_stride bytes; may be
  // nullptr when there are no slots.
  static Result<std::unique_ptr<SlotRegion>> Create(const RegionConfig& config, uint8_t* arena);

  // Finds (group, unit); on a hit pins it, on a miss takes a free slot or evicts the least recently used unpinned slot
  // of the partition (or of the overflow pool, see RegionConfig::overflow_slots; never with use_overflow false), maps
  // the unit to it and pins it. Counts the hit/miss/eviction.
  Lookup Acquire(int64_t group, int64_t unit, bool use_overflow = true);
  // The slot whose unit Acquire(group, ...) of a unit not held would evict now, or -1 (a free slot, or nothing to
  // evict). No side effects.
  int32_t NextVictim(int64_t group, bool use_overflow = true) const;
  // The unit held by `slot` (-1: none) and its group.
  int64_t UnitOf(int32_t slot) const {
    const int64_t key = slots_[static_cast<size_t>(slot)].key;
    return key < 0 ? -1 : key % config_.units_per_group;
  }
  int64_t GroupOf(int32_t slot) const {
    const int64_t key = slots_[static_cast<size_t>(slot)].key;
    return key < 0 ? -1 : key / config_.units_per_group;
  }
  // Makes an unpinned slot the most recently used one, as a hit would (protected segment; a unit about to be hit must
  // not be evicted by the same token's misses first).
  void Touch(int32_t slot);
  // Drops one pin; at zero the slot becomes the most recently used of its segment (protected if it was hit).
  void Release(int32_t slot);
  // Drops one pin; at zero the slot becomes the least recently used of probation (the next to evict): for data loaded
  // on a guess that no one used, so it does not push out units that were.
  void ReleaseAsLru(int32_t slot);
  // The slot's data could not be loaded: unmaps the unit, frees the slot (which must be pinned exactly once).
  void Abandon(int32_t slot);
  // The slot holding (group, unit), or -1; no side effects (no counting, no recency change).
  int32_t Find(int64_t group, int64_t unit) const {
    return slot_of_key_[static_cast<size_t>(group * config_.units_per_group + unit)];
  }
  // Starts loading the slot record of a held unit into the cache (a hint, no effect on the state): Acquire touches it
  // at random, and a batch of lookups issued after a pass of these overlaps its cache misses.
  void Prefetch(int64_t group, int64_t unit) const { PrefetchSlot(Find(group, unit)); }
  // The same for a slot (Release of many slots: a few ahead of the one released).
  void PrefetchSlot(int32_t s) const {
    if (s >= 0) __builtin_prefetch(&slots_[static_cast<size_t>(s)], 1);
  }
  // Whether Acquire of a unit of `group` that is not held would get a slot of the group's own partition (a free one,
  // or an unpinned one to evict), not counting the overflow pool.
  bool CanPlace(int64_t group) const {
    const Partition& p = partitions_[static_cast<size_t>(PartitionOf(group))];
    return p.free_top >= 0 || Victim(p) >= 0;
  }
  // Drops every unit (e.g. after the deployment changed); pinned slots are a caller bug (aborts).
  void Clear();
  // Lends slots [first, first + count) (contiguous memory: SlotData(first) .. + count * slot_stride) to the caller
  // for other use until Reclaim, e.g. batched prefill's layer buffers when the budget has no room for them beside the
  // caches: their units are dropped, and the slots are neither free nor evictable meanwhile. Internal when a slot
  // of the range is pinned or slots are lent already (caller bugs); InvalidArgument for a range outside the region.
  Status Lend(int32_t first, int32_t count);
  // The lent slots become free slots of their partitions again (their memory holds whatever the borrower left).
  void Reclaim();
  int32_t lent_count() const { return lent_count_; }

  uint8_t* SlotData(int32_t slot) const { return arena_ + static_cast<size_t>(slot) * config_.slot_stride; }
  int64_t SlotCount() const { return static_cast<int64_t>(slots_.size()); }
  int32_t PinCount(int32_t slot) const { return slots_[slot].pins; }
  size_t slot_stride() const { return config_.slot_stride; }
  uint64_t bytes() const { return static_cast<uint64_t>(slots_.size()) * config_.slot_stride; }
  const RegionConfig& config() const { return config_; }
  const CacheCounters& counters(int64_t group) const { return counters_[group]; }
  CacheCounters TotalCounters() const;
  // Overwrites one group's counters, e.g. to leave out the lookups of cache warming (they are not a token's).
  void SetCounters(int64_t group, const CacheCounters& counters) { counters_[static_cast<size_t>(group)] = counters; }
  void ResetCounters();

 private:
  SlotRegion() = default;
  struct Slot {
    int64_t key = -1;   // group * units_per_group + unit, -1 when free
    int32_t prev = -1;  // LRU neighbours (towards least / most recently used); -1 at the ends
    int32_t next = -1;
    int32_t pins = 0;
    int32_t partition = 0;
    uint8_t segment = 0;  // list it is on when unpinned: 0 probation, 1 protected
    bool hit = false;     // hit since it was loaded (goes to the protected segment on release)
    uint64_t stamp = 0;   // when it last became unpinned (release order), 0: released as least recently used
  };
  // An intrusive doubly linked list over slot indices: head = least recently used, tail = most recently used.
  struct List {
    int32_t head = -1, tail = -1;
    int64_t size = 0;
  };
  struct Partition {
    List list[2];                 // probation, protected
    int64_t protected_cap = 0;    // protected_fraction x n_slots
    int32_t free_top = -1;        // free slots form a singly linked stack through Slot::next
    int64_t first_slot = 0, n_slots = 0;
  };
  void Unlink(int32_t slot);
  void PushMru(int32_t slot, int segment);
  // Rebuilds partition `p`'s free stack from its slots that hold no unit and are not lent, ascending.
  void RebuildFree(Partition& p);
  // RebuildFree of every partition with slots in [first, end) (a range lent or reclaimed).
  void RebuildFreeOverlapping(int64_t first, int64_t end);
  bool IsLent(int64_t s) const { return s >= lent_first_ && s < lent_first_ + lent_count_; }
  // The least recently used unpinned slot of partition `p` (probation first), or -1.
  int32_t Victim(const Partition& p) const { return p.list[0].head >= 0 ? p.list[0].head : p.list[1].head; }
  int32_t PartitionOf(int64_t group) const { return config_.slots_per_group.empty() ? 0 : static_cast<int32_t>(group); }
  // The index in partitions_ of the partition a miss of `group` takes its slot from (Acquire's choice): its own when
  // it has a free slot, else the overflow pool when that has a free slot or the older least recently used unit.
  size_t Source(int64_t group, bool use_overflow) const;

  RegionConfig config_;
  uint8_t* arena_ = nullptr;
  std::vector<int32_t> slot_of_key_;  // (group, unit) -> slot or -1
  std::vector<Slot> slots_;
  std::vector<Partition> partitions_;
  std::vector<CacheCounters> counters_;  // per group
  int32_t overflow_ = -1;                // index of the overflow pool in partitions_, or -1
  uint64_t clock_ = 0;                   // release counter for Slot::stamp
  int32_t lent_first_ = 0, lent_count_ = 0;  // slots lent out (Lend)
};

// The hot and cold regions in one arena.
struct NeuronCacheConfig {
  RegionConfig hot;   // units = clusters of `hot_cluster_neurons` consecutive hot neurons
  RegionConfig cold;  // units = neuron bundles
  int64_t hot_cluster_neurons = 0;
};

// Thread-safety: as SlotRegion (one scheduling thread; slot memory may be filled by an I/O thread while pinned).
class NeuronCache {
 public:
  // Bytes of the arena `config` needs: hot slots first, then cold slots.
  static Result<size_t> ArenaBytes(const NeuronCacheConfig& config);
  // Allocates the arena (kSlotAlignment-aligned, hot slots first, then cold), or uses `external` (at least
  // ArenaBytes bytes, kSlotAlignment-aligned, owned by the caller and outliving the cache: e.g. memory the I/O reader
  // registered as fixed buffers), and zero-fills it so its pages are resident from the start (the budget counts
  // them). ResourceExhausted when the allocation fails; InvalidArgument for a too small or misaligned `external`.
  static Result<std::unique_ptr<NeuronCache>> Create(const NeuronCacheConfig& config, uint8_t* external = nullptr,
                                                     size_t external_bytes = 0);
  ~NeuronCache();
  NeuronCache(const NeuronCache&) = delete;
  NeuronCache& operator=(const NeuronCache&) = delete;

  SlotRegion& hot() { return *hot_; }
  SlotRegion& cold() { return *cold_; }
  const SlotRegion& hot() const { return *hot_; }
  const SlotRegion& cold() const { return *cold_; }
  int64_t hot_cluster_neurons() const { return hot_cluster_neurons_; }

  // The arena, for registering with io_uring (IORING_REGISTER_BUFFERS) and for accounting.
  uint8_t* arena() const { return arena_; }
  size_t arena_bytes() const { return arena_bytes_; }

 private:
  NeuronCache() = default;
  uint8_t* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  bool owns_arena_ = false;
  int64_t hot_cluster_neurons_ = 0;
  std::unique_ptr<SlotRegion> hot_, cold_;
};

// Rounds `bytes` up to a multiple of kSlotAlignment.
constexpr size_t AlignSlot(size_t bytes) { return RoundUp(bytes, kSlotAlignment); }

}  // namespace nflash::sparse
