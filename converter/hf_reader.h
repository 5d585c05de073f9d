// Hugging Face model directories (config.json + safetensors + tokenizer) to the converter's SourceModel.
//
// config.json fields read (HF names; "required" fields missing are an error naming config.json and the field):
//   architectures[0]           LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM,
//                              TurboSparseMixtralForCausalLM (Mixtral layout, dReLU FFN; see below),
//                              Qwen2ForCausalLM (q, k, v biases), Phi3ForCausalLM (fused projections, see below),
//                              Qwen3ForCausalLM (per-head q/k norms: written as llama.cpp's qwen3 architecture,
//                              see below), Qwen3MoeForCausalLM (Qwen3 with MoE FFNs: llama.cpp's qwen3moe)
//   hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, max_position_embeddings, vocab_size,
//   rms_norm_eps               required
//   num_key_value_heads        default num_attention_heads
//   head_dim                   optional; ARCH.attention.key_length when not hidden_size / num_attention_heads
//   rope_theta                 default 10000
//   rope_scaling               null, or {"type" or "rope_type": "default" | "linear" | "llama3" | "longrope"};
//                              llama3 and longrope give rope_freqs.weight (docs/formats.md); others Unsupported
//   sliding_window             Mistral (default 4096), Phi-3, Mixtral: llama.attention.sliding_window; null: none
//   attention_bias, mlp_bias, partial_rotary_factor, use_sliding_window: refused where they would change the model
//   tie_word_embeddings        default false
//   hidden_act                 "silu" (default) -> silu, "relu" -> relu; others Unsupported
//   num_local_experts, num_experts_per_tok   required for the Mixtral architectures
//   num_experts, num_experts_per_tok, moe_intermediate_size (the experts' n_ff)   required for Qwen3-MoE, and
//   norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [] (else refused: the runtime renormalises the chosen
//   experts' weights, and every layer is MoE)
//   nflash_ffn_activation      optional, "silu" | "relu" | "drelu": overrides hidden_act. dReLU models need it:
//                              TurboSparse checkpoints only say hidden_act "relu" and implement dReLU
//                              (relu(gate) * relu(up)) in their custom modeling code, so config.json alone cannot
//                              tell ReLU from dReLU. TurboSparseMixtralForCausalLM defaults to drelu.
//
// Tensor names, HF -> GGUF (llama.cpp's convert_hf_to_gguf.py); HF shape [out, in] is GGUF dims {in, out}, same bytes:
//   model.embed_tokens.weight                           -> token_embd.weight        {dim, n_vocab}
//   model.layers.N.input_layernorm.weight               -> blk.N.attn_norm.weight   {dim}
//   model.layers.N.self_attn.q_proj.weight              -> blk.N.attn_q.weight      {dim, dim}        (RoPE rows)
//   model.layers.N.self_attn.k_proj.weight              -> blk.N.attn_k.weight      {dim, kv_dim}     (RoPE rows)
//   model.layers.N.self_attn.v_proj.weight              -> blk.N.attn_v.weight      {dim, kv_dim}
//   model.layers.N.self_attn.o_proj.weight              -> blk.N.attn_output.weight {dim, dim}
//   model.layers.N.post_attention_layernorm.weight      -> blk.N.ffn_norm.weight    {dim}
//   model.layers.N.mlp.gate_proj/up_proj/down_proj      -> blk.N.ffn_gate/ffn_up {dim, n_ff}, ffn_down {n_ff, dim}
//   Phi-3: model.layers.N.self_attn.qkv_proj.weight (rows q, k, v) and mlp.gate_up_proj.weight (rows gate, up), split
//   by rows into the tensors above; LongRoPE's attention factor is folded into attn_q and attn_k
//   model.layers.N.block_sparse_moe.gate.weight         -> blk.N.ffn_gate_inp.weight {dim, n_expert}
//   (Qwen3-MoE: model.layers.N.mlp.gate.weight and mlp.experts.E.gate_proj/up_proj/down_proj, likewise)
//   model.layers.N.block_sparse_moe.experts.E.w1/w3/w2  -> blk.N.ffn_gate_exps / ffn_up_exps {dim, n_ff, n_expert},
//                                                          ffn_down_exps {n_ff, dim, n_expert} (experts stacked in
//                                                          order E = 0..n_expert-1 along the slowest dimension)
//   model.norm.weight                                   -> output_norm.weight       {dim}
//   lm_head.weight                                      -> output.weight            {dim, n_vocab} (absent if tied)
// RoPE: HF stores q_proj/k_proj rows per head as [first halves of the pairs..., second halves...] (rotate-half);
// GGUF wants interleaved pairs. Per head (head_dim rows), GGUF row 2i + j = HF row j * head_dim/2 + i (j in {0, 1}),
// as llama.cpp's LlamaModel.permute (reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2)), with n_kv_heads for k_proj.
// Qwen3 (Qwen3-MoE) is written as llama.cpp's qwen3 (qwen3moe) architecture instead (keys qwen3.*, qwen3moe.*):
// q_proj/k_proj rows as stored (the runtime rotates NEOX pairs (i, i + head_dim/2)), and
// model.layers.N.self_attn.q_norm/k_norm.weight -> blk.N.attn_q_norm / attn_k_norm.weight {head_dim}, applied per
// head before RoPE.
#pragma once

#include <string>
#include <string_view>

#include "converter/model_ir.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// Parses config.json text into a ModelConfig (name left empty). `path` is used in messages.
Result<ModelConfig> ParseHfConfig(std::string_view text, const std::string& path);

// ReadHfDirectory(dir) is declared in converter/readers.h.

}  // namespace nflash::converter
