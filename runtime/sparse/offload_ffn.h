// The flash-offloaded FFN: an FfnBackend that computes each token's FFN from neuron bundles (gate row | up row | down
// column) held in the neuron cache or read from the deployment's ffn.bin, the numerics of the in-memory sparse FFN
// (runtime/engine/sparse_ffn.h) with a different source of rows.
//
// Per token and FFN (group g = layer x expert):
//   1. active set A, ascending: the predictor's guess, or (oracle, for testing) the exact set from all gate rows,
//      which this backend then holds in memory (read from flash and checked once, at Create);
//   2. every neuron of A is looked up: hot neurons (slot < hot_count) by their cluster in the hot region, others in
//      the cold region; misses become reads into the slot they were given (or into staging memory when the cache has
//      no slot for them), sorted by file offset and coalesced;
//   3. full mode: the misses are read by the I/O thread in chunks while this thread computes the hits, then each
//      chunk as it completes; llmflash mode: every miss is read with a blocking pread, then everything is computed;
//   4. every bundle that arrives is checked against its xxHash64 (a mismatch or a failed read is retried once with a
//      synchronous read, then is an error naming layer, neuron and ffn.bin offset);
//   5. per neuron k of A: h_k = ActivateNeuron(gate_k, up_k) (0 unless |act(gate_k)| > threshold) and its down
//      column copied to row k of a compact matrix; then out = sum over k ascending with h_k != 0 of h_k * down_k
//      (AccumulateRows): the summation order is that of A, never the order reads completed in, so results do not
//      depend on timing, cache state or mode, and equal SparseFfn's (same rows, same order, same kernels).
//
// Batched prefill (x.n() > 1, dense FFN, with options.batched_prefill and its buffers; offload_prefill.cc): the
// layer's whole region is read sequentially in kPrefillRequestBytes requests into one of two layer buffers while the
// next layer's region is prefetched into the other; gate/up of every neuron by GemmMany over strided views of the
// bundles, then per token the down columns of the neurons with h != 0 accumulated in ascending neuron order (the
// token path's arithmetic: oracle mode gives bitwise the token-by-token result; predictor mode computes every neuron,
// as the in-memory engine's dense prefill does). The hot clusters read are copied into the hot region (a fair share
// per layer) so decode starts warm.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "packer/deployment.h"
#include "runtime/core/file.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/sparse/io_worker.h"
#include "runtime/sparse/neuron_cache.h"

namespace nflash::sparse {

enum class OffloadMode { kFull, kLlmFlash };
const char* OffloadModeName(OffloadMode mode);

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
  // Hot cluster size in flash groups (0: kDefaultClusterBytes worth). A cluster is read with one request.
  int64_t cluster_groups = 0;
  // Coalesced requests per pipeline chunk (one batched submission each; the compute thread can start on a chunk as
  // soon as it completes).
  int64_t chunk_requests = 16;
  // Largest merged request.
  size_t max_request_bytes = size_t{256} << 10;
  // Memory for the cache arena (NeuronCache::ArenaBytes of the cache this creates), e.g. registered with the I/O
  // reader as fixed buffers; nullptr: the cache allocates its own.
  uint8_t* arena = nullptr;
  size_t arena_bytes = 0;
  // Batched prefill through two layer buffers (PrefillBufferBytes); false: prefill runs token by token (e.g. when the
  // memory budget has no room for the buffers).
  bool batched_prefill = false;
};

// Prefill reads: 1 MiB requests reach sequential flash bandwidth (UFS/NVMe saturate at 512 KiB-1 MiB) while the
// queue keeps a few in flight; larger ones only add latency before the first bytes can be checked.
inline constexpr size_t kPrefillRequestBytes = size_t{1} << 20;
// Tokens per batched-prefill tile: the gate/up outputs of a tile (2 x tile x n_ff floats) stay a few MiB at 7B scale.
inline constexpr int64_t kPrefillTokenTile = 64;

// Batched prefill, summed over layers.
struct OffloadPrefillStats {
  int64_t layers = 0;          // layer passes (one per layer and batch)
  int64_t tokens = 0;          // token-layer pairs
  int64_t requests = 0;
  uint64_t bytes_read = 0;
  int64_t prefetch_hits = 0;   // layers whose region had been prefetched during the previous layer
  uint64_t io_wait_ns = 0;     // compute thread blocked on the region read (exposed I/O)
  uint64_t verify_ns = 0;      // xxHash64 of every bundle read
  uint64_t compute_ns = 0;     // gate/up GEMM, activation, down accumulation
  uint64_t gate_up_ns = 0;     // of which the gate/up GEMM
  int64_t warmed_clusters = 0; // hot clusters copied into the hot region
  int64_t retries = 0;
};

// 64 KiB: large enough that a hot cluster read runs near sequential flash throughput (random-read bandwidth keeps
// rising up to ~64 KiB requests on UFS/NVMe), small enough that LRU per cluster still tracks popularity.
inline constexpr size_t kDefaultClusterBytes = size_t{64} << 10;

// Per group (layer x expert), summed over tokens.
struct OffloadGroupStats {
  int64_t tokens = 0;
  int64_t active = 0;       // |A|
  int64_t used = 0;         // neurons whose h != 0 (rows of the down accumulation)
  int64_t requests = 0;     // reads issued after coalescing (retries excluded)
  uint64_t bytes_read = 0;  // bytes of those reads
  int64_t retries = 0;
};

// Thread-safety: not thread-safe; one per InferenceContext. Owns one I/O thread in full mode. The deployment, model,
// predictor, flash file and pool must outlive it.
class OffloadFfn : public FfnBackend {
 public:
  static Result<std::unique_ptr<OffloadFfn>> Create(const packer::Deployment& deployment, const Model& model,
                                                    std::shared_ptr<const ReadableFile> flash,
                                                    const OffloadOptions& options, ThreadPool* pool);
  ~OffloadFfn() override;

  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override;

  const NeuronCache& cache() const { return *cache_; }
  const std::vector<OffloadGroupStats>& stats() const { return stats_; }
  OffloadGroupStats TotalStats() const;
  void ResetStats();
  // Nanoseconds the compute thread waited for reads (full: blocked on chunks; llmflash: inside the blocking reads).
  uint64_t io_wait_ns() const;
  // Bytes this backend holds besides the cache arena: scratch, staging for misses without a slot, oracle gate rows.
  uint64_t scratch_bytes() const;
  uint64_t oracle_bytes() const;
  int64_t hot_cluster_neurons() const { return cluster_neurons_; }
  OffloadMode mode() const { return options_.mode; }

  // What Create will allocate, for the memory budget before the cache is sized: staging + compact down + scratch
  // (per_token_bytes) and oracle gate rows (0 with a predictor).
  static uint64_t EstimateScratchBytes(const packer::Deployment& deployment);
  static uint64_t EstimateOracleBytes(const packer::Deployment& deployment, bool oracle);
  // Slot sizes of the two regions for `cluster_groups` (0: default).
  static uint64_t HotSlotBytes(const packer::Deployment& deployment, int64_t cluster_groups);
  static uint64_t ColdSlotBytes(const packer::Deployment& deployment);
  // Hot clusters of all groups and cold-eligible neurons of all groups (the most each region could use).
  static int64_t HotClusterCount(const packer::Deployment& deployment, int64_t cluster_groups);
  // What batched prefill allocates: two buffers of the largest region plus the gate/up outputs of a token tile.
  static uint64_t PrefillBufferBytes(const packer::Deployment& deployment);
  bool batched_prefill() const { return !prefill_buf_[0].empty(); }
  const OffloadPrefillStats& prefill_stats() const { return prefill_stats_; }
  uint64_t prefill_bytes() const;

 private:
  // A read of one unit (a cold neuron bundle or a hot cluster) into `dst`.
  struct Unit {
    uint64_t offset = 0;
    size_t size = 0;
    uint8_t* dst = nullptr;
    int32_t cache_slot = -1;  // -1: staging
    bool hot = false;
    int64_t index = 0;        // neuron (cold) or cluster (hot)
    int32_t acquired = -1;    // position in acquired_hot_ / acquired_cold_ (-1: staging)
  };
  OffloadFfn(const packer::Deployment& deployment, const Model& model, std::shared_ptr<const ReadableFile> flash,
             const OffloadOptions& options, ThreadPool* pool);
  Status Init();
  Status LoadOracleGates();
  // Batched dense prefill of a dense FFN layer (offload_prefill.cc).
  Status ForwardBatch(int64_t layer, const Activation& x, float* out);
  // kPrefillRequestBytes rounded down to whole flash groups (at least one).
  uint64_t PrefillRequestBytes() const;
  // Allocates the prefill buffers when options.batched_prefill (dense models only).
  Status InitPrefill();
  // Starts reading `layer`'s region into prefill buffer `buf` (I/O thread in full mode, else synchronously).
  Status StartRegionRead(int64_t layer, int buf);
  // Waits for / verifies the region in buffer `buf` (bad bundles re-read once synchronously).
  Status FinishRegionRead(int64_t layer, int buf);
  // Drops a prefetch still in flight (before the I/O thread is used for something else).
  void CancelPrefetch();
  void WarmHotRegion(int64_t group, const packer::RegionInfo& region, const uint8_t* buf);
  // One token (x.n() == 1).
  Status ForwardToken(int64_t group, int64_t layer, int64_t expert, const Activation& x, float* out);
  // Resolves A into items (bundle pointers or pending units), filling units_ with the misses.
  Status Resolve(int64_t group, const packer::RegionInfo& region);
  Status VerifyUnit(int64_t layer, int64_t expert, const packer::RegionInfo& region, const Unit& u) const;
  // Verifies unit `u` after its read finished with `read_status`; a failed read or a mismatch is retried once with a
  // synchronous read, then is an error naming layer, neuron (or hot cluster) and ffn.bin offset.
  Status CheckArrival(int64_t layer, int64_t expert, const packer::RegionInfo& region, size_t u,
                      const Status& read_status);
  void ComputeItems(std::span<const int32_t> items, const Activation& x, float threshold);
  // Releases this token's pins in acquisition order (so LRU order is access order).
  void ReleaseAll();
  // After an error: drops the slots whose reads were pending (their contents are unknown), releases the rest.
  void AbandonPending();

  const packer::Deployment& deploy_;
  const Model& model_;
  std::shared_ptr<const ReadableFile> flash_;
  OffloadOptions options_;
  ThreadPool* pool_;
  int64_t n_groups_ = 0, n_experts_ = 0;
  int64_t cluster_neurons_ = 0;   // neurons (slots) per hot cluster
  uint64_t cluster_bytes_ = 0;    // bytes per hot cluster read
  uint64_t cold_stride_ = 0;
  std::unique_ptr<NeuronCache> cache_;
  std::unique_ptr<IoWorker> io_;
  std::vector<float> thresholds_;
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
  std::vector<ReadRequest> requests_;    // coalesced, in unit_order_
  std::vector<int32_t> request_of_unit_; // per unit (in unit_order_ position) -> request index
  std::vector<size_t> chunk_ends_;
  std::vector<int32_t> items_by_chunk_;  // item indices grouped by chunk (CSR with chunk_item_begin_)
  std::vector<size_t> chunk_item_begin_;
  std::vector<size_t> chunk_fill_;
  std::vector<int32_t> ready_items_;
  std::vector<int32_t> acquired_hot_, acquired_cold_;  // slots pinned this token, in acquisition order
  std::vector<float> hidden_;            // per item
  std::vector<uint8_t> used_flag_;       // per item
  std::vector<int32_t> used_rows_;
  std::vector<float> used_hidden_;
  std::vector<uint8_t> down_compact_;    // per item: its down column (compact down matrix rows)
  uint8_t* staging_ = nullptr;           // n_ff cold slots, kSlotAlignment-aligned
  Activation token_act_;                 // one prefill token
  PredictorScratch pred_scratch_;
  bool oracle_ = true;

  // Batched prefill: two layer buffers (the region of `buf_layer_[b]`, -1 none), the read in flight, scratch.
  struct AlignedFree {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  struct PrefillBuffer {
    std::unique_ptr<uint8_t, AlignedFree> data;
    size_t bytes = 0;
    bool empty() const { return bytes == 0; }
  };
  PrefillBuffer prefill_buf_[2];
  int64_t buf_layer_[2] = {-1, -1};
  int pending_buf_ = -1;                  // buffer whose read the I/O thread runs, -1 none
  std::vector<ReadRequest> prefill_reqs_[2];
  std::vector<size_t> prefill_chunks_[2];
  std::vector<float> pf_gate_, pf_up_;    // kPrefillTokenTile x n_ff, slot-view order (see ForwardBatch)
  OffloadPrefillStats prefill_stats_;
  OffloadPrefillStats prefill_batch_start_;  // at layer 0 of the current prompt (for the per-prompt log line)
};

}  // namespace nflash::sparse
