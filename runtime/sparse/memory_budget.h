// The memory budget of the sparse runtime (`--memory 1.5G`): parsing sizes, accounting for what the process holds
// (resident weights, KV cache, scratch, predictor: the fixed part; then the hot and cold cache regions), refusing a
// budget below the fixed part with the minimum, and the default hot/cold split when no plan decides it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/status.h"

namespace nflash::sparse {

// Parses a size: a decimal number with an optional fraction and a case-insensitive unit. K, M, G, T and KiB, MiB, GiB,
// TiB are binary (1024-based, like cgroups, docker --memory and systemd MemoryMax, the tools a budget is compared
// with); KB, MB, GB, TB are decimal; no unit or B means bytes. "1.5G" = 1610612736. Fractions of a byte are rounded
// down. InvalidArgument (quoting the text) for anything else, negative numbers and sizes over 2^64 - 1.
Result<uint64_t> ParseMemorySize(std::string_view text);
// "512 B", "3.50 KiB", "1.50 GiB": for messages (binary units, two decimals).
std::string FormatBytes(uint64_t bytes);

// KV cache bytes of the engine's cache: K and V, n_layers x n_ctx x kv_dim elements of `element_bytes` each (4 for
// KvType::kF32, 2 for kF16: KvElementBytes).
uint64_t KvCacheBytes(int64_t n_layers, int64_t n_ctx, int64_t kv_dim, uint64_t element_bytes);

// What the process holds whatever the cache sizes: the part of the budget no plan can trade away.
struct FixedMemory {
  uint64_t resident_weights = 0;  // resident.gguf: attention, embeddings, norms, output head
  uint64_t kv_cache = 0;          // KvCacheBytes
  uint64_t scratch = 0;           // activations, logits, per-token read buffers for misses that get no cache slot
  uint64_t predictor = 0;         // predictor weights (0 in oracle mode)
  uint64_t lookahead = 0;         // the lookahead projection table (lookahead.gguf; 0 when not used)
  uint64_t vocabulary = 0;        // resident.gguf's parsed metadata and the tokenizer built from it (heap estimates)
  uint64_t Total() const { return resident_weights + kv_cache + scratch + predictor + lookahead + vocabulary; }
  // "resident weights A, KV cache B, scratch C[, predictor D][, lookahead table E][, metadata and tokenizer F]"
  std::string Describe() const;
};

// InvalidArgument (a flag asked for the impossible, so the CLI exits with 2) when `budget` < fixed.Total():
// "memory budget X is below the fixed part Y (resident weights A, KV cache B, scratch C); the minimum is Y".
Status CheckFixedFits(uint64_t budget, const FixedMemory& fixed);

// What the cache regions could hold at most (caching more than the whole FFN is pointless).
struct CacheShape {
  int64_t n_groups = 0;                // layers x experts
  uint64_t hot_slot_bytes = 0;         // one hot cluster slot (cluster bundle bytes rounded to the slot alignment)
  int64_t hot_clusters = 0;            // hot clusters of all groups together
  uint64_t cold_slot_bytes = 0;        // one neuron bundle slot
  int64_t cold_neurons = 0;            // neurons of all groups that the cold region may hold
};

// How the budget left after the fixed part is spent.
struct CacheSplit {
  int64_t hot_slots = 0;   // one pool shared by every group
  int64_t cold_slots = 0;  // one pool shared by every group (a plan may instead give a budget per group)
  uint64_t hot_bytes = 0, cold_bytes = 0;
  uint64_t unused_bytes = 0;  // left over: the whole FFN fits, or less than a slot remains
};

// Without a plan there is no hit-rate curve to trade the regions against each other: give the hot region (neurons
// every token is likely to use, read as large sequential clusters) up to this fraction of the cache budget, then
// the rest to the cold region (and to the hot region again if the cold one is full).
inline constexpr double kDefaultHotFraction = 0.5;

// Checks the fixed part fits (CheckFixedFits), then splits the rest: hot first, up to `hot_fraction` of it, capped
// at shape.hot_clusters slots; the cold region takes the remainder, capped at shape.cold_neurons slots; what the cold
// region cannot use goes back to the hot region.
Result<CacheSplit> SplitBudget(uint64_t budget, const FixedMemory& fixed, const CacheShape& shape,
                               double hot_fraction = kDefaultHotFraction);

// A multi-line accounting table: each fixed component, each cache region, the total and the budget.
std::string DescribeAccounting(uint64_t budget, const FixedMemory& fixed, const CacheSplit& split);

}  // namespace nflash::sparse
