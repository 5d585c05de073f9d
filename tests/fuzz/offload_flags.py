#!/usr/bin/env python3
"""Random flag combinations of `nflash offload` on small deployments it builds itself (ctest -L slow: OffloadFlags).

Two deployments: stories260K-relu (from ../shared, with a low-rank predictor and its lookahead table) and a SYNTHETIC
top-4-of-8 MoE (2 layers, half the neurons active). Each run draws flags (mode, cache split, hot policy, lookahead and
its sources, two-phase, siblings, KV type, threads, prefill kind and batch sizes, cold preload, queue depth, chunk size,
slot alignment, scattered reads, resident embedding, segmented LRU, buffered reads, pinning, warming, cluster size),
a budget down to near the minimum or a plan (per-layer or shared cold pool), an active-set source and a prompt. It must:
  - exit 0 and write the text of a roomy run with the same active-set source (greedy: the offloaded FFN equals the
    in-memory sparse one whatever the cache);
  - keep the runtime's accounting within the budget and the measured peak RSS within it + 64 MiB;
or refuse (exit 2) a budget below the fixed part, saying so. Then copies of both deployments with bytes flipped in cold
neurons' up+down parts (read only while decoding, the cold preload off) must either write the clean text or exit 1
with the checksum error; never crash, hang or write other text.

Two sessions of such runs found two internal errors of the cache (docs/results.md, sessions 48 and 49).
Usage: offload_flags.py --nflash BIN --shared DIR [--runs N] [--seed S] [--workdir DIR]
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

OPTS = [["--mode full", "--mode full", "--mode llmflash"],
        ["--hot-fraction auto", "--hot-fraction 0", "--hot-fraction 0.3", "--hot-fraction 1"],
        ["", "", "--hot-policy lru"], ["", "--lookahead 0", "--lookahead 16", "--lookahead -1"],
        ["", "--lookahead-source same-layer", "--lookahead-input hits", "--lookahead-input ffn-input"],
        ["", "--two-phase on", "--two-phase auto"], ["", "--no-sibling-readahead"], ["", "--kv-type f16"],
        ["-t 2", "-t 1"], ["", "--token-prefill", "--prefill-batch-min 4 --batch 7", "--prefill-batch-min 2"],
        ["", "--no-cold-preload"], ["", "--queue-depth 1", "--queue-depth 2", "--queue-depth 64"],
        ["", "--chunk-requests 1", "--chunk-requests 3"], ["", "--slot-alignment 4096", "--slot-alignment 512"],
        ["", "--no-scatter"], ["", "--resident-embedding"], ["", "--cold-protected 0.5"], ["", "--buffered"],
        ["", "--pin-threads on", "--pin-threads off"], ["", "--warm-next 0", "--warm-next 1"],
        ["", "--cluster-groups 1", "--cluster-groups 3"]]
# Flags a plan sizes (a plan refuses to be overridden on them, saying so).
PLANNED = ("--hot-fraction", "--hot-policy", "--kv-type", "--resident-embedding")
PLAN_OPTS = [["", "--cold-pool shared"], ["", "--no-cold-overflow"]]
SHORT = "Once upon a time"
LONG = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. One day she "
        "saw a big red ball under a tree and she ran to get it.")
CTX = 160


def sh(cmd, timeout=300):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)


def must(cmd):
    r = sh(cmd, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"setup failed: {cmd}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def build(nf, shared, work):
    """The two deployments and their budgets (just above the minimum, then roomier)."""
    calib = os.path.join(shared, "text", "tinystories_calib.txt")
    relu = os.path.join(work, "relu.gguf")
    must(f"{nf} -q convert {shared}/models/stories260K-relu/stories260K-relu.bin --tokenizer "
         f"{shared}/models/stories260K/tok512.bin --activation relu --type f32 -o {relu}")
    must(f"{nf} -q profile -m {relu} -f {calib} --tokens 4000 -t 1 -o {work}/relu.prof")
    must(f"{nf} -q train-predictor -m {relu} -f {calib} --tokens 4000 --method lowrank -o {work}/relu.pred")
    must(f"{nf} -q pack -m {relu} -p {work}/relu.prof --predictor {work}/relu.pred -o {work}/relu.deploy")
    moe = os.path.join(work, "moe.gguf")
    must(f"{nf} -q synth --shape custom --dim 128 --ffn 384 --heads 4 --layers 2 --experts 8 --top-k 4 --vocab 512 "
         f"--type f32 --sparsity 0.5 --threads 1 -o {moe}")
    must(f"{nf} -q profile -m {moe} -f {calib} --tokens 1000 -t 1 -o {work}/moe.prof")
    must(f"{nf} -q pack -m {moe} -p {work}/moe.prof -o {work}/moe.deploy")
    deploys = {}
    for name, srcs in (("relu.deploy", ["oracle", "predictor"]), ("moe.deploy", ["oracle"])):
        d = os.path.join(work, name)
        r = sh(f"{nf} -q offload -d {d} --memory 1K -c {CTX} -n 1")
        marker = "the minimum is "
        if marker not in r.stderr:
            sys.exit(f"{d}: no minimum in the refusal of a 1K budget:\n{r.stderr}")
        minimum = int(r.stderr.split(marker, 1)[1].split("(", 1)[1].split(" ", 1)[0])
        budgets = [minimum + (64 << 10), minimum + (512 << 10), minimum + (2 << 20), minimum + (6 << 20)]
        deploys[d] = (srcs, budgets)
    return deploys


def run_json(cmd):
    """(json, error): error is None for a run that exited 0 with JSON."""
    try:
        r = sh(cmd)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    if r.returncode != 0:
        return None, f"exit {r.returncode}: {r.stderr.strip()[-400:]}"
    try:
        return json.loads(r.stdout), None
    except ValueError as e:
        return None, f"no JSON: {e}"


def flags_runs(nf, deploys, work, rng, runs):
    failures, refused, done = [], 0, 0
    per_deploy = max(1, runs // len(deploys))
    for d, (srcs, budgets) in deploys.items():
        plans = []
        for b in budgets[1:3]:
            p = os.path.join(work, f"{os.path.basename(d)}-{b}.json")
            r = sh(f"{nf} -q plan --hw {work}/hw.json --deploy {d} --memory {b} --ctx {CTX} -o {p} --force")
            if r.returncode == 0:
                plans.append(p)
        refs = {}
        for src in srcs:
            for prompt in (SHORT, LONG):
                j, err = run_json(f"{nf} -q offload -d {d} --active-set {src} -n 20 -c {CTX} --json -p '{prompt}'")
                if err:
                    sys.exit(f"reference run failed on {d}: {err}")
                refs[(src, prompt)] = j["text"]
        for _ in range(per_deploy):
            flags = [rng.choice(o) for o in OPTS]
            src, prompt = rng.choice(srcs), rng.choice((SHORT, LONG))
            if plans and rng.random() < 0.3:
                flags = [f for f in flags if not f.startswith(PLANNED)]
                mem = f"--plan {rng.choice(plans)} " + " ".join(rng.choice(o) for o in PLAN_OPTS)
            else:
                mem = f"--memory {rng.choice(budgets)} -c {CTX}"
            cmd = f"{nf} -q offload -d {d} --active-set {src} -n 20 --json -p '{prompt}' {mem} " + " ".join(flags)
            done += 1
            j, err = run_json(cmd)
            if err and err.startswith("exit 2:") and "is below the fixed part" in err:
                refused += 1  # flags that add to the fixed part (--resident-embedding, say) at the lowest budgets
                continue
            if err is None:
                budget = j.get("memory_budget", 0)
                if j["text"] != refs[(src, prompt)]:
                    err = f"text differs from the roomy run's: {j['text']!r}"
                elif budget and j["accounted_bytes"] > budget:
                    err = f"accounted {j['accounted_bytes']} B over the budget {budget} B"
                elif budget and j["peak_rss_bytes"] > budget + (64 << 20):
                    err = f"peak RSS {j['peak_rss_bytes']} B over the budget {budget} B + 64 MiB"
            if err:
                failures.append(f"{cmd}\n    {err}")
    return done, refused, failures


def corrupt_runs(nf, deploys, work, rng, runs):
    failures, errors, done = [], 0, 0
    per_deploy = max(1, runs // len(deploys))
    for d, (srcs, budgets) in deploys.items():
        bad = d + "-corrupt"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(d, bad)
        man = json.load(open(os.path.join(bad, "manifest.json")))
        bl = man["bundle"]
        with open(os.path.join(bad, "ffn.bin"), "r+b") as f:
            for _ in range(6):
                reg = rng.choice(man["regions"])
                slot = rng.randrange(max(reg["hot_count"], reg["n_neurons"] // 2), reg["n_neurons"])
                at = (reg["offset"] + (slot // bl["slots_per_group"]) * bl["group_bytes"] +
                      (slot % bl["slots_per_group"]) * bl["bundle_bytes"] + bl["up_offset"] +
                      rng.randrange(bl["up_bytes"] + bl["down_bytes"]))
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0x5A]))
        for _ in range(per_deploy):
            flags = " ".join(rng.choice(o) for o in OPTS[:10] + OPTS[11:12] + OPTS[17:18])
            tail = (f"--active-set {rng.choice(srcs)} -n 16 -c {CTX} --json -p '{rng.choice((SHORT, LONG))}' "
                    f"--memory {rng.choice(budgets[1:])} {flags} --no-cold-preload")
            ref, err = run_json(f"{nf} -q offload -d {d} {tail}")
            if err:
                if "is below the fixed part" not in err:
                    failures.append(f"clean run of {d} {tail}\n    {err}")
                continue
            cmd = f"{nf} -q offload -d {bad} {tail}"
            done += 1
            try:
                r = sh(cmd, timeout=120)
            except subprocess.TimeoutExpired:
                failures.append(f"{cmd}\n    hung")
                continue
            if r.returncode == 0:
                if json.loads(r.stdout)["text"] != ref["text"]:
                    failures.append(f"{cmd}\n    exit 0 with other text")
            elif r.returncode == 1 and "checksum mismatch" in r.stderr:
                errors += 1
            else:
                failures.append(f"{cmd}\n    exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return done, errors, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nflash", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--runs", type=int, default=160, help="flag combinations (the corruption runs: a quarter of them)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", help="keep the deployments here (default: a temporary directory, removed)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = a.workdir or tempfile.mkdtemp(prefix="nflash-flags-")
    os.makedirs(work, exist_ok=True)
    try:
        deploys = build(a.nflash, a.shared, work)
        must(f"{a.nflash} -q profile-hw --quick --dir {work} -o {work}/hw.json --force")
        done, refused, failures = flags_runs(a.nflash, deploys, work, rng, a.runs)
        print(f"flag combinations: {done} runs, {refused} refused a budget below the fixed part, "
              f"{len(failures)} failed", flush=True)
        cdone, cerrors, cfailures = corrupt_runs(a.nflash, deploys, work, rng, max(2, a.runs // 4))
        print(f"corrupted bundles: {cdone} runs, {cerrors} stopped with the checksum error, {len(cfailures)} failed",
              flush=True)
        for f in failures + cfailures:
            print("FAIL", f, flush=True)
        if done - refused < a.runs // 2:
            print(f"FAIL: only {done - refused} of {done} runs ran (budgets too tight?)")
            return 1
        return 1 if failures or cfailures else 0
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
