// The writer side of the deployment format (packer/deployment.h): neuron ordering from a profile (hot first; cold by
// popularity or co-activation chains), and PackDeployment, which streams a GGUF model into DEPLOY_DIR one FFN region
// at a time (never the whole flash image in memory).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "profiler/profile.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"

namespace nflash::packer {

enum class NeuronOrder { kHotness, kCoactivation };
Result<NeuronOrder> ParseNeuronOrder(const std::string& name);
const char* NeuronOrderName(NeuronOrder order);

// Share of activations the default hot set covers (when --hot-fraction is not given): the smallest most-popular
// prefix of a region's neurons that accounts for half of its activations in the profile (the "dense cluster" the
// runtime reads sequentially); half is the knee the PowerInfer papers use for the hot/cold split.
inline constexpr double kDefaultHotActivationShare = 0.5;

// Number of hot neurons of `ffn`: round(hot_fraction * n) when hot_fraction >= 0, else the
// kDefaultHotActivationShare rule above (0 when the profile saw no activation).
int64_t HotCount(const profiler::FfnProfile& ffn, double hot_fraction);
// neuron_of_slot for one region: slots [0, hot_count) the most popular neurons (count desc, index asc); then the cold
// ones by popularity (kHotness) or by greedy chaining (kCoactivation: start at the most popular unplaced cold neuron,
// then repeatedly move to the current neuron's strongest unplaced cold co-activation partner; when none, start a new
// chain). Returns a permutation of 0..n_neurons-1.
std::vector<int32_t> OrderNeurons(const profiler::FfnProfile& ffn, int64_t hot_count, NeuronOrder order);
// The order OrderNeurons really applies to `ffn`: kHotness for a profile without co-activation partners (coact_k 0),
// else `order`. The manifest records it.
NeuronOrder EffectiveOrder(const profiler::FfnProfile& ffn, NeuronOrder order);

struct PackOptions {
  // Co-activation chains by default: on the SYNTHETIC 7B they cut cold-only reads per held-out token by 29% in replay
  // and requests per decoded token by 12% under a plan (docs/results.md, seventh run). Popularity order for a profile
  // without co-activation partners.
  NeuronOrder order = NeuronOrder::kCoactivation;
  double hot_fraction = -1.0;  // < 0: kDefaultHotActivationShare rule
  std::string predictor_path;  // "" or a predictor GGUF copied into the deployment
  // "" or the profile file (whose hash is `profile_hash`): copied into the deployment as kProfileFileName, so that
  // `nflash plan` finds the popularity and hit-rate curves of what it plans for without another argument.
  std::string profile_path;
  bool overwrite = false;      // replace an existing DEPLOY_DIR
  bool progress = true;        // progress bar on stderr
};

// Summary of a finished pack (also in the manifest).
struct PackStats {
  uint64_t flash_bytes = 0, resident_bytes = 0, padding_bytes = 0;
  int64_t hot_neurons = 0, neurons = 0;
  double seconds = 0.0;
};

// Packs `model_path` (GGUF) with `profile` (made from that model: checked by hash and shape; `profile_hash` is the
// profile file's HashToHex(HashFile)) into `out_dir`, written as `out_dir`.tmp-PID and renamed at the end.
Result<PackStats> PackDeployment(const std::string& model_path, const profiler::ModelProfile& profile,
                                 const std::string& profile_hash, const std::string& out_dir,
                                 const PackOptions& options, ThreadPool* pool);

}  // namespace nflash::packer
