#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, then run nflash's whole pipeline on the default model
# (../shared/models/stories260K) and on its ReLU fine-tune (stories260K-relu, 86% of FFN activations exactly zero):
#   convert -> profile (calibration text) -> pack (FFN neurons on flash) -> profile-hw (this machine) -> plan (Z3,
#   memory limit, calibrated by measured runs: the median of 3) -> offload (FFN read from flash with O_DIRECT + io_uring under the plan's memory budget),
# printing the story, the speed and the memory used next to the in-memory dense engine's speed; then perplexity on
# the held-out text and a small synthetic sparse model.
# Usage: scripts/main_job.sh [SHARED_DIR] (default ../shared). Outputs go to out/.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${1:-../shared}
MODEL="$SHARED/models/stories260K/stories260K.bin"
RELU="$SHARED/models/stories260K-relu/stories260K-relu.bin"
CALIB="$SHARED/text/tinystories_calib.txt"      # calibration only
HELDOUT="$SHARED/text/tinystories_cased_197K.txt"  # evaluation only
[ -f "$MODEL" ] || { echo "main_job: $MODEL not found (pass the shared folder as the first argument)" >&2; exit 1; }
if ! command -v cmake >/dev/null || ! dpkg -s libcli11-dev libz3-dev libcpp-httplib-dev >/dev/null 2>&1; then bash scripts/setup.sh; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target nflash
NF=build/runtime/cli/nflash
mkdir -p out

echo "== convert (F32, Q8_0, Q4_0) and inspect"
for t in f32 q8_0 q4_0; do
  $NF -q convert "$MODEL" -o "out/stories260K-$t.gguf" --type "$t" --force
done
$NF -q convert "$RELU" --tokenizer "$SHARED/models/stories260K/tok512.bin" --activation relu -o out/relu-f32.gguf \
  --type f32 --force
$NF inspect out/stories260K-q8_0.gguf

echo "== this machine's hardware profile (quick)"
$NF -q profile-hw --quick --dir out -o out/hw.json --force

# One model through the pipeline: profile, pack, plan under MEMORY, run from flash, and the in-memory dense speed.
pipeline() {
  local name=$1 gguf=$2 memory=$3
  echo "== $name: profile -> pack -> plan ($memory) -> run from flash"
  $NF -q profile -m "$gguf" -f "$CALIB" --tokens 20000 -o "out/$name.prof" --force
  $NF -q pack -m "$gguf" -p "out/$name.prof" -o "out/$name.deploy" --force
  $NF inspect "out/$name.deploy"
  # --calibrate: the plan is run once (a few dozen tokens) and the cost model fitted to what was measured.
  $NF plan --hw out/hw.json --deploy "out/$name.deploy" --memory "$memory" --ctx 256 -o "out/$name.plan.json" \
    --force --explain --calibrate
  $NF offload -d "out/$name.deploy" --plan "out/$name.plan.json" -n 200
  echo "-- in-memory dense engine, same model, for comparison"
  $NF run -m "$gguf" -n 200 --temp 0 -c 256
}
pipeline stories260K out/stories260K-f32.gguf 4M
pipeline stories260K-relu out/relu-f32.gguf 3M

echo "== perplexity on the held-out text"
$NF perplexity -m out/stories260K-q8_0.gguf -f "$HELDOUT" --ctx 256
$NF synth --shape custom --dim 256 --ffn 1024 --layers 4 --heads 8 --kv-heads 4 --vocab 512 --type q4_0 \
  --sparsity 0.9 -o out/synthetic-small.gguf --force
