#!/usr/bin/env python3
"""Replays an active-set trace (`nflash offload --trace-active FILE`) through cache policies of a given size and
prints each policy's miss rate over the last decode tokens: what the cold region could gain from another policy.

The cache is one pool of SLOTS neuron bundles over every layer (the runtime's per-layer partitions plus its overflow
pool behave close to that: SYNTHETIC 7B trace, runtime 0.085 against 0.084 here). A miss is an active neuron that is
not cached when its layer runs; a layer's own active neurons are never evicted while it runs (they are pinned).

Policies: lru (the runtime's default), slru-P (segmented LRU with a protected share P, --cold-protected P), arc,
srrip / brrip (re-reference interval prediction), bip (LRU inserting misses at the cold end but for 1/8 of them),
tinylfu (LRU admitting a miss only when it was used more often than the victim; aged: counts halved every 4 x SLOTS
uses), lru with oracle admission (caches a miss only when it comes back within 32 tokens: the bound of any admission
filter; needs the future), and belady (evicts the bundle whose next use is furthest away: the optimum for this trace,
which needs the future).

Dense models only (every layer appears once per token). Example:
    nflash offload -d s7b16r.deploy --plan plan.json -n 40 --warmup 8 --json --trace-active trace.txt > run.json
    scripts/cache_policy_sim.py trace.txt --slots 71681 --measure-tokens 19
"""
import argparse
import collections
import heapq
import random
import sys


def read_trace(path):
    steps = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                sys.exit(f"{path}:{number}: empty line (expected: group neuron...)")
            try:
                steps.append((int(fields[0]), [int(v) for v in fields[1:]]))
            except ValueError:
                sys.exit(f"{path}:{number}: not a list of integers")
    return steps


def lru(capacity):
    cache = collections.OrderedDict()

    def step(keys):
        misses = 0
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
            else:
                misses += 1
                cache[k] = True
        while len(cache) > capacity:
            cache.popitem(last=False)  # the step's own keys are the most recent: never evicted here
        return misses

    return step


def slru(capacity, protected_share):
    probation, protected = collections.OrderedDict(), collections.OrderedDict()
    protected_cap = int(capacity * protected_share)

    def step(keys):
        misses = 0
        for k in keys:
            if k in protected:
                protected.move_to_end(k)
            elif k in probation:
                del probation[k]
                protected[k] = True
                while len(protected) > protected_cap:
                    demoted, _ = protected.popitem(last=False)
                    probation[demoted] = True
            else:
                misses += 1
                probation[k] = True
        current = set(keys)
        while len(probation) + len(protected) > capacity:
            segment = probation if probation else protected
            victim = next(iter(segment))
            if victim in current:  # pinned: every older key is gone already, so evict from the other end of the LRU
                segment = protected if segment is probation else probation
                victim = next(k for k in segment if k not in current)
            del segment[victim]
        return misses

    return step


def arc(capacity):
    t1, t2, b1, b2 = (collections.OrderedDict() for _ in range(4))
    target = [0]

    def replace(key):
        if t1 and (len(t1) > target[0] or (key in b2 and len(t1) == target[0])):
            old, _ = t1.popitem(last=False)
            b1[old] = True
        elif t2:
            old, _ = t2.popitem(last=False)
            b2[old] = True
        else:
            old, _ = t1.popitem(last=False)
            b1[old] = True

    def step(keys):
        misses = 0
        for k in keys:
            if k in t1:
                del t1[k]
                t2[k] = True
                continue
            if k in t2:
                t2.move_to_end(k)
                continue
            misses += 1
            if k in b1:
                target[0] = min(capacity, target[0] + max(1, len(b2) // max(1, len(b1))))
                replace(k)
                del b1[k]
                t2[k] = True
            elif k in b2:
                target[0] = max(0, target[0] - max(1, len(b1) // max(1, len(b2))))
                replace(k)
                del b2[k]
                t2[k] = True
            else:
                if len(t1) + len(b1) == capacity:
                    if len(t1) < capacity:
                        b1.popitem(last=False)
                        replace(k)
                    else:
                        t1.popitem(last=False)
                elif len(t1) + len(t2) + len(b1) + len(b2) >= capacity:
                    if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * capacity:
                        b2.popitem(last=False)
                    replace(k)
                t1[k] = True
        return misses

    return step


def tinylfu(capacity, halve_every=0):
    # LRU whose misses are admitted only when used more often (so far) than the LRU victim; a rejected bundle is read
    # for the step and not cached. halve_every > 0: every count is halved after that many uses (aging).
    cache = collections.OrderedDict()
    counts = collections.Counter()
    uses = [0]

    def step(keys):
        misses = 0
        current = set(keys)
        for k in keys:
            counts[k] += 1
            uses[0] += 1
            if halve_every and uses[0] % halve_every == 0:
                for key in list(counts):
                    counts[key] //= 2
            if k in cache:
                cache.move_to_end(k)
                continue
            misses += 1
            if len(cache) < capacity:
                cache[k] = True
                continue
            victim = next((v for v in cache if v not in current), None)
            if victim is None or counts[k] <= counts[victim]:
                continue
            del cache[victim]
            cache[k] = True
        return misses

    return step


def next_uses(trace_keys, never):
    # Per step, per key: the next step that uses the key again (`never` when none does).
    next_use = [None] * len(trace_keys)
    following = {}
    for i in range(len(trace_keys) - 1, -1, -1):
        next_use[i] = [following.get(k, never) for k in trace_keys[i]]
        for k in trace_keys[i]:
            following[k] = i
    return next_use


def srrip(capacity, bits=2, bimodal=0.0, seed=1):
    # Re-reference interval prediction: each bundle has an RRPV in 0..2^bits-1; a hit sets it to 0, a miss inserts it
    # at max-1 (bimodal > 0: at max except with that probability, BRRIP); evictions take a bundle at max, ageing every
    # bundle by one when there is none (the step's own bundles are pinned and skipped).
    rnd = random.Random(seed)
    top = (1 << bits) - 1
    rrpv = {}
    buckets = [collections.OrderedDict() for _ in range(top + 1)]

    def step(keys):
        misses = 0
        current = set(keys)
        for k in keys:
            if k in rrpv:
                del buckets[rrpv[k]][k]
                rrpv[k] = 0
            else:
                misses += 1
                rrpv[k] = top if bimodal > 0 and rnd.random() >= bimodal else top - 1
            buckets[rrpv[k]][k] = True
        while len(rrpv) > capacity:
            victim = next((k for k in buckets[top] if k not in current), None)
            if victim is None:
                for r in range(top - 1, -1, -1):
                    for k in list(buckets[r]):
                        if k not in current:
                            del buckets[r][k]
                            rrpv[k] = r + 1
                            buckets[r + 1][k] = True
                continue
            del buckets[top][victim]
            del rrpv[victim]
        return misses

    return step


def bip(capacity, eps, seed=1):
    # Bimodal insertion: LRU whose misses enter at the least recently used end except with probability eps.
    rnd = random.Random(seed)
    cache = collections.OrderedDict()

    def step(keys):
        misses = 0
        current = set(keys)
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
                continue
            misses += 1
            cache[k] = True
            if rnd.random() >= eps:
                cache.move_to_end(k, last=False)
        kept = []
        while len(cache) > capacity:
            k, _ = cache.popitem(last=False)
            if k in current:
                kept.append(k)
        for k in reversed(kept):
            cache[k] = True
            cache.move_to_end(k, last=False)
        return misses

    return step


def lru_oracle_admission(capacity, trace_keys, horizon_steps):
    # LRU that caches a miss only when it is used again within horizon_steps steps (needs the future): the bound of
    # any admission filter in front of LRU.
    next_use = next_uses(trace_keys, float("inf"))  # never again: never admitted
    cache = collections.OrderedDict()
    position = [0]

    def step(keys):
        i = position[0]
        position[0] += 1
        misses = 0
        for k, use in zip(keys, next_use[i]):
            if k in cache:
                cache.move_to_end(k)
            else:
                misses += 1
                if use - i <= horizon_steps:
                    cache[k] = True
        while len(cache) > capacity:
            cache.popitem(last=False)  # the step's keys are the most recent
        return misses

    return step


def belady(capacity, trace_keys):
    next_use = next_uses(trace_keys, len(trace_keys))
    cache, heap = {}, []
    position = [0]

    def step(keys):
        i = position[0]
        position[0] += 1
        misses = 0
        for k, use in zip(keys, next_use[i]):
            if k not in cache:
                misses += 1
            cache[k] = use
            heapq.heappush(heap, (-use, k))
        while len(cache) > capacity:  # the step's keys are used at i, before every other key's next use
            use, k = heapq.heappop(heap)
            if cache.get(k) == -use:
                del cache[k]
        return misses

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="file written by nflash offload --trace-active")
    ap.add_argument("--slots", type=int, required=True, help="cache size in neuron bundles (the run's cold_slots)")
    ap.add_argument("--measure-tokens", type=int, default=0,
                    help="miss rate over the last N tokens (0: every step); earlier steps only warm the cache")
    ap.add_argument("--slru", type=float, action="append", default=[], help="protected share(s) for slru")
    args = ap.parse_args()
    if args.slots <= 0:
        sys.exit("--slots must be positive")
    steps = read_trace(args.trace)
    groups = max(g for g, _ in steps) + 1
    keys = [[(g, n) for n in active] for g, active in steps]
    first = 0 if args.measure_tokens <= 0 else max(0, len(steps) - args.measure_tokens * groups)
    measured_active = sum(len(k) for k in keys[first:])
    if measured_active == 0:
        sys.exit("no active neurons in the measured steps")
    policies = [("lru", lru(args.slots))]
    policies += [(f"slru-{p:g}", slru(args.slots, p)) for p in (args.slru or [0.5])]
    policies += [("arc", arc(args.slots)), ("srrip", srrip(args.slots)), ("brrip 1/32", srrip(args.slots, 2, 1 / 32)),
                 ("bip 1/8", bip(args.slots, 1 / 8)), ("tinylfu", tinylfu(args.slots)),
                 ("tinylfu, aged", tinylfu(args.slots, 4 * args.slots)),
                 ("lru, oracle admission", lru_oracle_admission(args.slots, keys, 32 * groups)),
                 ("belady (optimum)", belady(args.slots, keys))]
    print(f"{len(steps)} steps, {groups} layers, {args.slots} slots; measured: the last {len(steps) - first} steps, "
          f"{measured_active} active neurons")
    for name, policy in policies:
        misses = 0
        for i, k in enumerate(keys):
            m = policy(k)
            if i >= first:
                misses += m
        print(f"  {name:22s} miss rate {misses / measured_active:.4f}  ({misses} misses)")


if __name__ == "__main__":
    main()
