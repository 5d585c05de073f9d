// The converter's in-memory description of a source model, produced by every reader (llama2.c, HF, GGUF, synthetic)
// and consumed by the one GGUF writer. Tensors are described, not loaded: each carries a loader, so models larger
// than memory stream through one tensor at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/core/ffn_activation.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/gguf.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// The FFN activation kinds are shared with the runtime (runtime/core/ffn_activation.h).
using ::nflash::FfnActivation;
using ::nflash::FfnActivationName;
using ::nflash::ParseFfnActivation;

struct ModelConfig {
  // GGUF general.architecture, the prefix of the model keys: "llama" (every family the converter rearranges into the
  // llama layout), or "qwen3" / "qwen3moe" (llama.cpp's: q and k rows as Hugging Face stores them for NEOX RoPE, and
  // per-head q/k norms blk.N.attn_{q,k}_norm.weight, which the llama architecture has no place for; qwen3moe's
  // experts as Mixtral's, n_ff their size, written as expert_feed_forward_length too).
  std::string architecture = "llama";
  std::string name;                    // general.name
  int64_t n_vocab = 0;
  int64_t dim = 0;             // llama.embedding_length
  int64_t n_layers = 0;        // llama.block_count
  int64_t n_ff = 0;            // llama.feed_forward_length (per expert for MoE)
  int64_t n_heads = 0;         // llama.attention.head_count
  int64_t n_kv_heads = 0;      // llama.attention.head_count_kv
  int64_t context_length = 0;  // llama.context_length
  float rope_theta = 10000.0f;  // llama.rope.freq_base
  float norm_eps = 1e-5f;       // llama.attention.layer_norm_rms_epsilon
  // Linear RoPE scaling (HF rope_scaling {"type": "linear", "factor": f}); 1 = none.
  float rope_scale_linear = 1.0f;
  // Llama 3 RoPE scaling (HF rope_scaling {"rope_type": "llama3", ...}): per rotary pair i, the factor its frequency
  // theta^(-2i / head_dim) is divided by, written as the tensor rope_freqs.weight (llama.cpp's form). Empty: none.
  std::vector<float> rope_freq_factors;
  // llama.attention.sliding_window (HF "sliding_window": Mistral v0.1, Phi-3): the query at position p attends to keys
  // (p - W, p] only. 0: every earlier key.
  int64_t sliding_window = 0;
  int64_t n_experts = 0;       // llama.expert_count (0: dense FFN)
  int64_t n_experts_used = 0;  // llama.expert_used_count
  FfnActivation activation = FfnActivation::kSilu;
  bool tied_embeddings = false;  // no output.weight: the head reuses token_embd.weight
  // The q, k and v projections add a bias (Qwen2; HF "attention_bias"): blk.N.attn_{q,k,v}.bias, as llama.cpp's llama
  // architecture reads them.
  bool attention_bias = false;
  // The Hugging Face source's layout (read by the HF reader only; the GGUF written is the same either way):
  // Phi-3 fuses q, k, v into one qkv_proj and gate, up into one gate_up_proj, which the reader splits by rows.
  bool hf_fused_projections = false;
  // Phi-3's LongRoPE multiplies cos and sin by an attention factor, which scales rotated q and k alike; being linear,
  // it is folded into the q and k weights (and biases). 1: none.
  float hf_qk_scale = 1.0f;
  // llama.attention.key_length (= value_length; HF "head_dim"): the head size when it is not dim / n_heads (Mistral
  // Nemo: 5120 / 32 heads of 128). 0: dim / n_heads.
  int64_t key_length = 0;
  int64_t head_dim() const { return key_length > 0 ? key_length : n_heads > 0 ? dim / n_heads : 0; }
  // Whether the architecture has per-head q/k norms (blk.N.attn_{q,k}_norm.weight): qwen3 and qwen3moe.
  bool qk_norms() const { return architecture == "qwen3" || architecture == "qwen3moe"; }
  int64_t q_dim() const { return n_heads * head_dim(); }
  int64_t kv_dim() const { return n_kv_heads * head_dim(); }
};

struct TokenizerData {
  std::string model;  // tokenizer.ggml.model: "llama" (SentencePiece BPE) or "gpt2" (byte-level BPE); empty: none
  std::string pre;    // tokenizer.ggml.pre (gpt2 pre-tokenizer name), optional
  std::vector<std::string> tokens;
  std::vector<float> scores;          // may be empty for gpt2
  std::vector<int32_t> token_types;   // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
  std::vector<std::string> merges;    // gpt2 only: "a b"
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  std::optional<bool> add_bos, add_eos;
  std::string chat_template;  // tokenizer.chat_template (Jinja, from HF tokenizer_config.json); "" when none
};

// One tensor of the source, named and shaped in GGUF's convention (llama.cpp names; dims[0] is the row length) and
// already in GGUF's layout (HF q/k permutation undone, transposes applied) by its loader.
struct SourceTensor {
  std::string name;
  std::vector<uint64_t> dims;
  GgmlType source_type = GgmlType::kF32;
  // The tensor as F32 in GGUF layout, n_elements floats.
  std::function<Result<std::vector<float>>()> load_f32;
  // The tensor's raw bytes in `source_type` (GGUF sources only), so an unchanged type is copied bit for bit. Optional.
  std::function<Result<std::vector<uint8_t>>()> load_raw;
};

struct SourceModel {
  std::string source_path;
  std::string source_format;  // "llama2c-v0", "llama2c-v1", "hf-safetensors", "gguf", "synthetic"
  ModelConfig config;
  TokenizerData tokenizer;
  std::vector<SourceTensor> tensors;
  // Extra keys copied into the output as they are (e.g. nflash.* or powerinfer.* keys of a GGUF source).
  std::vector<std::pair<std::string, GgufValue>> extra_metadata;
};

}  // namespace nflash::converter
