// Calibration of the cost model from a measured decode of the deployment (`nflash plan --calibrate`): the kernel and
// read figures of hw.json describe the kernels alone; a real decode step also spends time in attention over the KV
// cache, norms, thread hand-offs, checksums and request bookkeeping, and the disk behaves differently under the
// runtime's access pattern. Two factors, fitted to one measured run of a plan, scale the hardware figures the cost
// model uses (docs/planner.md, "Calibration"):
//   compute_scale = (T - W) / C   T: measured time per token, W: measured I/O wait per token (the compute thread
//                                 blocked on reads), C: the model's compute-side terms for that plan (attention +
//                                 predictor + FFN compute + pipeline) with the raw figures;
//   io_scale                      the factor on read time (throughput divided, latency multiplied) at which the
//                                 model, with compute_scale applied, predicts T for that plan (bisection; 1 when the
//                                 plan reads nothing).
#pragma once

#include <string>

#include "planner/cost_model.h"
#include "planner/plan.h"

namespace nflash::planner {


// `hw` with the factors applied: GEMV and sparse-FFN throughput divided by compute_scale, submission and cluster
// hand-off costs multiplied by it; random-read throughput divided by io_scale and latency multiplied by it. Prefill figures (GEMM, sequential
// reads) are left as measured.
HardwareParams Calibrated(const HardwareParams& hw, const Calibration& c);

// Fits the two factors to a run of `settings` that took `token_s` per token, `io_wait_s` of it waiting for reads.
// InvalidArgument for a run that cannot be fitted (non-positive time, wait larger than the time).
Result<Calibration> FitCalibration(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings,
                                   double token_s, double io_wait_s, int tokens);

}  // namespace nflash::planner
