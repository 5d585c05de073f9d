#!/usr/bin/env bash
# Issue 6's speed targets in one command: makes (or reuses) the SYNTHETIC 16-layer llama-7b workdir the results of runs
# 17-27 were measured on (docs/results.md, "Where things stand"), profiles this machine now, and runs
# scripts/ab_offload.sh: interleaved rounds of the in-memory sparse run, `full` under the plan's 1392 MiB (half of the
# FFN offloaded) and llmflash, with each round's ratios and their medians. Every weight is SYNTHETIC (`nflash synth`).
#
# Usage: scripts/offload_targets.sh [WORKDIR]   (default /var/tmp/nflash-targets)
# Time on the 2-vCPU development VM: 7-10 minutes to make the workdir (the calibrated plan: ~40 s), ~7 minutes per 8 rounds.
# Environment: SHARED (default ../shared beside the repository), NFLASH (default build/runtime/cli/nflash),
# ROUNDS (default 8), DENSE=1 also runs dense-mmap in a memory cgroup of the same budget (needs root and cgroups).
# Existing files of the workdir are reused (each nflash command writes its output under a temporary name first, so a
# file that exists is complete); delete one to make it again. hw.json is measured again on every call: the floors
# must describe the machine as it is now (the plan keeps the profile it was made with, hw-plan.json).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/var/tmp/nflash-targets}
SHARED=${SHARED:-$ROOT/../shared}
NF=${NFLASH:-$ROOT/build/runtime/cli/nflash}
ROUNDS=${ROUNDS:-8}
if [ ! -x "$NF" ]; then
  echo "offload_targets.sh: $NF not found: build it first (cmake --build build --target nflash)" >&2
  exit 2
fi
NF=$(readlink -f "$NF")
TEXT=$(readlink -f "$SHARED")/text
for f in tinystories_calib.txt tinystories_cased_197K.txt; do
  [ -f "$TEXT/$f" ] || { echo "offload_targets.sh: $TEXT/$f not found (SHARED=$SHARED)" >&2; exit 2; }
done
mkdir -p "$WORK"
cd "$WORK"

# once OUTPUT COMMAND...: runs COMMAND unless OUTPUT exists.
once() {
  local out=$1
  shift
  if [ -e "$out" ]; then
    echo "reusing $WORK/$out"
  else
    echo "+ $*"
    "$@"
  fi
}
once s7b16r.gguf "$NF" synth --shape llama-7b --layers 16 --type q4_0 --gate-rank 16 --sparsity 0.9 --seed 1 \
  --threads 2 -o s7b16r.gguf
# The profile from the model's own decode (what the cache will see), on calibration text only.
once s7b16r.prof "$NF" profile -m s7b16r.gguf -f "$TEXT/tinystories_calib.txt" --tokens 512 --generate 32 \
  --prompt-tokens 16 -o s7b16r.prof
once s7b16r.pred "$NF" train-predictor -m s7b16r.gguf -f "$TEXT/tinystories_calib.txt" --tokens 3072 --method lowrank \
  --ranks 24,32,48 --recall 0.99 --eval-text "$TEXT/tinystories_cased_197K.txt" --eval-tokens 1024 --weight-type f16 \
  -t 2 -o s7b16r.pred
# With the predictor, pack also writes the lookahead table (lookahead.gguf).
once s7b16r.deploy "$NF" pack -m s7b16r.gguf -p s7b16r.prof --predictor s7b16r.pred --order coactivation \
  -o s7b16r.deploy
once hw-plan.json "$NF" profile-hw -o hw-plan.json
# Calibrated, as the main job's plans are: the cost model fitted to measured runs, and the lookahead timed both ways
# (kept only where it is faster on this machine; docs/planner.md, "Calibration"). Before 2026-11-28 the targets ran
# under plan.json, made without --calibrate (the runtime's lookahead rule).
once plan-calibrated.json "$NF" plan --deploy s7b16r.deploy --hw hw-plan.json --memory 1392M --ctx 64 --calibrate \
  --calibrate-runs 5 -o plan-calibrated.json

echo "+ $NF profile-hw --force -o hw.json"
"$NF" -q profile-hw --force -o hw.json
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
echo "machine: $(nproc) CPUs, $cpu, $(date -u '+%F %T UTC')"
NFLASH=$NF ROUNDS=$ROUNDS HW=hw.json LLMFLASH=1 "$ROOT/scripts/ab_offload.sh" s7b16r.gguf s7b16r.deploy:plan-calibrated.json
if [ "${DENSE:-0}" = 1 ]; then
  # The same budget as the plan's (--offload 0.5: every non-FFN byte, half of the FFN and the KV cache).
  "$NF" bench -m s7b16r.gguf --modes dense-mmap --offload 0.5 --tests tg16 -r 1
fi
echo "targets (issue 6): full >= 0.7x the in-memory run, within 1.3x of the floor, >= 3x llmflash. SYNTHETIC weights."
