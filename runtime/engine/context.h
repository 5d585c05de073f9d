// Inference state of one sequence: KV cache, scratch buffers and the forward pass (batched prefill with GEMM,
// single-token decode with GEMV) over a Model.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/thread_pool.h"
#include "runtime/engine/model.h"

namespace nflash {

// What the forward pass shows of each FFN it runs, for the profiler and predictor training (an observer sees it
// after the FFN's hidden vector is formed and before the down projection).
struct FfnObservation {
  int64_t layer = 0;
  int64_t expert = -1;          // -1 for a dense FFN
  int64_t n_tokens = 0;
  // Which tokens of the Eval's batch these rows belong to: MoE, token_index[r]; dense (token_index nullptr),
  // first_token + r (a batch longer than InferenceContext::max_batch runs in chunks, one observation per chunk).
  const int64_t* token_index = nullptr;
  int64_t first_token = 0;
  const float* gate_act = nullptr;       // n_tokens x n_ff: act(gate x) (relu/silu), the FFN's "neuron output" test
  const float* hidden = nullptr;         // n_tokens x n_ff: the vector multiplied by the down projection
  const float* ffn_input = nullptr;      // n_tokens x dim: the normalised FFN input (predictor training data)
};
using FfnObserver = std::function<void(const FfnObservation&)>;

// Computes FFNs in place of the dense path: the sparse in-memory FFN (predictor + active rows) and the flash-offloaded
// runtime plug in here. Forward is called once per layer (per selected expert for MoE, with only the tokens routed to
// it) with the normalised FFN input `x` (x.n() tokens of dim floats, with its Q8_0 form) and writes x.n() x dim
// outputs to `out`. It returns false, writing nothing, to let the dense path run this call (e.g. batched prefill).
class FfnBackend {
 public:
  virtual ~FfnBackend() = default;
  virtual Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) = 0;
  // Before layer `layer`'s attention, with its normalised input (rmsnorm(x) * attn_norm, n tokens): a backend may
  // start work for that layer's FFN early (e.g. reads it will probably need). Must not change any result.
  virtual void BeforeAttention(int64_t layer, const float* xn, int64_t n) {
    (void)layer;
    (void)xn;
    (void)n;
  }
  // Before layer `layer`'s FFN, with the residual stream its input is the rmsnorm of (x, n tokens; valid until the
  // FFN returns). A backend may use it to guess ahead (e.g. the next layer's reads). Must not change any result.
  virtual void BeforeFfn(int64_t layer, const float* x, int64_t n) {
    (void)layer;
    (void)x;
    (void)n;
  }
  // Around each InferenceContext::Eval, on the thread calling it (which runs the whole batch, with the pool): a
  // backend may place its threads for the batch (e.g. pin them to CPUs) and restore them afterwards. Must not change
  // any result.
  virtual void BeginEval() {}
  virtual void EndEval() {}
  // MoE: before layer `layer`'s experts run, how many of the batch's tokens the router sent to each expert (n_experts
  // items; Forward is then called for the experts with tokens, in ascending order). A backend may plan reads for the
  // experts to come. Must not change any result.
  virtual void BeforeExperts(int64_t layer, std::span<const int64_t> tokens_per_expert) {
    (void)layer;
    (void)tokens_per_expert;
  }
};

// Element type of the KV cache. kF32: exact. kF16: half the memory (llama.cpp's default cache type); keys and values
// are rounded to IEEE half (nearest even) as they are stored and widened exactly when read, everything else stays
// float, so a run differs from kF32 only by that rounding.
enum class KvType : uint8_t { kF32, kF16 };
const char* KvTypeName(KvType type);
Result<KvType> ParseKvType(const std::string& name);
inline uint64_t KvElementBytes(KvType type) { return type == KvType::kF16 ? 2 : 4; }

// Tokens an Eval runs through the layers at a time (InferenceContext::SetMaxBatch): a longer batch is cut into
// ceil(n / max) chunks of near-equal size, run one after the other, so the batch scratch (a few vectors of dim, kv_dim
// and n_ff floats per token) stays bounded whatever the prompt's length. Chunks of near-equal size keep every chunk of
// a batch of >= 64 tokens at >= 64 tokens whenever the maximum is >= 128, so the sparse FFNs' batched-prefill rule
// (kDefaultBatchedPrefillMinTokens, runtime/engine/sparse_ffn.h) gives the same function with or without chunking.
inline constexpr int64_t kDefaultMaxBatch = 512;
// Tokens whose q, k, v and attention output a chunk computes at a time (the projections' GEMM rows equal GEMV rows and
// attention is per query, so the tiling changes no result).
inline constexpr int64_t kAttentionTile = 64;

// MoE routing: the experts of the k largest router logits (ties to the smaller index) into order[0..k), from order's
// n_experts entries (all of them are rewritten). One rule for the context's routing and the offloaded runtime's
// guesses of it.
void TopExperts(const float* logits, int64_t k, std::span<int64_t> order);

// out = x / rms(x) * w over n elements (eps added to the mean square): the model's normalisation, shared with the
// offloaded runtime's guesses of a layer's input.
void RmsNorm(const float* x, const float* w, int64_t n, float eps, float* out);

// Thread-safety: not thread-safe; one context per sequence. The model and pool must outlive it.
class InferenceContext {
 public:
  // `n_ctx`: maximum sequence length (KV cache size); <= 0 means the model's context length.
  InferenceContext(const Model& model, ThreadPool* pool, int64_t n_ctx, KvType kv_type = KvType::kF32);

  // Runs `tokens` at positions pos() .. pos()+n-1 (GEMM when n > 1, GEMV when n == 1; in chunks of at most
  // max_batch() tokens) and advances pos(). Keeps the logits of the last token, or of every token when `all_logits`.
  // A failure in a later chunk leaves pos() after the chunks that ran.
  Status Eval(std::span<const int32_t> tokens, bool all_logits);
  // The largest chunk an Eval runs at once (kDefaultMaxBatch; >= 1). Results do not depend on it (per-row GEMM equals
  // GEMV; attention is per query), except through an FFN backend's batch rules (see kDefaultMaxBatch).
  void SetMaxBatch(int64_t n) { max_batch_ = std::max<int64_t>(1, n); }
  int64_t max_batch() const { return max_batch_; }
  // Allocates now the batch scratch of a chunk of min(n, max_batch()) tokens, so that state_bytes() counts it (e.g. in
  // a memory budget's fixed part). `ffn`: also the gate/up/hidden vectors of the context's own FFN (n_ff floats each
  // per token), which it otherwise allocates only when it computes an FFN itself (no backend, or one that declines).
  void ReserveBatch(int64_t n, bool ffn);
  // Allocates now the logits of n tokens (an all_logits Eval of up to n tokens, e.g. a perplexity window), so that
  // state_bytes() counts them.
  void ReserveLogits(int64_t n);
  // Logits (n_vocab floats) of token `i` of the last Eval (i < 0: the last token).
  const float* logits(int64_t i = -1) const;
  int64_t pos() const { return pos_; }
  int64_t n_ctx() const { return n_ctx_; }
  // Positions the KV cache holds: n_ctx, or with a sliding window W that many fewer: a ring of the last
  // W + kAttentionTile positions (rounded up to whole key blocks), which a tile's new keys never overwrite while its
  // queries still see them.
  static int64_t KvPositions(const LlamaHparams& hp, int64_t n_ctx);
  int64_t kv_positions() const { return kv_positions_; }
  KvType kv_type() const { return kv_type_; }
  int64_t n_vocab() const { return hp_.n_vocab; }
  void Reset() { pos_ = 0; }
  // Whether the context can go back to position `pos` (0 <= pos <= pos()) and continue from there as if the tokens
  // after it had never been evaluated: always, unless the KV cache is a ring whose later positions have overwritten a
  // key that the queries from `pos` on still see (one older than pos - sliding window + 1 is never seen again).
  bool CanRewind(int64_t pos) const;
  // Goes back to `pos` (CanRewind(pos) must hold, else Internal): positions pos.. are rewritten by the next Eval,
  // whose results equal those of a context that evaluated only the tokens before `pos` (each row's arithmetic is the
  // same in any batch; EngineTest.RewoundContextEqualsAFreshOne). The logits of the last Eval are no longer valid.
  Status Rewind(int64_t pos);
  void SetFfnObserver(FfnObserver observer) { observer_ = std::move(observer); }
  // nullptr: the dense FFN. The backend must outlive its use; the observer sees only FFNs the dense path ran.
  void SetFfnBackend(FfnBackend* backend) { ffn_backend_ = backend; }
  // Where token embedding rows come from when the model's token_embd is not in memory (e.g. read from flash): fills
  // the row of `token` (token_embd's row_bytes) into `row`. Empty: token_embd's memory.
  using EmbeddingSource = std::function<Status(int32_t token, uint8_t* row)>;
  void SetEmbeddingSource(EmbeddingSource source) { embedding_source_ = std::move(source); }
  // Bytes held by the KV cache and scratch buffers (their capacity: what the process holds).
  uint64_t state_bytes() const;

 private:
  void EnsureBatch(int64_t n);
  void EnsureFfnBatch(int64_t n);
  // Hands the observer (if any) the FFN just computed in gate_ / hidden_: n rows of `ffn_input`, the batch's tokens
  // token_index[r] (MoE) or chunk_first_ + r (dense, token_index nullptr).
  void Observe(int64_t layer, int64_t expert, int64_t n, const int64_t* token_index, const float* ffn_input);
  // One chunk of Eval; its logits (all, or only its last token's when `last_logits`) go to logits_ from row `row`.
  Status EvalChunk(std::span<const int32_t> tokens, bool all_logits, bool last_logits, int64_t row);
  // Attention of the n tokens in q_, k_, v_ at positions pos .. pos+n-1 (appends their keys and values).
  void Attention(int64_t layer, int64_t n, int64_t pos);
  Status DenseFfn(const LayerWeights& L, int64_t layer, int64_t n);
  Status MoeFfn(const LayerWeights& L, int64_t layer, int64_t n);
  void MatMul(const MatrixView& w, const Activation& x, float* y);

  const Model& model_;
  const LlamaHparams& hp_;
  ThreadPool* pool_;
  int64_t n_ctx_;
  int64_t kv_positions_;  // KvPositions(hp_, n_ctx_)
  int64_t pos_ = 0;
  FfnObserver observer_;
  FfnBackend* ffn_backend_ = nullptr;
  EmbeddingSource embedding_source_;
  std::vector<uint8_t> embedding_row_;
  KvType kv_type_;
  // Per layer: keys in blocks of 64 positions, transposed (KeyCacheIndex in context.cc); values (kv_positions, kv_dim).
  // Position p is kept at p % kv_positions_ (p itself unless a sliding window makes the cache a ring).
  // kF32 uses k_cache_ / v_cache_, kF16 k_half_ / v_half_ (IEEE half bits).
  std::vector<float> k_cache_, v_cache_;
  std::vector<uint16_t> k_half_, v_half_;
  // Batch scratch, sized for the largest chunk seen (gate_, up_, hidden_: the largest FFN the context computed).
  int64_t max_batch_ = kDefaultMaxBatch;
  int64_t chunk_first_ = 0;  // the running chunk's first token in its Eval's batch
  int64_t batch_cap_ = 0, ffn_cap_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, att_, o_, gate_, up_, hidden_, ffn_out_;
  // MoE: router logits (n x n_experts), one expert's inputs and outputs (n x dim), its tokens.
  std::vector<float> router_, expert_x_, expert_out_;
  std::vector<int64_t> expert_tokens_;
  std::vector<float> attn_scratch_;       // per thread: AttentionScratchFloats (context.cc)
  std::vector<float> logits_;
  int64_t n_logits_ = 0;
  std::vector<float> rope_cos_, rope_sin_;  // (n_ctx, head_dim / 2)
  Activation act_;
};

}  // namespace nflash
