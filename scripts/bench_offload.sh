#!/usr/bin/env bash
# Issue 6's speed benchmark: at the memory budget that leaves half of the FFN weights on flash (`nflash bench
# --offload 0.5`: every non-FFN byte + half the FFN + KV cache + 16 MiB), decode through the offloaded runtime in
# `full`, `llmflash` and `bundles` modes, dense-mmap in a memory cgroup of the same budget, and the in-memory engines
# (dense, and the sparse FFN with the deployment's predictor: `nflash run --sparse predictor`) side by side, with the
# compute / I/O floors from the hardware profile.
# Usage: [MODES=full,llmflash,bundles,dense-mmap] scripts/bench_offload.sh MODEL.gguf DEPLOY_DIR HW_JSON [REPETITIONS=3]
#        [TOKENS=32] [OUT_DIR=.]
# Needs build/runtime/cli/nflash (or $NFLASH) and python3 (to read JSON; not the product).
set -euo pipefail
MODEL=$1 DEPLOY=$2 HW=$3 REPS=${4:-3} TOKENS=${5:-32} OUT=${6:-.}
NF=${NFLASH:-build/runtime/cli/nflash}
mkdir -p "$OUT"
PROMPT_TOKENS=16

echo "== nflash bench (offload 0.5), $REPS repetitions, tg$TOKENS after a $PROMPT_TOKENS-token prompt"
"$NF" -q bench -m "$MODEL" --deploy "$DEPLOY" --modes "${MODES:-full,llmflash,bundles,dense-mmap}" --offload 0.5 \
  --tests "tg$TOKENS" --prompt-tokens "$PROMPT_TOKENS" -r "$REPS" --warmup 1 -t 2 --hw "$HW" \
  --row-timeout 900 --output csv -o "$OUT/offload_bench.csv" --force
column -s, -t < "$OUT/offload_bench.csv"

echo "== in memory (no budget): dense engine and sparse FFN with the deployment's predictor, $REPS runs each"
run_speed() {  # args: run flags...; prints decode tok/s of one run
  "$NF" -q run -m "$MODEL" -n "$TOKENS" --temp 0 -t 2 --json -p "Once upon a time there was a little girl" "$@" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])'
}
for what in dense sparse; do
  flags=()
  [ "$what" = sparse ] && flags=(--sparse predictor --predictor "$DEPLOY/predictor.gguf" --skip-predictor-hash)
  speeds=()
  for _ in $(seq "$REPS"); do speeds+=("$(run_speed "${flags[@]}")"); done
  printf '%s\n' "${speeds[@]}" | sort -g | awk -v w="$what" '{a[NR]=$1} END {printf "in-memory %s: median %.2f tok/s (runs:", w, a[int((NR+1)/2)]; for (i=1;i<=NR;i++) printf " %.2f", a[i]; print ")"}'
done | tee "$OUT/in_memory.txt"
