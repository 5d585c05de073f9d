#!/usr/bin/python3
"""Per-token A/B of `nflash offload --warm-next-ab SEED --json` (or `--pin-threads-ab SEED`, `--lookahead-input-ab
SEED`) runs: fits

    token_ms = run level + b * reads + effect * on

by least squares over every measured token of every run given (one level per run absorbs the host's drift between
runs; the reads absorb the tokens' different I/O) and prints the effect with its standard error. Use a different
seed per run, so that the same token is not always in the same group:

    for s in $(seq 1 14); do nflash -q offload -d DEPLOY --plan PLAN -n 60 --warmup 8 --json --warm-next-ab $s \\
        > ab_$s.json; done
    scripts/ab_tokens.py ab_*.json

Needs numpy (Debian python3-numpy); a development tool, not part of the product's path.
"""
import json
import sys

import numpy as np


SWITCHES = {"warm_next_ab": "warming", "pin_threads_ab": "pinning", "lookahead_input_ab": "the guess through the table"}


def main(paths):
    rows = []  # (ms, reads, on, run)
    name = None
    for r, path in enumerate(paths):
        with open(path) as f:
            d = json.load(f)
        keys = [k for k in SWITCHES if k in d]
        if len(keys) != 1 or (name is not None and keys[0] != name):
            sys.exit(f"{path}: expected exactly one of {', '.join(SWITCHES)}, the same in every run "
                     "(run with --warm-next-ab, --pin-threads-ab or --lookahead-input-ab SEED, and --json)")
        name = keys[0]
        ab = d[name]
        lat, req, on = d["token_latencies_ms"], d["token_requests"], ab["token_on"]
        if not (len(lat) == len(req) == len(on)):
            sys.exit(f"{path}: token_latencies_ms, token_requests and {name}.token_on differ in length "
                     f"({len(lat)}, {len(req)}, {len(on)})")
        rows += [(a, b, c, r) for a, b, c in zip(lat, req, on)]
    a = np.array(rows, dtype=float)
    if len(a) == 0 or a[:, 2].min() == a[:, 2].max():
        sys.exit(f"need tokens with the {SWITCHES[name]} on and off")
    runs = len(paths)
    x = np.column_stack([a[:, 1], a[:, 2]] + [(a[:, 3] == r).astype(float) for r in range(runs)])
    coef, _, _, _ = np.linalg.lstsq(x, a[:, 0], rcond=None)
    resid = a[:, 0] - x @ coef
    dof = len(a) - x.shape[1]
    cov = (resid @ resid / dof) * np.linalg.pinv(x.T @ x)
    on, off = a[a[:, 2] == 1, 0], a[a[:, 2] == 0, 0]
    print(f"{len(a)} tokens in {runs} runs: {len(on)} on, {len(off)} off")
    print(f"mean on {on.mean():.2f} ms, off {off.mean():.2f} ms; median on {np.median(on):.2f}, off {np.median(off):.2f}")
    print(f"fit: {coef[0] * 1000:.2f} us per read; {SWITCHES[name]} effect {coef[1]:+.2f} ms per token "
          f"(standard error {np.sqrt(cov[1, 1]):.2f})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
