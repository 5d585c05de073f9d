// Hugging Face directory reader: config.json, (sharded) safetensors weights and tokenizer to a SourceModel.
#include "converter/hf_reader.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "converter/hf_tokenizer.h"
#include "converter/readers.h"
#include "converter/rope_rows.h"
#include "converter/safetensors.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"

namespace nflash::converter {
namespace {

using nlohmann::json;

// llama.cpp's token type for vocabulary padding rows ([PAD<i>]) and the score it gives them.
constexpr int32_t kTokenTypeUnused = 5;
constexpr float kPadScore = -1000.0f;
// Missing tensors listed by name in the error before "and N more", to keep the message readable.
constexpr size_t kMaxMissingListed = 8;

// A config.json accessor whose errors name the file and the field. Thread-safety: read-only, as the json it wraps.
class ConfigFields {
 public:
  ConfigFields(const json& doc, const std::string& path) : doc_(doc), path_(path) {}

  bool Has(const char* key) const { return doc_.contains(key) && !doc_[key].is_null(); }

  Result<int64_t> Int(const char* key) const {
    if (!Has(key)) return Status::InvalidArgument(path_ + ": missing required field \"" + key + "\"");
    return IntValue(key);
  }
  Result<int64_t> Int(const char* key, int64_t fallback) const { return Has(key) ? IntValue(key) : fallback; }
  Result<int64_t> PositiveInt(const char* key) const {
    NF_ASSIGN_OR_RETURN(int64_t v, Int(key));
    if (v <= 0) return BadValue(key, "a positive integer");
    return v;
  }
  Result<double> Float(const char* key) const {
    if (!Has(key)) return Status::InvalidArgument(path_ + ": missing required field \"" + key + "\"");
    return FloatValue(key);
  }
  Result<double> Float(const char* key, double fallback) const { return Has(key) ? FloatValue(key) : fallback; }
  Result<bool> Bool(const char* key, bool fallback) const {
    if (!Has(key)) return fallback;
    if (!doc_[key].is_boolean()) return BadValue(key, "a boolean");
    return doc_[key].get<bool>();
  }
  Result<std::string> String(const char* key, const std::string& fallback) const {
    if (!Has(key)) return fallback;
    if (!doc_[key].is_string()) return BadValue(key, "a string");
    return doc_[key].get<std::string>();
  }
  Status BadValue(const std::string& key, const std::string& expected) const {
    return Status::InvalidArgument(path_ + ": field \"" + key + "\": expected " + expected + ", found " +
                                   doc_[key].dump());
  }

 private:
  Result<int64_t> IntValue(const char* key) const {
    const json& v = doc_[key];
    if (v.is_number_integer()) return v.get<int64_t>();
    // Some exporters write integers as 4096.0.
    if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 1e15) {
      return static_cast<int64_t>(v.get<double>());
    }
    return BadValue(key, "an integer");
  }
  Result<double> FloatValue(const char* key) const {
    if (!doc_[key].is_number()) return BadValue(key, "a number");
    return doc_[key].get<double>();
  }
  const json& doc_;
  const std::string& path_;
};

// One source tensor of a shard.
struct ShardTensor {
  std::shared_ptr<const SafetensorsFile> file;
  SafetensorsTensor tensor;
};

// The output tensor and where its data comes from.
struct TensorPlan {
  std::string gguf_name;
  std::vector<uint64_t> dims;         // GGUF dims
  std::vector<std::string> hf_names;  // one, or one per expert (stacked)
  int64_t rope_heads = 0;             // > 0: undo the HF q/k row permutation with this many heads
  // Rows [row_begin, row_begin + rows) of a fused source with source_rows rows (Phi-3's qkv_proj, gate_up_proj);
  // source_rows 0: the whole source.
  uint64_t source_rows = 0, row_begin = 0;
  float scale = 1.0f;                 // every value multiplied by this (LongRoPE's attention factor on q and k)
};

std::vector<uint64_t> Reversed(std::vector<uint64_t> v) { return {v.rbegin(), v.rend()}; }

std::string BaseName(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.find_last_of('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

Result<json> ReadJsonFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  try {
    return json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": JSON does not parse: " + e.what());
  }
}

// name -> tensor over all shards.
Result<std::map<std::string, ShardTensor>> OpenWeights(const std::string& dir) {
  std::map<std::string, ShardTensor> out;
  const std::string single = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  auto add_file = [&](const std::string& path) -> Result<std::shared_ptr<const SafetensorsFile>> {
    NF_ASSIGN_OR_RETURN(SafetensorsFile st, SafetensorsFile::OpenPath(path));
    return std::make_shared<const SafetensorsFile>(std::move(st));
  };
  if (FileExists(single)) {
    NF_ASSIGN_OR_RETURN(auto file, add_file(single));
    for (const SafetensorsTensor& t : file->tensors()) out.emplace(t.name, ShardTensor{file, t});
    return out;
  }
  if (!FileExists(index_path)) {
    if (FileExists(dir + "/pytorch_model.bin") || FileExists(dir + "/pytorch_model.bin.index.json")) {
      return Status::Unsupported(dir + ": PyTorch .bin checkpoints are not supported; save the model as safetensors");
    }
    return Status::NotFound(dir + ": no weights: neither model.safetensors nor model.safetensors.index.json exists");
  }
  NF_ASSIGN_OR_RETURN(json index, ReadJsonFile(index_path));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return Status::Corruption(index_path + ": missing object field \"weight_map\"");
  }
  std::map<std::string, std::shared_ptr<const SafetensorsFile>> shards;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return Status::Corruption(index_path + ": weight_map[\"" + it.key() + "\"]: expected a file name, found " +
                                it.value().dump());
    }
    const std::string shard = it.value().get<std::string>();
    // Shards live beside the index; a path leaving the directory is not a HF layout.
    if (shard.empty() || shard[0] == '/' || shard.find("..") != std::string::npos) {
      return Status::Corruption(index_path + ": weight_map[\"" + it.key() + "\"]: shard \"" + shard +
                                "\" is not a file name inside the model directory");
    }
    auto found = shards.find(shard);
    if (found == shards.end()) {
      const std::string shard_path = dir + "/" + shard;
      if (!FileExists(shard_path)) {
        return Status::NotFound(index_path + ": weight_map[\"" + it.key() + "\"] names shard " + shard_path +
                                ", which does not exist");
      }
      NF_ASSIGN_OR_RETURN(auto file, add_file(shard_path));
      found = shards.emplace(shard, std::move(file)).first;
    }
    const SafetensorsTensor* t = found->second->Find(it.key());
    if (t == nullptr) {
      return Status::Corruption(index_path + ": weight_map[\"" + it.key() + "\"] names shard " + shard +
                                ", which has no such tensor");
    }
    out.emplace(it.key(), ShardTensor{found->second, *t});
  }
  return out;
}

// Builds the list of output tensors for `c` (see hf_reader.h for the mapping).
std::vector<TensorPlan> PlanTensors(const ModelConfig& c) {
  const auto dim = static_cast<uint64_t>(c.dim);
  const auto kv_dim = static_cast<uint64_t>(c.kv_dim()), q_dim = static_cast<uint64_t>(c.q_dim());
  const auto n_ff = static_cast<uint64_t>(c.n_ff);
  const auto n_vocab = static_cast<uint64_t>(c.n_vocab);
  const float qk = c.hf_qk_scale;
  // The llama layout interleaves each q and k head's rows for consecutive-pair RoPE; qwen3 and qwen3moe keep them as
  // stored.
  const bool llama_layout = c.architecture == "llama";
  const int64_t q_heads = llama_layout ? c.n_heads : 0, kv_heads = llama_layout ? c.n_kv_heads : 0;
  const bool qwen3moe = c.architecture == "qwen3moe";
  std::vector<TensorPlan> plan;
  plan.push_back({"token_embd.weight", {dim, n_vocab}, {"model.embed_tokens.weight"}, 0});
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    const std::string gg = "blk." + std::to_string(l) + ".";
    plan.push_back({gg + "attn_norm.weight", {dim}, {hf + "input_layernorm.weight"}, 0});
    if (c.hf_fused_projections) {  // Phi-3: rows q, then k, then v of one matrix
      const std::string qkv = hf + "self_attn.qkv_proj.weight";
      const uint64_t rows = q_dim + 2 * kv_dim;
      plan.push_back({gg + "attn_q.weight", {dim, q_dim}, {qkv}, c.n_heads, rows, 0, qk});
      plan.push_back({gg + "attn_k.weight", {dim, kv_dim}, {qkv}, c.n_kv_heads, rows, q_dim, qk});
      plan.push_back({gg + "attn_v.weight", {dim, kv_dim}, {qkv}, 0, rows, q_dim + kv_dim});
    } else {
      plan.push_back({gg + "attn_q.weight", {dim, q_dim}, {hf + "self_attn.q_proj.weight"}, q_heads, 0, 0, qk});
      plan.push_back({gg + "attn_k.weight", {dim, kv_dim}, {hf + "self_attn.k_proj.weight"}, kv_heads, 0, 0, qk});
      plan.push_back({gg + "attn_v.weight", {dim, kv_dim}, {hf + "self_attn.v_proj.weight"}, 0});
    }
    if (c.qk_norms()) {  // per-head norms over head_dim elements, in the rows' own (rotate-half) order
      const auto hd = static_cast<uint64_t>(c.head_dim());
      plan.push_back({gg + "attn_q_norm.weight", {hd}, {hf + "self_attn.q_norm.weight"}, 0});
      plan.push_back({gg + "attn_k_norm.weight", {hd}, {hf + "self_attn.k_norm.weight"}, 0});
    }
    plan.push_back({gg + "attn_output.weight", {q_dim, dim}, {hf + "self_attn.o_proj.weight"}, 0});
    if (c.attention_bias) {  // q and k biases are permuted (and scaled) like their rows
      plan.push_back({gg + "attn_q.bias", {q_dim}, {hf + "self_attn.q_proj.bias"}, c.n_heads, 0, 0, qk});
      plan.push_back({gg + "attn_k.bias", {kv_dim}, {hf + "self_attn.k_proj.bias"}, c.n_kv_heads, 0, 0, qk});
      plan.push_back({gg + "attn_v.bias", {kv_dim}, {hf + "self_attn.v_proj.bias"}, 0});
    }
    plan.push_back({gg + "ffn_norm.weight", {dim}, {hf + "post_attention_layernorm.weight"}, 0});
    // FFN order gate, down, up: the order the llama2.c reader uses, so the same model gives the same file layout.
    if (c.n_experts == 0 && c.hf_fused_projections) {  // Phi-3: rows gate, then up
      const std::string gate_up = hf + "mlp.gate_up_proj.weight";
      plan.push_back({gg + "ffn_gate.weight", {dim, n_ff}, {gate_up}, 0, 2 * n_ff, 0});
      plan.push_back({gg + "ffn_down.weight", {n_ff, dim}, {hf + "mlp.down_proj.weight"}, 0});
      plan.push_back({gg + "ffn_up.weight", {dim, n_ff}, {gate_up}, 0, 2 * n_ff, n_ff});
      continue;
    }
    if (c.n_experts == 0) {
      plan.push_back({gg + "ffn_gate.weight", {dim, n_ff}, {hf + "mlp.gate_proj.weight"}, 0});
      plan.push_back({gg + "ffn_down.weight", {n_ff, dim}, {hf + "mlp.down_proj.weight"}, 0});
      plan.push_back({gg + "ffn_up.weight", {dim, n_ff}, {hf + "mlp.up_proj.weight"}, 0});
      continue;
    }
    // Mixtral: block_sparse_moe.gate and experts.E.w1 (gate), w2 (down), w3 (up); Qwen3-MoE: mlp.gate and
    // experts.E.gate_proj, down_proj, up_proj.
    const std::string moe = hf + (qwen3moe ? "mlp." : "block_sparse_moe.");
    const auto n_exp = static_cast<uint64_t>(c.n_experts);
    plan.push_back({gg + "ffn_gate_inp.weight", {dim, n_exp}, {moe + "gate.weight"}, 0});
    for (const auto& [gguf_part, hf_part, dims] :
         {std::tuple<const char*, const char*, std::vector<uint64_t>>{
              "ffn_gate_exps", qwen3moe ? "gate_proj" : "w1", {dim, n_ff, n_exp}},
          {"ffn_down_exps", qwen3moe ? "down_proj" : "w2", {n_ff, dim, n_exp}},
          {"ffn_up_exps", qwen3moe ? "up_proj" : "w3", {dim, n_ff, n_exp}}}) {
      TensorPlan p{gg + gguf_part + ".weight", dims, {}, 0};
      for (int64_t e = 0; e < c.n_experts; ++e) {
        p.hf_names.push_back(moe + "experts." + std::to_string(e) + "." + hf_part + ".weight");
      }
      plan.push_back(std::move(p));
    }
  }
  plan.push_back({"output_norm.weight", {dim}, {"model.norm.weight"}, 0});
  if (!c.tied_embeddings) plan.push_back({"output.weight", {dim, n_vocab}, {"lm_head.weight"}, 0});
  return plan;
}

// Rows [begin, begin + count) of the row-major tensor `t`: the same bytes of the file, a narrower window of them, so
// that each part of a fused source reads only its own rows.
SafetensorsTensor RowWindow(const SafetensorsTensor& t, uint64_t begin, uint64_t count) {
  SafetensorsTensor w = t;
  const uint64_t row_elements = t.n_elements / t.shape[0];
  const uint64_t row_bytes = row_elements * SafetensorsDtypeSize(t.dtype);
  w.shape[0] = count;
  w.offset += begin * row_bytes;
  w.n_elements = count * row_elements;
  w.n_bytes = count * row_bytes;
  return w;
}

// The loader of one planned tensor: reads each source (in F32), scales, undoes the RoPE permutation, stacks experts.
std::function<Result<std::vector<float>>()> MakeLoader(std::vector<ShardTensor> sources, int64_t rope_heads,
                                                       float scale) {
  return [sources = std::move(sources), rope_heads, scale]() -> Result<std::vector<float>> {
    if (sources.size() == 1) {
      const ShardTensor& s = sources[0];
      NF_ASSIGN_OR_RETURN(std::vector<float> data, s.file->ReadF32(s.tensor));
      if (scale != 1.0f) {
        for (float& v : data) v *= scale;
      }
      if (rope_heads > 0) {
        const auto rows = static_cast<int64_t>(s.tensor.shape[0]);
        const auto cols = s.tensor.shape.size() > 1 ? static_cast<int64_t>(s.tensor.shape[1]) : 1;  // a bias: 1-D
        return InterleaveRopeRows<float>(data, rope_heads, rows, static_cast<size_t>(cols));
      }
      return data;
    }
    std::vector<float> out;
    for (const ShardTensor& s : sources) {
      NF_ASSIGN_OR_RETURN(std::vector<float> part, s.file->ReadF32(s.tensor));
      if (out.empty()) out.reserve(part.size() * sources.size());
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  };
}

// The llama3 rope_scaling's factors (ModelConfig::rope_freq_factors) for `head_dim` / 2 rotary pairs.
Result<std::vector<float>> Llama3RopeFactors(const json& rs, double theta, int64_t head_dim, const std::string& path) {
  auto number = [&](const char* key, double* out) -> Status {
    if (!rs.contains(key) || !rs[key].is_number() || !(rs[key].get<double>() > 0)) {
      return Status::InvalidArgument(path + ": field \"rope_scaling\": \"" + key +
                                     "\" must be a positive number for type \"llama3\"");
    }
    *out = rs[key].get<double>();
    return Status::Ok();
  };
  double factor = 0, low = 0, high = 0, original = 0;
  NF_RETURN_IF_ERROR(number("factor", &factor));
  NF_RETURN_IF_ERROR(number("low_freq_factor", &low));
  NF_RETURN_IF_ERROR(number("high_freq_factor", &high));
  NF_RETURN_IF_ERROR(number("original_max_position_embeddings", &original));
  if (!(high > low)) {
    return Status::InvalidArgument(path + ": field \"rope_scaling\": high_freq_factor " + std::to_string(high) +
                                   " must exceed low_freq_factor " + std::to_string(low));
  }
  // As Meta's reference and llama.cpp's converter: wavelengths shorter than original / high keep their frequency,
  // those longer than original / low are slowed by `factor`, and the band between is interpolated smoothly.
  const double low_wavelen = original / low, high_wavelen = original / high;
  std::vector<float> factors(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < factors.size(); ++i) {
    const double freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    const double wavelen = 2.0 * M_PI / freq;
    double f = 1.0;
    if (wavelen > low_wavelen) {
      f = factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (original / wavelen - low) / (high - low);
      f = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    factors[i] = static_cast<float>(f);
  }
  return factors;
}

// LongRoPE (Phi-3's rope_scaling type "longrope", once "su"), as transformers computes it: rotary pair i's frequency
// divided by short_factor[i] while the sequence stays within original_max_position_embeddings (long_factor past it),
// and cos, sin multiplied by an attention factor: rope_scaling's "attention_factor", or sqrt(1 + ln s / ln original)
// with s = max_position_embeddings / original (1 when s <= 1). One GGUF holds one set of factors, so this writes the
// short ones (rope_freqs.weight), folds the attention factor into the q and k weights, and caps the context length
// at original_max_position_embeddings, where they hold.
Status LongRopeScaling(const json& doc, ModelConfig* c, const std::string& path) {
  const json& rs = doc["rope_scaling"];
  const std::string field = path + ": field \"rope_scaling\": ";
  double original = 0;
  for (const json* where : {&doc, &rs}) {
    if (where->contains("original_max_position_embeddings") && !(*where)["original_max_position_embeddings"].is_null()) {
      const json& v = (*where)["original_max_position_embeddings"];
      if (!v.is_number() || !(v.get<double>() >= 2)) {  // its logarithm divides
        return Status::InvalidArgument(path + ": field \"original_max_position_embeddings\": expected a number of "
                                       "positions >= 2, found " + v.dump());
      }
      original = v.get<double>();
      break;
    }
  }
  if (original == 0) {
    return Status::InvalidArgument(path + ": missing required field \"original_max_position_embeddings\" (for "
                                   "rope_scaling type \"longrope\")");
  }
  const size_t pairs = static_cast<size_t>(c->head_dim() / 2);
  std::vector<float> factors[2];
  const char* names[2] = {"short_factor", "long_factor"};
  for (int k = 0; k < 2; ++k) {
    if (!rs.contains(names[k]) || !rs[names[k]].is_array() || rs[names[k]].size() != pairs) {
      return Status::InvalidArgument(field + "\"" + names[k] + "\" must be a list of head_dim / 2 = " +
                                     std::to_string(pairs) + " numbers for type \"longrope\"" +
                                     (rs.contains(names[k]) ? ", found " + rs[names[k]].dump() : ", found none"));
    }
    for (const json& v : rs[names[k]]) {
      if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>())) {
        return Status::InvalidArgument(field + "\"" + names[k] + "\" holds " + v.dump() +
                                       ", expected positive numbers");
      }
      factors[k].push_back(static_cast<float>(v.get<double>()));
    }
  }
  double attention = 1.0;
  if (rs.contains("attention_factor") && !rs["attention_factor"].is_null()) {
    if (!rs["attention_factor"].is_number() || !(rs["attention_factor"].get<double>() > 0)) {
      return Status::InvalidArgument(field + "\"attention_factor\" must be a positive number, found " +
                                     rs["attention_factor"].dump());
    }
    attention = rs["attention_factor"].get<double>();
  } else if (const double scale = static_cast<double>(c->context_length) / original; scale > 1) {
    attention = std::sqrt(1.0 + std::log(scale) / std::log(original));
  }
  c->rope_freq_factors = std::move(factors[0]);
  c->hf_qk_scale = static_cast<float>(attention);
  if (c->context_length > static_cast<int64_t>(original)) {
    NF_LOG(Info) << path << ": longrope: writing the short factors, valid up to original_max_position_embeddings "
                 << static_cast<int64_t>(original) << "; the context length is capped there (from "
                 << c->context_length << ")";
    c->context_length = static_cast<int64_t>(original);
  }
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ParseHfConfig(std::string_view text, const std::string& path) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": JSON does not parse: " + e.what());
  }
  if (!doc.is_object()) return Status::Corruption(path + ": expected a JSON object");
  try {
    ConfigFields f(doc, path);
    ModelConfig c;
    if (!f.Has("architectures")) return Status::InvalidArgument(path + ": missing required field \"architectures\"");
    if (!doc["architectures"].is_array() || doc["architectures"].empty() || !doc["architectures"][0].is_string()) {
      return f.BadValue("architectures", "a non-empty array of strings");
    }
    const std::string arch = doc["architectures"][0].get<std::string>();
    const bool mixtral = arch == "MixtralForCausalLM" || arch == "TurboSparseMixtralForCausalLM";
    const bool qwen2 = arch == "Qwen2ForCausalLM";
    const bool phi3 = arch == "Phi3ForCausalLM";
    const bool mistral = arch == "MistralForCausalLM";
    const bool qwen3moe = arch == "Qwen3MoeForCausalLM";
    const bool qwen3 = arch == "Qwen3ForCausalLM" || qwen3moe;  // Qwen3-MoE: Qwen3's attention, MoE FFNs
    if (!mixtral && !qwen2 && !qwen3 && !phi3 && !mistral && arch != "LlamaForCausalLM") {
      return Status::Unsupported(path + ": architectures[0] \"" + arch +
                                 "\" is not supported (expected LlamaForCausalLM, MistralForCausalLM, "
                                 "MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM or "
                                 "Phi3ForCausalLM)");
    }
    // Phi-3 is Llama with fused projections (split by the reader) and, in its long-context versions, LongRoPE.
    c.hf_fused_projections = phi3;
    if (f.Has("partial_rotary_factor")) {
      NF_ASSIGN_OR_RETURN(double partial, f.Float("partial_rotary_factor"));
      if (partial != 1.0) {
        return Status::Unsupported(path + ": field \"partial_rotary_factor\" is " + doc["partial_rotary_factor"].dump() +
                                   ": partial rotary embeddings are not supported (expected 1)");
      }
    }
    // Mistral's and Phi-3's sliding window (Mixtral's configs carry one too); Qwen2 says whether it is used. null:
    // none; absent: transformers' default (4096 for Mistral, none for the others).
    if (mistral && !doc.contains("sliding_window")) c.sliding_window = 4096;
    if ((mistral || phi3 || mixtral) && f.Has("sliding_window")) {
      NF_ASSIGN_OR_RETURN(c.sliding_window, f.Int("sliding_window"));
      if (c.sliding_window <= 0 || c.sliding_window > UINT32_MAX) {
        return f.BadValue("sliding_window", "null or a positive number of positions below 2^32");
      }
    }
    // Qwen2 is Llama with biases on q, k and v (and its own tokenizer); its sliding window, when used, is not.
    // transformers gives Qwen2 those biases whatever attention_bias says, and Mistral, Mixtral and Phi-3 none; Llama's
    // attention_bias would bias o_proj too, which the llama layout here has no tensor for.
    c.attention_bias = qwen2;
    NF_ASSIGN_OR_RETURN(bool llama_bias, f.Bool("attention_bias", false));
    if (llama_bias && (arch == "LlamaForCausalLM" || qwen3)) {
      return Status::Unsupported(path + ": field \"attention_bias\" is true: " + (qwen3 ? "Qwen3" : "Llama") +
                                 "'s attention biases include o_proj's, which are not supported");
    }
    NF_ASSIGN_OR_RETURN(bool mlp_bias, f.Bool("mlp_bias", false));
    if (mlp_bias) return Status::Unsupported(path + ": field \"mlp_bias\" is true: FFN biases are not supported");
    NF_ASSIGN_OR_RETURN(bool sliding, f.Bool("use_sliding_window", false));
    if (sliding) {
      return Status::Unsupported(path + ": field \"use_sliding_window\" is true: sliding-window attention is not "
                                 "supported");
    }
    // Qwen3 (Qwen2 without biases, with per-head q/k RMSNorm before RoPE) is written as llama.cpp's qwen3
    // architecture: the llama one has no place for the q/k norms.
    c.architecture = qwen3moe ? "qwen3moe" : qwen3 ? "qwen3" : "llama";
    NF_ASSIGN_OR_RETURN(c.dim, f.PositiveInt("hidden_size"));
    // Qwen3-MoE's experts have their own size (intermediate_size is a dense FFN's, which its layers do not have).
    NF_ASSIGN_OR_RETURN(c.n_ff, f.PositiveInt(qwen3moe ? "moe_intermediate_size" : "intermediate_size"));
    NF_ASSIGN_OR_RETURN(c.n_layers, f.PositiveInt("num_hidden_layers"));
    NF_ASSIGN_OR_RETURN(c.n_heads, f.PositiveInt("num_attention_heads"));
    NF_ASSIGN_OR_RETURN(c.n_kv_heads, f.Int("num_key_value_heads", c.n_heads));
    NF_ASSIGN_OR_RETURN(c.context_length, f.PositiveInt("max_position_embeddings"));
    NF_ASSIGN_OR_RETURN(c.n_vocab, f.PositiveInt("vocab_size"));
    NF_ASSIGN_OR_RETURN(double eps, f.Float("rms_norm_eps"));
    NF_ASSIGN_OR_RETURN(double theta, f.Float("rope_theta", 10000.0));
    NF_ASSIGN_OR_RETURN(c.tied_embeddings, f.Bool("tie_word_embeddings", false));
    if (!(eps > 0)) return f.BadValue("rms_norm_eps", "a positive number");
    if (!(theta > 0)) return f.BadValue("rope_theta", "a positive number");
    c.norm_eps = static_cast<float>(eps);
    c.rope_theta = static_cast<float>(theta);

    if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0) {
      return f.BadValue("num_key_value_heads", "a positive divisor of num_attention_heads (" +
                                                   std::to_string(c.n_heads) + ")");
    }
    // head_dim (transformers' getattr(config, "head_dim", hidden_size // num_attention_heads)) may differ from
    // hidden_size / num_attention_heads (Mistral Nemo: 128, not 160): llama.attention.key_length.
    // Qwen3Config's default is 128 whatever the hidden size.
    if (f.Has("head_dim") || qwen3) {
      NF_ASSIGN_OR_RETURN(int64_t head_dim, f.Int("head_dim", qwen3 ? 128 : 0));
      if (head_dim <= 0 || head_dim % 2 != 0) return f.BadValue("head_dim", "a positive even number (RoPE rotates pairs)");
      if (head_dim * c.n_heads != c.dim) c.key_length = head_dim;
    }
    if (c.key_length == 0 && (c.dim % c.n_heads != 0 || (c.dim / c.n_heads) % 2 != 0)) {
      return Status::InvalidArgument(path + ": hidden_size " + std::to_string(c.dim) + " / num_attention_heads " +
                                     std::to_string(c.n_heads) + " must be an even integer head size for RoPE");
    }

    if (f.Has("rope_scaling")) {
      const json& rs = doc["rope_scaling"];
      if (!rs.is_object()) return f.BadValue("rope_scaling", "null or an object");
      std::string type;
      if (rs.contains("type") && rs["type"].is_string()) type = rs["type"].get<std::string>();
      if (rs.contains("rope_type") && rs["rope_type"].is_string()) type = rs["rope_type"].get<std::string>();
      if (type == "linear") {
        if (!rs.contains("factor") || !rs["factor"].is_number() || !(rs["factor"].get<double>() > 0)) {
          return f.BadValue("rope_scaling", "a positive \"factor\" for linear scaling");
        }
        c.rope_scale_linear = static_cast<float>(rs["factor"].get<double>());
      } else if (type == "llama3") {
        NF_ASSIGN_OR_RETURN(c.rope_freq_factors, Llama3RopeFactors(rs, c.rope_theta, c.head_dim(), path));
      } else if (type == "longrope" || type == "su") {
        NF_RETURN_IF_ERROR(LongRopeScaling(doc, &c, path));
      } else if (type != "default") {
        return Status::Unsupported(path + ": field \"rope_scaling\": type \"" + type +
                                   "\" is not supported (only \"linear\", \"llama3\" and \"longrope\")");
      }
    }

    NF_ASSIGN_OR_RETURN(std::string act, f.String("hidden_act", "silu"));
    if (act == "silu" || act == "swish") {
      c.activation = FfnActivation::kSilu;
    } else if (act == "relu") {
      c.activation = FfnActivation::kRelu;
    } else {
      return Status::Unsupported(path + ": field \"hidden_act\": \"" + act +
                                 "\" is not supported (expected \"silu\" or \"relu\")");
    }
    if (arch == "TurboSparseMixtralForCausalLM") c.activation = FfnActivation::kDRelu;
    if (f.Has("nflash_ffn_activation")) {
      NF_ASSIGN_OR_RETURN(std::string override_act, f.String("nflash_ffn_activation", ""));
      std::optional<FfnActivation> a = ParseFfnActivation(override_act);
      if (!a) return f.BadValue("nflash_ffn_activation", "\"silu\", \"relu\" or \"drelu\"");
      c.activation = *a;
    }

    if (mixtral || qwen3moe) {
      const char* const count = qwen3moe ? "num_experts" : "num_local_experts";
      NF_ASSIGN_OR_RETURN(c.n_experts, f.PositiveInt(count));
      NF_ASSIGN_OR_RETURN(c.n_experts_used, f.PositiveInt("num_experts_per_tok"));
      if (c.n_experts_used > c.n_experts) {
        return f.BadValue("num_experts_per_tok", std::string("at most ") + count + " (" +
                                                     std::to_string(c.n_experts) + ")");
      }
    }
    if (qwen3moe) {
      // The runtime (as llama.cpp's qwen3moe) weighs the chosen experts by a softmax over their logits alone, which
      // is transformers' softmax over all renormalised over the top k; and every layer is MoE.
      NF_ASSIGN_OR_RETURN(bool norm_topk, f.Bool("norm_topk_prob", false));
      if (!norm_topk) {
        return Status::Unsupported(path + ": field \"norm_topk_prob\" is " +
                                   (f.Has("norm_topk_prob") ? "false" : "absent (transformers' default: false)") +
                                   ": only true is supported (the chosen experts' weights renormalised, as llama.cpp "
                                   "computes them)");
      }
      NF_ASSIGN_OR_RETURN(int64_t step, f.Int("decoder_sparse_step", 1));
      if (step != 1) return f.BadValue("decoder_sparse_step", "1 (every layer MoE)");
      if (f.Has("mlp_only_layers") && !(doc["mlp_only_layers"].is_array() && doc["mlp_only_layers"].empty())) {
        return f.BadValue("mlp_only_layers", "[] (every layer MoE)");
      }
    }
    return c;
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": unexpected JSON structure: " + e.what());
  }
}

Result<SourceModel> ReadHfDirectory(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  if (!FileExists(config_path)) return Status::NotFound(config_path + ": no such file (not a HF model directory?)");
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> config_bytes, ReadWholeFile(config_path));
  SourceModel model;
  model.source_path = dir;
  model.source_format = "hf-safetensors";
  NF_ASSIGN_OR_RETURN(model.config,
                      ParseHfConfig(std::string_view(reinterpret_cast<const char*>(config_bytes.data()),
                                                     config_bytes.size()),
                                    config_path));
  ModelConfig& c = model.config;
  c.name = BaseName(dir);

  NF_ASSIGN_OR_RETURN(model.tokenizer, ReadHfTokenizer(dir));
  TokenizerData& tok = model.tokenizer;
  if (static_cast<int64_t>(tok.tokens.size()) > c.n_vocab) {
    return Status::InvalidArgument(dir + ": the tokenizer has " + std::to_string(tok.tokens.size()) +
                                   " tokens, more than config.json vocab_size " + std::to_string(c.n_vocab));
  }
  // Embedding rows beyond the tokenizer are padding (as llama.cpp writes them).
  if (static_cast<int64_t>(tok.tokens.size()) < c.n_vocab) {
    NF_LOG(Info) << dir << ": padding the vocabulary from " << tok.tokens.size() << " to " << c.n_vocab
                 << " tokens with [PAD<id>]";
    for (auto i = static_cast<int64_t>(tok.tokens.size()); i < c.n_vocab; ++i) {
      tok.tokens.push_back("[PAD" + std::to_string(i) + "]");
      if (!tok.scores.empty()) tok.scores.push_back(kPadScore);
      tok.token_types.push_back(kTokenTypeUnused);
    }
  }

  NF_ASSIGN_OR_RETURN(auto weights, OpenWeights(dir));
  std::set<std::string> used;
  if (c.tied_embeddings && weights.count("lm_head.weight")) {
    NF_LOG(Debug) << dir << ": tie_word_embeddings is true; lm_head.weight is ignored";
    used.insert("lm_head.weight");
  }
  std::vector<std::string> missing;
  for (TensorPlan& p : PlanTensors(c)) {
    std::vector<ShardTensor> sources;
    // The shape each HF source must have: the reverse of the GGUF dims (per expert for stacked tensors).
    std::vector<uint64_t> gguf_part = p.dims;
    if (p.hf_names.size() > 1) gguf_part.pop_back();
    if (p.source_rows > 0) gguf_part.back() = p.source_rows;  // the fused source holds this tensor's rows and others'
    const std::vector<uint64_t> want = Reversed(gguf_part);
    std::optional<SafetensorsDtype> dtype;
    for (const std::string& name : p.hf_names) {
      auto it = weights.find(name);
      if (it == weights.end()) {
        missing.push_back(name);
        continue;
      }
      used.insert(name);
      const SafetensorsTensor& t = it->second.tensor;
      if (t.shape != want) {
        return Status::InvalidArgument(it->second.file->path() + ": tensor \"" + name + "\" has shape " +
                                       ShapeToString(t.shape) + ", expected " + ShapeToString(want) +
                                       " from config.json");
      }
      if (!dtype) dtype = t.dtype;
      sources.push_back(it->second);
    }
    if (sources.size() != p.hf_names.size()) {
      if (p.source_rows > 0 && p.row_begin > 0) missing.pop_back();  // a fused source: named once, by its first part
      continue;
    }
    if (p.source_rows > 0) sources[0].tensor = RowWindow(sources[0].tensor, p.row_begin, p.dims.back());
    SourceTensor st;
    st.name = p.gguf_name;
    st.dims = p.dims;
    // Mixed dtypes across experts are read fine (everything goes through F32); the first one is reported.
    st.source_type = SafetensorsDtypeToGgml(*dtype);
    st.load_f32 = MakeLoader(std::move(sources), p.rope_heads, p.scale);
    model.tensors.push_back(std::move(st));
  }
  if (!c.rope_freq_factors.empty()) {
    SourceTensor st;
    st.name = "rope_freqs.weight";
    st.dims = {static_cast<uint64_t>(c.rope_freq_factors.size())};
    st.source_type = GgmlType::kF32;
    st.load_f32 = [factors = c.rope_freq_factors]() -> Result<std::vector<float>> { return factors; };
    model.tensors.push_back(std::move(st));
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < kMaxMissingListed; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > kMaxMissingListed) list += " and " + std::to_string(missing.size() - kMaxMissingListed) + " more";
    return Status::NotFound(dir + ": " + std::to_string(missing.size()) + " required tensor(s) missing: " + list);
  }
  for (const auto& [name, t] : weights) {
    if (!used.count(name)) {
      NF_LOG(Debug) << t.file->path() << ": skipping tensor \"" << name << "\" (not used)";
    }
  }
  return model;
}

}  // namespace nflash::converter
