#!/usr/bin/python3
# Independent NumPy forward pass for Hugging Face model directories (config.json + safetensors), used only by tests.
"""Reference forward pass of a Hugging Face model directory for nflash tests; never used by the product.

Written from the transformers model definitions (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM, Phi3ForCausalLM) in Hugging Face's own conventions, not from nflash's C++ code, and sharing no
code with llama_numpy.py / gguf_numpy.py (numpy and the standard library only):
  h = model.embed_tokens.weight[id]                                     positions 0..n-1, one forward pass
  per layer (model.layers.N.):
      a = rmsnorm(h) * input_layernorm.weight                           rmsnorm(x) = x / sqrt(mean(x^2) + eps)
      q, k, v = self_attn.{q,k,v}_proj(a)     (Phi-3: one qkv_proj, rows q [H*hd] | k [KV*hd] | v [KV*hd])
                + self_attn.{q,k,v}_proj.bias when attention_bias (default: true for Qwen2, false otherwise)
      Qwen3: each head of q and k RMS-normalised over head_dim (its own weights self_attn.q_norm.weight,
          self_attn.k_norm.weight, eps rms_norm_eps) before RoPE (Qwen3Config's head_dim default: 128)
      RoPE on q and k as stored (no row permutation), transformers' rotate-half form:
          x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[hd/2:], x[:hd/2]),
          cos/sin = cos/sin(cat(f, f)) * attention_factor, f = position * inv_freq,
          inv_freq = 1 / theta^(arange(0, hd, 2) / hd), changed by rope_scaling:
          linear (inv_freq / factor), llama3 (_compute_llama3_parameters), longrope / su
          (_compute_longrope_parameters: short_factor while n <= original_max_position_embeddings, else
          long_factor; attention_factor given, or sqrt(1 + ln(factor) / ln(original)) when factor > 1)
      grouped-query attention: head h reads kv head h // (H / KV); softmax(q.k / sqrt(hd)) over keys j <= i,
          and also i - j < sliding_window for Mistral / Phi-3 when config sliding_window is a positive int
          (null: none; absent: the config class default, 4096 for Mistral, none for Phi-3)
      h += o_proj(attn)                                (+ o_proj.bias for Llama and Qwen3 with attention_bias)
      f = rmsnorm(h) * post_attention_layernorm.weight
      h += down_proj(act(gate_proj f) * up_proj f)     (Phi-3: gate_up_proj rows gate [I] | up [I];
                                                        Llama mlp_bias: + the three biases)
      act: config hidden_act silu | relu; config key nflash_ffn_activation (silu | relu | drelu) overrides it;
           drelu: relu(gate f) * relu(up f)
      Qwen3-MoE (Qwen3MoeSparseMoeBlock), on the layers l not in mlp_only_layers with (l + 1) % decoder_sparse_step
      == 0 (the others: the dense mlp above, of intermediate_size): p = softmax(mlp.gate(f)) over num_experts (f32),
           the num_experts_per_tok largest p (weights renormalised to sum 1 when norm_topk_prob), and
           h += sum over them of p_e * down_e(act(gate_e f) * up_e f), mlp.experts.E.{gate,up,down}_proj of
           moe_intermediate_size
  logits = lm_head.weight (or model.embed_tokens.weight when tie_word_embeddings) applied to
           rmsnorm(h) * model.norm.weight
Weights come from DIR/model.safetensors or the shards named by DIR/model.safetensors.index.json (F32, F16, BF16),
numpy-style [out, in], memory-mapped and converted to the compute dtype (f32 or f64) at use.
Not modelled (clear error): other architectures, other rope types, partial_rotary_factor != 1, Qwen2's
use_sliding_window, transformers v5 "rope_parameters" configs, tensors the definition does not use.

CLI: hf_numpy.py --dir D (--tokens 1,2,3 | --prompt-ids-file F) [--dtype f32|f64] [--logits-out L.npy]
     writes float32 logits [n_tokens, vocab] (np.save) and prints {"n_tokens", "vocab", "argmax_last"} as JSON.
     Errors: message on stderr, exit code 1.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
ACTIVATIONS = ("silu", "relu", "drelu")
# The transformers config classes' defaults for fields a config.json may leave out.
CONFIG_DEFAULTS = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    "Qwen3MoeForCausalLM": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "head_dim": 128},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                        "original_max_position_embeddings": 4096},
}
# safetensors dtype -> (numpy dtype of the stored elements, bytes per element)
ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}


class HFError(ValueError):
    """A model directory this reference cannot (or refuses to) evaluate; the message names the file or field."""


# -------------------------------------------------------------------------------------------------------- safetensors

class SafetensorsFile:
    """One .safetensors file: u64 LE header length N, N bytes of JSON header, then the data buffer."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise HFError("%s: shorter than the 8-byte header length" % path)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise HFError("%s: header length %d exceeds the file size %d" % (path, n, size))
            try:
                header = json.loads(fh.read(n).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise HFError("%s: header is not JSON: %s" % (path, e))
        if not isinstance(header, dict):
            raise HFError("%s: header is not a JSON object" % path)
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.metadata = header.pop("__metadata__", None)
        self.tensors = {}
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise HFError("%s: tensor %s: malformed header entry %r" % (path, name, info))
            if not 0 <= begin <= end <= data_size:
                raise HFError("%s: tensor %s: data_offsets [%d, %d] outside the %d-byte data buffer"
                              % (path, name, begin, end, data_size))
            if dtype in ST_DTYPES:
                want = int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[dtype][1]
                if end - begin != want:
                    raise HFError("%s: tensor %s: %s %s needs %d bytes, data_offsets span %d"
                                  % (path, name, dtype, shape, want, end - begin))
            self.tensors[name] = (dtype, tuple(shape), begin, end)

    def raw(self, name):
        """The stored elements, memory-mapped (F32/F16 as floats, BF16 as uint16 bit patterns)."""
        dtype, shape, begin, end = self.tensors[name]
        if dtype not in ST_DTYPES:
            raise HFError("%s: tensor %s has dtype %s; supported: %s" % (self.path, name, dtype, sorted(ST_DTYPES)))
        np_dtype = np.dtype(ST_DTYPES[dtype][0])
        if end == begin:
            return np.zeros(shape, np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.data_start + begin, shape=shape)


def to_float(raw, st_dtype, dtype):
    """Stored elements -> dtype. BF16 is the top 16 bits of an IEEE float32."""
    if st_dtype == "BF16":
        return (np.asarray(raw, dtype=np.uint32) << np.uint32(16)).view(np.float32).astype(dtype)
    return np.asarray(raw).astype(dtype)


class Weights:
    """Tensor name -> file, from model.safetensors or model.safetensors.index.json; converted at each use."""

    def __init__(self, directory, dtype):
        self.dtype = dtype
        self.where = {}
        single = os.path.join(directory, "model.safetensors")
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(single):  # transformers looks for the single file first
            f = SafetensorsFile(single)
            self.where = {n: f for n in f.tensors}
        elif os.path.exists(index):
            with open(index, encoding="utf-8") as fh:
                try:
                    weight_map = json.load(fh)["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise HFError("%s: no weight_map (%s)" % (index, e))
            files = {}
            for name, shard in weight_map.items():
                if shard not in files:
                    path = os.path.join(directory, shard)
                    if not os.path.exists(path):
                        raise HFError("%s: shard %s (for %s) does not exist" % (index, shard, name))
                    files[shard] = SafetensorsFile(path)
                if name not in files[shard].tensors:
                    raise HFError("%s: weight_map puts %s in %s, which does not hold it" % (index, name, shard))
                self.where[name] = files[shard]
        else:
            raise HFError("%s: neither model.safetensors nor model.safetensors.index.json" % directory)
        self.used = set()

    def has(self, name):
        return name in self.where

    def shape(self, name):
        self._need(name)
        return self.where[name].tensors[name][1]

    def _need(self, name):
        if name not in self.where:
            raise HFError("missing tensor %s" % name)

    def get(self, name, shape=None):
        """The whole tensor in the compute dtype; shape, if given, must match the stored one."""
        self._need(name)
        f = self.where[name]
        st_dtype, stored = f.tensors[name][:2]
        if shape is not None and tuple(stored) != tuple(shape):
            raise HFError("tensor %s has shape %s, the config implies %s" % (name, list(stored), list(shape)))
        self.used.add(name)
        return to_float(f.raw(name), st_dtype, self.dtype)

    def rows(self, name, ids):
        """Rows ids of a 2-D tensor (the embedding lookup) in the compute dtype."""
        self._need(name)
        f = self.where[name]
        self.used.add(name)
        return to_float(f.raw(name)[np.asarray(ids)], f.tensors[name][0], self.dtype)


# ------------------------------------------------------------------------------------------------------------- config

def _positive_int(cfg, key, default=None):
    v = cfg.get(key)
    if v is None:  # absent or null: the config class default
        v = default
    if v is None:
        raise HFError("config.json: missing %s" % key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise HFError("config.json: %s must be a positive integer, got %r" % (key, v))
    return v


def _number(d, key, where):
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HFError("config.json: %s[%r] must be a number, got %r" % (where, key, v))
    return float(v)


def parse_config(raw):
    """config.json dict -> the fields the forward pass uses (raises HFError for what it does not model)."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise HFError("config.json: no \"architectures\" list")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise HFError("config.json: architectures[0] = %r is not supported (supported: %s)"
                      % (arch, ", ".join(ARCHITECTURES)))
    defaults = CONFIG_DEFAULTS[arch]
    if "rope_parameters" in raw:
        raise HFError("config.json: \"rope_parameters\" (transformers v5 form) is not modelled; this reference "
                      "reads rope_theta and rope_scaling")
    hidden = _positive_int(raw, "hidden_size")
    heads = _positive_int(raw, "num_attention_heads")
    kv_heads = _positive_int(raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise HFError("config.json: num_attention_heads %d is not a multiple of num_key_value_heads %d"
                      % (heads, kv_heads))
    head_dim = raw.get("head_dim", defaults.get("head_dim"))
    if head_dim is None:  # transformers: getattr(config, "head_dim", hidden_size // num_attention_heads)
        if hidden % heads:
            raise HFError("config.json: hidden_size %d is not a multiple of num_attention_heads %d" % (hidden, heads))
        head_dim = hidden // heads
    head_dim = _positive_int({"head_dim": head_dim}, "head_dim")
    if head_dim % 2:
        raise HFError("config.json: head_dim %d is odd; RoPE rotates halves" % head_dim)
    prf = raw.get("partial_rotary_factor", 1.0)
    if prf is not None and float(prf) != 1.0:
        raise HFError("config.json: partial_rotary_factor %r is not modelled (only 1.0)" % prf)

    act = raw.get("hidden_act", "silu")
    act = {"silu": "silu", "swish": "silu", "relu": "relu"}.get(act)
    if act is None:
        raise HFError("config.json: hidden_act %r is not modelled (silu or relu)" % raw.get("hidden_act"))
    if "nflash_ffn_activation" in raw:
        act = raw["nflash_ffn_activation"]
        if act not in ACTIVATIONS:
            raise HFError("config.json: nflash_ffn_activation %r is not one of %s" % (act, ACTIVATIONS))

    attention_bias = raw.get("attention_bias", arch == "Qwen2ForCausalLM")
    if not isinstance(attention_bias, bool):
        raise HFError("config.json: attention_bias must be true or false, got %r" % attention_bias)
    if attention_bias and arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        raise HFError("config.json: attention_bias true, but transformers' %s has no attention biases" % arch)
    mlp_bias = raw.get("mlp_bias", False) if arch == "LlamaForCausalLM" else False
    if not isinstance(mlp_bias, bool):
        raise HFError("config.json: mlp_bias must be true or false, got %r" % mlp_bias)

    window = None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        if raw.get("use_sliding_window", False):
            raise HFError("config.json: use_sliding_window true is not modelled (Qwen2 and Qwen3 apply "
                          "sliding_window only to the layers from max_window_layers on)")
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        window = raw.get("sliding_window", defaults.get("sliding_window"))  # present and null: no window
        if window is not None:
            window = _positive_int({"sliding_window": window}, "sliding_window")

    theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise HFError("config.json: rope_theta must be a positive number, got %r" % theta)
    eps = raw.get("rms_norm_eps", defaults["rms_norm_eps"])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise HFError("config.json: rms_norm_eps must be a number >= 0, got %r" % eps)
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise HFError("config.json: tie_word_embeddings must be true or false, got %r" % tie)

    cfg = {
        "arch": arch, "hidden_size": hidden, "intermediate_size": _positive_int(raw, "intermediate_size"),
        "num_hidden_layers": _positive_int(raw, "num_hidden_layers"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": float(eps),
        "rope_theta": float(theta), "tie_word_embeddings": tie, "activation": act,
        "attention_bias": attention_bias, "mlp_bias": mlp_bias, "sliding_window": window,
        "vocab_size": raw.get("vocab_size"),
        "max_position_embeddings": raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
        # a top-level attribute only in Phi3Config (default 4096) or when config.json has it
        "original_max_position_embeddings": raw.get("original_max_position_embeddings",
                                                    defaults.get("original_max_position_embeddings")),
        "rope_scaling": raw.get("rope_scaling"),
        "moe": None,
    }
    if arch == "Qwen3MoeForCausalLM":  # Qwen3MoeConfig's defaults
        only = raw.get("mlp_only_layers", [])
        if not isinstance(only, list) or not all(isinstance(x, int) for x in only):
            raise HFError("config.json: mlp_only_layers must be a list of layer indices, got %r" % only)
        cfg["moe"] = {
            "num_experts": _positive_int(raw, "num_experts", 128),
            "num_experts_per_tok": _positive_int(raw, "num_experts_per_tok", 8),
            "moe_intermediate_size": _positive_int(raw, "moe_intermediate_size", 768),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "decoder_sparse_step": _positive_int(raw, "decoder_sparse_step", 1),
            "mlp_only_layers": set(only),
        }
    rope_parameters(cfg, 1)  # validate rope_scaling now, with a clear error
    return cfg


# --------------------------------------------------------------------------------------------------------------- RoPE

def longrope_attention_factor(factor, original_max_position_embeddings):
    """_compute_longrope_parameters' default: 1 when factor <= 1, else sqrt(1 + ln(factor) / ln(original))."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(factor) / math.log(original_max_position_embeddings))


def rope_parameters(cfg, seq_len):
    """(inv_freq [hd/2] float64, attention_factor) for a forward pass over positions 0..seq_len-1."""
    hd = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.get("rope_scaling")
    if rs is None:
        return inv_freq, 1.0
    if not isinstance(rs, dict):
        raise HFError("config.json: rope_scaling must be an object or null, got %r" % (rs,))
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / _number(rs, "factor", "rope_scaling"), 1.0
    if kind == "llama3":
        factor = _number(rs, "factor", "rope_scaling")
        low = _number(rs, "low_freq_factor", "rope_scaling")
        high = _number(rs, "high_freq_factor", "rope_scaling")
        old = _number(rs, "original_max_position_embeddings", "rope_scaling")
        if high <= low:
            raise HFError("config.json: rope_scaling high_freq_factor %g must exceed low_freq_factor %g" % (high, low))
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled), 1.0
    if kind in ("longrope", "su"):
        original = cfg.get("original_max_position_embeddings")
        if original is None:
            original = rs.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise HFError("config.json: longrope needs a positive integer original_max_position_embeddings (top "
                          "level or in rope_scaling), got %r" % (original,))
        mpe = cfg.get("max_position_embeddings")
        if isinstance(mpe, bool) or not isinstance(mpe, int) or mpe <= 0:
            raise HFError("config.json: longrope needs a positive integer max_position_embeddings, got %r" % (mpe,))
        factor = mpe / original
        if rs.get("factor") is not None and abs(_number(rs, "factor", "rope_scaling") - factor) > 1e-12 * factor:
            raise HFError("config.json: rope_scaling factor %r differs from max_position_embeddings / "
                          "original_max_position_embeddings = %r (transformers versions disagree on which wins)"
                          % (rs["factor"], factor))
        lists = {}
        for key in ("short_factor", "long_factor"):
            v = rs.get(key)
            if not isinstance(v, list) or len(v) != hd // 2 or \
                    not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise HFError("config.json: rope_scaling %s must be a list of %d numbers (head_dim / 2), got %s"
                              % (key, hd // 2, "%d items" % len(v) if isinstance(v, list) else repr(v)))
            lists[key] = np.asarray(v, dtype=np.float64)
        if rs.get("attention_factor") is not None:
            attention_factor = _number(rs, "attention_factor", "rope_scaling")
        else:
            attention_factor = longrope_attention_factor(factor, original)
        ext = lists["long_factor"] if seq_len > original else lists["short_factor"]
        return 1.0 / (ext * cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)), attention_factor
    raise HFError("config.json: rope_scaling type %r is not modelled (default, linear, llama3, longrope/su)" % (kind,))


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


# ------------------------------------------------------------------------------------------------------------ forward

def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps)) * w


def silu(x):
    return x / (x.dtype.type(1) + np.exp(-x))


class Model:
    """A Hugging Face model directory; forward(ids) runs ids at positions 0..n-1. Not thread-safe."""

    def __init__(self, directory, dtype=np.float32):
        path = os.path.join(directory, "config.json")
        if not os.path.exists(path):
            raise HFError("%s: no config.json" % directory)
        with open(path, encoding="utf-8") as fh:
            try:
                raw = json.load(fh)
            except ValueError as e:
                raise HFError("%s: not JSON: %s" % (path, e))
        self.cfg = parse_config(raw)
        self.dtype = dtype
        self.w = Weights(directory, dtype)
        c = self.cfg
        emb = self.w.shape("model.embed_tokens.weight")
        if len(emb) != 2 or emb[1] != c["hidden_size"]:
            raise HFError("model.embed_tokens.weight has shape %s, want [vocab, %d]" % (list(emb), c["hidden_size"]))
        self.vocab = emb[0]
        if c["vocab_size"] is not None and c["vocab_size"] != self.vocab:
            raise HFError("config.json: vocab_size %r but model.embed_tokens.weight has %d rows"
                          % (c["vocab_size"], self.vocab))
        self.head = "model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight"

    def forward(self, ids):
        c, w, dt = self.cfg, self.w, self.dtype
        ids = [int(t) for t in ids]
        n = len(ids)
        if n == 0:
            raise HFError("no token ids")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise HFError("token ids out of range [0, %d): %s" % (self.vocab, bad[:5]))
        D, I = c["hidden_size"], c["intermediate_size"]
        H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        eps = c["rms_norm_eps"]
        inv_freq, attention_factor = rope_parameters(c, n)
        freqs = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)                        # [n, hd]
        cos = (np.cos(emb) * attention_factor).astype(dt)[:, None, :]       # broadcast over heads
        sin = (np.sin(emb) * attention_factor).astype(dt)[:, None, :]
        i = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        visible = j <= i
        if c["sliding_window"] is not None:
            visible &= (i - j) < c["sliding_window"]
        kv_of_head = np.arange(H) // (H // KV)
        scaling = dt(hd ** -0.5)

        h = w.rows("model.embed_tokens.weight", ids)
        for layer in range(c["num_hidden_layers"]):
            p = "model.layers.%d." % layer
            a = rmsnorm(h, w.get(p + "input_layernorm.weight", (D,)), eps)
            if c["arch"] == "Phi3ForCausalLM":
                qkv = a @ w.get(p + "self_attn.qkv_proj.weight", ((H + 2 * KV) * hd, D)).T
                q, k, v = qkv[:, :H * hd], qkv[:, H * hd:(H + KV) * hd], qkv[:, (H + KV) * hd:]
            else:
                q = a @ w.get(p + "self_attn.q_proj.weight", (H * hd, D)).T
                k = a @ w.get(p + "self_attn.k_proj.weight", (KV * hd, D)).T
                v = a @ w.get(p + "self_attn.v_proj.weight", (KV * hd, D)).T
                if c["attention_bias"]:
                    q = q + w.get(p + "self_attn.q_proj.bias", (H * hd,))
                    k = k + w.get(p + "self_attn.k_proj.bias", (KV * hd,))
                    v = v + w.get(p + "self_attn.v_proj.bias", (KV * hd,))
            q = q.reshape(n, H, hd)
            k = k.reshape(n, KV, hd)
            v = v.reshape(n, KV, hd)
            if c["arch"] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):  # Qwen3Attention: q_norm / k_norm per head
                q = rmsnorm(q, w.get(p + "self_attn.q_norm.weight", (hd,)), eps)
                k = rmsnorm(k, w.get(p + "self_attn.k_norm.weight", (hd,)), eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            qh = q.transpose(1, 0, 2)                                        # [H, n, hd]
            kh = k.transpose(1, 0, 2)[kv_of_head]                            # [H, n, hd]
            vh = v.transpose(1, 0, 2)[kv_of_head]
            s = np.matmul(qh, kh.transpose(0, 2, 1)) * scaling               # [H, n(query), n(key)]
            s = np.where(visible[None], s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            e = np.exp(s)
            probs = e / e.sum(axis=-1, keepdims=True)
            att = np.matmul(probs, vh).transpose(1, 0, 2).reshape(n, H * hd)
            o = att @ w.get(p + "self_attn.o_proj.weight", (D, H * hd)).T
            if c["attention_bias"] and c["arch"] in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
                o = o + w.get(p + "self_attn.o_proj.bias", (D,))
            h = h + o

            f = rmsnorm(h, w.get(p + "post_attention_layernorm.weight", (D,)), eps)
            moe = c["moe"]
            if moe and layer not in moe["mlp_only_layers"] and (layer + 1) % moe["decoder_sparse_step"] == 0:
                h = h + self._sparse_moe(p, f, moe)
                continue
            if c["arch"] == "Phi3ForCausalLM":
                gu = f @ w.get(p + "mlp.gate_up_proj.weight", (2 * I, D)).T
                g, u = gu[:, :I], gu[:, I:]
            else:
                g = f @ w.get(p + "mlp.gate_proj.weight", (I, D)).T
                u = f @ w.get(p + "mlp.up_proj.weight", (I, D)).T
                if c["mlp_bias"]:
                    g = g + w.get(p + "mlp.gate_proj.bias", (I,))
                    u = u + w.get(p + "mlp.up_proj.bias", (I,))
            act = self._act(g, u)
            down = act @ w.get(p + "mlp.down_proj.weight", (D, I)).T
            if c["mlp_bias"]:
                down = down + w.get(p + "mlp.down_proj.bias", (D,))
            h = h + down

        h = rmsnorm(h, w.get("model.norm.weight", (D,)), eps)
        logits = h @ w.get(self.head, (self.vocab, D)).T
        self._check_all_used()
        return logits

    def _act(self, g, u):
        if self.cfg["activation"] == "silu":
            return silu(g) * u
        if self.cfg["activation"] == "relu":
            return np.maximum(g, 0) * u
        return np.maximum(g, 0) * np.maximum(u, 0)  # drelu

    def _sparse_moe(self, p, f, moe):
        """Qwen3MoeSparseMoeBlock: softmax router over all experts, top k, optional renormalisation."""
        w, D = self.w, self.cfg["hidden_size"]
        E, K, I = moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]
        logits = (f @ w.get(p + "mlp.gate.weight", (E, D)).T).astype(np.float32)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        out = np.zeros_like(f)
        for t in range(f.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:K]
            weights = probs[t, top]
            if moe["norm_topk_prob"]:
                weights = weights / weights.sum()
            for e, we in zip(top, weights):
                q = p + "mlp.experts.%d." % e
                x = f[t:t + 1]
                g = x @ w.get(q + "gate_proj.weight", (I, D)).T
                u = x @ w.get(q + "up_proj.weight", (I, D)).T
                out[t] += (self._act(g, u) @ w.get(q + "down_proj.weight", (D, I)).T)[0] * f.dtype.type(we)
        return out

    def _check_all_used(self):
        ignorable = ("lm_head.weight",) if self.cfg["tie_word_embeddings"] else ()  # transformers ties it over
        unused = sorted(n for n in self.w.where if n not in self.w.used and n not in ignorable
                        and not n.endswith(".rotary_emb.inv_freq"))
        if unused:
            raise HFError("%d tensors not used by transformers' %s with this config: %s"
                          % (len(unused), self.cfg["arch"], ", ".join(unused[:8])))


def load(directory, dtype=np.float32):
    return Model(directory, dtype)


# --------------------------------------------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        sys.stderr.write("%s: error: %s\n" % (self.prog, message))
        sys.exit(1)


def main(argv=None):
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids")
    src.add_argument("--prompt-ids-file", help="file of token ids (whitespace/comma separated, or a JSON list)")
    ap.add_argument("--dtype", choices=("f32", "f64"), default="f32")
    ap.add_argument("--logits-out", help="write float32 logits [n_tokens, vocab] (.npy)")
    args = ap.parse_args(argv)
    try:
        if args.tokens is not None:
            ids = [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
        else:
            with open(args.prompt_ids_file) as fh:
                s = fh.read().strip()
            ids = json.loads(s) if s.startswith("[") else [int(t) for t in s.replace(",", " ").split()]
        model = Model(args.dir, np.float32 if args.dtype == "f32" else np.float64)
        logits = model.forward(ids)
    except (HFError, OSError, ValueError) as e:
        sys.stderr.write("hf_numpy.py: error: %s\n" % e)
        return 1
    if args.logits_out:
        np.save(args.logits_out, logits.astype(np.float32))
    print(json.dumps({"n_tokens": len(ids), "vocab": int(model.vocab), "argmax_last": int(np.argmax(logits[-1]))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
