// The sparse in-memory FFN backend: active-set selection (oracle or predictor), row-sparse gate/up, and the down
// projection accumulated from a transposed copy of ffn_down.
#include "runtime/engine/sparse_ffn.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "runtime/core/file.h"
#include "runtime/core/quant.h"
#include "runtime/core/round.h"

namespace nflash {

SparseFfn::SparseFfn(const Model& model, const Predictor* predictor, const SparseFfnOptions& options, ThreadPool* pool)
    : model_(model), predictor_(predictor), options_(options), pool_(pool) {}

Result<std::unique_ptr<SparseFfn>> SparseFfn::Create(const Model& model, const Predictor* predictor,
                                                     const SparseFfnOptions& options, ThreadPool* pool) {
  const LlamaHparams& hp = model.hparams();
  if (options.mode == SparseMode::kPredictor) {
    if (predictor == nullptr) return Status::InvalidArgument("sparse FFN in predictor mode needs a predictor");
    NF_RETURN_IF_ERROR(predictor->CheckForModel(model, "", hp.name));
  }
  std::unique_ptr<SparseFfn> s(new SparseFfn(model, options.mode == SparseMode::kPredictor ? predictor : nullptr,
                                             options, pool));
  const size_t nl = static_cast<size_t>(hp.n_layers);
  // Thresholds per group (layer x expert; MoE predictors have one per expert).
  const size_t per_layer = static_cast<size_t>(std::max<int64_t>(1, hp.n_experts));
  if (!options.activation_threshold.empty()) {
    const size_t n = options.activation_threshold.size();
    if (n != nl && n != nl * per_layer) {
      return Status::InvalidArgument("sparse FFN: " + std::to_string(n) + " activation thresholds for a model of " +
                                     std::to_string(nl) + " layers" +
                                     (per_layer > 1 ? " of " + std::to_string(per_layer) + " experts" : std::string()));
    }
    for (size_t g = 0; g < nl * per_layer; ++g) {
      s->thresholds_.push_back(options.activation_threshold[n == nl ? g / per_layer : g]);
    }
  } else if (s->predictor_ != nullptr) {
    for (size_t g = 0; g < nl * per_layer; ++g) {
      s->thresholds_.push_back(s->predictor_->activation_threshold(static_cast<int64_t>(g)));
    }
  } else {
    s->thresholds_.assign(nl * per_layer, 0.0f);
  }
  for (float t : s->thresholds_) {
    if (!(t >= 0.0f)) return Status::InvalidArgument("sparse FFN: activation thresholds must be >= 0");
  }
  NF_RETURN_IF_ERROR(s->BuildTransposedDown());
  s->stats_.resize(nl);
  s->ResetStats();
  const size_t n_ff = static_cast<size_t>(hp.n_ff);
  s->rows_.reserve(n_ff);
  s->used_.reserve(n_ff);
  s->gate_all_.resize(n_ff);
  s->gate_.resize(n_ff);
  s->up_.resize(n_ff);
  s->hidden_.resize(n_ff);
  if (s->predictor_ != nullptr) s->predictor_->PrepareScratch(&s->pred_scratch_);
  return s;
}

Status SparseFfn::BuildTransposedDown() {
  const LlamaHparams& hp = model_.hparams();
  const int64_t dim = hp.dim, n_ff = hp.n_ff;
  // One transposed down per FFN: group = layer x max(1, n_experts) + expert.
  const int64_t per_layer = std::max<int64_t>(1, hp.n_experts);
  down_t_.resize(static_cast<size_t>(hp.n_layers * per_layer));
  // One block for every group, in 2 MiB pages where the kernel gives them: AccumulateRows reads rows of a few KiB at
  // random across hundreds of MiB, and with 4 KiB pages each row costs a TLB miss (a two-level page walk in a VM).
  // SYNTHETIC 16-layer 7B Q4_0, in-memory predictor decode on 2 vCPUs: the down accumulation took 8-19 ms per token
  // from a std::vector, against ~3 ms in the offloaded runtime's huge-page cache slots.
  size_t total = 0;
  std::vector<size_t> offset;
  for (int64_t g = 0; g < hp.n_layers * per_layer; ++g) {
    const LayerWeights& L = model_.layers()[static_cast<size_t>(g / per_layer)];
    if (!IsRowType(L.down.type)) {
      return Status::Unsupported("layer " + std::to_string(g / per_layer) + ": ffn_down type " +
                                 std::string(GgmlTypeName(L.down.type)) + " has no sparse column form");
    }
    auto rb = RowBytes(ColumnType(L.down.type, dim), static_cast<uint64_t>(dim));
    if (!rb) return Status::Internal("layer " + std::to_string(g / per_layer) + ": no row size for ffn_down columns");
    offset.push_back(total);
    total += static_cast<size_t>(*rb) * static_cast<size_t>(n_ff);
  }
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t alloc = std::max(kHuge, RoundUp(total, kHuge));
  down_t_block_.reset(static_cast<uint8_t*>(std::aligned_alloc(kHuge, alloc)));
  if (down_t_block_ == nullptr) {
    return Status::ResourceExhausted("sparse FFN: cannot allocate " + std::to_string(alloc) +
                                     " bytes for the transposed ffn_down");
  }
  AdviseHugePages(down_t_block_.get(), alloc);
  down_t_block_bytes_ = total;
  std::vector<float> row(static_cast<size_t>(n_ff)), t(static_cast<size_t>(n_ff * dim));
  for (int64_t g = 0; g < hp.n_layers * per_layer; ++g) {
    const int64_t l = g / per_layer;
    const LayerWeights& L = model_.layers()[static_cast<size_t>(l)];
    const MatrixView down = hp.n_experts > 0 ? L.Expert(L.down, L.expert_stride_down, g % per_layer)
                                             : L.down;  // (dim rows, n_ff cols)
    if (down.rows != dim || down.cols != n_ff) {
      return Status::Internal("layer " + std::to_string(l) + ": ffn_down is not dim x n_ff");
    }
    // The columns in the type a deployment's bundles keep (ColumnType): float types exact; Q8_0/Q4_0 requantized
    // by column (for Q4_0 that adds up to half a 4-bit step of the new scale per weight). The offloaded FFN reads the
    // packer's columns of the same type, so the two engines compute the same function, at the same bytes per neuron.
    const GgmlType out_type = ColumnType(down.type, dim);
    for (int64_t r = 0; r < dim; ++r) {
      NF_RETURN_IF_ERROR(DequantizeRow(down.type, static_cast<const uint8_t*>(down.data) + down.row_bytes * r,
                                       row.data(), n_ff));
      for (int64_t c = 0; c < n_ff; ++c) t[static_cast<size_t>(c * dim + r)] = row[static_cast<size_t>(c)];
    }
    const size_t rb = static_cast<size_t>(*RowBytes(out_type, static_cast<uint64_t>(dim)));  // ColumnType fits dim
    uint8_t* bytes = down_t_block_.get() + offset[static_cast<size_t>(g)];
    for (int64_t c = 0; c < n_ff; ++c) {
      NF_RETURN_IF_ERROR(QuantizeRow(out_type, t.data() + c * dim, bytes + rb * static_cast<size_t>(c), dim));
    }
    down_t_[static_cast<size_t>(g)] = DenseMatrix(out_type, bytes, n_ff, dim);
    NF_RETURN_IF_ERROR(ValidateMatrix(down_t_[static_cast<size_t>(g)], "transposed ffn_down"));
  }
  return Status::Ok();
}

void SparseFfn::ResetStats() {
  for (SparseFfnLayerStats& s : stats_) {
    s = SparseFfnLayerStats();
    const bool knows_truth = predictor_ == nullptr || options_.measure_recall;
    s.true_active = knows_truth ? 0 : -1;
    s.true_positive = knows_truth ? 0 : -1;
  }
}

uint64_t SparseFfn::extra_bytes() const { return down_t_block_bytes_; }

Result<bool> SparseFfn::Forward(int64_t layer, int64_t expert, const Activation& x, float* out) {
  // Predictor mode prefills through the token path whatever the batch (the offloaded batched prefill computes the same
  // function from its layer buffer).
  if (x.n() > 1 && !options_.sparse_prefill && predictor_ == nullptr && x.n() >= options_.batched_prefill_min_tokens) {
    ForwardPrefill(layer, expert, x, out);
    return true;
  }
  if (x.n() == 1) {
    ForwardToken(layer, expert, x, 0, out, /*counted=*/true);
  } else {
    // A short prompt through the token path: the statistics stay those of decode (as before, when such prompts ran
    // the dense path), unless every batch is meant to be counted (sparse_prefill: perplexity).
    const int64_t dim = x.cols();
    for (int64_t t = 0; t < x.n(); ++t) {
      token_act_.Set(x.f32() + t * dim, 1, dim);
      ForwardToken(layer, expert, token_act_, 0, out + t * dim, options_.sparse_prefill);
    }
  }
  return true;
}

void SparseFfn::ForwardPrefill(int64_t layer, int64_t expert, const Activation& x, float* out) {
  const LlamaHparams& hp = model_.hparams();
  const LayerWeights& L = model_.layers()[static_cast<size_t>(layer)];
  const int64_t n_ff = hp.n_ff, dim = hp.dim;
  const size_t group = static_cast<size_t>(layer * std::max<int64_t>(1, hp.n_experts) + std::max<int64_t>(0, expert));
  // Oracle mode only: the token path's threshold, so the result equals token-by-token prefill bitwise.
  const float thr = thresholds_[group];
  const MatrixView gate = expert >= 0 ? L.Expert(L.gate, L.expert_stride_gate, expert) : L.gate;
  const MatrixView up = expert >= 0 ? L.Expert(L.up, L.expert_stride_up, expert) : L.up;
  constexpr int64_t kTile = 32;  // tokens per GEMM: bounds the scratch (Gemm rows equal Gemv rows for any tile)
  const size_t need = static_cast<size_t>(std::min(kTile, x.n()) * n_ff);
  if (prefill_gate_.size() < need) {
    prefill_gate_.resize(need);
    prefill_up_.resize(need);
  }
  for (int64_t t0 = 0; t0 < x.n(); t0 += kTile) {
    const int64_t tn = std::min(kTile, x.n() - t0);
    token_act_.Set(x.f32() + t0 * dim, tn, dim);
    const MatrixView ws[2] = {gate, up};
    float* const ys[2] = {prefill_gate_.data(), prefill_up_.data()};
    GemmMany(ws, token_act_, ys, pool_);
    for (int64_t t = 0; t < tn; ++t) {
      used_.clear();
      for (int64_t i = 0; i < n_ff; ++i) {
        const size_t idx = static_cast<size_t>(t * n_ff + i);
        float ga = 0.0f;
        const float h = ActivateNeuron(hp.activation, prefill_gate_[idx], prefill_up_[idx], &ga);
        if (std::fabs(ga) > thr && h != 0.0f) {
          hidden_[used_.size()] = h;
          used_.push_back(static_cast<int32_t>(i));
        }
      }
      float* y = out + (t0 + t) * dim;
      std::fill(y, y + dim, 0.0f);
      AccumulateRows(down_t_[group], used_, hidden_.data(), y, pool_);
    }
  }
}

void SparseFfn::ForwardToken(int64_t layer, int64_t expert, const Activation& x, int64_t token, float* out,
                             bool counted) {
  const LlamaHparams& hp = model_.hparams();
  const LayerWeights& L = model_.layers()[static_cast<size_t>(layer)];
  // MoE: this expert's rows (stats stay per layer, summed over the experts' token-expert pairs).
  const MatrixView gate = expert >= 0 ? L.Expert(L.gate, L.expert_stride_gate, expert) : L.gate;
  const MatrixView up = expert >= 0 ? L.Expert(L.up, L.expert_stride_up, expert) : L.up;
  const size_t group = static_cast<size_t>(layer * std::max<int64_t>(1, hp.n_experts) + std::max<int64_t>(0, expert));
  const int64_t n_ff = hp.n_ff, dim = hp.dim;
  const float thr = thresholds_[group];
  SparseFfnLayerStats uncounted;
  SparseFfnLayerStats& st = counted ? stats_[static_cast<size_t>(layer)] : uncounted;
  st.tokens += 1;
  float ga = 0.0f;
  const bool need_all_gates = predictor_ == nullptr || options_.measure_recall;
  if (need_all_gates) Gemv(gate, x, gate_all_.data(), pool_);

  rows_.clear();
  if (predictor_ == nullptr) {
    // Oracle: the exact active set; its gate values are already known.
    for (int64_t i = 0; i < n_ff; ++i) {
      ActivateNeuron(hp.activation, gate_all_[static_cast<size_t>(i)], 0.0f, &ga);
      if (std::fabs(ga) > thr) {
        gate_[rows_.size()] = gate_all_[static_cast<size_t>(i)];
        rows_.push_back(static_cast<int32_t>(i));
      }
    }
    st.true_active += static_cast<int64_t>(rows_.size());
    st.true_positive += static_cast<int64_t>(rows_.size());
  } else {
    predictor_->Predict(static_cast<int64_t>(group), x, token, &pred_scratch_, &rows_, pool_);
    GemvRows(gate, rows_, x, gate_.data(), pool_);
    if (options_.measure_recall) {
      int64_t truth = 0, tp = 0;
      size_t k = 0;  // rows_ is ascending
      for (int64_t i = 0; i < n_ff; ++i) {
        ActivateNeuron(hp.activation, gate_all_[static_cast<size_t>(i)], 0.0f, &ga);
        const bool active = std::fabs(ga) > thr;
        while (k < rows_.size() && rows_[k] < i) ++k;
        truth += active;
        tp += active && k < rows_.size() && rows_[k] == i;
      }
      st.true_active += truth;
      st.true_positive += tp;
    }
  }
  const size_t m = rows_.size();
  st.computed += static_cast<int64_t>(m);
  GemvRows(up, rows_, x, up_.data(), pool_);
  // Keep only the neurons that pass the active test; the down projection skips the rest.
  used_.clear();
  for (size_t k = 0; k < m; ++k) {
    const float h = ActivateNeuron(hp.activation, gate_[k], up_[k], &ga);
    if (std::fabs(ga) > thr && h != 0.0f) {
      hidden_[used_.size()] = h;
      used_.push_back(rows_[k]);
    } else if (std::fabs(ga) > thr) {
      // Active by the gate test but a zero product (e.g. drelu with up <= 0): counted active, nothing to add.
      st.active += 1;
    }
  }
  st.active += static_cast<int64_t>(used_.size());
  std::fill(out, out + dim, 0.0f);
  AccumulateRows(down_t_[group], used_, hidden_.data(), out, pool_);
}

}  // namespace nflash
