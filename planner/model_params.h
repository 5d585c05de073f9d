// The planner's inputs from the pipeline's files: ModelParams from a deployment (packer) and the profile it was packed
// from (profiler), HardwareParams from hw.json (profile-hw). Every figure is read, none assumed, except the few
// constants documented in docs/planner.md.
#pragma once

#include <string>

#include "packer/deployment.h"
#include "planner/cost_model.h"
#include "profiler/profile.h"
#include "runtime/core/status.h"

namespace nflash::planner {

// The runtime's per-neuron sizes (SparseRuntime::cold_slot_bytes, OffloadFfn::HotSlotBytes / its cluster).
struct NeuronSizes {
  uint64_t cold_slot = 0;  // a cold slot
  uint64_t hot_slot = 0;   // a neuron's share of a hot cluster slot (whole flash groups)
  uint64_t read = 0;       // bytes a cold miss reads
};

// A profile curve's points y_i at x = i / (points - 1), clamped to [0, 1].
Curve CurveFrom(const std::vector<float>& y);

// The popularity curve a region is planned with: the profile's held-out curve when it has one (what pinning the
// hottest neurons serves on tokens the profile did not see), else its in-sample curve; x = i / (points - 1).
Curve PlanningPopularity(const profiler::FfnProfile& fp);

// `n_ctx`: the context length the KV cache is sized for (<= 0: the model's). `fixed_bytes`: resident image + KV
// cache + scratch as the runtime counts them, and `sizes` what one neuron takes in the runtime's cache and what a
// miss reads (the caller passes the runtime's figures so both agree).
// InvalidArgument when the profile is not the one the deployment was packed from (hash) or their shapes differ.
Result<ModelParams> ModelParamsFromDeployment(const packer::Deployment& deployment, const profiler::ModelProfile& profile,
                                              const std::string& profile_path, uint64_t fixed_bytes,
                                              const NeuronSizes& sizes);

// hw.json (docs/hw-profile.md) for the model's weight type `type_name` (e.g. "q4_0"): GEMV and sparse-FFN throughput
// per thread count, memory bandwidth, random reads by size and queue depth, sequential reads, GEMM throughput.
Result<HardwareParams> LoadHardwareParams(const std::string& hw_json_path, const std::string& type_name);

}  // namespace nflash::planner
