// Speed floors of a sparse-runtime decode run (see decode_floors.h).
#include "runtime/sparse/decode_floors.h"

#include <algorithm>

#include "planner/model_params.h"
#include "runtime/core/ggml_type.h"

namespace nflash::sparse {

planner::DecodeWork MeasuredDecodeWork(const SparseRuntime& rt, const OffloadGroupStats& stats, double steps,
                                       int threads, double token_ms) {
  const double n = std::max(steps, 1.0);
  planner::DecodeWork w;
  w.threads = threads;
  w.dense_bytes = planner::ResidentDenseWeights(rt.deployment().resident()).bytes;
  w.predictor_bytes = rt.fixed().predictor;
  // The least FFN work: a gate row per predicted neuron (none with the oracle, whose gate values are computed with
  // predictor_bytes), an up row and a down column per neuron with h != 0. The runtime computes the up row of every
  // predicted neuron unless two-phase loading skips it, so this is a lower bound in both cases.
  const packer::BundleLayout& lay = rt.deployment().layout();
  const double gate = rt.predictor() ? static_cast<double>(lay.gate_bytes) : 0.0;
  w.ffn_bytes = (static_cast<double>(stats.active) * gate +
                 static_cast<double>(stats.used) * static_cast<double>(lay.up_bytes + lay.down_bytes)) / n;
  // The reads the tokens needed: bundles read ahead that no active set used are this runtime's waste, not work the
  // model asks for, so the I/O floor leaves them out (their share of the lookahead's bytes and requests).
  const double wasted = stats.prefetched > 0 ? static_cast<double>(stats.prefetched - stats.prefetch_used) /
                                                   static_cast<double>(stats.prefetched)
                                             : 0.0;
  w.read_bytes = (static_cast<double>(stats.bytes_read) - wasted * static_cast<double>(stats.prefetch_bytes)) / n;
  w.read_requests = (static_cast<double>(stats.requests) - wasted * static_cast<double>(stats.prefetch_requests)) / n;
  w.queue_depth = rt.reader() ? static_cast<int>(rt.reader()->queue_depth()) : 1;
  w.token_ms = token_ms;
  return w;
}

Result<planner::Floors> DecodeFloors(const SparseRuntime& rt, const std::string& hw_json,
                                     const planner::DecodeWork& work) {
  const std::string type_name(GgmlTypeName(rt.deployment().layout().gate_type));
  NF_ASSIGN_OR_RETURN(planner::HardwareParams hw, planner::LoadHardwareParams(hw_json, type_name));
  auto floors = planner::ComputeFloors(hw, work);
  if (!floors.ok()) return floors.status().WithContext(hw_json);
  return floors;
}

}  // namespace nflash::sparse
