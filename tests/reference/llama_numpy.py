#!/usr/bin/python3
# Independent NumPy Llama-family forward pass (GGUF or llama2.c v0 weights) used only by tests as the reference.
"""Reference Llama forward pass for nflash tests; never used by the product.

Written from the model definition (Llama / llama2.c / Mixtral / llama.cpp's qwen2, qwen3, qwen3moe), not from
nflash's C++ code:
  h = token_embd[id]
  per layer:  a = rmsnorm(h) * attn_norm;  q, k, v = Wq a (+ bq), Wk a (+ bk), Wv a (+ bv)
              qwen3, qwen3moe: each head of q and k = rmsnorm(head) * attn_q_norm / attn_k_norm
              RoPE on the pairs (2i, 2i+1) of each head (llama) or (i, i + n_rot/2) (NEOX: the qwen architectures),
              angle = (pos / linear_factor) * theta^(-2i/n_rot)
              grouped-query attention (head h reads kv head h // (n_heads / n_kv_heads)), softmax(q.k / sqrt(hd));
              with llama.attention.sliding_window W > 0, the query at position p sees keys p - W < j <= p only
              h += Wo attn
              f = rmsnorm(h) * ffn_norm
              dense: h += down(act(gate f, up f)); silu: silu(g)*u, relu: relu(g)*u, drelu: relu(g)*relu(u)
              MoE:   p = softmax(ffn_gate_inp f) over all experts, top-k, renormalised to sum 1,
                     h += sum_e p_e * down_e(act(gate_e f, up_e f))
  logits = output (or tied token_embd) applied to rmsnorm(h) * output_norm
Weights are named as in GGUF (token_embd.weight, blk.N.attn_q.weight, ...), held numpy-style [out, in].

CLI: llama_numpy.py (--model M.gguf | --llama2c M.bin [--activation relu]) (--tokens 1,2,3 | --prompt-ids-file F)
     [--dtype f32|f64] [--chunk N] [--logits-out L.npy] [--stats-out S.json] [--greedy N]
     [--tokenizer tok512.bin] [--ppl-text FILE --ppl-window 256]
"""

import argparse
import heapq
import json
import math
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_numpy  # noqa: E402

ACTIVATIONS = ("silu", "relu", "drelu")
# Dequantized GGUF weights are kept in memory only below this size; above it they are dequantized again, in row
# chunks, at each use, so a 7B-shaped file never needs its full float copy in RAM.
CACHE_LIMIT_BYTES = 1 << 30
# Rows per dequantization chunk when streaming (a 4096-wide f32 chunk is 64 MiB).
STREAM_ROWS = 4096


# ------------------------------------------------------------------------------------------------------------ weights

class Weights:
    """Named weights from a dict of arrays or a GGUFReader. Not thread-safe."""

    def __init__(self, dtype, arrays=None, reader=None):
        self.dtype = dtype
        self.arrays = arrays
        self.reader = reader
        self.cache = {}
        self.caching = True
        if reader is not None:
            total = sum(t.n_elements for t in reader.tensors.values()) * np.dtype(dtype).itemsize
            self.caching = total <= CACHE_LIMIT_BYTES

    def has(self, name):
        return name in (self.arrays if self.arrays is not None else self.reader.tensors)

    def shape(self, name):
        if self.arrays is not None:
            return self.arrays[name].shape
        return self.reader.tensors[name].shape

    def full(self, name):
        if self.arrays is not None:
            return self.arrays[name].astype(self.dtype, copy=False)
        if name in self.cache:
            return self.cache[name]
        w = self.reader.tensor(name, self.dtype)
        if self.caching:
            self.cache[name] = w
        return w

    def vector(self, name):
        return self.full(name).reshape(-1)

    def _rows(self, name, r0, r1):
        if self.arrays is not None:
            a = self.arrays[name]
            return a.reshape(-1, a.shape[-1])[r0:r1].astype(self.dtype, copy=False)
        return self.reader.rows(name, r0, r1, self.dtype)

    def embed(self, name, ids):
        if self.arrays is not None or self.caching:
            return self.full(name)[np.asarray(ids)]
        return np.concatenate([self._rows(name, i, i + 1) for i in ids], axis=0)

    def linear(self, x, name, expert=None):
        """x [n, in] -> x @ W.T, W [out, in] (for 3-D expert tensors, the slice of `expert`)."""
        shape = self.shape(name)
        n_out = shape[-2]
        base = 0 if expert is None else expert * n_out
        if self.arrays is not None or self.caching:
            w = self.full(name)
            w = w if expert is None else w[expert]
            return x @ w.T
        out = np.empty((x.shape[0], n_out), dtype=self.dtype)
        for r0 in range(0, n_out, STREAM_ROWS):
            r1 = min(n_out, r0 + STREAM_ROWS)
            out[:, r0:r1] = x @ self._rows(name, base + r0, base + r1).T
        return out


# ------------------------------------------------------------------------------------------------------------- config

def config_from_gguf(reader):
    md = reader.metadata
    arch = md.get("general.architecture", "llama")

    def g(key, default=None):
        v = md.get(arch + "." + key, default)
        if v is None:
            raise ValueError("%s: missing metadata %s.%s" % (reader.path, arch, key))
        return v

    if arch not in ("llama", "qwen2", "qwen3", "qwen3moe"):
        raise ValueError("%s: general.architecture %r not one of llama, qwen2, qwen3, qwen3moe" % (reader.path, arch))
    dim = int(g("embedding_length"))
    n_heads = int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", dim // n_heads))  # key_length: heads not of dim / n_heads (Nemo)
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError("%s: attention.value_length differs from key_length (not modelled)" % reader.path)
    n_vocab = reader.tensors["token_embd.weight"].shape[0]
    cfg = {
        "dim": dim,
        "n_layers": int(g("block_count")),
        # qwen3moe: the experts' width has its own key (feed_forward_length would be a dense FFN's)
        "n_ff": int(g("expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length")),
        "n_heads": n_heads,
        "n_kv_heads": int(g("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "n_rot": int(g("rope.dimension_count", head_dim)),
        "n_vocab": n_vocab,
        "eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_scale": 1.0,
        "n_experts": int(g("expert_count", 0)),
        "n_experts_used": int(g("expert_used_count", 0)),
        "activation": str(md.get("nflash.ffn_activation", "silu")),
        "sliding_window": int(g("attention.sliding_window", 0)),  # 0: none
        "rope_neox": arch != "llama",  # llama.cpp's rope type for qwen2/qwen3/qwen3moe
        "qk_norm": arch in ("qwen3", "qwen3moe"),
    }
    if md.get(arch + ".rope.scaling.type") == "linear":
        cfg["rope_scale"] = float(g("rope.scaling.factor", 1.0))
    if "rope_freqs.weight" in reader.tensors:  # llama3 scaling, llama.cpp's form: frequency i divided by element i
        cfg["rope_freqs"] = reader.tensor("rope_freqs.weight", np.float64).reshape(-1)
    if cfg["activation"] not in ACTIVATIONS:
        raise ValueError("%s: nflash.ffn_activation %r not one of %s" % (reader.path, cfg["activation"], ACTIVATIONS))
    return cfg


def load_gguf(path, dtype):
    reader = gguf_numpy.GGUFReader(path)
    return config_from_gguf(reader), Weights(dtype, reader=reader)


def load_llama2c(path, activation, dtype):
    """llama2.c legacy v0 checkpoint: 7 int32 header, then fp32 arrays (order in models/stories260K/README.md)."""
    raw = np.fromfile(path, dtype=np.uint8)
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    head_size = dim // n_heads
    kv_dim = n_kv_heads * head_size
    f = raw[28:].view("<f4")
    pos = [0]

    def take(*shape):
        n = int(np.prod(shape))
        if pos[0] + n > len(f):
            raise ValueError("%s: truncated: need %d floats at float offset %d, file has %d"
                             % (path, n, pos[0], len(f)))
        a = f[pos[0]:pos[0] + n].reshape(shape)
        pos[0] += n
        return a

    w = {}
    w["token_embd.weight"] = take(vocab, dim)
    order = [("attn_norm", (dim,)), ("attn_q", (dim, dim)), ("attn_k", (kv_dim, dim)), ("attn_v", (kv_dim, dim)),
             ("attn_output", (dim, dim)), ("ffn_norm", (dim,)), ("ffn_gate", (hidden, dim)),
             ("ffn_down", (dim, hidden)), ("ffn_up", (hidden, dim))]
    for name, shape in order:
        for layer in range(n_layers):
            w["blk.%d.%s.weight" % (layer, name)] = take(*shape)
    w["output_norm.weight"] = take(dim)
    take(seq_len, head_size // 2)  # freq_cis_real: unused, RoPE is recomputed
    take(seq_len, head_size // 2)  # freq_cis_imag
    if not shared:
        w["output.weight"] = take(vocab, dim)
    if pos[0] != len(f):
        raise ValueError("%s: %d trailing floats after the last array" % (path, len(f) - pos[0]))
    cfg = {"dim": dim, "n_layers": n_layers, "n_ff": hidden, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
           "head_dim": head_size, "n_rot": head_size, "n_vocab": vocab, "eps": 1e-5, "rope_theta": 10000.0,
           "rope_scale": 1.0, "n_experts": 0, "n_experts_used": 0, "activation": activation}
    return cfg, Weights(dtype, arrays={k: np.array(v) for k, v in w.items()})


# ------------------------------------------------------------------------------------------------------------ forward

def rmsnorm(x, w, eps):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + x.dtype.type(eps)) * w


def rope(x, positions, cfg):
    """x [n, heads, head_dim]; rotates pairs of the first n_rot dims of each head: (2i, 2i+1), or (i, i + n_rot/2)
    with cfg["rope_neox"]."""
    n_rot = cfg["n_rot"]
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = cfg["rope_theta"] ** (-2.0 * i / n_rot)
    if cfg.get("rope_freqs") is not None:
        inv_freq = inv_freq / cfg["rope_freqs"]
    ang = (np.asarray(positions, dtype=np.float64) / cfg["rope_scale"])[:, None] * inv_freq[None, :]  # [n, n_rot/2]
    cos = np.cos(ang).astype(x.dtype)[:, None, :]
    sin = np.sin(ang).astype(x.dtype)[:, None, :]
    out = x.copy()
    if cfg.get("rope_neox"):
        first, second = slice(0, n_rot // 2), slice(n_rot // 2, n_rot)
    else:
        first, second = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x0 = x[:, :, first]
    x1 = x[:, :, second]
    out[:, :, first] = x0 * cos - x1 * sin
    out[:, :, second] = x0 * sin + x1 * cos
    return out


def silu(x):
    return x / (x.dtype.type(1) + np.exp(-x))


def ffn_act(g, u, activation):
    """Returns (hidden activation, boolean 'active' mask used by the stats)."""
    if activation == "silu":
        return silu(g) * u, g > 0
    if activation == "relu":
        return np.maximum(g, 0) * u, g > 0
    if activation == "drelu":
        return np.maximum(g, 0) * np.maximum(u, 0), (g > 0) & (u > 0)
    raise ValueError("unknown activation %r" % activation)


class Llama:
    """Forward pass with a KV cache; feed tokens in chunks of any size (1 = token by token). Not thread-safe."""

    def __init__(self, cfg, weights, dtype=np.float32, collect_stats=False):
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.collect_stats = collect_stats
        self.reset()

    def reset(self, keep_stats=False):
        """Empties the KV cache (position 0); keep_stats keeps the activation records for stats()."""
        c = self.cfg
        self.pos = 0
        self.k_cache = [np.zeros((0, c["n_kv_heads"], c["head_dim"]), self.dtype) for _ in range(c["n_layers"])]
        self.v_cache = [np.zeros((0, c["n_kv_heads"], c["head_dim"]), self.dtype) for _ in range(c["n_layers"])]
        if not keep_stats:
            # per layer, one record per forward() call: dense: bool [n, n_ff]; MoE: (bool [n, E, n_ff], bool [n, E])
            self.masks = [[] for _ in range(c["n_layers"])]

    def forward(self, ids):
        """Feeds ids (positions self.pos ..); returns logits [len(ids), n_vocab] in self.dtype."""
        c, w = self.cfg, self.w
        n = len(ids)
        positions = np.arange(self.pos, self.pos + n)
        h = w.embed("token_embd.weight", ids).astype(self.dtype)
        H, KVH, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        group = H // KVH
        scale = self.dtype(1.0 / math.sqrt(hd))
        for L in range(c["n_layers"]):
            p = "blk.%d." % L
            a = rmsnorm(h, w.vector(p + "attn_norm.weight"), c["eps"])
            q = w.linear(a, p + "attn_q.weight").reshape(n, H, hd)
            k = w.linear(a, p + "attn_k.weight").reshape(n, KVH, hd)
            v = w.linear(a, p + "attn_v.weight").reshape(n, KVH, hd)
            for name, t in (("attn_q.bias", q), ("attn_k.bias", k), ("attn_v.bias", v)):  # optional (Qwen2)
                if w.has(p + name):
                    t += w.vector(p + name).reshape(t.shape[1], hd)
            if c.get("qk_norm"):  # per head, over head_dim, one weight vector shared by the heads
                q = rmsnorm(q, w.vector(p + "attn_q_norm.weight"), c["eps"])
                k = rmsnorm(k, w.vector(p + "attn_k_norm.weight"), c["eps"])
            q = rope(q, positions, c)
            k = rope(k, positions, c)
            K = self.k_cache[L] = np.concatenate([self.k_cache[L], k], axis=0)  # [T, KVH, hd]
            V = self.v_cache[L] = np.concatenate([self.v_cache[L], v], axis=0)
            T = K.shape[0]
            kv_index = np.arange(H) // group                      # head h -> kv head h // group
            Kh = K[:, kv_index, :].transpose(1, 0, 2)             # [H, T, hd]
            Vh = V[:, kv_index, :].transpose(1, 0, 2)
            s = np.matmul(q.transpose(1, 0, 2), Kh.transpose(0, 2, 1)) * scale  # [H, n, T]
            mask = np.arange(T)[None, :] > positions[:, None]     # key after the query: hidden
            if c.get("sliding_window", 0) > 0:                    # and keys W or more positions back
                mask |= positions[:, None] - np.arange(T)[None, :] >= c["sliding_window"]
            s = np.where(mask[None], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            e = np.exp(s)
            pr = e / e.sum(axis=-1, keepdims=True)
            att = np.matmul(pr, Vh).transpose(1, 0, 2).reshape(n, H * hd)  # [n, H * hd]
            h = h + w.linear(att, p + "attn_output.weight")
            f = rmsnorm(h, w.vector(p + "ffn_norm.weight"), c["eps"])
            if c["n_experts"] > 0:
                h = h + self._moe(f, L)
            else:
                g = w.linear(f, p + "ffn_gate.weight")
                u = w.linear(f, p + "ffn_up.weight")
                act, active = ffn_act(g, u, c["activation"])
                if self.collect_stats:
                    self.masks[L].append(active)
                h = h + w.linear(act, p + "ffn_down.weight")
        self.pos += n
        out = rmsnorm(h, w.vector("output_norm.weight"), c["eps"])
        head = "output.weight" if w.has("output.weight") else "token_embd.weight"
        return w.linear(out, head)

    def _moe(self, f, L):
        c, w = self.cfg, self.w
        p = "blk.%d." % L
        n, E, k = f.shape[0], c["n_experts"], c["n_experts_used"]
        logits = w.linear(f, p + "ffn_gate_inp.weight")          # [n, E]
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(z)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        # top-k by probability; ties go to the lower expert index (stable sort of the negated values)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [n, k]
        topw = np.take_along_axis(probs, top, axis=-1)
        topw = topw / topw.sum(axis=-1, keepdims=True)
        out = np.zeros_like(f)
        active_all = np.zeros((n, E, c["n_ff"]), dtype=bool)
        selected = np.zeros((n, E), dtype=bool)
        for e in range(E):
            rows, slot = np.nonzero(top == e)
            if len(rows) == 0:
                continue
            x = f[rows]
            g = w.linear(x, p + "ffn_gate_exps.weight", expert=e)
            u = w.linear(x, p + "ffn_up_exps.weight", expert=e)
            act, active = ffn_act(g, u, c["activation"])
            y = w.linear(act, p + "ffn_down_exps.weight", expert=e)
            out[rows] += topw[rows, slot][:, None].astype(f.dtype) * y
            active_all[rows, e] = active
            selected[rows, e] = True
        if self.collect_stats:
            self.masks[L].append((active_all, selected))
        return out

    # -------------------------------------------------------------------------------------------------------- stats
    def stats(self):
        c = self.cfg
        key = "positive_gate_fraction" if c["activation"] == "silu" else "active_fraction"
        layers = []
        for L in range(c["n_layers"]):
            if c["n_experts"] == 0:
                m = np.concatenate(self.masks[L], axis=0)        # [n_tokens, n_ff]
                layers.append({key: float(m.mean()), "neuron_counts": m.sum(axis=0).astype(int).tolist(),
                               "consecutive_jaccard": _jaccard(m)})
                continue
            act = np.concatenate([a for a, _ in self.masks[L]], axis=0)  # [n, E, n_ff]
            sel = np.concatenate([s for _, s in self.masks[L]], axis=0)  # [n, E]
            n_tok = act.shape[0]
            k = c["n_experts_used"]
            experts = []
            for e in range(c["n_experts"]):
                routed = act[sel[:, e], e]                             # [n_routed, n_ff]
                experts.append({"expert": e, "n_tokens": int(sel[:, e].sum()),
                                key: float(routed.mean()) if len(routed) else 0.0,
                                "neuron_counts": routed.sum(axis=0).astype(int).tolist(),
                                "consecutive_jaccard": _jaccard(routed)})
            flat = act.reshape(n_tok, -1)
            layers.append({key: float(flat.sum() / (n_tok * k * c["n_ff"])),
                           "neuron_counts": flat.sum(axis=0).astype(int).tolist(),
                           "consecutive_jaccard": _jaccard(flat), "experts": experts})
        n_tokens = int(sum(m.shape[0] if not isinstance(m, tuple) else m[0].shape[0] for m in self.masks[0])) \
            if c["n_layers"] else 0
        return {"n_tokens": n_tokens, "activation": c["activation"], "layers": layers}


def _jaccard(m):
    """Mean |A_t & A_t+1| / |A_t | A_t+1| over consecutive rows; two empty sets count as identical (1.0)."""
    if m.shape[0] < 2:
        return None
    inter = (m[1:] & m[:-1]).sum(axis=1)
    union = (m[1:] | m[:-1]).sum(axis=1)
    j = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return float(j.mean())


# ---------------------------------------------------------------------------------------------- llama2.c tokenizer

class Llama2cTokenizer:
    """tok512.bin format: int32 max_token_length, then per token: float32 score, int32 length, bytes."""

    def __init__(self, path, vocab_size):
        b = open(path, "rb").read()
        p = 4
        self.pieces, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", b, p)
            p += 8
            self.pieces.append(b[p:p + n])
            p += n
            self.scores.append(score)
        self.lookup = {}
        for i, s in enumerate(self.pieces):
            self.lookup.setdefault(s, i)

    def decode_piece(self, prev, tok):
        piece = self.pieces[tok]
        if prev == 1 and piece.startswith(b" "):
            piece = piece[1:]  # BOS strips the leading space (llama2.c decode)
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            return bytes([int(piece[3:5], 16)])
        return piece

    def decode(self, ids, prev=1):
        out = b""
        for t in ids:
            out += self.decode_piece(prev, t)
            prev = t
        return out

    def encode(self, text, bos=True):
        """llama2.c encode(): dummy-prefix space, codepoints (byte fallback +3), then greedy best-score merges
        (leftmost pair among equal scores). Heap + linked list instead of llama2.c's O(n^2) scan, same result."""
        data = text.encode("utf-8")
        toks = []
        if bos:
            toks.append(1)
        if data:
            toks.append(self.lookup[b" "])
        i = 0
        while i < len(data):
            j = i + 1
            while j < len(data) and (data[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            cp = data[i:j]
            if cp in self.lookup:
                toks.append(self.lookup[cp])
            else:
                toks.extend(b + 3 for b in cp)
            i = j
        n = len(toks)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        ver = [0] * n
        heap = []

        def push(a):
            bnode = nxt[a]
            if bnode >= n:
                return
            m = self.lookup.get(self.pieces[toks[a]] + self.pieces[toks[bnode]])
            if m is not None:
                heapq.heappush(heap, (-self.scores[m], a, ver[a], ver[bnode], bnode, m))

        for a in range(n - 1):
            push(a)
        while heap:
            _, a, va, vb, bnode, m = heapq.heappop(heap)
            if not (alive[a] and alive[bnode] and nxt[a] == bnode and ver[a] == va and ver[bnode] == vb):
                continue
            toks[a] = m
            ver[a] += 1
            alive[bnode] = False
            nxt[a] = nxt[bnode]
            if nxt[a] < n:
                prv[nxt[a]] = a
            if prv[a] >= 0:
                push(prv[a])
            push(a)
        out = []
        a = 0
        while a < n:
            out.append(toks[a])
            a = nxt[a]
        return out


# --------------------------------------------------------------------------------------------------------------- CLI

def greedy(model, prompt, n_new, chunk=0):
    """Feeds the prompt, then n_new greedy tokens (argmax, lowest id on ties); returns the new ids."""
    model.reset()
    logits = run_chunks(model, prompt, chunk)
    out = []
    for _ in range(n_new):
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        logits = model.forward([nxt])
    return out


def run_chunks(model, ids, chunk):
    if chunk <= 0:
        return model.forward(list(ids))
    return np.concatenate([model.forward(list(ids[i:i + chunk])) for i in range(0, len(ids), chunk)], axis=0)


def perplexity(model, ids, window):
    """The models/stories260K/README.md method: windows of `window` ids from an empty context."""
    n_win = (len(ids) - 1) // window
    nll, count = 0.0, 0
    for i in range(n_win):
        model.reset()
        x = ids[window * i: window * i + window]
        y = np.asarray(ids[window * i + 1: window * i + window + 1])
        lg = model.forward(x).astype(np.float64)
        lg = lg - lg.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(lg).sum(axis=-1))
        nll += float((lse - lg[np.arange(len(y)), y]).sum())
        count += len(y)
    return math.exp(nll / count), n_win, count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="GGUF file (llama architecture)")
    src.add_argument("--llama2c", help="llama2.c legacy v0 checkpoint")
    ap.add_argument("--activation", choices=ACTIVATIONS, default="silu", help="FFN activation of a --llama2c model")
    ap.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--prompt-ids-file", help="file of token ids (whitespace/comma separated, or a JSON list)")
    ap.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    ap.add_argument("--chunk", type=int, default=0, help="feed the prompt in chunks of N tokens (1 = token by token; "
                    "default: whole sequence at once)")
    ap.add_argument("--logits-out", help="write float32 logits [n_tokens, n_vocab] (.npy)")
    ap.add_argument("--stats-out", help="write FFN activation statistics (JSON)")
    ap.add_argument("--greedy", type=int, default=0, help="greedily generate N tokens; prints their ids as JSON")
    ap.add_argument("--tokenizer", help="llama2.c tokenizer (tok512.bin): decode --greedy output to stderr")
    ap.add_argument("--ppl-text", help="print the perplexity of this text (needs --tokenizer)")
    ap.add_argument("--ppl-window", type=int, default=256)
    args = ap.parse_args(argv)

    dtype = np.float32 if args.dtype == "f32" else np.float64
    if args.model:
        cfg, weights = load_gguf(args.model, dtype)
    else:
        cfg, weights = load_llama2c(args.llama2c, args.activation, dtype)
    model = Llama(cfg, weights, dtype, collect_stats=bool(args.stats_out))

    if args.ppl_text:
        if not args.tokenizer:
            ap.error("--ppl-text needs --tokenizer")
        tok = Llama2cTokenizer(args.tokenizer, cfg["n_vocab"])
        with open(args.ppl_text, "rb") as fh:
            text = fh.read().decode("utf-8")
        ids = tok.encode(text, bos=True)
        ppl, n_win, count = perplexity(model, ids, args.ppl_window)
        print(json.dumps({"perplexity": ppl, "n_ids": len(ids), "windows": n_win, "predictions": count}))
        return 0

    if args.tokens:
        ids = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
    elif args.prompt_ids_file:
        with open(args.prompt_ids_file) as fh:
            s = fh.read().strip()
        ids = json.loads(s) if s.startswith("[") else [int(t) for t in s.replace(",", " ").split()]
    else:
        ap.error("give --tokens or --prompt-ids-file")
    if not ids:
        ap.error("no token ids")
    bad = [t for t in ids if not 0 <= t < cfg["n_vocab"]]
    if bad:
        ap.error("token ids out of range [0, %d): %s" % (cfg["n_vocab"], bad[:5]))

    logits = run_chunks(model, ids, args.chunk)
    if args.logits_out:
        np.save(args.logits_out, logits.astype(np.float32))
    if args.stats_out:
        with open(args.stats_out, "w") as fh:
            json.dump(model.stats(), fh)
    if args.greedy > 0:
        out = []
        for _ in range(args.greedy):
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            logits = model.forward([nxt])
        print(json.dumps(out))
        if args.tokenizer:
            tok = Llama2cTokenizer(args.tokenizer, cfg["n_vocab"])
            sys.stderr.write(tok.decode((ids + out)[1:], prev=ids[0]).decode("utf-8", "replace") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
