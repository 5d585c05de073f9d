#!/usr/bin/env python3
"""The server's prompt cache, measured: a two-turn conversation against a running `nflash serve`, the second turn's
prompt evaluated with the cache (its first turn's prompt and completion kept) and without (`cache_prompt: false`),
alternating for ROUNDS rounds; prints each round's prompt time and the medians.

Usage: scripts/prompt_cache_bench.py URL [--rounds 5] [--prompt TEXT] [--first 32] [--second 16] [--suffix TEXT]
       URL: http://127.0.0.1:PORT of `nflash serve ... --port PORT` (start it first).
Not part of the product: a measuring tool (python3's standard library only).
"""
import argparse
import json
import statistics
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily. She liked to play in the "
                                        "park with her friends and her dog.")
    ap.add_argument("--first", type=int, default=32, help="tokens the first turn generates")
    ap.add_argument("--second", type=int, default=16, help="tokens the second turn generates")
    ap.add_argument("--suffix", default=" Then her mom called her home.")
    a = ap.parse_args()
    rows = {True: [], False: []}
    print("round  cache  prompt_tokens  cache_n  prompt_n  prompt_ms  predicted_per_second")
    for r in range(a.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            one = post(a.url, {"prompt": a.prompt, "n_predict": a.first, "temperature": 0, "cache_prompt": False})
            turn = a.prompt + one["content"] + a.suffix
            two = post(a.url, {"prompt": turn, "n_predict": a.second, "temperature": 0, "cache_prompt": cached})
            t = two["timings"]
            rows[cached].append((t["prompt_ms"], two))
            print("%5d  %5s  %13d  %7d  %8d  %9.1f  %20.2f" % (r + 1, "on" if cached else "off", two["tokens_evaluated"],
                                                               t["cache_n"], t["prompt_n"], t["prompt_ms"],
                                                               t["predicted_per_second"]))
    on = statistics.median(ms for ms, _ in rows[True])
    off = statistics.median(ms for ms, _ in rows[False])
    same = all(x["content"] == y["content"] for (_, x), (_, y) in zip(rows[True], rows[False]))
    print("median prompt_ms: cache on %.1f, off %.1f (%.1fx); second turn's text the same both ways: %s" %
          (on, off, off / on if on > 0 else float("inf"), same))


if __name__ == "__main__":
    main()
