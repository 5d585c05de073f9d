#!/usr/bin/python3
# Writes a Hugging Face directory as llama.cpp's converter does for Qwen2, Qwen3, Qwen3-MoE and Phi-3 (tests only).
"""A Hugging Face Qwen2, Qwen3, Qwen3-MoE or Phi-3 directory as a llama.cpp GGUF (qwen2, qwen3, qwen3moe, phi3).

Tests only. nflash reads llama.cpp's qwen2, qwen3, qwen3moe and phi3 GGUF files (the converter,
converter/gguf_model_reader.cc; the engine reads all but phi3 as they are). No such file can be downloaded here, so
tests make them with this script, written from llama.cpp's convert_hf_to_gguf.py conventions for those architectures
(Qwen2Model, Qwen3Model, Qwen3MoeModel, Phi3MiniModel) and not from nflash's code:
  - keys under the architecture's own prefix: ARCH.context_length (max_position_embeddings), embedding_length,
    feed_forward_length, block_count, attention.head_count, attention.head_count_kv, rope.freq_base,
    attention.layer_norm_rms_epsilon, attention.key_length and value_length when config.json has head_dim; phi3
    also rope.dimension_count (head_dim), attention.sliding_window (0: none),
    and with LongRoPE rope.scaling.original_context_length and rope.scaling.attn_factor;
  - the q and k rows (and Qwen2's q and k biases) exactly as stored: these architectures use llama.cpp's NEOX
    (rotate-half) RoPE, so unlike the llama architecture nothing is permuted;
  - tensor names: token_embd, output_norm, output (absent when tie_word_embeddings), blk.N.attn_norm, attn_q, attn_k,
    attn_v (+ .bias for Qwen2), attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down; qwen3 adds blk.N.attn_q_norm and
    attn_k_norm (self_attn.q_norm / k_norm, F32), and has no biases; qwen3moe is qwen3 with, per layer,
    blk.N.ffn_gate_inp (mlp.gate) and the experts stacked: ffn_gate_exps, ffn_up_exps (numpy [E, I, D]),
    ffn_down_exps ([E, D, I]) from mlp.experts.E.{gate,up,down}_proj, and the keys expert_count (num_experts),
    expert_used_count (num_experts_per_tok), expert_feed_forward_length (moe_intermediate_size); phi3 keeps qkv_proj as
    blk.N.attn_qkv (rows q | k | v) and gate_up_proj as blk.N.ffn_up (rows gate | up), and writes LongRoPE's factors
    as rope_factors_long.weight and rope_factors_short.weight (F32);
  - 1-D tensors F32; 2-D tensors in --type (f32, f16, q8_0 or q4_0, ggml's reference quantizers in gguf_numpy.py),
    F16 where a row is not a whole number of 32-value blocks (llama.cpp's fallback).
The tokenizer keys (tokenizer.*) are copied from --tokenizer-from, a GGUF of the same vocabulary.

CLI: llamacpp_gguf.py --dir D --out F.gguf --tokenizer-from T.gguf [--type f32|f16|q8_0|q4_0]
"""

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_numpy as gg  # noqa: E402
import hf_numpy as hf  # noqa: E402

TYPES = {"f32": gg.F32, "f16": gg.F16, "q8_0": gg.Q8_0, "q4_0": gg.Q4_0}
ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
        "Phi3ForCausalLM": "phi3"}


def convert(directory, out, tokenizer_from, weight_type):
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as fh:
        raw = json.load(fh)
    arch = ARCH.get((raw.get("architectures") or [None])[0])
    if arch is None:
        raise hf.HFError("config.json: architectures %r: this script writes Qwen2, Qwen3, Qwen3-MoE and Phi-3 only"
                         % raw.get("architectures"))
    w = hf.Weights(directory, np.float32)
    dim, n_ff = raw["hidden_size"], raw["intermediate_size"]
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or dim // heads
    p = arch + "."
    meta = [("general.architecture", arch), ("general.name", os.path.basename(os.path.normpath(directory))),
            (p + "context_length", raw["max_position_embeddings"], gg.T_UINT32),
            (p + "embedding_length", dim, gg.T_UINT32), (p + "feed_forward_length", n_ff, gg.T_UINT32),
            (p + "block_count", raw["num_hidden_layers"], gg.T_UINT32),
            (p + "attention.head_count", heads, gg.T_UINT32), (p + "attention.head_count_kv", kv_heads, gg.T_UINT32),
            (p + "rope.freq_base", float(raw.get("rope_theta", 10000.0)), gg.T_FLOAT32),
            (p + "attention.layer_norm_rms_epsilon", float(raw["rms_norm_eps"]), gg.T_FLOAT32)]
    if raw.get("head_dim") is not None:  # llama.cpp writes the head size whenever the config gives one
        meta.append((p + "attention.key_length", head_dim, gg.T_UINT32))
        meta.append((p + "attention.value_length", head_dim, gg.T_UINT32))
    extra = []
    if arch == "qwen3moe":
        meta.append((p + "expert_count", raw["num_experts"], gg.T_UINT32))
        meta.append((p + "expert_used_count", raw["num_experts_per_tok"], gg.T_UINT32))
        meta.append((p + "expert_feed_forward_length", raw["moe_intermediate_size"], gg.T_UINT32))
    if arch == "phi3":
        meta.append((p + "rope.dimension_count", head_dim, gg.T_UINT32))
        meta.append((p + "attention.sliding_window", raw.get("sliding_window") or 0, gg.T_UINT32))
        rs = raw.get("rope_scaling")
        if rs:
            original = raw["original_max_position_embeddings"]
            scale = raw["max_position_embeddings"] / original
            attn = rs.get("attention_factor")
            if attn is None:
                attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            meta.append((p + "rope.scaling.original_context_length", original, gg.T_UINT32))
            meta.append((p + "rope.scaling.attn_factor", float(attn), gg.T_FLOAT32))
            extra = [("rope_factors_long.weight", np.asarray(rs["long_factor"], np.float32), gg.F32),
                     ("rope_factors_short.weight", np.asarray(rs["short_factor"], np.float32), gg.F32)]
    r = gg.GGUFReader(tokenizer_from)
    for key, value in r.metadata.items():
        if key.startswith("tokenizer."):
            vtype = r.metadata_types[key]
            if vtype == gg.T_ARRAY:
                # the element type of a tokenizer array: strings (tokens, merges), f32 scores, i32 token types
                etype = {"tokenizer.ggml.scores": gg.T_FLOAT32, "tokenizer.ggml.token_type": gg.T_INT32}.get(
                    key, gg.T_STRING)
                meta.append((key, value, vtype, etype))
            else:
                meta.append((key, value, vtype))

    def t(name, hf_name):
        return t_array(name, w.get(hf_name))

    def t_array(name, a):
        if a.ndim == 1:
            return (name, a, gg.F32)
        # llama.cpp's fallback for rows that are not whole quantization blocks: F16
        blocked = weight_type in (gg.Q8_0, gg.Q4_0)
        return (name, a, gg.F16 if blocked and a.shape[-1] % 32 else weight_type)

    tensors = [t("token_embd.weight", "model.embed_tokens.weight")]
    for layer in range(raw["num_hidden_layers"]):
        h, b = "model.layers.%d." % layer, "blk.%d." % layer
        tensors.append(t(b + "attn_norm.weight", h + "input_layernorm.weight"))
        if arch == "phi3":
            tensors.append(t(b + "attn_qkv.weight", h + "self_attn.qkv_proj.weight"))
        else:
            for m in "qkv":
                tensors.append(t(b + "attn_%s.weight" % m, h + "self_attn.%s_proj.weight" % m))
                if arch == "qwen2":
                    tensors.append(t(b + "attn_%s.bias" % m, h + "self_attn.%s_proj.bias" % m))
        if arch in ("qwen3", "qwen3moe"):
            tensors.append(t(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight"))
            tensors.append(t(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight"))
        tensors.append(t(b + "attn_output.weight", h + "self_attn.o_proj.weight"))
        tensors.append(t(b + "ffn_norm.weight", h + "post_attention_layernorm.weight"))
        if arch == "phi3":
            tensors.append(t(b + "ffn_up.weight", h + "mlp.gate_up_proj.weight"))
        elif arch == "qwen3moe":
            tensors.append(t(b + "ffn_gate_inp.weight", h + "mlp.gate.weight"))
            for part in ("gate", "up", "down"):
                stacked = np.stack([w.get(h + "mlp.experts.%d.%s_proj.weight" % (e, part))
                                    for e in range(raw["num_experts"])])
                tensors.append(t_array(b + "ffn_%s_exps.weight" % part, stacked))
            continue
        else:
            tensors.append(t(b + "ffn_gate.weight", h + "mlp.gate_proj.weight"))
            tensors.append(t(b + "ffn_up.weight", h + "mlp.up_proj.weight"))
        tensors.append(t(b + "ffn_down.weight", h + "mlp.down_proj.weight"))
    tensors.append(t("output_norm.weight", "model.norm.weight"))
    if not raw.get("tie_word_embeddings", False):
        tensors.append(t("output.weight", "lm_head.weight"))
    gg.write_gguf(out, meta, tensors + extra)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--type", choices=sorted(TYPES), default="f32")
    a = ap.parse_args(argv)
    try:
        convert(a.dir, a.out, a.tokenizer_from, TYPES[a.type])
    except (hf.HFError, gg.GGUFError, KeyError, OSError) as e:
        print("llamacpp_gguf.py: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
