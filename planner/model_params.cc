// Planner inputs from the deployment, the profile and hw.json (see model_params.h).
#include "planner/model_params.h"

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

#include "planner/floors.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/json_fields.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"

namespace nflash::planner {

Curve CurveFrom(const std::vector<float>& y) {
  Curve c;
  for (size_t i = 0; i < y.size(); ++i) {
    c.x.push_back(static_cast<double>(i) / static_cast<double>(y.size() - 1));
    c.y.push_back(std::clamp(static_cast<double>(y[i]), 0.0, 1.0));
  }
  return c;
}

Curve PlanningPopularity(const profiler::FfnProfile& fp) {
  // The in-sample curve counts each neuron on the tokens that ranked it, which overstates coverage when the counts
  // rest on few tokens. SYNTHETIC 4-layer mixtral-8x7b shape, 1024 profiled decode tokens (~256 per expert): in-sample
  // P(1/2) was 4.5 points above the coverage measured on the offloaded decode's own active sets, and the plan pinned
  // every expert where an LRU cold region served more (docs/planner.md).
  return CurveFrom(fp.popularity_heldout.size() >= 2 ? fp.popularity_heldout : fp.popularity);
}

Result<ModelParams> ModelParamsFromDeployment(const packer::Deployment& deployment, const profiler::ModelProfile& profile,
                                              const std::string& profile_path, uint64_t fixed_bytes,
                                              const NeuronSizes& sizes) {
  const packer::Manifest& man = deployment.manifest();
  NF_ASSIGN_OR_RETURN(uint64_t profile_hash, HashFile(profile_path));
  if (HashToHex(profile_hash) != man.profile_hash) {
    return Status::InvalidArgument(profile_path + " is not the profile " + deployment.dir() +
                                   " was packed from: manifest.json field 'profile_hash' is " + man.profile_hash +
                                   ", the file hashes to " + HashToHex(profile_hash));
  }
  if (profile.n_layers != man.n_layers || profile.n_ff != man.n_ff || profile.n_experts != man.n_experts) {
    return Status::InvalidArgument(profile_path + ": shape (layers, n_ff, experts) differs from " + deployment.dir() +
                                   "/manifest.json");
  }
  NF_ASSIGN_OR_RETURN(LlamaHparams hp, ReadLlamaHparams(deployment.resident()));
  ModelParams m;
  m.name = man.model_name;
  m.n_layers = man.n_layers;
  m.fixed_bytes = fixed_bytes;
  m.overflow_pool_slots = man.n_ff;  // the staging in fixed_bytes (OffloadFfn::EstimateScratchBytes)
  m.predictor_bytes = man.predictor_bytes;
  m.ffn_bytes = man.flash_bytes;

  // Dense bytes per token: every resident matrix a decode token multiplies with (attention, router, output head). The
  // embedding table is a lookup (one row) unless it doubles as the output head; the deployment's index tables are
  // not read per token.
  const DenseWeights dense = ResidentDenseWeights(deployment.resident());  // the floors count the same bytes
  m.dense_bytes_per_token = dense.bytes;
  m.matmul_params = dense.params;
  m.dense_matmul_params = dense.params;
  const uint64_t per_region_params = 3ull * static_cast<uint64_t>(man.dim) * static_cast<uint64_t>(man.n_ff);

  // What the runtime will compute per token: with a predictor, the share it predicts active (held-out figure when the
  // trainer measured one); without one the runtime's oracle computes every neuron whose activation is non-zero: the
  // profile's share for ReLU / dReLU (threshold 0), all of them for SiLU (never exactly zero).
  std::unique_ptr<Predictor> predictor;
  if (!deployment.predictor_path().empty()) {
    NF_ASSIGN_OR_RETURN(predictor, Predictor::Load(deployment.predictor_path()));
  }
  m.predictor = predictor != nullptr;
  auto computed_fraction = [&](const profiler::FfnProfile& fp) -> double {
    if (predictor && fp.layer < predictor->n_layers() && (fp.expert < 0) == (predictor->n_experts() == 0) &&
        fp.expert < predictor->n_experts()) {
      const PredictorLayerInfo& info = predictor->info(predictor->Group(fp.layer, fp.expert));
      if (info.eval_predicted_fraction >= 0) return info.eval_predicted_fraction;
      if (info.predicted_fraction >= 0) return info.predicted_fraction;
    }
    if (hp.activation == FfnActivation::kSilu) return 1.0;
    return fp.mean_active_fraction;
  };
  const packer::BundleLayout& layout = deployment.layout();
  bool every_neuron = false;  // some region computes every neuron: the profile's curves do not apply
  for (const packer::RegionInfo& r : man.regions) {
    const profiler::FfnProfile* fp = profile.Find(r.layer, r.expert);
    if (fp == nullptr) {
      return Status::InvalidArgument(profile_path + " has no FFN (layer " + std::to_string(r.layer) + ", expert " +
                                     std::to_string(r.expert) + ") that " + deployment.dir() + " holds");
    }
    if (fp->popularity.size() < 2 || fp->lru_hit_rate.size() < 2) {
      return Status::InvalidArgument(profile_path + ": layer " + std::to_string(r.layer) +
                                     " lacks its popularity / LRU hit-rate curves");
    }
    FfnParams f;
    f.layer = r.layer;
    f.expert = r.expert;
    f.n_neurons = r.n_neurons;
    f.active_fraction = computed_fraction(*fp);
    f.route_fraction = profile.RoutedShare(*fp);
    // Decode waits about once per layer for its experts' first reads (the runtime's sibling read-ahead).
    if (r.expert >= 0 && hp.n_experts_used > 1) f.first_read_share = 1.0 / static_cast<double>(hp.n_experts_used);
    f.bundle_bytes = layout.bundle_bytes;
    // Without a predictor the runtime's oracle already has every gate value (its dense GEMV over the gate rows,
    // counted in predictor_bytes below): per active neuron it computes only up and down.
    f.compute_bytes = predictor ? layout.bundle_bytes : layout.up_bytes + layout.down_bytes;
    if (!predictor) {
      // (an expert's gate rows only for the tokens routed to it)
      m.predictor_bytes += static_cast<uint64_t>(static_cast<double>(r.n_neurons * layout.gate_bytes) * f.route_fraction);
    }
    f.read_bytes = sizes.read;  // the bundle rounded up to the direct-I/O alignment, or its whole group
    f.slot_bytes = sizes.cold_slot;
    f.hot_slot_bytes = sizes.hot_slot;
    f.popularity = PlanningPopularity(*fp);
    f.lru_hit = CurveFrom(fp->lru_hit_rate);
    if (f.active_fraction >= 1.0) {
      every_neuron = true;
      // Every neuron computed on every token: the profile's curves (of the thresholded activity) do not apply; a
      // region holding a share x of the neurons serves exactly x of them.
      f.popularity = Curve{{0.0, 1.0}, {0.0, 1.0}};
      f.lru_hit = f.popularity;
    }
    // The profile's replay counts the first touch of every neuron as a miss; a cache holding the whole region has
    // none in steady state (decode runs far longer than the warm-up), so its end point is 1.
    f.lru_hit.y.back() = 1.0;
    m.ffns.push_back(std::move(f));
    // MoE: a token runs n_experts_used experts, so per token the FFN products cost their route share.
    m.matmul_params += static_cast<uint64_t>(static_cast<double>(per_region_params) *
                                             (r.expert >= 0 ? static_cast<double>(hp.n_experts_used) /
                                                                  static_cast<double>(std::max<int64_t>(hp.n_experts, 1))
                                                            : 1.0));
  }
  if (profile.lru_hit_rate_shared.size() >= 2 && !every_neuron) {
    m.shared_lru = CurveFrom(profile.lru_hit_rate_shared);
    m.shared_lru.y.back() = 1.0;  // a pool holding every neuron has no misses in steady state (as above)
  }
  return m;
}

namespace {

using nlohmann::json;

// hw.json fields through the shared reader (runtime/core/json_fields.h); `where` names the file and the object.
Result<double> Number(const json& obj, const char* key, const std::string& where) {
  NF_ASSIGN_OR_RETURN(const JsonFields f, JsonFields::Of(obj, JsonLocation(where)));
  double v = 0;
  NF_RETURN_IF_ERROR(f.Get(key, &v));
  return v;
}

Result<const json*> Array(const json& obj, const char* key, const std::string& where) {
  NF_ASSIGN_OR_RETURN(const JsonFields f, JsonFields::Of(obj, JsonLocation(where)));
  return f.Array(key, /*min_size=*/1);
}

}  // namespace

Result<HardwareParams> LoadHardwareParams(const std::string& path, const std::string& type_name) {
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  const json j = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(path + ": not a JSON object");
  if (j.value("format", std::string()) != "nflash.hw_profile") {
    return Status::Corruption(path + ": field 'format': expected \"nflash.hw_profile\" (a file from `nflash "
                              "profile-hw`), found " + (j.contains("format") ? j["format"].dump() : "nothing"));
  }
  NF_ASSIGN_OR_RETURN(double version, Number(j, "version", path));
  if (version != 1) {
    return Status::Unsupported(path + ": field 'version': expected 1, found " + j["version"].dump());
  }
  HardwareParams hw;
  if (!j.contains("machine") || !j.contains("compute") || !j.contains("flash")) {
    return Status::Corruption(path + ": expected objects 'machine', 'compute' and 'flash'");
  }
  NF_ASSIGN_OR_RETURN(double threads, Number(j["machine"], "hardware_threads", path + " machine"));
  hw.cores = static_cast<int>(threads);

  // Per thread count: the model type's GEMV and sparse-row throughput; the best GEMM.
  std::map<int, double> gemv, rows, acc, neuron, mem;
  NF_ASSIGN_OR_RETURN(const json* results, Array(j["compute"], "results", path + " compute"));
  for (const json& r : *results) {
    if (r.value("type", std::string()) != type_name) continue;
    const std::string kernel = r.value("kernel", std::string());
    NF_ASSIGN_OR_RETURN(double t, Number(r, "threads", path + " compute.results"));
    NF_ASSIGN_OR_RETURN(double gbs, Number(r, "weight_gb_per_s", path + " compute.results"));
    const int ti = static_cast<int>(t);
    if (kernel == "gemv") gemv[ti] = gbs;
    if (kernel == "gemv_rows") rows[ti] = gbs;
    if (kernel == "accumulate_rows") acc[ti] = gbs;
    if (kernel == "neuron_path") neuron[ti] = gbs;
    if (kernel == "gemm" && r.value("tokens", 0) >= 128) {
      NF_ASSIGN_OR_RETURN(double gf, Number(r, "gflop_per_s", path + " compute.results"));
      hw.gemm_gflops = std::max(hw.gemm_gflops, gf);
    }
  }
  NF_ASSIGN_OR_RETURN(const json* memory, Array(j["compute"], "memory", path + " compute"));
  for (const json& r : *memory) {
    NF_ASSIGN_OR_RETURN(double t, Number(r, "threads", path + " compute.memory"));
    NF_ASSIGN_OR_RETURN(double gbs, Number(r, "read_gb_per_s", path + " compute.memory"));
    mem[static_cast<int>(t)] = gbs;
    hw.mem_bw_gbs = std::max(hw.mem_bw_gbs, gbs);
  }
  for (int t = 1; t <= hw.cores; ++t) {
    if (!gemv.count(t) || !rows.count(t) || !acc.count(t)) {
      if (t == 1) {
        return Status::Corruption(path + ": no gemv / gemv_rows / accumulate_rows results for type " + type_name +
                                  " at 1 thread");
      }
      break;  // fewer thread counts measured: the planner uses what there is
    }
    hw.dense_gemv_gbs.push_back(gemv[t]);
    // The runtime's per-neuron path when the profile measured it (profile-hw from 2026-11-23 on); older profiles:
    // a neuron's bytes are 2/3 gate and up rows (gemv_rows) and 1/3 down column (accumulate_rows), an upper bound.
    hw.sparse_ffn_gbs.push_back(neuron.count(t) ? neuron[t] : 1.0 / (2.0 / 3.0 / rows[t] + 1.0 / 3.0 / acc[t]));
  }

  const json& flash = j["flash"];
  NF_ASSIGN_OR_RETURN(const json* random, Array(flash, "random_read", path + " flash"));
  std::vector<double> submit;
  for (const json& r : *random) {
    const std::string where = path + " flash.random_read";
    NF_ASSIGN_OR_RETURN(double block, Number(r, "block_bytes", where));
    NF_ASSIGN_OR_RETURN(double qd, Number(r, "queue_depth", where));
    NF_ASSIGN_OR_RETURN(double mbs, Number(r, "mb_per_s", where));
    NF_ASSIGN_OR_RETURN(double lat, Number(r, "latency_mean_us", where));
    hw.random_reads.push_back({static_cast<uint64_t>(block), static_cast<int>(qd), mbs, lat});
    if (r.contains("submit_cpu_us_per_request") && r["submit_cpu_us_per_request"].is_number()) {
      submit.push_back(r["submit_cpu_us_per_request"].get<double>());
    }
  }
  if (!submit.empty()) {
    std::nth_element(submit.begin(), submit.begin() + static_cast<std::ptrdiff_t>(submit.size() / 2), submit.end());
    hw.submit_us_per_request = submit[submit.size() / 2];
  }
  NF_ASSIGN_OR_RETURN(const json* seq, Array(flash, "sequential_read", path + " flash"));
  for (const json& r : *seq) {
    NF_ASSIGN_OR_RETURN(double mbs, Number(r, "mb_per_s", path + " flash.sequential_read"));
    hw.seq_read_mbs = std::max(hw.seq_read_mbs, mbs);
  }
  return hw;
}

}  // namespace nflash::planner
