// The flash-offloaded FFN: an FfnBackend that computes each token's FFN from neuron bundles (gate row | up row | down
// column) held in the neuron cache or read from the deployment's ffn.bin, the numerics of the in-memory sparse FFN
// (runtime/engine/sparse_ffn.h) with a different source of rows.
//
// Per token and FFN (group g = layer x expert):
//   1. active set A, ascending: the predictor's guess, or (oracle, for testing) the exact set from all gate rows,
//      which this backend then holds in memory (read from flash and checked once, at Create);
//   2. every neuron of A is looked up: hot neurons (slot < hot_count) by their cluster in the hot region, others in
//      the cold region; misses become reads into the slot they were given (or into staging memory when the cache has
//      no slot for them; with per-layer partitions the staging is the cold region's overflow pool, which caches for
//      the layers that used it last and guarantees every miss a slot), sorted by file offset and coalesced: neighbours on flash become one request, scattered
//      (readv) into their slots when these are not neighbours in memory;
//   3. full mode: the misses are read by the I/O thread in chunks while this thread computes the hits, then each
//      chunk as it completes; llmflash mode: every miss is read with a blocking pread, then everything is computed;
//      with two-phase loading (predictor mode, large bundles) a cold miss reads its gate page first and the rest of
//      its bundle only if the gate passes (offload_two_phase.cc);
//   4. every bundle that arrives is checked against its per-neuron hash (XXH3-64; xxHash64 in older deployments): a
//      mismatch or a failed read is retried once with a synchronous read, then is an error naming layer, neuron and
//      ffn.bin offset;
//   5. per neuron k of A: h_k = ActivateNeuron(gate_k, up_k) (0 unless |act(gate_k)| > threshold) and its down
//      column copied to row k of a compact matrix; then out = sum over k ascending with h_k != 0 of h_k * down_k
//      (AccumulateRows): the summation order is that of A, never the order reads completed in, so results do not
//      depend on timing, cache state or mode, and equal SparseFfn's (same rows, same order, same kernels).
//
// Batched prefill (x.n() > 1, with options.batched_prefill and its buffers; offload_prefill.cc): the layer's whole
// region (MoE: the expert's, for the tokens the router sent it) is read sequentially in kPrefillRequestBytes requests
// into one of two layer buffers while the next region is prefetched into the other (the next layer; MoE: the layer's
// next expert with enough tokens, known from BeforeExperts, and after the last one a guess for the next layer);
// oracle mode: gate/up of every neuron by GemmMany over strided views of the bundles; predictor mode: per token the
// gate/up rows of its predicted neurons by address in the buffer (GemvRowPtrs, as the token path); then per token the
// down columns of the neurons that pass the active test accumulated in ascending neuron order (the token path's
// arithmetic: bitwise the token-by-token result in both modes). The hot clusters read are copied into the hot region
// (a fair share per layer) so decode starts warm.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "packer/deployment.h"
#include "packer/lookahead_table.h"
#include "runtime/core/file.h"
#include "runtime/core/round.h"
#include "runtime/core/thread_placement.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/io/direct_reader.h"
#include "runtime/sparse/io_worker.h"
#include "runtime/sparse/neuron_cache.h"

namespace nflash::sparse {

enum class OffloadMode { kFull, kLlmFlash };
const char* OffloadModeName(OffloadMode mode);

// Hot region (the first slots of each region: neurons in decreasing profiled popularity, packed as clusters of
// consecutive slots).
//   kPinned: each group's hottest clusters are loaded once, at Create, with large batched reads and stay: a token
//            finds a neuron there iff its slot is below the pinned count, so the hit rate is the profile's popularity
//            coverage P(h) (the planner's model). When a token's active set is larger than the cache, which is the
//            case whenever most of the FFN is on flash, LRU sees the layers as a cyclic scan and evicts every cluster
//            before its next use (hit rate ~0, measured on the synthetic 7B: docs/runtime.md); under independent
//            per-token activations, keeping the most probable units is the optimal static cache.
//   kLru:    one pool shared by all groups, LRU per cluster, loaded on demand (PowerInfer-2's description; kept for
//            comparison and for caches larger than a token's working set, where it adapts to the prompt).
enum class HotPolicy { kPinned, kLru };
const char* HotPolicyName(HotPolicy policy);
Result<HotPolicy> ParseHotPolicy(const std::string& name);

// Default share of the predictor's lookahead candidates read ahead (OffloadOptions::lookahead_keep). The synthetic 7B
// under its plan at 1392M (docs/results.md, seventh run): all candidates, 57% of the bundles read ahead were used and
// decode was slower than without lookahead (wasted reads cost I/O-thread CPU, evict cached neurons and land during
// attention); the top 40% by logit, ~80% used and faster than both.
inline constexpr double kDefaultLookaheadKeep = 0.4;

// Where the lookahead's guess for a layer comes from (OffloadOptions::lookahead_source). kNextLayer: during layer l's
// FFN, from l's FFN input, for layer l+1 (the guess spans l's FFN and l+1's attention). kSameLayer: before layer l's
// attention, from l's attention input, for layer l itself (it spans only l's attention, and starts reads when the
// disk has nothing else queued).
enum class LookaheadSource : uint8_t { kNextLayer, kSameLayer };
const char* LookaheadSourceName(LookaheadSource source);
Result<LookaheadSource> ParseLookaheadSource(const std::string& name);

// What the next-layer guess is computed from (OffloadOptions::lookahead_input). kHits (dense models, decode): once
// layer l's cache hits are computed, rmsnorm(residual + the hits' share of l's FFN output) * ffn_norm[l+1], i.e. layer
// l+1's FFN input but for l+1's attention and l's misses (SYNTHETIC 7B at 1392M, 8 interleaved pairs: 503 of 592
// bundles read ahead used per token against 341 of 475, I/O wait 7.3 against 9.4 ms, but the hits' down sum and the
// larger guess cost ~2 ms of CPU per token, so on 2 vCPUs the speed is within 1.5%; docs/results.md, twenty-fourth
// run). kFfnInput: l's FFN input rescaled by ffn_norm[l+1] / ffn_norm[l], as soon as l's misses are submitted (the
// rule before; MoE always). kProjected: kHits' input without its down sum, through the deployment's lookahead
// table (packer/lookahead_table.h): the predictor's hidden layer is fc1 . (ffn_norm[l+1] * residual) plus, per used
// hit, its activation times the table's row (rank multiply-adds instead of a 4096-long Q4_0 column), over rms(the
// residual) times last token's rms(layer output) / rms(residual) of the same layer; a layer without that ratio yet,
// or a deployment without the table, guesses as kHits.
enum class LookaheadInput : uint8_t { kHits, kFfnInput, kProjected };
const char* LookaheadInputName(LookaheadInput input);
Result<LookaheadInput> ParseLookaheadInput(const std::string& name);

// Adaptive lookahead (OffloadOptions::lookahead_adaptive): the share of a window's time spent waiting for reads at
// which the lookahead turns on, and the window in tokens. On 2 vCPUs both ways were measured: on a virtio disk of
// ~70k IOPS (8 KiB reads at queue depth 64: 581 MB/s) the SYNTHETIC 7B waited 14-18 ms of 61-76 ms per token without
// lookahead (~24%) and decoded faster with it (median +5%, 13 of 20 pairs); on one twice as fast it waited 2.5-8 ms
// of 40-56 ms (<= 15%) and the lookahead's CPU cost more than the wait it hid (~3% slower; docs/results.md).
inline constexpr double kDefaultLookaheadWaitShare = 0.15;
inline constexpr int64_t kDefaultLookaheadWindowTokens = 8;

// Default share of the cold region's protected segment (see OffloadOptions::cold_protected_fraction).
inline constexpr double kDefaultColdProtectedFraction = 0.0;

struct OffloadOptions {
  OffloadMode mode = OffloadMode::kFull;
  // nullptr: oracle (exact active set from every gate row).
  const Predictor* predictor = nullptr;
  // Per layer "active" threshold on |act(gate)| (empty: the predictor's, or 0 for the oracle: ReLU's exact zeros).
  std::vector<float> activation_threshold;
  // Cache capacity in slots (hot: clusters; cold: neurons), one pool shared by every group unless
  // cold_slots_per_group is given (n_groups entries, e.g. from a plan).
  int64_t hot_slots = 0;
  int64_t cold_slots = 0;
  std::vector<int64_t> cold_slots_per_group;
  // With cold_slots_per_group: the cold region's overflow pool (RegionConfig::overflow_slots), at least StagingSlots
  // so that a layer's misses always find a slot; it then replaces the staging memory (which is not allocated). 0:
  // misses without a slot of their partition are read into staging.
  int64_t cold_overflow_slots = 0;
  // Hot region policy (see "Hot region" below). kPinned: hot_slots_per_group[g] clusters of group g (empty: hot_slots
  // split evenly over the groups) are read at Create and never evicted; kLru: one pool of hot_slots clusters shared
  // by every group, LRU per cluster, filled on demand (and from batched prefill).
  HotPolicy hot_policy = HotPolicy::kPinned;
  std::vector<int64_t> hot_slots_per_group;
  // Hot cluster size in flash groups (0: kDefaultClusterBytes worth). A cluster is read with one request.
  int64_t cluster_groups = 0;
  // Coalesced requests per pipeline chunk (one batched submission each; the compute thread can start on a chunk as
  // soon as it completes).
  int64_t chunk_requests = 16;
  // Largest merged request.
  size_t max_request_bytes = size_t{256} << 10;
  // Neighbours on flash whose cache slots are not neighbours in memory merge into one scattered read (readv into
  // each slot) instead of one request each; false: only memory-adjacent ones merge (a comparison).
  bool scatter_reads = true;
  // Cold region replacement: the share of each partition kept for neurons hit since they were loaded (segmented
  // LRU, RegionConfig::protected_fraction); 0: plain LRU.
  double cold_protected_fraction = kDefaultColdProtectedFraction;
  // Memory for the cache arena (NeuronCache::ArenaBytes of the cache this creates), e.g. registered with the I/O
  // reader as fixed buffers; nullptr: the cache allocates its own.
  uint8_t* arena = nullptr;
  size_t arena_bytes = 0;
  // Batched prefill through two layer buffers (PrefillBufferBytes) for batches of batched_prefill_min_tokens or more;
  // false: prefill runs token by token.
  bool batched_prefill = false;
  // With batched_prefill: its buffers are cold-region slots lent for the prompt (SlotRegion::Lend, the last slots of
  // the region: the overflow pool first) instead of memory of their own; decode's next token takes them back. The
  // runtime sets it under a memory budget: a prompt then costs the cache what those slots held, instead of the
  // buffers' memory for good (or, when a plan fills the memory, instead of token-by-token prefill). Needs a cold
  // region of PrefillBufferBytes at least (else prefill runs token by token).
  bool prefill_in_cache = false;
  // Batches of fewer tokens than this go token by token through the decode path even with batched_prefill: a batched
  // prefill streams every FFN byte of the model (1376 MiB for the SYNTHETIC 16-layer 7B), which on this project's
  // machine costs about what ~50 decode-path tokens do (74 tokens: 1.82 s batched against 2.35 s token by token),
  // while the decode path reads only the misses of a warm cache. The default (runtime/engine/sparse_ffn.h) is the
  // in-memory SparseFfn's too, so both engines compute the same prompt.
  int64_t batched_prefill_min_tokens = kDefaultBatchedPrefillMinTokens;
  // Two-phase loading of cold misses (see "Two-phase loading" below): the gate page first, the up+down part only for
  // neurons whose gate passes the activation test. Applies only with a predictor and a layout of one bundle per
  // group whose gate part lies in the group's first page and whose group is longer than that page; otherwise Create
  // logs why once and reads whole bundles. A no-op in oracle mode: the oracle's active set already holds only
  // neurons whose exact gate passes, so every one of them needs its up+down part.
  bool two_phase = false;
  // Cross-layer lookahead (see "Lookahead" below): bundles read ahead per layer at most; -1: n_ff / 8 (MoE: off),
  // 0: off. In effect only in full mode, without two-phase loading (LookaheadSlots); MoE: per guessed expert.
  int64_t lookahead_slots = -1;
  // With a predictor: the share of the lookahead's candidates read ahead, those with the largest predictor logits (the
  // likeliest to be active); 1: all of them.
  double lookahead_keep = kDefaultLookaheadKeep;
  // Adaptive: the lookahead is set up (lookahead_slots) but starts off; it turns on, for good, at the first window of
  // kDefaultLookaheadWindowTokens tokens whose I/O wait is at least lookahead_wait_share of their time (each token's time
  // from its first layer's FFN to its last one's end, so that idle time between requests does not count; the first
  // window, which warms the cache, is not judged). For a machine whose compute threads take every core, where the
  // lookahead's CPU (a second predictor pass per layer, more requests) only pays when reads keep the compute waiting.
  bool lookahead_adaptive = false;
  // MoE decode, full mode, whole-bundle reads, no next-layer lookahead (lookahead_slots 0 or the MoE default): at a
  // layer's first routed expert the other routed experts' active sets are predicted from the same input (what their
  // own steps would predict: no guess; kept for them) and their misses read at once through the lookahead's sets, so
  // that each expert's reads overlap the experts computed before it instead of each waiting for its own.
  bool sibling_readahead = true;
  LookaheadSource lookahead_source = LookaheadSource::kNextLayer;
  LookaheadInput lookahead_input = LookaheadInput::kHits;
  // kProjected's table (owned by the caller; nullptr: kProjected guesses as kHits).
  const packer::LookaheadTable* lookahead_table = nullptr;
  double lookahead_wait_share = kDefaultLookaheadWaitShare;
  // A measurement of what a perfect guess would give (dense models): the active sets of an earlier run of the same
  // prompt and settings (`--trace-active` FILE: one line per layer step, the group, then its active neurons). Each
  // guess still runs as configured (its CPU is spent), then reads exactly the next step's cold neurons from the file
  // instead of its own picks, up to the usual cap. Results are unchanged either way; if the file's steps stop matching
  // the run's (another prompt, batching, an error), it is dropped with a warning. Empty: off.
  std::string lookahead_replay;
  // Full mode, decode: while the compute thread waits for a layer's reads it streams up to this many bytes of the
  // weights computed next (the next layer's attention matrices; after the last layer, the output matrix) through
  // its caches instead of sleeping, so that they are read from the last-level cache, not DRAM (docs/runtime.md,
  // "Warming the next weights while waiting"). -1: half the last-level cache (LastLevelCacheBytes; off when unknown),
  // 0: off.
  int64_t warm_next_bytes = -1;
  // At Create, the cold region is filled with the bundles that follow each group's hot ones in the layout (the
  // packer's most popular first, then its co-activation chains, which start from the most popular cold neurons): each
  // partition up to its size, a shared pool up to each group's share (ColdShare), read in large sequential requests
  // scattered into the slots (LoadColdPrefix). Decode then starts from the popular neurons instead of an empty region,
  // as the pinned hot region does. false: the cold region starts empty (a comparison).
  bool preload_cold = true;
  // With one shared pool: each group's share of it, for the preload and for the prefill's warming, in proportion to
  // these (n_groups entries, e.g. a plan's per-region cold slots); empty: in proportion to the deployment's
  // per-region active_per_token (the profile's active neurons per token, routing included, so experts a router picks
  // more often get more) when every region has one, else equal shares.
  std::vector<double> cold_share_weights;
  // Full mode: whether the caller, the pool's workers and the I/O thread are pinned to CPUs for each Eval
  // (runtime/core/thread_placement.h; auto: when the compute threads take every CPU the process may use).
  PinThreads pin_threads = PinThreads::kAuto;
  // The flash file's direct-I/O alignment (DirectReader::alignment, from statx): sizes the cold slots (ColdReadBytes).
  // kSlotAlignment keeps them whole 4 KiB-aligned groups.
  uint64_t dio_alignment = kSlotAlignment;
};

// Lookahead (full mode, whole-bundle reads). A layer's reads cannot start before its active set is known
// (after its attention and the gate GEMV / predictor), so without help the compute thread and the I/O thread take
// turns. The residual stream changes little from one layer to the next (cosine ~0.8-0.96 on the synthetic 7B), so
// while layer l runs, the active-set source of layer l+1 (the oracle's gate rows, or the predictor) is applied to
// layer l's FFN input, rescaled elementwise by ffn_norm[l+1] / ffn_norm[l] (exactly the next layer's normalisation of
// the same residual), and the cold neurons it selects that are neither pinned nor cached (at most `lookahead_slots`;
// the oracle keeps those with the largest |act(gate)|, the predictor its lookahead_keep share with the largest
// logits) get cold-cache slots at once, pinned, and are read into them
// behind layer l's own misses in the same I/O stream (no extra memory, no copy). When layer l+1 runs, an active
// neuron read ahead waits for that read instead of issuing one; every bundle read ahead is verified, and the ones
// the layer did not need stay in the cache as ordinary (unpinned) entries. If the pins leave a miss of layer l+1 no
// slot, the lookahead is settled first (its pins released). The active set itself is still computed exactly from
// layer l+1's real input, so results are bitwise those without lookahead; only what is read, and when, changes.
// Cache counters: a bundle read ahead counts as a miss when its read is issued, used or not.
// MoE: after the layer's last routed expert has issued its own reads, layer l+1's router is applied to the same
// rescaled input, and each of its top-k experts gets a guess from its own predictor (or gate rows) into a set of its
// own; a wrong expert only costs reads, since layer l+1's real router decides which experts run.

// Two-phase loading (predictor mode, OffloadOptions::two_phase). A predictor guesses A; ReLU then zeroes a large share
// of the predicted neurons' gates (~40% at 7B), whose up and down parts are never used. With one bundle per flash
// group and the gate at its start:
//   phase 1: every cold miss of A reads the group's first page (kTwoPhasePageBytes, aligned) into its slot or staging,
//            checked against the gate hash; gate = RowDot of the gate row (the same dot the whole-bundle path computes);
//   phase 2: only neurons with |act(gate)| > threshold read the rest of the group (whole pages, straight after the
//            first page in the slot), checked against the up+down hash.
// A cold slot may thus hold a gate-only bundle: a later hit whose gate passes needs only phase 2. Full mode: phase-1
// chunks go through the I/O thread; as each one lands its gates are computed and its phase-2 reads appended to the
// same job, so the I/O thread stays busy. llmflash: blocking phase-1 reads, then blocking phase-2 reads. Hot clusters
// and hits on complete bundles are unchanged. The down sum still runs over A ascending, so results are bitwise those
// of whole-bundle reads and of SparseFfn.
inline constexpr uint64_t kTwoPhasePageBytes = 4096;  // kDeployAlignment: the O_DIRECT unit and the packer's page

// Prefill reads: 1 MiB requests reach sequential flash bandwidth (UFS/NVMe saturate at 512 KiB-1 MiB) while the
// queue keeps a few in flight; larger ones only add latency before the first bytes can be checked.
inline constexpr size_t kPrefillRequestBytes = size_t{1} << 20;
// Tokens per batched-prefill tile: the gate/up outputs of a tile (2 x tile x n_ff floats) stay a few MiB at 7B scale.
inline constexpr int64_t kPrefillTokenTile = 64;
// Prompt tokens whose used neurons warm the cold region after a batched prefill (WarmColdRegion): the recent past an
// LRU cache holds after token-by-token prefill, at ReLU sparsity ~0.9 about one 7B partition's worth.
inline constexpr uint8_t kWarmTokens = 8;

// Batched prefill, summed over layers.
struct OffloadPrefillStats {
  int64_t layers = 0;          // FFN passes (one per layer, or per MoE expert with its tokens, and batch)
  int64_t tokens = 0;          // token-FFN pairs
  int64_t requests = 0;
  uint64_t bytes_read = 0;
  int64_t prefetch_hits = 0;   // passes whose region had been prefetched during the previous pass
  int64_t prefetch_dropped = 0;   // regions read ahead that no pass used (MoE: a guess that missed, or dropped for
  uint64_t dropped_bytes = 0;     // an expert's token-by-token path); their bytes are in bytes_read too
  uint64_t io_wait_ns = 0;     // compute thread blocked on the region read (exposed I/O)
  uint64_t verify_ns = 0;      // per-neuron hashes of every bundle read
  uint64_t compute_ns = 0;     // gate/up GEMM, activation, down accumulation
  uint64_t gate_up_ns = 0;     // of which the gate/up GEMM (oracle), or the per-token part: predictor, gate/up rows
                               // and down accumulation (predictor)
  int64_t warmed_clusters = 0; // hot clusters copied into the hot region
  int64_t warmed_bundles = 0;  // cold bundles copied into the cold region (WarmColdRegion)
  int64_t retries = 0;
};

// Batched prefill of one layer (MoE: of one expert of a layer), the last prompt's: Fig. 8 of the paper, compute against
// sequential I/O per layer.
struct PrefillLayerTiming {
  int64_t chunk = 0;        // the prompt's batched Eval it belongs to (a prompt longer than the context's maximum
                            // batch runs in chunks), from 0
  int64_t layer = 0;
  int64_t expert = -1;      // -1: a dense FFN
  uint64_t bytes = 0;       // the layer's region
  uint64_t read_ns = 0;     // reading the region (the I/O thread's time in its batch, or the blocking read)
  uint64_t wait_ns = 0;     // of which the compute thread waited (not hidden by the previous layer's compute)
  uint64_t verify_ns = 0;   // checksums of its bundles
  uint64_t compute_ns = 0;  // gate/up GEMM, activation, down accumulation
};

// The shape (type, cols, row bytes; no data) of one bundle part, e.g. PartShape(lay, lay.up_type, lay.up_bytes): what
// GemvRowPtrs / AccumulateRowPtrs need besides the row addresses.
inline MatrixView PartShape(const packer::BundleLayout& lay, GgmlType type, uint64_t bytes) {
  return MatrixView{type, nullptr, 0, lay.dim, static_cast<size_t>(bytes)};
}

// A cold neuron whose group holds only it is read as its bundle rounded up to `dio_alignment`, the device's direct-I/O
// alignment (at least kMinSlotAlignment, at most its group): an aligned O_DIRECT read from the group's start straight
// into the slot. The rest of the group is padding to the packer's 4 KiB alignment and is not read, nor kept: on a
// disk with 512-byte blocks a 6912-byte Q4_0 bundle of a 7B model takes a 7168-byte slot instead of its 8192-byte
// group, so the same memory caches 14% more neurons (SYNTHETIC 7B trace, LRU: miss rate 0.084 -> 0.063). Bundles
// sharing a group are read as their exact bytes (the reader bounces them through an aligned buffer).
inline uint64_t ColdReadBytes(const packer::BundleLayout& layout, uint64_t dio_alignment = kSlotAlignment) {
  if (layout.slots_per_group != 1) return layout.bundle_bytes;
  const uint64_t a = std::max<uint64_t>(dio_alignment, kMinSlotAlignment);
  return std::min<uint64_t>(layout.group_bytes, RoundUp<uint64_t>(layout.bundle_bytes, a));
}

// Requests of `requests` that are scattered reads.
inline int64_t CountScattered(std::span<const ReadRequest> requests) {
  return std::count_if(requests.begin(), requests.end(), [](const ReadRequest& r) { return r.n_pieces > 0; });
}

// Per-neuron scratch of OffloadFfn (~20 arrays of 1-8 bytes per neuron: item tables, row addresses, gate/up/h
// values, two-phase state), rounded up; counted in the fixed part.
inline constexpr uint64_t kPerNeuronScratchBytes = 128;

// 64 KiB: large enough that a hot cluster read runs near sequential flash throughput (random-read bandwidth keeps
// rising up to ~64 KiB requests on UFS/NVMe), small enough that LRU per cluster still tracks popularity.
inline constexpr size_t kDefaultClusterBytes = size_t{64} << 10;

// Per group (layer x expert), summed over tokens.
struct OffloadGroupStats {
  int64_t tokens = 0;
  int64_t active = 0;       // |A|
  int64_t missed = 0;       // neurons of A not (wholly) in memory when the token needed them: read from flash
  int64_t used = 0;         // neurons whose h != 0 (rows of the down accumulation)
  int64_t requests = 0;     // reads issued after coalescing (retries excluded), both phases of two-phase loads
  int64_t scattered_requests = 0;  // of which scattered reads (flash neighbours into slots apart in memory)
  uint64_t bytes_read = 0;  // bytes of those reads
  int64_t retries = 0;
  // Two-phase loading (included in requests / bytes_read above): gate-page reads (phase 1), up+down reads (phase 2),
  // and the cold neurons of A whose gate failed the test so their up+down part was never read.
  int64_t gate_requests = 0;
  uint64_t gate_bytes = 0;
  int64_t updown_requests = 0;
  uint64_t updown_bytes = 0;
  int64_t updown_skipped = 0;
  // Lookahead (included in requests / bytes_read above, counted for the layer they were read for): bundles read ahead
  // and, of those, the ones the layer's active set then used (also counted in `missed`: they came from flash).
  int64_t prefetched = 0;
  int64_t prefetch_used = 0;
  int64_t prefetch_requests = 0;
  uint64_t prefetch_bytes = 0;
  uint64_t lookahead_ns = 0;  // compute thread: choosing the next layer's bundles (its gate rows or predictor)
  uint64_t lookahead_verify_ns = 0;  // compute thread: verifying the bundles read ahead (after their reads landed)
  uint64_t io_wait_ns = 0;  // compute thread: blocked on this group's reads (and its lookahead's), token path only
  uint64_t warm_next_bytes = 0;  // compute thread: weights streamed through the caches while waiting (warm_next_bytes)

  // Adds every counter of `o` (totals over groups).
  void Add(const OffloadGroupStats& o);
};

// Thread-safety: not thread-safe; one per InferenceContext. Owns one I/O thread in full mode. The deployment, model,
// predictor, flash file and pool must outlive it.
class OffloadFfn : public FfnBackend {
 public:
  static Result<std::unique_ptr<OffloadFfn>> Create(const packer::Deployment& deployment, const Model& model,
                                                    std::shared_ptr<const ReadableFile> flash,
                                                    const OffloadOptions& options, ThreadPool* pool);
  ~OffloadFfn() override;

  void BeforeAttention(int64_t layer, const float* xn, int64_t n) override;
  void BeforeFfn(int64_t layer, const float* x, int64_t n) override;
  void BeforeExperts(int64_t layer, std::span<const int64_t> tokens_per_expert) override;
  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override;
  void BeginEval() override;
  void EndEval() override;

  const NeuronCache& cache() const { return *cache_; }
  const std::vector<OffloadGroupStats>& stats() const { return stats_; }
  OffloadGroupStats TotalStats() const;
  void ResetStats();
  // Where the token path's FFN time goes, in steps (wall time on the calling thread, summed over layers and tokens
  // since ResetStats): kFfnStepNames[i] names step_ns()[i].
  static constexpr int kFfnSteps = 9;
  static constexpr const char* kFfnStepNames[kFfnSteps] = {
      "predict",        // the active set (predictor or oracle)
      "lookup_misses",  // cache lookups; the misses' slots and reads built
      "pin_hits",       // the misses' reads submitted, the hits pinned
      "guess_next",     // the lookahead: the next layer's guess, its slots and reads
      "hits",           // gate and up rows of the cache hits
      "lookahead_wait", // this layer's reads ahead waited for, verified and computed
      "reads",          // the layer's own reads waited for, verified and computed (llmflash, two-phase: all reads)
      "down",           // the down accumulation
      "release",        // the slots released
  };
  const std::array<uint64_t, kFfnSteps>& step_ns() const { return step_ns_; }
  // Records every active set of the decode path (a token's layer or expert, after the predictor or the oracle): one
  // text line each, the group (layer x max(1, n_experts) + expert) then the neuron indices, ascending, separated by
  // spaces. For cache-policy studies (scripts/cache_policy_sim.py). nullptr: off. The writer must outlive its use.
  void SetActiveTrace(AtomicFileWriter* trace) { active_trace_ = trace; }
  // Records the decode path's spans (event_trace.h) from now on: each layer's attention (from BeforeAttention to its
  // FFN) and FFN on the compute lane, the waits for reads, the I/O thread's streams ("reads": a layer's misses,
  // "reads ahead": the lookahead's). Batched prefill is not traced. nullptr: off. The trace must outlive its use.
  void SetEventTrace(EventTrace* trace);
  // Nanoseconds the compute thread waited for reads (full: blocked on chunks; llmflash: inside the blocking reads).
  uint64_t io_wait_ns() const;
  // Nanoseconds the I/O thread had reads in flight (full mode; 0 without the I/O thread).
  uint64_t io_busy_ns() const { return io_ ? io_->busy_ns() : 0; }
  // Bytes this backend holds besides the cache arena: scratch, staging for misses without a slot, oracle gate rows.
  uint64_t scratch_bytes() const;
  uint64_t oracle_bytes() const;
  int64_t hot_cluster_neurons() const { return cluster_neurons_; }
  int64_t chunk_requests() const { return options_.chunk_requests; }
  OffloadMode mode() const { return options_.mode; }
  // Whether two-phase loading is in effect (requested, predictor mode and a layout that allows it).
  bool two_phase() const { return two_phase_; }

  // What Create will allocate, for the memory budget before the cache is sized: staging + compact down + scratch
  // (per_token_bytes) and oracle gate rows (0 with a predictor).
  static uint64_t EstimateScratchBytes(const packer::Deployment& deployment, uint64_t dio_alignment = kSlotAlignment);
  static uint64_t EstimateOracleBytes(const packer::Deployment& deployment, bool oracle);
  // Slot sizes of the two regions for `cluster_groups` (0: default).
  static uint64_t HotSlotBytes(const packer::Deployment& deployment, int64_t cluster_groups);
  // `dio_alignment`: the flash file's direct-I/O alignment (DirectReader::alignment; see ColdReadBytes).
  static uint64_t ColdSlotBytes(const packer::Deployment& deployment, uint64_t dio_alignment = kSlotAlignment);
  // Hot clusters of all groups and cold-eligible neurons of all groups (the most each region could use).
  // kLru: clusters of the packer's hot part of each region; kPinned: clusters covering whole regions (any slot may be
  // pinned: slots are in popularity order).
  static int64_t HotClusterCount(const packer::Deployment& deployment, int64_t cluster_groups,
                                 HotPolicy policy = HotPolicy::kLru);
  // Neurons of one hot cluster for `cluster_groups` (0: default).
  static int64_t HotClusterNeurons(const packer::Deployment& deployment, int64_t cluster_groups);
  // kPinned without per-group counts: `clusters` pinned clusters split evenly over the groups, each capped at its
  // `cap` (what a small group cannot take goes to the others, in group order).
  static std::vector<int64_t> SpreadPinnedClusters(int64_t clusters, const std::vector<int64_t>& cap);
  // Cold slot memory that doubles as staging: misses with no cold slot are read into staging (n_ff slots minus the
  // smallest cold partition, since one group's misses are pinned at a time).
  static int64_t StagingSlots(int64_t n_ff, int64_t cold_slots, const std::vector<int64_t>& cold_slots_per_group);
  // What batched prefill needs: two buffers of the largest region, the gate/up outputs of a token tile and the compact
  // down rows of one layer, each kSlotAlignment-aligned.
  static uint64_t PrefillBufferBytes(const packer::Deployment& deployment);
  // Bundles read ahead per layer at most that `options` give for this deployment (0 when lookahead does not apply;
  // two-phase loading, which turns it off, only where TwoPhaseUnusable allows it).
  static int64_t LookaheadSlots(const packer::Deployment& deployment, const OffloadOptions& options);
  // Why two-phase loading cannot run on `deployment` (empty: it can): the oracle's active set (`oracle`), or a layout
  // without a gate page of its own for the cold bundles read at `dio_alignment` (ColdReadBytes).
  static std::string TwoPhaseUnusable(const packer::Deployment& deployment, bool oracle, uint64_t dio_alignment);
  int64_t lookahead_slots() const { return la_slots_; }
  // The sibling read-ahead is in effect (MoE decode; OffloadOptions::sibling_readahead without next-layer lookahead).
  bool sibling_readahead() const { return la_siblings_; }
  // Bytes streamed through the caches per layer wait at most (OffloadOptions::warm_next_bytes resolved); 0: off.
  uint64_t warm_next_cap() const { return warm_cap_; }
  // Switches the warming off (and on again) from the next layer on, e.g. per token for an A/B comparison inside one
  // process (`nflash offload --warm-next-ab`). On by default (when warm_next_cap() > 0).
  void SetWarmNextEnabled(bool on) { warm_enabled_ = on; }
  // An A/B switch between decode tokens (--lookahead-input-ab): the guess after the hits through the lookahead table
  // (on) or from the hits' down columns (off). Only with the table (otherwise kHits stays); the rms ratios the table's
  // guess needs are kept up to date either way.
  void SetProjectedGuess(bool on) {
    if (options_.lookahead_table != nullptr) options_.lookahead_input = on ? LookaheadInput::kProjected : LookaheadInput::kHits;
  }
  // Where the threads are pinned for each Eval (OffloadOptions::pin_threads), or nullptr when they are not.
  const ThreadCpuPlan* thread_plan() const { return placement_ ? &placement_->plan() : nullptr; }
  // The flash disk's interrupts per CPU when the runtime opened (DiskInterruptsPerCpu; empty: unknown, or not full mode).
  const std::vector<uint64_t>& disk_interrupts() const { return disk_interrupts_; }
  // Each allowed CPU's capacity when the runtime opened (CpuCapacities, per CPU number; empty: unknown, or not full
  // mode): the pinned compute threads take the fastest.
  const std::vector<uint64_t>& cpu_capacity() const { return cpu_capacity_; }
  // OffloadOptions::lookahead_replay: whether the run still followed the file (false also when there is none).
  bool replay_followed() const { return replay_on_; }
  // Switches the pinning off (and on again) from the next Eval on, e.g. per token for an A/B comparison inside one
  // process (`nflash offload --pin-threads-ab`).
  void SetPinThreadsEnabled(bool on) { pin_enabled_ = on; }
  const OffloadOptions& options() const { return options_; }
  // Whether the lookahead reads ahead now (adaptive: once the I/O wait turned it on), and after how many tokens it
  // started (0: from the start; -1: never).
  bool lookahead_on() const { return la_slots_ > 0 && la_on_; }
  int64_t lookahead_started_token() const { return la_slots_ > 0 && la_on_ ? la_started_token_ : -1; }
  bool batched_prefill() const { return prefill_block_bytes_ > 0; }
  // Batched prefill runs in cold slots lent for the prompt (OffloadOptions::prefill_in_cache).
  bool prefill_in_cache() const { return prefill_in_cache_; }
  const OffloadPrefillStats& prefill_stats() const { return prefill_stats_; }
  // Cold bundles read into the cold region at Create (OffloadOptions::preload_cold), and the time it took.
  int64_t preloaded_bundles() const { return preloaded_bundles_; }
  // Group g's cold partition, or its share of the shared pool (OffloadOptions::cold_share_weights).
  int64_t ColdShare(int64_t g) const { return cold_share_[static_cast<size_t>(g)]; }
  double preload_seconds() const { return preload_s_; }
  // Per layer (MoE: per expert pass), the last batched prefill: of a prompt longer than the context's max_batch, its
  // last chunk (empty when prefill ran token by token).
  const std::vector<PrefillLayerTiming>& prefill_layers() const { return prefill_layers_; }
  uint64_t prefill_bytes() const;

 private:
  // What a read brings: a whole bundle (or hot cluster), or one phase of a two-phase load.
  enum class Phase : uint8_t { kWhole, kGate, kUpDown };
  // A read of one unit (a cold neuron bundle or a hot cluster) into `dst`.
  struct Unit {
    uint64_t offset = 0;
    size_t size = 0;
    uint8_t* dst = nullptr;   // kUpDown: the bundle's second page (the bundle starts kTwoPhasePageBytes before)
    int32_t cache_slot = -1;  // -1: staging
    bool hot = false;
    int64_t index = 0;        // neuron (cold) or cluster (hot)
    int32_t acquired = -1;    // position in acquired_hot_ / acquired_cold_ (-1: staging)
    Phase phase = Phase::kWhole;
    int32_t item = -1;        // cold units: the item (position in A) it serves
  };
  OffloadFfn(const packer::Deployment& deployment, const Model& model, std::shared_ptr<const ReadableFile> flash,
             const OffloadOptions& options, ThreadPool* pool);
  Status Init();
  Status LoadOracleGates();
  // kPinned: sizes pinned_ from the options and reads every pinned cluster into its slot (batched, verified, each bad
  // cluster read again once, then an error naming it).
  Status LoadPinnedClusters();
  // Fills cold_share_ (OffloadOptions::cold_share_weights).
  Status ShareOutColdRegion();
  // OffloadOptions::preload_cold.
  Status LoadColdPrefix();
  // Batched dense prefill of a layer's FFN, or of an MoE expert's tokens (offload_prefill.cc).
  Status ForwardBatch(int64_t layer, int64_t expert, const Activation& x, float* out);
  // The group whose region batched prefill reads after (layer, expert)'s, or -1 (see NextBatchGroup in
  // offload_prefill.cc).
  int64_t NextBatchGroup(int64_t layer, int64_t expert) const;
  // Group g = layer x n_experts_ + expert: its layer, its expert (-1 for a dense model), "layer L[ expert E]".
  int64_t GroupLayer(int64_t g) const { return g / n_experts_; }
  int64_t GroupExpert(int64_t g) const { return model_.hparams().n_experts > 0 ? g % n_experts_ : -1; }
  std::string GroupName(int64_t g) const;
  // kPrefillRequestBytes rounded down to whole flash groups (at least one).
  uint64_t PrefillRequestBytes() const;
  // Allocates the prefill buffers when options.batched_prefill (dense models only).
  Status InitPrefill();
  // Starts reading `group`'s region into prefill buffer `buf` (I/O thread in full mode, else synchronously).
  Status StartRegionRead(int64_t group, int buf);
  // Waits for / verifies the region in buffer `buf` (bad bundles re-read once synchronously).
  Status FinishRegionRead(int64_t group, int buf);
  // Drops a prefetch still in flight (before the I/O thread is used for something else).
  void CancelPrefetch();
  // Within a batch: waits for the prefetch in flight and keeps its buffer for the batched FFN that wants it
  // (arrived_buf_), so that the I/O thread is free for a token-by-token FFN in between (MoE: an expert with too few
  // tokens between two batched ones, or after the layer's last).
  void CompletePrefetch();
  // Counts buffer `buf`'s region as read ahead and not used, and forgets it.
  void DropPrefetched(int buf);
  void WarmHotRegion(int64_t group, const packer::RegionInfo& region, const uint8_t* buf);
  // Puts into the cold region the bundles of the neurons the prompt's last tokens used (warm_age_, the newest
  // first, up to the group's partition), copied from the layer buffer `buf`, so that decode starts with the working set
  // token-by-token prefill would have left in the cache. Acquired oldest token first: the last token's are the most
  // recently used.
  void WarmColdRegion(int64_t group, const packer::RegionInfo& region, const uint8_t* buf);
  // One token (x.n() == 1); `lookahead`: may read ahead for the next layer.
  Status ForwardToken(int64_t group, int64_t layer, int64_t expert, const Activation& x, float* out, bool lookahead);
  // Whether slot `s` of `group` is served by the hot region (pinned: its cluster is pinned; LRU: the packer's hot part,
  // when there is a hot region at all); the others take the cold path.
  bool HotPath(int64_t group, const packer::RegionInfo& region, int32_t s) const {
    return pinned_.empty() ? s < region.hot_count && cache_->hot().SlotCount() > 0
                           : s / cluster_neurons_ < pinned_[static_cast<size_t>(group)];
  }
  // Cuts `n_requests` requests into chunks of options_.chunk_requests: `ends` gets each chunk's end index.
  void CutChunks(size_t n_requests, std::vector<size_t>* ends) const;
  // Resolves A into items (bundle pointers or pending units), filling units_ with the misses and the requests that
  // read them; the cold hits are only found (deferred_hits_), and ResolveHits pins them.
  Status Resolve(int64_t group, const packer::RegionInfo& region);
  // Pins the cold hits Resolve deferred (after the misses' reads were submitted) and makes them ready items.
  void ResolveHits(int64_t group);
  Status VerifyUnit(int64_t layer, int64_t expert, const packer::RegionInfo& region, const Unit& u) const;
  // Verifies unit `x` after its read finished with `read_status`; a failed read or a mismatch is retried once with a
  // synchronous read, then is an error naming layer, neuron (or hot cluster) and ffn.bin offset.
  Status CheckArrival(int64_t layer, int64_t expert, const packer::RegionInfo& region, const Unit& x,
                      const Status& read_status);
  void ComputeItems(std::span<const int32_t> items, const Activation& x, float threshold);
  // Two-phase path of ForwardToken (offload_two_phase.cc); Resolve has run.
  Status ForwardTokenTwoPhase(int64_t group, int64_t layer, int64_t expert, const packer::RegionInfo& region,
                              const Activation& x, float threshold);
  // Phase 1 done for `items` (gate bytes verified): computes their gates into gate_item_; the ones that pass get a
  // phase-2 unit and request (appended to units_ / requests2_), the others are final (unused).
  void ComputeGates(std::span<const int32_t> items, const Activation& x, float threshold, int64_t group,
                    const packer::RegionInfo& region);
  // A verified arrival: a cold slot that now holds its whole bundle is marked complete.
  void MarkComplete(const Unit& u);
  // Cuts the phase-2 requests not yet in a chunk into whole chunks of chunk_requests (recorded in chunks2_end_);
  // `flush`: the remainder too.
  void CutPhase2Chunks(bool flush);
  // Decides whether two_phase applies (logs why not once).
  void InitTwoPhase();
  // Lookahead (offload_lookahead.cc). Sets up the scratch and the norm ratios; loads lookahead_replay.
  Status InitLookahead();
  Status LoadLookaheadReplay(const std::string& path);
  // Replay: ForwardToken's step for `group` begins (checks that the file still follows the run).
  void ReplayStep(int64_t group);
  // Layer `layer` runs with FFN input x: selects layer+1's probable cold misses and appends their reads to the I/O job.
  void IssueLookahead(int64_t layer, const Activation& x);
  // Whether layer `layer`'s next-layer guess waits for its hits (LookaheadInput::kHits applies to this token).
  bool GuessAfterHits(int64_t layer, const float* residual) const;
  // The kHits guess for layer+1, once `layer`'s hits (ready_items_) are computed: from the residual plus their down
  // columns' sum.
  void IssueLookaheadAfterHits(int64_t layer, const float* residual);
  // The guess for layer `next` while layer `current` runs (the same layer for the same-layer source), from `input`
  // (current's FFN or attention input, dim floats) rescaled by la_scale_; MoE: for the top-k experts next's router
  // picks on that input. `t0`: when the caller started (lookahead_ns).
  void IssueGuess(int64_t next, int64_t current, const float* input, uint64_t t0);
  // One group's guess from la_act_ into lookahead set `b`: slots, requests, submission (MoE: left to the caller's
  // SubmitDeferredSets, which reads the layer's experts' sets as one stream).
  // `predicted`: la_rows_ and pred_scratch_.logits already hold the predictor's guess (kProjected, siblings).
  // `exact`: the set is the group's own active set (siblings), so every candidate is read (no lookahead_keep share,
  // no replay), up to half the group's partition.
  void GuessGroup(int64_t group, int b, uint64_t t0, bool predicted = false, bool exact = false);
  // OffloadOptions::sibling_readahead: at layer `layer`'s first routed expert `expert` (one token), the other routed
  // experts' active sets from x into sib_active_, their misses into this layer's lookahead sets.
  void IssueSiblings(int64_t layer, int64_t expert, const Activation& x);
  // The active set IssueSiblings predicted for `group` into active_ (true), or false.
  bool TakeSiblingSet(int64_t group);
  // The reads of the MoE sets GuessGroup prepared for `layer` since the last call, as one submission.
  void SubmitDeferredSets(int64_t layer);
  // kProjected: the guess's predictor pass from the table into la_rows_; false when the layer has no ratio yet.
  bool PredictProjected(int64_t layer, const float* residual);
  // kProjected: after layer `layer`'s FFN, its rms(residual + out) / rms(residual) for the next token's guess.
  void NoteLayerRmsRatio(int64_t layer, const float* residual, const float* out);
  // Waits for the reads of lookahead set `b` and verifies them: a bundle an item took is retried once (then an
  // error); the others are released into the cache, or dropped when bad. The set is empty afterwards.
  Status SettleLookahead(int b);
  // Settles the set the current token's Resolve uses, if any.
  Status ConsumeLookahead();
  // Waits for and forgets the lookahead of every layer but `keep_layer` (-1: of every layer, e.g. before prefill uses
  // the I/O thread).
  void DropLookahead(int64_t keep_layer);
  // No lookahead set holds reads.
  bool LookaheadIdle() const {
    return std::all_of(la_group_.begin(), la_group_.end(), [](int64_t g) { return g < 0; });
  }
  // MoE: whether (layer, expert) is the layer's first / last FFN of the current token (BeforeExperts's routing; a
  // dense FFN always is).
  bool FirstFfnOfLayer(int64_t layer, int64_t expert) const {
    return expert < 0 || (moe_layer_ == layer && !moe_routed_.empty() && moe_routed_.front() == expert);
  }
  bool LastFfnOfLayer(int64_t layer, int64_t expert) const {
    return expert < 0 || (moe_layer_ == layer && !moe_routed_.empty() && moe_routed_.back() == expert);
  }
  // After Drain (an error): drops every lookahead bundle no item took (their contents are unknown).
  void ForgetLookahead();
  // Adaptive lookahead: WatchTokenStart at a token's first layer, WatchTokenEnd after its last one (which turns the
  // lookahead on when a full window's I/O wait reached its share). ResetLookaheadWindow starts over, with a window
  // that is not judged (after a batched prefill, whose time is not decode's).
  void WatchTokenStart();
  void WatchTokenEnd();
  void ResetLookaheadWindow() {
    la_token_t0_ = 0;
    la_window_tokens_ = 0;
    la_window_ns_ = 0;
    la_window_wait_ns_ = 0;
    la_window_judged_ = false;
  }
  // Submits reads to the I/O thread: a new job, or appended to the open one (a lookahead is pending); returns the
  // first chunk's index in the job.
  size_t SubmitReads(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends, const char* label);
  // Releases this token's pins in acquisition order (lookahead items, misses, then hits: the LRU order follows it).
  void ReleaseAll();
  // After an error: drops the slots whose reads were pending (their contents are unknown), releases the rest.
  void AbandonPending();

  const packer::Deployment& deploy_;
  const Model& model_;
  std::shared_ptr<const ReadableFile> flash_;
  OffloadOptions options_;
  AtomicFileWriter* active_trace_ = nullptr;
  std::string trace_line_;
  EventTrace* event_trace_ = nullptr;
  // The residual stream BeforeFfn gave for the next ForwardToken, which takes it (once: nullptr afterwards).
  const float* residual_ = nullptr;
  std::vector<float> la_resid_;      // kHits guess: the residual plus the hits' share of the FFN output
  std::vector<int32_t> la_hit_rows_;  // kProjected guess: the used hits' neurons
  std::vector<float> la_rms_ratio_;   // kProjected: per layer, last token's rms(output) / rms(residual); 0: none yet
  uint64_t attention_begin_ns_ = 0;  // event trace: the current token's layer attention began (0: not traced)
  ThreadPool* pool_;
  int64_t n_groups_ = 0, n_experts_ = 0;
  int64_t cluster_neurons_ = 0;   // neurons (slots) per hot cluster
  uint64_t cluster_bytes_ = 0;    // bytes per hot cluster read
  uint64_t cold_read_ = 0;     // bytes read per cold bundle (ColdReadBytes)
  uint64_t cold_stride_ = 0;   // and its slot stride (ColdSlotBytes)
  // Merged reads of flash neighbours skip the padding between two bundles (their group's unread tail) into this
  // buffer: bytes nobody reads, shared by all requests (io::RequestBuilder::Reset).
  uint8_t* gap_sink_ = nullptr;
  size_t gap_bytes_ = 0;
  std::vector<int64_t> pinned_;     // kPinned: clusters of each group held in the hot region (slots < pinned * cluster)
  int64_t staging_slots_ = 0;       // misses that can go without a cold slot in one group (StagingSlots)
  std::unique_ptr<NeuronCache> cache_;
  std::unique_ptr<IoWorker> io_;
  // Warming (OffloadOptions::warm_next_bytes): the byte ranges to stream while waiting, the position in them and the
  // bytes left to stream for the current layer; the group whose stats count them.
  struct WarmSpan {
    const uint8_t* data = nullptr;
    size_t bytes = 0;
  };
  std::vector<WarmSpan> warm_spans_;
  size_t warm_span_ = 0, warm_offset_ = 0;
  uint64_t warm_left_ = 0;
  uint64_t warm_cap_ = 0;  // warm_next_bytes resolved (-1: half the last-level cache)
  bool warm_enabled_ = true;
  std::optional<ThreadPlacement> placement_;  // full mode, when OffloadOptions::pin_threads applies
  std::array<uint64_t, kFfnSteps> step_ns_{};
  std::vector<uint64_t> disk_interrupts_;
  std::vector<uint64_t> cpu_capacity_;  // per CPU number (cpu_capacity())
  bool pin_enabled_ = true;
  int64_t warm_group_ = -1;
  // Arms the warming for a layer's waits: the weights computed after it (ForwardToken, at the layer's first FFN).
  void ArmWarming(int64_t layer, int64_t group);
  // One step of the warming (IoWorker idle work): returns whether more steps are left.
  bool WarmStep();
  std::vector<float> thresholds_;  // per group (layer x n_experts_ + expert)
  std::vector<OffloadGroupStats> stats_;
  uint64_t sync_wait_ns_ = 0;

  // Oracle: per group, every neuron's gate row (neuron order) as a matrix.
  std::vector<std::vector<uint8_t>> oracle_gate_bytes_;
  std::vector<MatrixView> oracle_gate_;

  // Per-token scratch, sized at Create (no allocation per token).
  std::vector<int32_t> active_;          // A, ascending neurons
  std::vector<float> gate_all_;          // oracle gate values (n_ff)
  std::vector<const uint8_t*> bundle_;   // per item: its bundle once available
  std::vector<int32_t> item_unit_;       // per item: pending unit or -1
  std::vector<int32_t> cluster_slot_;    // per hot cluster of the current group: cache slot, -1 unknown, -2 bypass
  std::vector<int32_t> cluster_unit_;    // per hot cluster: pending unit, or -1 when its data is in the cache
  std::vector<int32_t> touched_clusters_;
  std::vector<Unit> units_;
  std::vector<int32_t> unit_order_;      // units sorted by offset
  std::vector<ReadRequest> requests_;    // coalesced, in unit_order_ (scattered ones point into request_builder_)
  io::RequestBuilder request_builder_;
  std::vector<int32_t> request_of_unit_; // per unit (in unit_order_ position) -> request index
  std::vector<size_t> chunk_ends_;
  std::vector<int32_t> items_by_chunk_;  // item indices grouped by chunk (CSR with chunk_item_begin_)
  std::vector<size_t> chunk_item_begin_;
  std::vector<size_t> chunk_fill_;
  std::vector<int32_t> ready_items_;
  std::vector<int32_t> deferred_hits_;  // items whose cold slot Resolve found, pinned by ResolveHits
  std::vector<uint8_t> active_flag_;    // n_ff: 1 for the neurons of the active set being resolved
  std::vector<int32_t> acquired_hot_, acquired_cold_;  // slots pinned this token, in acquisition order
  std::vector<float> hidden_;            // per item
  std::vector<uint8_t> used_flag_;       // per item
  std::vector<const uint8_t*> down_ptr_; // per item: its down column in place (slot or staging), when used
  std::vector<const uint8_t*> used_down_;
  std::vector<int32_t> used_rows_;        // batched prefill: used neurons of a token
  std::vector<float> used_hidden_;
  std::vector<const uint8_t*> gate_ptrs_, up_ptrs_;  // ComputeItems: rows to dot, by address
  std::vector<float> gate_out_, up_out_;
  // Two-phase loading.
  bool two_phase_ = false;
  std::vector<uint8_t> cold_complete_;   // per cold slot: 1 when it holds the up+down part too (verified)
  std::vector<float> gate_item_;         // per item: its gate from phase 1 (valid when gate_known_)
  std::vector<uint8_t> gate_known_;      // per item
  std::vector<int32_t> item_slot_;       // per cold-path item: its cold slot (-1: staging)
  std::vector<int32_t> item_acq_;        // per cold-path item: position in acquired_cold_ (-1: staging)
  std::vector<int32_t> gate_hit_items_;  // items whose cold slot holds only the gate part (hits)
  std::vector<int32_t> scratch_items_;   // per chunk: items to compute in full / by gate
  std::vector<int32_t> phase2_items_;    // per phase-2 request: its item
  std::vector<int32_t> phase2_units_;    // per phase-2 request: its unit
  std::vector<ReadRequest> requests2_;   // phase-2 reads (capacity n_ff: spans handed to the I/O thread stay valid)
  std::vector<size_t> chunks2_end_;      // phase-2 chunk ends (indices into requests2_)
  uint8_t* staging_ = nullptr;           // n_ff cold slots, kSlotAlignment-aligned
  Activation token_act_;                 // one prefill token
  PredictorScratch pred_scratch_;
  bool oracle_ = true;

  // Lookahead: per set b = (layer parity) x k + j (k = the experts a token uses, 1 for a dense model; j: the guessed
  // expert's rank), the group it read for (-1: none), its first chunk in the I/O job, the neuron
  // and cold slot of each of its bundles (file order; slot -1 once settled), the reverse map (n_ff, -1), its
  // requests and chunk ends, and per bundle the item of the current token that took it (-1: none).
  int64_t la_slots_ = 0;
  bool la_siblings_ = false;      // OffloadOptions::sibling_readahead in effect (the sets exist with la_slots_ 0)
  // Per routed sibling j: its group (-1: none) and the active set predicted for it (IssueSiblings).
  std::vector<int64_t> sib_group_;
  std::vector<std::vector<int32_t>> sib_active_;
  // MoE: the sets GuessGroup prepared and SubmitDeferredSets reads as one stream (their requests copied in set order,
  // chunk ends shifted), per layer parity like the sets, so that a stream still in flight is never rewritten.
  std::vector<int> deferred_sets_;
  std::vector<ReadRequest> deferred_requests_[2];
  std::vector<size_t> deferred_chunk_ends_[2];
  bool la_on_ = true;             // false while an adaptive lookahead waits for its trigger
  int64_t la_tokens_ = 0;         // tokens whose last layer ran while it watched
  int64_t la_started_token_ = 0;  // la_tokens_ when it turned on
  uint64_t la_token_t0_ = 0;      // the current token's start (0: none) and the I/O wait then
  uint64_t la_token_wait0_ = 0;
  int64_t la_window_tokens_ = 0;  // the current window: tokens, their time, their I/O wait
  uint64_t la_window_ns_ = 0;
  uint64_t la_window_wait_ns_ = 0;
  bool la_window_judged_ = false;  // false: the current window warms the cache and is not judged
  int64_t la_per_layer_ = 1;
  std::vector<int64_t> la_group_;
  std::vector<size_t> la_first_chunk_;
  std::vector<std::vector<int32_t>> la_neurons_;
  std::vector<std::vector<int32_t>> la_slot_;
  std::vector<std::vector<int32_t>> la_index_of_neuron_;
  std::vector<std::vector<ReadRequest>> la_requests_;  // scattered ones point into la_builder_ of the same set
  std::vector<io::RequestBuilder> la_builder_;
  std::vector<std::vector<size_t>> la_chunk_ends_;
  std::vector<std::vector<int32_t>> la_item_;
  std::vector<float> la_router_;         // MoE: the guessed layer's router logits
  std::vector<int64_t> la_experts_;      // MoE: its top-k experts
  int la_current_ = -1;                  // set the current token's Resolve uses (-1: none)
  // OffloadOptions::lookahead_replay: per step of the file its group and active neurons; the current step (-1: none
  // yet) and whether the run still follows the file.
  std::vector<int64_t> replay_group_;
  std::vector<std::vector<int32_t>> replay_set_;
  int64_t replay_step_ = -1;
  bool replay_on_ = false;
  std::vector<int32_t> la_items_;        // items served by a read ahead
  std::vector<uint8_t> la_taken_;        // per item: served by a read ahead (set by Resolve when a set was current)
  std::vector<float> la_scale_;          // per layer l x dim: ffn_norm[l+1] / ffn_norm[l] (next-layer, up to
                                         // n_layers - 2) or ffn_norm[l] / attn_norm[l] (same-layer)
  std::vector<float> la_x_;              // the rescaled input
  Activation la_act_;
  std::vector<int32_t> la_rows_;         // candidates (oracle: rows whose gate is computed)
  std::vector<float> la_score_;          // per candidate (oracle: gate value)
  std::vector<int32_t> la_pick_;
  bool io_open_ = false;                 // the I/O job has chunks a later layer will wait for

  // Batched prefill: two layer buffers (the region of `buf_layer_[b]`, -1 none), the read in flight, scratch.
  struct AlignedFree {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  // Points the buffers below into `block` (PrefillBufferBytes: own memory, or lent cold slots).
  void CarvePrefill(uint8_t* block);
  // In-cache prefill: lends the cold slots (the caller has dropped the lookahead and its pins) / takes them back
  // (after draining reads into them); both no-ops in the other modes or when already done.
  Status LendPrefillMemory();
  void ReclaimPrefillMemory();
  struct PrefillBuffer {
    uint8_t* data = nullptr;
    size_t bytes = 0;
  };
  std::unique_ptr<uint8_t, AlignedFree> prefill_owned_;  // own memory (not in-cache)
  uint64_t prefill_block_bytes_ = 0;                      // PrefillBufferBytes when batched prefill is on, else 0
  bool prefill_in_cache_ = false;
  int32_t prefill_slots_ = 0;                             // in-cache: the cold slots the buffers take
  int32_t prefill_lent_first_ = -1;                       // in-cache: the first lent cold slot while lent, else -1
  PrefillBuffer prefill_buf_[2];
  uint8_t* down_compact_ = nullptr;      // per neuron its down column (compact down matrix rows)
  int64_t buf_group_[2] = {-1, -1};
  int pending_buf_ = -1;                  // buffer whose read the I/O thread runs, -1 none
  int arrived_buf_ = -1;                  // buffer whose prefetch CompletePrefetch waited for (not yet verified), -1 none
  Status arrived_status_;                 // that read's status
  uint64_t arrived_read_ns_ = 0;          // and its time
  std::vector<ReadRequest> prefill_reqs_[2];
  std::vector<size_t> prefill_chunks_[2];
  std::vector<uint8_t> warm_age_;   // per neuron: 1 + how many tokens before the batch's last it was last used
                                    // (1..kWarmTokens), 0 when not among the last kWarmTokens (WarmColdRegion)
  std::vector<int32_t> warm_rows_;
  // Predictor-mode batched prefill: per compute thread, one token's scratch (grown on first use, kept).
  struct PrefillThread {
    Activation act;
    PredictorScratch pred;
    std::vector<int32_t> active, rows;
    std::vector<const uint8_t*> ptrs, up_ptrs;
    std::vector<float> out, hidden;
  };
  std::vector<PrefillThread> pf_threads_;
  std::vector<std::vector<int32_t>> pf_warm_rows_;  // the used rows of the batch's last kWarmTokens tokens
  float* pf_gate_ = nullptr;              // kPrefillTokenTile x n_ff, slot-view order (see ForwardBatch)
  float* pf_up_ = nullptr;
  OffloadPrefillStats prefill_stats_;
  int64_t preloaded_bundles_ = 0;
  // Per group: its cold partition, or its share of one shared pool (ShareOutColdRegion); what the preload and the
  // prefill's warming fill at most.
  std::vector<int64_t> cold_share_;
  double preload_s_ = 0.0;
  OffloadPrefillStats prefill_batch_start_;  // at the current prompt's first batched FFN (for the per-prompt log line)
  bool prefill_batch_begins_ = true;         // set by BeforeAttention of layer 0 for a batch
  bool in_batch_ = false;                    // the engine's current Eval has more than one token (BeforeAttention)
  bool new_prompt_ = true;                   // a batch began after a one-token Eval (or the first): prefill_layers_
                                             // starts over at its first batched FFN
  int64_t prompt_chunk_ = -1;                // batched Evals of the current prompt so far, less one
  // MoE: the layer of the last BeforeExperts and its experts that go through ForwardBatch, ascending.
  int64_t moe_layer_ = -1;
  std::vector<int64_t> moe_batched_;
  std::vector<int64_t> moe_routed_;  // the experts with tokens, ascending
  bool moe_one_token_ = false;       // the routing is one token's (decode): every routed expert gets the same input
  std::vector<PrefillLayerTiming> prefill_layers_;  // the current prompt's batched FFN passes, every chunk's
  uint64_t last_region_read_ns_ = 0;                // set by FinishRegionRead
};

}  // namespace nflash::sparse
