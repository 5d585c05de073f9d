#!/usr/bin/env python3
"""Turns the CSVs and JSONs of scripts/evaluate.sh into the markdown tables of docs/results.md (stdout) and the
whitespace-separated .dat files the gnuplot scripts beside this file read (in --out)."""
import argparse
import csv
import json
import os

MIB = 1048576.0


def rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def num(r, k):
    try:
        return float(r[k])
    except (KeyError, ValueError):
        return float("nan")


def fmt_mib(b):
    b = float(b)
    return "-" if b <= 0 else f"{b / MIB:.0f} MiB"


def status(r):
    # Error rows keep only their first clause: the full message is in the CSV.
    s = r.get("status", "")
    return "ok" if s == "ok" else s.split(";")[0][:110]


def machine_text(hw):
    m, fl = hw["machine"], hw["flash"]
    seq = max((x["mb_per_s"] for x in fl.get("sequential_read", [])), default=0)
    rnd = {(x["block_bytes"], x["queue_depth"]): x["mb_per_s"] for x in fl.get("random_read", [])}
    r1 = rnd.get((4096, 1), 0)
    r32 = rnd.get((4096, 32), 0)
    return (f"{m['hardware_threads']} cores {m['cpu_model']} ({m['isa']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
            f"{fl['device']} {fl['filesystem']}: seq read {seq:.0f} MB/s, 4K random {r1:.0f} MB/s QD1 / "
            f"{r32:.0f} MB/s QD32 (profile-hw{', quick' if hw.get('quick') else ''})")


def greedy_comparison(work):
    """Compares the greedy text of the offloaded runtime with the dense engine's over their common length (the two
    commands count generated tokens differently and print different trailers)."""
    def text(fn, stop):
        p = os.path.join(work, fn)
        t = open(p, errors="replace").read() if os.path.exists(p) else ""
        return t.split(stop)[0].strip() if stop else t.strip()
    d = text("dense_text.txt", None)
    o = text("offload_text.txt", "memory accounting")
    n = min(len(d), len(o))
    if n == 0:
        return "Offloaded: no text to compare (see the workdir and evaluate.log)."
    same = d[:n] == o[:n]
    return (f"Offloaded (deployment, oracle active sets, 1 hot + 64 cold slots, so nearly every neuron is read from "
            f"flash): greedy text {'IDENTICAL to' if same else 'DIFFERENT from'} the dense engine's over the first "
            f"{n} characters (offload_text.txt vs dense_text.txt in the workdir).")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hw", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", required=True)
    ap.add_argument("--shape", default="llama-7b")
    ap.add_argument("--quick", default="0")
    a = ap.parse_args()
    hw = json.load(open(a.hw))
    mach = machine_text(hw)
    with open(os.path.join(a.out, "machine.txt"), "w") as f:
        f.write(mach.replace("'", ""))
    budgets = dict(kv.split("=", 1) for kv in open(os.path.join(a.out, "budgets.txt")).read().split())
    model_bytes = float(budgets["model_bytes"])
    P = print
    P(f"Machine: {mach}. Model: {a.shape} shape cut to {a.layers} layers, Q4_0, **SYNTHETIC weights** "
      f"({os.path.basename(a.model)}, {model_bytes / MIB:.0f} MiB; ffn.bin {float(budgets['flash_bytes']) / MIB:.0f} MiB; "
      f"sparse runtime minimum {float(budgets['min_bytes']) / MIB:.0f} MiB). "
      f"{'Quick mode: 1 repetition.' if a.quick == '1' else ''}\n")

    # Fig. 6 and Table 4: decode at the main budget.
    dec = rows(os.path.join(a.out, "decode_main.csv"))
    P(f"### Decode at {budgets['main_budget']} (Fig. 6, Table 4)\n")
    P("| mode | budget | t/s | mean ms | P50 ms | P90 ms | P99 ms | miss rate mean / P99 | MB/tok | peak RSS | CPU | "
      "constraint | status |")
    P("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    with open(os.path.join(a.out, "fig6.dat"), "w") as f:
        for r in dec:
            t = num(r, "tok_s_mean")
            ok = r["status"] == "ok"
            mm, m99 = num(r, "miss_rate_mean"), num(r, "miss_rate_p99")
            miss = f"{mm:.3f} / {m99:.3f}" if mm >= 0 else "-"
            P(f"| {r['mode']} | {fmt_mib(r['memory_budget_bytes'])} | "
              f"{t:.2f} ± {num(r, 'tok_s_sd'):.2f} | {1000 / t if ok and t > 0 else float('nan'):.1f} | "
              f"{num(r, 'token_ms_p50'):.1f} | {num(r, 'token_ms_p90'):.1f} | {num(r, 'token_ms_p99'):.1f} | "
              f"{miss} | {num(r, 'mb_read_per_token'):.1f} | "
              f"{fmt_mib(r['peak_rss_bytes'])} | {100 * num(r, 'cpu_util'):.0f}% | {r['constraint']} | {status(r)} |")
            f.write(f"{r['mode']} {t if ok else 0:.4f} {num(r, 'tok_s_sd'):.4f}\n")
    P("\nmiss rate: per decode token, the share of its active neurons read from flash (not in the neuron cache); the "
      "mean over tokens and the 99th percentile (paper Table 4).\n")

    # Ablation (issue 8): each step adds one technique to the one before, at the same budget.
    by_mode = {r["mode"]: r for r in dec}
    steps = [("dense-mmap", "dense engine, GGUF mmapped (baseline)"), ("bundles", "+ neuron bundles on flash (no cache)"),
             ("llmflash", "+ neuron cache"), ("full", "+ I/O pipeline (io_uring, overlapped)")]
    if any(m in by_mode for m, _ in steps[1:]):
        P(f"### Ablation at {budgets['main_budget']}\n")
        P("| step | mode | t/s | x previous | MB/tok | hit rate | compute floor ms | I/O floor ms | x floor | status |")
        P("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        prev = float("nan")
        for m, what in steps:
            r = by_mode.get(m)
            if r is None:
                continue
            t = num(r, "tok_s_mean") if r["status"] == "ok" else float("nan")
            fl = [num(r, k) for k in ("floor_compute_ms", "floor_io_ms", "floor_ratio")]
            cells = [f"{v:.3f}" if v == v and v >= 0 else "-" for v in fl[:2]] + [f"{fl[2]:.2f}" if fl[2] == fl[2] and fl[2] >= 0 else "-"]
            hit = num(r, "hit_rate")
            gain = f"{t / prev:.2f}" if prev == prev and prev > 0 and t == t else "-"
            P(f"| {what} | {m} | {t:.2f} | {gain} | {num(r, 'mb_read_per_token'):.2f} | "
              f"{f'{hit:.3f}' if hit >= 0 else '-'} | " + " | ".join(cells) + f" | {status(r)} |")
            prev = t
        P("\nFloors (docs/planner.md, \"Floors\"): the least time per token for the work each row did, from hw.json; "
          "x floor = measured mean token time / max(compute, I/O floor).\n")

    # Fig. 8: prefill per layer, compute against sequential I/O.
    try:
        f8 = json.load(open(os.path.join(a.out, "fig8_prefill.json")))
        f8_budget = open(os.path.join(a.out, "fig8_budget.txt")).read().strip()
    except (OSError, ValueError):
        f8 = {}
        f8_budget = "-"
    layers = f8.get("prefill_layers", [])
    P(f"### Prefill per layer (Fig. 8): {f8.get('prompt_tokens', '-')} tokens at {f8_budget}\n")
    if layers:
        P("| layer | MB read | sequential read ms | compute ms | I/O not hidden ms | checksums ms |")
        P("| ---: | ---: | ---: | ---: | ---: | ---: |")
        with open(os.path.join(a.out, "fig8.dat"), "w") as f:
            f.write("layer compute read exposed\n")
            for l in layers:
                P(f"| {l['layer']} | {l['mb']:.1f} | {l['read_ms']:.1f} | {l['compute_ms']:.1f} | {l['wait_ms']:.1f} | "
                  f"{l['verify_ms']:.1f} |")
                f.write(f"{l['layer']} {l['compute_ms']:.3f} {l['read_ms']:.3f} {l['wait_ms']:.3f}\n")
        P("")
    else:
        P("batched prefill did not run (no per-layer figures)\n")

    # Fig. 7: prefill.
    pre = rows(os.path.join(a.out, "prefill_main.csv"))
    tests = sorted({r["test"] for r in pre}, key=lambda t: int(t[2:]))
    P(f"### Prefill at {budgets['main_budget']} (Fig. 7)\n")
    P("| mode | " + " | ".join(f"{t} t/s" for t in tests) + " | MB/tok | status |")
    P("| --- | " + " | ".join("---:" for _ in tests) + " | ---: | --- |")
    modes = []
    for r in pre:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    with open(os.path.join(a.out, "fig7.dat"), "w") as f:
        f.write("mode " + " ".join(tests) + "\n")
        for m in modes:
            mr = {r["test"]: r for r in pre if r["mode"] == m}
            cells = [f"{num(mr[t], 'tok_s_mean'):.2f}" if t in mr and mr[t]["status"] == "ok" else "-" for t in tests]
            st = "; ".join(sorted({status(r) for r in mr.values()}))
            mb = max((num(r, "mb_read_per_token") for r in mr.values()), default=0)
            P(f"| {m} | " + " | ".join(cells) + f" | {mb:.1f} | {st} |")
            f.write(m + " " + " ".join(c if c != "-" else "0" for c in cells) + "\n")

    # Fig. 9 and Fig. 11: decode vs budget; plans.
    sw = rows(os.path.join(a.out, "decode_vs_memory.csv"))
    plans = {r["budget"]: r for r in rows(os.path.join(a.out, "plans.csv"))}
    inmem = [r for r in dec if r["mode"] == "in-memory" and r["status"] == "ok"]
    P("\n### Decode vs memory budget (Fig. 9)\n")
    P("| budget | % of model | full t/s | full hit rate | plan predicted t/s | dense-mmap t/s | dense-mmap MB/tok | notes |")
    P("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    by_b = {}
    for r in sw:
        by_b.setdefault(int(r["memory_budget_bytes"]), {})[r["mode"]] = r
    with open(os.path.join(a.out, "fig9.dat"), "w") as f:
        f.write("# budget_mib full_tok_s dense_mmap_tok_s plan_tok_s (0: error or infeasible)\n")
        for b in sorted(by_b):
            fu, dm = by_b[b].get("full"), by_b[b].get("dense-mmap")
            pl = plans.get(f"{b // 1048576}M", {})
            fu_t = num(fu, "tok_s_mean") if fu and fu["status"] == "ok" else 0
            dm_t = num(dm, "tok_s_mean") if dm and dm["status"] == "ok" else 0
            pt = pl.get("predicted_tok_s", "") if pl.get("status") == "ok" else ""
            notes = "; ".join(f"{x['mode']}: {status(x)}" for x in (fu, dm) if x and x["status"] != "ok")
            if pl.get("status") == "infeasible":
                notes += ("; " if notes else "") + "plan: infeasible"
            P(f"| {b / MIB:.0f} MiB | {100 * b / model_bytes:.0f}% | {fu_t:.2f} | "
              f"{num(fu, 'hit_rate') if fu else float('nan'):.3f} | {float(pt) if pt else float('nan'):.2f} | "
              f"{dm_t:.2f} | {num(dm, 'mb_read_per_token') if dm else float('nan'):.1f} | {notes} |")
            f.write(f"{b / MIB:.1f} {fu_t:.4f} {dm_t:.4f} {float(pt) if pt else 0:.4f}\n")
    with open(os.path.join(a.out, "inmem.dat"), "w") as f:
        f.write(f"{num(inmem[0], 'tok_s_mean') if inmem else 0:.4f}\n")

    P("\n### In memory: sparse vs dense (Fig. 11)\n")
    P("| engine | memory | t/s | peak RSS |")
    P("| --- | ---: | ---: | ---: |")
    for r in inmem:
        P(f"| dense, whole GGUF in memory | {fmt_mib(r['peak_rss_bytes'])} (RSS) | {num(r, 'tok_s_mean'):.2f} | "
          f"{fmt_mib(r['peak_rss_bytes'])} |")
    fulls = sorted((int(r["memory_budget_bytes"]), r) for r in sw if r["mode"] == "full" and r["status"] == "ok")
    if fulls:
        b, r = fulls[-1]
        P(f"| sparse `full`, largest budget (hit rate {num(r, 'hit_rate'):.3f}) | {b / MIB:.0f} MiB | "
          f"{num(r, 'tok_s_mean'):.2f} | {fmt_mib(r['peak_rss_bytes'])} |")
    main = [r for r in dec if r["mode"] == "full" and r["status"] == "ok"]
    for r in main:
        P(f"| sparse `full`, main budget (hit rate {num(r, 'hit_rate'):.3f}) | {fmt_mib(r['memory_budget_bytes'])} | "
          f"{num(r, 'tok_s_mean'):.2f} | {fmt_mib(r['peak_rss_bytes'])} |")

    # Quality.
    P("\n### Quality: stories260K-relu (and stories260K) on the held-out text\n")
    P("| FFN | perplexity | windows | tok/s | active / predicted neurons |")
    P("| --- | ---: | ---: | ---: | --- |")
    for name, fn in (("dense", "ppl_dense.json"), ("sparse, oracle active set", "ppl_oracle.json"),
                     ("sparse, predictor", "ppl_predictor.json"),
                     ("offloaded: deployment, oracle, 1 hot + 64 cold slots (must equal the oracle row)",
                      "ppl_offload_oracle.json"),
                     ("stories260K (SiLU): dense", "ppl_silu_dense.json"),
                     ("stories260K (SiLU): sparse oracle, 50% below threshold", "ppl_silu_oracle50.json")):
        p = os.path.join(a.work, fn)
        try:
            j = json.load(open(p))
        except (OSError, ValueError):
            P(f"| {name} | - | - | - | missing ({fn}) |")
            continue
        sp = j.get("sparse", {})
        extra = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in sp.items()
                          if isinstance(v, (int, float)))[:160]
        P(f"| {name} | {j['perplexity']:.4f} | {j['windows']} | {j['tokens_per_s']:.0f} | {extra or '-'} |")
    try:
        o = json.load(open(os.path.join(a.work, "ppl_oracle.json")))["perplexity"]
        f = json.load(open(os.path.join(a.work, "ppl_offload_oracle.json")))["perplexity"]
        P(f"\nOffloaded perplexity {f!r} is {'IDENTICAL to' if f == o else 'DIFFERENT from'} the in-memory oracle's "
          f"{o!r} (every digit of the double).")
    except (OSError, ValueError, KeyError):
        pass
    P("\n" + greedy_comparison(a.work))

if __name__ == "__main__":
    main()
