// The execution plan from the cost model (cost_model.h), solved with Z3. The discrete knobs (compute threads, queue
// depth, cluster size) take few values, so they are enumerated (dominated queue depths pruned); for each combination
// the model is linear in every region's hot and cold-cache fractions and Z3's optimiser solves it exactly,
// maximising decode speed or minimising memory subject to a minimum speed. (One formulation with the knobs as Z3
// booleans took 580 s for 32 layers: the knob x miss-rate products make it a hard mixed problem; enumeration keeps
// each solve a linear program.) Infeasible limits are explained from Z3's unsat cores.
#pragma once

#include <string>
#include <vector>

#include "planner/cost_model.h"
#include "runtime/core/status.h"

namespace nflash::planner {

struct SolveResult {
  bool feasible = false;
  PlanSettings settings;
  Prediction prediction;            // Evaluate() of the settings (the rounded plan, real curves)
  double solver_token_s = 0;        // the solver's own objective value (concave-hull curves, unrounded) for the
                                    // per-region plan, also when a shared cold pool was chosen instead
  double solve_seconds = 0;
  int candidates = 0;               // knob combinations considered (threads x queue depths x cluster sizes, pruned)
  int solved = 0;                   // of which solved exactly by Z3 (the best-ranked; see OptimiseAll)
  int solver_regions = 0;           // regions in Z3's program: the model's, or its layers for many experts
  // Infeasible: the names of the conflicting constraints (memory_limit, fixed_part, min_speed) and the nearest
  // feasible limits.
  std::vector<std::string> conflict;
  uint64_t min_feasible_memory = 0;  // smallest memory that reaches min speed (0: unknown)
  double max_feasible_speed = 0;     // highest speed within the memory limit (0: none)
  std::string message;
};

// Thread-safety: reentrant (each call owns its Z3 context).
Result<SolveResult> SolvePlan(const HardwareParams& hw, const ModelParams& model, const UserLimits& limits);

}  // namespace nflash::planner
