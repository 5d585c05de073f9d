#!/usr/bin/env bash
# The evaluation (issue 8): runs nflash's pipeline (profile-hw, synth, profile, pack, plan, bench, perplexity) on
# synthetic Llama/Mistral-shaped models with layers cut and on the real stories260K-relu, and writes the CSVs, gnuplot SVGs
# and markdown tables that docs/results.md shows. It builds nothing: the binary is $NFLASH or build/runtime/cli/nflash.
#
# Usage: scripts/evaluate.sh [--quick] [--workdir DIR] [--shared DIR] [--shape S] [--layers N] [--out DIR]
#   --quick    2 layers, 1 repetition, short tests: < 10 minutes on the 2-core machine of docs/results.md
#   --workdir  models, profiles, deployments, raw CSVs (default /var/tmp/nflash-eval); existing models are reused
#   --shared   the shared folder with models/ and text/ (default ../shared beside the checkout)
#   --shape    synthetic shape: llama-7b (default), llama-13b, mistral-7b, mixtral-8x7b
#   --layers   layers to keep (default 8; quick 2)
#   --out      where results.md tables, CSVs and SVGs go (default WORKDIR/results; copy into docs/ by hand)
# Exit codes: 0 ok, 1 a step failed, 2 usage.
set -euo pipefail
main() {
REPO=$(cd "$(dirname "$0")/.." && pwd)
QUICK=0
WORK=/var/tmp/nflash-eval
SHARED="$REPO/../shared"
LAYERS=""
SHAPE=llama-7b
OUT=""
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --workdir) [ $# -ge 2 ] || usage; WORK=$2; shift ;;
    --shared) [ $# -ge 2 ] || usage; SHARED=$2; shift ;;
    --layers) [ $# -ge 2 ] || usage; LAYERS=$2; shift ;;
    --shape) [ $# -ge 2 ] || usage; SHAPE=$2; shift ;;
    --out) [ $# -ge 2 ] || usage; OUT=$2; shift ;;
    -h|--help) usage 0 ;;
    *) echo "evaluate: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done
NF=${NFLASH:-$REPO/build/runtime/cli/nflash}
[ -x "$NF" ] || { echo "evaluate: no nflash binary at $NF (build it, or set NFLASH)" >&2; exit 1; }
# A private copy: `bench` re-executes its own binary for every row, and a rebuild of the checkout during the run (other
# people's ninja) would otherwise swap the binary between rows.
mkdir -p "$WORK"
cp "$NF" "$WORK/nflash.bin.tmp" && mv "$WORK/nflash.bin.tmp" "$WORK/nflash"
NF="$WORK/nflash"
command -v gnuplot >/dev/null || { echo "evaluate: gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
CALIB="$SHARED/text/tinystories_calib.txt"
HELDOUT="$SHARED/text/tinystories_cased_197K.txt"
RELU="$SHARED/models/stories260K-relu/stories260K-relu.bin"
TOK="$SHARED/models/stories260K/tok512.bin"
for f in "$CALIB" "$HELDOUT" "$RELU" "$TOK"; do
  [ -f "$f" ] || { echo "evaluate: $f not found (pass --shared DIR)" >&2; exit 1; }
done

# Sizes. Quick: the smallest runs that still exercise every step (numbers indicative only). Full: 8 layers is what
# fits the time on this machine (synth of 32 layers takes ~30 min of I/O here); 3 repetitions as llama-bench.
if [ "$QUICK" = 1 ]; then
  LAYERS=${LAYERS:-2}; REPS=1; TG=tg16; PP=pp128; PROFILE_TOKENS=512; PPL_WINDOWS=100; HW_FLAGS=--quick
  CACHE_SHARES='0 0.25 0.5 1'; MAIN_CACHE=0.25; ROW_TIMEOUT=120
else
  LAYERS=${LAYERS:-8}; REPS=3; TG=tg64; PP=pp128,pp512; PROFILE_TOKENS=2048; PPL_WINDOWS=0; HW_FLAGS=
  CACHE_SHARES='0 0.1 0.25 0.5 0.75 1'; MAIN_CACHE=0.25; ROW_TIMEOUT=600
fi
OUT=${OUT:-$WORK/results}
mkdir -p "$WORK" "$OUT"
LOG="$WORK/evaluate.log"
: > "$LOG"
step() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG" >&2; }
# run CMD...: logs the exact command, then runs it with its output appended to the log; a failure stops the script.
run() {
  echo "\$ $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 || { echo "evaluate: failed (see $LOG): $*" >&2; exit 1; }
}
START=$(date +%s)

step "hardware profile"
HW="$WORK/hw.json"
[ -f "$HW" ] || run "$NF" -q profile-hw -o "$HW" --dir "$WORK" $HW_FLAGS

MODEL="$WORK/$SHAPE-${LAYERS}l.gguf"
PROF="$WORK/$SHAPE-${LAYERS}l.prof"
DEPLOY="$WORK/$SHAPE-${LAYERS}l.deploy"
step "synthetic $SHAPE, $LAYERS layers, Q4_0 (SYNTHETIC weights)"
[ -f "$MODEL" ] || run "$NF" -q synth --shape "$SHAPE" --layers "$LAYERS" --type q4_0 --sparsity 0.9 --seed 1 -o "$MODEL"
step "profile ($PROFILE_TOKENS calibration tokens)"
[ -f "$PROF" ] || run "$NF" -q profile -m "$MODEL" -f "$CALIB" --tokens "$PROFILE_TOKENS" -o "$PROF"
step "pack"
[ -f "$DEPLOY/manifest.json" ] || run "$NF" -q pack -m "$MODEL" -p "$PROF" -o "$DEPLOY" --force

BENCH=("$NF" -q bench -m "$MODEL" --deploy "$DEPLOY" -r "$REPS" -t 2 --prompt-tokens 16 --row-timeout "$ROW_TIMEOUT"
       --output csv --force)
# Budgets. `--offload 0.5` (non-FFN + half the FFN) is below the sparse runtime's fixed part at these cut depths: in
# oracle mode (no predictor) it holds every gate row (1/3 of the FFN) plus scratch, so the budgets are built from the
# runtime's own minimum instead: MIN + c x ffn.bin, where c is the share of the FFN bundles its cache can hold.
# The minimum is read from the error a 1 MiB budget gets ("... the minimum is X MiB (N bytes)").
step "budgets: the sparse runtime's minimum"
"$NF" -q bench -m "$MODEL" --deploy "$DEPLOY" --modes full --memory 1M --tests tg1 -r 1 --warmup 0 --output csv \
  > "$WORK/min_probe.csv" 2>> "$LOG" || true
MIN=$(grep -o 'minimum is [0-9.]* MiB ([0-9]* bytes)' "$WORK/min_probe.csv" | head -1 | sed 's/.*(\([0-9]*\) bytes)/\1/')
[ -n "$MIN" ] || { echo "evaluate: could not read the sparse runtime's minimum from $WORK/min_probe.csv" >&2; exit 1; }
FLASH=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["flash_bytes"])' "$DEPLOY/manifest.json")
MODEL_BYTES=$(stat -L -c %s "$MODEL")
mib() { python3 -c "import sys; print(int(($1) / 1048576) + 1)"; }  # bytes -> whole MiB, rounded up
B_MAIN=$(mib "$MIN + $MAIN_CACHE * $FLASH")M
SWEEP=""
for c in $CACHE_SHARES; do SWEEP="$SWEEP${SWEEP:+,}$(mib "$MIN + $c * $FLASH")M"; done
SWEEP="$SWEEP,$(mib "$MODEL_BYTES")M"  # the dense-mmap baseline at the whole model's size
echo "min_bytes=$MIN flash_bytes=$FLASH model_bytes=$MODEL_BYTES main_budget=$B_MAIN main_cache_share=$MAIN_CACHE sweep=$SWEEP" \
  > "$OUT/budgets.txt"
cat "$OUT/budgets.txt" >> "$LOG"

step "bench: decode at budget $B_MAIN (Fig. 6, Table 4; ablation dense-mmap -> bundles -> llmflash -> full; floors)"
# bundles = llmflash with caches of 0 slots (every active bundle read each token); --hw adds the compute / I/O floors.
run "${BENCH[@]}" --modes full,llmflash,bundles,dense-mmap,in-memory --memory "$B_MAIN" --tests "$TG" --hw "$HW" \
  -o "$OUT/decode_main.csv"
step "bench: prefill at budget $B_MAIN (Fig. 7)"
run "${BENCH[@]}" --modes full,llmflash,dense-mmap,in-memory --memory "$B_MAIN" --tests "$PP" -o "$OUT/prefill_main.csv"
step "prefill per layer: compute vs sequential I/O (Fig. 8)"
# A prompt of about 500 tokens (1000 characters; synthetic models tokenize finely) from the calibration text through
# batched prefill at the main budget (its two layer buffers need room beside the fixed part: if they do not fit, a
# budget with room for them, and the table says so).
PROMPT=$(head -c 1000 "$CALIB" | tr '\n' ' ')
FIG8_BUDGET=$B_MAIN
for attempt in 1 2; do
  echo "\$ $NF offload -d $DEPLOY --memory $FIG8_BUDGET -p <1000 characters of $CALIB> -n 1 --json" >> "$LOG"
  "$NF" -q offload -d "$DEPLOY" --memory "$FIG8_BUDGET" -p "$PROMPT" -n 1 --json > "$OUT/fig8_prefill.json" 2>> "$LOG" \
    || { echo "evaluate: offload prefill run failed (see $LOG)" >&2; break; }
  python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["prefill_layers"] else 1)' \
    "$OUT/fig8_prefill.json" && break
  BUF=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(3 * max(r["size"] for r in m["regions"]))' \
    "$DEPLOY/manifest.json")
  FIG8_BUDGET=$(mib "$MIN + $BUF")M
done
echo "$FIG8_BUDGET" > "$OUT/fig8_budget.txt"
step "bench: decode vs memory budget $SWEEP (Fig. 9, Fig. 11)"
run "${BENCH[@]}" --modes full,dense-mmap --memory "$SWEEP" --tests "$TG" -o "$OUT/decode_vs_memory.csv"

step "plan at each budget of the sweep (predicted vs measured)"
PLANS="$OUT/plans.csv"
echo "budget,status,predicted_tok_s,predicted_mb_per_token,predicted_served_fraction" > "$PLANS"
for B in ${SWEEP//,/ }; do
  P="$WORK/plan-$B.json"
  # --ctx 128: the KV cache the bench's tg rows allocate (16 prompt + up to 64 generated tokens), not the model's 4096.
  echo "\$ $NF plan --hw $HW --deploy $DEPLOY --memory $B --ctx 128 -o $P --force --explain" >> "$LOG"
  if "$NF" -q plan --hw "$HW" --deploy "$DEPLOY" --memory "$B" --ctx 128 -o "$P" --force --explain >> "$LOG" 2>&1; then
    python3 -c '
import json, sys
p = json.load(open(sys.argv[1])).get("predicted", {})
print(sys.argv[2], "ok", p.get("tokens_per_s", ""), p.get("read_mb_per_token", ""), p.get("served_fraction", ""), sep=",")
' "$P" "$B" >> "$PLANS"
  else
    echo "$B,infeasible,,," >> "$PLANS"
  fi
done

step "quality: stories260K-relu perplexity on the held-out text (dense, oracle-sparse, predicted-sparse)"
RELU_GGUF="$WORK/stories260K-relu.gguf"
PRED="$WORK/stories260K-relu.pred.gguf"
[ -f "$RELU_GGUF" ] || run "$NF" -q convert "$RELU" --tokenizer "$TOK" --activation relu --type f32 -o "$RELU_GGUF"
# The predictor is trained on the calibration text only; the held-out text is used for evaluation, never training.
[ -f "$PRED" ] || run "$NF" -q train-predictor -m "$RELU_GGUF" -f "$CALIB" -o "$PRED"
PPL=(-m "$RELU_GGUF" -f "$HELDOUT" --ctx 256 --max-windows "$PPL_WINDOWS" --json)
{
  echo "\$ $NF perplexity ${PPL[*]}"; "$NF" -q perplexity "${PPL[@]}" > "$WORK/ppl_dense.json"
  echo "\$ $NF perplexity ${PPL[*]} --sparse oracle"; "$NF" -q perplexity "${PPL[@]}" --sparse oracle > "$WORK/ppl_oracle.json"
  echo "\$ $NF perplexity ${PPL[*]} --sparse predictor --predictor $PRED"
  "$NF" -q perplexity "${PPL[@]}" --sparse predictor --predictor "$PRED" > "$WORK/ppl_predictor.json"
  # stories260K (SiLU): never exactly zero, so sparse means "below a per-layer threshold" set for 50% inactive on
  # the calibration text (the held-out text only evaluates).
  SILU=(-m "$SHARED/models/stories260K/stories260K.bin" -f "$HELDOUT" --ctx 256 --max-windows "$PPL_WINDOWS" --json)
  echo "\$ $NF perplexity ${SILU[*]}"; "$NF" -q perplexity "${SILU[@]}" > "$WORK/ppl_silu_dense.json"
  echo "\$ $NF perplexity ${SILU[*]} --sparse oracle --target-sparsity 0.5 --calib-text $CALIB"
  "$NF" -q perplexity "${SILU[@]}" --sparse oracle --target-sparsity 0.5 --calib-text "$CALIB" \
    > "$WORK/ppl_silu_oracle50.json"
} >> "$LOG" 2>&1 || { echo "evaluate: perplexity failed (see $LOG)" >&2; exit 1; }
# Offloaded: perplexity through the deployment (oracle active sets, the whole FFN on flash with a small cache), which
# must equal the in-memory oracle figure; and greedy tokens from the deployment against the dense engine's.
RELU_PROF="$WORK/stories260K-relu.prof"
RELU_DEPLOY="$WORK/stories260K-relu.deploy"
[ -f "$RELU_PROF" ] || run "$NF" -q profile -m "$RELU_GGUF" -f "$CALIB" --tokens 4096 -o "$RELU_PROF"
[ -f "$RELU_DEPLOY/manifest.json" ] || run "$NF" -q pack -m "$RELU_GGUF" -p "$RELU_PROF" -o "$RELU_DEPLOY" --force
OFFPPL=(--deploy "$RELU_DEPLOY" -f "$HELDOUT" --ctx 256 --max-windows "$PPL_WINDOWS" --json --active-set oracle
        --hot-slots 1 --cold-slots 64)
echo "\$ $NF perplexity ${OFFPPL[*]}" >> "$LOG"
"$NF" -q perplexity "${OFFPPL[@]}" > "$WORK/ppl_offload_oracle.json" 2>> "$LOG" \
  || echo "evaluate: offloaded perplexity failed (see $LOG)" >&2
echo "\$ $NF offload -d $RELU_DEPLOY -n 100 --active-set oracle --hot-slots 1 --cold-slots 64 -t 1" >> "$LOG"
"$NF" -q offload -d "$RELU_DEPLOY" -n 100 --active-set oracle --hot-slots 1 --cold-slots 64 -t 1 \
  > "$WORK/offload_text.txt" 2>> "$LOG" || echo "offload failed" > "$WORK/offload_text.txt"
echo "\$ $NF run -m $RELU_GGUF -n 100 --temp 0 -t 1" >> "$LOG"
"$NF" -q run -m "$RELU_GGUF" -n 100 --temp 0 -t 1 > "$WORK/dense_text.txt" 2>> "$LOG" || echo "run failed" > "$WORK/dense_text.txt"

step "tables and figures"
python3 "$REPO/scripts/eval/tables.py" --work "$WORK" --out "$OUT" --hw "$HW" --model "$MODEL" --shape "$SHAPE" --layers "$LAYERS" \
  --quick "$QUICK" > "$OUT/tables.md"
for g in "$REPO"/scripts/eval/*.gnuplot; do
  (cd "$OUT" && gnuplot -e "machine='$(cat "$OUT/machine.txt")'" "$g") >> "$LOG" 2>&1 \
    || echo "evaluate: gnuplot $(basename "$g") failed (see $LOG)" >&2
done
step "done in $(( $(date +%s) - START )) s: $OUT/tables.md, $OUT/*.csv, $OUT/*.svg; log $LOG"
}
main "$@"; exit $?
