// Speed floors (planner/floors.h, docs/planner.md "Floors") of a decode run of the sparse runtime: the work per token
// from the runtime's counters, the hardware figures from hw.json for the deployment's weight type. Shared by
// `nflash offload --hw` and `nflash bench --hw`.
#pragma once

#include <string>

#include "planner/floors.h"
#include "runtime/core/status.h"
#include "runtime/sparse/sparse_runtime.h"

namespace nflash::sparse {

// The work of `steps` decode steps whose offload counters (differences over those steps) are `stats`, run with
// `threads` compute threads in `token_ms` per token on average: dense bytes from the resident model, the active-set
// source's bytes as the runtime accounts them (predictor, or the oracle's gate rows), FFN rows computed and flash traffic
// per token, the reader's queue depth.
planner::DecodeWork MeasuredDecodeWork(const SparseRuntime& rt, const OffloadGroupStats& stats, double steps,
                                       int threads, double token_ms);

// Loads `hw_json` (planner::LoadHardwareParams, for the deployment's gate type) and computes the floors of `work`.
Result<planner::Floors> DecodeFloors(const SparseRuntime& rt, const std::string& hw_json,
                                     const planner::DecodeWork& work);

}  // namespace nflash::sparse
