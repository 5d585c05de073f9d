// Reads a llama-architecture GGUF model (llama.cpp, PowerInfer or nflash output) into a SourceModel for re-quantizing.
#include <memory>
#include <string>

#include "converter/readers.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"

namespace nflash::converter {
namespace {

// Key prefixes copied through unchanged: PowerInfer's settings (e.g. powerinfer.sparse_threshold) and nflash's own.
constexpr std::string_view kPassThroughPrefixes[] = {"powerinfer.", "nflash."};
// Written by the writer from ModelConfig::activation, so not copied as an extra key.
constexpr std::string_view kActivationKey = "nflash.ffn_activation";

bool IsConvertibleType(GgmlType t) {
  return t == GgmlType::kF32 || t == GgmlType::kF16 || t == GgmlType::kBF16 || t == GgmlType::kQ8_0 ||
         t == GgmlType::kQ4_0;
}

// An optional integer key: absent => `fallback`; present with a bad type => error.
Result<int64_t> OptionalInt(const GgufFile& f, const std::string& key, int64_t fallback) {
  if (f.Find(key) == nullptr) return fallback;
  return f.GetInt(key);
}
Result<double> OptionalFloat(const GgufFile& f, const std::string& key, double fallback) {
  if (f.Find(key) == nullptr) return fallback;
  return f.GetFloat(key);
}

Result<int64_t> RequiredPositive(const GgufFile& f, const std::string& key) {
  NF_ASSIGN_OR_RETURN(int64_t v, f.GetInt(key));
  if (v <= 0) {
    return Status::Corruption(f.path() + ": " + key + " is " + std::to_string(v) + ", expected a positive value");
  }
  return v;
}

Result<std::vector<std::string>> StringArray(const GgufFile& f, const std::string& key) {
  NF_ASSIGN_OR_RETURN(const GgufArray* arr, f.GetArray(key));
  std::vector<std::string> out;
  out.reserve(arr->items.size());
  for (size_t i = 0; i < arr->items.size(); ++i) {
    const auto* s = std::get_if<std::string>(&arr->items[i].v);
    if (s == nullptr) {
      return Status::Corruption(f.path() + ": " + key + "[" + std::to_string(i) + "] has type " +
                                std::string(GgufTypeName(arr->items[i].type())) + ", expected string");
    }
    out.push_back(*s);
  }
  return out;
}

// A numeric array element as double (scores are float32, token types int32; other numeric types are accepted).
Result<double> NumberAt(const GgufFile& f, const std::string& key, const GgufValue& v, size_t i) {
  return std::visit(
      [&](const auto& x) -> Result<double> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
          return static_cast<double>(x);
        } else {
          return Status::Corruption(f.path() + ": " + key + "[" + std::to_string(i) + "] has type " +
                                    std::string(GgufTypeName(v.type())) + ", expected a number");
        }
      },
      v.v);
}

Status ReadTokenizer(const GgufFile& f, TokenizerData* tok) {
  if (f.Find("tokenizer.ggml.model") == nullptr) return Status::Ok();  // a weights-only file
  NF_ASSIGN_OR_RETURN(tok->model, f.GetString("tokenizer.ggml.model"));
  if (f.Find("tokenizer.ggml.pre") != nullptr) {
    NF_ASSIGN_OR_RETURN(tok->pre, f.GetString("tokenizer.ggml.pre"));
  }
  NF_ASSIGN_OR_RETURN(tok->tokens, StringArray(f, "tokenizer.ggml.tokens"));
  if (f.Find("tokenizer.ggml.scores") != nullptr) {
    NF_ASSIGN_OR_RETURN(const GgufArray* arr, f.GetArray("tokenizer.ggml.scores"));
    for (size_t i = 0; i < arr->items.size(); ++i) {
      NF_ASSIGN_OR_RETURN(double v, NumberAt(f, "tokenizer.ggml.scores", arr->items[i], i));
      tok->scores.push_back(static_cast<float>(v));
    }
  }
  if (f.Find("tokenizer.ggml.token_type") != nullptr) {
    NF_ASSIGN_OR_RETURN(const GgufArray* arr, f.GetArray("tokenizer.ggml.token_type"));
    for (size_t i = 0; i < arr->items.size(); ++i) {
      NF_ASSIGN_OR_RETURN(double v, NumberAt(f, "tokenizer.ggml.token_type", arr->items[i], i));
      tok->token_types.push_back(static_cast<int32_t>(v));
    }
  }
  if (f.Find("tokenizer.ggml.merges") != nullptr) {
    NF_ASSIGN_OR_RETURN(tok->merges, StringArray(f, "tokenizer.ggml.merges"));
  }
  const size_t n = tok->tokens.size();
  if (!tok->scores.empty() && tok->scores.size() != n) {
    return Status::Corruption(f.path() + ": tokenizer.ggml.scores has " + std::to_string(tok->scores.size()) +
                              " entries, expected " + std::to_string(n) + " (one per token)");
  }
  if (!tok->token_types.empty() && tok->token_types.size() != n) {
    return Status::Corruption(f.path() + ": tokenizer.ggml.token_type has " +
                              std::to_string(tok->token_types.size()) + " entries, expected " + std::to_string(n));
  }
  struct IdKey {
    const char* key;
    int32_t* dst;
  };
  for (const IdKey& k : {IdKey{"tokenizer.ggml.bos_token_id", &tok->bos_id},
                         IdKey{"tokenizer.ggml.eos_token_id", &tok->eos_id},
                         IdKey{"tokenizer.ggml.unknown_token_id", &tok->unk_id},
                         IdKey{"tokenizer.ggml.padding_token_id", &tok->pad_id}}) {
    if (f.Find(k.key) == nullptr) continue;
    NF_ASSIGN_OR_RETURN(int64_t id, f.GetInt(k.key));
    // llama.cpp writes "none" as u32 0xFFFFFFFF; any id outside the vocabulary means none.
    *k.dst = id >= 0 && id < static_cast<int64_t>(n) ? static_cast<int32_t>(id) : -1;
  }
  if (f.Find("tokenizer.ggml.add_bos_token") != nullptr) {
    NF_ASSIGN_OR_RETURN(bool b, f.GetBool("tokenizer.ggml.add_bos_token"));
    tok->add_bos = b;
  }
  if (f.Find("tokenizer.ggml.add_eos_token") != nullptr) {
    NF_ASSIGN_OR_RETURN(bool b, f.GetBool("tokenizer.ggml.add_eos_token"));
    tok->add_eos = b;
  }
  if (f.Find("tokenizer.chat_template") != nullptr) {
    NF_ASSIGN_OR_RETURN(tok->chat_template, f.GetString("tokenizer.chat_template"));
  }
  return Status::Ok();
}

Result<std::vector<float>> LoadF32(const GgufFile& f, const GgufTensorInfo& info) {
  std::vector<uint8_t> scratch;
  NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f.TensorData(info, &scratch));
  std::vector<float> out(info.n_elements);
  const uint64_t row = info.dims.empty() ? 1 : info.dims[0];
  const auto row_bytes = RowBytes(info.type, row);
  if (!row_bytes || row == 0) {
    return Status::Corruption(f.path() + ": tensor " + info.name + " has row length " + std::to_string(row) +
                              ", not a whole number of " + std::string(GgmlTypeName(info.type)) + " blocks");
  }
  const uint64_t rows = info.n_elements / row;
  for (uint64_t r = 0; r < rows; ++r) {
    Status s = DequantizeRow(info.type, bytes.data() + r * *row_bytes, out.data() + r * row, static_cast<int64_t>(row));
    if (!s.ok()) return s.WithContext(f.path() + ": tensor " + info.name + " row " + std::to_string(r));
  }
  return out;
}

}  // namespace

Result<SourceModel> ReadGgufModel(const std::string& path) {
  NF_ASSIGN_OR_RETURN(GgufFile opened, GgufFile::OpenPath(path));
  auto f = std::make_shared<const GgufFile>(std::move(opened));

  SourceModel model;
  model.source_path = path;
  model.source_format = "gguf";
  ModelConfig& c = model.config;
  NF_ASSIGN_OR_RETURN(c.architecture, f->GetString("general.architecture"));
  if (c.architecture != "llama") {
    return Status::Unsupported(path + ": general.architecture is \"" + c.architecture +
                               "\"; nflash converts only \"llama\" GGUF models");
  }
  if (f->Find("general.name") != nullptr) {
    NF_ASSIGN_OR_RETURN(c.name, f->GetString("general.name"));
  }
  NF_ASSIGN_OR_RETURN(c.dim, RequiredPositive(*f, "llama.embedding_length"));
  NF_ASSIGN_OR_RETURN(c.n_layers, RequiredPositive(*f, "llama.block_count"));
  NF_ASSIGN_OR_RETURN(c.n_ff, RequiredPositive(*f, "llama.feed_forward_length"));
  NF_ASSIGN_OR_RETURN(c.n_heads, RequiredPositive(*f, "llama.attention.head_count"));
  NF_ASSIGN_OR_RETURN(c.n_kv_heads, OptionalInt(*f, "llama.attention.head_count_kv", c.n_heads));
  NF_ASSIGN_OR_RETURN(c.context_length, OptionalInt(*f, "llama.context_length", 0));
  // Defaults as llama.cpp's: RoPE base 10000, RMSNorm eps 1e-5.
  NF_ASSIGN_OR_RETURN(double theta, OptionalFloat(*f, "llama.rope.freq_base", 10000.0));
  NF_ASSIGN_OR_RETURN(double eps, OptionalFloat(*f, "llama.attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_theta = static_cast<float>(theta);
  c.norm_eps = static_cast<float>(eps);
  if (f->Find("llama.rope.scaling.type") != nullptr) {
    NF_ASSIGN_OR_RETURN(std::string type, f->GetString("llama.rope.scaling.type"));
    if (type == "linear") {
      NF_ASSIGN_OR_RETURN(double factor, f->GetFloat("llama.rope.scaling.factor"));
      c.rope_scale_linear = static_cast<float>(factor);
    } else if (type != "none") {
      return Status::Unsupported(path + ": llama.rope.scaling.type \"" + type + "\" (only linear is supported)");
    }
  }
  NF_ASSIGN_OR_RETURN(c.sliding_window, OptionalInt(*f, "llama.attention.sliding_window", 0));
  if (c.sliding_window < 0 || c.sliding_window > UINT32_MAX) {
    return Status::Corruption(path + ": llama.attention.sliding_window is " + std::to_string(c.sliding_window) +
                              ", expected 0 (none) or a window of positions below 2^32");
  }
  NF_ASSIGN_OR_RETURN(c.n_experts, OptionalInt(*f, "llama.expert_count", 0));
  NF_ASSIGN_OR_RETURN(c.n_experts_used, OptionalInt(*f, "llama.expert_used_count", 0));
  if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0 || c.dim % c.n_heads != 0) {
    return Status::Corruption(path + ": inconsistent attention shape: embedding_length " + std::to_string(c.dim) +
                              ", head_count " + std::to_string(c.n_heads) + ", head_count_kv " +
                              std::to_string(c.n_kv_heads));
  }

  NF_RETURN_IF_ERROR(ReadTokenizer(*f, &model.tokenizer));

  bool has_predictors = false;
  for (const GgufTensorInfo& info : f->tensors()) {
    if (!IsConvertibleType(info.type)) {
      return Status::Unsupported(path + ": tensor " + info.name + " has type " +
                                 std::string(GgmlTypeName(info.type)) +
                                 "; nflash converts from f32, f16, bf16, q8_0 and q4_0 only");
    }
    if (info.name.ends_with(".fc1.weight") || info.name.ends_with(".fc2.weight")) has_predictors = true;
    SourceTensor st;
    st.name = info.name;
    st.dims = info.dims;
    st.source_type = info.type;
    const std::string name = info.name;
    st.load_f32 = [f, name]() -> Result<std::vector<float>> {
      const GgufTensorInfo* t = f->FindTensor(name);
      if (t == nullptr) return Status::Internal(f->path() + ": tensor " + name + " vanished from the directory");
      return LoadF32(*f, *t);
    };
    st.load_raw = [f, name]() -> Result<std::vector<uint8_t>> {
      const GgufTensorInfo* t = f->FindTensor(name);
      if (t == nullptr) return Status::Internal(f->path() + ": tensor " + name + " vanished from the directory");
      std::vector<uint8_t> scratch;
      NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f->TensorData(*t, &scratch));
      return std::vector<uint8_t>(bytes.begin(), bytes.end());
    };
    model.tensors.push_back(std::move(st));
  }

  const GgufTensorInfo* embd = f->FindTensor("token_embd.weight");
  if (embd == nullptr) return Status::Corruption(path + ": tensor token_embd.weight is missing");
  if (embd->dims.size() != 2 || embd->dims[0] != static_cast<uint64_t>(c.dim)) {
    return Status::Corruption(path + ": token_embd.weight row length " + std::to_string(embd->dims[0]) +
                              " does not match llama.embedding_length " + std::to_string(c.dim));
  }
  // llama.vocab_size is optional in llama.cpp files; the embedding's row count is authoritative.
  c.n_vocab = static_cast<int64_t>(embd->dims[1]);
  c.tied_embeddings = f->FindTensor("output.weight") == nullptr;

  c.activation = FfnActivation::kSilu;
  if (const GgufValue* v = f->Find(kActivationKey); v != nullptr) {
    NF_ASSIGN_OR_RETURN(std::string name, f->GetString(kActivationKey));
    auto a = ParseFfnActivation(name);
    if (!a) {
      return Status::Corruption(path + ": " + std::string(kActivationKey) + " is \"" + name +
                                "\", expected silu, relu or drelu");
    }
    c.activation = *a;
  } else if (has_predictors) {
    // PowerInfer's activation predictors exist only for ReLU-family models; its files do not record the activation.
    c.activation = FfnActivation::kRelu;
    NF_LOG(Warning) << path << ": PowerInfer predictors without " << kActivationKey
                    << ": assuming relu (pass --activation to override)";
  }

  for (const auto& [key, value] : f->metadata()) {
    if (key == kActivationKey) continue;
    for (std::string_view prefix : kPassThroughPrefixes) {
      if (key.starts_with(prefix)) {
        model.extra_metadata.emplace_back(key, value);
        break;
      }
    }
  }
  return model;
}

}  // namespace nflash::converter
