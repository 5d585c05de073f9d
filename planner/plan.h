// plan.json: the execution plan `nflash plan` writes and the sparse runtime follows (docs/planner.md, "plan.json").
// This file has no solver dependency so that the runtime can read plans without linking Z3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core/status.h"

namespace nflash::planner {

// Major version of plan.json; readers reject any other.
inline constexpr int kPlanSchemaVersion = 1;

struct RegionPlan {
  int64_t layer = 0;
  int64_t expert = -1;      // -1: a dense FFN
  int64_t hot_neurons = 0;  // the first hot_neurons slots of the region (the packer put the hottest first)
  int64_t cold_slots = 0;   // LRU cold-cache capacity, in neurons
};

// The predicted per-token breakdown (seconds) the plan was chosen for.
struct PlanPrediction {
  double attention_s = 0, predictor_s = 0, ffn_compute_s = 0, io_s = 0, io_exposed_s = 0, pipeline_s = 0;
  double token_s = 0, tokens_per_s = 0;
  double served_fraction = 0, read_mb_per_token = 0, reads_per_token = 0;
  double prefill128_tokens_per_s = 0, prefill512_tokens_per_s = 0;
  uint64_t memory_bytes = 0;
};

// The cost model's calibration from a measured decode (planner/calibration.h; absent: tokens == 0).
struct Calibration {
  double compute_scale = 1.0;
  double io_scale = 1.0;
  // What it was fitted to (reported in plan.json).
  double measured_token_s = 0;     // mean time per decode token of the measured run
  double measured_io_wait_s = 0;   // mean I/O wait per token of that run
  double uncalibrated_token_s = 0; // the model's prediction for that run's plan with the raw figures
  int tokens = 0;                  // measured tokens (after warm-up)
  int runs = 1;                    // runs made; the fit uses the one with the median time per token
  uint64_t memory_bytes = 0;       // the memory limit of the measured plan
  // The lookahead, timed both ways (runs alternating, the same count each): the median time per token with the
  // runtime's own lookahead rule and with none. 0: not compared (the run had no lookahead to turn off).
  double lookahead_on_token_s = 0;
  double lookahead_off_token_s = 0;
  bool present() const { return tokens > 0; }
  bool lookahead_compared() const { return lookahead_on_token_s > 0 && lookahead_off_token_s > 0; }
};

struct Plan {
  int schema_version = kPlanSchemaVersion;
  std::string deployment_hash;  // HashToHex(HashFile(DEPLOY_DIR/manifest.json)): the deployment it was made for
  std::string hardware_hash;    // HashToHex(HashFile(hw.json))
  std::string model_name;
  // User limits it was solved under.
  uint64_t memory_limit_bytes = 0;
  int cores = 0;
  double min_tokens_per_s = 0;
  std::string objective;  // "speed" or "memory"
  // Settings.
  uint64_t fixed_bytes = 0;  // resident image + KV cache + scratch, as the planner counted them
  int n_ctx = 0;             // context length the KV cache was sized for
  std::string kv_type = "f32";  // and its element type (KvTypeName); plans without the field are f32
  int compute_threads = 1;
  int io_threads = 1;
  int queue_depth = 32;
  int cluster_neurons = 32;
  // true: the regions' cold slots form one LRU pool every layer and expert competes for (the runtime's
  // --cold-pool shared) instead of a partition each; their split over the regions is then only indicative. Plans
  // without the field: false.
  bool shared_cold_pool = false;
  // The cross-layer lookahead, as the runtime's --lookahead: -1 the runtime's own rule (AutoLookahead), 0 off, N up
  // to N bundles read ahead per layer. `plan --calibrate` times the rule against none and keeps the faster (the
  // lookahead's CPU and extra reads cost more than the wait it hides where reads are fast; docs/results.md). Plans
  // without the field: -1.
  int64_t lookahead = -1;
  std::vector<RegionPlan> regions;  // layer-major, experts in order (the manifest's order)
  PlanPrediction predicted;
  Calibration calibration;  // optional in plan.json ("calibration")
  double solve_seconds = 0;
};

std::string PlanToJson(const Plan& plan);
// Validates field presence and types and the schema version; `source` names the file in errors.
Result<Plan> ParsePlan(const std::string& json_text, const std::string& source);
Result<Plan> LoadPlan(const std::string& path);
Status SavePlan(const Plan& plan, const std::string& path, bool overwrite);
// InvalidArgument naming both hashes when the plan was made for another deployment (manifest.json hash).
Status CheckPlanForDeployment(const Plan& plan, const std::string& deploy_dir);

}  // namespace nflash::planner
