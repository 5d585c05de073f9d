// The flash-offloaded FFN backend: active set, cache lookup, batched and pipelined reads, checksums, fixed-order
// accumulation (see offload_ffn.h).
#include "runtime/sparse/offload_ffn.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "runtime/core/block_device.h"
#include "runtime/core/cpu_affinity.h"
#include "runtime/core/ffn_activation.h"
#include "runtime/core/kernels.h"
#include "runtime/core/log.h"
#include "runtime/core/stats.h"
#include "runtime/io/direct_reader.h"  // CoalesceRequests

namespace nflash::sparse {

namespace {

int64_t ClusterGroups(const packer::BundleLayout& layout, int64_t cluster_groups) {
  if (cluster_groups > 0) return cluster_groups;
  return std::max<int64_t>(1, static_cast<int64_t>(kDefaultClusterBytes / layout.group_bytes));
}

int64_t Groups(const packer::Manifest& m) { return m.n_layers * std::max<int64_t>(1, m.n_experts); }

// Each region's active neurons per token (packer::RegionInfo::active_per_token), or empty when a region lacks the
// figure (packed before it existed) or every one is 0.
std::vector<double> ActivityWeights(const packer::Manifest& m) {
  std::vector<double> w;
  for (const packer::RegionInfo& r : m.regions) {
    if (r.active_per_token < 0) return {};
    w.push_back(r.active_per_token);
  }
  if (std::all_of(w.begin(), w.end(), [](double x) { return x <= 0; })) return {};
  return w;
}

}  // namespace

const char* OffloadModeName(OffloadMode mode) { return mode == OffloadMode::kFull ? "full" : "llmflash"; }

const char* HotPolicyName(HotPolicy policy) { return policy == HotPolicy::kPinned ? "pinned" : "lru"; }

Result<HotPolicy> ParseHotPolicy(const std::string& name) {
  if (name == "pinned") return HotPolicy::kPinned;
  if (name == "lru") return HotPolicy::kLru;
  return Status::InvalidArgument("hot policy \"" + name + "\": expected pinned or lru");
}

uint64_t OffloadFfn::ColdSlotBytes(const packer::Deployment& d, uint64_t dio_alignment) {
  const packer::BundleLayout& lay = d.layout();
  return lay.slots_per_group == 1 ? ColdReadBytes(lay, dio_alignment) : AlignSlot(lay.bundle_bytes);
}

uint64_t OffloadFfn::HotSlotBytes(const packer::Deployment& d, int64_t cluster_groups) {
  return static_cast<uint64_t>(ClusterGroups(d.layout(), cluster_groups)) * d.layout().group_bytes;
}

int64_t OffloadFfn::HotClusterCount(const packer::Deployment& d, int64_t cluster_groups, HotPolicy policy) {
  const int64_t c = HotClusterNeurons(d, cluster_groups);
  int64_t n = 0;
  for (const auto& r : d.manifest().regions) {
    n += ((policy == HotPolicy::kPinned ? r.n_neurons : r.hot_count) + c - 1) / c;
  }
  return n;
}

int64_t OffloadFfn::HotClusterNeurons(const packer::Deployment& d, int64_t cluster_groups) {
  return ClusterGroups(d.layout(), cluster_groups) * d.layout().slots_per_group;
}

std::vector<int64_t> OffloadFfn::SpreadPinnedClusters(int64_t clusters, const std::vector<int64_t>& cap) {
  std::vector<int64_t> pinned(cap.size(), 0);
  int64_t left = std::max<int64_t>(0, clusters);
  for (bool progress = true; left > 0 && progress;) {
    progress = false;
    int64_t open = 0;
    for (size_t g = 0; g < cap.size(); ++g) open += pinned[g] < cap[g] ? 1 : 0;
    if (open == 0) break;
    const int64_t share = std::max<int64_t>(1, left / open);
    for (size_t g = 0; g < cap.size() && left > 0; ++g) {
      const int64_t add = std::min({share, cap[g] - pinned[g], left});
      if (add <= 0) continue;
      pinned[g] += add;
      left -= add;
      progress = true;
    }
  }
  return pinned;
}

int64_t OffloadFfn::StagingSlots(int64_t n_ff, int64_t cold_slots, const std::vector<int64_t>& cold_slots_per_group) {
  int64_t smallest = cold_slots;
  if (!cold_slots_per_group.empty()) {
    smallest = *std::min_element(cold_slots_per_group.begin(), cold_slots_per_group.end());
  }
  return std::max<int64_t>(0, n_ff - std::max<int64_t>(0, smallest));
}

uint64_t OffloadFfn::EstimateScratchBytes(const packer::Deployment& d, uint64_t dio_alignment) {
  const auto& m = d.manifest();
  const uint64_t n_ff = static_cast<uint64_t>(m.n_ff);
  // Staging for a whole group of misses without a cold slot (the most StagingSlots can ask for; the runtime gives
  // what a shared cold pool makes unnecessary back to that pool), and the per-neuron arrays (kPerNeuronScratchBytes).
  return n_ff * ColdSlotBytes(d, dio_alignment) + n_ff * kPerNeuronScratchBytes;
}

uint64_t OffloadFfn::EstimateOracleBytes(const packer::Deployment& d, bool oracle) {
  if (!oracle) return 0;
  return static_cast<uint64_t>(Groups(d.manifest())) * static_cast<uint64_t>(d.manifest().n_ff) * d.layout().gate_bytes;
}

OffloadFfn::OffloadFfn(const packer::Deployment& deployment, const Model& model,
                       std::shared_ptr<const ReadableFile> flash, const OffloadOptions& options, ThreadPool* pool)
    : deploy_(deployment), model_(model), flash_(std::move(flash)), options_(options), pool_(pool) {}

OffloadFfn::~OffloadFfn() {
  io_.reset();  // joins the I/O thread before the buffers it may write go away
  std::free(staging_);
  std::free(gap_sink_);
}

Result<std::unique_ptr<OffloadFfn>> OffloadFfn::Create(const packer::Deployment& deployment, const Model& model,
                                                       std::shared_ptr<const ReadableFile> flash,
                                                       const OffloadOptions& options, ThreadPool* pool) {
  std::unique_ptr<OffloadFfn> f(new OffloadFfn(deployment, model, std::move(flash), options, pool));
  NF_RETURN_IF_ERROR(f->Init());
  return f;
}

Status OffloadFfn::Init() {
  const LlamaHparams& hp = model_.hparams();
  const packer::Manifest& m = deploy_.manifest();
  const packer::BundleLayout& lay = deploy_.layout();
  auto mismatch = [&](const char* what, int64_t dep, int64_t mod) {
    return Status::InvalidArgument(deploy_.dir() + ": manifest " + what + " is " + std::to_string(dep) +
                                   " but the resident model has " + std::to_string(mod));
  };
  if (m.dim != hp.dim) return mismatch("dim", m.dim, hp.dim);
  if (m.n_ff != hp.n_ff) return mismatch("n_ff", m.n_ff, hp.n_ff);
  if (m.n_layers != hp.n_layers) return mismatch("n_layers", m.n_layers, hp.n_layers);
  if (m.n_experts != hp.n_experts) return mismatch("n_experts", m.n_experts, hp.n_experts);
  if (flash_->Size() != m.flash_bytes) {
    return Status::Corruption(flash_->Path() + ": size " + std::to_string(flash_->Size()) + ", manifest says " +
                              std::to_string(m.flash_bytes));
  }
  n_experts_ = std::max<int64_t>(1, hp.n_experts);
  n_groups_ = hp.n_layers * n_experts_;
  oracle_ = options_.predictor == nullptr;
  if (!oracle_) {
    const Predictor& p = *options_.predictor;
    if (p.n_layers() != hp.n_layers || p.n_experts() != hp.n_experts || p.n_ff() != hp.n_ff || p.dim() != hp.dim) {
      return Status::InvalidArgument("predictor shape (layers " + std::to_string(p.n_layers()) + ", experts " +
                                     std::to_string(p.n_experts()) + ", n_ff " + std::to_string(p.n_ff()) + ", dim " +
                                     std::to_string(p.dim()) + ") does not match the deployment (layers " +
                                     std::to_string(hp.n_layers) + ", experts " + std::to_string(hp.n_experts) + ")");
    }
  }
  if (!options_.activation_threshold.empty() &&
      static_cast<int64_t>(options_.activation_threshold.size()) != hp.n_layers) {
    return Status::InvalidArgument("activation_threshold has " + std::to_string(options_.activation_threshold.size()) +
                                   " values, expected one per layer (" + std::to_string(hp.n_layers) + ")");
  }
  // Per group: a MoE predictor has one threshold per (layer, expert); the option gives one per layer.
  thresholds_.resize(static_cast<size_t>(n_groups_));
  for (int64_t g = 0; g < n_groups_; ++g) {
    thresholds_[g] = !options_.activation_threshold.empty() ? options_.activation_threshold[g / n_experts_]
                     : oracle_                               ? 0.0f
                                                             : options_.predictor->activation_threshold(g);
  }
  if (options_.chunk_requests <= 0) return Status::InvalidArgument("chunk_requests must be > 0");

  const int64_t k = ClusterGroups(lay, options_.cluster_groups);
  cluster_neurons_ = k * lay.slots_per_group;
  cluster_bytes_ = static_cast<uint64_t>(k) * lay.group_bytes;
  cold_read_ = ColdReadBytes(lay, options_.dio_alignment);
  cold_stride_ = ColdSlotBytes(deploy_, options_.dio_alignment);
  if (lay.slots_per_group == 1 && cold_read_ < lay.group_bytes) {
    gap_bytes_ = static_cast<size_t>(lay.group_bytes - cold_read_);
    gap_sink_ = static_cast<uint8_t*>(std::aligned_alloc(kSlotAlignment, AlignSlot(gap_bytes_)));
    if (gap_sink_ == nullptr) return Status::ResourceExhausted("cannot allocate the read gap buffer");
  }
  const bool pinned = options_.hot_policy == HotPolicy::kPinned;
  int64_t max_clusters = 0;
  for (const auto& r : m.regions) {
    max_clusters = std::max(max_clusters, ((pinned ? r.n_neurons : r.hot_count) + cluster_neurons_ - 1) / cluster_neurons_);
  }
  if (pinned) {
    // Pinned clusters per group: as given (e.g. by a plan), or hot_slots split evenly, capped at the group's clusters
    // (what a small group cannot take goes to the others).
    if (!options_.hot_slots_per_group.empty() &&
        static_cast<int64_t>(options_.hot_slots_per_group.size()) != n_groups_) {
      return Status::InvalidArgument("hot_slots_per_group has " + std::to_string(options_.hot_slots_per_group.size()) +
                                     " entries, expected one per layer/expert (" + std::to_string(n_groups_) + ")");
    }
    pinned_.assign(static_cast<size_t>(n_groups_), 0);
    std::vector<int64_t> cap(static_cast<size_t>(n_groups_));
    for (int64_t g = 0; g < n_groups_; ++g) {
      const packer::RegionInfo& r = m.regions[static_cast<size_t>(g)];
      cap[g] = (r.n_neurons + cluster_neurons_ - 1) / cluster_neurons_;
    }
    if (!options_.hot_slots_per_group.empty()) {
      for (int64_t g = 0; g < n_groups_; ++g) pinned_[g] = std::clamp<int64_t>(options_.hot_slots_per_group[g], 0, cap[g]);
    } else {
      pinned_ = SpreadPinnedClusters(options_.hot_slots, cap);
    }
  }

  NeuronCacheConfig cc;
  cc.hot_cluster_neurons = cluster_neurons_;
  cc.hot.n_groups = n_groups_;
  cc.hot.units_per_group = max_clusters;
  cc.hot.unit_bytes = cluster_bytes_;
  cc.hot.slot_stride = cluster_bytes_;
  if (pinned) {
    cc.hot.slots_per_group = pinned_;
  } else {
    cc.hot.shared_slots = max_clusters > 0 ? options_.hot_slots : 0;
  }
  cc.cold.n_groups = n_groups_;
  cc.cold.units_per_group = hp.n_ff;
  cc.cold.unit_bytes = cold_read_;
  cc.cold.slot_stride = cold_stride_;
  cc.cold.slots_per_group = options_.cold_slots_per_group;
  cc.cold.shared_slots = options_.cold_slots;
  cc.cold.protected_fraction = options_.cold_protected_fraction;
  cc.cold.overflow_slots = options_.cold_overflow_slots;
  const int64_t staging_needed = StagingSlots(hp.n_ff, options_.cold_slots, options_.cold_slots_per_group);
  if (options_.cold_overflow_slots > 0 && options_.cold_overflow_slots < staging_needed) {
    return Status::InvalidArgument("cold overflow pool of " + std::to_string(options_.cold_overflow_slots) +
                                   " slots: a layer's misses may need " + std::to_string(staging_needed) +
                                   " (n_ff minus the smallest partition)");
  }
  if (cluster_bytes_ % kSlotAlignment != 0) {
    return Status::Internal("deployment group_bytes " + std::to_string(lay.group_bytes) + " is not a multiple of 4096");
  }
  NF_ASSIGN_OR_RETURN(cache_, NeuronCache::Create(cc, options_.arena, options_.arena_bytes));

  const size_t n_ff = static_cast<size_t>(hp.n_ff);
  staging_slots_ = options_.cold_overflow_slots > 0 ? 0 : staging_needed;
  staging_ = static_cast<uint8_t*>(
      std::aligned_alloc(kSlotAlignment, AlignSlot(std::max<size_t>(1, static_cast<size_t>(staging_slots_)) * cold_stride_)));
  if (staging_ == nullptr) return Status::ResourceExhausted("cannot allocate the miss staging buffer");
  active_.reserve(n_ff);
  gate_all_.resize(n_ff);
  bundle_.resize(n_ff);
  item_unit_.resize(n_ff);
  active_flag_.assign(static_cast<size_t>(n_ff), 0);
  deferred_hits_.reserve(static_cast<size_t>(n_ff));
  cluster_slot_.assign(static_cast<size_t>(max_clusters), -1);
  cluster_unit_.assign(static_cast<size_t>(max_clusters), -1);
  touched_clusters_.reserve(static_cast<size_t>(max_clusters));
  // Hot clusters, then one unit per neuron of A, plus (two-phase) one up+down unit per neuron.
  units_.reserve(2 * n_ff + static_cast<size_t>(max_clusters));
  unit_order_.reserve(n_ff);
  requests_.reserve(n_ff);
  request_of_unit_.resize(n_ff);
  chunk_ends_.reserve(n_ff);
  items_by_chunk_.reserve(n_ff);
  chunk_item_begin_.reserve(n_ff + 1);
  ready_items_.reserve(n_ff);
  acquired_hot_.reserve(static_cast<size_t>(max_clusters));
  acquired_cold_.reserve(n_ff);
  hidden_.resize(n_ff);
  used_flag_.resize(n_ff);
  used_down_.reserve(n_ff);
  used_rows_.reserve(n_ff);
  used_hidden_.reserve(n_ff);
  gate_ptrs_.reserve(2 * n_ff);  // gate and up rows when fused (ComputeItems)
  up_ptrs_.reserve(n_ff);
  gate_out_.resize(2 * n_ff);
  up_out_.resize(n_ff);
  down_ptr_.resize(n_ff);
  InitTwoPhase();
  cold_complete_.assign(static_cast<size_t>(cache_->cold().SlotCount()), 0);
  gate_item_.resize(n_ff);
  gate_known_.assign(n_ff, 0);
  item_slot_.resize(n_ff);
  item_acq_.resize(n_ff);
  gate_hit_items_.reserve(n_ff);
  scratch_items_.reserve(n_ff);
  phase2_items_.reserve(n_ff);
  phase2_units_.reserve(n_ff);
  requests2_.reserve(n_ff);
  chunks2_end_.reserve(n_ff);
  stats_.assign(static_cast<size_t>(n_groups_), OffloadGroupStats());
  if (!oracle_) options_.predictor->PrepareScratch(&pred_scratch_);
  if (oracle_) NF_RETURN_IF_ERROR(LoadOracleGates());
  if (pinned) NF_RETURN_IF_ERROR(LoadPinnedClusters());
  NF_RETURN_IF_ERROR(ShareOutColdRegion());
  if (options_.preload_cold) NF_RETURN_IF_ERROR(LoadColdPrefix());
  if (options_.mode == OffloadMode::kFull) {
    io_ = std::make_unique<IoWorker>(flash_.get());
    warm_cap_ = options_.warm_next_bytes >= 0 ? static_cast<uint64_t>(options_.warm_next_bytes)
                                              : LastLevelCacheBytes() / 2;
    if (warm_cap_ > 0) io_->SetIdleWork([this] { return WarmStep(); });
    const std::vector<int> allowed = ThreadCpus(pthread_self());
    const int compute_threads = pool_ != nullptr ? pool_->NumThreads() : 1;
    disk_interrupts_ = DiskInterruptsPerCpu(flash_->Path());
    cpu_capacity_ = CpuCapacities(allowed);
    if (std::optional<ThreadCpuPlan> plan =
            PlanThreadCpus(options_.pin_threads, compute_threads, allowed, disk_interrupts_, cpu_capacity_)) {
      std::string workers, capacities;
      for (int w : plan->workers) workers += " " + std::to_string(w);
      for (int c : allowed) {
        if (static_cast<size_t>(c) < cpu_capacity_.size()) capacities += " " + std::to_string(cpu_capacity_[c]);
      }
      const bool known = std::any_of(disk_interrupts_.begin(), disk_interrupts_.end(), [](uint64_t n) { return n > 0; });
      NF_LOG(Info) << "threads pinned for each evaluation (--pin-threads): caller on CPU " << plan->caller
                   << (workers.empty() ? "" : ", workers on CPU" + workers) << ", I/O thread on CPU " << plan->io
                   << (known ? " (where most of the disk's interrupts arrive)" : " (the disk's interrupts unknown)")
                   << (capacities.empty() ? "; CPU capacities unknown" : "; CPU capacities" + capacities);
      placement_.emplace(std::move(*plan),
                         pool_ != nullptr ? pool_->WorkerHandles() : std::vector<std::thread::native_handle_type>{},
                         io_->ThreadHandle());
    }
  }
  NF_RETURN_IF_ERROR(InitLookahead());
  NF_RETURN_IF_ERROR(InitPrefill());
  return Status::Ok();
}

Status OffloadFfn::LoadOracleGates() {
  const packer::BundleLayout& lay = deploy_.layout();
  const int64_t n_ff = model_.hparams().n_ff;
  oracle_gate_bytes_.resize(static_cast<size_t>(n_groups_));
  oracle_gate_.resize(static_cast<size_t>(n_groups_));
  std::vector<ReadRequest> reqs(static_cast<size_t>(n_ff));
  for (int64_t g = 0; g < n_groups_; ++g) {
    const int64_t layer = g / n_experts_;
    const int64_t expert = model_.hparams().n_experts > 0 ? g % n_experts_ : -1;
    auto& bytes = oracle_gate_bytes_[g];
    bytes.resize(static_cast<size_t>(n_ff) * lay.gate_bytes);
    for (int64_t n = 0; n < n_ff; ++n) {
      const ByteRange r = deploy_.GateRange(layer, expert, n);
      reqs[n] = ReadRequest{r.offset, static_cast<size_t>(r.size), bytes.data() + n * lay.gate_bytes};
    }
    Status batch = flash_->ReadBatch(reqs);
    for (int64_t n = 0; n < n_ff; ++n) {
      std::span<const uint8_t> row(bytes.data() + n * lay.gate_bytes, lay.gate_bytes);
      if (batch.ok() && deploy_.VerifyGate(layer, expert, n, row).ok()) continue;
      // Retry once, synchronously, then report the neuron.
      NF_RETURN_IF_ERROR(flash_->ReadAt(reqs[n].offset, reqs[n].size, reqs[n].dst)
                             .WithContext("oracle gate rows: layer " + std::to_string(layer) + " neuron " +
                                          std::to_string(n) + " (second attempt)"));
      NF_RETURN_IF_ERROR(deploy_.VerifyGate(layer, expert, n, row).WithContext("oracle gate rows, after one retry"));
    }
    oracle_gate_[g] = MatrixView{lay.gate_type, bytes.data(), n_ff, lay.dim, static_cast<size_t>(lay.gate_bytes)};
  }
  return Status::Ok();
}

Status OffloadFfn::LoadPinnedClusters() {
  const packer::BundleLayout& lay = deploy_.layout();
  SlotRegion& hot = cache_->hot();
  // One group at a time: its clusters are consecutive on flash, so they are read as large requests straight into
  // their slots when the slots are consecutive too (a fresh partition hands them out in order), else one per cluster.
  std::vector<ReadRequest> reads;
  for (int64_t g = 0; g < n_groups_; ++g) {
    if (pinned_[g] == 0) continue;
    const packer::RegionInfo& region = deploy_.manifest().regions[static_cast<size_t>(g)];
    const int64_t layer = g / n_experts_;
    const int64_t expert = model_.hparams().n_experts > 0 ? g % n_experts_ : -1;
    units_.clear();
    for (int64_t c = 0; c < pinned_[g]; ++c) {
      const SlotRegion::Lookup l = hot.Acquire(g, c);
      if (l.slot < 0 || l.hit) {
        return Status::Internal("hot region: no fresh slot for pinned cluster " + std::to_string(c) + " of group " +
                                std::to_string(g));
      }
      const uint64_t start = lay.SlotOffset(c * cluster_neurons_);
      const size_t size = static_cast<size_t>(std::min<uint64_t>(cluster_bytes_, region.size - start));
      units_.push_back(Unit{region.offset + start, size, hot.SlotData(l.slot), l.slot, true, c, -1, Phase::kWhole, -1});
      reads.push_back(ReadRequest{region.offset + start, size, hot.SlotData(l.slot)});
    }
    const Status batch = flash_->ReadBatch(io::CoalesceRequests(reads, kPrefillRequestBytes));
    reads.clear();
    for (size_t u = 0; u < units_.size(); ++u) {
      NF_RETURN_IF_ERROR(
          CheckArrival(layer, expert, region, units_[u], batch).WithContext("loading the pinned hot region"));
      hot.Release(units_[u].cache_slot);
    }
    stats_[static_cast<size_t>(g)].retries = 0;  // load-time retries are not decode statistics
  }
  units_.clear();
  hot.ResetCounters();
  return Status::Ok();
}

Status OffloadFfn::ShareOutColdRegion() {
  const RegionConfig& cc = cache_->cold().config();
  if (!cc.slots_per_group.empty()) {
    cold_share_ = cc.slots_per_group;
    return Status::Ok();
  }
  std::vector<double> weights = options_.cold_share_weights;
  if (!weights.empty() && static_cast<int64_t>(weights.size()) != n_groups_) {
    return Status::InvalidArgument("cold_share_weights has " + std::to_string(weights.size()) +
                                   " entries, expected one per layer/expert (" + std::to_string(n_groups_) + ")");
  }
  if (weights.empty()) weights = ActivityWeights(deploy_.manifest());
  long double sum = 0;
  for (double w : weights) sum += std::max(0.0, w);
  // In proportion to the weights (equal without them), rounded down; what rounding leaves, a slot each to the first
  // groups, so that the shares add up to the pool (as the planner's SharedPoolSettings deals its remainder).
  const int64_t pool = cc.shared_slots;
  cold_share_.assign(static_cast<size_t>(n_groups_), 0);
  int64_t given = 0;
  for (int64_t g = 0; g < n_groups_; ++g) {
    int64_t& share = cold_share_[static_cast<size_t>(g)];
    const long double w = sum > 0 ? std::max(0.0, weights[static_cast<size_t>(g)]) : 0.0;
    share = sum > 0 ? static_cast<int64_t>(static_cast<long double>(pool) * w / sum) : pool / n_groups_;
    given += share;
  }
  for (int64_t g = 0; g < n_groups_ && given < pool; ++g, ++given) ++cold_share_[static_cast<size_t>(g)];
  return Status::Ok();
}

Status OffloadFfn::LoadColdPrefix() {
  SlotRegion& cold = cache_->cold();
  if (cold.SlotCount() == 0) return Status::Ok();
  const uint64_t t0 = SteadyNowNs();
  const packer::BundleLayout& lay = deploy_.layout();
  const SlotRegion& hot = cache_->hot();
  for (int64_t g = 0; g < n_groups_; ++g) {
    const packer::RegionInfo& region = deploy_.manifest().regions[static_cast<size_t>(g)];
    const int64_t layer = g / n_experts_;
    const int64_t expert = model_.hparams().n_experts > 0 ? g % n_experts_ : -1;
    // The first slot the hot region does not serve (HotPath), and the group's share of the cold region.
    const int64_t first = !pinned_.empty()     ? std::min(region.n_neurons, pinned_[g] * cluster_neurons_)
                          : hot.SlotCount() > 0 ? region.hot_count
                                                : 0;
    const int64_t share = ColdShare(g);
    const int64_t end = first + std::clamp<int64_t>(share, 0, region.n_neurons - first);
    if (end == first) continue;
    units_.clear();
    request_builder_.Reset(kPrefillRequestBytes, /*scatter=*/true, gap_sink_, gap_bytes_);
    for (int64_t s = first; s < end; ++s) {  // in file order, as the builder wants
      const SlotRegion::Lookup l = cold.Acquire(g, region.neuron_of_slot[s], /*use_overflow=*/false);
      if (l.slot < 0) break;  // a partition smaller than its share of the region (or every slot taken)
      const uint64_t offset = region.offset + lay.SlotOffset(s);
      units_.push_back(Unit{offset, static_cast<size_t>(cold_read_), cold.SlotData(l.slot), l.slot, false,
                            region.neuron_of_slot[s], -1, Phase::kWhole, -1});
      request_builder_.Add(offset, static_cast<size_t>(cold_read_), cold.SlotData(l.slot));
    }
    const Status batch = flash_->ReadBatch(request_builder_.Finish());
    // Released least popular first (Release makes a slot the most recently used), so that the most popular are the
    // last to be evicted.
    for (auto u = units_.rbegin(); u != units_.rend(); ++u) {
      NF_RETURN_IF_ERROR(CheckArrival(layer, expert, region, *u, batch).WithContext("preloading the cold region"));
      cold.Release(u->cache_slot);
    }
    preloaded_bundles_ += static_cast<int64_t>(units_.size());
    stats_[static_cast<size_t>(g)].retries = 0;  // load-time retries are not decode statistics
  }
  units_.clear();
  cold.ResetCounters();
  preload_s_ = static_cast<double>(SteadyNowNs() - t0) * 1e-9;
  if (preloaded_bundles_ > 0) {
    NF_LOG(Info) << "cold region: " << preloaded_bundles_ << " of its " << cold.SlotCount()
                 << " slots preloaded with the layers' most popular cold neurons in " << preload_s_
                 << " s (--no-cold-preload: start empty)";
  }
  return Status::Ok();
}

Result<bool> OffloadFfn::Forward(int64_t layer, int64_t expert, const Activation& x, float* out) {
  const int64_t dim = model_.hparams().dim;
  const int64_t group = layer * n_experts_ + std::max<int64_t>(0, expert);
  if (x.n() == 1) {
    NF_RETURN_IF_ERROR(ForwardToken(group, layer, expert, x, out, /*lookahead=*/true));
    return true;
  }
  if (batched_prefill() && x.n() >= options_.batched_prefill_min_tokens) {
    ResetLookaheadWindow();  // a batched prefill's time and reads are not decode's
    NF_RETURN_IF_ERROR(ForwardBatch(layer, expert, x, out));
    return true;
  }
  // Without prefill buffers (or for fewer tokens), prefill runs token by token through the decode path (the next
  // layer's lookahead only from the last token: the next token comes back to this layer).
  for (int64_t t = 0; t < x.n(); ++t) {
    token_act_.Set(x.f32() + t * dim, 1, dim);
    NF_RETURN_IF_ERROR(ForwardToken(group, layer, expert, token_act_, out + t * dim, t + 1 == x.n()));
  }
  return true;
}

Status OffloadFfn::Resolve(int64_t group, const packer::RegionInfo& region) {
  const packer::BundleLayout& lay = deploy_.layout();
  SlotRegion& hot = cache_->hot();
  SlotRegion& cold = cache_->cold();
  units_.clear();
  acquired_hot_.clear();
  acquired_cold_.clear();
  touched_clusters_.clear();
  ready_items_.clear();
  gate_hit_items_.clear();
  la_items_.clear();
  int64_t staging_used = 0;
  auto add_unit = [&](bool is_hot, int64_t index, uint64_t offset, size_t size, uint8_t* dst, int32_t slot,
                      int32_t acq, Phase phase, int32_t item) {
    units_.push_back(Unit{offset, size, dst, slot, is_hot, index, acq, phase, item});
    return static_cast<int32_t>(units_.size() - 1);
  };
  // Neurons read ahead during the previous layer first: each item takes over its bundle's pin (its read is waited for
  // and verified by ConsumeLookahead), before any miss below can make the set settle early and release them.
  // (la_current_ may drop to -1 in the loop below, when a full partition settles the set: the taken items stay taken.)
  const bool any_taken = la_current_ >= 0;
  if (any_taken) {
    const int b = la_current_;
    for (size_t k = 0; k < active_.size(); ++k) {
      la_taken_[k] = 0;
      const int32_t ahead = la_index_of_neuron_[b][static_cast<size_t>(active_[k])];
      if (ahead < 0 || la_slot_[b][static_cast<size_t>(ahead)] < 0) continue;
      const int32_t slot = la_slot_[b][static_cast<size_t>(ahead)];
      acquired_cold_.push_back(slot);
      item_slot_[k] = slot;
      item_acq_[k] = static_cast<int32_t>(acquired_cold_.size() - 1);
      bundle_[k] = cold.SlotData(slot);
      la_item_[b][static_cast<size_t>(ahead)] = static_cast<int32_t>(k);
      la_items_.push_back(static_cast<int32_t>(k));
      la_taken_[k] = 1;
    }
  }
  // The slot records the lookups below touch at random, loaded in one burst whose misses overlap (SYNTHETIC 7B at
  // 1392M: lookups 1.8 -> 1.3 ms per token).
  for (int32_t n : active_) cold.Prefetch(group, n);
  // Misses first, hits after (ResolveHits, once the misses' reads are submitted): the reads start before the hits'
  // lookups. A miss may not evict a unit this token is about to hit: such a victim is touched (made most recently
  // used, as its hit will) and the next one taken. The touches are bounded by the active set; beyond that (a partition
  // of nothing but this token's units) the victim is evicted, and the loop after the pass reads it as a miss too.
  deferred_hits_.clear();
  for (int32_t n : active_) active_flag_[static_cast<size_t>(n)] = 1;
  size_t touches = 0;
  auto resolve_cold = [&](size_t k) -> Status {
    const int32_t n = active_[k];
    const int32_t s = region.slot_of_neuron[n];
    const uint64_t offset = region.offset + lay.SlotOffset(s);
    if (la_current_ >= 0 && !cold.CanPlace(group) && cold.Find(group, n) < 0) {
      // The lookahead's pins leave this miss no slot: settle it (its unused bundles become evictable) first.
      NF_RETURN_IF_ERROR(SettleLookahead(la_current_));
    }
    if (!cold.CanPlace(group) && staging_used >= staging_slots_ && cold.config().slots_per_group.empty()) {
      // One pool for every group, and the sets other groups read ahead (an MoE layer's later siblings, a guess) pin
      // what this miss needs: they give way, settled now (their bundles stay cached, first in line for eviction,
      // and their groups read again what is evicted). Without this an expert whose own set the pool's half-share
      // cut short found neither slot nor staging after a later sibling's set took the other half (SYNTHETIC
      // qwen3-30b-a3b, 8 layers, 1200M, --hot-fraction 1: an internal error).
      for (size_t o = 0; o < la_group_.size() && !cold.CanPlace(group); ++o) {
        if (la_group_[o] >= 0 && static_cast<int>(o) != la_current_) {
          NF_RETURN_IF_ERROR(SettleLookahead(static_cast<int>(o)));
        }
      }
    }
    for (int32_t v = cold.NextVictim(group); v >= 0 && touches < active_.size() && cold.GroupOf(v) == group &&
                                             active_flag_[static_cast<size_t>(cold.UnitOf(v))] != 0;
         v = cold.NextVictim(group)) {
      cold.Touch(v);
      ++touches;
    }
    SlotRegion::Lookup l = cold.Acquire(group, n);
    if (l.slot < 0 && staging_used >= staging_slots_ && prefill_lent_first_ >= 0) {
      // A batch's FFN on the token path (an MoE expert with fewer tokens than the batched minimum, or a dense chunk
      // of a long prompt below it) while the batch's prefill buffers hold lent cold slots: the buffers give them
      // back (the prefetched region is dropped; the batch's next batched FFN lends and reads again). Without this a
      // cold region barely larger than the buffers left such a miss neither slot nor staging (an internal error).
      ReclaimPrefillMemory();
      l = cold.Acquire(group, n);
    }
    int32_t acq = -1;
    if (l.slot >= 0) {
      acquired_cold_.push_back(l.slot);
      acq = static_cast<int32_t>(acquired_cold_.size() - 1);
    }
    item_slot_[k] = l.slot;
    item_acq_[k] = acq;
    if (l.slot < 0 && staging_used >= staging_slots_) {  // sized so that this cannot happen
      return Status::Internal("layer " + std::to_string(group) + ": no cold slot and no staging left for neuron " +
                              std::to_string(n) + " (" + std::to_string(active_.size()) + " active)");
    }
    uint8_t* dst = l.slot >= 0 ? cold.SlotData(l.slot) : staging_ + static_cast<size_t>(staging_used++) * cold_stride_;
    bundle_[k] = dst;
    // A miss (called only for units not held; the hits are ResolveHits'): its read.
    if (l.slot >= 0) cold_complete_[static_cast<size_t>(l.slot)] = 0;
    item_unit_[k] = two_phase_ ? add_unit(false, n, offset, kTwoPhasePageBytes, dst, l.slot, acq, Phase::kGate,
                                          static_cast<int32_t>(k))
                               : add_unit(false, n, offset, static_cast<size_t>(cold_read_), dst, l.slot,
                                          acq, Phase::kWhole, static_cast<int32_t>(k));
    return Status::Ok();
  };
  for (size_t k = 0; k < active_.size(); ++k) {
    const int32_t n = active_[k];
    const int32_t s = region.slot_of_neuron[n];
    item_unit_[k] = -1;
    gate_known_[k] = 0;
    if (any_taken && la_taken_[k]) continue;
    if (HotPath(group, region, s)) {
      const int64_t c = s / cluster_neurons_;
      if (cluster_slot_[c] == -1) {
        touched_clusters_.push_back(static_cast<int32_t>(c));
        SlotRegion::Lookup l = hot.Acquire(group, c);
        if (l.slot < 0) {
          cluster_slot_[c] = -2;
        } else {
          cluster_slot_[c] = l.slot;
          acquired_hot_.push_back(l.slot);
          cluster_unit_[c] = -1;
          if (!l.hit) {
            const uint64_t start = lay.SlotOffset(c * cluster_neurons_);
            const size_t size = static_cast<size_t>(std::min<uint64_t>(cluster_bytes_, region.size - start));
            cluster_unit_[c] = add_unit(true, c, region.offset + start, size, hot.SlotData(l.slot), l.slot,
                                        static_cast<int32_t>(acquired_hot_.size() - 1), Phase::kWhole, -1);
          }
        }
      }
      if (cluster_slot_[c] >= 0) {
        bundle_[k] = hot.SlotData(cluster_slot_[c]) + (lay.SlotOffset(s) - lay.SlotOffset(c * cluster_neurons_));
        item_unit_[k] = cluster_unit_[c];
        if (item_unit_[k] < 0) ready_items_.push_back(static_cast<int32_t>(k));
        continue;
      }
      // No hot slot for this cluster (every one pinned): serve the neuron through the cold path.
    }
    if (cold.Find(group, n) >= 0) {
      deferred_hits_.push_back(static_cast<int32_t>(k));
      continue;
    }
    if (Status st = resolve_cold(k); !st.ok()) {
      for (int32_t a : active_) active_flag_[static_cast<size_t>(a)] = 0;
      return st;
    }
  }
  // A deferred unit evicted after all is a miss: read with the others.
  Status status;
  for (bool again = true; again && status.ok();) {
    again = false;
    for (size_t i = 0; i < deferred_hits_.size() && status.ok(); ++i) {
      const size_t k = static_cast<size_t>(deferred_hits_[i]);
      if (cold.Find(group, active_[k]) >= 0) continue;
      deferred_hits_.erase(deferred_hits_.begin() + static_cast<std::ptrdiff_t>(i));
      --i;
      status = resolve_cold(k);
      again = true;
    }
  }
  for (int32_t n : active_) active_flag_[static_cast<size_t>(n)] = 0;
  NF_RETURN_IF_ERROR(status);
  // Requests in file order: neighbours on flash merge, into one plain read when their destinations are adjacent too,
  // else into one scattered read (each bundle into its own slot).
  unit_order_.resize(units_.size());
  std::iota(unit_order_.begin(), unit_order_.end(), 0);
  std::sort(unit_order_.begin(), unit_order_.end(),
            [&](int32_t a, int32_t b) { return units_[a].offset < units_[b].offset; });
  // (llmflash reads unit by unit, blocking: one request each, never merged.)
  request_builder_.Reset(options_.mode == OffloadMode::kFull ? options_.max_request_bytes : 0, options_.scatter_reads,
                         gap_sink_, gap_bytes_);
  for (int32_t u : unit_order_) {
    const Unit& x = units_[u];
    // A gate page is never merged: its request must end where the page does (the rest comes only if needed).
    request_of_unit_[u] = static_cast<int32_t>(request_builder_.Add(x.offset, x.size, x.dst, x.phase == Phase::kWhole));
  }
  requests_ = request_builder_.Finish();
  CutChunks(requests_.size(), &chunk_ends_);
  // Items grouped by the chunk their unit is read in (counting sort).
  const size_t n_chunks = chunk_ends_.size();
  chunk_item_begin_.assign(n_chunks + 1, 0);
  auto chunk_of_item = [&](size_t k) {
    return static_cast<size_t>(request_of_unit_[item_unit_[k]]) / static_cast<size_t>(options_.chunk_requests);
  };
  for (size_t k = 0; k < active_.size(); ++k) {
    if (item_unit_[k] >= 0) ++chunk_item_begin_[chunk_of_item(k) + 1];
  }
  for (size_t c = 0; c < n_chunks; ++c) chunk_item_begin_[c + 1] += chunk_item_begin_[c];
  items_by_chunk_.resize(chunk_item_begin_[n_chunks]);
  chunk_fill_.assign(chunk_item_begin_.begin(), chunk_item_begin_.end() - (n_chunks ? 1 : 0));
  for (size_t k = 0; k < active_.size(); ++k) {
    if (item_unit_[k] >= 0) items_by_chunk_[chunk_fill_[chunk_of_item(k)]++] = static_cast<int32_t>(k);
  }
  return Status::Ok();
}

void OffloadFfn::ResolveHits(int64_t group) {
  SlotRegion& cold = cache_->cold();
  for (int32_t k : deferred_hits_) {
    const SlotRegion::Lookup l = cold.Acquire(group, active_[static_cast<size_t>(k)]);
    if (!l.hit) std::abort();  // Resolve left every deferred unit held, and nothing acquired cold slots since
    acquired_cold_.push_back(l.slot);
    item_slot_[static_cast<size_t>(k)] = l.slot;
    item_acq_[static_cast<size_t>(k)] = static_cast<int32_t>(acquired_cold_.size() - 1);
    bundle_[static_cast<size_t>(k)] = cold.SlotData(l.slot);
    // Two-phase: a slot may hold only the gate part; its up+down part is read if the gate passes.
    if (two_phase_ && !cold_complete_[static_cast<size_t>(l.slot)]) {
      gate_hit_items_.push_back(k);
    } else {
      ready_items_.push_back(k);
    }
  }
  deferred_hits_.clear();
}

void OffloadFfn::CutChunks(size_t n_requests, std::vector<size_t>* ends) const {
  ends->clear();
  const size_t step = static_cast<size_t>(options_.chunk_requests);
  for (size_t r = 0; r < n_requests; r += step) ends->push_back(std::min(n_requests, r + step));
}

Status OffloadFfn::VerifyUnit(int64_t layer, int64_t expert, const packer::RegionInfo& region, const Unit& u) const {
  const packer::BundleLayout& lay = deploy_.layout();
  if (!u.hot) {
    switch (u.phase) {
      case Phase::kWhole:
        return deploy_.VerifyBundle(layer, expert, u.index, std::span<const uint8_t>(u.dst, lay.bundle_bytes));
      case Phase::kGate:
        return deploy_.VerifyGate(layer, expert, u.index,
                                  std::span<const uint8_t>(u.dst + lay.gate_offset, lay.gate_bytes));
      case Phase::kUpDown:  // dst is the bundle's second page; up starts in the first (read by phase 1)
        return deploy_.VerifyUpDown(layer, expert, u.index,
                                    std::span<const uint8_t>(u.dst - kTwoPhasePageBytes + lay.up_offset,
                                                             lay.up_bytes + lay.down_bytes));
    }
  }
  const int64_t first = u.index * cluster_neurons_;
  const int64_t end = std::min<int64_t>(first + cluster_neurons_, pinned_.empty() ? region.hot_count : region.n_neurons);
  for (int64_t s = first; s < end; ++s) {
    const uint8_t* b = u.dst + (lay.SlotOffset(s) - lay.SlotOffset(first));
    NF_RETURN_IF_ERROR(deploy_.VerifyBundle(layer, expert, region.neuron_of_slot[s],
                                            std::span<const uint8_t>(b, lay.bundle_bytes)));
  }
  return Status::Ok();
}

Status OffloadFfn::CheckArrival(int64_t layer, int64_t expert, const packer::RegionInfo& region, const Unit& x,
                                const Status& read_status) {
  // A failed batch may have read this unit or not: its checksum decides (a per-neuron hash cannot pass on another
  // neuron's stale bytes), so only units whose bytes are wrong are read again.
  Status first = VerifyUnit(layer, expert, region, x);
  if (first.ok()) {
    MarkComplete(x);
    return first;
  }
  if (!read_status.ok()) first = read_status;
  // One synchronous retry: transient read errors and bits flipped in transit get a second chance; persistent
  // corruption on flash does not go away and is reported.
  ++stats_[static_cast<size_t>(layer * n_experts_ + std::max<int64_t>(0, expert))].retries;
  const char* phase = x.phase == Phase::kGate     ? " phase 1 (gate page)"
                      : x.phase == Phase::kUpDown ? " phase 2 (up+down part)"
                                                  : "";
  const std::string what = std::string("layer ") + std::to_string(layer) +
                           (expert >= 0 ? " expert " + std::to_string(expert) : std::string()) +
                           (x.hot ? " hot cluster " : " neuron ") + std::to_string(x.index) + phase +
                           ": ffn.bin offset " + std::to_string(x.offset) + " (" + std::to_string(x.size) + " bytes)";
  // Phase 2 checks up bytes that phase 1 brought with the gate page (only the gate was verified then): its retry
  // starts at the page holding the start of up, and then the whole bundle is verified.
  uint64_t offset = x.offset;
  size_t size = x.size;
  uint8_t* dst = x.dst;
  if (x.phase == Phase::kUpDown) {
    const uint64_t back = kTwoPhasePageBytes - deploy_.layout().up_offset / kTwoPhasePageBytes * kTwoPhasePageBytes;
    offset -= back;
    size += back;
    dst -= back;
  }
  Status again = flash_->ReadAt(offset, size, dst);
  if (!again.ok()) {
    return Status::IOError(what + ": read failed twice: " + again.message() + " (first: " + first.message() + ")");
  }
  Status verified = x.phase == Phase::kUpDown
                        ? deploy_.VerifyBundle(layer, expert, x.index,
                                               std::span<const uint8_t>(x.dst - kTwoPhasePageBytes,
                                                                        deploy_.layout().bundle_bytes))
                        : VerifyUnit(layer, expert, region, x);
  if (!verified.ok()) return Status::Corruption(what + ": checksum mismatch after one retry: " + verified.message());
  MarkComplete(x);
  return verified;
}

void OffloadFfn::ComputeItems(std::span<const int32_t> items, const Activation& x, float threshold) {
  if (items.empty()) return;
  const packer::BundleLayout& lay = deploy_.layout();
  const FfnActivation act = model_.hparams().activation;
  // The rows every item still needs (its gate unless the oracle or phase 1 has it, and its up), by address: one
  // GemvRowPtrs per part runs the multi-row tiles over bundles scattered across the cache and staging, the same
  // arithmetic per row as RowDot / the in-memory GemvRows (bit for bit) at several times the speed of one RowDot
  // per row.
  // With gate and up of one type (the packer's bundles), each item's gate and up rows, adjacent in its bundle, go
  // one after the other into one list: one parallel pass that streams each bundle's first two parts in order
  // (results per row as with two lists).
  const bool fused = lay.gate_type == lay.up_type && lay.gate_bytes == lay.up_bytes;
  gate_ptrs_.clear();
  up_ptrs_.clear();
  for (int32_t k : items) {
    if (!oracle_ && !gate_known_[k]) gate_ptrs_.push_back(bundle_[k] + lay.gate_offset);
    (fused ? gate_ptrs_ : up_ptrs_).push_back(bundle_[k] + lay.up_offset);
  }
  if (!gate_ptrs_.empty()) {
    GemvRowPtrs(PartShape(lay, lay.gate_type, lay.gate_bytes), gate_ptrs_, x, gate_out_.data(), pool_);
  }
  if (!fused) GemvRowPtrs(PartShape(lay, lay.up_type, lay.up_bytes), up_ptrs_, x, up_out_.data(), pool_);
  size_t gi = 0;  // in gate_out_
  for (size_t j = 0; j < items.size(); ++j) {
    const int32_t k = items[j];
    const float gate = oracle_ ? gate_all_[active_[k]] : gate_known_[k] ? gate_item_[k] : gate_out_[gi++];
    const float up = fused ? gate_out_[gi++] : up_out_[j];
    float ga = 0.0f;
    const float h = ActivateNeuron(act, gate, up, &ga);
    const bool use = std::fabs(ga) > threshold && h != 0.0f;
    used_flag_[k] = use;
    hidden_[k] = h;
    // The down column stays where it is (its slot is pinned, staging is not reused) until the accumulation.
    down_ptr_[k] = use ? bundle_[k] + lay.down_offset : nullptr;
  }
}

void OffloadFfn::ReleaseAll() {
  for (int32_t s : acquired_hot_) {
    if (s >= 0) cache_->hot().Release(s);
  }
  SlotRegion& cold = cache_->cold();
  constexpr size_t kAhead = 8;  // slot records are touched at random: start loading them a few releases ahead
  for (size_t i = 0; i < acquired_cold_.size(); ++i) {
    if (i + kAhead < acquired_cold_.size()) cold.PrefetchSlot(acquired_cold_[i + kAhead]);
    if (acquired_cold_[i] >= 0) cold.Release(acquired_cold_[i]);
  }
  for (int32_t c : touched_clusters_) cluster_slot_[c] = -1;
  acquired_hot_.clear();
  acquired_cold_.clear();
  touched_clusters_.clear();
}

void OffloadFfn::AbandonPending() {
  // Pending slots may hold partial data: drop them from the cache instead of releasing them.
  // (Two-phase: a slot can have two units, gate page and up+down part; it is abandoned once.)
  for (const Unit& u : units_) {
    if (u.cache_slot < 0) continue;
    if (u.hot) {
      if (acquired_hot_[u.acquired] < 0) continue;
      cache_->hot().Abandon(u.cache_slot);
      acquired_hot_[u.acquired] = -1;
    } else {
      if (acquired_cold_[u.acquired] < 0) continue;
      cache_->cold().Abandon(u.cache_slot);
      acquired_cold_[u.acquired] = -1;
    }
  }
  // Slots that items took from a lookahead set (verified or not: dropping a good one is harmless).
  for (int32_t k : la_items_) {
    const int32_t acq = item_acq_[static_cast<size_t>(k)];
    if (acq < 0 || acquired_cold_[static_cast<size_t>(acq)] < 0) continue;
    cache_->cold().Abandon(acquired_cold_[static_cast<size_t>(acq)]);
    acquired_cold_[static_cast<size_t>(acq)] = -1;
  }
  la_items_.clear();
  ReleaseAll();
}

Status OffloadFfn::ForwardToken(int64_t group, int64_t layer, int64_t expert, const Activation& x, float* out,
                                bool lookahead) {
  // Event trace: this layer's attention (since BeforeAttention) and, at any return, its FFN with its reads.
  struct FfnSpan {
    OffloadFfn* self;
    int64_t group;
    uint64_t begin = 0;
    bool resolved = false;  // requests_ are this layer's
    ~FfnSpan() {
      if (begin == 0) return;
      self->event_trace_->Add(TraceSpan{"ffn", TraceLane::kCompute, begin, SteadyNowNs(), group,
                                        resolved ? static_cast<int64_t>(self->requests_.size()) : -1});
    }
  } ffn_span{this, group};
  const float* const residual = residual_;  // BeforeFfn's, for this call only
  residual_ = nullptr;
  if (event_trace_ != nullptr) {
    ffn_span.begin = SteadyNowNs();
    if (attention_begin_ns_ != 0) {
      event_trace_->Add(TraceSpan{"attention", TraceLane::kCompute, attention_begin_ns_, ffn_span.begin, layer, -1});
      attention_begin_ns_ = 0;
    }
  }
  const LlamaHparams& hp = model_.hparams();
  const packer::BundleLayout& lay = deploy_.layout();
  const packer::RegionInfo* region = deploy_.Region(layer, expert);
  if (region == nullptr) {
    return Status::Internal("deployment has no region for layer " + std::to_string(layer) + " expert " +
                            std::to_string(expert));
  }
  const float thr = thresholds_[static_cast<size_t>(group)];
  OffloadGroupStats& st = stats_[static_cast<size_t>(group)];
  const uint64_t wait0 = io_wait_ns();
  uint64_t step_t = SteadyNowNs();
  auto step_done = [&](int step) {  // the time since the last step goes to `step`
    const uint64_t now = SteadyNowNs();
    step_ns_[static_cast<size_t>(step)] += now - step_t;
    step_t = now;
  };
  // A prefetched region must not race with this token's reads. Within a batch a later batched FFN wants it (MoE: this
  // expert has too few tokens and runs between batched ones), so its read completes first and the buffer stays (its
  // wait is prefill's exposed I/O); otherwise (e.g. after a failed prefill) nobody will use it. The slots a batched
  // prefill borrowed serve the cache again once the batch is over (its buffers stay lent until then: taking them back
  // would drop the prefetched region, and lending them again drops the bundles cached there meanwhile).
  if (pending_buf_ >= 0) {
    if (in_batch_) {
      CompletePrefetch();
    } else {
      CancelPrefetch();
    }
  }
  if (!in_batch_) ReclaimPrefillMemory();
  if (warm_cap_ > 0 && FirstFfnOfLayer(layer, expert)) ArmWarming(in_batch_ ? -1 : layer, group);
  // This layer's lookahead (read during the previous layer) serves its misses; any other is stale.
  if (la_slots_ > 0 && !la_on_ && layer == 0 && FirstFfnOfLayer(layer, expert)) WatchTokenStart();
  if (la_slots_ > 0 || la_siblings_) {
    // At the layer's first FFN (MoE: its first routed expert; the next layer's guesses are issued after its last one)
    // every set but this layer's is stale.
    if (FirstFfnOfLayer(layer, expert)) {
      DropLookahead(layer);
      std::fill(sib_group_.begin(), sib_group_.end(), -1);  // sets of an earlier token (one that failed) are stale
    }
    la_current_ = -1;
    const int first = static_cast<int>((layer % 2) * la_per_layer_);
    for (int b = first; b < first + la_per_layer_; ++b) {
      if (la_group_[static_cast<size_t>(b)] == group) la_current_ = b;
    }
  }

  ReplayStep(group);
  // 1. The active set, ascending.
  active_.clear();
  if (oracle_) {
    Gemv(oracle_gate_[group], x, gate_all_.data(), pool_);
    float ga = 0.0f;
    for (int64_t i = 0; i < hp.n_ff; ++i) {
      ActivateNeuron(hp.activation, gate_all_[i], 0.0f, &ga);
      if (std::fabs(ga) > thr) active_.push_back(static_cast<int32_t>(i));
    }
  } else if (!TakeSiblingSet(group)) {
    options_.predictor->Predict(group, x, 0, &pred_scratch_, &active_, pool_);
  }

  if (active_trace_ != nullptr) {
    trace_line_ = std::to_string(group);
    for (int32_t n : active_) {
      trace_line_ += ' ';
      trace_line_ += std::to_string(n);
    }
    trace_line_ += '\n';
    NF_RETURN_IF_ERROR(active_trace_->Append(trace_line_.data(), trace_line_.size()));
  }
  step_done(0);

  // 2. Cache lookups and the reads the misses need.
  if (Status resolved = Resolve(group, *region); !resolved.ok()) {
    AbandonPending();  // nothing was submitted for this layer; drop what it pinned
    return resolved;
  }
  ffn_span.resolved = true;
  step_done(1);
  // Full mode: the misses' reads go out before the hits are pinned (their lookups then overlap the reads).
  const bool early_reads = !two_phase_ && options_.mode == OffloadMode::kFull;
  size_t base = 0;
  if (early_reads && !requests_.empty()) {
    base = SubmitReads(requests_, chunk_ends_, "reads");
    io_open_ = true;
  }
  ResolveHits(group);
  step_done(2);
  st.tokens += 1;
  st.active += static_cast<int64_t>(active_.size());
  st.missed += static_cast<int64_t>(active_.size() - ready_items_.size());
  st.requests += static_cast<int64_t>(requests_.size());
  st.scattered_requests += CountScattered(requests_);
  for (const ReadRequest& r : requests_) st.bytes_read += r.size;

  // 3-4. Reads, checks and compute.
  Status status;
  if (two_phase_) {
    status = ForwardTokenTwoPhase(group, layer, expert, *region, x, thr);
  } else if (options_.mode == OffloadMode::kFull) {
    // The next layer's probable misses, queued behind this layer's (the I/O thread reads them while this layer and
    // the next one's attention compute).
    // MoE: once per layer, after its last routed expert's own reads.
    // With LookaheadInput::kHits the guess waits for the hits (their share of the output makes it closer to the next
    // layer's input); its reads still queue right behind this layer's, which take longer than the hits.
    const bool guess = lookahead && la_on_ && options_.lookahead_source == LookaheadSource::kNextLayer &&
                       LastFfnOfLayer(layer, expert);
    const bool after_hits = guess && GuessAfterHits(layer, residual);
    if (guess && !after_hits) IssueLookahead(layer, x);
    // MoE, one token: the layer's other experts' reads behind this one's.
    if (la_siblings_ && moe_one_token_ && FirstFfnOfLayer(layer, expert)) IssueSiblings(layer, expert, x);
    step_done(3);
    ComputeItems(ready_items_, x, thr);  // cache hits: while the first reads are in flight
    step_done(4);
    if (after_hits) {
      IssueLookaheadAfterHits(layer, residual);
      step_done(3);
    }
    status = ConsumeLookahead();
    if (status.ok()) ComputeItems(la_items_, x, thr);
    step_done(5);
    size_t pos = 0;  // in unit_order_
    for (size_t c = 0; c < chunk_ends_.size() && status.ok(); ++c) {
      Status read = io_->WaitChunk(base + c);
      for (; pos < unit_order_.size() && static_cast<size_t>(request_of_unit_[unit_order_[pos]]) < chunk_ends_[c];
           ++pos) {
        status = CheckArrival(layer, expert, *region, units_[static_cast<size_t>(unit_order_[pos])], read);
        if (!status.ok()) break;
      }
      if (!status.ok()) break;
      ComputeItems(std::span<const int32_t>(items_by_chunk_).subspan(chunk_item_begin_[c],
                                                                     chunk_item_begin_[c + 1] - chunk_item_begin_[c]),
                   x, thr);
    }
    if (!status.ok()) {
      io_->Drain();
      ForgetLookahead();
    }
    if (LookaheadIdle()) io_open_ = false;  // every chunk of the job was waited for
  } else {
    const uint64_t t0 = SteadyNowNs();
    for (int32_t u : unit_order_) {
      const Unit& x_unit = units_[u];
      Status read = flash_->ReadAt(x_unit.offset, x_unit.size, x_unit.dst);
      status = CheckArrival(layer, expert, *region, units_[static_cast<size_t>(u)], read);
      if (!status.ok()) break;
    }
    sync_wait_ns_ += SteadyNowNs() - t0;
    if (status.ok()) {
      ComputeItems(ready_items_, x, thr);
      ComputeItems(items_by_chunk_, x, thr);
    }
  }
  step_done(6);  // full: the chunks; llmflash and two-phase: every read and the compute
  if (!status.ok()) {
    AbandonPending();
    return status;
  }

  // 5. out = sum over used neurons in ascending order of h * down column, read in place from the pinned slots and
  // staging (AccumulateRowPtrs: the same kernel, row order and chunking as AccumulateRows over a compact copy).
  used_down_.clear();
  used_hidden_.clear();
  for (size_t k = 0; k < active_.size(); ++k) {
    if (!used_flag_[k]) continue;
    used_down_.push_back(down_ptr_[k]);
    used_hidden_.push_back(hidden_[k]);
  }
  st.used += static_cast<int64_t>(used_down_.size());
  std::fill(out, out + hp.dim, 0.0f);
  AccumulateRowPtrs(PartShape(lay, lay.down_type, lay.down_bytes), used_down_, used_hidden_.data(), out, pool_);
  NoteLayerRmsRatio(layer, residual, out);
  step_done(7);
  ReleaseAll();  // after the accumulation: the down columns were read from the pinned slots
  step_done(8);
  st.io_wait_ns += io_wait_ns() - wait0;
  if (LastFfnOfLayer(layer, expert)) warm_left_ = 0;  // other waits (prefill's) do not warm
  if (la_slots_ > 0 && !la_on_ && layer + 1 == hp.n_layers && LastFfnOfLayer(layer, expert)) WatchTokenEnd();
  return Status::Ok();
}

void OffloadFfn::BeginEval() {
  if (!placement_ || !pin_enabled_) return;
  if (Status st = placement_->Begin(); !st.ok()) {
    NF_LOG(Warning) << "thread placement off: " << st.message();
    placement_.reset();
  }
}

void OffloadFfn::EndEval() {
  if (placement_) placement_->End();
}

void OffloadFfn::ArmWarming(int64_t layer, int64_t group) {
  warm_spans_.clear();
  warm_span_ = 0;
  warm_offset_ = 0;
  warm_left_ = 0;
  if (layer < 0) return;  // batched prefill: no warming
  auto add = [&](const MatrixView& w) {
    if (w.data != nullptr && w.rows > 0) {
      warm_spans_.push_back({static_cast<const uint8_t*>(w.data), static_cast<size_t>(w.rows) * w.row_bytes});
    }
  };
  // In the order the engine reads them next: the next layer's q, k, v projections (one parallel loop over their rows),
  // then its output projection; after the last layer, the output matrix.
  const auto& layers = model_.layers();
  if (layer + 1 < static_cast<int64_t>(layers.size())) {
    const LayerWeights& next = layers[static_cast<size_t>(layer + 1)];
    add(next.wq);
    add(next.wk);
    add(next.wv);
    add(next.wo);
  } else {
    add(model_.output());
  }
  warm_left_ = warm_enabled_ ? warm_cap_ : 0;
  warm_group_ = group;
}

bool OffloadFfn::WarmStep() {
  // 64 KiB per step: ~2-4 us at DRAM speed, so a chunk's arrival is noticed within a few microseconds.
  constexpr size_t kStepBytes = size_t{64} << 10;
  while (warm_left_ > 0 && warm_span_ < warm_spans_.size()) {
    const WarmSpan& s = warm_spans_[warm_span_];
    if (warm_offset_ >= s.bytes) {
      ++warm_span_;
      warm_offset_ = 0;
      continue;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>({kStepBytes, s.bytes - warm_offset_, warm_left_}));
    TouchCacheLines(s.data + warm_offset_, n);
    warm_offset_ += n;
    warm_left_ -= n;
    stats_[static_cast<size_t>(warm_group_)].warm_next_bytes += n;
    return true;
  }
  return false;
}

void OffloadGroupStats::Add(const OffloadGroupStats& o) {
  tokens += o.tokens;
  active += o.active;
  missed += o.missed;
  used += o.used;
  requests += o.requests;
  scattered_requests += o.scattered_requests;
  bytes_read += o.bytes_read;
  retries += o.retries;
  gate_requests += o.gate_requests;
  gate_bytes += o.gate_bytes;
  updown_requests += o.updown_requests;
  updown_bytes += o.updown_bytes;
  updown_skipped += o.updown_skipped;
  prefetched += o.prefetched;
  prefetch_used += o.prefetch_used;
  prefetch_requests += o.prefetch_requests;
  prefetch_bytes += o.prefetch_bytes;
  lookahead_ns += o.lookahead_ns;
  lookahead_verify_ns += o.lookahead_verify_ns;
  io_wait_ns += o.io_wait_ns;
  warm_next_bytes += o.warm_next_bytes;
}

OffloadGroupStats OffloadFfn::TotalStats() const {
  OffloadGroupStats t;
  for (const auto& s : stats_) t.Add(s);
  return t;
}

void OffloadFfn::ResetStats() {
  for (auto& s : stats_) s = OffloadGroupStats();
  step_ns_.fill(0);
  cache_->hot().ResetCounters();
  cache_->cold().ResetCounters();
}

void OffloadFfn::SetEventTrace(EventTrace* trace) {
  event_trace_ = trace;
  attention_begin_ns_ = 0;
  if (io_) io_->SetTrace(trace);
}

uint64_t OffloadFfn::io_wait_ns() const { return sync_wait_ns_ + (io_ ? io_->wait_ns() : 0); }

uint64_t OffloadFfn::scratch_bytes() const {
  return static_cast<uint64_t>(staging_slots_) * cold_stride_ +
         static_cast<uint64_t>(model_.hparams().n_ff) * kPerNeuronScratchBytes;
}

uint64_t OffloadFfn::oracle_bytes() const {
  uint64_t n = 0;
  for (const auto& b : oracle_gate_bytes_) n += b.size();
  return n;
}

}  // namespace nflash::sparse
