// Closed-form low-rank predictors: principal directions of the gate pre-activations by subspace iteration, the
// projection of the dequantized gate onto them, per-neuron residual scales, and the exact linear form written in the
// predictor file's relu-MLP layout (see predictor_lowrank.h).
#include "profiler/predictor_lowrank.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>

#include "runtime/core/quant.h"

namespace nflash::profiler {
namespace {

// Y (n x rows) = X (n x cols) . W^T with W (rows x cols) F32 row-major.
void MatMulT(const float* w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y, ThreadPool* pool) {
  Gemm(DenseMatrix(GgmlType::kF32, w, rows, cols), x, n, y, pool);
}

std::vector<float> Transposed(const float* a, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = a[r * cols + c];
  }
  return out;
}

// Orthonormalizes the k rows of q (k x m) in place: modified Gram-Schmidt, twice (the second pass removes what
// rounding left of the first), double accumulation. A row that vanishes becomes a fresh random direction
// orthogonal to the others (rank-deficient input).
void OrthonormalizeRows(float* q, int64_t k, int64_t m, std::mt19937_64* rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < k; ++i) {
    float* qi = q + i * m;
    for (int attempt = 0; attempt < 3; ++attempt) {
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j = 0; j < i; ++j) {
          const float* qj = q + j * m;
          double dot = 0;
          for (int64_t c = 0; c < m; ++c) dot += static_cast<double>(qi[c]) * qj[c];
          const float d = static_cast<float>(dot);
          for (int64_t c = 0; c < m; ++c) qi[c] -= d * qj[c];
        }
      }
      double norm = 0;
      for (int64_t c = 0; c < m; ++c) norm += static_cast<double>(qi[c]) * qi[c];
      if (norm > 1e-24) {
        const float inv = static_cast<float>(1.0 / std::sqrt(norm));
        for (int64_t c = 0; c < m; ++c) qi[c] *= inv;
        break;
      }
      for (int64_t c = 0; c < m; ++c) qi[c] = nd(*rng);
    }
  }
}

}  // namespace

void SymmetricEigen(std::vector<double> a, int64_t k, std::vector<double>* values, std::vector<double>* vectors) {
  const size_t K = static_cast<size_t>(k);
  std::vector<double> v(K * K, 0.0);
  for (size_t i = 0; i < K; ++i) v[i * K + i] = 1.0;
  auto at = [&](size_t r, size_t c) -> double& { return a[r * K + c]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (size_t p = 0; p < K; ++p) {
      diag += at(p, p) * at(p, p);
      for (size_t q = p + 1; q < K; ++q) off += at(p, q) * at(p, q);
    }
    if (off <= 1e-30 * std::max(diag, 1e-300)) break;
    for (size_t p = 0; p < K; ++p) {
      for (size_t q = p + 1; q < K; ++q) {
        const double apq = at(p, q);
        if (apq == 0.0) continue;
        // The rotation that zeroes a[p][q] (Golub & Van Loan, symmetric Schur decomposition).
        const double theta = (at(q, q) - at(p, p)) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (size_t r = 0; r < K; ++r) {  // columns p and q
          const double arp = at(r, p), arq = at(r, q);
          at(r, p) = c * arp - s * arq;
          at(r, q) = s * arp + c * arq;
        }
        for (size_t r = 0; r < K; ++r) {  // rows p and q
          const double apr = at(p, r), aqr = at(q, r);
          at(p, r) = c * apr - s * aqr;
          at(q, r) = s * apr + c * aqr;
        }
        for (size_t r = 0; r < K; ++r) {  // eigenvectors are the rows of v
          const double vpr = v[p * K + r], vqr = v[q * K + r];
          v[p * K + r] = c * vpr - s * vqr;
          v[q * K + r] = s * vpr + c * vqr;
        }
      }
    }
  }
  std::vector<size_t> order(K);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return at(x, x) > at(y, y); });
  values->resize(K);
  vectors->resize(K * K);
  for (size_t i = 0; i < K; ++i) {
    (*values)[i] = at(order[i], order[i]);
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(order[i] * K), K,
                vectors->begin() + static_cast<std::ptrdiff_t>(i * K));
  }
}

std::vector<float> PrincipalDirections(const float* g, int64_t n, int64_t m, int64_t k, int iterations,
                                       int64_t oversample, uint64_t seed, std::vector<double>* variances,
                                       ThreadPool* pool) {
  k = std::clamp<int64_t>(k, 0, std::min(n, m));
  const int64_t kk = std::min(k + std::max<int64_t>(oversample, 0), std::min(n, m));
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x5EED);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> qt(static_cast<size_t>(kk * m));
  for (float& v : qt) v = nd(rng);
  OrthonormalizeRows(qt.data(), kk, m, &rng);
  const std::vector<float> gt = Transposed(g, n, m);  // m x n
  std::vector<float> y(static_cast<size_t>(n * kk));
  for (int it = 0; it < iterations; ++it) {
    MatMulT(qt.data(), kk, m, g, n, y.data(), pool);                     // y = g Q            (n x kk)
    const std::vector<float> yt = Transposed(y.data(), n, kk);          //                    (kk x n)
    MatMulT(gt.data(), m, n, yt.data(), kk, qt.data(), pool);           // Q^T <- (g^T y)^T  (kk x m)
    OrthonormalizeRows(qt.data(), kk, m, &rng);
  }
  // Rayleigh-Ritz: the eigenvectors of Q^T g^T g Q rotate Q's rows onto the principal directions, in order.
  MatMulT(qt.data(), kk, m, g, n, y.data(), pool);
  std::vector<double> t(static_cast<size_t>(kk * kk), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    const float* yr = y.data() + r * kk;
    for (int64_t a = 0; a < kk; ++a) {
      for (int64_t b = a; b < kk; ++b) t[static_cast<size_t>(a * kk + b)] += static_cast<double>(yr[a]) * yr[b];
    }
  }
  for (int64_t a = 0; a < kk; ++a) {
    for (int64_t b = 0; b < a; ++b) t[static_cast<size_t>(a * kk + b)] = t[static_cast<size_t>(b * kk + a)];
  }
  std::vector<double> values, vectors;
  SymmetricEigen(std::move(t), kk, &values, &vectors);
  std::vector<float> out(static_cast<size_t>(k * m), 0.0f);
  std::vector<double> row(static_cast<size_t>(m));
  for (int64_t a = 0; a < k; ++a) {
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t b = 0; b < kk; ++b) {
      const double e = vectors[static_cast<size_t>(a * kk + b)];
      const float* qb = qt.data() + b * m;
      for (int64_t c = 0; c < m; ++c) row[static_cast<size_t>(c)] += e * qb[c];
    }
    for (int64_t c = 0; c < m; ++c) out[static_cast<size_t>(a * m + c)] = static_cast<float>(row[static_cast<size_t>(c)]);
  }
  variances->assign(values.begin(), values.begin() + k);
  for (double& v : *variances) v /= static_cast<double>(std::max<int64_t>(n, 1));
  return out;
}

float ActivationBoundary(FfnActivation activation, float threshold) {
  if (activation != FfnActivation::kSilu || threshold <= 0) return 0.0f;
  // silu is increasing for g > -1.28 and silu(g) > g - 0.28 there: bisect on [0, threshold + 1].
  double lo = 0, hi = static_cast<double>(threshold) + 1.0;
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (mid / (1.0 + std::exp(-mid)) > threshold ? hi : lo) = mid;
  }
  return static_cast<float>(hi);
}

Result<PredictorLayerData> FitLowRankLayer(const MatrixView& gate, const float* x, const uint8_t* mask, int64_t n_train,
                                           int64_t n_val, float boundary, const LowRankOptions& o, ThreadPool* pool,
                                           bool* fallback) {
  *fallback = false;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t dim = gate.cols, n_ff = gate.rows;
  if (n_train <= 1 || n_val <= 0) return Status::InvalidArgument("a low-rank fit needs training and validation tokens");
  if (o.ranks.empty()) return Status::InvalidArgument("no candidate predictor ranks");
  NF_RETURN_IF_ERROR(ValidateMatrix(gate, "gate"));
  std::vector<int64_t> ranks = o.ranks;
  std::sort(ranks.begin(), ranks.end());
  for (int64_t& r : ranks) r = std::min({r, n_train, n_ff});
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  const int64_t rmax = ranks.back();
  const size_t F = static_cast<size_t>(n_ff), D = static_cast<size_t>(dim);

  // Centred pre-activations of the training tokens, as the engine computes them (same kernel, same quantized input).
  std::vector<float> gc(static_cast<size_t>(n_train) * F);
  Gemm(gate, x, n_train, gc.data(), pool);
  std::vector<double> mean(F, 0.0);
  for (int64_t t = 0; t < n_train; ++t) {
    for (size_t i = 0; i < F; ++i) mean[i] += gc[static_cast<size_t>(t) * F + i];
  }
  for (double& v : mean) v /= static_cast<double>(n_train);
  for (int64_t t = 0; t < n_train; ++t) {
    for (size_t i = 0; i < F; ++i) gc[static_cast<size_t>(t) * F + i] -= static_cast<float>(mean[i]);
  }
  std::vector<double> variances;
  const std::vector<float> qt =
      PrincipalDirections(gc.data(), n_train, n_ff, rmax, o.iterations, o.oversample, o.seed, &variances, pool);

  // P = Q^T W (rmax x dim) from the dequantized gate, transposed (dim x n_ff) for the GEMM.
  std::vector<float> wt(D * F), row(D);
  for (int64_t i = 0; i < n_ff; ++i) {
    NF_RETURN_IF_ERROR(DequantizeRow(gate.type, static_cast<const uint8_t*>(gate.data) + gate.row_bytes * i,
                                     row.data(), dim));
    for (size_t d = 0; d < D; ++d) wt[d * F + static_cast<size_t>(i)] = row[d];
  }
  std::vector<float> p(static_cast<size_t>(rmax) * D);
  MatMulT(wt.data(), dim, n_ff, qt.data(), rmax, p.data(), pool);
  wt = {};
  std::vector<float> y(static_cast<size_t>(n_train * rmax));  // G_c Q: the training tokens' coordinates
  MatMulT(qt.data(), rmax, n_ff, gc.data(), n_train, y.data(), pool);
  std::vector<double> qmean(static_cast<size_t>(rmax), 0.0);  // Q^T g_mean
  for (int64_t j = 0; j < rmax; ++j) {
    for (size_t i = 0; i < F; ++i) qmean[static_cast<size_t>(j)] += qt[static_cast<size_t>(j) * F + i] * mean[i];
  }

  PredictorLayerData best;
  for (int64_t r : ranks) {
    const size_t R = static_cast<size_t>(r);
    // Residual RMS per neuron on the training tokens: G_c - (G_c Q_r) Q_r^T.
    std::vector<float> q_r(F * R), y_r(static_cast<size_t>(n_train) * R);
    for (size_t i = 0; i < F; ++i) {
      for (size_t j = 0; j < R; ++j) q_r[i * R + j] = qt[j * F + i];
    }
    for (int64_t t = 0; t < n_train; ++t) {
      std::copy_n(y.begin() + t * rmax, r, y_r.begin() + t * r);
    }
    std::vector<double> sq(F, 0.0), col(F, 0.0);
    constexpr int64_t kChunk = 256;  // tokens per reconstruction GEMM
    std::vector<float> rec(static_cast<size_t>(kChunk) * F);
    for (int64_t b = 0; b < n_train; b += kChunk) {
      const int64_t m = std::min(kChunk, n_train - b);
      MatMulT(q_r.data(), n_ff, r, y_r.data() + b * r, m, rec.data(), pool);
      for (int64_t t = 0; t < m; ++t) {
        const float* g = gc.data() + static_cast<size_t>(b + t) * F;
        const float* h = rec.data() + static_cast<size_t>(t) * F;
        for (size_t i = 0; i < F; ++i) {
          const double e = static_cast<double>(g[i]) - h[i];
          sq[i] += e * e;
          col[i] += static_cast<double>(g[i]) * g[i];
        }
      }
    }
    PredictorLayerData L;
    L.info.rank = 2 * r;
    L.fc1.resize(2 * R * D);
    for (size_t j = 0; j < R; ++j) {
      for (size_t d = 0; d < D; ++d) {
        L.fc1[j * D + d] = p[j * D + d];
        L.fc1[(R + j) * D + d] = -p[j * D + d];
      }
    }
    L.fc2.resize(F * 2 * R);
    L.fc2_bias.resize(F);
    for (size_t i = 0; i < F; ++i) {
      // The floor keeps a neuron the subspace explains exactly (residual 0) finite: 1e-3 of its own spread.
      const double spread = std::sqrt(col[i] / static_cast<double>(n_train));
      const double s = std::max(std::sqrt(sq[i] / static_cast<double>(n_train)), 1e-3 * spread + 1e-30);
      double proj = 0;
      for (size_t j = 0; j < R; ++j) {
        const float a = static_cast<float>(q_r[i * R + j] / s);
        L.fc2[i * 2 * R + j] = a;
        L.fc2[i * 2 * R + R + j] = -a;
        proj += q_r[i * R + j] * qmean[j];
      }
      L.fc2_bias[i] = static_cast<float>((mean[i] - proj - boundary) / s);
    }
    SetThresholdForRecall(&L, x + n_train * dim, mask + n_train * n_ff, n_val, dim, n_ff, o.target_recall, pool);
    L.info.train_seconds =
        static_cast<float>(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (L.info.recall >= o.target_recall && L.info.predicted_fraction <= o.max_predicted_ratio * L.info.true_fraction) {
      return L;
    }
    if (best.info.rank == 0 || L.info.predicted_fraction < best.info.predicted_fraction) best = std::move(L);
  }
  *fallback = true;
  return best;
}

}  // namespace nflash::profiler
