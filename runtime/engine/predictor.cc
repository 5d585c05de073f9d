// Activation predictor files (read, write, validate) and the per-token prediction (two GEMVs).
#include "runtime/engine/predictor.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <variant>

#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "runtime/core/quant.h"

namespace nflash {
namespace {

// `w` (its bytes in `bytes`, row-major) transposed in place: the view of the (w.cols, w.rows) result. F32 and F16.
MatrixView TransposeInPlace(const MatrixView& w, std::vector<uint8_t>* bytes) {
  const size_t elem = w.type == GgmlType::kF16 ? 2 : 4;
  std::vector<uint8_t> t(bytes->size());
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t c = 0; c < w.cols; ++c) {
      std::memcpy(&t[(static_cast<size_t>(c) * static_cast<size_t>(w.rows) + static_cast<size_t>(r)) * elem],
                  &(*bytes)[(static_cast<size_t>(r) * static_cast<size_t>(w.cols) + static_cast<size_t>(c)) * elem],
                  elem);
    }
  }
  *bytes = std::move(t);
  return DenseMatrix(w.type, bytes->data(), w.cols, w.rows);
}

constexpr const char* kPrefix = "nflash.predictor.";

std::string Key(const char* name) { return std::string(kPrefix) + name; }
// The tensor `what` of group `g`: blk.L.what (dense), blk.L.exp.E.what (MoE, g = L x n_experts + E).
std::string TensorName(int64_t g, int64_t n_experts, const char* what) {
  if (n_experts <= 0) return "blk." + std::to_string(g) + "." + what;
  return "blk." + std::to_string(g / n_experts) + ".exp." + std::to_string(g % n_experts) + "." + what;
}

GgufValue FloatArray(const std::vector<float>& v) {
  GgufArray a;
  a.element_type = GgufType::kFloat32;
  for (float x : v) a.items.emplace_back(x);
  return GgufValue(std::move(a));
}

GgufValue U32Array(const std::vector<uint32_t>& v) {
  GgufArray a;
  a.element_type = GgufType::kUint32;
  for (uint32_t x : v) a.items.emplace_back(x);
  return GgufValue(std::move(a));
}

// A numeric GGUF value as double (strings, bools, arrays: nullopt).
std::optional<double> AsNumber(const GgufValue& v) {
  return std::visit(
      [](const auto& x) -> std::optional<double> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) return static_cast<double>(x);
        return std::nullopt;
      },
      v.v);
}

// A per-layer numeric array of exactly `n` items.
Result<std::vector<double>> ReadArray(const GgufFile& f, const char* name, int64_t n) {
  NF_ASSIGN_OR_RETURN(const GgufArray* a, f.GetArray(Key(name)));
  if (static_cast<int64_t>(a->items.size()) != n) {
    return Status::Corruption(f.path() + ": " + Key(name) + " has " + std::to_string(a->items.size()) +
                              " items, expected " + std::to_string(n) + " (one per layer, or per layer and expert)");
  }
  std::vector<double> out;
  for (const GgufValue& v : a->items) {
    auto x = AsNumber(v);
    if (!x) return Status::Corruption(f.path() + ": " + Key(name) + " holds a non-numeric item");
    out.push_back(*x);
  }
  return out;
}

std::vector<uint8_t> ToBytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(float));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

Status SavePredictor(const PredictorData& data, const std::string& path, bool overwrite, GgmlType weight_type) {
  if (weight_type != GgmlType::kF32 && weight_type != GgmlType::kF16) {
    return Status::InvalidArgument("predictor weights must be F32 or F16, not " + std::string(GgmlTypeName(weight_type)));
  }
  const int64_t per_layer = std::max<int64_t>(1, data.n_experts);
  const int64_t n_groups = static_cast<int64_t>(data.layers.size());
  if (data.n_experts < 0 || n_groups % per_layer != 0) {
    return Status::InvalidArgument("predictor of " + std::to_string(n_groups) + " groups for " +
                                   std::to_string(data.n_experts) + " experts per layer");
  }
  const int64_t n_layers = n_groups / per_layer;
  GgufWriter w;
  w.Set("general.architecture", "nflash-predictor");
  w.Set("general.name", data.model_name + " predictor");
  w.Set(Key("schema_version"), kPredictorSchemaVersion);
  w.Set(Key("model_hash"), data.model_hash);
  w.Set(Key("model_name"), data.model_name);
  w.Set(Key("activation"), data.activation);
  w.Set(Key("dim"), static_cast<uint64_t>(data.dim));
  w.Set(Key("n_ff"), static_cast<uint64_t>(data.n_ff));
  w.Set(Key("n_layers"), static_cast<uint64_t>(n_layers));
  if (data.n_experts > 0) w.Set(Key("n_experts"), static_cast<uint64_t>(data.n_experts));
  w.Set(Key("target_recall"), data.target_recall);
  w.Set(Key("train_tokens"), static_cast<uint64_t>(data.train_tokens));
  std::vector<uint32_t> rank;
  std::vector<float> lt, at, rec, prec, pf, tf, erec, eprec, epf, etf, secs;
  for (const PredictorLayerData& L : data.layers) {
    const PredictorLayerInfo& i = L.info;
    if (static_cast<int64_t>(L.fc1.size()) != i.rank * data.dim ||
        static_cast<int64_t>(L.fc2.size()) != data.n_ff * i.rank ||
        (!L.fc2_bias.empty() && static_cast<int64_t>(L.fc2_bias.size()) != data.n_ff) || i.rank <= 0) {
      return Status::InvalidArgument("predictor layer " + std::to_string(&L - data.layers.data()) +
                                     ": weight sizes do not match rank " + std::to_string(i.rank));
    }
    rank.push_back(static_cast<uint32_t>(i.rank));
    lt.push_back(i.logit_threshold);
    at.push_back(i.activation_threshold);
    rec.push_back(i.recall);
    prec.push_back(i.precision);
    pf.push_back(i.predicted_fraction);
    tf.push_back(i.true_fraction);
    erec.push_back(i.eval_recall);
    eprec.push_back(i.eval_precision);
    epf.push_back(i.eval_predicted_fraction);
    etf.push_back(i.eval_true_fraction);
    secs.push_back(i.train_seconds);
  }
  w.Set(Key("rank"), U32Array(rank));
  w.Set(Key("logit_threshold"), FloatArray(lt));
  w.Set(Key("activation_threshold"), FloatArray(at));
  w.Set(Key("recall"), FloatArray(rec));
  w.Set(Key("precision"), FloatArray(prec));
  w.Set(Key("predicted_fraction"), FloatArray(pf));
  w.Set(Key("true_fraction"), FloatArray(tf));
  w.Set(Key("eval_recall"), FloatArray(erec));
  w.Set(Key("eval_precision"), FloatArray(eprec));
  w.Set(Key("eval_predicted_fraction"), FloatArray(epf));
  w.Set(Key("eval_true_fraction"), FloatArray(etf));
  w.Set(Key("train_seconds"), FloatArray(secs));
  const int64_t ne = data.n_experts;
  for (int64_t l = 0; l < n_groups; ++l) {
    const PredictorLayerData& L = data.layers[static_cast<size_t>(l)];
    const uint64_t r = static_cast<uint64_t>(L.info.rank);
    NF_RETURN_IF_ERROR(w.AddTensor(TensorName(l, ne, "fc1.weight"), weight_type, {static_cast<uint64_t>(data.dim), r}));
    NF_RETURN_IF_ERROR(w.AddTensor(TensorName(l, ne, "fc2.weight"), weight_type, {r, static_cast<uint64_t>(data.n_ff)}));
    if (!L.fc2_bias.empty()) {
      NF_RETURN_IF_ERROR(
          w.AddTensor(TensorName(l, ne, "fc2.bias"), GgmlType::kF32, {static_cast<uint64_t>(data.n_ff)}));
    }
  }
  NF_RETURN_IF_ERROR(w.Begin(path, overwrite));
  auto encode = [&](const std::vector<float>& v, int64_t cols) -> Result<std::vector<uint8_t>> {
    if (weight_type == GgmlType::kF32) return ToBytes(v);
    const int64_t rows = static_cast<int64_t>(v.size()) / cols;
    const size_t rb = static_cast<size_t>(*RowBytes(weight_type, static_cast<uint64_t>(cols)));  // F32/F16: any cols
    std::vector<uint8_t> out(rb * static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      NF_RETURN_IF_ERROR(QuantizeRow(weight_type, v.data() + r * cols, out.data() + rb * static_cast<size_t>(r), cols));
    }
    return out;
  };
  for (int64_t l = 0; l < n_groups; ++l) {
    const PredictorLayerData& L = data.layers[static_cast<size_t>(l)];
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> fc1, encode(L.fc1, data.dim));
    NF_RETURN_IF_ERROR(w.WriteTensorData(TensorName(l, ne, "fc1.weight"), fc1));
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> fc2, encode(L.fc2, L.info.rank));
    NF_RETURN_IF_ERROR(w.WriteTensorData(TensorName(l, ne, "fc2.weight"), fc2));
    if (!L.fc2_bias.empty()) {
      NF_RETURN_IF_ERROR(w.WriteTensorData(TensorName(l, ne, "fc2.bias"), ToBytes(L.fc2_bias)));
    }
  }
  return w.Finish();
}

Result<std::unique_ptr<Predictor>> Predictor::Load(const std::string& path) {
  // With O_DIRECT (weights never go through the page cache), into memory freed once the tensors are copied out.
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> bytes, ReadFileDirect(path));
  NF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(std::shared_ptr<const ReadableFile>(std::move(bytes))));
  Result<uint64_t> version_or = f.GetUint(Key("schema_version"));
  if (!version_or.ok()) {
    return Status::Corruption(path + ": not an nflash predictor file (" + version_or.status().message() + ")");
  }
  const uint64_t version = *version_or;
  if (version != kPredictorSchemaVersion) {
    return Status::Unsupported(path + ": predictor schema version " + std::to_string(version) + ", this nflash reads " +
                               std::to_string(kPredictorSchemaVersion));
  }
  std::unique_ptr<Predictor> p(new Predictor());
  p->path_ = path;
  NF_ASSIGN_OR_RETURN(p->model_hash_, f.GetString(Key("model_hash")));
  NF_ASSIGN_OR_RETURN(p->model_name_, f.GetString(Key("model_name")));
  NF_ASSIGN_OR_RETURN(p->activation_, f.GetString(Key("activation")));
  NF_ASSIGN_OR_RETURN(uint64_t dim, f.GetUint(Key("dim")));
  NF_ASSIGN_OR_RETURN(uint64_t n_ff, f.GetUint(Key("n_ff")));
  NF_ASSIGN_OR_RETURN(uint64_t n_layers, f.GetUint(Key("n_layers")));
  NF_ASSIGN_OR_RETURN(double target, f.GetFloat(Key("target_recall")));
  // Bounds far above any real model, so that a corrupt count cannot drive a huge allocation.
  constexpr uint64_t kMaxDim = 1u << 20, kMaxLayers = 4096;
  if (dim == 0 || dim > kMaxDim || n_ff == 0 || n_ff > kMaxDim || n_layers == 0 || n_layers > kMaxLayers) {
    return Status::Corruption(path + ": implausible predictor shape dim " + std::to_string(dim) + ", n_ff " +
                              std::to_string(n_ff) + ", n_layers " + std::to_string(n_layers));
  }
  uint64_t n_experts = 0;
  if (f.Find(Key("n_experts")) != nullptr) {
    NF_ASSIGN_OR_RETURN(n_experts, f.GetUint(Key("n_experts")));
    constexpr uint64_t kMaxExperts = 1024;
    if (n_experts == 0 || n_experts > kMaxExperts) {
      return Status::Corruption(path + ": " + Key("n_experts") + " is " + std::to_string(n_experts) +
                                ", expected 1.." + std::to_string(kMaxExperts) + " (or no key for a dense model)");
    }
  }
  p->dim_ = static_cast<int64_t>(dim);
  p->n_ff_ = static_cast<int64_t>(n_ff);
  p->n_layers_ = static_cast<int64_t>(n_layers);
  p->n_experts_ = static_cast<int64_t>(n_experts);
  p->target_recall_ = static_cast<float>(target);
  const int64_t ne = p->n_experts_;
  const int64_t nl = p->n_layers_ * std::max<int64_t>(1, ne);  // groups
  NF_ASSIGN_OR_RETURN(std::vector<double> rank, ReadArray(f, "rank", nl));
  NF_ASSIGN_OR_RETURN(std::vector<double> lt, ReadArray(f, "logit_threshold", nl));
  NF_ASSIGN_OR_RETURN(std::vector<double> at, ReadArray(f, "activation_threshold", nl));
  // Measurements are informative: read them when present.
  const char* kStats[] = {"recall", "precision", "predicted_fraction", "true_fraction", "eval_recall",
                          "eval_precision", "eval_predicted_fraction", "eval_true_fraction", "train_seconds"};
  std::vector<std::vector<double>> stats;
  for (const char* s : kStats) {
    auto a = ReadArray(f, s, nl);
    stats.push_back(a.ok() ? *a : std::vector<double>(static_cast<size_t>(nl), -1.0));
  }
  p->layers_.resize(static_cast<size_t>(nl));
  std::vector<uint8_t> scratch;
  for (int64_t l = 0; l < nl; ++l) {
    Layer& L = p->layers_[static_cast<size_t>(l)];
    const size_t li = static_cast<size_t>(l);
    PredictorLayerInfo& info = L.info;
    info.rank = static_cast<int64_t>(rank[li]);
    info.logit_threshold = static_cast<float>(lt[li]);
    info.activation_threshold = static_cast<float>(at[li]);
    float* dst[] = {&info.recall, &info.precision, &info.predicted_fraction, &info.true_fraction, &info.eval_recall,
                    &info.eval_precision, &info.eval_predicted_fraction, &info.eval_true_fraction,
                    &info.train_seconds};
    for (size_t s = 0; s < stats.size(); ++s) *dst[s] = static_cast<float>(stats[s][li]);
    if (info.rank <= 0 || info.rank > static_cast<int64_t>(kMaxDim)) {
      return Status::Corruption(path + ": " + TensorName(l, ne, "fc1.weight") + ": rank " + std::to_string(info.rank));
    }
    auto load = [&](const char* what, int64_t rows, int64_t cols, std::vector<uint8_t>* bytes,
                    MatrixView* view) -> Status {
      const std::string name = TensorName(l, ne, what);
      const GgufTensorInfo* t = f.FindTensor(name);
      if (t == nullptr) return Status::Corruption(path + ": missing tensor " + name);
      if (t->type != GgmlType::kF32 && t->type != GgmlType::kF16) {
        return Status::Unsupported(path + ": tensor " + name + " has type " + std::string(GgmlTypeName(t->type)) +
                                   ", expected F32 or F16");
      }
      if (t->dims.size() != 2 || t->dims[0] != static_cast<uint64_t>(cols) || t->dims[1] != static_cast<uint64_t>(rows)) {
        std::string found;
        for (uint64_t d : t->dims) found += (found.empty() ? "" : " x ") + std::to_string(d);
        return Status::Corruption(path + ": tensor " + name + " has dims [" + found + "], expected [" +
                                  std::to_string(cols) + " x " + std::to_string(rows) + "]");
      }
      NF_ASSIGN_OR_RETURN(std::span<const uint8_t> data, f.TensorData(*t, &scratch));
      bytes->assign(data.begin(), data.end());
      *view = DenseMatrix(t->type, bytes->data(), rows, cols);
      return ValidateMatrix(*view, name.c_str());
    };
    NF_RETURN_IF_ERROR(load("fc1.weight", info.rank, p->dim_, &L.fc1_bytes, &L.fc1));
    NF_RETURN_IF_ERROR(load("fc2.weight", p->n_ff_, info.rank, &L.fc2_bytes, &L.fc2t));
    L.fc2t = TransposeInPlace(L.fc2t, &L.fc2_bytes);
    L.fc2_bias.assign(static_cast<size_t>(p->n_ff_), 0.0f);
    if (const GgufTensorInfo* b = f.FindTensor(TensorName(l, ne, "fc2.bias"))) {
      if (b->type != GgmlType::kF32 || b->n_elements != n_ff) {
        return Status::Corruption(path + ": tensor " + b->name + " must be F32 with " + std::to_string(n_ff) +
                                  " elements");
      }
      NF_ASSIGN_OR_RETURN(std::span<const uint8_t> data, f.TensorData(*b, &scratch));
      std::memcpy(L.fc2_bias.data(), data.data(), static_cast<size_t>(n_ff) * sizeof(float));
    }
  }
  return p;
}

Result<std::unique_ptr<Predictor>> Predictor::FromData(const PredictorData& data) {
  std::unique_ptr<Predictor> p(new Predictor());
  p->path_ = "(in memory)";
  p->model_hash_ = data.model_hash;
  p->model_name_ = data.model_name;
  p->activation_ = data.activation;
  p->dim_ = data.dim;
  p->n_ff_ = data.n_ff;
  p->n_experts_ = data.n_experts;
  const int64_t per_layer = std::max<int64_t>(1, data.n_experts);
  if (data.n_experts < 0 || data.layers.size() % static_cast<size_t>(per_layer) != 0) {
    return Status::InvalidArgument("predictor of " + std::to_string(data.layers.size()) + " groups for " +
                                   std::to_string(data.n_experts) + " experts per layer");
  }
  p->n_layers_ = static_cast<int64_t>(data.layers.size()) / per_layer;
  p->target_recall_ = data.target_recall;
  p->layers_.resize(data.layers.size());
  for (size_t l = 0; l < data.layers.size(); ++l) {
    const PredictorLayerData& s = data.layers[l];
    Layer& L = p->layers_[l];
    L.info = s.info;
    if (static_cast<int64_t>(s.fc1.size()) != s.info.rank * data.dim ||
        static_cast<int64_t>(s.fc2.size()) != data.n_ff * s.info.rank || s.info.rank <= 0) {
      return Status::InvalidArgument("predictor layer " + std::to_string(l) + ": weight sizes do not match rank");
    }
    L.fc1_bytes = ToBytes(s.fc1);
    L.fc2_bytes = ToBytes(s.fc2);
    L.fc1 = DenseMatrix(GgmlType::kF32, L.fc1_bytes.data(), s.info.rank, data.dim);
    L.fc2t = TransposeInPlace(DenseMatrix(GgmlType::kF32, L.fc2_bytes.data(), data.n_ff, s.info.rank), &L.fc2_bytes);
    L.fc2_bias = s.fc2_bias.empty() ? std::vector<float>(static_cast<size_t>(data.n_ff), 0.0f) : s.fc2_bias;
  }
  return p;
}

Status Predictor::CheckForModel(const LlamaHparams& hp, const std::string& model_hash,
                                const std::string& model_path) const {
  auto mismatch = [&](const char* what, const std::string& expected, const std::string& found) {
    return Status::InvalidArgument(path_ + ": predictor made for a different model: " + what + " " + found +
                                   ", but " + model_path + " has " + expected);
  };
  if (hp.dim != dim_) return mismatch("dim", std::to_string(hp.dim), std::to_string(dim_));
  if (hp.n_ff != n_ff_) return mismatch("n_ff", std::to_string(hp.n_ff), std::to_string(n_ff_));
  if (hp.n_layers != n_layers()) return mismatch("layers", std::to_string(hp.n_layers), std::to_string(n_layers()));
  if (hp.n_experts != n_experts_) {
    return mismatch("experts per layer", std::to_string(hp.n_experts), std::to_string(n_experts_));
  }
  if (FfnActivationName(hp.activation) != activation_) {
    return mismatch("activation", FfnActivationName(hp.activation), activation_);
  }
  if (!model_hash.empty() && model_hash != model_hash_) {
    return mismatch("model hash", model_hash, model_hash_);
  }
  return Status::Ok();
}

void Predictor::PrepareScratch(PredictorScratch* scratch) const {
  int64_t max_rank = 0;
  for (const Layer& L : layers_) max_rank = std::max(max_rank, L.info.rank);
  scratch->hidden.resize(static_cast<size_t>(max_rank));
  scratch->logits.resize(static_cast<size_t>(n_ff_));
  scratch->live.reserve(static_cast<size_t>(max_rank));
  scratch->live_h.reserve(static_cast<size_t>(max_rank));
}

void Predictor::Hidden(int64_t group, const float* x, PredictorScratch* scratch, ThreadPool* pool) const {
  scratch->x_act.Set(x, 1, dim_, /*quantize=*/false);  // fc1 is F32 or F16 (Load checks): no Q8_0 copy
  Gemv(layers_[static_cast<size_t>(group)].fc1, scratch->x_act, scratch->hidden.data(), pool);
}

void Predictor::LogitsFromHidden(int64_t group, PredictorScratch* scratch, ThreadPool* pool) const {
  const Layer& L = layers_[static_cast<size_t>(group)];
  const float* h = scratch->hidden.data();
  scratch->live.clear();
  scratch->live_h.clear();
  for (int64_t i = 0; i < L.info.rank; ++i) {
    if (h[i] > 0.0f) {  // ReLU: the other units add nothing
      scratch->live.push_back(static_cast<int32_t>(i));
      scratch->live_h.push_back(h[i]);
    }
  }
  float* lg = scratch->logits.data();
  std::memcpy(lg, L.fc2_bias.data(), static_cast<size_t>(n_ff_) * sizeof(float));
  AccumulateRows(L.fc2t, scratch->live, scratch->live_h.data(), lg, pool);
}

void Predictor::Logits(int64_t group, const float* x, PredictorScratch* scratch, ThreadPool* pool) const {
  Hidden(group, x, scratch, pool);
  LogitsFromHidden(group, scratch, pool);
}

void Predictor::ActiveFromLogits(int64_t group, const PredictorScratch& scratch, std::vector<int32_t>* active) const {
  const float thr = layers_[static_cast<size_t>(group)].info.logit_threshold;
  const float* lg = scratch.logits.data();
  active->clear();
  // 64 comparisons into a mask, then its set bits: no branch per neuron (about a tenth pass, at random).
  for (int64_t b = 0; b < n_ff_; b += 64) {
    const int64_t e = std::min<int64_t>(n_ff_, b + 64);
    uint64_t m = 0;
    for (int64_t i = b; i < e; ++i) m |= static_cast<uint64_t>(lg[i] > thr) << (i - b);
    for (; m != 0; m &= m - 1) active->push_back(static_cast<int32_t>(b + std::countr_zero(m)));
  }
}

void Predictor::Predict(int64_t group, const Activation& x, int64_t token, PredictorScratch* scratch,
                        std::vector<int32_t>* active, ThreadPool* pool) const {
  Logits(group, x.f32() + token * x.cols(), scratch, pool);
  ActiveFromLogits(group, *scratch, active);
}

uint64_t Predictor::LayerBytes(int64_t group) const {
  const Layer& L = layers_[static_cast<size_t>(group)];
  return L.fc1_bytes.size() + L.fc2_bytes.size() + L.fc2_bias.size() * sizeof(float);
}

uint64_t Predictor::PredictorBytes() const {
  uint64_t b = 0;
  for (int64_t g = 0; g < n_groups(); ++g) b += LayerBytes(g);
  return b;
}

}  // namespace nflash
