// The Llama forward pass: embedding, per layer RMSNorm -> attention (RoPE, GQA, KV cache) -> RMSNorm -> FFN (dense or
// mixture of experts), final norm and output head. A batch of n tokens uses GEMM; a single token uses GEMV.
#include "runtime/engine/context.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "runtime/core/quant.h"

namespace nflash {
namespace {

void RmsNorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

// gate <- act(gate); hidden = gate * up (silu, relu) or gate * relu(up) (drelu).
void ApplyFfnActivation(FfnActivation a, int64_t count, float* gate, const float* up, float* hidden) {
  for (int64_t i = 0; i < count; ++i) hidden[i] = ActivateNeuron(a, gate[i], up[i], &gate[i]);
}

}  // namespace

InferenceContext::InferenceContext(const Model& model, ThreadPool* pool, int64_t n_ctx)
    : model_(model), hp_(model.hparams()), pool_(pool), n_ctx_(n_ctx > 0 ? n_ctx : model.hparams().context_length) {
  const size_t kv = static_cast<size_t>(hp_.n_layers * n_ctx_ * hp_.kv_dim());
  k_cache_.assign(kv, 0.0f);
  v_cache_.assign(kv, 0.0f);
  scores_.assign(static_cast<size_t>(pool_->NumThreads() * n_ctx_), 0.0f);
  // RoPE tables: pair i of a head rotates by (pos / scale) * theta^(-2i / head_dim) (llama2.c / GGUF convention).
  const int64_t half = hp_.head_dim / 2;
  rope_cos_.resize(static_cast<size_t>(n_ctx_ * half));
  rope_sin_.resize(rope_cos_.size());
  for (int64_t p = 0; p < n_ctx_; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double freq = std::pow(static_cast<double>(hp_.rope_theta), -2.0 * static_cast<double>(i) /
                                                                           static_cast<double>(hp_.head_dim));
      const double angle = static_cast<double>(p) / hp_.rope_scale * freq;
      rope_cos_[p * half + i] = static_cast<float>(std::cos(angle));
      rope_sin_[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

uint64_t InferenceContext::state_bytes() const {
  uint64_t floats = k_cache_.size() + v_cache_.size() + scores_.size() + logits_.size() + rope_cos_.size() +
                    rope_sin_.size();
  for (const auto* v : {&x_, &xn_, &q_, &k_, &v_, &att_, &o_, &gate_, &up_, &hidden_, &ffn_out_}) floats += v->size();
  return floats * sizeof(float);
}

void InferenceContext::EnsureBatch(int64_t n) {
  if (n <= batch_cap_) return;
  batch_cap_ = n;
  const auto sz = [n](int64_t per_token) { return static_cast<size_t>(n * per_token); };
  x_.resize(sz(hp_.dim));
  xn_.resize(sz(hp_.dim));
  q_.resize(sz(hp_.q_dim()));
  k_.resize(sz(hp_.kv_dim()));
  v_.resize(sz(hp_.kv_dim()));
  att_.resize(sz(hp_.q_dim()));
  o_.resize(sz(hp_.dim));
  gate_.resize(sz(hp_.n_ff));
  up_.resize(sz(hp_.n_ff));
  hidden_.resize(sz(hp_.n_ff));
  ffn_out_.resize(sz(hp_.dim));
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
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return Status::InvalidArgument("Eval of an empty batch");
  if (pos_ + n > n_ctx_) {
    return Status::ResourceExhausted("context full: position " + std::to_string(pos_) + " + " + std::to_string(n) +
                                     " tokens exceeds the context size " + std::to_string(n_ctx_));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= hp_.n_vocab) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                     std::to_string(hp_.n_vocab) + ")");
    }
  }
  EnsureBatch(n);
  const int64_t dim = hp_.dim;
  const MatrixView& emb = model_.token_embd();
  for (int64_t t = 0; t < n; ++t) {
    const auto* row = static_cast<const uint8_t*>(emb.data) + emb.row_bytes * static_cast<size_t>(tokens[t]);
    NF_RETURN_IF_ERROR(DequantizeRow(emb.type, row, x_.data() + t * dim, dim));
  }

  for (int64_t l = 0; l < hp_.n_layers; ++l) {
    const LayerWeights& L = model_.layers()[static_cast<size_t>(l)];
    for (int64_t t = 0; t < n; ++t) RmsNorm(x_.data() + t * dim, L.attn_norm, dim, hp_.norm_eps, xn_.data() + t * dim);
    act_.Set(xn_.data(), n, dim);
    MatMul(L.wq, act_, q_.data());
    MatMul(L.wk, act_, k_.data());
    MatMul(L.wv, act_, v_.data());
    Attention(l, n);
    act_.Set(att_.data(), n, hp_.q_dim());
    MatMul(L.wo, act_, o_.data());
    for (int64_t i = 0; i < n * dim; ++i) x_[i] += o_[i];

    for (int64_t t = 0; t < n; ++t) RmsNorm(x_.data() + t * dim, L.ffn_norm, dim, hp_.norm_eps, xn_.data() + t * dim);
    if (hp_.n_experts == 0) {
      NF_RETURN_IF_ERROR(DenseFfn(L, l, n));
    } else {
      NF_RETURN_IF_ERROR(MoeFfn(L, l, n));
    }
    for (int64_t i = 0; i < n * dim; ++i) x_[i] += ffn_out_[i];
  }

  // Output head: all tokens, or only the last one.
  const int64_t first = all_logits ? 0 : n - 1;
  n_logits_ = n - first;
  for (int64_t t = first; t < n; ++t) {
    RmsNorm(x_.data() + t * dim, model_.output_norm(), dim, hp_.norm_eps, xn_.data() + (t - first) * dim);
  }
  logits_.resize(static_cast<size_t>(n_logits_ * hp_.n_vocab));
  act_.Set(xn_.data(), n_logits_, dim);
  MatMul(model_.output(), act_, logits_.data());
  pos_ += n;
  return Status::Ok();
}

void InferenceContext::Attention(int64_t layer, int64_t n) {
  const int64_t hd = hp_.head_dim, half = hd / 2, kv_dim = hp_.kv_dim(), q_dim = hp_.q_dim();
  const int64_t group = hp_.n_heads / hp_.n_kv_heads;
  float* kc = k_cache_.data() + layer * n_ctx_ * kv_dim;
  float* vc = v_cache_.data() + layer * n_ctx_ * kv_dim;
  // RoPE on q and k (consecutive pairs), then append k and v to the cache.
  for (int64_t t = 0; t < n; ++t) {
    const float* c = rope_cos_.data() + (pos_ + t) * half;
    const float* s = rope_sin_.data() + (pos_ + t) * half;
    auto rotate = [&](float* vec, int64_t heads) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = vec + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[2 * i], b = v[2 * i + 1];
          v[2 * i] = a * c[i] - b * s[i];
          v[2 * i + 1] = a * s[i] + b * c[i];
        }
      }
    };
    rotate(q_.data() + t * q_dim, hp_.n_heads);
    rotate(k_.data() + t * kv_dim, hp_.n_kv_heads);
    std::memcpy(kc + (pos_ + t) * kv_dim, k_.data() + t * kv_dim, sizeof(float) * kv_dim);
    std::memcpy(vc + (pos_ + t) * kv_dim, v_.data() + t * kv_dim, sizeof(float) * kv_dim);
  }
  // Causal attention, one (token, head) pair per work item; each pair is computed by one thread in a fixed order.
  const float inv_sqrt = 1.0f / std::sqrt(static_cast<float>(hd));
  pool_->ParallelFor(n * hp_.n_heads, 1, [&](int64_t begin, int64_t end, int thread) {
    float* sc = scores_.data() + thread * n_ctx_;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / hp_.n_heads, h = item % hp_.n_heads;
      const int64_t kvh = h / group;
      const int64_t len = pos_ + t + 1;
      const float* q = q_.data() + t * q_dim + h * hd;
      float mx = -INFINITY;
      for (int64_t p = 0; p < len; ++p) {
        const float* k = kc + p * kv_dim + kvh * hd;
        float d = 0;
        for (int64_t i = 0; i < hd; ++i) d += q[i] * k[i];
        sc[p] = d * inv_sqrt;
        mx = std::max(mx, sc[p]);
      }
      float sum = 0;
      for (int64_t p = 0; p < len; ++p) {
        sc[p] = std::exp(sc[p] - mx);
        sum += sc[p];
      }
      const float inv = 1.0f / sum;
      float* out = att_.data() + t * q_dim + h * hd;
      std::fill(out, out + hd, 0.0f);
      for (int64_t p = 0; p < len; ++p) {
        const float* v = vc + p * kv_dim + kvh * hd;
        const float a = sc[p] * inv;
        for (int64_t i = 0; i < hd; ++i) out[i] += a * v[i];
      }
    }
  });
}

Status InferenceContext::DenseFfn(const LayerWeights& L, int64_t layer, int64_t n) {
  const int64_t n_ff = hp_.n_ff;
  act_.Set(xn_.data(), n, hp_.dim);
  if (ffn_backend_ != nullptr) {
    NF_ASSIGN_OR_RETURN(bool handled, ffn_backend_->Forward(layer, -1, act_, ffn_out_.data()));
    if (handled) return Status::Ok();
  }
  MatMul(L.gate, act_, gate_.data());
  MatMul(L.up, act_, up_.data());
  ApplyFfnActivation(hp_.activation, n * n_ff, gate_.data(), up_.data(), hidden_.data());
  if (observer_) {
    FfnObservation obs;
    obs.layer = layer;
    obs.n_tokens = n;
    obs.gate_act = gate_.data();
    obs.hidden = hidden_.data();
    obs.ffn_input = xn_.data();
    observer_(obs);
  }
  act_.Set(hidden_.data(), n, n_ff);
  MatMul(L.down, act_, ffn_out_.data());
  return Status::Ok();
}

Status InferenceContext::MoeFfn(const LayerWeights& L, int64_t layer, int64_t n) {
  const int64_t dim = hp_.dim, n_ff = hp_.n_ff, n_exp = hp_.n_experts, k = hp_.n_experts_used;
  std::vector<float> router(static_cast<size_t>(n * n_exp));
  act_.Set(xn_.data(), n, dim);
  MatMul(L.router, act_, router.data());
  // Per token: top-k experts by router logit; weights = softmax over the selected logits (Mixtral: softmax over all,
  // then renormalised over the top k, which is the same).
  std::vector<std::vector<std::pair<int64_t, float>>> by_expert(static_cast<size_t>(n_exp));  // (token, weight)
  std::vector<int64_t> order(static_cast<size_t>(n_exp));
  for (int64_t t = 0; t < n; ++t) {
    const float* r = router.data() + t * n_exp;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return r[a] > r[b] || (r[a] == r[b] && a < b); });
    const float mx = r[order[0]];
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(r[order[j]] - mx);
    for (int64_t j = 0; j < k; ++j) {
      by_expert[static_cast<size_t>(order[j])].push_back({t, std::exp(r[order[j]] - mx) / sum});
    }
  }
  std::fill(ffn_out_.begin(), ffn_out_.begin() + n * dim, 0.0f);
  std::vector<float> xe, out;
  std::vector<int64_t> token_index;
  Activation act;
  for (int64_t e = 0; e < n_exp; ++e) {
    const auto& sel = by_expert[static_cast<size_t>(e)];
    if (sel.empty()) continue;
    const int64_t m = static_cast<int64_t>(sel.size());
    xe.resize(static_cast<size_t>(m * dim));
    token_index.resize(static_cast<size_t>(m));
    for (int64_t j = 0; j < m; ++j) {
      token_index[j] = sel[j].first;
      std::memcpy(xe.data() + j * dim, xn_.data() + sel[j].first * dim, sizeof(float) * dim);
    }
    act.Set(xe.data(), m, dim);
    out.resize(static_cast<size_t>(m * dim));
    bool handled = false;
    if (ffn_backend_ != nullptr) {
      NF_ASSIGN_OR_RETURN(handled, ffn_backend_->Forward(layer, e, act, out.data()));
    }
    if (!handled) {
    MatMul(L.Expert(L.gate, L.expert_stride_gate, e), act, gate_.data());
    MatMul(L.Expert(L.up, L.expert_stride_up, e), act, up_.data());
    ApplyFfnActivation(hp_.activation, m * n_ff, gate_.data(), up_.data(), hidden_.data());
    if (observer_) {
      FfnObservation obs;
      obs.layer = layer;
      obs.expert = e;
      obs.n_tokens = m;
      obs.token_index = token_index.data();
      obs.gate_act = gate_.data();
      obs.hidden = hidden_.data();
      obs.ffn_input = xe.data();
      observer_(obs);
    }
    act.Set(hidden_.data(), m, n_ff);
    MatMul(L.Expert(L.down, L.expert_stride_down, e), act, out.data());
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
