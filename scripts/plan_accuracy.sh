#!/usr/bin/env bash
# Issue 7's acceptance benchmark: at several memory budgets, the plan's predicted decode speed against the measured one
# (`nflash offload --plan`, median of R runs), and the plan's measured speed against the best configuration of a small
# grid over the same knobs (hot/cold split, queue depth, chunk size) run with `nflash offload --memory`.
# Usage: scripts/plan_accuracy.sh DEPLOY_DIR HW_JSON "BUDGET1 BUDGET2 ..." [RUNS] [TOKENS] [WARMUP]
# Each run decodes WARMUP + TOKENS tokens and measures the last TOKENS (`nflash offload --warmup`): the planner
# predicts warm caches. Extra `nflash offload` flags (e.g. --active-set oracle) come from $OFFLOAD_FLAGS.
# $CALIBRATE: empty (raw hw.json figures), "each" (`nflash plan --calibrate` at every budget: a measured decode of
# the uncalibrated plan, then a re-plan), or one budget, e.g. 1850M (calibrate there once and reuse the factors at
# every budget with --calibration: the cross-budget test). $GRID=0 skips the grid search.
# Prints a markdown table. Needs build/runtime/cli/nflash (or $NFLASH) and python3 (JSON parsing, not the product).
set -euo pipefail
DEPLOY=$1 HW=$2 BUDGETS=$3 RUNS=${4:-3} TOKENS=${5:-32} WARMUP=${6:-8}
NF=${NFLASH:-build/runtime/cli/nflash}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
CTX=$((TOKENS + WARMUP + 16))
read -r -a EXTRA <<< "${OFFLOAD_FLAGS:-}"
CALIBRATE=${CALIBRATE:-}
GRID=${GRID:-1}
CAL_ARGS=()
if [ -n "$CALIBRATE" ] && [ "$CALIBRATE" != each ]; then
  "$NF" -q plan --hw "$HW" --deploy "$DEPLOY" --memory "$CALIBRATE" --ctx "$CTX" -o "$WORK/calibration.json" --force \
    --calibrate
  CAL_ARGS=(--calibration "$WORK/calibration.json")
elif [ "$CALIBRATE" = each ]; then
  CAL_ARGS=(--calibrate)
fi

median_speed() {  # args: offload flags...; prints the median decode tok/s over RUNS runs
  local speeds=()
  for _ in $(seq "$RUNS"); do
    speeds+=("$("$NF" -q offload -d "$DEPLOY" -n "$((TOKENS + WARMUP))" --warmup "$WARMUP" --json "${EXTRA[@]}" "$@" | python3 -c \
      'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])')")
  done
  printf '%s\n' "${speeds[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}

echo "| budget | predicted tok/s | measured tok/s (plan) | predicted / measured | best grid tok/s (config) | plan / best |"
echo "|---|--:|--:|--:|--:|--:|"
for B in $BUDGETS; do
  "$NF" -q plan --hw "$HW" --deploy "$DEPLOY" --memory "$B" --ctx "$CTX" -o "$WORK/plan.json" --force "${CAL_ARGS[@]}"
  predicted=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["predicted"]["tokens_per_s"])' "$WORK/plan.json")
  measured=$(median_speed --plan "$WORK/plan.json")
  best=0 best_cfg=""
  [ "$GRID" = 0 ] && { python3 -c "import sys; p, m = float(sys.argv[2]), float(sys.argv[3]); print(f'| {sys.argv[1]} | {p:.1f} | {m:.1f} | {p / m:.2f} | - | - |')" "$B" "$predicted" "$measured"; continue; }
  for hf in 0 0.5 1; do
    for qd in 8 32; do
      for chunk in 8 32; do
        s=$(median_speed --memory "$B" --ctx "$CTX" --hot-fraction "$hf" --queue-depth "$qd" --chunk-requests "$chunk")
        if python3 -c "import sys; sys.exit(0 if float('$s') > float('$best') else 1)"; then
          best=$s best_cfg="hot $hf, qd $qd, chunk $chunk"
        fi
      done
    done
  done
  python3 - "$B" "$predicted" "$measured" "$best" "$best_cfg" <<'PY'
import sys
b, p, m, g, cfg = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
print(f"| {b} | {p:.1f} | {m:.1f} | {p / m:.2f} | {g:.1f} ({cfg}) | {m / g:.2f} |")
PY
done
