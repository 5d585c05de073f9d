// Batched prefill of the flash-offloaded FFN (see offload_ffn.h): whole-region sequential reads into two layer
// buffers with the next region (layer, or MoE expert) prefetched, per-bundle checksums, gate/up by GEMM over strided
// bundle views (oracle) or of each token's predicted neurons by address (predictor), the down accumulation of the
// token path per token, and warming the caches from what was read.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "runtime/core/ffn_activation.h"
#include "runtime/core/kernels.h"
#include "runtime/core/stats.h"
#include "runtime/core/log.h"
#include "runtime/sparse/memory_budget.h"
#include "runtime/sparse/offload_ffn.h"

namespace nflash::sparse {

namespace {

uint64_t MaxRegionBytes(const packer::Manifest& m) {
  uint64_t b = 0;
  for (const auto& r : m.regions) b = std::max(b, r.size);
  return b;
}

// Where batched prefill's buffers lie in its block: two layer buffers, the gate and up outputs of a token tile, the
// compact down rows; each part kSlotAlignment-aligned (the layer buffers are O_DIRECT destinations).
struct PrefillParts {
  size_t region = 0, tile = 0, down = 0;
  size_t gate_at() const { return 2 * region; }
  size_t up_at() const { return 2 * region + tile; }
  size_t down_at() const { return 2 * region + 2 * tile; }
  size_t total() const { return down_at() + down; }
};

PrefillParts Parts(const packer::Deployment& d) {
  const packer::Manifest& m = d.manifest();
  PrefillParts p;
  p.region = AlignSlot(static_cast<size_t>(MaxRegionBytes(m)));
  p.tile = AlignSlot(static_cast<size_t>(kPrefillTokenTile * m.n_ff) * sizeof(float));
  p.down = AlignSlot(static_cast<size_t>(m.n_ff) * static_cast<size_t>(d.layout().down_bytes));
  return p;
}

}  // namespace

uint64_t OffloadFfn::PrefillBufferBytes(const packer::Deployment& d) {
  const packer::Manifest& m = d.manifest();
  if (MaxRegionBytes(m) == 0) return 0;
  return Parts(d).total();
}

uint64_t OffloadFfn::PrefillRequestBytes() const {
  // Whole groups per request, so that a bundle never straddles two requests (a retry re-reads whole bundles).
  const uint64_t g = deploy_.layout().group_bytes;
  return std::max<uint64_t>(1, kPrefillRequestBytes / g) * g;
}

uint64_t OffloadFfn::prefill_bytes() const { return prefill_owned_ ? prefill_block_bytes_ : 0; }

void OffloadFfn::CarvePrefill(uint8_t* block) {
  const PrefillParts p = Parts(deploy_);
  for (int b = 0; b < 2; ++b) prefill_buf_[b] = PrefillBuffer{block + static_cast<size_t>(b) * p.region, p.region};
  pf_gate_ = reinterpret_cast<float*>(block + p.gate_at());
  pf_up_ = reinterpret_cast<float*>(block + p.up_at());
  down_compact_ = block + p.down_at();
}

Status OffloadFfn::InitPrefill() {
  if (!options_.batched_prefill) return Status::Ok();
  const uint64_t bytes = PrefillBufferBytes(deploy_);
  if (bytes == 0) return Status::Ok();
  const auto n_ff = static_cast<size_t>(deploy_.manifest().n_ff);
  warm_age_.assign(n_ff, 0);
  warm_rows_.reserve(n_ff);
  if (options_.prefill_in_cache) {
    SlotRegion& cold = cache_->cold();
    const uint64_t slots = (bytes + cold.slot_stride() - 1) / std::max<size_t>(1, cold.slot_stride());
    if (cold.slot_stride() == 0 || slots > static_cast<uint64_t>(cold.SlotCount())) {
      NF_LOG(Info) << "prefill runs token by token: its buffers (" << FormatBytes(bytes) << ") need " << slots
                   << " cold slots, the cold region has " << cold.SlotCount();
      return Status::Ok();
    }
    prefill_in_cache_ = true;
    prefill_slots_ = static_cast<int32_t>(slots);
    prefill_block_bytes_ = bytes;
    return Status::Ok();
  }
  prefill_owned_.reset(static_cast<uint8_t*>(std::aligned_alloc(kSlotAlignment, static_cast<size_t>(bytes))));
  if (!prefill_owned_) {
    return Status::ResourceExhausted("cannot allocate the batched prefill buffers (" + std::to_string(bytes) +
                                     " bytes)");
  }
  // Touched now, so the buffers are resident and counted from the start like the cache arena.
  std::memset(prefill_owned_.get(), 0, static_cast<size_t>(bytes));
  prefill_block_bytes_ = bytes;
  CarvePrefill(prefill_owned_.get());
  return Status::Ok();
}

Status OffloadFfn::LendPrefillMemory() {
  if (!prefill_in_cache_ || prefill_lent_first_ >= 0) return Status::Ok();
  SlotRegion& cold = cache_->cold();
  // The region's last slots: the overflow pool (shared, so no one layer loses its whole partition), then the last
  // layers' partitions.
  const auto first = static_cast<int32_t>(cold.SlotCount() - prefill_slots_);
  NF_RETURN_IF_ERROR(cold.Lend(first, prefill_slots_));
  prefill_lent_first_ = first;
  CarvePrefill(cold.SlotData(first));
  return Status::Ok();
}

void OffloadFfn::ReclaimPrefillMemory() {
  if (prefill_lent_first_ < 0) return;
  if (pending_buf_ >= 0) CancelPrefetch();  // no read may land in a slot the cache hands out again
  if (arrived_buf_ >= 0) DropPrefetched(arrived_buf_);
  buf_group_[0] = buf_group_[1] = -1;
  cache_->cold().Reclaim();
  prefill_lent_first_ = -1;
}

void OffloadFfn::CancelPrefetch() {
  if (pending_buf_ < 0) return;
  io_->Drain();
  const int buf = pending_buf_;
  pending_buf_ = -1;
  DropPrefetched(buf);
}

void OffloadFfn::CompletePrefetch() {
  if (pending_buf_ < 0) return;
  const uint64_t t0 = SteadyNowNs();
  arrived_status_ = io_->WaitChunk(0);  // the region's one chunk: the job is done, the I/O thread free
  prefill_stats_.io_wait_ns += SteadyNowNs() - t0;
  arrived_read_ns_ = io_->ChunkReadNs(0);
  arrived_buf_ = pending_buf_;
  pending_buf_ = -1;
}

void OffloadFfn::DropPrefetched(int buf) {
  ++prefill_stats_.prefetch_dropped;
  const int64_t g = buf_group_[buf];
  if (g >= 0) prefill_stats_.dropped_bytes += deploy_.Region(GroupLayer(g), GroupExpert(g))->size;
  buf_group_[buf] = -1;
  if (arrived_buf_ == buf) arrived_buf_ = -1;
}

std::string OffloadFfn::GroupName(int64_t group) const {
  const int64_t expert = GroupExpert(group);
  return "layer " + std::to_string(GroupLayer(group)) + (expert >= 0 ? " expert " + std::to_string(expert) : "");
}

Status OffloadFfn::StartRegionRead(int64_t group, int buf) {
  const packer::RegionInfo* region = deploy_.Region(GroupLayer(group), GroupExpert(group));
  if (region == nullptr) return Status::Internal("deployment has no region for " + GroupName(group));
  std::vector<ReadRequest>& reqs = prefill_reqs_[buf];
  reqs.clear();
  uint8_t* dst = prefill_buf_[buf].data;
  const uint64_t req_bytes = PrefillRequestBytes();
  for (uint64_t off = 0; off < region->size; off += req_bytes) {
    const size_t size = static_cast<size_t>(std::min<uint64_t>(req_bytes, region->size - off));
    reqs.push_back(ReadRequest{region->offset + off, size, dst + off});
  }
  // One chunk: ReadBatch keeps up to the queue depth of these in flight.
  prefill_chunks_[buf].assign(1, reqs.size());
  prefill_stats_.requests += static_cast<int64_t>(reqs.size());
  prefill_stats_.bytes_read += region->size;
  buf_group_[buf] = group;
  if (options_.mode == OffloadMode::kFull && !reqs.empty()) {
    io_->Start(reqs, prefill_chunks_[buf]);
    pending_buf_ = buf;
  }
  return Status::Ok();
}

Status OffloadFfn::FinishRegionRead(int64_t group, int buf) {
  const int64_t layer = GroupLayer(group), expert = GroupExpert(group);
  const packer::RegionInfo& region = *deploy_.Region(layer, expert);
  const packer::BundleLayout& lay = deploy_.layout();
  uint8_t* data = prefill_buf_[buf].data;
  const uint64_t t0 = SteadyNowNs();
  Status read;
  if (pending_buf_ == buf) {
    read = io_->WaitChunk(0);
    pending_buf_ = -1;
    last_region_read_ns_ = io_->ChunkReadNs(0);
  } else if (arrived_buf_ == buf) {
    read = arrived_status_;
    arrived_buf_ = -1;
    last_region_read_ns_ = arrived_read_ns_;
  } else {
    read = flash_->ReadBatch(prefill_reqs_[buf]);
    last_region_read_ns_ = SteadyNowNs() - t0;
  }
  const uint64_t t1 = SteadyNowNs();
  prefill_stats_.io_wait_ns += t1 - t0;
  // Every bundle against its hash, request by request; a request with a bad bundle (or one a failed batch may not
  // have read: the hashes decide) is read again once, synchronously, then the bad neuron is reported.
  const std::vector<ReadRequest>& reqs = prefill_reqs_[buf];
  const int64_t slots_per_req = static_cast<int64_t>(PrefillRequestBytes() / lay.group_bytes) * lay.slots_per_group;
  // First pass in parallel (hashing a 7B layer is ~40 ms on one core; Deployment::VerifyBundle is const and safe to
  // call concurrently); retries below run on this thread only.
  std::vector<uint8_t> bad_request(reqs.size(), 0);
  auto scan = [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t end_slot = std::min<int64_t>(region.n_neurons, (r + 1) * slots_per_req);
      for (int64_t s = r * slots_per_req; s < end_slot && !bad_request[r]; ++s) {
        bad_request[r] = !deploy_.VerifyBundle(layer, expert, region.neuron_of_slot[s],
                                               std::span<const uint8_t>(data + lay.SlotOffset(s), lay.bundle_bytes))
                              .ok();
      }
    }
  };
  if (pool_ != nullptr) {
    pool_->ParallelFor(static_cast<int64_t>(reqs.size()), 1, scan);
  } else {
    scan(0, static_cast<int64_t>(reqs.size()), 0);
  }
  for (size_t r = 0; r < reqs.size(); ++r) {
    const int64_t first_slot = static_cast<int64_t>(r) * slots_per_req;
    const int64_t end_slot = std::min<int64_t>(region.n_neurons, first_slot + slots_per_req);
    auto check = [&](int64_t* bad) {
      for (int64_t s = first_slot; s < end_slot; ++s) {
        Status v = deploy_.VerifyBundle(layer, expert, region.neuron_of_slot[s],
                                        std::span<const uint8_t>(data + lay.SlotOffset(s), lay.bundle_bytes));
        if (!v.ok()) {
          *bad = s;
          return v;
        }
      }
      return Status::Ok();
    };
    if (!bad_request[r]) continue;
    int64_t bad = -1;
    Status first = check(&bad);
    if (first.ok()) continue;
    if (!read.ok()) first = read;
    ++prefill_stats_.retries;
    ++stats_[static_cast<size_t>(group)].retries;
    const ReadRequest& q = reqs[r];
    auto what = [&](int64_t slot) {
      return "prefill: " + GroupName(group) + " neuron " + std::to_string(region.neuron_of_slot[slot]) +
             ": ffn.bin offset " + std::to_string(region.offset + lay.SlotOffset(slot)) + " (request at " +
             std::to_string(q.offset) + ", " + std::to_string(q.size) + " bytes)";
    };
    Status again = flash_->ReadAt(q.offset, q.size, q.dst);
    if (!again.ok()) {
      buf_group_[buf] = -1;
      return Status::IOError(what(bad) + ": read failed twice: " + again.message() + " (first: " + first.message() +
                             ")");
    }
    Status verified = check(&bad);
    if (!verified.ok()) {
      buf_group_[buf] = -1;
      return Status::Corruption(what(bad) + ": checksum mismatch after one retry: " + verified.message());
    }
  }
  prefill_stats_.verify_ns += SteadyNowNs() - t1;
  return Status::Ok();
}

void OffloadFfn::WarmColdRegion(int64_t group, const packer::RegionInfo& region, const uint8_t* buf) {
  SlotRegion& cold = cache_->cold();
  if (cold.SlotCount() == 0) return;
  const int64_t room = ColdShare(group);
  // Newest token first, up to the partition's size; then acquired in the reverse order (oldest first).
  warm_rows_.clear();
  const auto n_ff = static_cast<int32_t>(warm_age_.size());
  for (uint8_t age = 1; age <= kWarmTokens && static_cast<int64_t>(warm_rows_.size()) < room; ++age) {
    for (int32_t n = 0; n < n_ff && static_cast<int64_t>(warm_rows_.size()) < room; ++n) {
      if (warm_age_[static_cast<size_t>(n)] == age && !HotPath(group, region, region.slot_of_neuron[n])) {
        warm_rows_.push_back(n);
      }
    }
  }
  const packer::BundleLayout& lay = deploy_.layout();
  const size_t size = static_cast<size_t>(cold_read_);
  const CacheCounters before = cold.counters(group);  // warming is not a token's lookups
  for (auto it = warm_rows_.rbegin(); it != warm_rows_.rend(); ++it) {
    const int32_t n = *it;
    // Never the overflow pool: it is the room a layer's misses are guaranteed (and mostly lent during prefill).
    const SlotRegion::Lookup l = cold.Acquire(group, n, /*use_overflow=*/false);
    if (l.slot < 0) continue;
    if (!l.hit) {
      // The bytes were verified against their checksums when the region was read (FinishRegionRead).
      std::memcpy(cold.SlotData(l.slot), buf + lay.SlotOffset(region.slot_of_neuron[n]), size);
      cold_complete_[static_cast<size_t>(l.slot)] = 1;
      ++prefill_stats_.warmed_bundles;
    }
    cold.Release(l.slot);
  }
  cold.SetCounters(group, before);
}

void OffloadFfn::WarmHotRegion(int64_t group, const packer::RegionInfo& region, const uint8_t* buf) {
  SlotRegion& hot = cache_->hot();
  // Pinned clusters were loaded at Create and are never replaced.
  if (hot.SlotCount() == 0 || cluster_neurons_ == 0 || !pinned_.empty()) return;
  const int64_t n_clusters = (region.hot_count + cluster_neurons_ - 1) / cluster_neurons_;
  // An equal share of the hot region per layer (the first layers get the remainder), most popular clusters first:
  // warming layer l never evicts what warming layer l-1 put in (the hot region is one LRU pool shared by all layers).
  const int64_t groups = std::max<int64_t>(1, n_groups_);
  const int64_t share =
      std::min(n_clusters, hot.SlotCount() / groups + (group < hot.SlotCount() % groups ? 1 : 0));
  const packer::BundleLayout& lay = deploy_.layout();
  for (int64_t c = 0; c < share; ++c) {
    if (hot.Find(group, c) >= 0) continue;
    const SlotRegion::Lookup l = hot.Acquire(group, c);
    if (l.slot < 0) break;
    if (!l.hit) {
      const uint64_t start = lay.SlotOffset(c * cluster_neurons_);
      const size_t size = static_cast<size_t>(std::min<uint64_t>(cluster_bytes_, region.size - start));
      std::memcpy(hot.SlotData(l.slot), buf + start, size);
      ++prefill_stats_.warmed_clusters;
    }
    hot.Release(l.slot);
  }
}

void OffloadFfn::BeforeExperts(int64_t layer, std::span<const int64_t> tokens_per_expert) {
  moe_layer_ = layer;
  moe_batched_.clear();
  moe_routed_.clear();
  int64_t routings = 0;
  for (size_t e = 0; e < tokens_per_expert.size(); ++e) {
    const int64_t n = tokens_per_expert[e];
    routings += n;
    if (n > 0) moe_routed_.push_back(static_cast<int64_t>(e));
    // Forward's rule: an expert's tokens go through ForwardBatch iff they are more than one and at least the minimum.
    if (batched_prefill() && n > 1 && n >= options_.batched_prefill_min_tokens) {
      moe_batched_.push_back(static_cast<int64_t>(e));
    }
  }
  // One token routes to n_experts_used experts once each; more tokens route more often.
  moe_one_token_ = routings == model_.hparams().n_experts_used;
}

int64_t OffloadFfn::NextBatchGroup(int64_t layer, int64_t expert) const {
  const int64_t n_layers = model_.hparams().n_layers;
  if (expert < 0) return layer + 1 < n_layers ? layer + 1 : -1;
  // MoE: the layer's next batched expert; after its last one, the next layer's first expert batched here (a guess:
  // that layer's router has not run yet; a long prompt sends tokens to every expert). Without the router's counts
  // (BeforeExperts), none.
  if (moe_layer_ != layer || moe_batched_.empty()) return -1;
  const auto it = std::upper_bound(moe_batched_.begin(), moe_batched_.end(), expert);
  if (it != moe_batched_.end()) return layer * n_experts_ + *it;
  return layer + 1 < n_layers ? (layer + 1) * n_experts_ + moe_batched_.front() : -1;
}

Status OffloadFfn::ForwardBatch(int64_t layer, int64_t expert, const Activation& x, float* out) {
  const LlamaHparams& hp = model_.hparams();
  const packer::BundleLayout& lay = deploy_.layout();
  const int64_t group = layer * n_experts_ + std::max<int64_t>(0, expert);
  const packer::RegionInfo* region = deploy_.Region(layer, expert);
  if (region == nullptr) return Status::Internal("deployment has no region for " + GroupName(group));
  // The I/O thread is this prefill's now, and the lookahead's pins would keep cold slots from being lent.
  if (la_slots_ > 0 || la_siblings_) DropLookahead(-1);
  NF_RETURN_IF_ERROR(LendPrefillMemory());
  if (prefill_batch_begins_) {  // the batch's first batched FFN (BeforeAttention of layer 0 set the flag)
    prefill_batch_begins_ = false;
    prefill_batch_start_ = prefill_stats_;
    if (new_prompt_) {
      new_prompt_ = false;
      prefill_layers_.clear();
      prompt_chunk_ = -1;
    }
    ++prompt_chunk_;
  }
  const OffloadPrefillStats layer_start = prefill_stats_;

  // 1. The region in a layer buffer: prefetched during the previous FFN, still there, or read now.
  int b = -1;
  for (int i = 0; i < 2; ++i) {
    if (buf_group_[i] == group) b = i;
  }
  if (b >= 0 && (pending_buf_ == b || arrived_buf_ == b)) {
    ++prefill_stats_.prefetch_hits;
    NF_RETURN_IF_ERROR(FinishRegionRead(group, b));
  } else if (b < 0) {
    if (pending_buf_ >= 0) CancelPrefetch();  // a guess that missed (MoE)
    if (arrived_buf_ >= 0) DropPrefetched(arrived_buf_);
    b = buf_group_[0] == group - 1 && group > 0 ? 1 : 0;  // keep the previous region's buffer if it is still wanted
    NF_RETURN_IF_ERROR(StartRegionRead(group, b));
    NF_RETURN_IF_ERROR(FinishRegionRead(group, b));
  }
  // 2. The next region into the other buffer while this one computes (full mode: the I/O thread).
  const int other = 1 - b;
  const int64_t next = NextBatchGroup(layer, expert);
  if (options_.mode == OffloadMode::kFull && next >= 0 && buf_group_[other] != next && pending_buf_ < 0) {
    NF_RETURN_IF_ERROR(StartRegionRead(next, other));
  }

  // 3. Compute. Slot s of the region is at (s / spg) * group_bytes + (s % spg) * bundle_bytes: for each j < spg the
  // slots j, j + spg, j + 2 spg, ... have one stride (group_bytes), so the gate (up) rows form spg strided matrices
  // whose products GemmMany computes in one parallel loop. A tile's outputs of view j start at tn * start[j].
  const uint64_t t0 = SteadyNowNs();
  const uint8_t* data = prefill_buf_[b].data;
  const int64_t spg = lay.slots_per_group, n_ff = region->n_neurons, dim = hp.dim;
  std::vector<int64_t> rows(static_cast<size_t>(spg)), start(static_cast<size_t>(spg));
  int64_t acc = 0;
  for (int64_t j = 0; j < spg; ++j) {
    rows[j] = j < n_ff ? (n_ff - j + spg - 1) / spg : 0;
    start[j] = acc;
    acc += rows[j];
  }
  // Down columns in neuron order, the token path's compact matrix geometry (same kernel chunking, same bits).
  auto copy_down = [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(down_compact_ + static_cast<size_t>(i) * lay.down_bytes,
                  data + lay.SlotOffset(region->slot_of_neuron[i]) + lay.down_offset, lay.down_bytes);
    }
  };
  // 256 columns of a few KiB each per task: large enough to amortize the task, small enough to balance.
  if (pool_ != nullptr) {
    pool_->ParallelFor(n_ff, 256, copy_down);
  } else {
    copy_down(0, n_ff, 0);
  }
  const MatrixView down{lay.down_type, down_compact_, n_ff, lay.dim, static_cast<size_t>(lay.down_bytes)};
  // The token path's threshold: both ways compute the token-by-token function bitwise.
  const float thr = thresholds_[static_cast<size_t>(group)];
  const FfnActivation act = hp.activation;
  Activation tile_act;
  std::fill(warm_age_.begin(), warm_age_.end(), uint8_t{0});
  // The last prompt tokens' neurons, for WarmColdRegion: tokens run oldest first, so a neuron keeps its newest use.
  auto note_warm = [&](int64_t t) {
    const int64_t back = x.n() - t;  // 1 for the last token
    if (back <= kWarmTokens) {
      for (int32_t n : used_rows_) warm_age_[static_cast<size_t>(n)] = static_cast<uint8_t>(back);
    }
  };
  if (!oracle_) {
    // Predictor: per token, its predicted neurons' gate and up rows from the layer buffer by address (GemvRowPtrs,
    // gate and up of a bundle in one list as ComputeItems has them), the active test, and the down columns of the
    // used ones in ascending order: the token path's arithmetic on the same bytes, so batched and token-by-token
    // prefill give the same logits bit for bit, at ~1/10 of a dense GEMM's work for a ~10% active set (the rows
    // come from the buffer, read sequentially, instead of the cache and random reads). Tokens are independent here,
    // so each thread takes whole tokens with the single-threaded kernels (the same values: the kernels' results do not
    // depend on the thread count) instead of splitting every token's small calls over the pool.
    const bool fused = lay.gate_type == lay.up_type && lay.gate_bytes == lay.up_bytes;
    const int threads = pool_ != nullptr ? pool_->NumThreads() : 1;
    while (static_cast<int>(pf_threads_.size()) < threads) {
      pf_threads_.emplace_back();
      options_.predictor->PrepareScratch(&pf_threads_.back().pred);
    }
    const int64_t warm_from = std::max<int64_t>(0, x.n() - kWarmTokens);
    pf_warm_rows_.resize(static_cast<size_t>(kWarmTokens));
    const uint64_t g0 = SteadyNowNs();
    auto run = [&](int64_t begin, int64_t end, int thread) {
      PrefillThread& ts = pf_threads_[static_cast<size_t>(thread)];
      for (int64_t t = begin; t < end; ++t) {
        ts.act.Set(x.f32() + t * dim, 1, dim);
        options_.predictor->Predict(group, ts.act, 0, &ts.pred, &ts.active, nullptr);
        ts.ptrs.clear();
        ts.up_ptrs.clear();
        for (int32_t k : ts.active) {
          const uint8_t* b = data + lay.SlotOffset(region->slot_of_neuron[k]);
          ts.ptrs.push_back(b + lay.gate_offset);
          (fused ? ts.ptrs : ts.up_ptrs).push_back(b + lay.up_offset);
        }
        ts.out.resize(ts.ptrs.size() + ts.up_ptrs.size());
        if (!ts.ptrs.empty()) {
          GemvRowPtrs(PartShape(lay, lay.gate_type, lay.gate_bytes), ts.ptrs, ts.act, ts.out.data(), nullptr);
        }
        if (!ts.up_ptrs.empty()) {
          GemvRowPtrs(PartShape(lay, lay.up_type, lay.up_bytes), ts.up_ptrs, ts.act, ts.out.data() + ts.ptrs.size(),
                      nullptr);
        }
        ts.rows.clear();
        ts.hidden.clear();
        for (size_t j = 0; j < ts.active.size(); ++j) {
          const float gate = ts.out[fused ? 2 * j : j];
          const float up = fused ? ts.out[2 * j + 1] : ts.out[ts.ptrs.size() + j];
          float ga = 0.0f;
          const float h = ActivateNeuron(act, gate, up, &ga);
          if (std::fabs(ga) > thr && h != 0.0f) {
            ts.rows.push_back(ts.active[j]);
            ts.hidden.push_back(h);
          }
        }
        float* y = out + t * dim;
        std::fill(y, y + dim, 0.0f);
        AccumulateRows(down, ts.rows, ts.hidden.data(), y, nullptr);
        if (t >= warm_from) pf_warm_rows_[static_cast<size_t>(t - warm_from)] = ts.rows;
      }
    };
    if (pool_ != nullptr) {
      pool_->ParallelFor(x.n(), 1, run);
    } else {
      run(0, x.n(), 0);
    }
    prefill_stats_.gate_up_ns += SteadyNowNs() - g0;  // predictor, gate/up and down together here
    for (int64_t t = warm_from; t < x.n(); ++t) {
      used_rows_.swap(pf_warm_rows_[static_cast<size_t>(t - warm_from)]);
      note_warm(t);
    }
  }
  std::vector<MatrixView> ws;
  std::vector<float*> ys;
  for (int64_t t0_tok = 0; oracle_ && t0_tok < x.n(); t0_tok += kPrefillTokenTile) {
    const int64_t tn = std::min(kPrefillTokenTile, x.n() - t0_tok);
    tile_act.Set(x.f32() + t0_tok * dim, tn, dim);
    ws.clear();
    ys.clear();
    for (int64_t j = 0; j < spg; ++j) {
      if (rows[j] == 0) continue;
      const uint8_t* base = data + static_cast<size_t>(j) * lay.bundle_bytes;
      ws.push_back(MatrixView{lay.gate_type, base + lay.gate_offset, rows[j], dim, static_cast<size_t>(lay.group_bytes)});
      ys.push_back(pf_gate_ + tn * start[j]);
      ws.push_back(MatrixView{lay.up_type, base + lay.up_offset, rows[j], dim, static_cast<size_t>(lay.group_bytes)});
      ys.push_back(pf_up_ + tn * start[j]);
    }
    const uint64_t g0 = SteadyNowNs();
    GemmMany(ws, tile_act, ys, pool_);
    prefill_stats_.gate_up_ns += SteadyNowNs() - g0;
    for (int64_t t = 0; t < tn; ++t) {
      used_rows_.clear();
      used_hidden_.clear();
      for (int64_t i = 0; i < n_ff; ++i) {
        const int64_t s = region->slot_of_neuron[i];
        const int64_t j = s % spg;
        const size_t idx = static_cast<size_t>(tn * start[j] + t * rows[j] + s / spg);
        float ga = 0.0f;
        const float h = ActivateNeuron(act, pf_gate_[idx], pf_up_[idx], &ga);
        if (std::fabs(ga) > thr && h != 0.0f) {
          used_rows_.push_back(static_cast<int32_t>(i));
          used_hidden_.push_back(h);
        }
      }
      float* y = out + (t0_tok + t) * dim;
      std::fill(y, y + dim, 0.0f);
      AccumulateRows(down, used_rows_, used_hidden_.data(), y, pool_);
      note_warm(t0_tok + t);
    }
  }
  prefill_stats_.compute_ns += SteadyNowNs() - t0;
  prefill_stats_.layers += 1;
  prefill_stats_.tokens += x.n();
  prefill_layers_.push_back(PrefillLayerTiming{prompt_chunk_, layer, expert, region->size, last_region_read_ns_,
                                               prefill_stats_.io_wait_ns - layer_start.io_wait_ns,
                                               prefill_stats_.verify_ns - layer_start.verify_ns,
                                               prefill_stats_.compute_ns - layer_start.compute_ns});

  // 4. Decode starts warm: the hot clusters just read go into the hot region, the neurons the last prompt tokens
  // used into the cold region.
  WarmHotRegion(group, *region, data);
  WarmColdRegion(group, *region, data);

  // One line per prompt: where prefill's time went (exposed I/O vs checksums vs compute), per layer (MoE: per
  // expert pass), after its last batched FFN.
  const bool last = layer == hp.n_layers - 1 &&
                    (expert < 0 || (moe_layer_ == layer && !moe_batched_.empty() && moe_batched_.back() == expert));
  if (last) {
    const OffloadPrefillStats& a = prefill_batch_start_;
    const OffloadPrefillStats& z = prefill_stats_;
    const double layers = static_cast<double>(std::max<int64_t>(1, z.layers - a.layers));
    const char* unit = expert < 0 ? "layer" : "expert pass";
    NF_LOG(Info) << "prefill: " << (expert < 0 ? x.n() : z.tokens - a.tokens)
                 << (expert < 0 ? " tokens, " : " token-expert pairs, ") << (z.layers - a.layers) << " " << unit
                 << (expert < 0 ? "s" : "es") << ": read " << (z.bytes_read - a.bytes_read) / 1048576 << " MiB in "
                 << (z.requests - a.requests) << " requests (" << (z.prefetch_hits - a.prefetch_hits)
                 << " prefetched, " << (z.prefetch_dropped - a.prefetch_dropped) << " read ahead unused); per " << unit
                 << ": I/O wait " << (z.io_wait_ns - a.io_wait_ns) / 1e6 / layers << " ms, verify "
                 << (z.verify_ns - a.verify_ns) / 1e6 / layers << " ms, compute "
                 << (z.compute_ns - a.compute_ns) / 1e6 / layers << (oracle_ ? " ms (gate/up GEMM " : " ms (per token ")
                 << (z.gate_up_ns - a.gate_up_ns) / 1e6 / layers << " ms); " << (z.warmed_clusters - a.warmed_clusters)
                 << " hot clusters and " << (z.warmed_bundles - a.warmed_bundles) << " cold bundles warmed";
  }
  return Status::Ok();
}

}  // namespace nflash::sparse
