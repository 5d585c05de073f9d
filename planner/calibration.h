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

#include <cstdint>
#include <string>
#include <vector>

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

// One measured calibration run: mean time and I/O wait per decode token, and the tokens measured.
struct CalibrationRun {
  double token_s = 0;
  double io_wait_s = 0;
  int tokens = 0;
};

// What `plan --calibrate` fits to and keeps, from the runs of the plan as made (`with`: the runtime's own lookahead
// rule) and, when the lookahead was compared, the runs with `--lookahead 0` (`without`; empty otherwise): each kind's
// median run (the lower middle of an even count); the kind with the lower median is kept (a tie keeps the rule).
struct CalibrationChoice {
  CalibrationRun fit;      // the kept kind's median run
  int64_t lookahead = -1;  // Plan::lookahead: 0 when the runs without it were faster, else -1
  double with_s = 0;       // the medians of both kinds (without_s: 0 when not compared)
  double without_s = 0;
};
// InvalidArgument when `with` is empty.
Result<CalibrationChoice> ChooseCalibrationRun(std::vector<CalibrationRun> with, std::vector<CalibrationRun> without);

// The lookahead a recorded calibration chose (Plan::lookahead): 0 when both medians were measured and the one without
// was lower, else -1 (also for no calibration at all).
int64_t ChosenLookahead(const Calibration& c);

}  // namespace nflash::planner
