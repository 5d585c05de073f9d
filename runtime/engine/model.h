// A Llama-family model loaded from GGUF for inference: hyper-parameters, weight views into the (mapped or read) file,
// and the tokenizer. Llama, Mistral (GQA) and Mixtral (MoE) shapes, Qwen2, Qwen3 and Qwen3-MoE (llama.cpp's qwen2,
// qwen3 and qwen3moe architectures); SwiGLU, ReLU-gated and dReLU FFNs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/ffn_activation.h"
#include "runtime/core/gguf.h"
#include "runtime/core/kernels.h"
#include "runtime/core/status.h"

namespace nflash {

// Hyper-parameters read from a GGUF file's ARCH.* and nflash.* keys, ARCH being general.architecture: llama, or
// llama.cpp's qwen2, qwen3 and qwen3moe (read as llama.cpp writes them: NEOX RoPE, q/k rows as Hugging Face stores
// them; qwen3moe's n_ff from expert_feed_forward_length).
struct LlamaHparams {
  std::string arch = "llama";
  // RoPE rotates the pairs (i, i + head_dim / 2) of each head (NEOX, transformers' rotate-half: qwen2, qwen3) instead
  // of the consecutive pairs (2i, 2i + 1) of the llama layout, whose q and k rows llama.cpp's converter permutes.
  bool rope_neox = false;
  int64_t n_vocab = 0;
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_ff = 0;          // per expert for MoE
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;      // llama.attention.key_length, default dim / n_heads (= llama.rope.dimension_count)
  int64_t context_length = 0;
  float rope_theta = 10000.0f;
  float rope_scale = 1.0f;   // positions are divided by this (linear RoPE scaling)
  float norm_eps = 1e-5f;
  // llama.attention.sliding_window (Mistral v0.1, Phi-3): the query at position p attends to keys (p - W, p]; 0: all.
  int64_t sliding_window = 0;
  int64_t n_experts = 0;
  int64_t n_experts_used = 0;
  FfnActivation activation = FfnActivation::kSilu;
  bool synthetic = false;    // general.name contains "synthetic" or nflash.synthetic is true
  std::string name;
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t q_dim() const { return n_heads * head_dim; }
};
Result<LlamaHparams> ReadLlamaHparams(const GgufFile& file);

struct LayerWeights {
  const float* attn_norm = nullptr;  // (dim)
  MatrixView wq;                     // (n_heads*head_dim rows, dim)
  MatrixView wk;                     // (kv_dim, dim)
  MatrixView wv;                     // (kv_dim, dim)
  MatrixView wo;                     // (dim, n_heads*head_dim)
  // Biases of the q, k and v projections (attn_{q,k,v}.bias: Qwen2), or nullptr.
  const float* bq = nullptr;
  const float* bk = nullptr;
  const float* bv = nullptr;
  // Per-head RMSNorm of q and k before RoPE (attn_{q,k}_norm.weight, head_dim each: Qwen3, Qwen3-MoE), or nullptr.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* ffn_norm = nullptr;   // (dim)
  // Dense FFN (n_experts == 0): gate/up (n_ff, dim), down (dim, n_ff).
  // MoE: router (n_experts, dim); gate/up/down hold expert 0 and `expert_stride_*` bytes step to the next expert.
  MatrixView router;
  MatrixView gate, up, down;
  size_t expert_stride_gate = 0, expert_stride_up = 0, expert_stride_down = 0;
  MatrixView Expert(const MatrixView& m, size_t stride, int64_t e) const {
    MatrixView v = m;
    v.data = static_cast<const uint8_t*>(m.data) + stride * static_cast<size_t>(e);
    return v;
  }
};

struct LoadOptions {
  bool use_mmap = true;  // false: read the whole file into memory with O_DIRECT (--no-mmap; ReadFileDirect)
  // The FFN weights are not in the file (a deployment's resident.gguf): every FFN is computed by an FfnBackend (the
  // flash-offloaded runtime), so gate/up/down tensors are not required and their views stay empty (MoE routers are).
  bool external_ffn = false;
};

// Thread-safety: immutable after Load; shared by any number of inference contexts.
class Model {
 public:
  static Result<std::unique_ptr<Model>> Load(const std::string& path, const LoadOptions& options);
  // From an already opened file (tests, on-the-fly conversions held in memory).
  static Result<std::unique_ptr<Model>> FromGguf(std::shared_ptr<const GgufFile> file);
  static Result<std::unique_ptr<Model>> FromGguf(std::shared_ptr<const GgufFile> file, const LoadOptions& options);

  const LlamaHparams& hparams() const { return hp_; }
  const GgufFile& gguf() const { return *file_; }
  const MatrixView& token_embd() const { return token_embd_; }  // (n_vocab, dim)
  const float* output_norm() const { return output_norm_; }     // (dim)
  // rope_freqs.weight (llama3 RoPE scaling, llama.cpp's form): rotary pair i's frequency is divided by element i
  // (head_dim / 2 of them, each finite and > 0); nullptr when the model has none.
  const float* rope_freqs() const { return rope_freqs_; }
  const MatrixView& output() const { return output_; }          // (n_vocab, dim); token_embd when tied
  const std::vector<LayerWeights>& layers() const { return layers_; }
  // Bytes of all tensor data (what a dense run streams).
  uint64_t weight_bytes() const { return weight_bytes_; }

 private:
  Model() = default;
  Status Bind();
  std::shared_ptr<const GgufFile> file_;
  std::vector<std::vector<float>> owned_f32_;  // norms converted to F32 when stored otherwise
  LlamaHparams hp_;
  MatrixView token_embd_;
  const float* output_norm_ = nullptr;
  const float* rope_freqs_ = nullptr;
  MatrixView output_;
  std::vector<LayerWeights> layers_;
  uint64_t weight_bytes_ = 0;
  bool external_ffn_ = false;
};

}  // namespace nflash
