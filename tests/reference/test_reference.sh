#!/bin/bash
# Self-check of the NumPy reference (gguf_numpy.py, llama_numpy.py, hf_numpy.py) against published outputs;
# non-zero on mismatch.
# Usage: tests/reference/test_reference.sh [--quick] [--full]
#   --quick: skip the held-out perplexity / sparsity checks (about 1-2 minutes on a busy 2-core machine)
#   --full:  also time a 7B-shaped 4-layer Q4_0 file (writes about 0.6 GB under $TMPDIR)
# Every expected value below comes from outside this code: the model READMEs under /work/shared/models (published
# greedy outputs, perplexities and sparsity numbers), hand-encoded GGUF blocks, and llama.cpp's vocab GGUF file.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
SHARED="${NFLASH_SHARED:-/work/shared}"
PY=/usr/bin/python3  # Debian's python3 has numpy; the pyenv one on PATH does not
QUICK=0
FULL=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    --full) FULL=1 ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nflash-ref.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

exec "$PY" - "$HERE" "$SHARED" "$WORK" "$QUICK" "$FULL" <<'PYEOF'
import json, math, os, re, struct, subprocess, sys, time
import numpy as np

HERE, SHARED, WORK, QUICK, FULL = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1"
sys.path.insert(0, HERE)
import gguf_numpy as G
import llama_numpy as L

M = os.path.join(SHARED, "models")
REL = os.path.join(M, "stories260K-relu", "stories260K-relu.bin")
SILU = os.path.join(M, "stories260K", "stories260K.bin")
TOK = os.path.join(M, "stories260K", "tok512.bin")
HELD_OUT = os.path.join(SHARED, "text", "tinystories_cased_197K.txt")
failures = []
passes = [0]


def check(name, ok, detail=""):
    if ok:
        passes[0] += 1
        print("PASS %s %s" % (name, detail))
    else:
        failures.append(name)
        print("FAIL %s %s" % (name, detail))


def cli(*args):
    t = time.time()
    r = subprocess.run([sys.executable, os.path.join(HERE, "llama_numpy.py")] + list(args), capture_output=True,
                       text=True)
    if r.returncode != 0:
        print(r.stderr)
    return r, time.time() - t


def readme(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def fp16_bytes(v):
    return np.float16(v).tobytes()


# ---------------------------------------------------------------- 1. dequantization of hand-encoded blocks (GGUF spec)
# Q4_0: d = 0.5, byte j = (j & 15) | ((15 - j) << 4): element j = 0.5*(j - 8), element 16+j = 0.5*(15 - j - 8).
blk = fp16_bytes(0.5) + bytes(((j & 15) | ((15 - j) << 4)) for j in range(16))
want = [0.5 * (j - 8) for j in range(16)] + [0.5 * (7 - j) for j in range(16)]
check("dequant_q4_0", np.array_equal(G.dequantize(np.frombuffer(blk, np.uint8), G.Q4_0, 32), np.float32(want)))
# Q8_0: d = 2, q = -16..15: x = 2q; a second block with d = -0.25 and q = 100 - 7j.
q1 = np.arange(-16, 16, dtype=np.int8)
q2 = np.array([100 - 7 * j for j in range(32)], dtype=np.int8)
raw = fp16_bytes(2.0) + q1.tobytes() + fp16_bytes(-0.25) + q2.tobytes()
want = np.concatenate([2.0 * q1, -0.25 * q2]).astype(np.float32)
check("dequant_q8_0", np.array_equal(G.dequantize(np.frombuffer(raw, np.uint8), G.Q8_0, 64), want))
# F16 / BF16 bit patterns: 0x3C00 = 1.0, 0xC000 = -2.0 (fp16); 0x3F80 = 1.0, 0xC0A0 = -5.0, 0x7F80 = +inf (bf16).
f16 = np.array([0x3C00, 0xC000, 0x3555], np.uint16).astype("<u2").view(np.uint8)
check("dequant_f16", np.allclose(G.dequantize(f16, G.F16, 3), [1.0, -2.0, 0.333251953125], rtol=0, atol=0))
bf = np.array([0x3F80, 0xC0A0, 0x7F80], np.uint16).astype("<u2").view(np.uint8)
check("dequant_bf16", np.array_equal(G.dequantize(bf, G.BF16, 3), np.float32([1.0, -5.0, np.inf])))

# ---------------------------------------------------------------- 2. quantizers: ggml reference rules, worked by hand
# Q4_0 of x_j = j - 16: max magnitude is x_0 = -16, d = -16 / -8 = 2, q_j = min(15, trunc((j - 16)/2 + 8.5)).
x = np.arange(32, dtype=np.float32) - 16
qs = [min(15, int((j - 16) / 2 + 8.5)) for j in range(32)]
want = fp16_bytes(2.0) + bytes(qs[j] | (qs[16 + j] << 4) for j in range(16))
check("quant_q4_0_bytes", G.quantize(x, G.Q4_0).tobytes() == want)
# Q8_0 of x_j = (j - 10) * 0.5: amax 10.5, d = 10.5/127, q = round-half-away(x * 127/10.5).
x = (np.arange(32, dtype=np.float32) - 10) * np.float32(0.5)
d = np.float32(10.5) / np.float32(127)
qv = [int(np.trunc(v + np.copysign(0.5, v))) for v in (x * (np.float32(1) / d)).astype(np.float32)]
want = fp16_bytes(d) + np.array(qv, np.int8).tobytes()
check("quant_q8_0_bytes", G.quantize(x, G.Q8_0).tobytes() == want and qv[-1] == 127 and qv[0] == -60)
rng = np.random.default_rng(7)
x = rng.standard_normal(4096).astype(np.float32)
# Q8_0: rounding error <= d/2 with d = amax/127, plus |q| * (fp16 rounding of d, <= d * 2^-11) <= 127 d 2^-11.
# Q4_0: the scale puts the signed max at -8, so the opposite extreme can be clamped at +7: error <= d = amax/8, plus
# 8 d 2^-11 from fp16.
for t, bound in ((G.Q8_0, (0.5 + 127 / 2048) / 127), (G.Q4_0, (1 + 8 / 2048) / 8)):
    y = G.dequantize(G.quantize(x, t), t, x.size)
    rel = np.max(np.abs(y - x).reshape(-1, 32) / np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True))
    check("roundtrip_%s" % G.TYPE_NAMES[t], rel <= bound, "max error / block amax = %.4f" % rel)

# ---------------------------------------------------------------- 3. a GGUF written by another tool (llama.cpp)
r = G.GGUFReader(os.path.join(M, "vocab", "ggml-vocab-llama-spm.gguf"))
md = r.metadata
check("vocab_gguf", r.version == 3 and len(md) == 22 and len(r.tensors) == 0 and
      md["general.architecture"] == "llama" and md["llama.embedding_length"] == 4096 and
      md["llama.feed_forward_length"] == 11008 and len(md["tokenizer.ggml.tokens"]) == 32000 and
      md["tokenizer.ggml.tokens"][1] == "<s>" and md["tokenizer.ggml.tokens"][3] == "<0x00>" and
      md["tokenizer.ggml.token_type"][:4] == [2, 3, 3, 6] and md["tokenizer.ggml.add_bos_token"] is True and
      abs(md["llama.attention.layer_norm_rms_epsilon"] - 1e-5) < 1e-9)

# ---------------------------------------------------------------- 4. writer -> reader round trip, all value types
p = os.path.join(WORK, "rt.gguf")
a3 = rng.standard_normal((3, 4, 64)).astype(np.float32)
meta = [("u8", 200, G.T_UINT8), ("i8", -100, G.T_INT8), ("u16", 60000, G.T_UINT16), ("i16", -30000, G.T_INT16),
        ("u32", 4000000000, G.T_UINT32), ("i32", -2000000000, G.T_INT32), ("f32", 0.5, G.T_FLOAT32),
        ("b", True, G.T_BOOL), ("s", "héllo", G.T_STRING), ("u64", 2**63 + 5, G.T_UINT64), ("i64", -2**62, G.T_INT64),
        ("f64", 0.1, G.T_FLOAT64), ("arr_s", ["a", "bc", ""], G.T_ARRAY, G.T_STRING),
        ("arr_f", [1.5, -2.0], G.T_ARRAY, G.T_FLOAT32), ("arr_arr", [[1, 2], [3]], G.T_ARRAY, G.T_ARRAY)]
G.write_gguf(p, meta, [("t_f32", a3, G.F32), ("t_f16", a3, G.F16), ("t_bf16", a3, G.BF16), ("t_q8", a3, G.Q8_0),
                       ("t_q4", a3, G.Q4_0)], alignment=64, version=2)
r = G.GGUFReader(p)
want = {"u8": 200, "i8": -100, "u16": 60000, "i16": -30000, "u32": 4000000000, "i32": -2000000000, "f32": 0.5,
        "b": True, "s": "héllo", "u64": 2**63 + 5, "i64": -2**62, "f64": 0.1, "arr_s": ["a", "bc", ""],
        "arr_f": [1.5, -2.0], "arr_arr": [[1, 2], [3]], "general.alignment": 64}
ok = r.version == 2 and r.alignment == 64 and r.data_offset % 64 == 0 and r.metadata == want
ok = ok and all(r.tensors[n].dims == [64, 4, 3] and r.tensor(n).shape == (3, 4, 64) for n in r.tensors)
ok = ok and np.array_equal(r.tensor("t_f32"), a3) and np.array_equal(r.tensor("t_f16"), a3.astype(np.float16))
ok = ok and np.allclose(r.tensor("t_bf16"), a3, rtol=1 / 128) and np.allclose(r.tensor("t_q8"), a3, atol=0.03)
ok = ok and all(np.array_equal(r.rows(n, 5, 9), r.tensor(n).reshape(12, 64)[5:9]) for n in r.tensors)
check("gguf_roundtrip", ok)

# ---------------------------------------------------------------- 5. published greedy outputs (llama2.c files)
text = readme(os.path.join(M, "stories260K-relu", "README.md"))
relu_ids = json.loads(re.search(r"next 100 greedy token ids:\s*```\s*(\[[^\]]*\])", text).group(1))
prompt = [1, 403, 407, 261, 378]
res, dt = cli("--llama2c", REL, "--activation", "relu", "--tokens", ",".join(map(str, prompt)), "--greedy", "100")
got = json.loads(res.stdout) if res.returncode == 0 else None
check("relu_greedy_100", got == relu_ids, "(%.1fs)" % dt)

text = readme(os.path.join(M, "stories260K", "README.md"))
golden = re.search(r"## Golden output.*?```\n(.*?)```", text, re.S).group(1).rstrip("\n")
cfg, w = L.load_llama2c(SILU, "silu", np.float32)
tok = L.Llama2cTokenizer(TOK, cfg["n_vocab"])
t0 = time.time()
gen = L.greedy(L.Llama(cfg, w), [1], 256)  # llama2.c run: 256 steps, stop at BOS
if 1 in gen:
    gen = gen[:gen.index(1)]
decoded = tok.decode(gen, prev=1).decode("utf-8")
check("silu_golden_text_256", decoded.rstrip("\n") == golden, "(%d tokens, %.1fs)" % (len(gen), time.time() - t0))
check("silu_golden_text_60", golden.startswith(tok.decode(gen[:60], prev=1).decode()))

# the tokenizer against the README's encoding of the prompt
check("llama2c_encode", tok.encode("Once upon a time") == prompt)

# ---------------------------------------------------------------- 6. the GGUF path gives the same model
cfg_r, w_r = L.load_llama2c(REL, "relu", np.float32)


def llama_meta(cfg, activation=None, extra=()):
    m = [("general.architecture", "llama"), ("llama.embedding_length", cfg["dim"], G.T_UINT32),
         ("llama.block_count", cfg["n_layers"], G.T_UINT32), ("llama.feed_forward_length", cfg["n_ff"], G.T_UINT32),
         ("llama.attention.head_count", cfg["n_heads"], G.T_UINT32),
         ("llama.attention.head_count_kv", cfg["n_kv_heads"], G.T_UINT32),
         ("llama.attention.layer_norm_rms_epsilon", cfg["eps"], G.T_FLOAT32),
         ("llama.rope.freq_base", cfg["rope_theta"], G.T_FLOAT32), ("llama.context_length", 512, G.T_UINT32)]
    if activation:
        m.append(("nflash.ffn_activation", activation))
    return m + list(extra)


tens = [(n, a, G.F32) for n, a in w_r.arrays.items()]
p32 = os.path.join(WORK, "relu_f32.gguf")
G.write_gguf(p32, llama_meta(cfg_r, "relu"), tens)
res, dt = cli("--model", p32, "--tokens", ",".join(map(str, prompt)), "--greedy", "100")
check("gguf_f32_relu_greedy_100", res.returncode == 0 and json.loads(res.stdout) == relu_ids, "(%.1fs)" % dt)
pq = os.path.join(WORK, "relu_q8.gguf")
G.write_gguf(pq, llama_meta(cfg_r, "relu"),
             [(n, a, G.Q8_0 if a.ndim == 2 and a.shape[1] % 32 == 0 else G.F32) for n, a in w_r.arrays.items()])
res, dt = cli("--model", pq, "--tokens", ",".join(map(str, prompt + relu_ids[:40])), "--logits-out",
              os.path.join(WORK, "q8.npy"), "--stats-out", os.path.join(WORK, "q8.json"))
lg = np.load(os.path.join(WORK, "q8.npy")) if res.returncode == 0 else np.zeros((1, 1))
ref = L.Llama(cfg_r, w_r).forward(prompt + relu_ids[:40])
agree = float(np.mean(lg.argmax(-1) == ref.argmax(-1))) if lg.shape == ref.shape else 0
check("gguf_q8_0_logits", lg.shape == (45, 512) and lg.dtype == np.float32 and agree >= 0.9,
      "(top-1 agreement with f32 %.2f, max |diff| %.3f)" % (agree, np.abs(lg - ref).max() if agree else -1))
st = json.load(open(os.path.join(WORK, "q8.json"))) if res.returncode == 0 else {}
ok = st.get("n_tokens") == 45 and len(st.get("layers", [])) == 5
for lay in st.get("layers", []):
    c = np.array(lay["neuron_counts"])
    ok = ok and len(c) == 172 and c.min() >= 0 and c.max() <= 45
    ok = ok and abs(lay["active_fraction"] - c.sum() / (45 * 172)) < 1e-9 and 0 <= lay["consecutive_jaccard"] <= 1
check("stats_json", ok)

# ---------------------------------------------------------------- 7. whole sequence == token by token (f64)
cfg64, w64 = L.load_llama2c(SILU, "silu", np.float64)
ids = [1] + gen[:40]
whole = L.Llama(cfg64, w64, np.float64).forward(ids)
m = L.Llama(cfg64, w64, np.float64)
steps = np.concatenate([m.forward([t]) for t in ids])
check("chunking_invariance", np.abs(whole - steps).max() < 1e-9, "(max diff %.2e)" % np.abs(whole - steps).max())


# ---------------------------------------------------------------- 8. MoE with identical experts == dense FFN
def random_llama(dim, n_ff, n_layers, n_heads, n_kv, vocab, seed, tied=True):
    g = np.random.default_rng(seed)
    hd = dim // n_heads
    w = {"token_embd.weight": g.standard_normal((vocab, dim)).astype(np.float32) * 0.5,
         "output_norm.weight": (1 + 0.1 * g.standard_normal(dim)).astype(np.float32)}
    if not tied:
        w["output.weight"] = g.standard_normal((vocab, dim)).astype(np.float32) / np.sqrt(dim)
    for i in range(n_layers):
        p = "blk.%d." % i
        w[p + "attn_norm.weight"] = (1 + 0.1 * g.standard_normal(dim)).astype(np.float32)
        w[p + "ffn_norm.weight"] = (1 + 0.1 * g.standard_normal(dim)).astype(np.float32)
        for n, shape in (("attn_q", (dim, dim)), ("attn_k", (n_kv * hd, dim)), ("attn_v", (n_kv * hd, dim)),
                         ("attn_output", (dim, dim)), ("ffn_gate", (n_ff, dim)), ("ffn_up", (n_ff, dim)),
                         ("ffn_down", (dim, n_ff))):
            w[p + n + ".weight"] = (g.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return w


dense = random_llama(64, 96, 2, 4, 2, 100, 1)
cfgd = dict(cfg64, dim=64, n_ff=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_rot=16, n_vocab=100,
            activation="drelu")
E, K = 4, 2
moe = {k: v for k, v in dense.items() if ".ffn_gate." not in k and ".ffn_up." not in k and ".ffn_down." not in k}
for i in range(2):
    p = "blk.%d." % i
    moe[p + "ffn_gate_inp.weight"] = rng.standard_normal((E, 64)).astype(np.float32)
    for n in ("gate", "up", "down"):
        moe[p + "ffn_%s_exps.weight" % n] = np.stack([dense[p + "ffn_%s.weight" % n]] * E)
pm = os.path.join(WORK, "moe.gguf")
G.write_gguf(pm, llama_meta(cfgd, "drelu", [("llama.expert_count", E, G.T_UINT32),
                                            ("llama.expert_used_count", K, G.T_UINT32)]),
             [(n, a, G.F32) for n, a in moe.items()])
tr = G.GGUFReader(pm).tensors["blk.0.ffn_gate_exps.weight"]
ids = list(rng.integers(0, 100, 20))
cfg_m, w_m = L.load_gguf(pm, np.float64)
mm = L.Llama(cfg_m, w_m, np.float64, collect_stats=True)
out_moe = mm.forward(ids)
md_ = L.Llama(cfgd, L.Weights(np.float64, arrays=dense), np.float64, collect_stats=True)
out_dense = md_.forward(ids)
sm, sd = mm.stats(), md_.stats()
ok = tr.dims == [64, 96, E] and np.abs(out_moe - out_dense).max() < 1e-9
ok = ok and all(sum(e["n_tokens"] for e in lay["experts"]) == 20 * K for lay in sm["layers"])
ok = ok and all(abs(a["active_fraction"] - b["active_fraction"]) < 1e-12 for a, b in zip(sm["layers"], sd["layers"]))
check("moe_identical_experts", ok, "(max diff %.2e)" % np.abs(out_moe - out_dense).max())

# distinct experts: the vectorised router/scatter against a plain per-token loop (Mixtral: softmax over all experts,
# top-k, weights renormalised to sum 1)
for i in range(2):
    p = "blk.%d." % i
    for n in ("gate", "up", "down"):
        moe[p + "ffn_%s_exps.weight" % n] = rng.standard_normal(moe[p + "ffn_%s_exps.weight" % n].shape) / 8
wm = L.Weights(np.float64, arrays=moe)
mm = L.Llama(cfg_m, wm, np.float64)
f = rng.standard_normal((7, 64))
got = mm._moe(f, 1)
want = np.zeros_like(f)
for t_ in range(7):
    z = moe["blk.1.ffn_gate_inp.weight"].astype(np.float64) @ f[t_]
    pr = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    top = sorted(range(E), key=lambda e: -pr[e])[:K]
    for e in top:
        gte = moe["blk.1.ffn_gate_exps.weight"][e] @ f[t_]
        upe = moe["blk.1.ffn_up_exps.weight"][e] @ f[t_]
        want[t_] += pr[e] / sum(pr[j] for j in top) * (moe["blk.1.ffn_down_exps.weight"][e] @
                                                       (np.maximum(gte, 0) * np.maximum(upe, 0)))
check("moe_distinct_experts_vs_loop", np.abs(got - want).max() < 1e-10 and np.abs(want).max() > 1e-3,
      "(max diff %.2e, max |out| %.3f)" % (np.abs(got - want).max(), np.abs(want).max()))

# ---------------------------------------------------------------- 9. speed: dim 256, n_ff 1024, 4 layers, 64 tokens
sp = random_llama(256, 1024, 4, 8, 4, 512, 3, tied=False)
cfgs = dict(cfg64, dim=256, n_ff=1024, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, n_rot=32, n_vocab=512)
ps = os.path.join(WORK, "speed.gguf")
G.write_gguf(ps, llama_meta(cfgs), [(n, a, G.F32 if a.ndim == 1 else G.Q4_0) for n, a in sp.items()])
res, dt = cli("--model", ps, "--tokens", ",".join(str(i * 7 % 512) for i in range(64)), "--logits-out",
              os.path.join(WORK, "sp.npy"))
check("speed_dim256_64_tokens", res.returncode == 0 and dt < 5.0, "(%.2fs wall, including Python start-up)" % dt)

# ---------------------------------------------------------------- 10. hf_numpy.py: HF directories from stories260K
# Expected values come from llama_numpy.py (GGUF/llama2.c conventions: pair-wise RoPE), which shares nothing with
# hf_numpy.py but numpy, and from formulas worked by hand. The HF directories are written here from the llama2.c file
# (layout in models/stories260K/README.md), with q/k rows permuted from llama2.c's pair order into HF's half order.
import hf_numpy as HF

t_hf = time.time()
raw = np.fromfile(SILU, np.uint8)
dim, hid, nl, nh, nkv, voc, seq = struct.unpack_from("<7i", raw, 0)
flt = raw[28:].view("<f4")
at = [0]


def take(*shape):
    n_ = int(np.prod(shape))
    a_ = flt[at[0]:at[0] + n_].reshape(shape).copy()
    at[0] += n_
    return a_


hd = dim // nh
kvd = nkv * hd
voc = abs(voc)
emb = take(voc, dim)
rms_att, wq, wk, wv, wo = take(nl, dim), take(nl, dim, dim), take(nl, kvd, dim), take(nl, kvd, dim), take(nl, dim, dim)
rms_ffn, w1, w2, w3, rms_fin = take(nl, dim), take(nl, hid, dim), take(nl, dim, hid), take(nl, hid, dim), take(dim)


def to_hf(w_, heads):
    """llama2.c rows -> HF rows, per head: HF row j*hd/2 + i = llama2.c row 2i + j (j in 0, 1)."""
    return w_.reshape(heads, hd // 2, 2, -1).transpose(0, 2, 1, 3).reshape(heads * hd, -1)


def hf_tensors(fused=False, biases=None, lm_head=None):
    t_ = {"model.embed_tokens.weight": emb, "model.norm.weight": rms_fin}
    if lm_head is not None:
        t_["lm_head.weight"] = lm_head
    for i in range(nl):
        p = "model.layers.%d." % i
        q_, k_ = to_hf(wq[i], nh), to_hf(wk[i], nkv)
        t_.update({p + "input_layernorm.weight": rms_att[i], p + "post_attention_layernorm.weight": rms_ffn[i],
                   p + "self_attn.o_proj.weight": wo[i], p + "mlp.down_proj.weight": w2[i]})
        if fused:
            t_[p + "self_attn.qkv_proj.weight"] = np.concatenate([q_, k_, wv[i]])
            t_[p + "mlp.gate_up_proj.weight"] = np.concatenate([w1[i], w3[i]])
        else:
            t_.update({p + "self_attn.q_proj.weight": q_, p + "self_attn.k_proj.weight": k_,
                       p + "self_attn.v_proj.weight": wv[i], p + "mlp.gate_proj.weight": w1[i],
                       p + "mlp.up_proj.weight": w3[i]})
        if biases is not None:
            bq, bk, bv = biases[i]
            t_.update({p + "self_attn.q_proj.bias": to_hf(bq[:, None], nh)[:, 0],
                       p + "self_attn.k_proj.bias": to_hf(bk[:, None], nkv)[:, 0], p + "self_attn.v_proj.bias": bv})
    return t_


def st_encode(a_, dt):
    a_ = np.ascontiguousarray(a_, np.float32)
    if dt == "F32":
        return a_.astype("<f4").tobytes()
    if dt == "F16":
        return a_.astype("<f2").tobytes()
    return (a_.view("<u4") >> 16).astype("<u2").tobytes()  # BF16: the top 16 bits (truncation)


def st_write(path, items):
    """Minimal safetensors writer; items: (name, dtype, shape, bytes). u64 LE header length, JSON header, data."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape, b in items:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hj)) + hj + b"".join(b for _, _, _, b in items))


MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "Phi3ForCausalLM": "phi3"}


def hf_dir(name, arch="LlamaForCausalLM", extra=None, tensors=None, dtypes=None, shards=1):
    d_ = os.path.join(WORK, "hf_" + name)
    os.makedirs(d_)
    conf = {"architectures": [arch], "model_type": MODEL_TYPE.get(arch, "x"), "hidden_size": dim,
            "intermediate_size": hid, "num_hidden_layers": nl, "num_attention_heads": nh, "num_key_value_heads": nkv,
            "vocab_size": voc, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    conf.update(extra or {})
    with open(os.path.join(d_, "config.json"), "w") as fh:
        json.dump(conf, fh, indent=1)
    items = [(n_, (dtypes or {}).get(n_, "F32"), a_.shape, st_encode(a_, (dtypes or {}).get(n_, "F32")))
             for n_, a_ in sorted((tensors if tensors is not None else hf_tensors()).items())]
    if shards == 1:
        st_write(os.path.join(d_, "model.safetensors"), items)
        return d_
    wmap = {}
    for s_ in range(shards):
        fn = "model-%05d-of-%05d.safetensors" % (s_ + 1, shards)
        st_write(os.path.join(d_, fn), items[s_::shards])
        wmap.update({it[0]: fn for it in items[s_::shards]})
    with open(os.path.join(d_, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": sum(len(it[3]) for it in items)}, "weight_map": wmap}, fh)
    return d_


def hf_logits(d_):
    """f64 logits of hf_numpy.Model; a refusal prints its message and gives NaN (every comparison then fails)."""
    try:
        return HF.Model(d_, np.float64).forward(hf_ids)
    except HF.HFError as e:
        print("     hf_numpy refused %s: %s" % (os.path.basename(d_), e))
        return np.full((len(hf_ids), voc), np.nan)


def ref_logits(arrays=None, **cfg_changes):
    """llama_numpy.py on the llama2.c weights (GGUF names), f64, with config / array changes."""
    return L.Llama(dict(cfg64, **cfg_changes), L.Weights(np.float64, arrays=dict(w64.arrays, **(arrays or {}))),
                   np.float64).forward(hf_ids)


def mx(a_, b_):
    return float(np.abs(a_ - b_).max())


def hf_cli(*args):
    return subprocess.run([sys.executable, os.path.join(HERE, "hf_numpy.py")] + list(args), capture_output=True,
                          text=True)


hf_ids = [1] + gen[:31]  # 32 ids of the golden story
base = ref_logits()
d_llama = hf_dir("llama")
lg_llama = hf_logits(d_llama)
check("hf_llama_vs_llama_numpy", mx(lg_llama, base) < 1e-6 and np.abs(base).max() > 1,
      "(32 tokens, f64, max diff %.2e)" % mx(lg_llama, base))
# the same directory with q/k left in llama2.c order must not pass (the permutation is what makes HF RoPE agree)
t_raw = hf_tensors()
for i in range(nl):
    t_raw["model.layers.%d.self_attn.q_proj.weight" % i] = wq[i]
    t_raw["model.layers.%d.self_attn.k_proj.weight" % i] = wk[i]
check("hf_llama_unpermuted_qk_differs", mx(hf_logits(hf_dir("llama_unpermuted", tensors=t_raw)), base) > 0.1)

# CLI: f64 run, float32 .npy, one-line JSON summary
res = hf_cli("--dir", d_llama, "--tokens", ",".join(map(str, hf_ids)), "--dtype", "f64", "--logits-out",
             os.path.join(WORK, "hf.npy"))
js = json.loads(res.stdout) if res.returncode == 0 else {}
lg = np.load(os.path.join(WORK, "hf.npy")) if res.returncode == 0 else np.zeros(1)
check("hf_cli_f64", js == {"n_tokens": 32, "vocab": 512, "argmax_last": int(np.argmax(base[-1]))} and
      lg.dtype == np.float32 and lg.shape == (32, 512) and np.array_equal(lg, lg_llama.astype(np.float32)),
      "(%s)" % js)
with open(os.path.join(WORK, "ids.txt"), "w") as fh:
    fh.write(json.dumps(hf_ids))
res = hf_cli("--dir", d_llama, "--prompt-ids-file", os.path.join(WORK, "ids.txt"), "--logits-out",
             os.path.join(WORK, "hf32.npy"))
lg = np.load(os.path.join(WORK, "hf32.npy")) if res.returncode == 0 else np.zeros((1, 1))
check("hf_cli_f32", res.returncode == 0 and lg.shape == (32, 512) and mx(lg, base) < 1e-3 and
      float(np.mean(lg.argmax(-1) == base.argmax(-1))) == 1.0, "(max diff to f64 %.2e)" % mx(lg, base))

# safetensors reading: hand-encoded bit patterns (BF16 0x3F80 = 1, 0xC0A0 = -5, 0x7F80 = +inf; F16 0x3C00 = 1,
# 0xC000 = -2), then sharded files with BF16 / F16 tensors against the same values rounded here
p_st = os.path.join(WORK, "bits.safetensors")
st_write(p_st, [("b", "BF16", (3,), np.array([0x3F80, 0xC0A0, 0x7F80], "<u2").tobytes()),
                ("h", "F16", (2, 1), np.array([0x3C00, 0xC000], "<u2").tobytes()),
                ("f", "F32", (1,), np.array([0.25], "<f4").tobytes())])
sf = HF.SafetensorsFile(p_st)
check("hf_safetensors_bits", np.array_equal(HF.to_float(sf.raw("b"), "BF16", np.float64), [1.0, -5.0, np.inf]) and
      np.array_equal(HF.to_float(sf.raw("h"), "F16", np.float32), [[1.0], [-2.0]]) and
      HF.to_float(sf.raw("f"), "F32", np.float64).tolist() == [0.25] and sf.metadata == {"format": "pt"})
bf_emb = (emb.view("<u4") & np.uint32(0xFFFF0000)).view(np.float32)
f16_norm = rms_att[0].astype(np.float16).astype(np.float32)
d_bf = hf_dir("bf16_sharded", dtypes={"model.embed_tokens.weight": "BF16", "model.layers.0.input_layernorm.weight":
                                      "F16"}, shards=3)
want = ref_logits({"token_embd.weight": bf_emb, "blk.0.attn_norm.weight": f16_norm})
got = hf_logits(d_bf)
check("hf_sharded_bf16_f16", len(os.listdir(d_bf)) == 5 and mx(got, want) < 1e-6 and mx(want, base) > 1e-3,
      "(max diff %.2e; BF16 embedding moves the logits by %.3f)" % (mx(got, want), mx(want, base)))

# 2. Phi-3: fused qkv_proj / gate_up_proj, same logits
for sw in (None, 32, 2047):
    d_ = hf_dir("phi3_%s" % sw, "Phi3ForCausalLM", {"rope_scaling": None, "sliding_window": sw},
                tensors=hf_tensors(fused=True))
    check("hf_phi3_fused_window_%s" % sw, mx(hf_logits(d_), lg_llama) < 1e-9)

# 3. Mistral sliding window: key j visible to query i iff j <= i and i - j < W
lg_w32 = hf_logits(hf_dir("mistral_w32", "MistralForCausalLM", {"sliding_window": 32}))
check("hf_mistral_window_32_equals_full", mx(lg_w32, lg_llama) < 1e-9)
lg_w4 = hf_logits(hf_dir("mistral_w4", "MistralForCausalLM", {"sliding_window": 4}))
row_diff = np.abs(lg_w4 - lg_llama).max(axis=1)
check("hf_mistral_window_4", row_diff[:4].max() < 1e-9 and row_diff[4:].min() > 0.1,
      "(rows 0-3 max diff %.1e, rows 4+ min diff %.3f)" % (row_diff[:4].max(), row_diff[4:].min()))

# 4. LongRoPE (Phi-3): factor 1 and short factors 1 = plain RoPE; attention_factor a scales cos and sin; past
# original_max_position_embeddings the long factors are used
lr = {"type": "longrope", "short_factor": [1.0] * (hd // 2), "long_factor": [4.0] * (hd // 2)}
ph = dict(tensors=hf_tensors(fused=True))
lg_lr = hf_logits(hf_dir("lr_plain", "Phi3ForCausalLM", {"rope_scaling": lr, "original_max_position_embeddings": 512},
                         **ph))
check("hf_longrope_factor_1_equals_plain", mx(lg_lr, lg_llama) < 1e-9)
lg_su = hf_logits(hf_dir("lr_su", "Phi3ForCausalLM", {"rope_scaling": dict(lr, type="su"),
                                                      "original_max_position_embeddings": 512}, **ph))
check("hf_longrope_su_alias", mx(lg_su, lg_llama) < 1e-9)
lg_af = hf_logits(hf_dir("lr_af", "Phi3ForCausalLM", {"rope_scaling": dict(lr, attention_factor=1.2),
                                                      "original_max_position_embeddings": 512}, **ph))
# cos and sin times a multiply the rotated q and k by a, so every score by a^2: llama_numpy with Wq * a^2
want = ref_logits({"blk.%d.attn_q.weight" % i: wq[i].astype(np.float64) * 1.2 ** 2 for i in range(nl)})
check("hf_longrope_attention_factor_1_2", mx(lg_af, want) < 1e-6 and mx(lg_af, lg_llama) > 0.1,
      "(%.2e to llama_numpy with Wq * 1.44; %.3f to plain)" % (mx(lg_af, want), mx(lg_af, lg_llama)))
lg_long = hf_logits(hf_dir("lr_long", "Phi3ForCausalLM", {
    "rope_scaling": {"rope_type": "longrope", "short_factor": [3.0] * (hd // 2), "long_factor": [1.0] * (hd // 2),
                     "attention_factor": 1.0}, "original_max_position_embeddings": 16}, **ph))
check("hf_longrope_long_factor_past_original", mx(lg_long, lg_llama) < 1e-9, "(32 tokens > original 16)")
# factor 131072 / 4096 = 32: sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12) = sqrt(17/12)
lcfg = {"head_dim": 8, "rope_theta": 10000.0, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1, 2, 3, 4], "long_factor": [5, 6, 7, 8]}}
inv_s, af_s = HF.rope_parameters(lcfg, 4096)
inv_l, af_l = HF.rope_parameters(lcfg, 4097)
base_inv = np.array([1.0, 0.1, 0.01, 0.001])
check("hf_longrope_attention_factor_hand", abs(HF.longrope_attention_factor(32, 4096) - math.sqrt(17 / 12)) < 1e-15
      and abs(af_s - math.sqrt(17 / 12)) < 1e-15 and af_l == af_s and
      np.allclose(inv_s, base_inv / [1, 2, 3, 4], rtol=1e-12) and
      np.allclose(inv_l, base_inv / [5, 6, 7, 8], rtol=1e-12),
      "(%.12f)" % af_s)

# linear and llama3 RoPE scaling against llama_numpy's linear rope_scale and per-frequency divisors (rope_freqs).
# llama3 by hand for head_dim 8 (inv_freq 1, 0.1, 0.01, 0.001; wavelengths 2 pi / inv_freq), factor 8, low 1, high 4,
# original 64: wavelength 6.3 < 64/4 kept; 62.8 in [16, 64]: smooth s = (64 / 62.83 - 1) / 3, new = ((1 - s)/8 + s) *
# old; 628 and 6283 > 64: divided by 8.
lg_lin = hf_logits(hf_dir("linear", extra={"rope_scaling": {"type": "linear", "factor": 2.0}}))
want = ref_logits(rope_scale=2.0)
check("hf_rope_linear_vs_llama_numpy", mx(lg_lin, want) < 1e-6 and mx(want, base) > 0.01, "(%.2e)" % mx(lg_lin, want))
s_ = (64 / (2 * math.pi / 0.1) - 1) / 3
lg_l3 = hf_logits(hf_dir("llama3", extra={"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 64}}))
want = ref_logits(rope_freqs=np.array([1.0, 1 / ((1 - s_) / 8 + s_), 8.0, 8.0]))
check("hf_rope_llama3_vs_llama_numpy", mx(lg_l3, want) < 1e-6 and mx(want, base) > 0.01 and 0 < s_ < 1,
      "(%.2e)" % mx(lg_l3, want))

# activations, untied head, Qwen2 biases (default attention_bias true) against llama_numpy
for act_key, act in (("hidden_act", "relu"), ("nflash_ffn_activation", "drelu")):
    got = hf_logits(hf_dir("act_" + act, extra={act_key: act}))
    want = ref_logits(activation=act)
    check("hf_%s_%s_vs_llama_numpy" % (act_key, act), mx(got, want) < 1e-6 and mx(want, base) > 0.1,
          "(%.2e)" % mx(got, want))
g_ = np.random.default_rng(5)
head_w = (g_.standard_normal((voc, dim)) * 0.2).astype(np.float32)
got = hf_logits(hf_dir("untied", extra={"tie_word_embeddings": False}, tensors=hf_tensors(lm_head=head_w)))
check("hf_untied_lm_head_vs_llama_numpy", mx(got, ref_logits({"output.weight": head_w})) < 1e-6)
bias = [tuple((g_.standard_normal(n_) * 0.3).astype(np.float32) for n_ in (dim, kvd, kvd)) for _ in range(nl)]
got = hf_logits(hf_dir("qwen2_bias", "Qwen2ForCausalLM", tensors=hf_tensors(biases=bias)))
b_arrays = {}
for i in range(nl):
    for nm, b_ in zip(("attn_q", "attn_k", "attn_v"), bias[i]):
        b_arrays["blk.%d.%s.bias" % (i, nm)] = b_
want = ref_logits(b_arrays)
check("hf_qwen2_biases_vs_llama_numpy", mx(got, want) < 1e-6 and mx(want, base) > 0.1, "(%.2e)" % mx(got, want))

# 5. refused configurations and directories: exit 1 / HFError naming the field
res = hf_cli("--dir", hf_dir("gpt2", "GPT2LMHeadModel"), "--tokens", "1,2")
check("hf_error_architecture", res.returncode == 1 and "GPT2LMHeadModel" in res.stderr and
      "architectures" in res.stderr and res.stdout == "", "(%s)" % res.stderr.strip())
res = hf_cli("--dir", hf_dir("qwen2_swa", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4},
                             tensors=hf_tensors(biases=bias)), "--tokens", "1,2")
check("hf_error_qwen2_use_sliding_window", res.returncode == 1 and "use_sliding_window" in res.stderr,
      "(%s)" % res.stderr.strip())


def refused(name, arch, extra, tensors, words):
    try:
        HF.Model(hf_dir(name, arch, extra, tensors=tensors), np.float64).forward(hf_ids)
        msg = ""
    except HF.HFError as e:
        msg = str(e)
    check("hf_error_" + name, msg != "" and all(w_ in msg for w_ in words), "(%s)" % msg)


refused("longrope_list_length", "Phi3ForCausalLM", {"rope_scaling": dict(lr, short_factor=[1.0] * 3)},
        hf_tensors(fused=True), ("short_factor", "4"))
refused("rope_type_yarn", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, None,
        ("rope_scaling", "yarn"))
t_ = hf_tensors()
del t_["model.layers.2.mlp.up_proj.weight"]
refused("missing_tensor", "LlamaForCausalLM", None, t_, ("model.layers.2.mlp.up_proj.weight",))
refused("unused_tensor", "MistralForCausalLM", {"sliding_window": None}, hf_tensors(biases=bias),
        ("not used", "self_attn.q_proj.bias"))
refused("shape", "LlamaForCausalLM", {"intermediate_size": hid + 1}, None, ("gate_proj", str(hid + 1)))
print("     (hf_numpy checks: %.1fs)" % (time.time() - t_hf))

# ---------------------------------------------------------------- 11. held-out perplexity and ReLU sparsity
if not QUICK:
    text = readme(os.path.join(M, "stories260K", "README.md"))
    for path, act, want in ((SILU, "silu", 6.3035), (REL, "relu", 5.7738)):
        res, dt = cli("--llama2c", path, "--activation", act, "--tokenizer", TOK, "--ppl-text", HELD_OUT)
        js = json.loads(res.stdout) if res.returncode == 0 else {}
        check("perplexity_%s" % act, js.get("n_ids") == 100708 and js.get("predictions") == 100608 and
              abs(js.get("perplexity", 0) - want) < 6e-4, "(%s, want %.4f, %.0fs)" % (js, want, dt))
    # README: ReLU zero share per layer 0.926, 0.889, 0.881, 0.833, 0.791 over the held-out text (here every 4th
    # window of 256 ids, measured to agree within 0.005 of the whole-file numbers).
    cfg, w = L.load_llama2c(REL, "relu", np.float32)
    ids = tok.encode(open(HELD_OUT, encoding="utf-8").read())
    m = L.Llama(cfg, w, collect_stats=True)
    for i in range(0, (len(ids) - 1) // 256, 4):
        m.reset(keep_stats=True)
        m.forward(ids[256 * i:256 * i + 256])
    zeros = [1 - lay["active_fraction"] for lay in m.stats()["layers"]]
    check("relu_sparsity_per_layer", np.allclose(zeros, [0.926, 0.889, 0.881, 0.833, 0.791], atol=0.005),
          "(%s)" % ", ".join("%.3f" % z for z in zeros))

# ---------------------------------------------------------------- 12. 7B-shaped 4-layer Q4_0 file
if FULL:
    dim, n_ff, nl, vocab = 4096, 11008, 4, 32000
    g = np.random.default_rng(11)

    def rand_q4(rows, cols, d):
        nb = rows * cols // 32
        b = g.integers(0, 256, size=(nb, 18), dtype=np.uint8)
        b[:, :2] = np.frombuffer(fp16_bytes(d), np.uint8)
        return b.reshape(-1), G.Q4_0, (rows, cols)

    tens = [("token_embd.weight",) + rand_q4(vocab, dim, 0.3), ("output_norm.weight", np.ones(dim, np.float32), G.F32),
            ("output.weight",) + rand_q4(vocab, dim, 0.005)]
    for i in range(nl):
        p = "blk.%d." % i
        tens += [(p + "attn_norm.weight", np.ones(dim, np.float32), G.F32),
                 (p + "ffn_norm.weight", np.ones(dim, np.float32), G.F32)]
        for n, (r_, c_) in (("attn_q", (dim, dim)), ("attn_k", (dim, dim)), ("attn_v", (dim, dim)),
                            ("attn_output", (dim, dim)), ("ffn_gate", (n_ff, dim)), ("ffn_up", (n_ff, dim)),
                            ("ffn_down", (dim, n_ff))):
            tens.append((p + n + ".weight",) + rand_q4(r_, c_, 0.005))
    p7 = os.path.join(WORK, "7b4.gguf")
    cfg7 = dict(dim=dim, n_layers=nl, n_ff=n_ff, n_heads=32, n_kv_heads=32, eps=1e-5, rope_theta=10000.0)
    G.write_gguf(p7, llama_meta(cfg7), tens)
    del tens
    res, dt = cli("--model", p7, "--tokens", "1,450,4996,29871,5", "--logits-out", os.path.join(WORK, "7b.npy"))
    lg = np.load(os.path.join(WORK, "7b.npy")) if res.returncode == 0 else np.zeros(1)
    check("speed_7b_shape_4_layers_q4_0", lg.shape == (5, vocab) and np.isfinite(lg).all() and dt < 60,
          "(5 tokens, %.1fs wall, file %.0f MB)" % (dt, os.path.getsize(p7) / 1e6))

print("%d passed, %d failed%s" % (passes[0], len(failures), (": " + ", ".join(failures)) if failures else ""))
sys.exit(1 if failures else 0)
PYEOF
