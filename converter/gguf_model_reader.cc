// Reads a GGUF model of llama.cpp's llama, qwen2, qwen3, qwen3moe or phi3 architecture (llama.cpp, PowerInfer or
// nflash output) into a SourceModel in the llama layout (qwen3 and qwen3moe: in their own), for re-quantizing.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "converter/readers.h"
#include "converter/rope_rows.h"
#include "converter/source_quants.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"

namespace nflash::converter {
namespace {

// Key prefixes copied through unchanged: PowerInfer's settings (e.g. powerinfer.sparse_threshold) and nflash's own.
constexpr std::string_view kPassThroughPrefixes[] = {"powerinfer.", "nflash."};
// Written by the writer from ModelConfig::activation, so not copied as an extra key.
constexpr std::string_view kActivationKey = "nflash.ffn_activation";
// The architectures read: llama, qwen3 and qwen3moe as they are (qwen3's per-head q/k norms have no place in the
// llama layout, so it stays qwen3); qwen2 and phi3 (llama.cpp's NEOX RoPE, Phi-3's fused tensors) rearranged into the
// llama layout by GgufParts.
constexpr std::string_view kArchitectures[] = {"llama", "qwen2", "qwen3", "qwen3moe", "phi3"};

// The core types, and the block types read only here (legacy Q4_1/Q5_0/Q5_1 and the K-quants), dequantized on reading.
bool IsConvertibleType(GgmlType t) {
  return t == GgmlType::kF32 || t == GgmlType::kF16 || t == GgmlType::kBF16 || t == GgmlType::kQ8_0 ||
         t == GgmlType::kQ4_0 || IsSourceOnlyType(t);
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

// Rows [first_row, first_row + n_rows) of `info` (rows of dims[0] values; all of them by default) as F32.
Result<std::vector<float>> LoadF32(const GgufFile& f, const GgufTensorInfo& info, uint64_t first_row = 0,
                                   std::optional<uint64_t> n_rows = std::nullopt) {
  std::vector<uint8_t> scratch;
  NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f.TensorData(info, &scratch));
  const uint64_t row = info.dims.empty() ? 1 : info.dims[0];
  const auto row_bytes = RowBytes(info.type, row);
  if (!row_bytes || row == 0) {
    return Status::Corruption(f.path() + ": tensor " + info.name + " has row length " + std::to_string(row) +
                              ", not a whole number of " + std::string(GgmlTypeName(info.type)) + " blocks");
  }
  const uint64_t total = info.n_elements / row;
  const uint64_t count = n_rows.value_or(total - std::min(first_row, total));
  if (first_row + count > total) {
    return Status::Internal(f.path() + ": tensor " + info.name + " has " + std::to_string(total) + " rows, not rows " +
                            std::to_string(first_row) + ".." + std::to_string(first_row + count));
  }
  std::vector<float> out(count * row);
  for (uint64_t r = 0; r < count; ++r) {
    Status s = DequantizeSourceRow(info.type, bytes.data() + (first_row + r) * *row_bytes, out.data() + r * row,
                                   static_cast<int64_t>(row));
    if (!s.ok()) return s.WithContext(f.path() + ": tensor " + info.name + " row " + std::to_string(first_row + r));
  }
  return out;
}

// The tensor `name` of `f`, which the reader listed when it made the loader that looks it up now.
Result<const GgufTensorInfo*> ListedTensor(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return Status::Internal(f.path() + ": tensor " + name + " vanished from the directory");
  return t;
}

// One tensor of the output cut from a tensor of the file: rows [row_begin, row_begin + rows) of `source` (rows of
// dims[0] elements; a 1-D tensor's rows are its elements), put from rotate-half into pair order over `rope_heads`
// heads when that is > 0, every value multiplied by `scale`.
struct GgufPart {
  std::string name;
  std::string source;
  uint64_t row_begin = 0, rows = 0;  // rows 0: the whole source, dims unchanged
  int64_t rope_heads = 0;
  float scale = 1.0f;
};

uint64_t RowCount(const GgufTensorInfo& t) { return t.dims.size() == 1 ? t.dims[0] : t.n_elements / t.dims[0]; }
uint64_t RowElements(const GgufTensorInfo& t) { return t.dims.size() == 1 ? 1 : t.dims[0]; }

// What the written model (`c`'s architecture) needs of `arch`'s tensor `t`: the same tensor when the architecture is
// kept (llama, qwen3, qwen3moe). qwen2 and phi3 rotate halves (llama.cpp's NEOX RoPE, the Hugging Face order), so
// their q and k rows and biases are interleaved into the llama layout as the HF reader does; phi3's attn_qkv (rows
// q | k | v) and ffn_up (rows gate | up) are split; LongRoPE's short factors become rope_freqs.weight and the long ones
// are left out (the context is capped where the short ones hold); `qk_scale` (LongRoPE's attention factor) scales q
// and k. The sizes cut are checked against the hyperparameters here, before any row is moved.
Result<std::vector<GgufPart>> GgufParts(const GgufFile& f, const std::string& arch, const ModelConfig& c,
                                        const GgufTensorInfo& t, float qk_scale) {
  const auto n_ff = static_cast<uint64_t>(c.n_ff);
  const auto q_dim = static_cast<uint64_t>(c.q_dim()), kv_dim = static_cast<uint64_t>(c.kv_dim());
  const std::string& n = t.name;
  if (arch == c.architecture) return std::vector<GgufPart>{{n, n}};  // kept as it is (llama, qwen3, qwen3moe)
  if (arch == "phi3" && n == "rope_factors_long.weight") return std::vector<GgufPart>{};
  if (arch == "phi3" && n == "rope_factors_short.weight") return std::vector<GgufPart>{{"rope_freqs.weight", n}};
  const size_t dot = n.rfind('.');
  const std::string stem = dot == std::string::npos ? n : n.substr(0, dot);
  const std::string prefix = stem.substr(0, stem.rfind('.') + 1);  // "blk.N." for a layer's tensor
  // `split`: the tensor is cut by rows, which needs a matrix (a q or k bias is permuted whole).
  auto rows_are = [&](uint64_t want, const std::string& what, bool split) -> Status {
    const bool shape = split ? t.dims.size() == 2 : t.dims.size() <= 2;
    if (shape && RowCount(t) == want) return Status::Ok();
    return Status::Corruption(f.path() + ": tensor " + n + " has dims " + ShapeToString(t.dims) + ", expected " +
                              std::to_string(want) + " rows (" + what + ")");
  };
  const bool q = stem.ends_with(".attn_q"), k = stem.ends_with(".attn_k");
  if (stem.starts_with("blk.") && (q || k)) {
    NF_RETURN_IF_ERROR(rows_are(q ? q_dim : kv_dim, q ? "head_count x head size" : "head_count_kv x head size", false));
    return std::vector<GgufPart>{{n, n, 0, 0, q ? c.n_heads : c.n_kv_heads, qk_scale}};
  }
  if (arch == "phi3" && stem.starts_with("blk.") && stem.ends_with(".attn_qkv") && n.ends_with(".weight")) {
    NF_RETURN_IF_ERROR(
        rows_are(q_dim + 2 * kv_dim, "q, k and v: (head_count + 2 x head_count_kv) x head size", true));
    return std::vector<GgufPart>{{prefix + "attn_q.weight", n, 0, q_dim, c.n_heads, qk_scale},
                                 {prefix + "attn_k.weight", n, q_dim, kv_dim, c.n_kv_heads, qk_scale},
                                 {prefix + "attn_v.weight", n, q_dim + kv_dim, kv_dim}};
  }
  if (arch == "phi3" && stem.starts_with("blk.") && n.ends_with(".ffn_up.weight")) {
    NF_RETURN_IF_ERROR(rows_are(2 * n_ff, "gate and up: 2 x feed_forward_length", true));
    return std::vector<GgufPart>{{prefix + "ffn_gate.weight", n, 0, n_ff}, {prefix + "ffn_up.weight", n, n_ff, n_ff}};
  }
  return std::vector<GgufPart>{{n, n}};
}

// The source of part `p` of the file `f`: as F32, and as raw bytes when the rows can move whole (nothing scaled; a
// 1-D tensor only in a type of one element per block).
SourceTensor PartTensor(const std::shared_ptr<const GgufFile>& f, const GgufTensorInfo& info, const GgufPart& p) {
  SourceTensor st;
  st.name = p.name;
  st.dims = info.dims;
  if (p.rows > 0) st.dims = info.dims.size() == 1 ? std::vector<uint64_t>{p.rows} : std::vector{info.dims[0], p.rows};
  st.source_type = info.type;
  st.load_f32 = [f, p]() -> Result<std::vector<float>> {
    NF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, ListedTensor(*f, p.source));
    // A part of a fused tensor dequantizes its own rows only.
    NF_ASSIGN_OR_RETURN(std::vector<float> v, p.rows > 0 ? LoadF32(*f, *t, p.row_begin, p.rows) : LoadF32(*f, *t));
    if (p.scale != 1.0f) {
      for (float& x : v) x *= p.scale;
    }
    if (p.rope_heads == 0) return v;
    const uint64_t rows = p.rows > 0 ? p.rows : RowCount(*t);
    return InterleaveRopeRows<float>(v, p.rope_heads, static_cast<int64_t>(rows), RowElements(*t));
  };
  const auto row_bytes = RowBytes(info.type, RowElements(info));
  if (p.scale != 1.0f || !row_bytes) return st;
  st.load_raw = [f, p, row_bytes = *row_bytes]() -> Result<std::vector<uint8_t>> {
    NF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, ListedTensor(*f, p.source));
    std::vector<uint8_t> scratch;
    NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f->TensorData(*t, &scratch));
    const uint64_t rows = p.rows > 0 ? p.rows : RowCount(*t);
    const std::span<const uint8_t> window = bytes.subspan(p.row_begin * row_bytes, rows * row_bytes);
    if (p.rope_heads == 0) return std::vector<uint8_t>(window.begin(), window.end());
    return InterleaveRopeRows<uint8_t>(window, p.rope_heads, static_cast<int64_t>(rows), row_bytes);
  };
  return st;
}

// Phi-3's LongRoPE in a phi3 file: rope_factors_short.weight (head size / 2 factors, F32), used up to
// rope.scaling.original_context_length, where the context is capped (the long factors are left out, as the HF reader
// does); returns the attention factor that scales q and k: rope.scaling.attn_factor, else transformers' default
// sqrt(1 + ln(context / original) / ln(original)) when the context is longer. No factors: 1, nothing changed.
Result<float> Phi3LongRope(const GgufFile& f, ModelConfig* c) {
  const GgufTensorInfo* t = f.FindTensor("rope_factors_short.weight");
  if (t == nullptr) {
    NF_ASSIGN_OR_RETURN(double attn, OptionalFloat(f, "phi3.rope.scaling.attn_factor", 1.0));
    if (attn != 1.0) {
      return Status::Corruption(f.path() + ": phi3.rope.scaling.attn_factor is " + std::to_string(attn) +
                                " without rope_factors_short.weight (LongRoPE's factors)");
    }
    return 1.0f;
  }
  const auto pairs = static_cast<uint64_t>(c->head_dim() / 2);
  if (t->type != GgmlType::kF32 || t->dims != std::vector<uint64_t>{pairs}) {
    return Status::Corruption(f.path() + ": tensor rope_factors_short.weight must be F32 [" + std::to_string(pairs) +
                              "] (head size / 2), found " + std::string(GgmlTypeName(t->type)) + " with " +
                              std::to_string(t->n_elements) + " elements");
  }
  NF_ASSIGN_OR_RETURN(int64_t original, RequiredPositive(f, "phi3.rope.scaling.original_context_length"));
  double attn = 1.0;
  if (f.Find("phi3.rope.scaling.attn_factor") != nullptr) {
    NF_ASSIGN_OR_RETURN(attn, f.GetFloat("phi3.rope.scaling.attn_factor"));
  } else if (const double scale = static_cast<double>(c->context_length) / static_cast<double>(original); scale > 1) {
    attn = std::sqrt(1.0 + std::log(scale) / std::log(static_cast<double>(original)));
  }
  if (!(attn > 0) || !std::isfinite(attn)) {
    return Status::Corruption(f.path() + ": phi3.rope.scaling.attn_factor is " + std::to_string(attn) +
                              ", expected a positive number");
  }
  if (c->context_length > original) {
    NF_LOG(Info) << f.path() << ": longrope: using the short factors, valid up to rope.scaling.original_context_length "
                 << original << "; the context length is capped there (from " << c->context_length << ")";
    c->context_length = original;
  }
  return static_cast<float>(attn);
}

}  // namespace

Result<SourceModel> ReadGgufModel(const std::string& path) {
  NF_ASSIGN_OR_RETURN(GgufFile opened, GgufFile::OpenPath(path));
  auto f = std::make_shared<const GgufFile>(std::move(opened));

  SourceModel model;
  model.source_path = path;
  model.source_format = "gguf";
  ModelConfig& c = model.config;
  std::string arch;
  NF_ASSIGN_OR_RETURN(arch, f->GetString("general.architecture"));
  if (std::find(std::begin(kArchitectures), std::end(kArchitectures), arch) == std::end(kArchitectures)) {
    return Status::Unsupported(path + ": general.architecture is \"" + arch +
                               "\"; nflash converts \"llama\", \"qwen2\", \"qwen3\", \"qwen3moe\" and \"phi3\" GGUF "
                               "models");
  }
  c.architecture = arch == "qwen3" || arch == "qwen3moe" ? arch : "llama";  // what the file written is
  const std::string key = arch + ".";
  if (f->Find("general.name") != nullptr) {
    NF_ASSIGN_OR_RETURN(c.name, f->GetString("general.name"));
  }
  NF_ASSIGN_OR_RETURN(c.dim, RequiredPositive(*f, key + "embedding_length"));
  NF_ASSIGN_OR_RETURN(c.n_layers, RequiredPositive(*f, key + "block_count"));
  // qwen3moe: the experts' size has its own key (feed_forward_length is a dense FFN's).
  NF_ASSIGN_OR_RETURN(c.n_ff, RequiredPositive(*f, key + (arch == "qwen3moe" ? "expert_feed_forward_length"
                                                                               : "feed_forward_length")));
  NF_ASSIGN_OR_RETURN(c.n_heads, RequiredPositive(*f, key + "attention.head_count"));
  NF_ASSIGN_OR_RETURN(c.n_kv_heads, OptionalInt(*f, key + "attention.head_count_kv", c.n_heads));
  NF_ASSIGN_OR_RETURN(c.context_length, OptionalInt(*f, key + "context_length", 0));
  // Defaults as llama.cpp's: RoPE base 10000, RMSNorm eps 1e-5.
  NF_ASSIGN_OR_RETURN(double theta, OptionalFloat(*f, key + "rope.freq_base", 10000.0));
  NF_ASSIGN_OR_RETURN(double eps, OptionalFloat(*f, key + "attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_theta = static_cast<float>(theta);
  c.norm_eps = static_cast<float>(eps);
  if (f->Find(key + "rope.scaling.type") != nullptr) {
    NF_ASSIGN_OR_RETURN(std::string type, f->GetString(key + "rope.scaling.type"));
    if (type == "linear") {
      NF_ASSIGN_OR_RETURN(double factor, f->GetFloat(key + "rope.scaling.factor"));
      c.rope_scale_linear = static_cast<float>(factor);
    } else if (type != "none") {
      return Status::Unsupported(path + ": " + key + "rope.scaling.type \"" + type + "\" (only linear is supported)");
    }
  }
  NF_ASSIGN_OR_RETURN(c.sliding_window, OptionalInt(*f, key + "attention.sliding_window", 0));
  if (c.sliding_window < 0 || c.sliding_window > UINT32_MAX) {
    return Status::Corruption(path + ": " + key + "attention.sliding_window is " + std::to_string(c.sliding_window) +
                              ", expected 0 (none) or a window of positions below 2^32");
  }
  NF_ASSIGN_OR_RETURN(c.n_experts, OptionalInt(*f, key + "expert_count", 0));
  NF_ASSIGN_OR_RETURN(c.n_experts_used, OptionalInt(*f, key + "expert_used_count", 0));
  // The head size when it is not embedding_length / head_count (Mistral Nemo); llama.cpp writes value_length too.
  NF_ASSIGN_OR_RETURN(c.key_length, OptionalInt(*f, key + "attention.key_length", 0));
  NF_ASSIGN_OR_RETURN(int64_t value_length, OptionalInt(*f, key + "attention.value_length", c.key_length));
  if (c.key_length < 0 || value_length != c.key_length) {
    return Status::Unsupported(path + ": " + key + "attention.key_length " + std::to_string(c.key_length) + " and " +
                               key + "attention.value_length " + std::to_string(value_length) +
                               ": only equal key and value head sizes are supported");
  }
  if (c.key_length * c.n_heads == c.dim) c.key_length = 0;  // the default, written out
  if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0 || (c.key_length == 0 && c.dim % c.n_heads != 0) ||
      c.head_dim() % 2 != 0) {
    return Status::Corruption(path + ": inconsistent attention shape: embedding_length " + std::to_string(c.dim) +
                              ", head_count " + std::to_string(c.n_heads) + ", head_count_kv " +
                              std::to_string(c.n_kv_heads) + " (expected an even head size)");
  }
  NF_ASSIGN_OR_RETURN(int64_t rotary, OptionalInt(*f, key + "rope.dimension_count", c.head_dim()));
  if (rotary != c.head_dim()) {
    return Status::Unsupported(path + ": " + key + "rope.dimension_count is " + std::to_string(rotary) +
                               ", expected the head size " + std::to_string(c.head_dim()) +
                               " (partial rotary embeddings are not supported)");
  }
  float qk_scale = 1.0f;
  if (arch == "phi3") {
    NF_ASSIGN_OR_RETURN(qk_scale, Phi3LongRope(*f, &c));
  }

  NF_RETURN_IF_ERROR(ReadTokenizer(*f, &model.tokenizer));

  bool has_predictors = false;
  for (const GgufTensorInfo& info : f->tensors()) {
    if (!IsConvertibleType(info.type)) {
      return Status::Unsupported(path + ": tensor " + info.name + " has type " +
                                 std::string(GgmlTypeName(info.type)) +
                                 "; nflash converts from f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 and the "
                                 "k-quants q2_K to q6_K");
    }
    if (info.name.ends_with(".fc1.weight") || info.name.ends_with(".fc2.weight")) has_predictors = true;
    NF_ASSIGN_OR_RETURN(std::vector<GgufPart> parts, GgufParts(*f, arch, c, info, qk_scale));
    for (const GgufPart& p : parts) model.tensors.push_back(PartTensor(f, info, p));
  }

  const GgufTensorInfo* embd = f->FindTensor("token_embd.weight");
  if (embd == nullptr) return Status::Corruption(path + ": tensor token_embd.weight is missing");
  if (embd->dims.size() != 2 || embd->dims[0] != static_cast<uint64_t>(c.dim)) {
    return Status::Corruption(path + ": token_embd.weight row length " + std::to_string(embd->dims[0]) +
                              " does not match " + key + "embedding_length " + std::to_string(c.dim));
  }
  // ARCH.vocab_size is optional in llama.cpp files; the embedding's row count is authoritative.
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
