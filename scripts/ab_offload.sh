#!/usr/bin/env bash
# Issue 6's 0.7x ratio, side by side: N rounds, each running the in-memory sparse run (`nflash run --sparse predictor`
# with the first deployment's predictor, weights read into memory) and then every offloaded configuration given
# (`nflash offload --plan`), interleaved so that the host's load drifts through all of them alike, in ABBA order (odd
# rounds: the in-memory run, then the configurations; even rounds: the configurations in reverse, then the in-memory
# run): on the development VM the run right after an in-memory run was the slowest of three in 3 of 3, so a fixed order
# penalised the first configuration (docs/results.md, twenty-first run). The configurations (llmflash included) also
# rotate from one pair of rounds to the next, so that each follows the in-memory run in its share of the odd rounds
# (without the rotation the first one always did, and lost 0.07-0.24 of its ratio there: twenty-sixth run). Prints
# each round's tok/s (decode after WARMUP tokens), each configuration's I/O wait per token and ratio to that round's
# in-memory run, and the median ratios (the lower middle for an even count). The same prompt, token count and threads
# everywhere. Each run's text is compared with its round's in-memory run (issue 6: at temperature 0 `full` and
# llmflash equal the in-memory sparse run with the same predictor): a round that differs is marked TEXT DIFFERS, and
# the summary counts the equal rounds, so that a speed is never quoted for a run that computed something else.
# Usage: [ROUNDS=6] [TOKENS=40] [WARMUP=8] [THREADS=2] [HW=hw.json] [LLMFLASH=1] scripts/ab_offload.sh MODEL.gguf
#        DEPLOY_DIR:PLAN.json [DEPLOY_DIR:PLAN.json ...]
# Extra offload flags per configuration: DEPLOY_DIR:PLAN.json:--flag,value (commas become spaces).
# The issue's other two targets in the same rounds: HW (a `nflash profile-hw` file) adds each configuration's token time
# over max(compute floor, I/O floor) (`--hw`; target <= 1.3) and the in-memory run's time over that compute floor
# (a check of the profile: a floor above the in-memory run is no floor; profiles before 3a75a85 gave such floors).
# LLMFLASH=1 adds a run of the first configuration in llmflash mode to every round (in the same interleaved order) and
# each configuration's speed over it (target >= 3).
# Needs build/runtime/cli/nflash (or $NFLASH) and python3 (to read JSON; not the product).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,18p' "$0" >&2
  exit 2
fi
MODEL=$1
shift
NF=${NFLASH:-build/runtime/cli/nflash}
ROUNDS=${ROUNDS:-6} TOKENS=${TOKENS:-40} WARMUP=${WARMUP:-8} THREADS=${THREADS:-2} HW=${HW:-} LLMFLASH=${LLMFLASH:-0}
PROMPT="Once upon a time"
FIRST_DEPLOY=${1%%:*}

inmem() {
  "$NF" -q run -m "$MODEL" -n "$TOKENS" --temp 0 -t "$THREADS" --json -p "$PROMPT" --sparse predictor \
    --predictor "$FIRST_DEPLOY/predictor.gguf" --skip-predictor-hash --no-mmap |
    python3 -c 'import hashlib,json,sys; d=json.load(sys.stdin); l=d["token_latencies_ms"][int(sys.argv[1]):]; print("%.2f %s" % (1000*len(l)/sum(l), hashlib.sha1(d["text"].encode()).hexdigest()[:12]))' \
      "$WARMUP"
}
offload() {  # DEPLOY PLAN [flags]
  local deploy=$1 plan=$2
  shift 2
  local hw=()
  if [ -n "$HW" ]; then hw=(--hw "$HW"); fi
  "$NF" -q offload -d "$deploy" --plan "$plan" -n "$TOKENS" --warmup "$WARMUP" -p "$PROMPT" --json "${hw[@]}" "$@" |
    python3 -c 'import hashlib,json,sys; d=json.load(sys.stdin); print("%.2f %.1f %.3f %.3f %s" % (d["decode_tok_s"], d["io_wait_ms_per_token"], d.get("floor_ratio", 0.0), d.get("floor_compute_ms", 0.0), hashlib.sha1(d["text"].encode()).hexdigest()[:12]))'
}

RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
CFGS=("$@")
NAMES=("$@")
if [ "$LLMFLASH" = 1 ]; then
  IFS=: read -r deploy plan _ <<< "$1"
  CFGS+=("$deploy:$plan:--mode,llmflash")
  NAMES+=("llmflash")
fi
LF=$((${#CFGS[@]} - 1))  # the llmflash run's index when LLMFLASH=1
printf 'round  in-memory'
for cfg in "${NAMES[@]}"; do printf '  | %s' "$cfg"; done
printf '\n'

N_CFGS=${#CFGS[@]}
for r in $(seq "$ROUNDS"); do
  # Rounds 2k-1 and 2k: the configurations from index k-1 (mod their count) on, cyclically; reversed in round 2k.
  first=$((((r - 1) / 2) % N_CFGS))
  order=$(for i in $(seq 0 $((N_CFGS - 1))); do echo $(((first + i) % N_CFGS)); done)
  if [ $((r % 2)) -eq 1 ]; then
    read -r base base_text <<< "$(inmem)"
  else
    order=$(echo "$order" | tac)
  fi
  got=()
  for c in $order; do
    IFS=: read -r deploy plan extra <<< "${CFGS[$c]}"
    # shellcheck disable=SC2086
    got[c]=$(offload "$deploy" "$plan" ${extra//,/ })
  done
  if [ $((r % 2)) -eq 0 ]; then read -r base base_text <<< "$(inmem)"; fi
  line="$r  $base"
  if [ -n "$HW" ]; then
    # The in-memory run against the first configuration's compute floor (the same tokens, predicted sets and dense
    # work): a floor must not exceed it, so a ratio below 1 says the profile underrates this machine's kernels.
    read -r _ _ _ floor_c _ <<< "${got[0]}"
    base_floor=$(python3 -c "print('%.3f' % (1000.0 / $base / $floor_c if $floor_c > 0 else 0.0))")
    line="$line (x$base_floor compute floor)"
    echo "inmem $base_floor" >> "$RESULTS"
  fi
  lf_speed=0
  if [ "$LLMFLASH" = 1 ]; then read -r lf_speed _ <<< "${got[$LF]}"; fi
  for c in $(seq 0 $((${#CFGS[@]} - 1))); do
    read -r speed wait floor _ text <<< "${got[$c]}"
    ratio=$(python3 -c "print('%.3f' % ($speed / $base))")
    same=1
    if [ "$text" != "$base_text" ]; then same=0; fi
    line="$line  | $speed tok/s, wait $wait ms, x$ratio"
    if [ "$same" = 0 ]; then line="$line, TEXT DIFFERS"; fi
    if [ -n "$HW" ]; then line="$line, floor x$floor"; fi
    vs_lf=0
    if [ "$LLMFLASH" = 1 ] && [ "$c" != "$LF" ]; then
      vs_lf=$(python3 -c "print('%.3f' % ($speed / $lf_speed))")
      line="$line, x$vs_lf llmflash"
    fi
    echo "$c $ratio $speed $floor $vs_lf $same" >> "$RESULTS"
  done
  echo "$line"
done
# Medians (the lower middle for an even count) of the in-memory run's floor check and of each configuration's ratios,
# and how many rounds met each target.
python3 - "$RESULTS" "$([ -n "$HW" ] && echo 1 || echo 0)" "$([ "$LLMFLASH" = 1 ] && echo "$LF" || echo -1)" \
  "${NAMES[@]}" <<'PY'
import sys
path, hw, lf, names = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4:]
lines = [l.split() for l in open(path)]
def med(values):
    v = sorted(values)
    return v[(len(v) - 1) // 2], v[0], v[-1]
if hw:
    m, lo, hi = med(float(l[1]) for l in lines if l[0] == "inmem")
    print("in-memory run: median x%.3f its compute floor (%.3f-%.3f): the floors are lower bounds where this is >= 1"
          % (m, lo, hi))
for c, name in enumerate(names):
    rows = [list(map(float, l[1:])) for l in lines if l[0] == str(c)]
    m, lo, hi = med(r[0] for r in rows)
    out = "%s: median ratio %.3f (%.3f-%.3f) over %d rounds, >= 0.7 in %d" % (
        name, m, lo, hi, len(rows), sum(r[0] >= 0.7 for r in rows))
    if hw:
        m, lo, hi = med(r[2] for r in rows)
        out += "; floor x%.3f (%.3f-%.3f), <= 1.3 in %d" % (m, lo, hi, sum(r[2] <= 1.3 for r in rows))
    if lf >= 0 and c != lf:
        m, lo, hi = med(r[3] for r in rows)
        out += "; x%.3f llmflash (%.3f-%.3f), >= 3 in %d" % (m, lo, hi, sum(r[3] >= 3 for r in rows))
    same = sum(r[4] == 1 for r in rows)
    out += "; text equal to the in-memory run's in %d of %d" % (same, len(rows))
    print(out)
PY
