// Predictor training: sample collection with an FFN observer, Adam on weighted BCE with GEMM-based forward and
// backward passes, logit-threshold calibration for a recall target, and rank selection.
#include "profiler/predictor_train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "profiler/activation_stats.h"
#include "runtime/core/kernels.h"
#include "runtime/engine/context.h"

namespace nflash::profiler {
namespace {

// Y (n x rows) = X (n x cols) . W^T with W (rows x cols), both row-major floats.
void MatMulT(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y, ThreadPool* pool) {
  Gemm(DenseMatrix(GgmlType::kF32, w, rows, cols), x, n, y, pool);
}

void Transpose(const float* a, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = a[r * cols + c];
  }
}

float Sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// Adam state and update for one parameter tensor.
struct AdamTensor {
  std::vector<float> m, v;
  explicit AdamTensor(size_t n) : m(n, 0.0f), v(n, 0.0f) {}
  void Step(float* p, const float* g, size_t n, float lr, int64_t t, ThreadPool* pool) {
    constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f;  // the usual Adam defaults
    const float c1 = 1.0f - std::pow(kBeta1, static_cast<float>(t));
    const float c2 = 1.0f - std::pow(kBeta2, static_cast<float>(t));
    pool->ParallelFor(static_cast<int64_t>(n), 4096, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        m[i] = kBeta1 * m[i] + (1 - kBeta1) * g[i];
        v[i] = kBeta2 * v[i] + (1 - kBeta2) * g[i] * g[i];
        p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + kEps);
      }
    });
  }
};

}  // namespace

Result<ActivationSamples> CollectSamples(const Model& model, std::span<const int32_t> tokens, int64_t window,
                                         ThreadPool* pool) {
  const LlamaHparams& hp = model.hparams();
  if (window <= 0 || window > hp.context_length) window = hp.context_length;
  ActivationSamples s;
  s.dim = hp.dim;
  s.n_ff = hp.n_ff;
  s.n_tokens = static_cast<int64_t>(tokens.size());
  s.n_experts = hp.n_experts;
  const int64_t per_layer = std::max<int64_t>(1, hp.n_experts);
  const size_t n_groups = static_cast<size_t>(hp.n_layers * per_layer);
  s.group_tokens.assign(n_groups, 0);
  s.x.resize(n_groups);
  s.gate_abs.resize(n_groups);
  if (hp.n_experts == 0) {  // every layer sees every token: the sizes are known
    for (size_t g = 0; g < n_groups; ++g) {
      s.x[g].reserve(static_cast<size_t>(s.n_tokens * hp.dim));
      s.gate_abs[g].reserve(static_cast<size_t>(s.n_tokens * hp.n_ff));
    }
  }
  InferenceContext ctx(model, pool, window);
  // Each observation's rows are its group's next tokens (MoE: ffn_input holds the routed tokens' rows, in order).
  ctx.SetFfnObserver([&](const FfnObservation& o) {
    const size_t g = static_cast<size_t>(o.layer * per_layer + std::max<int64_t>(0, o.expert));
    s.x[g].insert(s.x[g].end(), o.ffn_input, o.ffn_input + o.n_tokens * hp.dim);
    const size_t old = s.gate_abs[g].size();
    s.gate_abs[g].resize(old + static_cast<size_t>(o.n_tokens * hp.n_ff));
    float* dst = s.gate_abs[g].data() + old;
    for (int64_t i = 0; i < o.n_tokens * hp.n_ff; ++i) dst[i] = std::fabs(o.gate_act[i]);
    s.group_tokens[g] += o.n_tokens;
  });
  int64_t base = 0;
  for (base = 0; base < s.n_tokens; base += window) {
    const int64_t n = std::min(window, s.n_tokens - base);
    ctx.Reset();
    NF_RETURN_IF_ERROR(ctx.Eval(tokens.subspan(static_cast<size_t>(base), static_cast<size_t>(n)), false));
  }
  return s;
}

int64_t BorrowLayerInputs(const Model& model, ActivationSamples* samples, int64_t group, int64_t max_rows,
                          ThreadPool* pool) {
  const LlamaHparams& hp = model.hparams();
  const int64_t E = hp.n_experts, dim = hp.dim, n_ff = hp.n_ff, layer = group / E, expert = group % E;
  std::vector<float> x;
  std::vector<int64_t> next(static_cast<size_t>(E), 0);  // per expert of the layer: its next row to take
  for (bool took = true; took && static_cast<int64_t>(x.size()) < max_rows * dim;) {
    took = false;
    for (int64_t e = 0; e < E && static_cast<int64_t>(x.size()) < max_rows * dim; ++e) {
      const size_t g = static_cast<size_t>(layer * E + e);
      if (e == expert || next[e] >= samples->group_tokens[g]) continue;
      const float* row = samples->x[g].data() + next[e]++ * dim;
      x.insert(x.end(), row, row + dim);
      took = true;
    }
  }
  const int64_t n = static_cast<int64_t>(x.size()) / dim;
  const LayerWeights& W = model.layers()[static_cast<size_t>(layer)];
  std::vector<float> gate(static_cast<size_t>(n * n_ff));
  if (n > 0) Gemm(W.Expert(W.gate, W.expert_stride_gate, expert), x.data(), n, gate.data(), pool);
  for (float& v : gate) {
    float act = 0;
    ActivateNeuron(hp.activation, v, 0.0f, &act);
    v = std::fabs(act);
  }
  samples->x[static_cast<size_t>(group)] = std::move(x);
  samples->gate_abs[static_cast<size_t>(group)] = std::move(gate);
  samples->group_tokens[static_cast<size_t>(group)] = n;
  return n;
}

std::vector<float> SparsityThresholds(const ActivationSamples& samples, double sparsity) {
  std::vector<float> out;
  for (const std::vector<float>& g : samples.gate_abs) {
    if (sparsity <= 0 || g.empty()) {
      out.push_back(0.0f);
      continue;
    }
    std::vector<float> v = g;
    // The profile's definition (nearest rank), so profile and predictor thresholds agree exactly.
    out.push_back(QuantileThreshold(&v, sparsity));
  }
  return out;
}

std::vector<uint8_t> ActiveMask(const ActivationSamples& samples, int64_t group, float threshold) {
  const std::vector<float>& g = samples.gate_abs[static_cast<size_t>(group)];
  std::vector<uint8_t> m(g.size());
  for (size_t i = 0; i < g.size(); ++i) m[i] = g[i] > threshold ? 1 : 0;
  return m;
}

void PredictorLogits(const PredictorLayerData& layer, int64_t dim, int64_t n_ff, const float* x, int64_t n,
                     std::vector<float>* logits, ThreadPool* pool) {
  const int64_t r = layer.info.rank;
  std::vector<float> h(static_cast<size_t>(n * r));
  MatMulT(layer.fc1.data(), r, dim, x, n, h.data(), pool);
  for (float& v : h) v = std::max(v, 0.0f);
  logits->resize(static_cast<size_t>(n * n_ff));
  MatMulT(layer.fc2.data(), n_ff, r, h.data(), n, logits->data(), pool);
  if (!layer.fc2_bias.empty()) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < n_ff; ++j) (*logits)[static_cast<size_t>(t * n_ff + j)] += layer.fc2_bias[j];
    }
  }
}

PredictionQuality Evaluate(const PredictorLayerData& layer, int64_t dim, int64_t n_ff, const float* x,
                           const uint8_t* mask, int64_t n, ThreadPool* pool) {
  PredictionQuality q;
  int64_t tp = 0, pred = 0, truth = 0;
  constexpr int64_t kChunk = 1024;  // tokens per batched logit computation (bounds memory on 7B shapes)
  std::vector<float> lg;
  for (int64_t b = 0; b < n; b += kChunk) {
    const int64_t m = std::min(kChunk, n - b);
    PredictorLogits(layer, dim, n_ff, x + b * dim, m, &lg, pool);
    for (int64_t i = 0; i < m * n_ff; ++i) {
      const bool p = lg[static_cast<size_t>(i)] > layer.info.logit_threshold;
      const bool t = mask[b * n_ff + i] != 0;
      tp += p && t;
      pred += p;
      truth += t;
    }
  }
  const double pairs = static_cast<double>(n * n_ff);
  q.recall = truth > 0 ? static_cast<double>(tp) / static_cast<double>(truth) : 1.0;
  q.precision = pred > 0 ? static_cast<double>(tp) / static_cast<double>(pred) : 1.0;
  q.predicted_fraction = pairs > 0 ? static_cast<double>(pred) / pairs : 0.0;
  q.true_fraction = pairs > 0 ? static_cast<double>(truth) / pairs : 0.0;
  return q;
}

void SetThresholdForRecall(PredictorLayerData* L, const float* xv, const uint8_t* mv, int64_t n_val, int64_t dim,
                           int64_t n_ff, float target_recall, ThreadPool* pool) {
  // Allow at most floor((1 - recall) * positives) misses.
  std::vector<float> pos;
  constexpr int64_t kChunk = 1024;  // tokens per batched logit computation
  std::vector<float> lg;
  for (int64_t b = 0; b < n_val; b += kChunk) {
    const int64_t m = std::min(kChunk, n_val - b);
    PredictorLogits(*L, dim, n_ff, xv + b * dim, m, &lg, pool);
    for (int64_t i = 0; i < m * n_ff; ++i) {
      if (mv[b * n_ff + i]) pos.push_back(lg[static_cast<size_t>(i)]);
    }
  }
  if (pos.empty()) {
    L->info.logit_threshold = INFINITY;  // never active on validation data: predict nothing
  } else {
    const size_t k = static_cast<size_t>(std::floor((1.0 - target_recall) * static_cast<double>(pos.size())));
    std::nth_element(pos.begin(), pos.begin() + static_cast<std::ptrdiff_t>(k), pos.end());
    L->info.logit_threshold = std::nextafter(pos[k], -INFINITY);
  }
  const PredictionQuality q = Evaluate(*L, dim, n_ff, xv, mv, n_val, pool);
  L->info.recall = static_cast<float>(q.recall);
  L->info.precision = static_cast<float>(q.precision);
  L->info.predicted_fraction = static_cast<float>(q.predicted_fraction);
  L->info.true_fraction = static_cast<float>(q.true_fraction);
}

Result<PredictorLayerData> TrainLayer(const float* x, const uint8_t* mask, int64_t n_train, int64_t n_val, int64_t dim,
                                      int64_t n_ff, int64_t rank, const TrainOptions& o, ThreadPool* pool) {
  if (n_train <= 0 || n_val <= 0) return Status::InvalidArgument("predictor training needs training and validation tokens");
  const auto t0 = std::chrono::steady_clock::now();
  PredictorLayerData L;
  L.info.rank = rank;
  const size_t r = static_cast<size_t>(rank), d = static_cast<size_t>(dim), f = static_cast<size_t>(n_ff);
  std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank));
  // He initialisation for the ReLU hidden layer; fc2 starts small so the bias (the prior) dominates at first.
  std::normal_distribution<float> n1(0.0f, std::sqrt(2.0f / static_cast<float>(dim)));
  std::normal_distribution<float> n2(0.0f, 0.1f / std::sqrt(static_cast<float>(rank)));
  L.fc1.resize(r * d);
  L.fc2.resize(f * r);
  for (float& v : L.fc1) v = n1(rng);
  for (float& v : L.fc2) v = n2(rng);
  // Bias: the logit of each neuron's firing rate on the training tokens (clamped away from 0 and 1).
  L.fc2_bias.assign(f, 0.0f);
  for (int64_t t = 0; t < n_train; ++t) {
    for (size_t j = 0; j < f; ++j) L.fc2_bias[j] += mask[t * n_ff + static_cast<int64_t>(j)];
  }
  for (float& b : L.fc2_bias) {
    const float p = std::clamp(b / static_cast<float>(n_train), 1e-3f, 1.0f - 1e-3f);
    b = std::log(p / (1.0f - p));
  }

  const int64_t B = std::min(o.batch, n_train);
  const size_t bs = static_cast<size_t>(B);
  std::vector<float> xb(bs * d), xbt(d * bs), h(bs * r), a(bs * r), at(r * bs), z(bs * f), gt(f * bs);
  std::vector<float> fc2t(r * f), da(bs * r), dht(r * bs), g_fc1(r * d), g_fc2(f * r), g_b(f);
  AdamTensor adam1(r * d), adam2(f * r), adamb(f);
  std::vector<int64_t> order(static_cast<size_t>(n_train));
  std::iota(order.begin(), order.end(), 0);
  int64_t step = 0;
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t start = 0; start + B <= n_train; start += B) {  // drop the ragged tail: every step has B tokens
      for (int64_t i = 0; i < B; ++i) {
        std::memcpy(xb.data() + i * dim, x + order[static_cast<size_t>(start + i)] * dim, sizeof(float) * d);
      }
      // Forward: h = xb fc1^T, a = relu(h), z = a fc2^T + b.
      MatMulT(L.fc1.data(), rank, dim, xb.data(), B, h.data(), pool);
      for (size_t i = 0; i < h.size(); ++i) a[i] = std::max(h[i], 0.0f);
      MatMulT(L.fc2.data(), n_ff, rank, a.data(), B, z.data(), pool);
      // dL/dz of the weighted BCE, averaged over the batch; stored transposed (n_ff x B) for the fc2 gradient.
      std::fill(g_b.begin(), g_b.end(), 0.0f);
      const float inv_b = 1.0f / static_cast<float>(B);
      for (int64_t i = 0; i < B; ++i) {
        const uint8_t* y = mask + order[static_cast<size_t>(start + i)] * n_ff;
        float* zi = z.data() + i * n_ff;
        for (int64_t j = 0; j < n_ff; ++j) {
          const float p = Sigmoid(zi[j] + L.fc2_bias[j]);
          const float g = y[j] ? o.pos_weight * (p - 1.0f) * inv_b : p * inv_b;
          zi[j] = g;
          gt[j * B + i] = g;
          g_b[j] += g;
        }
      }
      // fc2 gradient (n_ff x r) = G^T a;  da (B x r) = G fc2.
      Transpose(a.data(), B, rank, at.data());
      MatMulT(at.data(), rank, B, gt.data(), n_ff, g_fc2.data(), pool);
      Transpose(L.fc2.data(), n_ff, rank, fc2t.data());
      MatMulT(fc2t.data(), rank, n_ff, z.data(), B, da.data(), pool);
      // dh = da * (h > 0), transposed (r x B); fc1 gradient (r x dim) = dh^T xb.
      for (int64_t i = 0; i < B; ++i) {
        for (int64_t k = 0; k < rank; ++k) dht[k * B + i] = h[i * rank + k] > 0 ? da[i * rank + k] : 0.0f;
      }
      Transpose(xb.data(), B, dim, xbt.data());
      MatMulT(xbt.data(), dim, B, dht.data(), rank, g_fc1.data(), pool);
      ++step;
      adam1.Step(L.fc1.data(), g_fc1.data(), g_fc1.size(), o.learning_rate, step, pool);
      adam2.Step(L.fc2.data(), g_fc2.data(), g_fc2.size(), o.learning_rate, step, pool);
      adamb.Step(L.fc2_bias.data(), g_b.data(), g_b.size(), o.learning_rate, step, pool);
    }
  }

  SetThresholdForRecall(&L, x + n_train * dim, mask + n_train * n_ff, n_val, dim, n_ff, o.target_recall, pool);
  L.info.train_seconds =
      static_cast<float>(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return L;
}

Result<PredictorLayerData> TrainLayerChooseRank(const float* x, const uint8_t* mask, int64_t n_train, int64_t n_val,
                                                int64_t dim, int64_t n_ff, const TrainOptions& o, ThreadPool* pool,
                                                bool* fallback) {
  *fallback = false;
  if (o.ranks.empty()) return Status::InvalidArgument("no candidate predictor ranks");
  std::vector<int64_t> ranks = o.ranks;
  std::sort(ranks.begin(), ranks.end());
  PredictorLayerData best;
  float seconds = 0;
  for (int64_t rank : ranks) {
    NF_ASSIGN_OR_RETURN(PredictorLayerData L, TrainLayer(x, mask, n_train, n_val, dim, n_ff, rank, o, pool));
    seconds += L.info.train_seconds;
    const bool ok = L.info.recall >= o.target_recall &&
                    L.info.predicted_fraction <= o.max_predicted_ratio * L.info.true_fraction;
    if (ok) {
      L.info.train_seconds = seconds;
      return L;
    }
    if (best.info.rank == 0 || L.info.predicted_fraction < best.info.predicted_fraction) best = std::move(L);
  }
  *fallback = true;
  best.info.train_seconds = seconds;
  return best;
}

}  // namespace nflash::profiler
