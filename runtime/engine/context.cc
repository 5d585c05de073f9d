// The Llama forward pass: embedding, per layer RMSNorm -> attention (RoPE, GQA, KV cache) -> RMSNorm -> FFN (dense or
// mixture of experts), final norm and output head. A batch of n tokens uses GEMM; a single token uses GEMV.
#include "runtime/engine/context.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>

#include <immintrin.h>

#include "runtime/core/float16.h"
#include "runtime/core/kernels.h"
#include "runtime/core/quant.h"

namespace nflash {

void RmsNorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

namespace {

// gate <- act(gate); hidden = gate * up (silu, relu) or gate * relu(up) (drelu).
void ApplyFfnActivation(FfnActivation a, int64_t count, float* gate, const float* up, float* hidden) {
  for (int64_t i = 0; i < count; ++i) hidden[i] = ActivateNeuron(a, gate[i], up[i], &gate[i]);
}

// Attention is flash-attention style: a tile of queries of one KV head (all its GQA query heads) walks the keys in
// blocks with an online softmax, so scores never need a row of n_ctx floats and each key block is loaded once for
// the whole tile. Queries per tile: 16, so that 16 x 64 scores (4 KiB) stay in L1.
constexpr int64_t kQueryTile = 16;
// Keys per block: 64 keys x head_dim 128 is 32 KiB (L1/L2-resident), and 64 floats are whole vectors of any width,
// so the QK loop over a block's keys has no scalar tail except at the causal edge. The key cache is kept in this
// blocked, transposed layout (per KV head, per block of 64 positions: head_dim rows of the block's keys; see
// KeyCacheIndex), written once per token, so the QK loop reads it directly. (Transposing each block on every call
// cost as much as the QK work itself in decode, one query row per block: ~10% of a SYNTHETIC 7B decode token.)
constexpr int64_t kKeyBlock = 64;

// Positions in the key block that starts at position `start` (a multiple of kKeyBlock): the row width of its keys.
inline int64_t KeyBlockWidth(int64_t n_ctx, int64_t start) { return std::min(kKeyBlock, n_ctx - start); }
// Float index, within one layer's key cache of n_ctx positions, of element i of KV head kvh's key at position p. The
// last block holds n_ctx mod 64 positions when n_ctx is not a multiple of 64: its rows are that wide, so the cache is
// exactly n_ctx * kv_dim elements per layer, as KvCacheBytes accounts it.
inline int64_t KeyCacheIndex(int64_t n_ctx, int64_t head_dim, int64_t kvh, int64_t p, int64_t i) {
  const int64_t start = p / kKeyBlock * kKeyBlock;
  return kvh * n_ctx * head_dim + start * head_dim + i * KeyBlockWidth(n_ctx, start) + (p - start);
}
// Below this many multiply-adds (~50 microseconds on one core) an attention call runs on the calling thread: waking
// the pool costs more than it saves (stories260K decode: 8 heads of 8 dims).
constexpr double kMinParallelAttentionWork = 2e5;

struct AttentionParams {
  const float* q = nullptr;  // (n, q_stride), RoPE applied
  // This layer's key cache in blocks (KeyCacheIndex), positions < pos + n filled, and value cache (n_ctx, kv_stride):
  // floats (KvType::kF32) or IEEE half bits (kF16).
  const void* kc = nullptr;
  const void* vc = nullptr;
  float* out = nullptr;       // (n, q_stride)
  int64_t pos = 0;            // position of query 0
  int64_t n = 0;
  int64_t head_dim = 0;
  int64_t q_stride = 0;
  int64_t kv_stride = 0;      // of the value cache
  int64_t slots = 0;          // positions the caches hold: position p at p % slots (InferenceContext::KvPositions)
  int64_t group = 1;          // query heads per KV head
  float scale = 1.0f;         // 1 / sqrt(head_dim)
  int64_t window = 0;         // > 0: the query at position p sees keys (p - window, p] only (sliding window)
};

// Floats of one thread's scratch: scores, output accumulators, running max and sum; with a half cache, one key block
// and its value rows widened to float.
size_t AttentionScratchFloats(int64_t head_dim, int64_t group, KvType kv_type) {
  const int64_t rows = group * kQueryTile;
  const int64_t widened = kv_type == KvType::kF16 ? 2 * kKeyBlock * head_dim : 0;
  return static_cast<size_t>(rows * kKeyBlock + rows * head_dim + 2 * rows + widened);
}

// Half bits -> floats (exact). The F16C copy serves the AVX2 and AVX-512 attention; both give Fp16ToFp32's values.
using WidenFn = void (*)(const uint16_t* src, int64_t n, float* dst);
void WidenHalfScalar(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(src[i]);
}
[[gnu::target("avx2,f16c")]] void WidenHalfF16c(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = Fp16ToFp32(src[i]);
}

// Queries [t0, t1) of every query head of KV head `kvh`. Each (query, head) row goes through the same operations in
// the same order whatever the tile holds (keys past its causal limit are skipped, not masked), so a batch gives the
// same values as token-by-token decode. Written as plain loops over contiguous floats, which the compiler vectorises
// for the ISA of the function it is inlined into (AttendTile's per-ISA copies). T: the cache's element (float, or
// uint16_t half bits, each block widened by `widen` into scratch before use: the same float values whatever the ISA).
template <typename T>
[[gnu::always_inline]] inline void AttendTileBody(const AttentionParams& a, int64_t t0, int64_t t1, int64_t kvh,
                                                  float* scratch, WidenFn widen) {
  const int64_t hd = a.head_dim, rows = (t1 - t0) * a.group, max_rows = a.group * kQueryTile;
  float* s = scratch;                     // (rows, kKeyBlock): scores, then probabilities
  float* o = s + max_rows * kKeyBlock;    // (rows, head_dim): unnormalised output
  float* m = o + max_rows * hd;           // (rows): running max of the scores
  float* l = m + max_rows;                // (rows): running sum of exp(score - m)
  float* kw = l + max_rows;               // half cache: the block's keys (head_dim, width), widened
  float* vw = kw + kKeyBlock * hd;        // and its value rows (nk, head_dim)
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    std::fill(o + r * hd, o + (r + 1) * hd, 0.0f);
  }
  const int64_t keys = a.pos + t1;  // keys seen by the tile's last query
  // The block holding the first key the tile's first query sees (the window's start moves with the query).
  const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, a.pos + t0 + 1 - a.window) : 0;
  for (int64_t k0 = first_key / kKeyBlock * kKeyBlock; k0 < keys; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, keys - k0);
    const int64_t at = k0 % a.slots;  // the block's place in the caches (a ring holds whole blocks)
    const int64_t width = KeyBlockWidth(a.slots, at);
    const float* kt = nullptr;  // (head_dim, width): the block's keys
    const float* vt = nullptr;  // value row of key k0 + j at vt + j * vstride
    int64_t vstride = 0;
    if constexpr (std::is_same_v<T, float>) {
      kt = kc + KeyCacheIndex(a.slots, hd, kvh, at, 0);
      vt = vc + at * a.kv_stride + kvh * hd;
      vstride = a.kv_stride;
    } else {
      widen(kc + KeyCacheIndex(a.slots, hd, kvh, at, 0), hd * width, kw);
      for (int64_t j = 0; j < nk; ++j) widen(vc + (at + j) * a.kv_stride + kvh * hd, hd, vw + j * hd);
      kt = kw;
      vt = vw;
      vstride = hd;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / a.group, h = kvh * a.group + r % a.group;
      const int64_t len = a.pos + t + 1;  // causal: this query sees keys [lo, len)
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
      if (k0 >= len || k0 + nk <= lo) continue;
      const int64_t j0 = std::max<int64_t>(0, lo - k0), nv = std::min(nk, len - k0);  // keys k0 + [j0, nv)
      const float* q = a.q + t * a.q_stride + h * hd;
      float* sr = s + r * kKeyBlock;
      std::fill(sr + j0, sr + nv, 0.0f);
      for (int64_t i = 0; i < hd; ++i) {
        const float qi = q[i];
        const float* kr = kt + i * width;
        for (int64_t j = j0; j < nv; ++j) sr[j] += qi * kr[j];
      }
      float mx = m[r];
      for (int64_t j = j0; j < nv; ++j) {
        sr[j] *= a.scale;
        mx = std::max(mx, sr[j]);
      }
      const float alpha = std::exp(m[r] - mx);  // rescales what earlier blocks summed; 0 for the first block
      float sum = 0.0f;
      for (int64_t j = j0; j < nv; ++j) {
        sr[j] = std::exp(sr[j] - mx);
        sum += sr[j];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
      float* orow = o + r * hd;
      if (alpha != 1.0f) {
        for (int64_t i = 0; i < hd; ++i) orow[i] *= alpha;
      }
      for (int64_t j = j0; j < nv; ++j) {
        const float p = sr[j];
        const float* v = vt + j * vstride;
        for (int64_t i = 0; i < hd; ++i) orow[i] += p * v[i];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / a.group, h = kvh * a.group + r % a.group;
    const float inv = 1.0f / l[r];
    float* out = a.out + t * a.q_stride + h * hd;
    for (int64_t i = 0; i < hd; ++i) out[i] = o[r * hd + i] * inv;
  }
}

// One copy of AttendTileBody per kernel ISA and cache type (the kernels' CPU checks guard them; see kernels.h
// ActiveIsa).
template <typename T>
[[gnu::target("avx512f,avx512vl,avx512bw,avx512dq,fma,f16c,prefer-vector-width=512")]] void AttendTileAvx512(
    const AttentionParams& a, int64_t t0, int64_t t1, int64_t kvh, float* scratch) {
  AttendTileBody<T>(a, t0, t1, kvh, scratch, WidenHalfF16c);
}
template <typename T>
[[gnu::target("avx2,fma,f16c")]] void AttendTileAvx2(const AttentionParams& a, int64_t t0, int64_t t1, int64_t kvh,
                                                    float* scratch) {
  AttendTileBody<T>(a, t0, t1, kvh, scratch, WidenHalfF16c);
}
template <typename T>
void AttendTileScalar(const AttentionParams& a, int64_t t0, int64_t t1, int64_t kvh, float* scratch) {
  AttendTileBody<T>(a, t0, t1, kvh, scratch, WidenHalfScalar);
}

template <typename T>
void AttendTile(const AttentionParams& a, int64_t t0, int64_t t1, int64_t kvh, float* scratch) {
  switch (ActiveIsa()) {
    case KernelIsa::kAvx512:
      return AttendTileAvx512<T>(a, t0, t1, kvh, scratch);
    case KernelIsa::kAvx2:
      return AttendTileAvx2<T>(a, t0, t1, kvh, scratch);
    case KernelIsa::kScalar:
      break;
  }
  AttendTileScalar<T>(a, t0, t1, kvh, scratch);
}

}  // namespace

const char* KvTypeName(KvType type) { return type == KvType::kF16 ? "f16" : "f32"; }

Result<KvType> ParseKvType(const std::string& name) {
  if (name == "f32") return KvType::kF32;
  if (name == "f16") return KvType::kF16;
  return Status::InvalidArgument("KV cache type \"" + name + "\": expected f32 or f16");
}

int64_t InferenceContext::KvPositions(const LlamaHparams& hp, int64_t n_ctx) {
  if (hp.sliding_window <= 0) return n_ctx;
  const int64_t ring = (hp.sliding_window + kAttentionTile + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  return std::min(n_ctx, ring);
}

bool InferenceContext::CanRewind(int64_t pos) const {
  if (pos < 0 || pos > pos_) return false;
  if (kv_positions_ >= n_ctx_) return true;  // no ring: nothing is ever overwritten
  // The ring holds positions [pos_ - kv_positions_, pos_); queries at pos.. see keys from pos - window + 1 on.
  return std::max<int64_t>(0, pos - hp_.sliding_window + 1) >= pos_ - kv_positions_;
}

Status InferenceContext::Rewind(int64_t pos) {
  if (!CanRewind(pos)) {
    return Status::Internal("cannot rewind the context from position " + std::to_string(pos_) + " to " +
                            std::to_string(pos) + " (KV ring of " + std::to_string(kv_positions_) +
                            " positions, sliding window " + std::to_string(hp_.sliding_window) + ")");
  }
  pos_ = pos;
  return Status::Ok();
}

InferenceContext::InferenceContext(const Model& model, ThreadPool* pool, int64_t n_ctx, KvType kv_type)
    : model_(model),
      hp_(model.hparams()),
      pool_(pool),
      n_ctx_(n_ctx > 0 ? n_ctx : model.hparams().context_length),
      kv_positions_(KvPositions(hp_, n_ctx_)),
      kv_type_(kv_type) {
  const size_t kv = static_cast<size_t>(hp_.n_layers * kv_positions_ * hp_.kv_dim());
  if (kv_type_ == KvType::kF16) {
    k_half_.assign(kv, 0);
    v_half_.assign(kv, 0);
  } else {
    k_cache_.assign(kv, 0.0f);
    v_cache_.assign(kv, 0.0f);
  }
  attn_scratch_.assign(AttentionScratchFloats(hp_.head_dim, hp_.n_heads / hp_.n_kv_heads, kv_type_) *
                           static_cast<size_t>(pool_->NumThreads()),
                       0.0f);
  // RoPE tables: pair i of a head rotates by (pos / scale) * theta^(-2i / head_dim) (llama2.c / GGUF convention),
  // that frequency divided by rope_freqs[i] where the model has them (llama3 scaling).
  const int64_t half = hp_.head_dim / 2;
  const float* freq_factors = model_.rope_freqs();
  rope_cos_.resize(static_cast<size_t>(n_ctx_ * half));
  rope_sin_.resize(rope_cos_.size());
  for (int64_t p = 0; p < n_ctx_; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      double freq = std::pow(static_cast<double>(hp_.rope_theta), -2.0 * static_cast<double>(i) /
                                                                     static_cast<double>(hp_.head_dim));
      if (freq_factors != nullptr) freq /= static_cast<double>(freq_factors[i]);
      const double angle = static_cast<double>(p) / hp_.rope_scale * freq;
      rope_cos_[p * half + i] = static_cast<float>(std::cos(angle));
      rope_sin_[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

uint64_t InferenceContext::state_bytes() const {
  uint64_t floats = 0;
  for (const auto* v : {&k_cache_, &v_cache_, &attn_scratch_, &logits_, &rope_cos_, &rope_sin_, &x_, &xn_, &q_, &k_,
                        &v_, &att_, &o_, &gate_, &up_, &hidden_, &ffn_out_, &router_, &expert_x_, &expert_out_}) {
    floats += v->capacity();
  }
  return floats * sizeof(float) + (k_half_.capacity() + v_half_.capacity()) * sizeof(uint16_t) +
         expert_tokens_.capacity() * sizeof(int64_t);
}

void InferenceContext::ReserveBatch(int64_t n, bool ffn) {
  const int64_t chunk = std::min({std::max<int64_t>(1, n), max_batch_, n_ctx_});  // no chunk outgrows the context
  EnsureBatch(chunk);
  if (ffn) EnsureFfnBatch(chunk);
  // Every token's logits (all_logits, e.g. perplexity) are the caller's choice, not reserved here.
}

void InferenceContext::ReserveLogits(int64_t n) {
  logits_.reserve(static_cast<size_t>(std::min(std::max<int64_t>(1, n), n_ctx_) * hp_.n_vocab));
}

void InferenceContext::EnsureBatch(int64_t n) {
  if (n <= batch_cap_) return;
  batch_cap_ = n;
  const auto sz = [n](int64_t per_token) { return static_cast<size_t>(n * per_token); };
  const auto tile = [n](int64_t per_token) { return static_cast<size_t>(std::min(n, kAttentionTile) * per_token); };
  x_.resize(sz(hp_.dim));
  xn_.resize(sz(hp_.dim));
  q_.resize(tile(hp_.q_dim()));
  k_.resize(tile(hp_.kv_dim()));
  v_.resize(tile(hp_.kv_dim()));
  att_.resize(tile(hp_.q_dim()));
  o_.resize(tile(hp_.dim));
  ffn_out_.resize(sz(hp_.dim));
  if (hp_.n_experts > 0) {
    router_.resize(sz(hp_.n_experts));
    expert_x_.resize(sz(hp_.dim));
    expert_out_.resize(sz(hp_.dim));
    expert_tokens_.resize(static_cast<size_t>(n));
  }
}

void InferenceContext::EnsureFfnBatch(int64_t n) {
  if (n <= ffn_cap_) return;
  ffn_cap_ = n;
  gate_.resize(static_cast<size_t>(n * hp_.n_ff));
  up_.resize(gate_.size());
  hidden_.resize(gate_.size());
}

void InferenceContext::MatMul(const MatrixView& w, const Activation& x, float* y) {
  if (x.n() == 1) {
    Gemv(w, x, y, pool_);
  } else {
    Gemm(w, x, y, pool_);
  }
}

const float* InferenceContext::logits(int64_t i) const {
  if (i < 0) i = n_logits_ - 1;
  return logits_.data() + i * hp_.n_vocab;
}

Status InferenceContext::Eval(std::span<const int32_t> tokens, bool all_logits) {
  const int64_t total = static_cast<int64_t>(tokens.size());
  if (total == 0) return Status::InvalidArgument("Eval of an empty batch");
  if (pos_ + total > n_ctx_) {
    return Status::ResourceExhausted("context full: position " + std::to_string(pos_) + " + " + std::to_string(total) +
                                     " tokens exceeds the context size " + std::to_string(n_ctx_));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= hp_.n_vocab) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                     std::to_string(hp_.n_vocab) + ")");
    }
  }
  // ceil(total / max_batch_) chunks of near-equal size, the first ones one token longer.
  const int64_t chunks = (total + max_batch_ - 1) / max_batch_;
  const int64_t base = total / chunks, longer = total % chunks;
  n_logits_ = all_logits ? total : 1;
  logits_.resize(static_cast<size_t>(n_logits_ * hp_.n_vocab));
  if (ffn_backend_ != nullptr) ffn_backend_->BeginEval();
  int64_t at = 0;
  Status status;
  for (int64_t c = 0; c < chunks && status.ok(); ++c) {
    const int64_t n = base + (c < longer ? 1 : 0);
    const bool last = c + 1 == chunks;
    chunk_first_ = at;
    status = EvalChunk(tokens.subspan(static_cast<size_t>(at), static_cast<size_t>(n)), all_logits, last,
                       all_logits ? at : 0);
    at += n;
  }
  if (ffn_backend_ != nullptr) ffn_backend_->EndEval();
  return status;
}

Status InferenceContext::EvalChunk(std::span<const int32_t> tokens, bool all_logits, bool last_logits, int64_t row) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  EnsureBatch(n);
  const int64_t dim = hp_.dim;
  const MatrixView& emb = model_.token_embd();
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* row = nullptr;
    if (embedding_source_) {
      embedding_row_.resize(emb.row_bytes);
      NF_RETURN_IF_ERROR(embedding_source_(tokens[t], embedding_row_.data()));
      row = embedding_row_.data();
    } else {
      row = static_cast<const uint8_t*>(emb.data) + emb.row_bytes * static_cast<size_t>(tokens[t]);
    }
    NF_RETURN_IF_ERROR(DequantizeRow(emb.type, row, x_.data() + t * dim, dim));
  }

  for (int64_t l = 0; l < hp_.n_layers; ++l) {
    const LayerWeights& L = model_.layers()[static_cast<size_t>(l)];
    for (int64_t t = 0; t < n; ++t) RmsNorm(x_.data() + t * dim, L.attn_norm, dim, hp_.norm_eps, xn_.data() + t * dim);
    if (ffn_backend_ != nullptr) ffn_backend_->BeforeAttention(l, xn_.data(), n);
    // Attention in tiles of kAttentionTile tokens (their keys and values appended before the next tile's queries
    // run), so that q, k, v and the attention output stay a tile's size whatever the chunk's.
    for (int64_t t0 = 0; t0 < n; t0 += kAttentionTile) {
      const int64_t tn = std::min(kAttentionTile, n - t0);
      act_.Set(xn_.data() + t0 * dim, tn, dim);
      {
        // One parallel loop for the three projections of the same input.
        const MatrixView ws[] = {L.wq, L.wk, L.wv};
        float* const ys[] = {q_.data(), k_.data(), v_.data()};
        GemmMany(ws, act_, ys, pool_);
        const float* const bs[] = {L.bq, L.bk, L.bv};
        const int64_t widths[] = {hp_.q_dim(), hp_.kv_dim(), hp_.kv_dim()};
        for (int m = 0; m < 3; ++m) {
          if (bs[m] == nullptr) continue;
          for (int64_t t = 0; t < tn; ++t) {
            float* y = ys[m] + t * widths[m];
            for (int64_t i = 0; i < widths[m]; ++i) y[i] += bs[m][i];
          }
        }
      }
      Attention(l, tn, pos_ + t0);
      act_.Set(att_.data(), tn, hp_.q_dim());
      MatMul(L.wo, act_, o_.data());
      float* x = x_.data() + t0 * dim;
      for (int64_t i = 0; i < tn * dim; ++i) x[i] += o_[i];
    }

    for (int64_t t = 0; t < n; ++t) RmsNorm(x_.data() + t * dim, L.ffn_norm, dim, hp_.norm_eps, xn_.data() + t * dim);
    if (ffn_backend_ != nullptr) ffn_backend_->BeforeFfn(l, x_.data(), n);
    if (hp_.n_experts == 0) {
      NF_RETURN_IF_ERROR(DenseFfn(L, l, n));
    } else {
      NF_RETURN_IF_ERROR(MoeFfn(L, l, n));
    }
    for (int64_t i = 0; i < n * dim; ++i) x_[i] += ffn_out_[i];
  }

  // Output head: all tokens, or only the last one (of the last chunk), into logits_ from row `row`.
  if (all_logits || last_logits) {
    const int64_t first = all_logits ? 0 : n - 1;
    for (int64_t t = first; t < n; ++t) {
      RmsNorm(x_.data() + t * dim, model_.output_norm(), dim, hp_.norm_eps, xn_.data() + (t - first) * dim);
    }
    act_.Set(xn_.data(), n - first, dim);
    MatMul(model_.output(), act_, logits_.data() + row * hp_.n_vocab);
  }
  pos_ += n;
  return Status::Ok();
}

void InferenceContext::Attention(int64_t layer, int64_t n, int64_t pos) {
  const int64_t hd = hp_.head_dim, half = hd / 2, kv_dim = hp_.kv_dim(), q_dim = hp_.q_dim();
  const int64_t group = hp_.n_heads / hp_.n_kv_heads;
  const bool f16 = kv_type_ == KvType::kF16;
  const int64_t layer_base = layer * kv_positions_ * kv_dim;
  float* kc = f16 ? nullptr : k_cache_.data() + layer_base;
  float* vc = f16 ? nullptr : v_cache_.data() + layer_base;
  uint16_t* kh = f16 ? k_half_.data() + layer_base : nullptr;
  uint16_t* vh = f16 ? v_half_.data() + layer_base : nullptr;
  // Qwen3: each head of q and k RMS-normalised (its own weights over head_dim) before RoPE.
  const LayerWeights& L = model_.layers()[static_cast<size_t>(layer)];
  // RoPE on q and k, pair i being elements (2i, 2i + 1) of a head (the llama layout) or (i, i + half) (NEOX), then
  // append k and v to the cache.
  const int64_t stride = hp_.rope_neox ? 1 : 2, offset = hp_.rope_neox ? half : 1;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = rope_cos_.data() + (pos + t) * half;
    const float* s = rope_sin_.data() + (pos + t) * half;
    auto rotate = [&](float* vec, int64_t heads, const float* norm) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = vec + h * hd;
        if (norm != nullptr) RmsNorm(v, norm, hd, hp_.norm_eps, v);
        for (int64_t i = 0; i < half; ++i) {
          float* x = v + i * stride;
          const float a = x[0], b = x[offset];
          x[0] = a * c[i] - b * s[i];
          x[offset] = a * s[i] + b * c[i];
        }
      }
    };
    rotate(q_.data() + t * q_dim, hp_.n_heads, L.q_norm);
    rotate(k_.data() + t * kv_dim, hp_.n_kv_heads, L.k_norm);
    const float* kt = k_.data() + t * kv_dim;
    const int64_t at = (pos + t) % kv_positions_;  // its place in the caches
    const int64_t width = KeyBlockWidth(kv_positions_, at / kKeyBlock * kKeyBlock);  // element i is i rows down
    const float* vt = v_.data() + t * kv_dim;
    // The key into its block (transposed), the value as a row, each element converted to the cache's type.
    auto append = [&](auto* keys, auto* values, auto convert) {
      for (int64_t h = 0; h < hp_.n_kv_heads; ++h) {
        auto* dst = keys + KeyCacheIndex(kv_positions_, hd, h, at, 0);
        for (int64_t i = 0; i < hd; ++i) dst[i * width] = convert(kt[h * hd + i]);
      }
      auto* vdst = values + at * kv_dim;
      for (int64_t i = 0; i < kv_dim; ++i) vdst[i] = convert(vt[i]);
    };
    if (f16) {
      append(kh, vh, Fp32ToFp16);  // rounded to nearest even, as F16C and ggml store it
    } else {
      append(kc, vc, [](float x) { return x; });
    }
  }
  AttentionParams a;
  a.q = q_.data();
  a.kc = f16 ? static_cast<const void*>(kh) : kc;
  a.vc = f16 ? static_cast<const void*>(vh) : vc;
  a.out = att_.data();
  a.pos = pos;
  a.n = n;
  a.head_dim = hd;
  a.q_stride = q_dim;
  a.kv_stride = kv_dim;
  a.slots = kv_positions_;
  a.group = group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  a.window = hp_.sliding_window;
  const int64_t tiles = (n + kQueryTile - 1) / kQueryTile;
  const int64_t items = tiles * hp_.n_kv_heads;
  const size_t per_thread = AttentionScratchFloats(hd, group, kv_type_);
  // Work item i is (query tile, kv head); tiles are taken last first, since causal masking makes later tiles the
  // longest, so the threads finish together. Each item is computed by one thread in a fixed order, so the result
  // does not depend on the thread count.
  auto run_item = [&](int64_t i, float* scratch) {
    const int64_t tile = tiles - 1 - i / hp_.n_kv_heads, kvh = i % hp_.n_kv_heads;
    const int64_t q0 = tile * kQueryTile, q1 = std::min(n, (tile + 1) * kQueryTile);
    if (f16) {
      AttendTile<uint16_t>(a, q0, q1, kvh, scratch);
    } else {
      AttendTile<float>(a, q0, q1, kvh, scratch);
    }
  };
  // Multiply-adds of the whole call: n queries x (pos + n/2) keys on average (at most the window) x 2 (QK and PV) x
  // q_dim.
  int64_t mean_keys = pos + (n + 1) / 2;
  if (a.window > 0) mean_keys = std::min(mean_keys, a.window);
  const double work = static_cast<double>(n) * static_cast<double>(mean_keys) * 2.0 * q_dim;
  if (pool_->NumThreads() == 1 || items == 1 || work < kMinParallelAttentionWork) {
    for (int64_t i = 0; i < items; ++i) run_item(i, attn_scratch_.data());
    return;
  }
  std::atomic<int64_t> next{0};
  pool_->ParallelFor(pool_->NumThreads(), 1, [&](int64_t, int64_t, int thread) {
    float* scratch = attn_scratch_.data() + per_thread * static_cast<size_t>(thread);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      run_item(i, scratch);
    }
  });
}

void InferenceContext::Observe(int64_t layer, int64_t expert, int64_t n, const int64_t* token_index,
                               const float* ffn_input) {
  if (!observer_) return;
  FfnObservation obs;
  obs.layer = layer;
  obs.expert = expert;
  obs.n_tokens = n;
  obs.token_index = token_index;
  obs.first_token = chunk_first_;
  obs.gate_act = gate_.data();
  obs.hidden = hidden_.data();
  obs.ffn_input = ffn_input;
  observer_(obs);
}

Status InferenceContext::DenseFfn(const LayerWeights& L, int64_t layer, int64_t n) {
  const int64_t n_ff = hp_.n_ff;
  act_.Set(xn_.data(), n, hp_.dim);
  if (ffn_backend_ != nullptr) {
    NF_ASSIGN_OR_RETURN(bool handled, ffn_backend_->Forward(layer, -1, act_, ffn_out_.data()));
    if (handled) return Status::Ok();
  }
  EnsureFfnBatch(n);
  {
    const MatrixView ws[] = {L.gate, L.up};
    float* const ys[] = {gate_.data(), up_.data()};
    GemmMany(ws, act_, ys, pool_);
  }
  ApplyFfnActivation(hp_.activation, n * n_ff, gate_.data(), up_.data(), hidden_.data());
  Observe(layer, -1, n, nullptr, xn_.data());
  act_.Set(hidden_.data(), n, n_ff);
  MatMul(L.down, act_, ffn_out_.data());
  return Status::Ok();
}

void TopExperts(const float* r, int64_t k, std::span<int64_t> order) {
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return r[a] > r[b] || (r[a] == r[b] && a < b); });
}

Status InferenceContext::MoeFfn(const LayerWeights& L, int64_t layer, int64_t n) {
  const int64_t dim = hp_.dim, n_ff = hp_.n_ff, n_exp = hp_.n_experts, k = hp_.n_experts_used;
  float* router = router_.data();
  act_.Set(xn_.data(), n, dim);
  MatMul(L.router, act_, router);
  // Per token: top-k experts by router logit; weights = softmax over the selected logits (Mixtral: softmax over all,
  // then renormalised over the top k, which is the same).
  std::vector<std::vector<std::pair<int64_t, float>>> by_expert(static_cast<size_t>(n_exp));  // (token, weight)
  std::vector<int64_t> order(static_cast<size_t>(n_exp));
  for (int64_t t = 0; t < n; ++t) {
    const float* r = router + t * n_exp;
    TopExperts(r, k, order);
    const float mx = r[order[0]];
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(r[order[j]] - mx);
    for (int64_t j = 0; j < k; ++j) {
      by_expert[static_cast<size_t>(order[j])].push_back({t, std::exp(r[order[j]] - mx) / sum});
    }
  }
  if (ffn_backend_ != nullptr) {
    std::vector<int64_t> counts(static_cast<size_t>(n_exp));
    for (int64_t e = 0; e < n_exp; ++e) counts[static_cast<size_t>(e)] = static_cast<int64_t>(by_expert[e].size());
    ffn_backend_->BeforeExperts(layer, counts);
  }
  std::fill(ffn_out_.begin(), ffn_out_.begin() + n * dim, 0.0f);
  float* xe = expert_x_.data();
  float* out = expert_out_.data();
  int64_t* token_index = expert_tokens_.data();
  Activation act;
  for (int64_t e = 0; e < n_exp; ++e) {
    const auto& sel = by_expert[static_cast<size_t>(e)];
    if (sel.empty()) continue;
    const int64_t m = static_cast<int64_t>(sel.size());
    for (int64_t j = 0; j < m; ++j) {
      token_index[j] = chunk_first_ + sel[j].first;
      std::memcpy(xe + j * dim, xn_.data() + sel[j].first * dim, sizeof(float) * dim);
    }
    act.Set(xe, m, dim);
    bool handled = false;
    if (ffn_backend_ != nullptr) {
      NF_ASSIGN_OR_RETURN(handled, ffn_backend_->Forward(layer, e, act, out));
    }
    if (!handled) {
      EnsureFfnBatch(m);
      MatMul(L.Expert(L.gate, L.expert_stride_gate, e), act, gate_.data());
      MatMul(L.Expert(L.up, L.expert_stride_up, e), act, up_.data());
      ApplyFfnActivation(hp_.activation, m * n_ff, gate_.data(), up_.data(), hidden_.data());
      Observe(layer, e, m, token_index, xe);
      act.Set(hidden_.data(), m, n_ff);
      MatMul(L.Expert(L.down, L.expert_stride_down, e), act, out);
    }
    for (int64_t j = 0; j < m; ++j) {
      const float w = sel[j].second;
      float* y = ffn_out_.data() + sel[j].first * dim;
      for (int64_t i = 0; i < dim; ++i) y[i] += w * out[j * dim + i];
    }
  }
  return Status::Ok();
}

}  // namespace nflash
