// The sparse runtime assembled from a deployment directory: the resident model (attention, embeddings, norms, head
// from resident.gguf; no FFN weights in memory), the predictor (or the oracle), the flash reader (O_DIRECT +
// io_uring), the memory budget and its cache split, the offloaded FFN backend and one inference context using it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "packer/deployment.h"
#include "runtime/core/file.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/io/direct_reader.h"
#include "runtime/sparse/flash_embedding.h"
#include "runtime/sparse/hot_split.h"
#include "runtime/sparse/memory_budget.h"
#include "runtime/sparse/offload_ffn.h"
#include "runtime/text/tokenizer.h"

namespace nflash::sparse {

enum class ActiveSetSource {
  kAuto,       // the deployment's predictor when it has one, else the oracle
  kPredictor,  // the deployment's predictor (error when it has none)
  kOracle,     // the exact active set from every gate row (held in memory: for testing and upper bounds)
};

struct SparseRuntimeOptions {
  OffloadMode mode = OffloadMode::kFull;
  ActiveSetSource active_set = ActiveSetSource::kAuto;
  std::vector<float> activation_threshold;  // per layer; empty: predictor's / 0
  // Everything the process holds (0: no budget; the caches get hot_slots / cold_slots).
  uint64_t memory_budget = 0;
  // The fixed part the plan that gave the cache sizes was made for (plan.json `fixed_bytes`; 0: no plan): named when
  // this runtime's fixed part has grown since and the sizes no longer fit.
  uint64_t plan_fixed_bytes = 0;
  // With memory_budget and no per-group sizes: the share of the cache bytes for the pinned hot region (SplitBudget),
  // or kAutoHotFraction: all pinned or all one LRU pool by the deployment's profile (hot_split.h).
  double hot_fraction = kAutoHotFraction;
  int64_t hot_slots = 0, cold_slots = 0;
  // Cold slots per layer/expert (manifest region order), e.g. from a plan: replaces cold_slots. With a memory budget
  // as well, these sizes are used as given and checked against the budget (no SplitBudget).
  std::vector<int64_t> cold_slots_per_group;
  // With cold_slots_per_group: their sum becomes one pool that every layer/expert competes for (LRU over all of them)
  // instead of one partition each; the memory is the same, the staging smaller (a layer's misses always find a slot
  // when the pool holds n_ff).
  bool shared_cold_pool = false;
  // Hot region policy (offload_ffn.h HotPolicy); with kPinned, pinned clusters per layer/expert (e.g. from a plan;
  // empty: hot_slots, or the budget's hot share, split evenly).
  HotPolicy hot_policy = HotPolicy::kPinned;
  std::vector<int64_t> hot_slots_per_group;
  int64_t n_ctx = 0;  // <= 0: the model's context length
  // Tokens a prompt runs through the layers at a time (InferenceContext::SetMaxBatch): the context's batch scratch
  // for that many tokens is allocated at Open and counted in the fixed part, so a long prompt stays within the budget.
  int64_t max_batch = kDefaultMaxBatch;
  // Tokens whose logits one Eval keeps at most (an all_logits Eval, e.g. a perplexity window; 1 for generation):
  // allocated at Open and counted in the fixed part.
  int64_t logits_tokens = 1;
  KvType kv_type = KvType::kF32;
  int64_t cluster_groups = 0;
  int64_t chunk_requests = 16;
  // OffloadOptions::scatter_reads.
  bool scatter_reads = true;
  // OffloadOptions::preload_cold.
  bool preload_cold = true;
  // OffloadOptions::sibling_readahead.
  bool sibling_readahead = true;
  // With per-layer cold partitions: the staging memory serves as the cold region's overflow pool
  // (OffloadOptions::cold_overflow_slots); false: it stays staging (a comparison).
  bool cold_overflow = true;
  // OffloadOptions::cold_protected_fraction.
  double cold_protected_fraction = kDefaultColdProtectedFraction;
  io::DirectReaderOptions io;
  // Batched prefill (OffloadFfn). Under a memory budget its buffers are cold-cache slots lent for each prompt
  // (OffloadOptions::prefill_in_cache; with a cold region too small for them prefill runs token by token, logged);
  // without one, two layer buffers and scratch of their own, counted in the fixed part.
  bool batched_prefill = true;
  // Lend the cold slots without a memory budget too (a comparison).
  bool prefill_in_cache = false;
  // OffloadOptions::batched_prefill_min_tokens.
  int64_t batched_prefill_min_tokens = kDefaultBatchedPrefillMinTokens;
  // Two-phase loading of cold misses (OffloadOptions::two_phase): predictor mode with a layout that allows it.
  bool two_phase = false;
  // Cross-layer lookahead bundles per buffer (OffloadOptions::lookahead_slots; -1: n_ff / 8, 0: off).
  int64_t lookahead_slots = -1;
  // OffloadOptions::lookahead_keep.
  double lookahead_keep = kDefaultLookaheadKeep;
  // OffloadOptions::warm_next_bytes.
  int64_t warm_next_bytes = -1;
  // OffloadOptions::pin_threads.
  PinThreads pin_threads = PinThreads::kAuto;
  // OffloadOptions::lookahead_adaptive and the share of time waiting for reads that turns it on.
  bool lookahead_adaptive = false;
  double lookahead_wait_share = kDefaultLookaheadWaitShare;
  // OffloadOptions::lookahead_source.
  LookaheadSource lookahead_source = LookaheadSource::kNextLayer;
  // OffloadOptions::lookahead_input (kProjected falls back to kHits without the deployment's lookahead table).
  LookaheadInput lookahead_input = LookaheadInput::kProjected;
  // OffloadOptions::lookahead_replay.
  std::string lookahead_replay;
  // Cold slots are the bundle rounded up to this alignment (OffloadOptions::dio_alignment, ColdReadBytes); 0: the flash
  // file's direct-I/O alignment (statx; 4096 when unknown or without O_DIRECT). kSlotAlignment: whole 4 KiB groups (a
  // comparison).
  uint64_t slot_alignment = 0;
  // Read token embedding rows from flash (FlashEmbedding) instead of holding token_embd in memory, when the model has
  // its own output head (tied embeddings are the head and stay resident); false: resident (a comparison).
  bool embedding_on_flash = true;
  // Tests: wraps the flash file (fault injection through the File abstraction).
  std::function<std::shared_ptr<const ReadableFile>(std::shared_ptr<const ReadableFile>)> wrap_flash;
};

// The lookahead that `--lookahead` (`flag`, -1: auto) asks for, with `compute_threads` compute threads (0: every
// core), `threads_pinned` when the decode's threads are pinned (thread_placement.h). The lookahead trades CPU (a second
// predictor pass per layer, more read requests, their verification) for I/O wait. With a core beyond the compute
// threads, or with the threads pinned (the I/O thread then no longer preempts the caller's serial steps: SYNTHETIC 7B
// at 1392M on 2 vCPUs, pinned, the lookahead cut the wait from ~12 to ~8.5 ms per token, +3-10% tok/s in 3 of 3
// pairs), auto reads ahead from the start (n_ff / 8 bundles). Where unpinned compute threads take every core, that CPU
// is short, and whether the trade pays depends on the disk (the same model unpinned: ~3% slower on a disk of ~140k
// IOPS, median +5% on one of ~70k): auto is then adaptive, off until waiting for reads takes
// kDefaultLookaheadWaitShare of a window of tokens (OffloadOptions::lookahead_adaptive).
struct LookaheadChoice {
  int64_t slots = 0;      // OffloadOptions::lookahead_slots
  bool adaptive = false;  // OffloadOptions::lookahead_adaptive
};
LookaheadChoice AutoLookahead(int64_t flag, int compute_threads, bool threads_pinned);
// Whether a runtime opened with `mode` and `pin` and `compute_threads` threads (0: every core) from this thread will
// pin them (OffloadFfn: full mode, PlanThreadCpus on the CPUs the calling thread may use).
bool ThreadsPinned(OffloadMode mode, PinThreads pin, int compute_threads);

// Thread-safety: not thread-safe (one sequence). The pool must outlive it.
class SparseRuntime {
 public:
  static Result<std::unique_ptr<SparseRuntime>> Open(const std::string& deploy_dir, const SparseRuntimeOptions& options,
                                                     ThreadPool* pool);
  ~SparseRuntime();

  const packer::Deployment& deployment() const { return *deploy_; }
  const Model& model() const { return *model_; }
  InferenceContext& context() { return *ctx_; }
  OffloadFfn& ffn() { return *ffn_; }
  const Predictor* predictor() const { return predictor_.get(); }
  // The model's tokenizer (from resident.gguf; nullptr when it has no vocabulary or one LoadTokenizer refuses, which
  // Open logs), counted in the fixed part.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  LookaheadInput lookahead_input() const { return lookahead_input_; }
  // nullptr when the flash file is not read through io_uring.
  const io::DirectReader* reader() const { return reader_; }
  const FixedMemory& fixed() const { return fixed_; }
  const CacheSplit& split() const { return split_; }
  // How the budget's cache bytes were shared out (a budget without per-group sizes; otherwise hot_fraction -1).
  const HotSplitChoice& hot_split() const { return hot_split_; }
  // Token embedding rows read from flash; nullptr when token_embd is in memory.
  const FlashEmbedding* embedding() const { return embedding_.get(); }
  // Bytes of one cold slot (OffloadFfn::ColdSlotBytes at the alignment in effect).
  uint64_t cold_slot_bytes() const { return cold_slot_bytes_; }
  uint64_t budget() const { return budget_; }
  // The accounting table (memory_budget.h) of what this runtime holds.
  std::string Accounting() const;

 private:
  SparseRuntime() = default;
  std::unique_ptr<packer::Deployment> deploy_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Predictor> predictor_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<packer::LookaheadTable> lookahead_table_;  // kProjected's table (nullptr: not used)
  LookaheadInput lookahead_input_ = LookaheadInput::kHits;  // what the lookahead really guesses from
  std::shared_ptr<const ReadableFile> flash_;
  uint64_t cold_slot_bytes_ = 0;
  std::unique_ptr<FlashEmbedding> embedding_;
  const io::DirectReader* reader_ = nullptr;
  std::unique_ptr<io::AlignedArena> arena_;
  std::unique_ptr<InferenceContext> ctx_;
  std::unique_ptr<OffloadFfn> ffn_;
  FixedMemory fixed_;
  CacheSplit split_;
  HotSplitChoice hot_split_{.hot_fraction = -1.0, .why = "sizes given"};
  uint64_t budget_ = 0;
};

}  // namespace nflash::sparse
