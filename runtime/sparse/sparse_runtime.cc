// Assembles the sparse runtime from a deployment directory (see sparse_runtime.h).
#include "runtime/sparse/sparse_runtime.h"

#include <pthread.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "runtime/core/cpu_affinity.h"
#include "runtime/core/log.h"

namespace nflash::sparse {

SparseRuntime::~SparseRuntime() {
  // The backend (and its I/O thread) goes before the reader and the arena it reads into.
  if (ctx_) ctx_->SetFfnBackend(nullptr);
  ffn_.reset();
  ctx_.reset();
}

Result<std::unique_ptr<SparseRuntime>> SparseRuntime::Open(const std::string& deploy_dir,
                                                           const SparseRuntimeOptions& options, ThreadPool* pool) {
  std::unique_ptr<SparseRuntime> rt(new SparseRuntime());
  packer::Deployment::Options open_options;
  open_options.resident_in_memory = true;  // resident weights by O_DIRECT, like the FFN: never the page cache
  open_options.embedding_on_flash = options.embedding_on_flash;
  NF_ASSIGN_OR_RETURN(rt->deploy_, packer::Deployment::Open(deploy_dir, open_options));
  const packer::Deployment& d = *rt->deploy_;
  LoadOptions lo;
  lo.external_ffn = true;
  NF_ASSIGN_OR_RETURN(rt->model_, Model::FromGguf(d.resident_shared(), lo));
  const LlamaHparams& hp = rt->model_->hparams();
  // The tokenizer, for the commands that take and give text (a vocabulary nflash cannot build leaves it null: the
  // runtime still computes tokens, e.g. for `nflash plan` and `bench`).
  if (d.resident().Find("tokenizer.ggml.tokens") != nullptr) {
    Result<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(d.resident());
    if (tok.ok()) {
      rt->tokenizer_ = std::move(tok).value();
    } else {
      NF_LOG(Warning) << d.resident_path() << ": no tokenizer: " << tok.status().ToString();
    }
  }

  const std::string pred_path = d.predictor_path();
  bool oracle = options.active_set == ActiveSetSource::kOracle;
  if (options.active_set == ActiveSetSource::kPredictor && pred_path.empty()) {
    return Status::InvalidArgument(deploy_dir + " has no predictor.gguf (pack with --predictor, or use the oracle)");
  }
  if (options.active_set == ActiveSetSource::kAuto) oracle = pred_path.empty();
  if (!oracle) {
    NF_ASSIGN_OR_RETURN(rt->predictor_, Predictor::Load(pred_path));
    NF_RETURN_IF_ERROR(rt->predictor_->CheckForModel(*rt->model_, d.manifest().model_hash, deploy_dir));
  }

  // The flash image through O_DIRECT + io_uring.
  NF_ASSIGN_OR_RETURN(std::unique_ptr<io::DirectReader> reader, io::DirectReader::Open(d.flash_path(), options.io));
  io::DirectReader* reader_raw = reader.get();
  rt->reader_ = reader_raw;
  std::shared_ptr<const ReadableFile> flash(std::move(reader));
  rt->flash_ = options.wrap_flash ? options.wrap_flash(flash) : flash;

  rt->ctx_ = std::make_unique<InferenceContext>(*rt->model_, pool, options.n_ctx, options.kv_type);
  // A prompt's chunk scratch now, so that the fixed part counts it (the FFN's own vectors are never used: the
  // offloaded FFN computes every FFN, with scratch of its own).
  rt->ctx_->SetMaxBatch(options.max_batch);
  rt->ctx_->ReserveBatch(options.max_batch, /*ffn=*/false);
  rt->ctx_->ReserveLogits(options.logits_tokens);
  if (d.embedding_range().size > 0) {
    // One row per token from flash, O_DIRECT like every other weight.
    NF_ASSIGN_OR_RETURN(std::unique_ptr<io::DirectReader> emb_reader, io::DirectReader::Open(d.resident_path()));
    const MatrixView& emb = rt->model_->token_embd();
    NF_ASSIGN_OR_RETURN(rt->embedding_, FlashEmbedding::Create(std::move(emb_reader), d.embedding_range(), emb.rows,
                                                               emb.row_bytes));
    const FlashEmbedding* e = rt->embedding_.get();
    rt->ctx_->SetEmbeddingSource([e](int32_t token, uint8_t* row) { return e->Row(token, row); });
  }
  // Cold slots at the file's direct-I/O alignment (a non-direct reader has no requirement: kSlotAlignment keeps its
  // slots what they would be with O_DIRECT on a 4 KiB device).
  const uint64_t dio_alignment =
      options.slot_alignment > 0 ? options.slot_alignment
                                 : (reader_raw->direct_io() ? reader_raw->alignment() : kSlotAlignment);
  if (dio_alignment > kSlotAlignment || (dio_alignment & (dio_alignment - 1)) != 0) {
    return Status::InvalidArgument("slot alignment " + std::to_string(dio_alignment) + " for " + d.flash_path() +
                                   ": expected a power of two up to " + std::to_string(kSlotAlignment));
  }

  // The fixed part and the cache split.
  FixedMemory& f = rt->fixed_;
  f.resident_weights = d.resident_memory_bytes();
  f.kv_cache = KvCacheBytes(hp.n_layers, rt->ctx_->kv_positions(), hp.kv_dim(), KvElementBytes(options.kv_type));
  const uint64_t ctx_state = rt->ctx_->state_bytes();
  f.scratch = (ctx_state > f.kv_cache ? ctx_state - f.kv_cache : 0) + OffloadFfn::EstimateScratchBytes(d, dio_alignment) +
              (rt->embedding_ ? rt->embedding_->memory_bytes() : 0);
  // Index tables of every region: slot_of_neuron, neuron_of_slot (4 bytes each), two hashes (8 bytes each).
  f.scratch += static_cast<uint64_t>(d.manifest().regions.size()) * static_cast<uint64_t>(hp.n_ff) * 24;
  // The resident image's parsed metadata, held with the model (the vocabulary's arrays: 18 MB of a 151936-token one),
  // and the tokenizer (the vocabulary again as strings, its lookup table and merges: 18 MB more).
  f.vocabulary = d.resident().MetadataHeapBytes() + (rt->tokenizer_ ? rt->tokenizer_->HeapBytes() : 0);
  f.predictor = oracle ? OffloadFfn::EstimateOracleBytes(d, true) : rt->predictor_->PredictorBytes();
  // The lookahead table, when the guess it serves runs (kProjected; otherwise, or without the file, kHits' rule).
  rt->lookahead_input_ = options.lookahead_input;
  if (rt->lookahead_input_ == LookaheadInput::kProjected) {
    OffloadOptions lookahead;  // what OffloadFfn::LookaheadSlots decides the lookahead from
    lookahead.mode = options.mode;
    lookahead.two_phase = options.two_phase;
    lookahead.predictor = rt->predictor_.get();  // TwoPhaseUnusable: null for the oracle
    lookahead.dio_alignment = dio_alignment;
    lookahead.lookahead_slots = options.lookahead_slots;
    const bool usable = !oracle && hp.n_experts == 0 && !d.lookahead_path().empty() &&
                        options.lookahead_source == LookaheadSource::kNextLayer &&
                        OffloadFfn::LookaheadSlots(d, lookahead) > 0;
    if (usable) {
      NF_ASSIGN_OR_RETURN(rt->lookahead_table_, packer::LookaheadTable::Load(d.lookahead_path(), *rt->predictor_));
      f.lookahead = rt->lookahead_table_->bytes();
    } else {
      rt->lookahead_input_ = LookaheadInput::kHits;
      if (!oracle && hp.n_experts == 0 && d.lookahead_path().empty() && options.mode == OffloadMode::kFull) {
        NF_LOG(Info) << deploy_dir << " has no lookahead table (packed before lookahead.gguf existed): the lookahead "
                     << "guesses from the hits' down columns (--lookahead-input hits)";
      }
    }
  }
  CacheShape shape;
  shape.n_groups = static_cast<int64_t>(d.manifest().regions.size());
  shape.hot_slot_bytes = OffloadFfn::HotSlotBytes(d, options.cluster_groups);
  shape.hot_clusters = OffloadFfn::HotClusterCount(d, options.cluster_groups, options.hot_policy);
  shape.cold_slot_bytes = OffloadFfn::ColdSlotBytes(d, dio_alignment);
  rt->cold_slot_bytes_ = shape.cold_slot_bytes;
  if (d.layout().slots_per_group == 1 && shape.cold_slot_bytes < d.layout().group_bytes) {
    NF_LOG(Info) << "cold slots of " << shape.cold_slot_bytes << " bytes: the " << d.layout().bundle_bytes
                 << "-byte bundle rounded up to " << dio_alignment << " bytes (direct-I/O alignment of "
                 << d.flash_path() << "), not its " << d.layout().group_bytes << "-byte flash group";
  }
  shape.cold_neurons = shape.n_groups * hp.n_ff;
  for (const auto& [per_group, what] : {std::pair{&options.cold_slots_per_group, "cold"},
                                        std::pair{&options.hot_slots_per_group, "hot"}}) {
    if (!per_group->empty() && static_cast<int64_t>(per_group->size()) != shape.n_groups) {
      return Status::InvalidArgument(std::string(what) + " slots given for " + std::to_string(per_group->size()) +
                                     " layers/experts, " + deploy_dir + " has " + std::to_string(shape.n_groups));
    }
  }
  // The cache sizes asked for (per group when given, e.g. by a plan); a budget without them is split below.
  const bool explicit_split = !options.cold_slots_per_group.empty();
  const int64_t asked_hot = std::min(
      shape.hot_clusters, options.hot_slots_per_group.empty()
                              ? options.hot_slots
                              : std::accumulate(options.hot_slots_per_group.begin(), options.hot_slots_per_group.end(),
                                                int64_t{0}));
  const int64_t asked_cold = explicit_split ? std::accumulate(options.cold_slots_per_group.begin(),
                                                              options.cold_slots_per_group.end(), int64_t{0})
                                            : options.cold_slots;
  // Batched prefill's buffers: under a memory budget, cold-cache slots lent for each prompt
  // (OffloadOptions::prefill_in_cache), so that decode keeps that memory as cache (a cold region too small for them:
  // token by token); without a budget, memory of their own, counted as scratch.
  const bool batched_prefill = options.batched_prefill && OffloadFfn::PrefillBufferBytes(d) > 0;
  const bool prefill_in_cache = batched_prefill && (options.prefill_in_cache || options.memory_budget > 0);
  if (batched_prefill && !prefill_in_cache) f.scratch += OffloadFfn::PrefillBufferBytes(d);
  const uint64_t full_staging = static_cast<uint64_t>(hp.n_ff) * shape.cold_slot_bytes;  // counted in f.scratch
  if (options.memory_budget > 0 && !explicit_split) {
    // The staging a whole layer of misses could need was reserved in the fixed part; with one cold pool shared by
    // every layer, that memory serves better as cold slots (a layer's misses then always find a slot: staging 0).
    auto split = [&](double hot_fraction) -> Result<CacheSplit> {
      NF_ASSIGN_OR_RETURN(CacheSplit s, SplitBudget(options.memory_budget, f, shape, hot_fraction));
      const int64_t extra = std::min<int64_t>(hp.n_ff, shape.cold_neurons - s.cold_slots);
      if (extra > 0) {
        s.cold_slots += extra;
        s.cold_bytes += static_cast<uint64_t>(extra) * shape.cold_slot_bytes;
      }
      return s;
    };
    rt->hot_split_.hot_fraction = options.hot_fraction;
    rt->hot_split_.why = "--hot-fraction given";
    if (options.hot_fraction == kAutoHotFraction) {
      if (options.hot_policy != HotPolicy::kPinned) {
        rt->hot_split_ = DefaultHotSplit("an LRU hot region (the profile's curves describe a pinned one)");
      } else {
        // The two pure ways this budget allows: all pinned (clusters spread over the groups as OffloadFfn does) and
        // all one cold pool.
        NF_ASSIGN_OR_RETURN(const CacheSplit all_hot, split(1.0));
        NF_ASSIGN_OR_RETURN(const CacheSplit all_cold, split(0.0));
        const int64_t cluster = OffloadFfn::HotClusterNeurons(d, options.cluster_groups);
        std::vector<int64_t> cap;
        for (const packer::RegionInfo& r : d.manifest().regions) cap.push_back((r.n_neurons + cluster - 1) / cluster);
        std::vector<int64_t> pinned = OffloadFfn::SpreadPinnedClusters(all_hot.hot_slots, cap);
        for (size_t g = 0; g < pinned.size(); ++g) {
          pinned[g] = std::min(d.manifest().regions[g].n_neurons, pinned[g] * cluster);
        }
        const bool every_neuron = oracle && hp.activation == FfnActivation::kSilu;
        rt->hot_split_ = AutoHotSplit(d, pinned, all_cold.cold_slots, every_neuron);
      }
      NF_LOG(Info) << "cache split: " << rt->hot_split_.why;
    }
    NF_ASSIGN_OR_RETURN(rt->split_, split(rt->hot_split_.hot_fraction));
    rt->budget_ = options.memory_budget;
  } else {
    rt->split_.hot_slots = asked_hot;
    rt->split_.cold_slots = asked_cold;
    rt->split_.hot_bytes = static_cast<uint64_t>(rt->split_.hot_slots) * shape.hot_slot_bytes;
    rt->split_.cold_bytes = static_cast<uint64_t>(rt->split_.cold_slots) * shape.cold_slot_bytes;
    if (options.memory_budget > 0) {
      NF_RETURN_IF_ERROR(CheckFixedFits(options.memory_budget, f));
      const uint64_t total = f.Total() + rt->split_.hot_bytes + rt->split_.cold_bytes;
      if (total > options.memory_budget) {
        const bool stale_plan = options.plan_fixed_bytes > 0 && options.plan_fixed_bytes < f.Total();
        const std::string hint = !stale_plan ? std::string()
                                             : "; the plan was made for a fixed part of " +
                                                   FormatBytes(options.plan_fixed_bytes) + " (" +
                                                   std::to_string(options.plan_fixed_bytes) +
                                                   " B): make it again with this nflash (nflash plan)";
        return Status::InvalidArgument("the cache sizes given (hot " + FormatBytes(rt->split_.hot_bytes) + ", cold " +
                                       FormatBytes(rt->split_.cold_bytes) + ") and the fixed part (" +
                                       FormatBytes(f.Total()) + ") need " + FormatBytes(total) + " (" +
                                       std::to_string(total) + " B), over the memory budget " +
                                       FormatBytes(options.memory_budget) + " (" +
                                       std::to_string(options.memory_budget) + " B); fixed part: " + f.Describe() +
                                       hint);
      }
      rt->split_.unused_bytes = options.memory_budget - total;
      rt->budget_ = options.memory_budget;
    }
  }

  // The staging the caches leave necessary (StagingSlots) replaces the worst case reserved in the fixed part. With
  // per-layer partitions it becomes the cold region's overflow pool: cache memory shared by the layers, and the room
  // a layer's misses are guaranteed (cold_overflow_slots).
  const std::vector<int64_t> no_partitions;
  const std::vector<int64_t>& partitions = options.shared_cold_pool ? no_partitions : options.cold_slots_per_group;
  const int64_t staging = OffloadFfn::StagingSlots(hp.n_ff, rt->split_.cold_slots, partitions);
  int64_t overflow = !partitions.empty() && options.cold_overflow ? staging : 0;
  f.scratch = f.scratch - full_staging + static_cast<uint64_t>(staging - overflow) * shape.cold_slot_bytes;
  if (rt->budget_ > 0 && explicit_split && (overflow > 0 || partitions.empty())) {
    // What the budget has left beyond the plan's regions (a plan rounds its sizes down; a shared pool frees the
    // staging the fixed part reserved) goes to the pool too, up to a slot for every cold neuron.
    const uint64_t used = f.Total() + rt->split_.hot_bytes + rt->split_.cold_bytes +
                          static_cast<uint64_t>(overflow) * shape.cold_slot_bytes;
    if (used < rt->budget_) {
      const int64_t room = std::max<int64_t>(0, shape.cold_neurons - rt->split_.cold_slots - overflow);
      const int64_t more = std::min<int64_t>(room, static_cast<int64_t>((rt->budget_ - used) / shape.cold_slot_bytes));
      if (partitions.empty()) {
        rt->split_.cold_slots += more;  // the one shared pool
        rt->split_.cold_bytes += static_cast<uint64_t>(more) * shape.cold_slot_bytes;
      } else {
        overflow += more;
      }
    }
  }
  rt->split_.cold_slots += overflow;
  rt->split_.cold_bytes += static_cast<uint64_t>(overflow) * shape.cold_slot_bytes;
  if (rt->budget_ > 0) {
    rt->split_.unused_bytes = rt->budget_ - (f.Total() + rt->split_.hot_bytes + rt->split_.cold_bytes);
  }

  OffloadOptions oo;
  oo.mode = options.mode;
  oo.hot_policy = options.hot_policy;
  oo.hot_slots_per_group = options.hot_slots_per_group;
  oo.predictor = rt->predictor_.get();
  oo.activation_threshold = options.activation_threshold;
  oo.hot_slots = rt->split_.hot_slots;
  oo.cold_slots = rt->split_.cold_slots;
  oo.cold_slots_per_group = partitions;
  oo.cold_overflow_slots = overflow;
  oo.cluster_groups = options.cluster_groups;
  oo.chunk_requests = options.chunk_requests;
  oo.scatter_reads = options.scatter_reads;
  oo.preload_cold = options.preload_cold;
  oo.sibling_readahead = options.sibling_readahead;
  // A plan's per-region cold slots run as one pool: they still say how to share it out (preload, prefill warming).
  if (options.shared_cold_pool) {
    oo.cold_share_weights.assign(options.cold_slots_per_group.begin(), options.cold_slots_per_group.end());
  }
  oo.cold_protected_fraction = options.cold_protected_fraction;
  oo.batched_prefill = batched_prefill;
  oo.prefill_in_cache = prefill_in_cache;
  oo.batched_prefill_min_tokens = options.batched_prefill_min_tokens;
  oo.two_phase = options.two_phase;
  oo.lookahead_slots = options.lookahead_slots;
  oo.lookahead_keep = options.lookahead_keep;
  oo.warm_next_bytes = options.warm_next_bytes;
  oo.pin_threads = options.pin_threads;
  oo.lookahead_adaptive = options.lookahead_adaptive;
  oo.lookahead_wait_share = options.lookahead_wait_share;
  oo.lookahead_source = options.lookahead_source;
  oo.lookahead_input = rt->lookahead_input_;
  oo.lookahead_table = rt->lookahead_table_.get();
  oo.lookahead_replay = options.lookahead_replay;
  oo.dio_alignment = dio_alignment;
  // The cache arena registered with the ring, so reads into it skip per-request page pinning.
  const uint64_t arena_bytes = rt->split_.hot_bytes + rt->split_.cold_bytes;
  if (arena_bytes > 0) {
    auto arena = reader_raw->CreateArena(kSlotAlignment, AlignSlot(arena_bytes) / kSlotAlignment);
    if (arena.ok()) {
      rt->arena_ = std::move(arena).value();
      oo.arena = rt->arena_->data();
      oo.arena_bytes = rt->arena_->size();
    } else {
      NF_LOG(Warning) << "cache arena not registered with io_uring (" << arena.status().message()
                      << "); reads still work, with per-request page pinning";
    }
  }
  NF_ASSIGN_OR_RETURN(rt->ffn_, OffloadFfn::Create(d, *rt->model_, rt->flash_, oo, pool));
  rt->ctx_->SetFfnBackend(rt->ffn_.get());
  if (rt->ffn_->lookahead_slots() > 0 && options.lookahead_adaptive) {
    NF_LOG(Info) << "lookahead adaptive: unpinned compute threads take every core, so it starts off and turns on if "
                 << "waiting for reads takes " << static_cast<int>(kDefaultLookaheadWaitShare * 100.0 + 0.5) << "% of "
                 << kDefaultLookaheadWindowTokens << " tokens (--lookahead N: always, 0: never)";
  } else if (hp.n_experts > 0 && options.lookahead_slots < 0 && options.mode == OffloadMode::kFull) {
    NF_LOG(Info) << "lookahead off by default for MoE models (--lookahead N: read up to N bundles ahead per guessed "
                 << "expert)";
  }
  return rt;
}

std::string SparseRuntime::Accounting() const { return DescribeAccounting(budget_, fixed_, split_); }

bool ThreadsPinned(OffloadMode mode, PinThreads pin, int compute_threads) {
  const int threads = compute_threads > 0 ? compute_threads : ThreadPool::HardwareThreads();
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  return mode == OffloadMode::kFull && PlanThreadCpus(pin, threads, allowed, {}, CpuCapacities(allowed)).has_value();
}

LookaheadChoice AutoLookahead(int64_t flag, int compute_threads, bool threads_pinned) {
  if (flag >= 0) return {flag, false};
  const int cores = ThreadPool::HardwareThreads();
  const int threads = compute_threads > 0 ? compute_threads : cores;
  if (threads < cores || threads_pinned) return {-1, false};
  return {-1, true};  // logged by SparseRuntime::Open when the lookahead applies
}

}  // namespace nflash::sparse
