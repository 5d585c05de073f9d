// Cost-model calibration from a measured decode (see calibration.h).
#include "planner/calibration.h"

#include <algorithm>
#include <cmath>

namespace nflash::planner {

namespace {

// Factors outside this range mean the run measured something else than the plan (a broken deployment, a clock
// problem): refused rather than fitted. Wide on purpose: hw.json's kernel figures come from 4096-wide matrices, and a
// tiny model (stories260K: dim 64) runs its per-token work ~10-15x faster than they predict (measured 0.07-0.09).
constexpr double kMinScale = 1e-3;
constexpr double kMaxScale = 1e3;

}  // namespace

HardwareParams Calibrated(const HardwareParams& hw, const Calibration& c) {
  HardwareParams out = hw;
  for (double& g : out.dense_gemv_gbs) g /= c.compute_scale;
  for (double& g : out.sparse_ffn_gbs) g /= c.compute_scale;
  out.submit_us_per_request *= c.compute_scale;
  out.cluster_sync_us *= c.compute_scale;
  for (IoPoint& p : out.random_reads) {
    p.mb_per_s /= c.io_scale;
    p.mean_latency_us *= c.io_scale;
  }
  return out;
}

Result<Calibration> FitCalibration(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings,
                                   double token_s, double io_wait_s, int tokens) {
  if (!(token_s > 0) || !(io_wait_s >= 0) || io_wait_s >= token_s || tokens <= 0) {
    return Status::InvalidArgument("calibration run: time per token " + std::to_string(token_s) + " s, I/O wait " +
                                   std::to_string(io_wait_s) + " s over " + std::to_string(tokens) +
                                   " tokens: expected 0 <= wait < time and tokens > 0");
  }
  Calibration c;
  c.measured_token_s = token_s;
  c.measured_io_wait_s = io_wait_s;
  c.tokens = tokens;
  const Prediction raw = Evaluate(hw, model, settings);
  c.uncalibrated_token_s = raw.token_s;
  const double compute_side = raw.attention_s + raw.predictor_s + raw.ffn_compute_s + raw.pipeline_s;
  if (!(compute_side > 0)) return Status::InvalidArgument("calibration: the plan has no compute-side time to scale");
  c.compute_scale = (token_s - io_wait_s) / compute_side;
  if (c.compute_scale < kMinScale || c.compute_scale > kMaxScale) {
    return Status::InvalidArgument("calibration: compute factor " + std::to_string(c.compute_scale) +
                                   " (measured " + std::to_string((token_s - io_wait_s) * 1e3) + " ms of compute per "
                                   "token against " + std::to_string(compute_side * 1e3) + " ms predicted) is outside [" +
                                   std::to_string(kMinScale) + ", " + std::to_string(kMaxScale) + "]");
  }
  if (raw.io_s <= 0) return c;  // nothing read: the run says nothing about the disk
  // Predicted time grows with io_scale (reads slower, latency longer): bisection in log space for T.
  auto predicted = [&](double io) {
    Calibration t = c;
    t.io_scale = io;
    return Evaluate(Calibrated(hw, t), model, settings).token_s;
  };
  double lo = kMinScale, hi = kMaxScale;
  if (predicted(lo) >= token_s) {
    c.io_scale = lo;
  } else if (predicted(hi) <= token_s) {
    c.io_scale = hi;
  } else {
    for (int i = 0; i < 60; ++i) {
      const double mid = std::sqrt(lo * hi);
      (predicted(mid) < token_s ? lo : hi) = mid;
    }
    c.io_scale = std::sqrt(lo * hi);
  }
  return c;
}

Result<CalibrationChoice> ChooseCalibrationRun(std::vector<CalibrationRun> with, std::vector<CalibrationRun> without) {
  if (with.empty()) return Status::InvalidArgument("calibration: no measured run");
  auto median = [](std::vector<CalibrationRun>& runs) {
    std::sort(runs.begin(), runs.end(),
              [](const CalibrationRun& a, const CalibrationRun& b) { return a.token_s < b.token_s; });
    return runs[(runs.size() - 1) / 2];
  };
  CalibrationChoice choice;
  choice.fit = median(with);
  choice.with_s = choice.fit.token_s;
  if (!without.empty()) {
    const CalibrationRun off = median(without);
    choice.without_s = off.token_s;
    if (off.token_s < choice.with_s) {
      choice.fit = off;
      choice.lookahead = 0;
    }
  }
  return choice;
}

int64_t ChosenLookahead(const Calibration& c) {
  return c.lookahead_compared() && c.lookahead_off_token_s < c.lookahead_on_token_s ? 0 : -1;
}

}  // namespace nflash::planner
