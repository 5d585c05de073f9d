#!/usr/bin/env python3
"""Summarizes an `nflash offload --trace-events FILE` timeline: per decode token, where its time went on the compute
thread (attention, FFN, of which waiting for reads) and when the I/O thread had reads in flight (during the attention,
during the FFN). Prints the per-token means over the tokens from --skip on (the warm-up steps).

Usage: scripts/trace_summary.py TRACE.json [--skip 8]
Reads only the file (Chrome Trace Event Format, docs/runtime.md "Timeline trace"); Python 3 standard library.
"""
import argparse
import json
import sys


def overlap(intervals, lo, hi):
    """Total length of the union of sorted, disjoint `intervals` inside [lo, hi)."""
    total = 0.0
    for a, b in intervals:
        if b <= lo:
            continue
        if a >= hi:
            break
        total += min(b, hi) - max(a, lo)
    return total


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=0, help="tokens to leave out at the start (warm-up)")
    args = ap.parse_args()
    with open(args.trace) as f:
        doc = json.load(f)
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    by_name = {}
    for e in spans:
        by_name.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"], e.get("args", {})))
    tokens = sorted(by_name.get("token", []))[args.skip:]
    if not tokens:
        sys.exit(f"{args.trace}: no token spans after --skip {args.skip}")
    # Reads ahead: the lookahead's guesses ("reads ahead"), or a layer's MoE experts' sets read as one stream
    # ("experts' reads ahead": the siblings' sets, or an MoE guess's).
    ahead_names = ("reads ahead", "experts' reads ahead")
    io = union([(a, b) for name in ("reads",) + ahead_names for a, b, _ in by_name.get(name, [])])
    attention = sorted((a, b) for a, b, _ in by_name.get("attention", []))
    ffn = sorted((a, b) for a, b, _ in by_name.get("ffn", []))
    wait = sorted((a, b) for a, b, _ in by_name.get("wait", []))
    reads = sorted(by_name.get("reads", []))
    ahead = sorted(span for name in ahead_names for span in by_name.get(name, []))
    rows = {k: 0.0 for k in ("token", "attention", "ffn", "wait", "io", "io_attention", "io_ffn", "requests",
                             "requests_ahead", "streams", "ahead_in_ffn")}
    for lo, hi, _ in tokens:
        rows["token"] += hi - lo
        rows["attention"] += overlap(attention, lo, hi)
        rows["ffn"] += overlap(ffn, lo, hi)
        rows["wait"] += overlap(wait, lo, hi)
        rows["io"] += overlap(io, lo, hi)
        rows["io_attention"] += sum(overlap(io, a, b) for a, b in attention if lo <= a < hi)
        rows["io_ffn"] += sum(overlap(io, a, b) for a, b in ffn if lo <= a < hi)
        # Reads ahead for a layer (streams that began before its FFN) still in flight after the FFN began: its own
        # misses' stream queues behind them.
        for a, b in ffn:
            if lo <= a < hi:
                rows["ahead_in_ffn"] += sum(max(0.0, min(e, b) - a) for s0, e, _ in ahead if s0 < a)
        rows["requests"] += sum(x.get("count", 0) for a, _, x in reads if lo <= a < hi)
        rows["requests_ahead"] += sum(x.get("count", 0) for a, _, x in ahead if lo <= a < hi)
        rows["streams"] += sum(1 for a, _, _ in reads + ahead if lo <= a < hi)
    n = len(tokens)
    ms = {k: v / n / 1e3 for k, v in rows.items()}  # microseconds -> ms per token
    print(f"{n} tokens (after {args.skip} skipped), per token:")
    print(f"  time                 {ms['token']:8.2f} ms")
    print(f"  attention            {ms['attention']:8.2f} ms  ({100 * ms['attention'] / ms['token']:.0f}%)")
    print(f"  ffn                  {ms['ffn']:8.2f} ms  ({100 * ms['ffn'] / ms['token']:.0f}%), of which waiting "
          f"for reads {ms['wait']:.2f} ms")
    print(f"  reads in flight      {ms['io']:8.2f} ms  ({100 * ms['io'] / ms['token']:.0f}% of the time): "
          f"{ms['io_attention']:.2f} ms during attention ({100 * ms['io_attention'] / max(ms['attention'], 1e-9):.0f}% "
          f"of it), {ms['io_ffn']:.2f} ms during the FFN ({100 * ms['io_ffn'] / max(ms['ffn'], 1e-9):.0f}% of it)")
    print(f"  late reads ahead     {ms['ahead_in_ffn']:8.2f} ms  (a layer's guessed reads still in flight after its "
          f"FFN began: its misses queue behind them)")
    print(f"  requests             {rows['requests'] / n:8.1f} for the layer's misses, "
          f"{rows['requests_ahead'] / n:.1f} read ahead, in {rows['streams'] / n:.1f} streams")
    dropped = doc.get("otherData", {}).get("dropped_spans", 0)
    if dropped:
        print(f"  warning: the trace dropped {dropped} spans (its capacity): the figures miss them")


if __name__ == "__main__":
    main()
