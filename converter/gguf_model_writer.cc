// Writes a SourceModel as a llama.cpp-compatible GGUF v3 file, streaming and (re-)quantizing one tensor at a time.
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "converter/readers.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_pool.h"

namespace nflash::converter {
namespace {

// ggml's GGUF quantization scheme version for Q4_0/Q8_0 blocks (llama.cpp writes 2 since its May 2023 format change).
constexpr uint32_t kQuantizationVersion = 2;

// llama_ftype values for general.file_type ("mostly <type>": norms stay F32).
Result<uint32_t> FileType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return 0u;
    case GgmlType::kF16:
      return 1u;
    case GgmlType::kQ4_0:
      return 2u;
    case GgmlType::kQ8_0:
      return 7u;
    case GgmlType::kBF16:
      return 32u;
    default:
      return Status::InvalidArgument("output type " + std::string(GgmlTypeName(t)) +
                                     " is not supported; choose f32, f16, bf16, q8_0 or q4_0");
  }
}


Status CheckConfig(const SourceModel& m) {
  const ModelConfig& c = m.config;
  const std::string where = m.source_path.empty() ? std::string("model") : m.source_path;
  struct Field {
    const char* name;
    int64_t value;
  };
  for (const Field& f : {Field{"n_vocab", c.n_vocab}, Field{"dim", c.dim}, Field{"n_layers", c.n_layers},
                         Field{"n_ff", c.n_ff}, Field{"n_heads", c.n_heads}, Field{"n_kv_heads", c.n_kv_heads}}) {
    if (f.value <= 0) {
      return Status::InvalidArgument(where + ": model " + f.name + " is " + std::to_string(f.value) +
                                     ", expected a positive value");
    }
  }
  if ((c.key_length == 0 && c.dim % c.n_heads != 0) || c.n_heads % c.n_kv_heads != 0) {
    return Status::InvalidArgument(where + ": dim " + std::to_string(c.dim) + ", n_heads " +
                                   std::to_string(c.n_heads) + ", n_kv_heads " + std::to_string(c.n_kv_heads) +
                                   ": dim must be a multiple of n_heads (unless a key length is given) and n_heads "
                                   "of n_kv_heads");
  }
  if (c.key_length < 0 || c.head_dim() % 2 != 0) {
    return Status::InvalidArgument(where + ": the head size " + std::to_string(c.head_dim()) +
                                   " must be a positive even number (RoPE rotates pairs)");
  }
  if (c.n_experts < 0 || (c.n_experts > 0 && (c.n_experts_used <= 0 || c.n_experts_used > c.n_experts))) {
    return Status::InvalidArgument(where + ": expert_used_count " + std::to_string(c.n_experts_used) +
                                   " must be in 1.." + std::to_string(c.n_experts) + " for a MoE model");
  }
  const TokenizerData& t = m.tokenizer;
  if (!t.model.empty()) {
    if (t.tokens.size() != static_cast<size_t>(c.n_vocab)) {
      return Status::InvalidArgument(where + ": tokenizer has " + std::to_string(t.tokens.size()) +
                                     " tokens but the model's vocabulary is " + std::to_string(c.n_vocab));
    }
    if (!t.scores.empty() && t.scores.size() != t.tokens.size()) {
      return Status::InvalidArgument(where + ": tokenizer has " + std::to_string(t.scores.size()) + " scores for " +
                                     std::to_string(t.tokens.size()) + " tokens");
    }
    if (!t.token_types.empty() && t.token_types.size() != t.tokens.size()) {
      return Status::InvalidArgument(where + ": tokenizer has " + std::to_string(t.token_types.size()) +
                                     " token types for " + std::to_string(t.tokens.size()) + " tokens");
    }
  }
  return Status::Ok();
}

// The tensors every llama (qwen3, qwen3moe) model has, with the shapes the config implies (GGUF dims order).
Status CheckTensors(const SourceModel& m) {
  const ModelConfig& c = m.config;
  const std::string where = m.source_path.empty() ? std::string("model") : m.source_path;
  if (c.architecture != "llama" && c.architecture != "qwen3" && c.architecture != "qwen3moe") {
    return Status::InvalidArgument(where + ": architecture \"" + c.architecture +
                                   "\", expected llama, qwen3 or qwen3moe");
  }
  std::unordered_map<std::string, const SourceTensor*> by_name;
  for (const SourceTensor& t : m.tensors) {
    if (!by_name.emplace(t.name, &t).second) {
      return Status::InvalidArgument(where + ": tensor " + t.name + " appears twice");
    }
    if (t.dims.empty() || t.dims.size() > 4) {
      return Status::InvalidArgument(where + ": tensor " + t.name + " has " + std::to_string(t.dims.size()) +
                                     " dimensions, expected 1 to 4");
    }
    for (uint64_t d : t.dims) {
      if (d == 0) return Status::InvalidArgument(where + ": tensor " + t.name + " has an empty dimension " +
                                                 ShapeToString(t.dims));
    }
    if (!t.load_f32) return Status::Internal(where + ": tensor " + t.name + " has no loader");
  }
  const uint64_t dim = c.dim, vocab = c.n_vocab, ff = c.n_ff, kv_dim = c.kv_dim(), q_dim = c.q_dim();
  auto expect = [&](const std::string& name, std::vector<uint64_t> dims) -> Status {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return Status::InvalidArgument(where + ": tensor " + name + " is missing (every " + c.architecture +
                                     " model has it)");
    }
    if (it->second->dims != dims) {
      return Status::InvalidArgument(where + ": tensor " + name + " has dims " + ShapeToString(it->second->dims) +
                                     ", expected " + ShapeToString(dims) + " from the model's hyper-parameters");
    }
    return Status::Ok();
  };
  NF_RETURN_IF_ERROR(expect("token_embd.weight", {dim, vocab}));
  NF_RETURN_IF_ERROR(expect("output_norm.weight", {dim}));
  if (by_name.count("rope_freqs.weight")) {  // llama3 RoPE scaling: one factor per rotary pair
    NF_RETURN_IF_ERROR(expect("rope_freqs.weight", {static_cast<uint64_t>(c.head_dim() / 2)}));
  }
  if (c.tied_embeddings) {
    if (by_name.count("output.weight")) {
      return Status::InvalidArgument(where + ": tied_embeddings is set but output.weight exists");
    }
  } else {
    NF_RETURN_IF_ERROR(expect("output.weight", {dim, vocab}));
  }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    NF_RETURN_IF_ERROR(expect(p + "attn_norm.weight", {dim}));
    NF_RETURN_IF_ERROR(expect(p + "attn_q.weight", {dim, q_dim}));
    NF_RETURN_IF_ERROR(expect(p + "attn_k.weight", {dim, kv_dim}));
    NF_RETURN_IF_ERROR(expect(p + "attn_v.weight", {dim, kv_dim}));
    NF_RETURN_IF_ERROR(expect(p + "attn_output.weight", {q_dim, dim}));
    for (const auto& [bias, n] : {std::pair{"attn_q.bias", q_dim}, {"attn_k.bias", kv_dim}, {"attn_v.bias", kv_dim}}) {
      if (by_name.count(p + bias)) NF_RETURN_IF_ERROR(expect(p + bias, {n}));  // optional (Qwen2)
    }
    for (const char* norm : {"attn_q_norm.weight", "attn_k_norm.weight"}) {  // qwen3's and qwen3moe's only
      if (c.qk_norms()) {
        NF_RETURN_IF_ERROR(expect(p + norm, {static_cast<uint64_t>(c.head_dim())}));
      } else if (by_name.count(p + norm)) {
        return Status::InvalidArgument(where + ": tensor " + p + norm + " in a " + c.architecture +
                                       " model (per-head q/k norms belong to qwen3 and qwen3moe)");
      }
    }
    NF_RETURN_IF_ERROR(expect(p + "ffn_norm.weight", {dim}));
    if (c.n_experts == 0) {  // MoE expert layouts vary (merged or per expert): left to the reader
      NF_RETURN_IF_ERROR(expect(p + "ffn_gate.weight", {dim, ff}));
      NF_RETURN_IF_ERROR(expect(p + "ffn_up.weight", {dim, ff}));
      // PowerInfer files replace ffn_down with its transpose ffn_down_t (one row of `dim` per neuron).
      if (by_name.count(p + "ffn_down.weight") == 0 && by_name.count(p + "ffn_down_t.weight") != 0) {
        NF_RETURN_IF_ERROR(expect(p + "ffn_down_t.weight", {dim, ff}));
      } else {
        NF_RETURN_IF_ERROR(expect(p + "ffn_down.weight", {ff, dim}));
      }
    }
  }
  return Status::Ok();
}

GgufArray StringArray(const std::vector<std::string>& v) {
  GgufArray a;
  a.element_type = GgufType::kString;
  a.items.reserve(v.size());
  for (const std::string& s : v) a.items.emplace_back(s);
  return a;
}

void SetMetadata(const SourceModel& m, uint32_t file_type, GgufWriter* w) {
  const ModelConfig& c = m.config;
  auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  // The model keys under the architecture's prefix (llama.*, qwen3.*), as llama.cpp reads them.
  w->Set("general.architecture", c.architecture);
  const std::string prefix = c.architecture + ".";
  if (!c.name.empty()) w->Set("general.name", c.name);
  w->Set("general.file_type", file_type);
  w->Set("general.quantization_version", kQuantizationVersion);
  // Only written when set: llama.cpp reads 0 as "unknown", and a llama2.c or synthetic model may not say.
  if (c.context_length > 0) w->Set(prefix + "context_length", u32(c.context_length));
  w->Set(prefix + "embedding_length", u32(c.dim));
  w->Set(prefix + "block_count", u32(c.n_layers));
  w->Set(prefix + "feed_forward_length", u32(c.n_ff));
  // llama.cpp's qwen3moe reads the experts' size from its own key (feed_forward_length would be a dense FFN's).
  if (c.architecture == "qwen3moe") w->Set(prefix + "expert_feed_forward_length", u32(c.n_ff));
  w->Set(prefix + "rope.dimension_count", u32(c.head_dim()));
  w->Set(prefix + "attention.head_count", u32(c.n_heads));
  w->Set(prefix + "attention.head_count_kv", u32(c.n_kv_heads));
  if (c.key_length > 0 && c.key_length * c.n_heads != c.dim) {  // as llama.cpp's converter: only when not dim / heads
    w->Set(prefix + "attention.key_length", u32(c.key_length));
    w->Set(prefix + "attention.value_length", u32(c.key_length));
  }
  w->Set(prefix + "attention.layer_norm_rms_epsilon", c.norm_eps);
  w->Set(prefix + "rope.freq_base", c.rope_theta);
  w->Set(prefix + "vocab_size", u32(c.n_vocab));
  if (c.sliding_window > 0) w->Set(prefix + "attention.sliding_window", u32(c.sliding_window));
  if (c.n_experts > 0) {
    w->Set(prefix + "expert_count", u32(c.n_experts));
    w->Set(prefix + "expert_used_count", u32(c.n_experts_used));
  }
  if (c.rope_scale_linear != 1.0f) {
    w->Set(prefix + "rope.scaling.type", "linear");
    w->Set(prefix + "rope.scaling.factor", c.rope_scale_linear);
  }
  const TokenizerData& t = m.tokenizer;
  if (!t.model.empty()) {
    w->Set("tokenizer.ggml.model", t.model);
    if (!t.pre.empty()) w->Set("tokenizer.ggml.pre", t.pre);
    w->Set("tokenizer.ggml.tokens", StringArray(t.tokens));
    if (!t.scores.empty()) {
      GgufArray a;
      a.element_type = GgufType::kFloat32;
      for (float s : t.scores) a.items.emplace_back(s);
      w->Set("tokenizer.ggml.scores", std::move(a));
    }
    if (!t.token_types.empty()) {
      GgufArray a;
      a.element_type = GgufType::kInt32;
      for (int32_t v : t.token_types) a.items.emplace_back(v);
      w->Set("tokenizer.ggml.token_type", std::move(a));
    }
    if (!t.merges.empty()) w->Set("tokenizer.ggml.merges", StringArray(t.merges));
    if (t.bos_id >= 0) w->Set("tokenizer.ggml.bos_token_id", u32(t.bos_id));
    if (t.eos_id >= 0) w->Set("tokenizer.ggml.eos_token_id", u32(t.eos_id));
    if (t.unk_id >= 0) w->Set("tokenizer.ggml.unknown_token_id", u32(t.unk_id));
    if (t.pad_id >= 0) w->Set("tokenizer.ggml.padding_token_id", u32(t.pad_id));
    if (t.add_bos) w->Set("tokenizer.ggml.add_bos_token", *t.add_bos);
    if (t.add_eos) w->Set("tokenizer.ggml.add_eos_token", *t.add_eos);
    if (!t.chat_template.empty()) w->Set("tokenizer.chat_template", t.chat_template);
  }
  w->Set("nflash.ffn_activation", FfnActivationName(c.activation));
  for (const auto& [key, value] : m.extra_metadata) w->Set(key, value);
}

// The bytes of `t` in `type`: the source bytes when unchanged, else F32 converted row by row.
Result<std::vector<uint8_t>> TensorBytes(ThreadPool* pool, bool q4_0_scale_search, const SourceTensor& t,
                                         GgmlType type, uint64_t n_elements, uint64_t n_bytes,
                                         bool* copied) {
  *copied = false;
  if (t.source_type == type && t.load_raw) {
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, t.load_raw());
    if (raw.size() != n_bytes) {
      return Status::Internal("tensor " + t.name + ": source gave " + std::to_string(raw.size()) +
                              " raw bytes, expected " + std::to_string(n_bytes));
    }
    *copied = true;
    return raw;
  }
  NF_ASSIGN_OR_RETURN(std::vector<float> x, t.load_f32());
  if (x.size() != n_elements) {
    return Status::Internal("tensor " + t.name + ": source gave " + std::to_string(x.size()) + " values, expected " +
                            std::to_string(n_elements) + " for dims " + ShapeToString(t.dims));
  }
  std::vector<uint8_t> out(n_bytes);
  const uint64_t row = t.dims[0];
  const uint64_t row_bytes = n_bytes / (n_elements / row);
  // Rows are independent: quantize them in parallel (the output does not depend on the partition).
  std::vector<Status> errors(static_cast<size_t>(pool->NumThreads()));
  pool->ParallelFor(static_cast<int64_t>(n_elements / row), 64, [&](int64_t begin, int64_t end, int thread) {
    for (int64_t r = begin; r < end && errors[thread].ok(); ++r) {
      Status s;
      if (type == GgmlType::kQ4_0 && q4_0_scale_search && row % kQBlock == 0) {
        QuantizeRowQ4_0Optimal(x.data() + r * row, reinterpret_cast<BlockQ4_0*>(out.data() + r * row_bytes),
                               static_cast<int64_t>(row));
      } else {
        s = QuantizeRow(type, x.data() + r * row, out.data() + r * row_bytes, static_cast<int64_t>(row));
      }
      if (!s.ok()) errors[thread] = s.WithContext("tensor " + t.name + " row " + std::to_string(r));
    }
  });
  for (const Status& e : errors) NF_RETURN_IF_ERROR(e);
  return out;
}

}  // namespace

GgmlType OutputTensorType(const SourceTensor& tensor, GgmlType requested, bool tied_embeddings) {
  // Norms (and any other 1-D tensor) stay F32: llama.cpp's kernels expect F32 norms, and they are tiny.
  if (tensor.dims.size() < 2) return GgmlType::kF32;
  // MoE routers stay F32 like llama.cpp's converter does: routing decisions are sensitive and the tensor is small.
  if (tensor.name.ends_with(".ffn_gate_inp.weight")) return GgmlType::kF32;
  const bool head = tensor.name == "output.weight" || (tied_embeddings && tensor.name == "token_embd.weight");
  if (head && requested == GgmlType::kQ4_0) requested = GgmlType::kQ8_0;
  const uint32_t block = TypeInfo(requested).block_size;
  if (block > 1 && tensor.dims[0] % block != 0) return GgmlType::kF16;
  return requested;
}

Status WriteModelGguf(const SourceModel& model, const WriteOptions& options) {
  return WriteModelGguf(model, options, nullptr);
}

Status WriteModelGguf(const SourceModel& model, const WriteOptions& options, WriteSummary* summary) {
  const auto start = std::chrono::steady_clock::now();
  NF_ASSIGN_OR_RETURN(uint32_t file_type, FileType(options.type));
  if (options.path.empty()) return Status::InvalidArgument("no output path given");
  if (!options.overwrite && FileExists(options.path)) {
    return Status::InvalidArgument(options.path + " exists; pass --force to overwrite");
  }
  NF_RETURN_IF_ERROR(CheckConfig(model));
  NF_RETURN_IF_ERROR(CheckTensors(model));
  if (model.tokenizer.model.empty()) {
    NF_LOG(Warning) << options.path << ": the model has no tokenizer; llama.cpp cannot run the output";
  }

  struct Planned {
    const SourceTensor* src;
    GgmlType type;
    uint64_t n_elements;
    uint64_t n_bytes;
  };
  std::vector<Planned> plan;
  WriteSummary s;
  uint64_t total_bytes = 0;
  GgufWriter writer;
  for (const SourceTensor& t : model.tensors) {
    const GgmlType type = OutputTensorType(t, options.type, model.config.tied_embeddings);
    uint64_t n = 1;
    for (uint64_t d : t.dims) {
      if (__builtin_mul_overflow(n, d, &n)) {
        return Status::InvalidArgument("tensor " + t.name + " dims " + ShapeToString(t.dims) + " overflow");
      }
    }
    const auto row_bytes = RowBytes(type, t.dims[0]);
    uint64_t bytes = 0;
    if (!row_bytes || __builtin_mul_overflow(*row_bytes, n / t.dims[0], &bytes)) {
      return Status::InvalidArgument("tensor " + t.name + " dims " + ShapeToString(t.dims) + " do not fit type " +
                                     std::string(GgmlTypeName(type)));
    }
    if (type != options.type && t.dims.size() >= 2 && type == GgmlType::kF16) {
      ++s.f16_fallbacks;
      NF_LOG(Debug) << "tensor " << t.name << ": row length " << t.dims[0] << " is not a multiple of "
                    << TypeInfo(options.type).block_size << "; writing F16 instead of "
                    << GgmlTypeName(options.type);
    }
    NF_RETURN_IF_ERROR(writer.AddTensor(t.name, type, t.dims));
    plan.push_back({&t, type, n, bytes});
    total_bytes += bytes;
  }
  SetMetadata(model, file_type, &writer);

  NF_RETURN_IF_ERROR(writer.Begin(options.path, options.overwrite));
  std::unique_ptr<ProgressBar> progress;
  if (options.progress) progress = std::make_unique<ProgressBar>("writing " + options.path, total_bytes);
  uint64_t done = 0;
  ThreadPool pool(options.threads);
  for (const Planned& p : plan) {
    bool copied = false;
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, TensorBytes(&pool, options.q4_0_scale_search, *p.src, p.type,
                                                                p.n_elements, p.n_bytes, &copied));
    NF_RETURN_IF_ERROR(writer.WriteTensorData(p.src->name, bytes));
    if (copied) ++s.raw_copies;
    ++s.tensors_by_type[p.type];
    s.bytes_by_type[p.type] += p.n_bytes;
    done += p.n_bytes;
    if (progress) progress->Update(done);
  }
  NF_RETURN_IF_ERROR(writer.Finish());
  if (progress) progress->Finish();

  s.n_tensors = plan.size();
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> written, OpenPreadFile(options.path));
  s.file_bytes = written->Size();
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  NF_LOG(Debug) << "wrote " << options.path << ": " << s.n_tensors << " tensors, " << s.file_bytes << " bytes, "
                << s.f16_fallbacks << " F16 fallbacks, " << s.raw_copies << " copied unchanged, " << s.seconds
                << " s";
  if (summary != nullptr) *summary = std::move(s);
  return Status::Ok();
}

}  // namespace nflash::converter
