// `nflash plan`: the execution plan for a deployment on this machine (docs/planner.md).
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "packer/deployment.h"
#include "planner/calibration.h"
#include "planner/commands.h"
#include "planner/model_params.h"
#include "planner/plan.h"
#include "planner/z3_planner.h"
#include "profiler/profile.h"
#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/json_fields.h"
#include "runtime/core/log.h"
#include "runtime/core/subprocess.h"
#include "runtime/core/thread_pool.h"
#include "runtime/sparse/memory_budget.h"
#include "runtime/sparse/sparse_runtime.h"

namespace nflash::planner {
namespace {

struct PlanFlags {
  std::string hw;
  std::string deploy;
  std::string profile;
  std::string memory;
  int cores = 0;
  double min_speed = 0;
  std::string objective = "speed";
  int n_ctx = 0;
  std::string kv_type = "f32";
  std::string output;
  bool explain = false;
  bool force = false;
  // Calibration (docs/planner.md): measure a decode of the uncalibrated plan and re-plan with the fitted factors, or
  // reuse the factors of an earlier calibrated plan.json (same deployment and hw.json).
  bool calibrate = false;
  int calibrate_tokens = 16;
  int calibrate_warmup = 8;
  int calibrate_runs = 3;
  std::string calibration;
};

// The solver's settings and predicted breakdown into `plan`.
void FillSolution(const SolveResult& solved, const HardwareParams& hw, const ModelParams& model, Plan* plan) {
  plan->compute_threads = solved.settings.compute_threads;
  plan->io_threads = solved.settings.io_threads;
  plan->queue_depth = BurstQueueDepth(hw, model, solved.settings, solved.prediction);
  plan->cluster_neurons = solved.settings.cluster_neurons;
  plan->shared_cold_pool = solved.settings.shared_cold_pool;
  plan->regions.clear();
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    plan->regions.push_back({model.ffns[r].layer, model.ffns[r].expert, solved.settings.hot_neurons[r],
                             solved.settings.cold_slots[r]});
  }
  const Prediction& p = solved.prediction;
  plan->predicted = {p.attention_s,     p.predictor_s,       p.ffn_compute_s,   p.io_s,
                     p.io_exposed_s,    p.pipeline_s,        p.token_s,         p.tokens_per_s,
                     p.served_fraction, p.read_mb_per_token, p.reads_per_token,
                     EvaluatePrefill(hw, model, solved.settings, 128).tokens_per_s,
                     EvaluatePrefill(hw, model, solved.settings, 512).tokens_per_s, p.memory_bytes};
  plan->solve_seconds = solved.solve_seconds;
}

// Runs `nflash offload --plan plan_path --json` in a child process (its own memory budget and peak RSS; the planner's
// process holds the profile and Z3) for warmup + tokens decode tokens, --calibrate-runs times, and fits the
// calibration to the run with the median time per token (its own I/O wait with it: time and wait of one run belong
// together). One short run on a shared machine can be far off (1.6x measured); the median of 3 is much steadier.
// When the first run reads ahead (its JSON's lookahead_slots > 0), each run is followed by one with `--lookahead 0`,
// the two kinds alternating so that a drift of the machine (the host's cache, other guests) falls on both alike; the
// kind with the lower median is what the plan keeps (Plan::lookahead), and the fit uses that kind's median run.
Result<Calibration> MeasureAndFit(const PlanFlags& f, const std::string& plan_path, const HardwareParams& hw,
                                  const ModelParams& model, const PlanSettings& settings) {
  NF_ASSIGN_OR_RETURN(const std::string self, SelfExecutable());
  const std::vector<std::string> argv = {self, "-q", "offload", "-d", f.deploy, "--plan", plan_path, "--json",
                                         "-n", std::to_string(f.calibrate_warmup + f.calibrate_tokens),
                                         "--warmup", std::to_string(f.calibrate_warmup)};
  struct Run {
    CalibrationRun run;
    int64_t lookahead_slots = 0;
  };
  auto measure = [&](const std::vector<std::string>& args, const std::string& name) -> Result<Run> {
    NF_ASSIGN_OR_RETURN(const std::string out, RunCapture(args));
    const nlohmann::json j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::Internal("calibration run: `nflash offload --json` printed no JSON object");
    }
    NF_ASSIGN_OR_RETURN(const JsonFields r, JsonFields::Of(j, JsonLocation("calibration run output")));
    Run run;
    double token_ms = 0, wait_ms = 0;
    int64_t generated = 0, warmup = 0;
    NF_RETURN_IF_ERROR(r.Get("token_ms_mean", &token_ms));
    NF_RETURN_IF_ERROR(r.Get("io_wait_ms_per_token", &wait_ms));
    NF_RETURN_IF_ERROR(r.Get("generated", &generated));
    NF_RETURN_IF_ERROR(r.Get("warmup_tokens", &warmup));
    NF_RETURN_IF_ERROR(r.Get("lookahead_slots", &run.lookahead_slots));
    run.run = {token_ms * 1e-3, wait_ms * 1e-3, static_cast<int>(generated - warmup)};
    if (run.run.tokens < 2) {
      return Status::InvalidArgument("calibration run measured " + std::to_string(run.run.tokens) +
                                     " tokens (context too small, or the model stopped early): raise --ctx");
    }
    NF_LOG(Info) << "calibration run " << name << ": " << std::to_string(token_ms) << " ms/token, "
                 << std::to_string(wait_ms) << " ms waiting for I/O, "
                 << (run.lookahead_slots > 0 ? "reading ahead up to " + std::to_string(run.lookahead_slots) +
                                                   " bundles per layer"
                                             : std::string("no lookahead"));
    return run;
  };
  std::vector<std::string> argv_off = argv;
  argv_off.insert(argv_off.end(), {"--lookahead", "0"});
  std::vector<CalibrationRun> on, off;  // the plan's runs (the runtime's lookahead rule) and those without lookahead
  bool compare = false;  // decided by the first run
  for (int i = 0; i < f.calibrate_runs; ++i) {
    NF_LOG(Info) << "calibrating: run " << i + 1 << " of " << f.calibrate_runs << ", " << f.calibrate_warmup << " + "
                 << f.calibrate_tokens << " decode tokens with the uncalibrated plan"
                 << (compare ? ", then the same without lookahead" : "");
    NF_ASSIGN_OR_RETURN(const Run a, measure(argv, std::to_string(i + 1)));
    on.push_back(a.run);
    if (i == 0 && a.lookahead_slots > 0) {
      compare = true;
      NF_LOG(Info) << "the plan reads ahead (up to " << a.lookahead_slots << " bundles per layer): each run is "
                   << "followed by one with --lookahead 0, and the faster kind (median) is kept";
    }
    if (compare) {
      NF_ASSIGN_OR_RETURN(const Run b, measure(argv_off, std::to_string(i + 1) + " without lookahead"));
      off.push_back(b.run);
    }
  }
  const size_t runs = on.size();
  NF_ASSIGN_OR_RETURN(const CalibrationChoice choice, ChooseCalibrationRun(std::move(on), std::move(off)));
  NF_ASSIGN_OR_RETURN(Calibration c, FitCalibration(hw, model, settings, choice.fit.token_s, choice.fit.io_wait_s,
                                                    choice.fit.tokens));
  c.runs = static_cast<int>(runs);
  c.lookahead_on_token_s = choice.without_s > 0 ? choice.with_s : 0;
  c.lookahead_off_token_s = choice.without_s;
  return c;
}

void PrintExplain(const Plan& plan, const Prediction& p, const ModelParams& model) {
  std::printf("plan for %s: %d compute thread(s) + %d I/O thread, queue depth %d, clusters of %d neurons%s%s\n",
              plan.model_name.c_str(), plan.compute_threads, plan.io_threads, plan.queue_depth, plan.cluster_neurons,
              plan.shared_cold_pool ? "; the cold slots are one pool shared by every region" : "",
              plan.lookahead == 0 ? "; no lookahead (measured slower)" : "");
  std::printf("memory: %.1f MiB of %.1f MiB (fixed part %.1f MiB)\n", static_cast<double>(p.memory_bytes) / (1 << 20),
              static_cast<double>(plan.memory_limit_bytes) / (1 << 20),
              static_cast<double>(plan.fixed_bytes) / (1 << 20));
  std::printf("\n%-8s %8s %8s %8s %8s %10s %10s %10s %10s\n", "region", "neurons", "hot", "cold", "served",
              "compute_us", "io_us", "pipe_us", "layer_us");
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    char name[32];
    std::snprintf(name, sizeof name, model.ffns[r].expert >= 0 ? "%lld.%lld" : "%lld",
                  static_cast<long long>(model.ffns[r].layer), static_cast<long long>(model.ffns[r].expert));
    std::printf("%-8s %8lld %8lld %8lld %7.1f%% %10.1f %10.1f %10.1f %10.1f\n", name,
                static_cast<long long>(model.ffns[r].n_neurons), static_cast<long long>(plan.regions[r].hot_neurons),
                static_cast<long long>(plan.regions[r].cold_slots), p.layer_served[r] * 100,
                p.layer_compute_s[r] * 1e6, p.layer_io_s[r] * 1e6, p.layer_pipeline_s[r] * 1e6,
                p.layer_token_s[r] * 1e6);
  }
  std::printf("\nper token: attention+head %.1f us, predictor %.1f us, FFN compute %.1f us, flash I/O %.1f us "
              "(%.1f us not hidden), pipeline %.1f us\n",
              p.attention_s * 1e6, p.predictor_s * 1e6, p.ffn_compute_s * 1e6, p.io_s * 1e6, p.io_exposed_s * 1e6,
              p.pipeline_s * 1e6);
  std::printf("predicted: %.2f tok/s decode (%.2f ms/token), %.1f%% of active neurons from memory, %.2f MB and %.0f "
              "reads per token; prefill %.1f tok/s at 128 tokens, %.1f at 512\n",
              p.tokens_per_s, p.token_s * 1e3, p.served_fraction * 100, p.read_mb_per_token, p.reads_per_token,
              plan.predicted.prefill128_tokens_per_s, plan.predicted.prefill512_tokens_per_s);
}

Status RunPlan(const PlanFlags& f) {
  if (!f.force && FileExists(f.output)) return Status::InvalidArgument(f.output + " exists; pass --force to overwrite");
  UserLimits limits;
  NF_ASSIGN_OR_RETURN(limits.memory_bytes, sparse::ParseMemorySize(f.memory));
  limits.cores = f.cores;
  limits.min_tokens_per_s = f.min_speed;
  if (f.objective == "memory") {
    limits.objective = UserLimits::Objective::kMemory;
  } else if (f.objective != "speed") {
    return Status::InvalidArgument("--objective " + f.objective + ": expected speed or memory");
  }
  if (limits.objective == UserLimits::Objective::kMemory && f.min_speed <= 0) {
    return Status::InvalidArgument("--objective memory needs --min-speed (the smallest plan reaching what speed?)");
  }

  NF_ASSIGN_OR_RETURN(auto deployment, packer::Deployment::Open(f.deploy));
  const packer::Manifest& man = deployment->manifest();
  const std::string profile_path = f.profile.empty() ? f.deploy + "/" + packer::kProfileFileName : f.profile;
  if (!FileExists(profile_path)) {
    return Status::NotFound("no profile: " + profile_path + " does not exist (pass --profile, the file " + f.deploy +
                            " was packed from)");
  }
  NF_ASSIGN_OR_RETURN(profiler::ModelProfile profile, profiler::LoadProfile(profile_path));
  const std::string type_name(GgmlTypeName(deployment->layout().gate_type));
  NF_ASSIGN_OR_RETURN(const HardwareParams raw_hw, LoadHardwareParams(f.hw, type_name));
  // The fixed part exactly as the runtime counts it: open the runtime with empty caches and ask. With as many threads
  // as the plan may choose: the context's attention scratch is per thread (a plan that filled the memory to the byte
  // was refused by a 2-thread runtime for the 45 KB of its second thread's scratch).
  sparse::FixedMemory fixed;
  int64_t n_ctx = 0;
  NeuronSizes sizes;
  {
    ThreadPool pool(limits.cores > 0 ? std::min(limits.cores, raw_hw.cores) : raw_hw.cores);
    sparse::SparseRuntimeOptions ro;
    ro.n_ctx = f.n_ctx;
    NF_ASSIGN_OR_RETURN(ro.kv_type, ParseKvType(f.kv_type));
    // Without the batched-prefill buffers: under a budget the runtime lends cold-cache slots for them per prompt
    // (counting them made every limit below fixed + 2 layers infeasible although the runtime ran there).
    ro.batched_prefill = false;
    NF_ASSIGN_OR_RETURN(auto rt, sparse::SparseRuntime::Open(f.deploy, ro, &pool));
    fixed = rt->fixed();
    n_ctx = rt->context().n_ctx();
    const packer::BundleLayout& lay = rt->deployment().layout();
    sizes.cold_slot = rt->cold_slot_bytes();
    sizes.hot_slot = sparse::OffloadFfn::HotSlotBytes(rt->deployment(), 0) /
                     static_cast<uint64_t>(std::max<int64_t>(1, rt->ffn().hot_cluster_neurons()));
    sizes.read = lay.slots_per_group == 1 ? rt->cold_slot_bytes() : lay.group_bytes;
  }
  NF_ASSIGN_OR_RETURN(ModelParams model,
                      ModelParamsFromDeployment(*deployment, profile, profile_path, fixed.Total(), sizes));
  NF_ASSIGN_OR_RETURN(uint64_t deploy_hash, HashFile(f.deploy + "/" + packer::kManifestFileName));
  NF_ASSIGN_OR_RETURN(uint64_t hw_hash, HashFile(f.hw));
  Calibration calibration;
  if (!f.calibration.empty()) {
    NF_ASSIGN_OR_RETURN(const Plan other, LoadPlan(f.calibration));
    if (!other.calibration.present()) {
      return Status::InvalidArgument("--calibration " + f.calibration + ": the plan has no 'calibration' (make it with "
                                     "--calibrate)");
    }
    if (other.deployment_hash != HashToHex(deploy_hash) || other.hardware_hash != HashToHex(hw_hash)) {
      return Status::InvalidArgument("--calibration " + f.calibration + " was measured for deployment " +
                                     other.deployment_hash + " / hw.json " + other.hardware_hash + ", these are " +
                                     HashToHex(deploy_hash) + " / " + HashToHex(hw_hash));
    }
    calibration = other.calibration;
  }
  HardwareParams hw = calibration.present() ? Calibrated(raw_hw, calibration) : raw_hw;

  NF_ASSIGN_OR_RETURN(SolveResult solved, SolvePlan(hw, model, limits));
  if (!solved.feasible) {
    // A limit the user set cannot be met: a usage-class error (exit 2) with Z3's explanation, and the context the KV
    // cache was sized for when that cache alone is more than a quarter of the limit (a plan without --ctx sizes it for
    // the model's whole context).
    std::string hint;
    if (fixed.kv_cache * 4 > limits.memory_bytes) {
      hint = "; the KV cache is sized for a context of " + std::to_string(n_ctx) + " tokens" +
             (f.n_ctx > 0 ? "" : " (the model's)") + ": --ctx N sizes it for fewer" +
             (f.kv_type == "f16" ? "" : ", --kv-type f16 halves it");
    }
    return Status::InvalidArgument(solved.message + " (fixed part: " + fixed.Describe() + ")" + hint);
  }
  Plan plan;
  plan.deployment_hash = HashToHex(deploy_hash);
  plan.hardware_hash = HashToHex(hw_hash);
  plan.model_name = man.model_name;
  plan.memory_limit_bytes = limits.memory_bytes;
  plan.cores = limits.cores;
  plan.min_tokens_per_s = limits.min_tokens_per_s;
  plan.objective = f.objective;
  plan.fixed_bytes = fixed.Total();
  plan.n_ctx = static_cast<int>(n_ctx);
  plan.kv_type = f.kv_type;
  FillSolution(solved, hw, model, &plan);
  plan.calibration = calibration;
  plan.lookahead = ChosenLookahead(calibration);  // -1 without a calibration
  if (f.calibrate) {
    // Measure the plan just made, fit, and plan again with the calibrated figures.
    const std::string probe = f.output + ".calibrate.tmp";
    NF_RETURN_IF_ERROR(SavePlan(plan, probe, /*overwrite=*/true));
    Result<Calibration> fitted = MeasureAndFit(f, probe, raw_hw, model, solved.settings);
    std::remove(probe.c_str());
    NF_RETURN_IF_ERROR(fitted.status());
    calibration = *fitted;
    calibration.memory_bytes = limits.memory_bytes;
    NF_LOG(Info) << "calibration: measured " << calibration.measured_token_s * 1e3 << " ms/token ("
                 << calibration.measured_io_wait_s * 1e3 << " ms waiting for I/O) against "
                 << calibration.uncalibrated_token_s * 1e3 << " ms predicted: compute x" << calibration.compute_scale
                 << ", I/O x" << calibration.io_scale;
    hw = Calibrated(raw_hw, calibration);
    const double first_solve = solved.solve_seconds;
    NF_ASSIGN_OR_RETURN(solved, SolvePlan(hw, model, limits));
    if (!solved.feasible) {
      return Status::InvalidArgument("after calibration: " + solved.message + " (fixed part: " + fixed.Describe() + ")");
    }
    FillSolution(solved, hw, model, &plan);
    plan.solve_seconds += first_solve;
    plan.calibration = calibration;
    plan.lookahead = ChosenLookahead(calibration);
    if (calibration.lookahead_compared()) {
      NF_LOG(Info) << "lookahead: " << calibration.lookahead_on_token_s * 1e3 << " ms/token with the runtime's rule, "
                   << calibration.lookahead_off_token_s * 1e3 << " without (medians of " << calibration.runs
                   << " runs each): the plan keeps it " << (plan.lookahead == 0 ? "off" : "to the runtime's rule");
    }
  }
  NF_RETURN_IF_ERROR(SavePlan(plan, f.output, f.force));
  const Prediction& p = solved.prediction;
  if (f.explain) PrintExplain(plan, p, model);
  NF_LOG(Info) << "wrote " << f.output << ": predicted " << p.tokens_per_s << " tok/s in "
               << sparse::FormatBytes(p.memory_bytes) << " (ranked " << solved.candidates << " knob combinations, solved " << solved.solved << " in "
               << solved.solve_seconds << " s)";
  return Status::Ok();
}

}  // namespace

void RegisterPlanCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand("plan", "Choose the execution plan for a deployment on this machine (Z3 cost model)");
  cmd->add_option("--hw", flags->hw, "Hardware profile from `nflash profile-hw`")->required();
  cmd->add_option("--deploy", flags->deploy, "Deployment directory from `nflash pack`")->required();
  cmd->add_option("--profile", flags->profile,
                  "Model profile the deployment was packed from (default: the copy inside the deployment)");
  cmd->add_option("--memory", flags->memory, "Memory limit for everything the runtime holds, e.g. 1.5G")->required();
  cmd->add_option("--cores", flags->cores, "Cores the runtime may use (default: all)");
  cmd->add_option("--min-speed", flags->min_speed, "Minimum decode speed, tokens/s");
  cmd->add_option("--objective", flags->objective, "speed (fastest plan within the memory) or memory (smallest plan "
                                                   "reaching --min-speed)");
  cmd->add_option("--ctx", flags->n_ctx, "Context length the KV cache is sized for (default: the runtime's)");
  cli::AddKvTypeOption(cmd, &flags->kv_type, "KV cache element type the plan sizes and the runtime then uses")
      ->capture_default_str();
  cmd->add_option("-o,--output", flags->output, "plan.json to write")->required();
  cmd->add_flag("--explain", flags->explain, "Print the per-token time breakdown as a table");
  cmd->add_flag("--force", flags->force, "Overwrite the output if it exists");
  CLI::Option* calibrate = cmd->add_flag("--calibrate", flags->calibrate,
                "Run the plan (`nflash offload`, a few seconds), fit the cost model's compute and I/O factors to the "
                "measured decode and plan again with them (recorded in plan.json)");
  // Without --calibrate these would be ignored: CLI11 refuses them (a usage error naming --calibrate).
  cmd->add_option("--calibrate-tokens", flags->calibrate_tokens, "Measured decode tokens of --calibrate")
      ->check(cli::kPositive)
      ->capture_default_str()
      ->needs(calibrate);
  cmd->add_option("--calibrate-warmup", flags->calibrate_warmup, "Warm-up tokens of --calibrate (not measured)")
      ->check(cli::kNonNegative)
      ->capture_default_str()
      ->needs(calibrate);
  cmd->add_option("--calibrate-runs", flags->calibrate_runs,
                  "Runs of --calibrate; the fit uses the one with the median time per token")
      ->check(cli::kPositive)
      ->capture_default_str()
      ->needs(calibrate);
  cmd->add_option("--calibration", flags->calibration,
                  "Reuse the calibration recorded in this plan.json (made with --calibrate for the same deployment "
                  "and hw.json, e.g. at another memory limit)")
      ->check(CLI::ExistingFile)
      ->excludes("--calibrate");
  cmd->callback([flags, action] { *action = [flags] { return RunPlan(*flags); }; });
}

}  // namespace nflash::planner
