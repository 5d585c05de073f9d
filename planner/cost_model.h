// The planner's cost model (docs/planner.md gives every equation and symbol): what one decode token costs for a
// given execution plan, from the hardware profile, the model's profile and deployment, and the user's limits. The Z3
// solver (z3_planner.h) encodes the same equations; Evaluate() computes them directly, for tests and for the
// predicted breakdown written into plan.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core/status.h"

namespace nflash::planner {

// A piecewise-linear curve through (x_i, y_i), x ascending in [0, 1] (popularity, cache hit rate).
struct Curve {
  std::vector<double> x, y;
  double At(double v) const;
  // The least concave majorant's segments (slope, intercept): y <= min_k (slope_k x + intercept_k) is the tightest
  // linear description of "y is at most the curve" when the curve is concave, and an upper bound otherwise.
  // `max_segments` > 0: at most that many of them, evenly spaced along the hull (always the first and the last): each
  // line is still an upper bound, so fewer of them bound the curve more loosely (optimistically) but never cut it.
  std::vector<std::pair<double, double>> ConcaveSegments(size_t max_segments = 0) const;
};

// The pointwise maximum of two curves (breakpoints of both plus their crossings).
Curve UpperEnvelope(const Curve& a, const Curve& b);

// Random-read performance at one (request size, queue depth), from profile-hw.
struct IoPoint {
  uint64_t request_bytes = 0;
  int queue_depth = 1;
  double mb_per_s = 0;     // 1e6 bytes per second
  double mean_latency_us = 0;
};

// Synchronisation cost of one cluster hand-off between the I/O thread and a compute thread (a futex wake and a cache
// line transfer: measured at 3-8 us on this class of machine; 5 us used).
inline constexpr double kClusterSyncUs = 5.0;

struct HardwareParams {
  int cores = 1;
  double mem_bw_gbs = 0;                       // streaming read, all cores (1e9 bytes/s)
  // Indexed by thread count - 1: weight bytes per second of the kernels decode uses.
  std::vector<double> dense_gemv_gbs;          // attention projections, output head, predictor (GEMV)
  std::vector<double> sparse_ffn_gbs;          // gate/up rows + down columns of active neurons (GemvRows/AccumulateRows)
  std::vector<IoPoint> random_reads;           // O_DIRECT io_uring random reads
  double seq_read_mbs = 0;                     // sequential reads (prefill streaming)
  double gemm_gflops = 0;                      // prefill GEMM, all cores
  double submit_us_per_request = 2.0;          // CPU time to issue one read (io_uring SQE + completion)
  double cluster_sync_us = kClusterSyncUs;     // one cluster hand-off (scaled by a calibration like the kernels)
  // Throughput at `request_bytes` and `queue_depth`: interpolated over request size in log space at the nearest
  // measured queue depth not above it.
  double ReadMbps(uint64_t request_bytes, int queue_depth) const;
  // Mean latency of one read (us) at `request_bytes` and `queue_depth`, interpolated the same way.
  double ReadLatencyUs(uint64_t request_bytes, int queue_depth) const;
};

// One FFN region (a dense layer, or one expert of an MoE layer).
struct FfnParams {
  int64_t layer = 0, expert = -1;
  int64_t n_neurons = 0;
  double active_fraction = 0;     // mean share of neurons active per token (per routed token for experts)
  double route_fraction = 1;      // MoE: share of tokens routed to this expert; 1 for dense
  uint64_t bundle_bytes = 0;      // gate + up + down bytes of one neuron
  uint64_t compute_bytes = 0;     // bytes computed per active neuron (0: bundle_bytes; up + down when the gate
                                  // values come from elsewhere, e.g. the oracle's dense gate GEMV)
  uint64_t read_bytes = 0;        // bytes one missed neuron costs to read (bundle rounded to the flash alignment)
  uint64_t slot_bytes = 0;        // memory one cached (cold) neuron takes
  uint64_t hot_slot_bytes = 0;    // memory one neuron of the hot region takes (0: slot_bytes); whole flash groups
  uint64_t HotSlotBytes() const { return hot_slot_bytes > 0 ? hot_slot_bytes : slot_bytes; }
  Curve popularity;               // share of activations covered by the hottest x of the neurons
  Curve lru_hit;                  // hit rate of an LRU cache holding x of the neurons
  // A region that is not one expert: the FFN runs it stands for per token (1 for a dense layer; a layer of grouped
  // experts, ExpertLayers: its experts used per token). An expert runs route_fraction times per token.
  double layer_runs = 1;
  // An expert: the share of its runs that wait for their own first reads. The runtime reads a layer's routed
  // experts' misses at its first one (sibling read-ahead, since session 46), so about one wait per layer: 1 /
  // experts used per token (ModelParamsFromDeployment); 1: every run waits.
  double first_read_share = 1;
  uint64_t ComputeBytes() const { return compute_bytes > 0 ? compute_bytes : bundle_bytes; }
  // FFN runs per token that wait for their first reads (the pipeline's exposed latency).
  double Runs() const { return expert >= 0 ? route_fraction * first_read_share : layer_runs; }
};

struct ModelParams {
  std::string name;
  int64_t n_layers = 0;
  uint64_t fixed_bytes = 0;             // resident image + KV cache + scratch: held whatever the plan
  uint64_t dense_bytes_per_token = 0;   // attention + output head + norms read per token (GEMV)
  uint64_t predictor_bytes = 0;         // all predictors (read per token)
  uint64_t ffn_bytes = 0;               // the whole flash image (for prefill streaming)
  uint64_t matmul_params = 0;           // weights in every matrix product per token (2 flops each per token)
  uint64_t dense_matmul_params = 0;     // of which outside the FFNs (attention, router, output head)
  bool predictor = false;               // the deployment ships a predictor (its FFNs compute predicted neurons)
  // Cold slots the runtime adds beyond the plan's, shared by every region: the miss staging reserved in fixed_bytes
  // (one slot per neuron of a region), which the runtime turns into a cold overflow pool when the plan gives per-layer
  // partitions (runtime/sparse/sparse_runtime.cc). 0: none.
  int64_t overflow_pool_slots = 0;
  // Hit rate of one LRU cold pool shared by every region holding a fraction x of all their neurons (the profile's
  // shared-cache curve, decode order); empty when the profile has none. Unlike the per-region curves it sees routing
  // that follows the sequence (MoE), which per-region partitions sized by the calibration's routing cannot follow.
  Curve shared_lru;
  std::vector<FfnParams> ffns;
};

struct UserLimits {
  uint64_t memory_bytes = 0;
  int cores = 0;                  // 0: all
  double min_tokens_per_s = 0;    // 0: none
  enum class Objective { kSpeed, kMemory } objective = Objective::kSpeed;
};

// The knobs the runtime exposes (what plan.json sets).
struct PlanSettings {
  int compute_threads = 1;
  int io_threads = 1;
  int queue_depth = 32;
  int cluster_neurons = 32;
  std::vector<int64_t> hot_neurons;   // per FFN region, in ModelParams::ffns order
  std::vector<int64_t> cold_slots;    // per FFN region
  // The cold slots (their sum, plus the overflow pool) as one LRU pool shared by every region, served at
  // ModelParams::shared_lru of its share of all neurons; hot_neurons are then 0.
  bool shared_cold_pool = false;
};

// Per-token time breakdown (seconds) and the memory of a plan.
struct Prediction {
  double attention_s = 0, predictor_s = 0, ffn_compute_s = 0, io_s = 0, io_exposed_s = 0, pipeline_s = 0;
  double token_s = 0;
  double tokens_per_s = 0;
  double served_fraction = 0;     // share of active neurons found in memory, weighted by active neurons
  double read_mb_per_token = 0;
  double reads_per_token = 0;
  uint64_t memory_bytes = 0;
  // Per region (ModelParams::ffns order): its time and terms.
  std::vector<double> layer_token_s, layer_compute_s, layer_io_s, layer_pipeline_s, layer_served;
};

// Cluster sizes and queue depths the planner chooses from (the runtime's supported values).
inline const std::vector<int> kClusterChoices = {8, 16, 32, 64, 128};
inline const std::vector<int> kQueueDepthChoices = {1, 2, 4, 8, 16, 32, 64};
// Reads in flight: the runtime's I/O thread streams a layer's reads through one queue kept at the queue depth, and
// hands them to compute cluster by cluster (IoWorker), so the cluster size no longer caps the depth.

// Prefill of `n_tokens` (docs/planner.md, "Prefill"): GEMM time against streaming the FFN regions that are not held
// in memory, overlapped by next-layer prefetch except for the first layer's read.
struct PrefillPrediction {
  double compute_s = 0, io_s = 0, exposed_io_s = 0, total_s = 0, tokens_per_s = 0;
};
PrefillPrediction EvaluatePrefill(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings,
                                  int64_t n_tokens);

// The cost model evaluated for `settings` (see docs/planner.md). Served fraction per region: the tighter of
// max(P, H)(h + c) and P(h) + H(c) (popularity curve P, LRU curve H, h hot and c cold fractions of the region): h + c
// neurons serve at most what the better of pinning the most popular ones and an LRU cache of that size serve (an LRU
// beats pinning when activations recur in time, which the profile's H shows as H(x) > P(x)). The overflow pool
// (ModelParams::overflow_pool_slots) is credited to the regions in even shares: a region's LRU holds its partition
// plus pool / regions (a miss evicts the older of its partition's and the pool's least recent entries, so under a
// steady load each region keeps about an even share).
Prediction Evaluate(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings);

// Deepest queue the planner sets for bursts (BurstQueueDepth).
inline constexpr int kMaxBurstQueueDepth = 256;
// The queue depth to run `settings` with: settings.queue_depth, raised (to a power of two, at most
// kMaxBurstQueueDepth) to hold a layer's expected misses (`prediction`, from Evaluate of `settings`) when the I/O
// thread shares the cores with the compute threads. A layer's misses are submitted together; beyond the depth, each
// further read waits for the I/O thread to reap a completion and refill, and on a machine without a spare core the I/O
// thread waits for a core the compute threads hold while they compute the layer's hits. The throughput and latency
// the profile measures at that depth stay what the prediction uses (a deeper queue only removes the refills).
// SYNTHETIC 7B at 1392M on 2 vCPUs (~120 misses per layer): depths 128 and 256 against 64 waited less for I/O in all
// 14 interleaved runs and were faster in 11; the re-made plan (256) against itself at 64 was faster in 5 of 5 pairs
// (docs/results.md, eleventh run).
int BurstQueueDepth(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings,
                    const Prediction& prediction);

// Each region's neurons held in memory (hot + cold, as in `settings`) all pinned hot or all one LRU cold partition,
// whichever the measured curves serve more of: Pop(x) or H(x) at the region's fraction x (ties: hot). Under the
// cost model a mix never serves more than the better pure choice (served <= max(P, H)(h + c)), and the pure choices
// are the only splits the curves measure exactly: P(h) + H(c) credits a cold partition beside the hot one with the
// LRU hit rate of the whole access stream, while it only sees the accesses the hot neurons do not serve (below a
// token's working set an LRU thrashes: the profile's H is near 0 there). The solver's linear relaxation takes H's
// concave hull and so favours small cold partitions beside large hot ones; this step removes them. Each region keeps
// its memory: the neurons it holds are those its bytes buy at the chosen way's size (capped at the region's neurons).
PlanSettings PureRegionSplits(const ModelParams& model, const PlanSettings& settings);

// `knobs`' threads, queue depth and cluster size with every byte `memory_bytes` leaves beyond the fixed part in one
// shared cold pool (at most every neuron), split over the regions by their active neurons per token (the runtime sums
// them). Empty cold slots when not even one slot fits.
PlanSettings SharedPoolSettings(const ModelParams& model, const PlanSettings& knobs, uint64_t memory_bytes);

// Mixture-of-experts models with many experts are beyond Z3's exact simplex as one region per expert (SYNTHETIC
// qwen3-30b-a3b cut to 8 layers, 1024 regions: no solve in 7 minutes on 2 vCPUs; the whole model has 6144). Above
// kMaxSolverRegions the solver sees one region per layer instead (ExpertLayers), whose curves merge its experts':
// each expert's curve, as its upper hull, is a run of segments of constant activation mass per neuron (its share
// of the curve times its active neurons per token, over its neurons), and the layer's curve takes all of them in
// decreasing order of that density, which is how a hot (or LRU) budget is best split over the experts when each
// keeps its own region. The solver's per-layer neurons are then handed out in that same order (SpreadOverExperts)
// and the plan is evaluated per expert. The merge is exact for the served activations; the layer's time takes
// max(compute, I/O) once per layer where the per-expert model takes it per expert (an optimistic solver figure; the
// plan's prediction is Evaluate's, per expert).
inline constexpr size_t kMaxSolverRegions = 128;

struct ExpertLayers {
  struct Piece {
    size_t region;  // index into the per-expert model's ffns
    double neurons;
  };
  ModelParams model;  // the per-expert model with one FFN region per layer
  // Per layer: the merged popularity and LRU segments, in the order they are filled.
  std::vector<std::vector<Piece>> hot_order, cold_order;
};

// The per-layer view of `model` (whose experts of one layer share bundle, read, slot and compute sizes; false
// otherwise, or for a dense model).
bool GroupExpertsByLayer(const ModelParams& model, ExpertLayers* out);

// The per-layer plan `per_layer` (ExpertLayers::model's regions) as a per-expert plan of `model`: each layer's hot
// neurons and cold slots handed to its experts in `layers`' order, whole neurons rounded down (never more memory).
PlanSettings SpreadOverExperts(const ModelParams& model, const ExpertLayers& layers, const PlanSettings& per_layer);

}  // namespace nflash::planner
