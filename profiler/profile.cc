// Encoding and decoding of the model profile file (one GGUF container; layout in docs/profile-format.md), shared by
// `nflash profile` (writer) and every reader (packer, planner, predictor trainer, inspect).
#include "profiler/profile.h"

#include <cstring>
#include <span>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "runtime/core/checksum.h"
#include "runtime/core/gguf.h"

namespace nflash::profiler {
namespace {

// Bins of FfnProfile::active_hist: 5% of the layer each, fine enough for P50/P90 and coarse enough to stay tiny.
constexpr size_t kHistBins = 20;
constexpr std::string_view kPrefix = "nflash.profile.";
// Seed of the chained xxHash64 over all tensor bytes in file order (any fixed value works; 0 is xxHash's default).
constexpr uint64_t kDataHashSeed = 0;

std::string Key(std::string_view k) { return std::string(kPrefix) + std::string(k); }

// "prof.blk.3.count_bs1" (dense) or "prof.blk.3.exp.7.count_bs1" (expert 7): at most ~40 bytes, under GGUF's 63.
// The model-level shared-cache LRU curve (ModelProfile::lru_hit_rate_shared).
constexpr const char* kSharedLruTensor = "prof.lru_hit_rate_shared";

std::string TensorName(const FfnProfile& f, std::string_view field) {
  std::string n = "prof.blk." + std::to_string(f.layer) + ".";
  if (f.expert >= 0) n += "exp." + std::to_string(f.expert) + ".";
  return n + std::string(field);
}

// One array field of an FfnProfile as it is stored: its tensor type, dims and bytes.
struct FieldView {
  std::string_view name;
  GgmlType type;
  std::vector<uint64_t> dims;
  const void* data;
  size_t bytes;
};

std::vector<FieldView> Fields(const FfnProfile& f) {
  const uint64_t n = static_cast<uint64_t>(f.n_neurons);
  const uint64_t k = static_cast<uint64_t>(f.coact_k);
  auto u32 = [](std::string_view name, const std::vector<uint32_t>& v, std::vector<uint64_t> dims) {
    return FieldView{name, GgmlType::kI32, std::move(dims), v.data(), v.size() * sizeof(uint32_t)};
  };
  auto f32 = [](std::string_view name, const std::vector<float>& v) {
    return FieldView{name, GgmlType::kF32, {v.size()}, v.data(), v.size() * sizeof(float)};
  };
  std::vector<FieldView> fields = {
      u32("count_bs1", f.count_bs1, {n}),
      u32("count_bs2", f.count_bs2, {n}),
      u32("count_bs4", f.count_bs4, {n}),
      u32("active_hist", f.active_hist, {kHistBins}),
      f32("popularity", f.popularity),
      f32("lru_hit_rate", f.lru_hit_rate),
      FieldView{"coact_partner", GgmlType::kI32, {k, n}, f.coact_partner.data(),
                f.coact_partner.size() * sizeof(int32_t)},
      u32("coact_count", f.coact_count, {k, n}),
      f32("report_thresholds", f.report_thresholds),
  };
  // Optional, last (absent from older files; the data hash covers it when present).
  if (!f.popularity_heldout.empty()) fields.push_back(f32("popularity_heldout", f.popularity_heldout));
  return fields;
}

// Checks the in-memory sizes before writing, so a writer bug cannot produce a file the reader rejects.
Status CheckSizes(const FfnProfile& f, size_t n_report, const std::string& where) {
  const size_t n = static_cast<size_t>(f.n_neurons);
  const size_t nk = n * static_cast<size_t>(f.coact_k);
  auto check = [&](std::string_view field, size_t found, size_t expected) -> Status {
    if (found == expected) return Status::Ok();
    return Status::InvalidArgument(where + ": field " + std::string(field) + " has " + std::to_string(found) +
                                   " elements, expected " + std::to_string(expected));
  };
  if (f.n_neurons <= 0) return Status::InvalidArgument(where + ": n_neurons must be > 0");
  if (f.coact_k < 0) return Status::InvalidArgument(where + ": coact_k must be >= 0");
  NF_RETURN_IF_ERROR(check("count_bs1", f.count_bs1.size(), n));
  NF_RETURN_IF_ERROR(check("count_bs2", f.count_bs2.size(), n));
  NF_RETURN_IF_ERROR(check("count_bs4", f.count_bs4.size(), n));
  NF_RETURN_IF_ERROR(check("active_hist", f.active_hist.size(), kHistBins));
  NF_RETURN_IF_ERROR(check("popularity", f.popularity.size(), kCurvePoints));
  NF_RETURN_IF_ERROR(check("lru_hit_rate", f.lru_hit_rate.size(), kCurvePoints));
  if (!f.popularity_heldout.empty()) {
    NF_RETURN_IF_ERROR(check("popularity_heldout", f.popularity_heldout.size(), kCurvePoints));
  }
  NF_RETURN_IF_ERROR(check("coact_partner", f.coact_partner.size(), nk));
  NF_RETURN_IF_ERROR(check("coact_count", f.coact_count.size(), nk));
  NF_RETURN_IF_ERROR(check("report_thresholds", f.report_thresholds.size(), n_report));
  return Status::Ok();
}

template <typename T, typename Get>
GgufArray MakeArray(GgufType type, const std::vector<FfnProfile>& ffns, Get get) {
  GgufArray a;
  a.element_type = type;
  a.items.reserve(ffns.size());
  for (const FfnProfile& f : ffns) a.items.emplace_back(static_cast<T>(get(f)));
  return a;
}

// Reads a per-FFN metadata array of `n` numbers (any integer or float element type) as doubles.
Result<std::vector<double>> ReadNumbers(const GgufFile& g, std::string_view field, size_t n) {
  const std::string key = Key(field);
  NF_ASSIGN_OR_RETURN(const GgufArray* a, g.GetArray(key));
  if (a->items.size() != n) {
    return Status::Corruption(g.path() + ": " + key + " has " + std::to_string(a->items.size()) +
                              " entries, expected " + std::to_string(n) + " (nflash.profile.n_ffns)");
  }
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    const bool ok = std::visit(
        [&](const auto& x) {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_arithmetic_v<X> && !std::is_same_v<X, bool>) {
            out[i] = static_cast<double>(x);
            return true;
          } else {
            return false;
          }
        },
        a->items[i].v);
    if (!ok) {
      return Status::Corruption(g.path() + ": " + key + "[" + std::to_string(i) + "] has type " +
                                std::string(GgufTypeName(a->items[i].type())) + ", expected a number");
    }
  }
  return out;
}

}  // namespace

const FfnProfile* ModelProfile::Find(int64_t layer, int64_t expert) const {
  for (const FfnProfile& f : ffns) {
    if (f.layer == layer && f.expert == expert) return &f;
  }
  return nullptr;
}

Status SaveProfile(const ModelProfile& p, const std::string& path, bool overwrite) {
  for (size_t i = 0; i < p.ffns.size(); ++i) {
    NF_RETURN_IF_ERROR(CheckSizes(p.ffns[i], p.report_sparsities.size(),
                                  "profile for " + path + ", ffn " + std::to_string(i)));
  }
  GgufWriter w;
  w.Set("general.type", "nflash-profile");
  w.Set(Key("schema_version"), static_cast<uint32_t>(p.schema_version));
  w.Set(Key("model_hash"), p.model_hash);
  w.Set(Key("model_name"), p.model_name);
  w.Set(Key("activation"), p.activation);
  w.Set(Key("n_layers"), static_cast<uint64_t>(p.n_layers));
  w.Set(Key("n_ff"), static_cast<uint64_t>(p.n_ff));
  w.Set(Key("n_experts"), static_cast<uint64_t>(p.n_experts));
  w.Set(Key("dim"), static_cast<uint64_t>(p.dim));
  w.Set(Key("tokens"), static_cast<uint64_t>(p.tokens));
  w.Set(Key("text_path"), p.text_path);
  w.Set(Key("ctx"), static_cast<uint64_t>(p.ctx));
  w.Set(Key("source"), p.decode_tokens > 0 ? "decode" : "text");
  if (p.decode_tokens > 0) {
    w.Set(Key("decode_tokens"), static_cast<uint64_t>(p.decode_tokens));
    w.Set(Key("decode_prompt_tokens"), static_cast<uint64_t>(p.decode_prompt_tokens));
    w.Set(Key("decode_temperature"), p.decode_temperature);
  }
  w.Set(Key("target_sparsity"), p.target_sparsity);
  {
    GgufArray rs{GgufType::kFloat32, {}};
    for (float s : p.report_sparsities) rs.items.emplace_back(s);
    w.Set(Key("report_sparsities"), std::move(rs));
  }
  w.Set(Key("n_ffns"), static_cast<uint64_t>(p.ffns.size()));
  const auto& F = p.ffns;
  w.Set(Key("ffn.layer"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.layer; }));
  w.Set(Key("ffn.expert"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.expert; }));
  w.Set(Key("ffn.n_neurons"),
        MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.n_neurons; }));
  w.Set(Key("ffn.threshold"),
        MakeArray<float>(GgufType::kFloat32, F, [](const FfnProfile& f) { return f.threshold; }));
  w.Set(Key("ffn.tokens"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.tokens; }));
  w.Set(Key("ffn.groups2"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.groups2; }));
  w.Set(Key("ffn.groups4"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.groups4; }));
  w.Set(Key("ffn.mean_active_fraction"),
        MakeArray<double>(GgufType::kFloat64, F, [](const FfnProfile& f) { return f.mean_active_fraction; }));
  w.Set(Key("ffn.up_given_gate"),
        MakeArray<double>(GgufType::kFloat64, F, [](const FfnProfile& f) { return f.up_given_gate; }));
  w.Set(Key("ffn.down_given_gate"),
        MakeArray<double>(GgufType::kFloat64, F, [](const FfnProfile& f) { return f.down_given_gate; }));
  w.Set(Key("ffn.coact_k"), MakeArray<int64_t>(GgufType::kInt64, F, [](const FfnProfile& f) { return f.coact_k; }));

  // The data hash chains every tensor's bytes in file order: GGUF has no checksum of its own, and a flipped count
  // would silently skew the packer's hot/cold split.
  uint64_t data_hash = kDataHashSeed;
  for (const FfnProfile& f : F) {
    for (const FieldView& v : Fields(f)) {
      NF_RETURN_IF_ERROR(w.AddTensor(TensorName(f, v.name), v.type, v.dims));
      data_hash = Xxh64(v.data, v.bytes, data_hash);
    }
  }
  // Optional model-level curve, after the FFNs' tensors.
  const std::vector<float>& shared = p.lru_hit_rate_shared;
  const size_t shared_bytes = shared.size() * sizeof(float);
  if (!shared.empty()) {
    if (shared.size() != static_cast<size_t>(kSharedCurvePoints)) {
      return Status::InvalidArgument(path + ": lru_hit_rate_shared has " + std::to_string(shared.size()) +
                                     " elements, expected " + std::to_string(kSharedCurvePoints));
    }
    NF_RETURN_IF_ERROR(w.AddTensor(kSharedLruTensor, GgmlType::kF32, {shared.size()}));
    data_hash = Xxh64(shared.data(), shared_bytes, data_hash);
  }
  w.Set(Key("data_xxh64"), data_hash);
  NF_RETURN_IF_ERROR(w.Begin(path, overwrite));
  for (const FfnProfile& f : F) {
    for (const FieldView& v : Fields(f)) {
      NF_RETURN_IF_ERROR(w.WriteTensorData(
          TensorName(f, v.name), std::span<const uint8_t>(static_cast<const uint8_t*>(v.data), v.bytes)));
    }
  }
  if (!shared.empty()) {
    NF_RETURN_IF_ERROR(w.WriteTensorData(
        kSharedLruTensor, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(shared.data()), shared_bytes)));
  }
  return w.Finish();
}

Result<ModelProfile> LoadProfile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenMmapFile(path));
  return LoadProfile(std::shared_ptr<const ReadableFile>(std::move(file)));
}

Result<ModelProfile> LoadProfile(std::shared_ptr<const ReadableFile> file) {
  const std::string path = file->Path();
  NF_ASSIGN_OR_RETURN(GgufFile g, GgufFile::Open(std::move(file)));
  auto type = g.GetString("general.type");
  if (!type.ok() || *type != "nflash-profile") {
    return Status::InvalidArgument(path + " is not an nflash profile (general.type is " +
                                   (type.ok() ? "\"" + *type + "\"" : std::string("missing")) +
                                   ", expected \"nflash-profile\")");
  }
  ModelProfile p;
  NF_ASSIGN_OR_RETURN(uint64_t version, g.GetUint(Key("schema_version")));
  if (version != static_cast<uint64_t>(kProfileSchemaVersion)) {
    return Status::Unsupported(path + ": profile schema version " + std::to_string(version) + ", this nflash reads " +
                               std::to_string(kProfileSchemaVersion) + " (re-run `nflash profile`)");
  }
  p.schema_version = static_cast<int>(version);
  NF_ASSIGN_OR_RETURN(p.model_hash, g.GetString(Key("model_hash")));
  NF_ASSIGN_OR_RETURN(p.model_name, g.GetString(Key("model_name")));
  NF_ASSIGN_OR_RETURN(p.activation, g.GetString(Key("activation")));
  NF_ASSIGN_OR_RETURN(p.n_layers, g.GetInt(Key("n_layers")));
  NF_ASSIGN_OR_RETURN(p.n_ff, g.GetInt(Key("n_ff")));
  NF_ASSIGN_OR_RETURN(p.n_experts, g.GetInt(Key("n_experts")));
  NF_ASSIGN_OR_RETURN(p.dim, g.GetInt(Key("dim")));
  NF_ASSIGN_OR_RETURN(p.tokens, g.GetInt(Key("tokens")));
  NF_ASSIGN_OR_RETURN(p.text_path, g.GetString(Key("text_path")));
  NF_ASSIGN_OR_RETURN(p.ctx, g.GetInt(Key("ctx")));
  // Optional (profiles before session 6 have none): "text" or "decode" with its parameters.
  if (g.Find(Key("source")) != nullptr) {
    NF_ASSIGN_OR_RETURN(std::string source, g.GetString(Key("source")));
    if (source == "decode") {
      NF_ASSIGN_OR_RETURN(p.decode_tokens, g.GetInt(Key("decode_tokens")));
      NF_ASSIGN_OR_RETURN(p.decode_prompt_tokens, g.GetInt(Key("decode_prompt_tokens")));
      NF_ASSIGN_OR_RETURN(p.decode_temperature, g.GetFloat(Key("decode_temperature")));
      if (p.decode_tokens < 1 || p.decode_prompt_tokens < 1 || p.decode_tokens + p.decode_prompt_tokens > p.ctx) {
        return Status::Corruption(path + ": nflash.profile.decode_tokens " + std::to_string(p.decode_tokens) +
                                  " and decode_prompt_tokens " + std::to_string(p.decode_prompt_tokens) +
                                  " must be >= 1 and fit ctx " + std::to_string(p.ctx));
      }
    } else if (source != "text") {
      return Status::Corruption(path + ": nflash.profile.source is \"" + source + "\", expected \"text\" or \"decode\"");
    }
  }
  NF_ASSIGN_OR_RETURN(p.target_sparsity, g.GetFloat(Key("target_sparsity")));
  NF_ASSIGN_OR_RETURN(uint64_t n_ffns, g.GetUint(Key("n_ffns")));
  // Each FFN has 9 tensors, so the directory bounds n_ffns; this keeps a hostile count from allocating first.
  if (n_ffns > g.tensors().size()) {
    return Status::Corruption(path + ": nflash.profile.n_ffns is " + std::to_string(n_ffns) + " but the file has " +
                              std::to_string(g.tensors().size()) + " tensors");
  }
  {
    NF_ASSIGN_OR_RETURN(const GgufArray* rs, g.GetArray(Key("report_sparsities")));
    for (const GgufValue& v : rs->items) {
      if (v.type() != GgufType::kFloat32) {
        return Status::Corruption(path + ": nflash.profile.report_sparsities has type " +
                                  std::string(GgufTypeName(v.type())) + " elements, expected f32");
      }
      p.report_sparsities.push_back(std::get<float>(v.v));
    }
  }
  const size_t n = static_cast<size_t>(n_ffns);
  NF_ASSIGN_OR_RETURN(auto layer, ReadNumbers(g, "ffn.layer", n));
  NF_ASSIGN_OR_RETURN(auto expert, ReadNumbers(g, "ffn.expert", n));
  NF_ASSIGN_OR_RETURN(auto n_neurons, ReadNumbers(g, "ffn.n_neurons", n));
  NF_ASSIGN_OR_RETURN(auto threshold, ReadNumbers(g, "ffn.threshold", n));
  NF_ASSIGN_OR_RETURN(auto tokens, ReadNumbers(g, "ffn.tokens", n));
  NF_ASSIGN_OR_RETURN(auto groups2, ReadNumbers(g, "ffn.groups2", n));
  NF_ASSIGN_OR_RETURN(auto groups4, ReadNumbers(g, "ffn.groups4", n));
  NF_ASSIGN_OR_RETURN(auto mean, ReadNumbers(g, "ffn.mean_active_fraction", n));
  NF_ASSIGN_OR_RETURN(auto upg, ReadNumbers(g, "ffn.up_given_gate", n));
  NF_ASSIGN_OR_RETURN(auto downg, ReadNumbers(g, "ffn.down_given_gate", n));
  NF_ASSIGN_OR_RETURN(auto coact_k, ReadNumbers(g, "ffn.coact_k", n));
  NF_ASSIGN_OR_RETURN(uint64_t expected_hash, g.GetUint(Key("data_xxh64")));

  uint64_t data_hash = kDataHashSeed;
  size_t tensors_read = 0;
  std::vector<uint8_t> scratch;
  p.ffns.resize(n);
  for (size_t i = 0; i < n; ++i) {
    FfnProfile& f = p.ffns[i];
    f.layer = static_cast<int64_t>(layer[i]);
    f.expert = static_cast<int64_t>(expert[i]);
    f.n_neurons = static_cast<int64_t>(n_neurons[i]);
    f.threshold = static_cast<float>(threshold[i]);
    f.tokens = static_cast<int64_t>(tokens[i]);
    f.groups2 = static_cast<int64_t>(groups2[i]);
    f.groups4 = static_cast<int64_t>(groups4[i]);
    f.mean_active_fraction = mean[i];
    f.up_given_gate = upg[i];
    f.down_given_gate = downg[i];
    f.coact_k = static_cast<int64_t>(coact_k[i]);
    const std::string where = path + ": ffn " + std::to_string(i) + " (layer " + std::to_string(f.layer) +
                              ", expert " + std::to_string(f.expert) + ")";
    if (f.layer < 0 || f.layer >= p.n_layers) {
      return Status::Corruption(where + ": layer out of range [0, " + std::to_string(p.n_layers) + ")");
    }
    if (f.expert < -1 || f.expert >= std::max<int64_t>(p.n_experts, 0)) {
      return Status::Corruption(where + ": expert out of range [-1, " + std::to_string(p.n_experts) + ")");
    }
    // n_ff bounds the neurons and the partner count: a hostile value cannot make the reader allocate much.
    if (f.n_neurons <= 0 || f.n_neurons > p.n_ff || f.coact_k < 0 || f.coact_k > f.n_neurons) {
      return Status::Corruption(where + ": n_neurons " + std::to_string(f.n_neurons) + " / coact_k " +
                                std::to_string(f.coact_k) + " out of range (n_ff " + std::to_string(p.n_ff) + ")");
    }
    if (f.tokens < 0 || f.groups2 < 0 || f.groups4 < 0) return Status::Corruption(where + ": negative token count");
    f.count_bs1.resize(f.n_neurons);
    f.count_bs2.resize(f.n_neurons);
    f.count_bs4.resize(f.n_neurons);
    f.active_hist.resize(kHistBins);
    f.popularity.resize(kCurvePoints);
    f.lru_hit_rate.resize(kCurvePoints);
    f.coact_partner.resize(f.n_neurons * f.coact_k);
    f.coact_count.resize(f.n_neurons * f.coact_k);
    f.report_thresholds.resize(p.report_sparsities.size());
    if (g.FindTensor(TensorName(f, "popularity_heldout")) != nullptr) f.popularity_heldout.resize(kCurvePoints);
    for (const FieldView& v : Fields(f)) {
      const std::string name = TensorName(f, v.name);
      const GgufTensorInfo* t = g.FindTensor(name);
      if (t == nullptr) return Status::Corruption(where + ": tensor " + name + " is missing");
      if (t->type != v.type || t->dims != v.dims) {
        return Status::Corruption(where + ": tensor " + name + " has type " +
                                  std::string(GgmlTypeName(t->type)) + " and " + std::to_string(t->n_elements) +
                                  " elements, expected " + std::string(GgmlTypeName(v.type)) + " and " +
                                  std::to_string(v.bytes / 4));
      }
      NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, g.TensorData(*t, &scratch));
      if (bytes.size() != v.bytes) return Status::Corruption(where + ": tensor " + name + " has the wrong size");
      // An empty field (no report sparsities, say) has no storage: memcpy's pointers must not be null even for 0.
      if (v.bytes > 0) std::memcpy(const_cast<void*>(v.data), bytes.data(), v.bytes);
      data_hash = Xxh64(bytes.data(), bytes.size(), data_hash);
      ++tensors_read;
    }
  }
  if (const GgufTensorInfo* t = g.FindTensor(kSharedLruTensor); t != nullptr) {
    const std::vector<uint64_t> dims = {static_cast<uint64_t>(kSharedCurvePoints)};
    if (t->type != GgmlType::kF32 || t->dims != dims) {
      return Status::Corruption(path + ": tensor " + std::string(kSharedLruTensor) + " has type " +
                                std::string(GgmlTypeName(t->type)) + " and " + std::to_string(t->n_elements) +
                                " elements, expected f32 and " + std::to_string(kSharedCurvePoints));
    }
    NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, g.TensorData(*t, &scratch));
    if (bytes.size() != kSharedCurvePoints * sizeof(float)) {
      return Status::Corruption(path + ": tensor " + std::string(kSharedLruTensor) + " has the wrong size");
    }
    p.lru_hit_rate_shared.resize(kSharedCurvePoints);
    std::memcpy(p.lru_hit_rate_shared.data(), bytes.data(), bytes.size());
    data_hash = Xxh64(bytes.data(), bytes.size(), data_hash);
    ++tensors_read;
  }
  // Every tensor must be one read above: the checksum covers only those, so another one (a newer nflash's field, or
  // a damaged name) would otherwise fail it as a corrupt file without saying which. Which one is looked up only then.
  if (tensors_read != g.tensors().size()) {
    std::unordered_set<std::string> known;
    for (const FfnProfile& f : p.ffns) {
      for (const FieldView& v : Fields(f)) known.insert(TensorName(f, v.name));
    }
    if (!p.lru_hit_rate_shared.empty()) known.insert(kSharedLruTensor);
    for (const GgufTensorInfo& t : g.tensors()) {
      if (known.count(t.name) == 0) {
        return Status::Corruption(path + ": tensor " + t.name + " is not one this nflash reads (a profile written by " +
                                  "a newer nflash, or a damaged name): make it again with this nflash's `nflash " +
                                  "profile`");
      }
    }
  }
  if (data_hash != expected_hash) {
    return Status::Corruption(path + ": profile data checksum mismatch (stored " + HashToHex(expected_hash) +
                              ", computed " + HashToHex(data_hash) + "): the file is corrupt");
  }
  for (size_t i = 0; i < n; ++i) {
    const FfnProfile& f = p.ffns[i];
    for (int32_t partner : f.coact_partner) {
      if (partner < -1 || partner >= f.n_neurons) {
        return Status::Corruption(path + ": ffn " + std::to_string(i) + ": co-activation partner " +
                                  std::to_string(partner) + " out of range [-1, " + std::to_string(f.n_neurons) +
                                  ")");
      }
    }
  }
  return p;
}

Status CheckProfileForModel(const ModelProfile& profile, const std::string& model_hash,
                            const std::string& model_path) {
  if (profile.model_hash == model_hash) return Status::Ok();
  return Status::InvalidArgument("the profile was made from a different model: profile model hash " +
                                 profile.model_hash + ", " + model_path + " has hash " + model_hash +
                                 " (re-run `nflash profile -m " + model_path + "`)");
}

}  // namespace nflash::profiler
