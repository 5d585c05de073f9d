#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, then run nflash's pipeline on the default model
# (../shared/models/stories260K): convert the llama2.c checkpoint to GGUF (F32, Q8_0, Q4_0), inspect it, generate
# text with the dense engine, measure perplexity on the held-out text, and write a small synthetic sparse model.
# Usage: scripts/main_job.sh [SHARED_DIR] (default ../shared). Outputs go to out/.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${1:-../shared}
MODEL="$SHARED/models/stories260K/stories260K.bin"
[ -f "$MODEL" ] || { echo "main_job: $MODEL not found (pass the shared folder as the first argument)" >&2; exit 1; }
if ! command -v cmake >/dev/null || ! dpkg -s libcli11-dev >/dev/null 2>&1; then bash scripts/setup.sh; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target nflash
NF=build/runtime/cli/nflash
mkdir -p out
for t in f32 q8_0 q4_0; do
  $NF convert "$MODEL" -o "out/stories260K-$t.gguf" --type "$t" --force
done
$NF inspect out/stories260K-q8_0.gguf
$NF run -m out/stories260K-f32.gguf -n 256 --temp 0
$NF perplexity -m out/stories260K-q8_0.gguf -f "$SHARED/text/tinystories_cased_197K.txt" --ctx 256
$NF synth --shape custom --dim 256 --ffn 1024 --layers 4 --heads 8 --kv-heads 4 --vocab 512 --type q4_0 \
  --sparsity 0.9 -o out/synthetic-small.gguf --force
