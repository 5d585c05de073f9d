// Synthetic activation-sparse models: shapes, counter-based weight generation, and the per-layer calibration
// simulation that sets each FFN neuron's offset on the constant residual channel (maths in docs/synthetic.md).
#include "converter/synth.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "runtime/core/kernels.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_pool.h"
#include "converter/readers.h"
#include "converter/synth_random.h"

namespace nflash::converter {
namespace {

// The constant channel's value in every token embedding. Its size is irrelevant to quantization (it is alone in its
// 32-wide block, so every block format stores it to fp16 precision); 1 keeps it comparable to the other channels.
constexpr float kConst = 1.0f;
// Token embeddings ~ N(0, 1): RMSNorm makes the scale irrelevant to the first layer, so the simplest one.
constexpr float kEmbedStd = 1.0f;
// q/k are small so attention is close to uniform over the context: its output is a running mean of the values,
// a slowly varying component shared by consecutive tokens (the source of temporal overlap of active sets).
constexpr float kQkGain = 0.5f;
// Attention output gain: the slow component's share of the residual. 2 makes it a clear share at tens of tokens
// without letting the first tokens (whose running mean is a single value) dominate the residual.
constexpr float kAttnGain = 1.25f;
// FFN output gain (per unit of active-neuron mass): each layer adds about this much rms to the residual, so the
// residual grows slowly with depth as in trained models.
constexpr float kDownGain = 0.7f;
// Bisection steps for the per-layer quantile shift: 2^-30 of the initial bracket is far below sampling noise.
constexpr int kShiftSteps = 30;
constexpr double kNormEps = 1e-5;

// ---------------------------------------------------------------------------------------------------- random numbers

using synth_random::Mix64;
using synth_random::NameKey;
using synth_random::NormalRow;

// Inverse standard normal CDF (Acklam's rational approximation, relative error 1e-9 after one Newton step).
double NormalQuantile(double p) {
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                             1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01,  -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                             3.754408661907416e+00};
  p = std::clamp(p, 1e-12, 1 - 1e-12);
  double x;
  if (p < 0.02425) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p > 1 - 0.02425) {
    const double q = std::sqrt(-2 * std::log(1 - p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  }
  const double e = 0.5 * std::erfc(-x / std::sqrt(2.0)) - p;  // Newton step on Phi(x) = p
  return x - e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
}

// ------------------------------------------------------------------------------------------------------------ tensors

enum class Kind { kOnes, kEmbed, kOutput, kQ, kK, kV, kO, kQkNorm, kGate, kUp, kDown, kRouter };

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;  // GGUF order: dims[0] is the row length
  Kind kind;
  int64_t layer = -1;
};

// Everything the loaders need; immutable once BuildSyntheticModel returns. Thread-safety: const after construction;
// the pool is used by one loader at a time (the writer loads tensors sequentially).
struct SynthState {
  ModelConfig cfg;
  SynthOptions opt;
  int64_t channel = 0;      // the constant residual channel
  int64_t block_start = 0;  // its 32-wide block, kept out of everything but the constant and the FFN offsets
  double mean_active = 0.1;
  // Per layer, per (expert, neuron): the gate and up weights on the constant channel (empty while calibrating).
  std::vector<std::vector<float>> gate_offset, up_offset;
  std::shared_ptr<ThreadPool> pool;

  bool Reserved(int64_t j) const { return j >= block_start && j < block_start + kQBlock; }
  int64_t experts() const { return std::max<int64_t>(cfg.n_experts, 1); }
};

// Row `row` of `spec` as the file holds it before quantization. `basis`: LowRankBasis of a gate/up tensor when
// --gate-rank is on (GenerateTensor makes it once per tensor), else unused.
void FillRow(const SynthState& s, const TensorSpec& spec, uint64_t key, int64_t row, float* out,
             const float* basis = nullptr) {
  const int64_t n = static_cast<int64_t>(spec.dims[0]);
  const ModelConfig& c = s.cfg;
  const float inv_sqrt_dim = 1.0f / std::sqrt(static_cast<float>(c.dim));
  auto clear_reserved = [&] { std::fill(out + s.block_start, out + s.block_start + kQBlock, 0.0f); };
  switch (spec.kind) {
    case Kind::kOnes:
      std::fill(out, out + n, 1.0f);
      return;
    case Kind::kQkNorm:
      // Per-head RMS norms (qwen3) leave every q and k element at rms ~1 whatever the projections' scale; this gain
      // gives q.k / sqrt(head_dim) the spread kQkGain gives llama's unnormalised q and k (0.25 of a unit).
      std::fill(out, out + n, kQkGain);
      return;
    case Kind::kEmbed:
      NormalRow(key, row, kEmbedStd, out, n);
      clear_reserved();
      out[s.channel] = kConst;
      return;
    case Kind::kOutput:
    case Kind::kV:
    case Kind::kRouter:
      NormalRow(key, row, inv_sqrt_dim, out, n);
      clear_reserved();
      return;
    case Kind::kQ:
    case Kind::kK:
      NormalRow(key, row, kQkGain * inv_sqrt_dim, out, n);
      clear_reserved();
      return;
    case Kind::kO:
      // Rows are residual channels: the reserved block receives nothing, so the constant stays constant. Scaled by
      // the row length (q_dim: dim unless the head size is set), so the output's rms does not depend on it.
      if (s.Reserved(row % c.dim)) {
        std::fill(out, out + n, 0.0f);
      } else {
        NormalRow(key, row, kAttnGain * (1.0f / std::sqrt(static_cast<float>(n))), out, n);
      }
      return;
    case Kind::kGate:
    case Kind::kUp: {
      if (s.opt.gate_rank > 0) {
        // Low-rank-plus-noise (--gate-rank): `basis` holds every expert's V, rank x n each.
        const int64_t r = s.opt.gate_rank;
        synth_random::LowRankRow(s.opt.seed, spec.name, key, static_cast<uint64_t>(row), basis + (row / c.n_ff) * r * n, r,
                   static_cast<float>(s.opt.gate_noise), inv_sqrt_dim, out, n);
      } else {
        NormalRow(key, row, inv_sqrt_dim, out, n);
      }
      clear_reserved();
      const auto& offsets = spec.kind == Kind::kGate ? s.gate_offset : s.up_offset;
      if (static_cast<size_t>(spec.layer) < offsets.size() && !offsets[spec.layer].empty()) {
        out[s.channel] = offsets[spec.layer][row];
      }
      return;
    }
    case Kind::kDown:
      if (s.Reserved(row % c.dim)) {
        std::fill(out, out + n, 0.0f);
      } else {
        const float scale = kDownGain / std::sqrt(static_cast<float>(c.n_ff) * static_cast<float>(s.mean_active));
        NormalRow(key, row, scale, out, n);
      }
      return;
  }
}

uint64_t RowCount(const TensorSpec& spec) {
  uint64_t rows = 1;
  for (size_t i = 1; i < spec.dims.size(); ++i) rows *= spec.dims[i];
  return rows;
}

// The whole tensor, rows generated in parallel (values do not depend on the thread count).
std::vector<float> GenerateTensor(const SynthState& s, const TensorSpec& spec) {
  const int64_t n = static_cast<int64_t>(spec.dims[0]);
  const int64_t rows = static_cast<int64_t>(RowCount(spec));
  std::vector<float> out(static_cast<size_t>(n * rows));
  const uint64_t key = NameKey(s.opt.seed, spec.name);
  std::vector<float> basis;
  if (s.opt.gate_rank > 0 && (spec.kind == Kind::kGate || spec.kind == Kind::kUp)) {
    basis = synth_random::LowRankBasis(s.opt.seed, spec.name, s.experts(), s.opt.gate_rank, n);
  }
  s.pool->ParallelFor(rows, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) FillRow(s, spec, key, r, out.data() + r * n, basis.data());
  });
  return out;
}

// The type the writer will give `spec` for the requested type.
GgmlType FileType(const SynthState& s, const TensorSpec& spec) {
  SourceTensor t;
  t.name = spec.name;
  t.dims = spec.dims;
  return OutputTensorType(t, s.opt.type, /*tied_embeddings=*/false);
}

// Quantizes and dequantizes every row in place, so the simulation sees the weights the file will hold.
Status RoundTrip(const SynthState& s, GgmlType type, int64_t n, std::vector<float>* x) {
  if (type == GgmlType::kF32) return Status::Ok();
  const int64_t rows = static_cast<int64_t>(x->size()) / n;
  const size_t row_bytes = *RowBytes(type, static_cast<uint64_t>(n));
  std::vector<Status> errors(static_cast<size_t>(s.pool->NumThreads()));
  s.pool->ParallelFor(rows, 16, [&](int64_t b, int64_t e, int t) {
    std::vector<uint8_t> buf(row_bytes);
    for (int64_t r = b; r < e && errors[t].ok(); ++r) {
      float* row = x->data() + r * n;
      errors[t] = QuantizeRow(type, row, buf.data(), n);
      if (errors[t].ok()) errors[t] = DequantizeRow(type, buf.data(), row, n);
    }
  });
  for (const Status& e : errors) NF_RETURN_IF_ERROR(e);
  return Status::Ok();
}

// The value a lone weight `w` at `channel` is stored as (it is alone in its block: the others are reserved zeros).
Result<float> StoredOffset(const SynthState& s, GgmlType type, float w) {
  float block[kQBlock] = {};
  block[s.channel - s.block_start] = w;
  // Large enough for one block of any row type: F32 (4 bytes per value) is the largest.
  alignas(4) uint8_t buf[kQBlock * sizeof(float)];
  NF_RETURN_IF_ERROR(QuantizeRow(type, block, buf, kQBlock));
  NF_RETURN_IF_ERROR(DequantizeRow(type, buf, block, kQBlock));
  return block[s.channel - s.block_start];
}

std::string LayerName(int64_t l, const char* suffix) { return "blk." + std::to_string(l) + "." + suffix; }

std::vector<TensorSpec> LayerSpecs(const ModelConfig& c, int64_t l) {
  const uint64_t dim = c.dim, ff = c.n_ff, q = c.q_dim(), kv = c.kv_dim(), e = c.n_experts;
  std::vector<TensorSpec> v = {
      {LayerName(l, "attn_norm.weight"), {dim}, Kind::kOnes, l},
      {LayerName(l, "attn_q.weight"), {dim, q}, Kind::kQ, l},
      {LayerName(l, "attn_k.weight"), {dim, kv}, Kind::kK, l},
      {LayerName(l, "attn_v.weight"), {dim, kv}, Kind::kV, l},
      {LayerName(l, "attn_output.weight"), {q, dim}, Kind::kO, l},
  };
  if (c.qk_norms()) {
    const uint64_t hd = c.head_dim();
    v.push_back({LayerName(l, "attn_q_norm.weight"), {hd}, Kind::kQkNorm, l});
    v.push_back({LayerName(l, "attn_k_norm.weight"), {hd}, Kind::kQkNorm, l});
  }
  v.push_back({LayerName(l, "ffn_norm.weight"), {dim}, Kind::kOnes, l});
  if (e == 0) {
    v.push_back({LayerName(l, "ffn_gate.weight"), {dim, ff}, Kind::kGate, l});
    v.push_back({LayerName(l, "ffn_up.weight"), {dim, ff}, Kind::kUp, l});
    v.push_back({LayerName(l, "ffn_down.weight"), {ff, dim}, Kind::kDown, l});
  } else {
    v.push_back({LayerName(l, "ffn_gate_inp.weight"), {dim, e}, Kind::kRouter, l});
    v.push_back({LayerName(l, "ffn_gate_exps.weight"), {dim, ff, e}, Kind::kGate, l});
    v.push_back({LayerName(l, "ffn_up_exps.weight"), {dim, ff, e}, Kind::kUp, l});
    v.push_back({LayerName(l, "ffn_down_exps.weight"), {ff, dim, e}, Kind::kDown, l});
  }
  return v;
}

const TensorSpec& Find(const std::vector<TensorSpec>& v, Kind kind) {
  for (const TensorSpec& t : v) {
    if (t.kind == kind) return t;
  }
  std::abort();  // LayerSpecs lists every kind a layer uses
}

// A generated weight matrix as the file will hold it (f32 after the round trip).
Result<std::vector<float>> FileWeights(const SynthState& s, const TensorSpec& spec) {
  std::vector<float> w = GenerateTensor(s, spec);
  NF_RETURN_IF_ERROR(RoundTrip(s, FileType(s, spec), static_cast<int64_t>(spec.dims[0]), &w));
  return w;
}

// ---------------------------------------------------------------------------------------------- calibration forward

// The simulated batch: `seqs` independent random sequences of `len` tokens, the residual stream h (n x dim,
// row-major); the first (seqs - 1) sequences fit the offsets, the last one is held out and measured.
struct Sim {
  int64_t seqs = 0, len = 0, n = 0, n_fit = 0;
  std::vector<float> h;
};

void Matmul(const std::vector<float>& w, int64_t rows, int64_t cols, const float* x, int64_t n, float* y,
            ThreadPool* pool) {
  Gemm(DenseMatrix(GgmlType::kF32, w.data(), rows, cols), x, n, y, pool);
}

std::vector<float> InvRms(const Sim& sim, int64_t dim) {
  std::vector<float> r(static_cast<size_t>(sim.n));
  for (int64_t t = 0; t < sim.n; ++t) {
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += double(sim.h[t * dim + j]) * sim.h[t * dim + j];
    r[t] = static_cast<float>(1.0 / std::sqrt(ss / dim + kNormEps));
  }
  return r;
}

// Per head: qwen3's RMS norm with the kQkNorm gain (when the architecture has it), then RoPE by pos *
// theta^(-2i/head_dim) on the pairs (2i, 2i+1) (llama.cpp's normal RoPE) or (i, i + head_dim/2) (NEOX: the Qwen
// architectures).
void NormRope(const ModelConfig& c, const Sim& sim, int64_t heads, std::vector<float>* x) {
  const int64_t hd = c.head_dim(), half = hd / 2;
  const bool neox = c.architecture != "llama";
  for (int64_t t = 0; t < sim.n; ++t) {
    const double pos = static_cast<double>(t % sim.len);
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x->data() + (t * heads + h) * hd;
      if (c.qk_norms()) {
        double ss = 0;
        for (int64_t i = 0; i < hd; ++i) ss += double(v[i]) * v[i];
        const float g = static_cast<float>(kQkGain / std::sqrt(ss / hd + kNormEps));
        for (int64_t i = 0; i < hd; ++i) v[i] *= g;
      }
      for (int64_t i = 0; i < half; ++i) {
        const double ang = pos * std::pow(static_cast<double>(c.rope_theta), -2.0 * i / hd);
        const float cs = static_cast<float>(std::cos(ang)), sn = static_cast<float>(std::sin(ang));
        float& a = neox ? v[i] : v[2 * i];
        float& b = neox ? v[i + half] : v[2 * i + 1];
        const float a0 = a, b0 = b;
        a = a0 * cs - b0 * sn;
        b = a0 * sn + b0 * cs;
      }
    }
  }
}

Status AttentionStep(const SynthState& s, const std::vector<TensorSpec>& specs, Sim* sim) {
  const ModelConfig& c = s.cfg;
  const int64_t dim = c.dim, hd = c.head_dim(), H = c.n_heads, KVH = c.n_kv_heads, kvd = hd * KVH, n = sim->n;
  const int64_t qd = c.q_dim();
  const std::vector<float> inv = InvRms(*sim, dim);
  std::vector<float> a(sim->h.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < dim; ++j) a[t * dim + j] = sim->h[t * dim + j] * inv[t];
  }
  std::vector<float> q(n * qd), k(n * kvd), v(n * kvd);
  {
    NF_ASSIGN_OR_RETURN(std::vector<float> w, FileWeights(s, Find(specs, Kind::kQ)));
    Matmul(w, qd, dim, a.data(), n, q.data(), s.pool.get());
    NF_ASSIGN_OR_RETURN(w, FileWeights(s, Find(specs, Kind::kK)));
    Matmul(w, kvd, dim, a.data(), n, k.data(), s.pool.get());
    NF_ASSIGN_OR_RETURN(w, FileWeights(s, Find(specs, Kind::kV)));
    Matmul(w, kvd, dim, a.data(), n, v.data(), s.pool.get());
  }
  NormRope(c, *sim, H, &q);
  NormRope(c, *sim, KVH, &k);
  std::vector<float> att(n * qd, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  s.pool->ParallelFor(sim->seqs * H, 1, [&](int64_t b, int64_t e, int) {
    std::vector<float> p(static_cast<size_t>(sim->len));
    for (int64_t job = b; job < e; ++job) {
      const int64_t seq = job / H, head = job % H, kvh = head / (H / KVH), t0 = seq * sim->len;
      for (int64_t i = 0; i < sim->len; ++i) {
        const float* qi = q.data() + ((t0 + i) * H + head) * hd;
        float mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = k.data() + ((t0 + j) * KVH + kvh) * hd;
          float d = 0;
          for (int64_t x = 0; x < hd; ++x) d += qi[x] * kj[x];
          p[j] = d * scale;
          mx = std::max(mx, p[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        float* out = att.data() + (t0 + i) * qd + head * hd;
        for (int64_t j = 0; j <= i; ++j) {
          const float* vj = v.data() + ((t0 + j) * KVH + kvh) * hd;
          for (int64_t x = 0; x < hd; ++x) out[x] += p[j] / sum * vj[x];
        }
      }
    }
  });
  NF_ASSIGN_OR_RETURN(std::vector<float> wo, FileWeights(s, Find(specs, Kind::kO)));
  std::vector<float> o(n * dim);
  Matmul(wo, dim, qd, att.data(), n, o.data(), s.pool.get());
  for (size_t i = 0; i < o.size(); ++i) sim->h[i] += o[i];
  return Status::Ok();
}

// Per (expert, neuron) column of z (n x cols): the mean and standard deviation over the fitting tokens.
void ColumnStats(const std::vector<float>& z, int64_t cols, int64_t n_fit, std::vector<double>* mu,
                 std::vector<double>* sd) {
  mu->assign(cols, 0.0);
  sd->assign(cols, 0.0);
  for (int64_t t = 0; t < n_fit; ++t) {
    for (int64_t i = 0; i < cols; ++i) (*mu)[i] += z[t * cols + i];
  }
  for (int64_t i = 0; i < cols; ++i) (*mu)[i] /= n_fit;
  for (int64_t t = 0; t < n_fit; ++t) {
    for (int64_t i = 0; i < cols; ++i) {
      const double d = z[t * cols + i] - (*mu)[i];
      (*sd)[i] += d * d;
    }
  }
  for (int64_t i = 0; i < cols; ++i) (*sd)[i] = std::max(std::sqrt((*sd)[i] / std::max<int64_t>(n_fit - 1, 1)), 1e-12);
}

// Per column, the activation probability its gate (and, for drelu, its up) projection is calibrated to.
std::vector<double> ColumnTargets(const SynthState& s, const std::vector<double>& popularity, int64_t layer) {
  const int64_t ff = s.cfg.n_ff, E = s.experts();
  std::vector<double> q(static_cast<size_t>(E * ff));
  std::vector<int64_t> perm(static_cast<size_t>(ff));
  for (int64_t e = 0; e < E; ++e) {
    // Seeded Fisher-Yates: rank -> neuron index, so the hot neurons are scattered over the layer.
    std::iota(perm.begin(), perm.end(), 0);
    const uint64_t key = Mix64(s.opt.seed ^ Mix64(0x5eed0000 + layer * 1024 + e));
    for (int64_t i = ff - 1; i > 0; --i) std::swap(perm[i], perm[Mix64(key + i) % static_cast<uint64_t>(i + 1)]);
    for (int64_t r = 0; r < ff; ++r) {
      const double p = popularity[r];
      // drelu needs both projections positive; independent projections each at sqrt(p) meet at p.
      q[e * ff + perm[r]] = s.cfg.activation == FfnActivation::kDRelu ? std::sqrt(p) : p;
    }
  }
  return q;
}

struct Offsets {
  std::vector<double> mu, sd, quantile;
  bool used = false;
  double At(int64_t i, double shift) const { return -mu[i] + sd[i] * (quantile[i] + shift); }
};

Status FfnStep(SynthState* s, int64_t layer, const std::vector<TensorSpec>& specs,
               const std::vector<double>& popularity, Sim* sim, SynthLayerReport* rep) {
  const ModelConfig& c = s->cfg;
  const int64_t dim = c.dim, ff = c.n_ff, E = s->experts(), cols = E * ff, n = sim->n;
  const bool drelu = c.activation == FfnActivation::kDRelu;
  const std::vector<float> inv = InvRms(*sim, dim);
  double rms = 0;
  for (int64_t t = 0; t < n; ++t) rms += 1.0 / (double(inv[t]) * inv[t]);
  rep->residual_rms = std::sqrt(rms / n);

  // z: the projections of the raw residual without the constant channel (its weights are still unset, i.e. 0).
  // Activity is scale-invariant, so the raw residual decides it exactly as the RMS-normalised one does.
  std::vector<float> zg(n * cols), zu(n * cols);
  {
    NF_ASSIGN_OR_RETURN(std::vector<float> w, FileWeights(*s, Find(specs, Kind::kGate)));
    Matmul(w, cols, dim, sim->h.data(), n, zg.data(), s->pool.get());
    NF_ASSIGN_OR_RETURN(w, FileWeights(*s, Find(specs, Kind::kUp)));
    Matmul(w, cols, dim, sim->h.data(), n, zu.data(), s->pool.get());
  }
  Offsets g, u;
  const std::vector<double> q = ColumnTargets(*s, popularity, layer);
  ColumnStats(zg, cols, sim->n_fit, &g.mu, &g.sd);
  g.quantile.resize(cols);
  for (int64_t i = 0; i < cols; ++i) g.quantile[i] = NormalQuantile(q[i]);
  g.used = true;
  if (drelu) {
    ColumnStats(zu, cols, sim->n_fit, &u.mu, &u.sd);
    u.quantile = g.quantile;
    u.used = true;
  }
  // One shift of every quantile, fitted by bisection so the fitting tokens' active fraction is exactly the target:
  // it absorbs what the normal model misses (z is not exactly normal, drelu's projections not exactly independent).
  auto active_fraction = [&](double shift) {
    std::vector<float> bg(cols), bu(cols, 0.0f);
    for (int64_t i = 0; i < cols; ++i) {
      bg[i] = static_cast<float>(g.At(i, shift));
      if (u.used) bu[i] = static_cast<float>(u.At(i, shift));
    }
    int64_t active = 0;
    for (int64_t t = 0; t < sim->n_fit; ++t) {
      for (int64_t i = 0; i < cols; ++i) {
        active += zg[t * cols + i] + bg[i] > 0 && (!u.used || zu[t * cols + i] + bu[i] > 0);
      }
    }
    return static_cast<double>(active) / static_cast<double>(sim->n_fit * cols);
  };
  double lo = -3, hi = 3;
  for (int i = 0; i < kShiftSteps; ++i) {
    const double mid = 0.5 * (lo + hi);
    (active_fraction(mid) < s->mean_active ? lo : hi) = mid;
  }
  const double shift = 0.5 * (lo + hi);
  // The weights on the constant channel, and the offsets they give once stored in the file's type.
  const GgmlType gate_type = FileType(*s, Find(specs, Kind::kGate));
  const GgmlType up_type = FileType(*s, Find(specs, Kind::kUp));
  std::vector<float>& gate_w = s->gate_offset[layer];
  std::vector<float>& up_w = s->up_offset[layer];
  gate_w.assign(cols, 0.0f);
  up_w.assign(cols, 0.0f);
  std::vector<float> bg(cols), bu(cols, 0.0f);
  for (int64_t i = 0; i < cols; ++i) {
    gate_w[i] = static_cast<float>(g.At(i, shift) / kConst);
    NF_ASSIGN_OR_RETURN(float stored, StoredOffset(*s, gate_type, gate_w[i]));
    bg[i] = stored * kConst;
    if (u.used) {
      up_w[i] = static_cast<float>(u.At(i, shift) / kConst);
      NF_ASSIGN_OR_RETURN(stored, StoredOffset(*s, up_type, up_w[i]));
      bu[i] = stored * kConst;
    }
  }

  // Routing (MoE): softmax over the router's logits, top-k, weights renormalised to sum 1.
  std::vector<float> route(n * E, E == 1 ? 1.0f : 0.0f);
  if (c.n_experts > 0) {
    std::vector<float> f(sim->h.size()), logits(n * E);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < dim; ++j) f[t * dim + j] = sim->h[t * dim + j] * inv[t];
    }
    NF_ASSIGN_OR_RETURN(std::vector<float> w, FileWeights(*s, Find(specs, Kind::kRouter)));
    Matmul(w, E, dim, f.data(), n, logits.data(), s->pool.get());
    std::vector<int64_t> order(E);
    for (int64_t t = 0; t < n; ++t) {
      const float* lt = logits.data() + t * E;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lt[x] > lt[y]; });
      double sum = 0;
      for (int64_t k = 0; k < c.n_experts_used; ++k) sum += std::exp(lt[order[k]] - lt[order[0]]);
      for (int64_t k = 0; k < c.n_experts_used; ++k) {
        route[t * E + order[k]] = static_cast<float>(std::exp(lt[order[k]] - lt[order[0]]) / sum);
      }
    }
  }
  // The FFN itself, with its activity recorded on the held-out sequence.
  std::vector<float> act(n * cols, 0.0f);
  std::vector<uint8_t> mask(static_cast<size_t>(sim->len * cols), 0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const float r = route[t * E + e];
      if (r == 0.0f) continue;
      for (int64_t i = e * ff; i < (e + 1) * ff; ++i) {
        const float gv = (zg[t * cols + i] + bg[i]) * inv[t];
        float uv = (zu[t * cols + i] + bu[i]) * inv[t];
        if (drelu) uv = std::max(uv, 0.0f);
        const bool on = gv > 0 && (!drelu || uv > 0);
        act[t * cols + i] = on ? r * gv * uv : 0.0f;
        if (t >= sim->n_fit) mask[(t - sim->n_fit) * cols + i] = on;
      }
    }
  }
  std::vector<float> out(n * dim, 0.0f), part(n * dim), slice(n * ff);
  NF_ASSIGN_OR_RETURN(std::vector<float> wd, FileWeights(*s, Find(specs, Kind::kDown)));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t = 0; t < n; ++t) std::copy_n(act.data() + t * cols + e * ff, ff, slice.data() + t * ff);
    std::vector<float> we(wd.begin() + e * dim * ff, wd.begin() + (e + 1) * dim * ff);
    Matmul(we, dim, ff, slice.data(), n, part.data(), s->pool.get());
    for (size_t i = 0; i < out.size(); ++i) out[i] += part[i];
  }
  for (size_t i = 0; i < out.size(); ++i) sim->h[i] += out[i];

  // Held-out measurements (as the reference forward reports them: MoE fractions per routed expert).
  const int64_t used = c.n_experts > 0 ? c.n_experts_used : 1;
  std::vector<int64_t> counts(cols, 0);
  int64_t total = 0;
  double jaccard = 0;
  for (int64_t t = 0; t < sim->len; ++t) {
    const uint8_t* m = mask.data() + t * cols;
    for (int64_t i = 0; i < cols; ++i) counts[i] += m[i];
    if (t == 0) continue;
    int64_t inter = 0, uni = 0;
    for (int64_t i = 0; i < cols; ++i) {
      inter += m[i] & m[i - cols];
      uni += m[i] | m[i - cols];
    }
    jaccard += uni > 0 ? double(inter) / uni : 1.0;
  }
  double sp = 0, sp2 = 0;
  for (int64_t i = 0; i < cols; ++i) {
    total += counts[i];
    const double p = double(counts[i]) / sim->len;
    sp += p;
    sp2 += p * p;
  }
  rep->active_fraction = double(total) / double(sim->len * used * ff);
  rep->consecutive_jaccard = sim->len > 1 ? jaccard / (sim->len - 1) : 0;
  rep->independent_jaccard = sp > 0 ? sp2 / (2 * sp - sp2) : 0;
  return Status::Ok();
}

TokenizerData ByteVocabulary(int64_t n_vocab) {
  TokenizerData t;
  t.model = "llama";
  t.unk_id = 0;
  t.bos_id = 1;
  t.eos_id = 2;
  t.add_bos = true;
  t.add_eos = false;
  auto add = [&](std::string piece, float score, int32_t type) {
    t.tokens.push_back(std::move(piece));
    t.scores.push_back(score);
    t.token_types.push_back(type);
  };
  add("<unk>", 0, 2);
  add("<s>", 0, 3);
  add("</s>", 0, 3);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    add(buf, 0, 6);
  }
  // Filler pieces: distinct lower-case words ("▁a", "▁b", ..., "▁aa", ...), scored so earlier ones merge first.
  for (int64_t i = 0; static_cast<int64_t>(t.tokens.size()) < n_vocab; ++i) {
    std::string w;
    for (int64_t x = i; ; x = x / 26 - 1) {
      w.insert(w.begin(), static_cast<char>('a' + x % 26));
      if (x < 26) break;
    }
    add("\xE2\x96\x81" + w, -static_cast<float>(i + 1), 1);
  }
  return t;
}

struct ShapeDefaults {
  const char* name;
  const char* arch;
  int64_t dim, ff, layers, heads, kv_heads, head_dim, experts, top_k, vocab, context;
  float rope_theta;
};
// Published hyper-parameters of the shapes' namesakes (Mistral-7B-v0.1: rope theta 10000, 8 kv heads; Qwen3's
// config.json: head_dim 128 whatever the width, Qwen3-30B-A3B's ff the experts' moe_intermediate_size). head_dim 0:
// dim / heads.
constexpr ShapeDefaults kShapes[] = {
    {"llama-7b", "llama", 4096, 11008, 32, 32, 32, 0, 0, 0, 32000, 4096, 10000.0f},
    {"llama-13b", "llama", 5120, 13824, 40, 40, 40, 0, 0, 0, 32000, 4096, 10000.0f},
    {"mistral-7b", "llama", 4096, 14336, 32, 32, 8, 0, 0, 0, 32000, 32768, 10000.0f},
    {"mixtral-8x7b", "llama", 4096, 14336, 32, 32, 8, 0, 8, 2, 32000, 32768, 1000000.0f},
    {"qwen3-8b", "qwen3", 4096, 12288, 36, 32, 8, 128, 0, 0, 151936, 40960, 1000000.0f},
    {"qwen3-30b-a3b", "qwen3moe", 2048, 768, 48, 32, 4, 128, 128, 8, 151936, 40960, 1000000.0f},
};
constexpr const char* kShapeList = "llama-7b, llama-13b, mistral-7b, mixtral-8x7b, qwen3-8b, qwen3-30b-a3b, custom";

}  // namespace

Result<ModelConfig> SynthConfig(const SynthOptions& o) {
  ModelConfig c;
  c.architecture = "llama";
  auto pick = [](int64_t flag, int64_t def) { return flag > 0 ? flag : def; };
  if (o.shape == "custom") {
    if (o.dim <= 0 || o.ffn <= 0 || o.heads <= 0 || o.vocab <= 0) {
      return Status::InvalidArgument("--shape custom needs --dim, --ffn, --heads and --vocab");
    }
    c.dim = o.dim;
    c.n_ff = o.ffn;
    c.n_heads = o.heads;
    c.n_kv_heads = pick(o.kv_heads, o.heads);
    c.n_layers = pick(o.layers, 2);
    c.n_experts = std::max<int64_t>(o.experts, 0);
    c.n_experts_used = c.n_experts > 0 ? pick(o.top_k, 2) : 0;
    c.n_vocab = o.vocab;
    c.context_length = pick(o.context, 4096);
    c.architecture = o.arch.empty() ? "llama" : o.arch;
    c.key_length = o.head_dim;
    if (c.architecture != "llama" && c.architecture != "qwen3" && c.architecture != "qwen3moe") {
      return Status::InvalidArgument("--arch " + c.architecture + " is not one of llama, qwen3, qwen3moe");
    }
    if (c.architecture == "qwen3moe" && c.n_experts == 0) {
      return Status::InvalidArgument("--arch qwen3moe needs --experts (its FFN is experts only)");
    }
    // A dense FFN routes nothing: --top-k would be dropped without a word.
    if (o.top_k != 0 && c.n_experts == 0) {
      return Status::InvalidArgument("--top-k " + std::to_string(o.top_k) +
                                     ": experts used per token need --experts N > 0 (the FFN is dense without it)");
    }
    if (c.architecture == "qwen3" && c.n_experts > 0) {
      return Status::InvalidArgument("--arch qwen3 is dense: --experts " + std::to_string(c.n_experts) +
                                     " needs --arch qwen3moe (or llama, Mixtral's layout)");
    }
  } else {
    const ShapeDefaults* d = nullptr;
    for (const ShapeDefaults& s : kShapes) {
      if (o.shape == s.name) d = &s;
    }
    if (d == nullptr) return Status::InvalidArgument("--shape " + o.shape + " is not one of " + kShapeList);
    if (o.dim || o.ffn || o.heads || o.kv_heads || o.head_dim || o.experts || o.top_k || o.vocab || !o.arch.empty()) {
      return Status::InvalidArgument(
          "--dim/--ffn/--heads/--kv-heads/--head-dim/--experts/--top-k/--vocab/--arch need --shape custom");
    }
    c.architecture = d->arch;
    c.key_length = d->head_dim;
    c.dim = d->dim;
    c.n_ff = d->ff;
    c.n_heads = d->heads;
    c.n_kv_heads = d->kv_heads;
    c.n_layers = d->layers;
    if (o.layers > 0) c.n_layers = std::min(o.layers, d->layers);
    c.n_experts = d->experts;
    c.n_experts_used = d->top_k;
    c.n_vocab = d->vocab;
    c.context_length = pick(o.context, d->context);
    c.rope_theta = d->rope_theta;
  }
  c.activation = o.activation;
  if (c.dim % kQBlock != 0 || c.n_ff % kQBlock != 0) {
    return Status::InvalidArgument("dim " + std::to_string(c.dim) + " and ffn " + std::to_string(c.n_ff) +
                                   " must be multiples of 32 (the constant channel owns a 32-wide block)");
  }
  if (c.key_length < 0 || (c.key_length == 0 && c.dim % c.n_heads != 0) || c.n_heads % c.n_kv_heads != 0 ||
      c.head_dim() % 2 != 0) {
    return Status::InvalidArgument("dim " + std::to_string(c.dim) + ", heads " + std::to_string(c.n_heads) +
                                   ", kv heads " + std::to_string(c.n_kv_heads) + ", head size " +
                                   std::to_string(c.head_dim()) +
                                   ": dim must be a multiple of heads (unless --head-dim is set), heads of kv heads, "
                                   "head size even");
  }
  if (c.key_length * c.n_heads == c.dim) c.key_length = 0;  // the default head size, as the converters write it
  if (c.dim < 2 * kQBlock) return Status::InvalidArgument("--dim must be at least 64");
  if (c.n_vocab < 259) return Status::InvalidArgument("--vocab must be at least 259 (3 specials + 256 bytes)");
  if (c.n_experts > 0 && (c.n_experts_used < 1 || c.n_experts_used > c.n_experts)) {
    return Status::InvalidArgument("--top-k " + std::to_string(c.n_experts_used) + " must be in 1.." +
                                   std::to_string(c.n_experts));
  }
  if (c.n_layers < 1) return Status::InvalidArgument("--layers must be at least 1");
  if (!(o.sparsity >= 0 && o.sparsity < 1 - 1e-9) || o.hot_skew < 0) {
    return Status::InvalidArgument("--sparsity must be in [0, 1) and --hot-skew >= 0");
  }
  if (o.gate_rank < 0 || (o.gate_rank > 0 && o.gate_rank >= c.dim) || !(o.gate_noise >= 0)) {
    return Status::InvalidArgument("--gate-rank " + std::to_string(o.gate_rank) + " must be in [0, dim " +
                                   std::to_string(c.dim) + ") and --gate-noise " + std::to_string(o.gate_noise) +
                                   " >= 0");
  }
  if (o.calib_sequences < 2 || o.calib_tokens < 4) {
    return Status::InvalidArgument("calibration needs at least 2 sequences of 4 tokens");
  }
  char name[160];
  std::snprintf(name, sizeof name, "synthetic %s %s s%.2f seed %llu", o.shape.c_str(), FfnActivationName(o.activation),
                o.sparsity, static_cast<unsigned long long>(o.seed));
  c.name = name;
  if (o.gate_rank > 0) c.name += " rank " + std::to_string(o.gate_rank);  // off: the name (and bytes) as before
  return c;
}

Result<std::vector<double>> PopularityTargets(int64_t n, double sparsity, double hot_skew) {
  const double mean = 1.0 - sparsity;
  if (n <= 0 || !(mean > 0) || mean > kSynthMaxPopularity) {
    return Status::InvalidArgument("sparsity " + std::to_string(sparsity) + " needs a mean popularity in (0, " +
                                   std::to_string(kSynthMaxPopularity) + "]");
  }
  auto fill = [&](double a, std::vector<double>* p) {
    double sum = 0;
    for (int64_t r = 0; r < n; ++r) {
      (*p)[r] = std::min(kSynthMaxPopularity, a * std::pow((r + 0.5) / n, -hot_skew));
      sum += (*p)[r];
    }
    return sum / n;
  };
  std::vector<double> p(static_cast<size_t>(n));
  // The mean grows monotonically with the scale a; bisect on log a.
  double lo = -60, hi = 10;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (fill(std::exp(mid), &p) < mean ? lo : hi) = mid;
  }
  fill(std::exp(0.5 * (lo + hi)), &p);
  return p;
}

Result<SourceModel> BuildSyntheticModel(const SynthOptions& options, SynthReport* report) {
  const auto start = std::chrono::steady_clock::now();
  NF_ASSIGN_OR_RETURN(ModelConfig cfg, SynthConfig(options));
  auto state = std::make_shared<SynthState>();
  state->cfg = cfg;
  state->opt = options;
  state->pool = std::make_shared<ThreadPool>(options.threads);
  const uint64_t ck = Mix64(options.seed ^ 0xc0a57a47ULL);
  state->block_start = static_cast<int64_t>(ck % static_cast<uint64_t>(cfg.dim / kQBlock)) * kQBlock;
  state->channel = state->block_start + static_cast<int64_t>((ck >> 32) % kQBlock);
  const bool sparse = cfg.activation != FfnActivation::kSilu;
  state->mean_active = sparse ? 1.0 - options.sparsity : 0.5;
  state->gate_offset.resize(cfg.n_layers);
  state->up_offset.resize(cfg.n_layers);
  SynthReport rep;
  rep.config = cfg;

  const TensorSpec embd{"token_embd.weight", {uint64_t(cfg.dim), uint64_t(cfg.n_vocab)}, Kind::kEmbed};
  if (sparse) {
    NF_ASSIGN_OR_RETURN(std::vector<double> popularity,
                        PopularityTargets(cfg.n_ff, options.sparsity, options.hot_skew));
    Sim sim;
    sim.seqs = options.calib_sequences;
    sim.len = options.calib_tokens;
    sim.n = sim.seqs * sim.len;
    sim.n_fit = (sim.seqs - 1) * sim.len;
    sim.h.resize(sim.n * cfg.dim);
    // Random token ids from the whole vocabulary, embedded as the file stores them.
    const uint64_t embd_key = NameKey(options.seed, embd.name);
    const GgmlType embd_type = FileType(*state, embd);
    for (int64_t t = 0; t < sim.n; ++t) {
      const int64_t id = static_cast<int64_t>(Mix64(options.seed * 0x9e37 + 0xca11b + t) % uint64_t(cfg.n_vocab));
      std::vector<float> row(cfg.dim);
      FillRow(*state, embd, embd_key, id, row.data());
      NF_RETURN_IF_ERROR(RoundTrip(*state, embd_type, cfg.dim, &row));
      std::copy(row.begin(), row.end(), sim.h.begin() + t * cfg.dim);
    }
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      const std::vector<TensorSpec> specs = LayerSpecs(cfg, l);
      NF_RETURN_IF_ERROR(AttentionStep(*state, specs, &sim));
      SynthLayerReport lr;
      NF_RETURN_IF_ERROR(FfnStep(state.get(), l, specs, popularity, &sim, &lr));
      rep.layers.push_back(lr);
    }
  }
  rep.calibration_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  SourceModel model;
  model.source_path = "synthetic:" + options.shape;
  model.source_format = "synthetic";
  model.config = cfg;
  model.tokenizer = ByteVocabulary(cfg.n_vocab);
  std::vector<TensorSpec> specs = {embd};
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    for (TensorSpec& t : LayerSpecs(cfg, l)) specs.push_back(std::move(t));
  }
  specs.push_back({"output_norm.weight", {uint64_t(cfg.dim)}, Kind::kOnes});
  specs.push_back({"output.weight", {uint64_t(cfg.dim), uint64_t(cfg.n_vocab)}, Kind::kOutput});
  for (TensorSpec& spec : specs) {
    SourceTensor t;
    t.name = spec.name;
    t.dims = spec.dims;
    t.source_type = GgmlType::kF32;
    t.load_f32 = [state, spec]() -> Result<std::vector<float>> { return GenerateTensor(*state, spec); };
    model.tensors.push_back(std::move(t));
  }
  model.extra_metadata = {
      {"nflash.synthetic", true},
      {"nflash.ffn_activation", std::string(FfnActivationName(cfg.activation))},
      {"nflash.synth.sparsity", static_cast<float>(options.sparsity)},
      {"nflash.synth.hot_skew", static_cast<float>(options.hot_skew)},
      {"nflash.synth.seed", static_cast<uint64_t>(options.seed)},
      {"nflash.synth.constant_channel", static_cast<uint32_t>(state->channel)},
  };
  if (options.gate_rank > 0) {  // only when on, so files made without the flag keep their bytes
    model.extra_metadata.push_back({"nflash.synth.gate_rank", static_cast<uint32_t>(options.gate_rank)});
    model.extra_metadata.push_back({"nflash.synth.gate_noise", static_cast<float>(options.gate_noise)});
  }
  if (report != nullptr) *report = std::move(rep);
  return model;
}

}  // namespace nflash::converter
