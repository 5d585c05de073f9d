// Z3 encoding of the cost model (docs/planner.md, "Solver"). Times are in microseconds and memory in MiB inside the
// solver so that every coefficient is a modest rational.
#include "planner/z3_planner.h"

#include <z3++.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "runtime/core/log.h"
#include "runtime/sparse/memory_budget.h"

namespace nflash::planner {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// A double as an exact Z3 rational (1e-9 resolution: times are microseconds and sizes MiB, so far below any effect).
z3::expr Real(z3::context& ctx, double v) {
  // z3::context::real_val(int, int) takes 32-bit ints; the numeral string form has no such limit.
  const auto scaled = static_cast<long long>(std::llround(v * 1e9));
  return ctx.real_val((std::to_string(scaled) + "/1000000000").c_str());
}

// A model coefficient (curve segment, time per region) as a rational of 7 significant digits: a relative
// error below 1e-6, far below the figures' own accuracy, and small numerators and denominators, which keep Z3's exact
// simplex fast (pivoting multiplies them). SYNTHETIC 2-layer mixtral-8x7b shape (16 regions): the plan solved in 16 s
// instead of 31 s, with the same prediction. Memory terms and limits stay exact (Real): a plan must not exceed them.
z3::expr Coef(z3::context& ctx, double v) {
  if (v == 0 || !std::isfinite(v)) return Real(ctx, v);
  const int digits = 7;
  const int e = digits - 1 - static_cast<int>(std::floor(std::log10(std::fabs(v))));
  if (e < 0 || e > 18) return Real(ctx, v);
  const auto m = static_cast<long long>(std::llround(v * std::pow(10.0, e)));
  return ctx.real_val((std::to_string(m) + "/1" + std::string(static_cast<size_t>(e), '0')).c_str());
}

double Value(const z3::model& m, const z3::expr& e) {
  z3::expr v = m.eval(e, true);
  std::string s = v.get_decimal_string(12);
  if (!s.empty() && s.back() == '?') s.pop_back();
  return std::strtod(s.c_str(), nullptr);
}

// The discrete knobs of one linear program: the solver enumerates them (at most cores x queue depths x cluster sizes
// combinations, fewer after dominance pruning) and, for each, Z3 solves the continuous allocation exactly.
struct Knobs {
  int threads = 1;
  int queue_depth = 1;
  int cluster = 32;
};

// The decision variables and derived terms of one formulation (all linear once the knobs are fixed).
struct Encoding {
  std::vector<z3::expr> hot, cold;  // fractions of each region
  z3::expr token_us;
  z3::expr memory_mib;
  explicit Encoding(z3::context& ctx) : token_us(ctx), memory_mib(ctx) {}
};

double Gbs(const std::vector<double>& v, int threads) {
  return v.at(std::min<size_t>(static_cast<size_t>(threads) - 1, v.size() - 1)) * 1e9;
}

// Hull lines per curve in the linear program: measured curves have ~30 hull edges; with all of them a 32-layer solve
// took 20.9 s (2-core machine, loaded), with 12 3.6 s; on the SYNTHETIC 16-layer 7B deployment the plans' predicted
// speed moved by <= 0.7% (the plan's prediction uses the full curves anyway: Evaluate).
constexpr size_t kMaxCurveSegments = 12;
// Z3's exact simplex slows down about quadratically in the LP's rows, and each region adds 3 curves' lines: the lines
// per curve shrink with the regions so that they total about kCurveLineBudget, never below kMinCurveSegments.
// SYNTHETIC mixtral-8x7b shape: 16 regions keep 12 (20 s); 32 regions take 6: 33 s instead of 194 s (the latter before
// the coefficient rounding above), predicted speed 33.45 against 33.74 tok/s (-0.8%; the plan's prediction is
// Evaluate on the full curves).
constexpr size_t kCurveLineBudget = 192;
constexpr size_t kMinCurveSegments = 4;
size_t CurveSegments(size_t regions) {
  return std::clamp<size_t>(kCurveLineBudget / std::max<size_t>(regions, 1), kMinCurveSegments, kMaxCurveSegments);
}

// Adds the model's constraints for fixed `knobs` to `add` (a solver or an optimizer) and returns the encoding.
template <typename Sink>
Encoding Encode(z3::context& ctx, Sink& add, const HardwareParams& hw, const ModelParams& model, const Knobs& knobs) {
  Encoding e(ctx);
  const int t = knobs.threads;
  const double dense_us =
      static_cast<double>(model.dense_bytes_per_token + model.predictor_bytes) / Gbs(hw.dense_gemv_gbs, t) * 1e6;
  z3::expr token = Coef(ctx, dense_us);
  z3::expr memory = Real(ctx, static_cast<double>(model.fixed_bytes) / kMiB);
  const bool io_shares_cores = t + 1 > hw.cores;
  const size_t segments = CurveSegments(model.ffns.size());
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    const std::string id = std::to_string(r);
    z3::expr h = ctx.real_const(("hot_" + id).c_str());
    z3::expr c = ctx.real_const(("cold_" + id).c_str());
    z3::expr served = ctx.real_const(("served_" + id).c_str());
    z3::expr p_h = ctx.real_const(("pop_hot_" + id).c_str());
    z3::expr h_c = ctx.real_const(("lru_cold_" + id).c_str());
    add.add(h >= 0 && c >= 0 && h + c <= 1 && served >= 0 && served <= 1);
    for (const auto& [slope, icpt] : UpperEnvelope(f.popularity, f.lru_hit).ConcaveSegments(segments)) {
      add.add(served <= Coef(ctx, slope) * (h + c) + Coef(ctx, icpt));  // served <= max(P, H)(h + c)
    }
    for (const auto& [slope, icpt] : f.popularity.ConcaveSegments(segments)) {
      add.add(p_h <= Coef(ctx, slope) * h + Coef(ctx, icpt));  // p_h <= P(h)
    }
    for (const auto& [slope, icpt] : f.lru_hit.ConcaveSegments(segments)) add.add(h_c <= Coef(ctx, slope) * c + Coef(ctx, icpt));
    add.add(served <= p_h + h_c);
    e.hot.push_back(h);
    e.cold.push_back(c);

    const double n = static_cast<double>(f.n_neurons);
    const double active = f.route_fraction * f.active_fraction * n;  // A
    const z3::expr miss_share = 1 - served;                           // M = A (1 - served)
    const double bw = hw.ReadMbps(f.read_bytes, knobs.queue_depth) * 1e6;
    const double us_per_miss = bw > 0 ? static_cast<double>(f.read_bytes) / bw * 1e6 : 1e9;
    z3::expr compute = Coef(ctx, active * static_cast<double>(f.ComputeBytes()) / Gbs(hw.sparse_ffn_gbs, t) * 1e6);
    if (io_shares_cores) compute = compute + miss_share * Coef(ctx, active * hw.submit_us_per_request / t);
    const z3::expr io = miss_share * Coef(ctx, active * us_per_miss);
    // Cluster hand-offs, plus the first cluster's reads (one latency, then its bytes), which nothing hides.
    const double latency_us = hw.ReadLatencyUs(f.read_bytes, knobs.queue_depth);
    const z3::expr pipeline = Coef(ctx, active / knobs.cluster * hw.cluster_sync_us / t) +
                              miss_share * Coef(ctx, f.Runs() * (latency_us + knobs.cluster * us_per_miss));
    z3::expr layer = ctx.real_const(("layer_us_" + id).c_str());
    add.add(layer >= compute + pipeline);
    add.add(layer >= io + pipeline);
    token = token + layer;
    memory = memory + h * Real(ctx, n * static_cast<double>(f.HotSlotBytes()) / kMiB) +
             c * Real(ctx, n * static_cast<double>(f.slot_bytes) / kMiB);
  }
  e.token_us = token;
  e.memory_mib = memory;
  return e;
}

// Every knob combination worth solving: a queue depth is dropped when another depth reads at least as fast with no
// more latency for every region (strictly better somewhere, or equal and smaller): it lowers or keeps every term
// they enter, so the dropped depth can never win.
std::vector<Knobs> Candidates(const HardwareParams& hw, const ModelParams& model, int max_threads) {
  std::vector<int> depths;
  for (size_t i = 0; i < kQueueDepthChoices.size(); ++i) {
    bool dominated = false;
    for (size_t j = 0; j < kQueueDepthChoices.size() && !dominated; ++j) {
      if (j == i) continue;
      bool no_worse = true, better = false;
      for (const FfnParams& f : model.ffns) {
        const double a = hw.ReadMbps(f.read_bytes, kQueueDepthChoices[i]);
        const double b = hw.ReadMbps(f.read_bytes, kQueueDepthChoices[j]);
        const double la = hw.ReadLatencyUs(f.read_bytes, kQueueDepthChoices[i]);
        const double lb = hw.ReadLatencyUs(f.read_bytes, kQueueDepthChoices[j]);
        no_worse = no_worse && b >= a && lb <= la;
        better = better || b > a || lb < la;
      }
      dominated = no_worse && (better || j < i);
    }
    if (!dominated) depths.push_back(kQueueDepthChoices[i]);
  }
  std::vector<Knobs> out;
  for (int t = 1; t <= max_threads; ++t) {
    for (int k : kClusterChoices) {
      for (int q : depths) out.push_back(Knobs{t, q, k});
    }
  }
  return out;
}

// Whole neurons from the solver's fractions. A value within 1e-6 of an integer is that integer (the rational optimum
// printed to 12 digits); otherwise rounded down (`round_up` false: the plan never exceeds the memory the solver
// allowed) or up (true: the plan never falls below the speed it was solved for). Hot first, then hot + cold.
PlanSettings Extract(const z3::model& m, const Encoding& e, const ModelParams& model, const Knobs& knobs,
                     bool round_up) {
  PlanSettings s;
  s.compute_threads = knobs.threads;
  s.queue_depth = knobs.queue_depth;
  s.cluster_neurons = knobs.cluster;
  auto count = [round_up](double v) {
    const double r = std::round(v);
    if (std::abs(v - r) < 1e-6) return static_cast<int64_t>(r);
    return static_cast<int64_t>(round_up ? std::ceil(v) : std::floor(v));
  };
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const int64_t n = model.ffns[r].n_neurons;
    const double h = Value(m, e.hot[r]), c = Value(m, e.cold[r]);
    const int64_t hot = std::clamp<int64_t>(count(h * static_cast<double>(n)), 0, n);
    const int64_t held = std::clamp<int64_t>(count((h + c) * static_cast<double>(n)), hot, n);
    s.hot_neurons.push_back(hot);
    s.cold_slots.push_back(held - hot);
  }
  return s;
}

// One optimisation for fixed knobs: `primary` minimised first, then `secondary` among its optima. Returns false when
// the constraints are infeasible for these knobs.
struct Optimum {
  double token_us = 0, memory_mib = 0;
  PlanSettings settings;
};

enum class Goal { kSpeed, kMemory };

bool Optimise(const HardwareParams& hw, const ModelParams& model, const Knobs& knobs, double mem_mib,
              double max_token_us, Goal goal, Optimum* out) {
  z3::context ctx;
  z3::optimize opt(ctx);
  Encoding e = Encode(ctx, opt, hw, model, knobs);
  if (mem_mib > 0) opt.add(e.memory_mib <= Real(ctx, mem_mib));
  if (max_token_us > 0) opt.add(e.token_us <= Real(ctx, max_token_us));
  // Last, among equal plans, neurons in the hot region rather than the cold cache: hot clusters are read as large
  // sequential runs and need no per-neuron LRU bookkeeping.
  z3::expr hot_total = Real(ctx, 0);
  for (const z3::expr& h : e.hot) hot_total = hot_total + h;
  // One weighted objective instead of three lexicographic ones (each of which re-solved the LP: 3x the time). Z3's
  // arithmetic is exact, so the weights only break ties: the secondary term (MiB or us, <= ~1e5) times 1e-7 is
  // worth < 0.01 us or MiB of the primary one, and the hot fractions (<= the number of regions) times 1e-10 less still.
  const z3::expr primary = goal == Goal::kMemory ? e.memory_mib : e.token_us;
  const z3::expr secondary = goal == Goal::kMemory ? e.token_us : e.memory_mib;
  opt.minimize(primary + ctx.real_val("1/10000000") * secondary - ctx.real_val("1/10000000000") * hot_total);
  if (opt.check() != z3::sat) return false;
  const z3::model m = opt.get_model();
  out->token_us = Value(m, e.token_us);
  out->memory_mib = Value(m, e.memory_mib);
  out->settings = Extract(m, e, model, knobs, /*round_up=*/goal == Goal::kMemory);
  // Rounding up may not cross the memory limit: then down.
  if (goal == Goal::kMemory && mem_mib > 0 &&
      static_cast<double>(Evaluate(hw, model, out->settings).memory_bytes) > mem_mib * kMiB) {
    out->settings = Extract(m, e, model, knobs, /*round_up=*/false);
  }
  return true;
}

// Knob combinations solved exactly per OptimiseAll call, besides the reference: enough that the exhaustive-grid test
// finds the optimum among them; each Z3 solve of a 16-layer model with measured curves takes ~0.5-1 s.
constexpr size_t kExactCandidates = 6;
// Fewer for models with many regions, whose solves take tens of seconds each: 6 x 32 / regions, at least 2. Where
// the winner ranked (session 18, 2 vCPUs): the reference itself (SYNTHETIC 4-layer mixtral shape, 32 regions), the
// first (16-layer 7B), the fifth, 0.3% ahead of the second and the reference (2-layer mixtral shape, 16 regions).
// A 128-region model then solves 3 times instead of 7 (~40 s each).
size_t ExactCandidates(size_t regions) {
  return std::clamp<size_t>(kExactCandidates * 32 / std::max<size_t>(regions, 1), 2, kExactCandidates);
}

// The best optimum over the knob combinations (ties: the first, i.e. fewer threads, smaller depth and cluster).
// Solving every combination exactly took 46 s for a 16-layer model with measured curves (58 combinations); the
// allocation that is best for one combination is close to the best for the others (memory, not the knobs, decides how
// many neurons fit), so: one reference combination (the most threads, the deepest queue, a middle cluster) is solved,
// every combination is ranked by the cost model (Evaluate) at the reference's allocation, and the kExactCandidates
// best-ranked are solved exactly. `solved` counts the Z3 solves.
// Exact solves slower than this are logged (progress on large models).
constexpr double kSolveLogSeconds = 5.0;

bool OptimiseAll(const HardwareParams& hw, const ModelParams& model, const std::vector<Knobs>& candidates,
                 double mem_mib, double max_token_us, Goal goal, Optimum* best, int* solved = nullptr) {
  bool found = false;
  // Optimise, logged when slow (progress on large models: a 128-region MoE takes ~40 s per solve on 2 cores).
  auto timed = [&](const Knobs& k, const std::string& what, Optimum* out) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = Optimise(hw, model, k, mem_mib, max_token_us, goal, out);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (seconds > kSolveLogSeconds) {
      NF_LOG(Info) << "plan: " << what << " (" << k.threads << " thread(s), queue depth " << k.queue_depth
                   << ", clusters of " << k.cluster << ") solved in " << seconds << " s";
    }
    return ok;
  };
  std::vector<Knobs> exact = candidates;
  const size_t n_exact = ExactCandidates(model.ffns.size());
  if (candidates.size() > n_exact + 1) {
    size_t ref = 0;
    for (size_t i = 1; i < candidates.size(); ++i) {
      const Knobs& a = candidates[i];
      const Knobs& b = candidates[ref];
      const auto key = [](const Knobs& k) { return std::make_tuple(k.threads, k.queue_depth, -std::abs(k.cluster - 32)); };
      if (key(a) > key(b)) ref = i;
    }
    Optimum r;
    if (solved) ++*solved;
    if (timed(candidates[ref], "the reference knob combination", &r)) {
      std::vector<std::pair<double, size_t>> ranked;
      for (size_t i = 0; i < candidates.size(); ++i) {
        if (i == ref) continue;
        PlanSettings s = r.settings;
        s.compute_threads = candidates[i].threads;
        s.queue_depth = candidates[i].queue_depth;
        s.cluster_neurons = candidates[i].cluster;
        ranked.emplace_back(Evaluate(hw, model, s).token_s, i);
      }
      std::stable_sort(ranked.begin(), ranked.end());
      exact.clear();
      for (size_t j = 0; j < ranked.size() && j < n_exact; ++j) exact.push_back(candidates[ranked[j].second]);
      *best = std::move(r);
      found = true;
    }
  }
  for (size_t i = 0; i < exact.size(); ++i) {
    Optimum o;
    if (solved) ++*solved;
    if (!timed(exact[i], "knob combination " + std::to_string(i + 1) + " of " + std::to_string(exact.size()), &o)) {
      continue;
    }
    const double key = goal == Goal::kSpeed ? o.token_us : o.memory_mib;
    const double best_key = goal == Goal::kSpeed ? best->token_us : best->memory_mib;
    // 1e-9 relative: rational optima that differ only by rounding count as ties.
    if (!found || key < best_key * (1 - 1e-9)) {
      *best = std::move(o);
      found = true;
    }
  }
  return found;
}

// The user's limits as tracked assumptions, so that Z3's unsat core names the conflicting ones. Empty when the knobs
// admit a solution.
std::vector<std::string> UnsatCore(const HardwareParams& hw, const ModelParams& model, const Knobs& knobs,
                                   double mem_mib, double max_token_us) {
  z3::context ctx;
  z3::solver solver(ctx);
  Encoding e = Encode(ctx, solver, hw, model, knobs);
  const z3::expr fixed = ctx.bool_const("fixed_part");
  const z3::expr memory = ctx.bool_const("memory_limit");
  const z3::expr speed = ctx.bool_const("min_speed");
  solver.add(z3::implies(fixed, Real(ctx, static_cast<double>(model.fixed_bytes) / kMiB) <= Real(ctx, mem_mib)));
  solver.add(z3::implies(memory, e.memory_mib <= Real(ctx, mem_mib)));
  if (max_token_us > 0) solver.add(z3::implies(speed, e.token_us <= Real(ctx, max_token_us)));
  z3::expr_vector assumptions(ctx);
  assumptions.push_back(fixed);
  assumptions.push_back(memory);
  if (max_token_us > 0) assumptions.push_back(speed);
  std::vector<std::string> names;
  if (solver.check(assumptions) == z3::unsat) {
    const z3::expr_vector core = solver.unsat_core();
    for (unsigned i = 0; i < core.size(); ++i) names.push_back(core[i].to_string());
  }
  return names;
}


// The best shared-pool plan (SharedPoolSettings) over the knob combinations, or false when the model has no shared
// curve or nothing meets the limits. The pool is one variable and the time falls as it grows, so for speed each
// combination takes the whole memory; for memory (a minimum speed) the smallest pool reaching it, by bisection.
bool BestSharedPool(const HardwareParams& hw, const ModelParams& model, const std::vector<Knobs>& candidates,
                    const UserLimits& limits, PlanSettings* best, Prediction* best_prediction) {
  if (model.shared_lru.x.empty() || model.ffns.empty() || model.fixed_bytes > limits.memory_bytes) return false;
  const double max_token_s = limits.min_tokens_per_s > 0 ? 1.0 / limits.min_tokens_per_s : 0.0;
  const bool for_memory = limits.objective == UserLimits::Objective::kMemory;
  bool found = false;
  for (const Knobs& k : candidates) {
    PlanSettings knobs;
    knobs.compute_threads = k.threads;
    knobs.queue_depth = k.queue_depth;
    knobs.cluster_neurons = k.cluster;
    PlanSettings s = SharedPoolSettings(model, knobs, limits.memory_bytes);
    Prediction p = Evaluate(hw, model, s);
    if (max_token_s > 0 && p.token_s > max_token_s) continue;
    if (for_memory && max_token_s > 0) {
      uint64_t lo = model.fixed_bytes, hi = limits.memory_bytes;  // hi meets the speed
      while (hi - lo > model.ffns[0].slot_bytes) {
        const uint64_t mid = lo + (hi - lo) / 2;
        (Evaluate(hw, model, SharedPoolSettings(model, knobs, mid)).token_s <= max_token_s ? hi : lo) = mid;
      }
      s = SharedPoolSettings(model, knobs, hi);
      p = Evaluate(hw, model, s);
    }
    const bool better = !found || (for_memory ? p.memory_bytes < best_prediction->memory_bytes ||
                                                    (p.memory_bytes == best_prediction->memory_bytes &&
                                                     p.token_s < best_prediction->token_s)
                                              : p.token_s < best_prediction->token_s);
    if (better) {
      *best = s;
      *best_prediction = p;
      found = true;
    }
  }
  return found;
}

}  // namespace

Result<SolveResult> SolvePlan(const HardwareParams& hw, const ModelParams& model_in, const UserLimits& limits) {
  // Many experts: the solver works on one region per layer (ExpertLayers) and the plan is spread back over them.
  ExpertLayers layers;
  const bool grouped = model_in.ffns.size() > kMaxSolverRegions && GroupExpertsByLayer(model_in, &layers);
  if (grouped) {
    NF_LOG(Info) << "plan: " << model_in.ffns.size() << " expert regions solved as " << layers.model.ffns.size()
                 << " layers (their experts' curves merged), then spread over the experts";
  }
  const ModelParams& model = grouped ? layers.model : model_in;
  if (hw.cores < 1 || hw.dense_gemv_gbs.empty() || hw.sparse_ffn_gbs.empty() || hw.random_reads.empty()) {
    return Status::InvalidArgument("hardware profile lacks cores, GEMV / sparse FFN throughput or random-read figures");
  }
  const int max_threads = limits.cores > 0 ? std::min(limits.cores, hw.cores) : hw.cores;
  const auto start = std::chrono::steady_clock::now();
  SolveResult result;
  result.solver_regions = static_cast<int>(model.ffns.size());
  try {
    const double mem_mib = static_cast<double>(limits.memory_bytes) / kMiB;
    const double max_token_us = limits.min_tokens_per_s > 0 ? 1e6 / limits.min_tokens_per_s : 0;
    const std::vector<Knobs> candidates = Candidates(hw, model, max_threads);
    result.candidates = static_cast<int>(candidates.size());
    Optimum best;
    const Goal goal = limits.objective == UserLimits::Objective::kMemory ? Goal::kMemory : Goal::kSpeed;
    // One pool shared by every region, when the profile has its curve (MoE: the routing follows the sequence, which
    // per-region partitions sized by the calibration's routing cannot): taken when it serves better, or alone when no
    // per-region plan meets the limits.
    PlanSettings shared;
    Prediction shared_p;
    const bool shared_ok = BestSharedPool(hw, model_in, candidates, limits, &shared, &shared_p);
    if (model.fixed_bytes <= limits.memory_bytes &&
        OptimiseAll(hw, model, candidates, mem_mib, max_token_us, goal, &best, &result.solved)) {
      result.feasible = true;
      result.solver_token_s = best.token_us * 1e-6;
      // The relaxation's mixed splits rest on the LRU curve's concave hull; the plan keeps the solver's memory per
      // region and holds it the way the measured curves serve best (cost_model.h).
      const PlanSettings solved = grouped ? SpreadOverExperts(model_in, layers, best.settings) : best.settings;
      result.settings = PureRegionSplits(model_in, solved);
      result.prediction = Evaluate(hw, model_in, result.settings);
      if (shared_ok && (goal == Goal::kMemory ? shared_p.memory_bytes < result.prediction.memory_bytes
                                              : shared_p.token_s < result.prediction.token_s)) {
        result.settings = shared;
        result.prediction = shared_p;
      }
    } else if (shared_ok) {
      result.feasible = true;
      result.settings = shared;
      result.prediction = shared_p;
    }
    if (result.feasible) {
      result.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return result;
    }

    // Infeasible for every knob combination: the conflicting limits (the union of the per-combination cores) and
    // the nearest feasible limits.
    for (const Knobs& k : candidates) {
      for (std::string& name : UnsatCore(hw, model, k, mem_mib, max_token_us)) result.conflict.push_back(name);
    }
    std::sort(result.conflict.begin(), result.conflict.end());
    result.conflict.erase(std::unique(result.conflict.begin(), result.conflict.end()), result.conflict.end());
    if (max_token_us > 0) {
      Optimum o;
      if (OptimiseAll(hw, model, candidates, 0, max_token_us, Goal::kMemory, &o)) {
        result.min_feasible_memory = static_cast<uint64_t>(std::ceil(o.memory_mib * kMiB));
      }
    }
    if (model.fixed_bytes <= limits.memory_bytes) {
      Optimum o;
      if (OptimiseAll(hw, model, candidates, mem_mib, 0, Goal::kSpeed, &o)) result.max_feasible_speed = 1e6 / o.token_us;
    }
    std::string msg = "no plan satisfies the limits: conflicting constraints {";
    for (size_t i = 0; i < result.conflict.size(); ++i) msg += (i ? ", " : "") + result.conflict[i];
    msg += "}";
    if (model.fixed_bytes > limits.memory_bytes) {
      msg += "; the fixed part (resident weights, KV cache, scratch) alone needs " + sparse::FormatBytes(model.fixed_bytes) +
             " but the memory limit is " + sparse::FormatBytes(limits.memory_bytes);
    }
    if (result.min_feasible_memory > 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "; reaching %.2f tok/s needs at least %s", limits.min_tokens_per_s,
                    sparse::FormatBytes(result.min_feasible_memory).c_str());
      msg += buf;
    } else if (max_token_us > 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "; %.2f tok/s is out of reach at any memory size", limits.min_tokens_per_s);
      msg += buf;
    }
    if (result.max_feasible_speed > 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "; within %s the best is %.2f tok/s", sparse::FormatBytes(limits.memory_bytes).c_str(),
                    result.max_feasible_speed);
      msg += buf;
    }
    result.message = msg;
  } catch (const z3::exception& ex) {
    return Status::Internal(std::string("Z3: ") + ex.msg());
  }
  result.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace nflash::planner
