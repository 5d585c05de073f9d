// How the runtime shares a memory budget's cache bytes between the pinned hot region and the cold region when no plan
// sizes them (SparseRuntimeOptions::hot_fraction = kAutoHotFraction, `--hot-fraction auto`, the default): all pinned
// or all one LRU pool, whichever the deployment's profile (profile.gguf, the one it was packed from) says serves
// more of a token's active neurons at that size. The planner's rule for a region (planner/cost_model.h,
// PureRegionSplits) applied to the whole cache:
//   pinned: each group (layer, or expert) pins its hottest neurons, the hot clusters split evenly over the groups as
//           the runtime does (OffloadFfn::SpreadPinnedClusters); served = sum_g a_g Pop_g(h_g / n_g) / sum_g a_g,
//           with a_g the group's active neurons per token and Pop_g its held-out popularity curve;
//   LRU:    one pool of c slots shared by every group; served = the profile's shared-pool LRU curve at c / sum_g n_g
//           (decode order; profiles without it: the groups' own LRU curves, weighted as above).
// A mix serves no more than the better pure way under the cost model, and the curves measure only the pure ways
// (docs/planner.md, "Pure regions"). SYNTHETIC 7B (16 layers) at 1392M: the fixed 0.5 missed 0.078 of the active
// neurons, all LRU 0.059, all pinned 0.267 (docs/runtime.md, "Memory budget").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "packer/deployment.h"
#include "profiler/profile.h"

namespace nflash::sparse {

// SparseRuntimeOptions::hot_fraction: choose by the profile (ChooseHotSplit).
inline constexpr double kAutoHotFraction = -1.0;

struct HotSplitChoice {
  double hot_fraction = 0.5;  // 1: all pinned; 0: all LRU; 0.5: no profile to decide by
  // The share of a token's active neurons each way would serve by the profile's curves (-1: not estimated).
  double served_pinned = -1.0;
  double served_lru = -1.0;
  std::string why;  // one line for the log and --json
};

// The choice for caches of the two pure ways: `pinned_neurons[g]` neurons pinned in group g (manifest region order)
// when the cache is all pinned, `lru_slots` cold slots when it is one LRU pool. `every_neuron`: the runtime computes
// every neuron of a routed FFN (a SiLU model without a predictor), so a cache serves the share of neurons it holds and
// the profile's curves (of thresholded activity) do not apply. InvalidArgument (naming the field) when the profile
// lacks a group of the manifest or its curves.
Result<HotSplitChoice> ChooseHotSplit(const profiler::ModelProfile& profile, const packer::Manifest& manifest,
                                      const std::vector<int64_t>& pinned_neurons, int64_t lru_slots, bool every_neuron);

// The fixed kDefaultHotFraction, with `why` = `reason` and the fraction (every case where the profile cannot decide).
HotSplitChoice DefaultHotSplit(const std::string& reason);

// ChooseHotSplit with the deployment's own profile.gguf; without one (or one that is not the profile the deployment
// was packed from, or unreadable), the fixed 0.5 of kDefaultHotFraction and a `why` that says so.
HotSplitChoice AutoHotSplit(const packer::Deployment& deployment, const std::vector<int64_t>& pinned_neurons,
                            int64_t lru_slots, bool every_neuron);

}  // namespace nflash::sparse
