#!/usr/bin/env bash
# Issue 6's 0.7x ratio, side by side: N rounds, each running the in-memory sparse run (`nflash run --sparse predictor`
# with the first deployment's predictor, weights read into memory) and then every offloaded configuration given
# (`nflash offload --plan`), interleaved so that the host's load drifts through all of them alike, in ABBA order (odd
# rounds: the in-memory run, then the configurations; even rounds: the configurations in reverse, then the in-memory
# run): on the development VM the run right after an in-memory run was the slowest of three in 3 of 3, so a fixed order
# penalised the first configuration (docs/results.md, twenty-first run). Prints each round's
# tok/s (decode after WARMUP tokens), each configuration's I/O wait per token and ratio to that round's in-memory run,
# and the median ratios (the lower middle for an even count). The same prompt, token count and threads everywhere.
# Usage: [ROUNDS=6] [TOKENS=40] [WARMUP=8] [THREADS=2] scripts/ab_offload.sh MODEL.gguf DEPLOY_DIR:PLAN.json
#        [DEPLOY_DIR:PLAN.json ...]
# Extra offload flags per configuration: DEPLOY_DIR:PLAN.json:--flag,value (commas become spaces).
# Needs build/runtime/cli/nflash (or $NFLASH) and python3 (to read JSON; not the product).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
MODEL=$1
shift
NF=${NFLASH:-build/runtime/cli/nflash}
ROUNDS=${ROUNDS:-6} TOKENS=${TOKENS:-40} WARMUP=${WARMUP:-8} THREADS=${THREADS:-2}
PROMPT="Once upon a time"
FIRST_DEPLOY=${1%%:*}

inmem() {
  "$NF" -q run -m "$MODEL" -n "$TOKENS" --temp 0 -t "$THREADS" --json -p "$PROMPT" --sparse predictor \
    --predictor "$FIRST_DEPLOY/predictor.gguf" --skip-predictor-hash --no-mmap |
    python3 -c 'import json,sys; l=json.load(sys.stdin)["token_latencies_ms"][int(sys.argv[1]):]; print("%.2f" % (1000*len(l)/sum(l)))' \
      "$WARMUP"
}
offload() {  # DEPLOY PLAN [flags]
  local deploy=$1 plan=$2
  shift 2
  "$NF" -q offload -d "$deploy" --plan "$plan" -n "$TOKENS" --warmup "$WARMUP" -p "$PROMPT" --json "$@" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.2f %.1f" % (d["decode_tok_s"], d["io_wait_ms_per_token"]))'
}

RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
printf 'round  in-memory'
for cfg in "$@"; do printf '  | %s' "$cfg"; done
printf '\n'
CFGS=("$@")
for r in $(seq "$ROUNDS"); do
  order=$(seq 0 $((${#CFGS[@]} - 1)))
  if [ $((r % 2)) -eq 1 ]; then
    base=$(inmem)
  else
    order=$(seq $((${#CFGS[@]} - 1)) -1 0)
  fi
  got=()
  for c in $order; do
    IFS=: read -r deploy plan extra <<< "${CFGS[$c]}"
    # shellcheck disable=SC2086
    got[$c]=$(offload "$deploy" "$plan" ${extra//,/ })
  done
  if [ $((r % 2)) -eq 0 ]; then base=$(inmem); fi
  line="$r  $base"
  for c in $(seq 0 $((${#CFGS[@]} - 1))); do
    read -r speed wait <<< "${got[$c]}"
    ratio=$(python3 -c "print('%.3f' % ($speed / $base))")
    line="$line  | $speed tok/s, wait $wait ms, x$ratio"
    echo "$c $ratio $speed" >> "$RESULTS"
  done
  echo "$line"
done
c=0
for cfg in "$@"; do
  awk -v c="$c" '$1 == c {print $2, $3}' "$RESULTS" | sort -g | awk -v name="$cfg" '
    {r[NR]=$1; s[NR]=$2} END {m=int((NR+1)/2); printf "%s: median ratio %.3f (%.3f-%.3f) over %d rounds\n", name, r[m], r[1], r[NR], NR}'
  c=$((c + 1))
done
