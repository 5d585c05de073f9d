// Model loading: hyper-parameters from GGUF metadata, weight views checked against the expected shapes.
#include "runtime/engine/model.h"

#include <cmath>
#include <cstring>
#include <tuple>

#include "runtime/core/quant.h"

namespace nflash {
Result<LlamaHparams> ReadLlamaHparams(const GgufFile& f) {
  const std::string& path = f.path();
  NF_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  const char* const kExpected = "expected \"llama\", \"qwen2\", \"qwen3\" or \"qwen3moe\"";
  if (arch == "phi3") {
    return Status::Unsupported(path + ": general.architecture is \"phi3\", " + kExpected + ": convert the file " +
                               "first (nflash convert " + path + " -o OUT.gguf), which splits phi3's fused tensors " +
                               "into the llama layout");
  }
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "qwen3moe") {
    return Status::Unsupported(path + ": general.architecture is \"" + arch + "\", " + kExpected);
  }
  LlamaHparams hp;
  hp.arch = arch;
  hp.rope_neox = arch != "llama";
  // Every model key under the architecture's prefix, as llama.cpp names them (qwen3.embedding_length, ...).
  const std::string prefix = arch + ".";
  auto key_of = [&](const char* name) { return prefix + name; };
  auto req = [&](const std::string& key, int64_t* out) -> Status {
    auto v = f.GetUint(key);
    if (!v.ok()) return v.status().WithContext(path);
    if (*v == 0 || *v > (uint64_t{1} << 40)) {
      return Status::Corruption(path + ": " + key + " = " + std::to_string(*v) + " is out of range");
    }
    *out = static_cast<int64_t>(*v);
    return Status::Ok();
  };
  NF_RETURN_IF_ERROR(req(key_of("embedding_length"), &hp.dim));
  NF_RETURN_IF_ERROR(req(key_of("block_count"), &hp.n_layers));
  NF_RETURN_IF_ERROR(req(key_of("feed_forward_length"), &hp.n_ff));
  // qwen3moe: the experts' own size (feed_forward_length is a dense FFN's, which its models do not have).
  if (arch == "qwen3moe") NF_RETURN_IF_ERROR(req(key_of("expert_feed_forward_length"), &hp.n_ff));
  NF_RETURN_IF_ERROR(req(key_of("attention.head_count"), &hp.n_heads));
  NF_RETURN_IF_ERROR(req(key_of("context_length"), &hp.context_length));
  hp.n_kv_heads = hp.n_heads;
  if (f.Find(key_of("attention.head_count_kv"))) {
    NF_RETURN_IF_ERROR(req(key_of("attention.head_count_kv"), &hp.n_kv_heads));
  }
  // The head size: ARCH.attention.key_length when the file has it (Mistral Nemo: 128 with 5120 / 32 heads), and then
  // value_length must equal it; else embedding_length / head_count.
  hp.head_dim = hp.dim / hp.n_heads;
  const bool keyed = f.Find(key_of("attention.key_length")) != nullptr;
  if (keyed) NF_RETURN_IF_ERROR(req(key_of("attention.key_length"), &hp.head_dim));
  if (f.Find(key_of("attention.value_length"))) {
    int64_t value_length = 0;
    NF_RETURN_IF_ERROR(req(key_of("attention.value_length"), &value_length));
    if (value_length != hp.head_dim) {
      return Status::Unsupported(path + ": " + key_of("attention.value_length") + " = " +
                                 std::to_string(value_length) + ", expected the key length " +
                                 std::to_string(hp.head_dim) + " (different key and value head sizes are not supported)");
    }
  }
  if (f.Find(key_of("rope.dimension_count"))) {
    int64_t rot = 0;
    NF_RETURN_IF_ERROR(req(key_of("rope.dimension_count"), &rot));
    if (rot != hp.head_dim) {
      return Status::Unsupported(path + ": " + key_of("rope.dimension_count") + " = " + std::to_string(rot) +
                                 ", expected the head size " + std::to_string(hp.head_dim) +
                                 " (partial rotary embeddings are not supported)");
    }
  }
  if ((!keyed && hp.dim % hp.n_heads != 0) || hp.n_heads % hp.n_kv_heads != 0 || hp.head_dim % 2 != 0) {
    return Status::Corruption(path + ": inconsistent heads: embedding_length " + std::to_string(hp.dim) +
                              ", head_count " + std::to_string(hp.n_heads) + ", head_count_kv " +
                              std::to_string(hp.n_kv_heads) + ", head size " + std::to_string(hp.head_dim));
  }
  if (auto v = f.GetFloat(key_of("rope.freq_base")); v.ok()) hp.rope_theta = static_cast<float>(*v);
  if (auto v = f.GetFloat(key_of("attention.layer_norm_rms_epsilon")); v.ok()) hp.norm_eps = static_cast<float>(*v);
  if (auto t = f.GetString(key_of("rope.scaling.type")); t.ok() && *t != "none") {
    if (*t != "linear") {
      return Status::Unsupported(path + ": " + key_of("rope.scaling.type") + " \"" + *t + "\" (only linear)");
    }
    NF_ASSIGN_OR_RETURN(double factor, f.GetFloat(key_of("rope.scaling.factor")));
    if (!(factor > 0)) return Status::Corruption(path + ": " + key_of("rope.scaling.factor") + " must be > 0");
    hp.rope_scale = static_cast<float>(factor);
  }
  if (f.Find(key_of("attention.sliding_window"))) {
    NF_ASSIGN_OR_RETURN(uint64_t w, f.GetUint(key_of("attention.sliding_window")));
    if (w > (uint64_t{1} << 40)) {
      return Status::Corruption(path + ": " + key_of("attention.sliding_window") + " = " + std::to_string(w) +
                                " is out of range");
    }
    hp.sliding_window = static_cast<int64_t>(w);  // 0: none, as llama.cpp reads it
  }
  if (f.Find(key_of("expert_count"))) {
    NF_ASSIGN_OR_RETURN(uint64_t ne, f.GetUint(key_of("expert_count")));
    hp.n_experts = static_cast<int64_t>(ne);
    if (hp.n_experts > 0) {
      NF_RETURN_IF_ERROR(req(key_of("expert_used_count"), &hp.n_experts_used));
      if (hp.n_experts_used > hp.n_experts) {
        return Status::Corruption(path + ": " + key_of("expert_used_count") + " " +
                                  std::to_string(hp.n_experts_used) + " > " + key_of("expert_count") + " " +
                                  std::to_string(hp.n_experts));
      }
    }
  }
  if (arch == "qwen3moe" && hp.n_experts == 0) {
    return Status::Corruption(path + ": " + key_of("expert_count") + " is missing or 0 (qwen3moe models are MoE)");
  }
  if (auto a = f.GetString("nflash.ffn_activation"); a.ok()) {
    auto act = ParseFfnActivation(*a);
    if (!act) {
      return Status::Corruption(path + ": nflash.ffn_activation is \"" + *a + "\", expected silu, relu or drelu");
    }
    hp.activation = *act;
  }
  if (auto n = f.GetString("general.name"); n.ok()) hp.name = *n;
  hp.synthetic = hp.name.find("synthetic") != std::string::npos;
  if (auto s = f.GetBool("nflash.synthetic"); s.ok() && *s) hp.synthetic = true;
  // n_vocab from the embedding tensor (ARCH.vocab_size is optional in GGUF).
  const GgufTensorInfo* emb = f.FindTensor("token_embd.weight");
  if (!emb) return Status::NotFound(path + ": tensor token_embd.weight is missing");
  if (emb->dims.size() != 2) return Status::Corruption(path + ": token_embd.weight must be 2-D");
  hp.n_vocab = static_cast<int64_t>(emb->dims[1]);
  return hp;
}

Result<std::unique_ptr<Model>> Model::Load(const std::string& path, const LoadOptions& options) {
  Result<std::unique_ptr<ReadableFile>> file = options.use_mmap ? OpenMmapFile(path) : ReadFileDirect(path);
  if (!file.ok()) return file.status();
  std::shared_ptr<const ReadableFile> shared(std::move(file).value());
  NF_ASSIGN_OR_RETURN(GgufFile gguf, GgufFile::Open(shared));
  return FromGguf(std::make_shared<const GgufFile>(std::move(gguf)), options);
}

Result<std::unique_ptr<Model>> Model::FromGguf(std::shared_ptr<const GgufFile> file) {
  return FromGguf(std::move(file), LoadOptions{});
}

Result<std::unique_ptr<Model>> Model::FromGguf(std::shared_ptr<const GgufFile> file, const LoadOptions& options) {
  if (file->file().Data() == nullptr) {
    return Status::InvalidArgument(file->path() + ": the engine needs the file mapped or in memory");
  }
  std::unique_ptr<Model> m(new Model());
  m->file_ = std::move(file);
  m->external_ffn_ = options.external_ffn;
  NF_ASSIGN_OR_RETURN(m->hp_, ReadLlamaHparams(*m->file_));
  NF_RETURN_IF_ERROR(m->Bind());
  return m;
}

Status Model::Bind() {
  const GgufFile& f = *file_;
  const LlamaHparams& hp = hp_;
  for (const auto& t : f.tensors()) weight_bytes_ += t.n_bytes;
  auto data_of = [&](const GgufTensorInfo* t) { return f.file().Data() + f.data_offset() + t->offset; };
  auto find = [&](const std::string& name, std::vector<uint64_t> dims) -> Result<const GgufTensorInfo*> {
    const GgufTensorInfo* t = f.FindTensor(name);
    if (!t) return Status::NotFound(f.path() + ": tensor " + name + " is missing");
    if (t->dims != dims) {
      return Status::Corruption(f.path() + ": tensor " + name + " has shape " + ShapeToString(t->dims) + ", expected " +
                                ShapeToString(dims));
    }
    return t;
  };
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows, int64_t n_experts,
                    MatrixView* out, size_t* expert_stride) -> Status {
    std::vector<uint64_t> dims = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
    if (n_experts > 0) dims.push_back(static_cast<uint64_t>(n_experts));
    NF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, find(name, dims));
    *out = DenseMatrix(t->type, data_of(t), rows, cols);
    if (expert_stride) *expert_stride = out->row_bytes * static_cast<size_t>(rows);
    return ValidateMatrix(*out, name.c_str()).WithContext(f.path());
  };
  // Norm vectors are used as F32; other storage types are converted once at load.
  auto vec = [&](const std::string& name, int64_t n, const float** out) -> Status {
    NF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, find(name, {static_cast<uint64_t>(n)}));
    const uint8_t* p = data_of(t);
    if (t->type == GgmlType::kF32 && reinterpret_cast<uintptr_t>(p) % alignof(float) == 0) {
      *out = reinterpret_cast<const float*>(p);
      return Status::Ok();
    }
    owned_f32_.emplace_back(static_cast<size_t>(n));
    NF_RETURN_IF_ERROR(DequantizeRow(t->type, p, owned_f32_.back().data(), n).WithContext(f.path() + ": " + name));
    *out = owned_f32_.back().data();
    return Status::Ok();
  };
  owned_f32_.reserve(static_cast<size_t>(7 * hp.n_layers + 3));  // pointers into it must stay valid

  NF_RETURN_IF_ERROR(matrix("token_embd.weight", hp.dim, hp.n_vocab, 0, &token_embd_, nullptr));
  NF_RETURN_IF_ERROR(vec("output_norm.weight", hp.dim, &output_norm_));
  if (f.FindTensor("rope_freqs.weight")) {
    NF_RETURN_IF_ERROR(vec("rope_freqs.weight", hp.head_dim / 2, &rope_freqs_));
    for (int64_t i = 0; i < hp.head_dim / 2; ++i) {
      if (!(std::isfinite(rope_freqs_[i]) && rope_freqs_[i] > 0)) {
        return Status::Corruption(f.path() + ": rope_freqs.weight[" + std::to_string(i) + "] is " +
                                  std::to_string(rope_freqs_[i]) + ", expected a finite factor > 0");
      }
    }
  }
  if (f.FindTensor("output.weight")) {
    NF_RETURN_IF_ERROR(matrix("output.weight", hp.dim, hp.n_vocab, 0, &output_, nullptr));
  } else {
    output_ = token_embd_;  // tied embeddings
  }
  layers_.resize(static_cast<size_t>(hp.n_layers));
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    LayerWeights& L = layers_[static_cast<size_t>(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    NF_RETURN_IF_ERROR(vec(p + "attn_norm.weight", hp.dim, &L.attn_norm));
    NF_RETURN_IF_ERROR(matrix(p + "attn_q.weight", hp.dim, hp.q_dim(), 0, &L.wq, nullptr));
    NF_RETURN_IF_ERROR(matrix(p + "attn_k.weight", hp.dim, hp.kv_dim(), 0, &L.wk, nullptr));
    NF_RETURN_IF_ERROR(matrix(p + "attn_v.weight", hp.dim, hp.kv_dim(), 0, &L.wv, nullptr));
    NF_RETURN_IF_ERROR(matrix(p + "attn_output.weight", hp.q_dim(), hp.dim, 0, &L.wo, nullptr));
    // Optional biases (Qwen2), each bound when the file has it (as llama.cpp's llama architecture does).
    for (const auto& [name, n, out] : {std::tuple{"attn_q.bias", hp.q_dim(), &L.bq},
                                       {"attn_k.bias", hp.kv_dim(), &L.bk}, {"attn_v.bias", hp.kv_dim(), &L.bv}}) {
      if (f.FindTensor(p + name)) NF_RETURN_IF_ERROR(vec(p + name, n, out));
    }
    // Qwen3's per-head q and k norms: part of that architecture (required), of no other.
    if (hp.arch == "qwen3" || hp.arch == "qwen3moe") {
      NF_RETURN_IF_ERROR(vec(p + "attn_q_norm.weight", hp.head_dim, &L.q_norm));
      NF_RETURN_IF_ERROR(vec(p + "attn_k_norm.weight", hp.head_dim, &L.k_norm));
    } else if (f.FindTensor(p + "attn_q_norm.weight") || f.FindTensor(p + "attn_k_norm.weight")) {
      return Status::Unsupported(f.path() + ": tensor " + p + "attn_q_norm.weight or attn_k_norm.weight in a " +
                                 hp.arch + " model (per-head q/k norms belong to qwen3 and qwen3moe)");
    }
    NF_RETURN_IF_ERROR(vec(p + "ffn_norm.weight", hp.dim, &L.ffn_norm));
    if (external_ffn_) {
      if (hp.n_experts > 0) {
        NF_RETURN_IF_ERROR(matrix(p + "ffn_gate_inp.weight", hp.dim, hp.n_experts, 0, &L.router, nullptr));
      }
    } else if (hp.n_experts == 0) {
      NF_RETURN_IF_ERROR(matrix(p + "ffn_gate.weight", hp.dim, hp.n_ff, 0, &L.gate, nullptr));
      NF_RETURN_IF_ERROR(matrix(p + "ffn_up.weight", hp.dim, hp.n_ff, 0, &L.up, nullptr));
      NF_RETURN_IF_ERROR(matrix(p + "ffn_down.weight", hp.n_ff, hp.dim, 0, &L.down, nullptr));
    } else {
      NF_RETURN_IF_ERROR(matrix(p + "ffn_gate_inp.weight", hp.dim, hp.n_experts, 0, &L.router, nullptr));
      NF_RETURN_IF_ERROR(matrix(p + "ffn_gate_exps.weight", hp.dim, hp.n_ff, hp.n_experts, &L.gate, &L.expert_stride_gate));
      NF_RETURN_IF_ERROR(matrix(p + "ffn_up_exps.weight", hp.dim, hp.n_ff, hp.n_experts, &L.up, &L.expert_stride_up));
      NF_RETURN_IF_ERROR(matrix(p + "ffn_down_exps.weight", hp.n_ff, hp.dim, hp.n_experts, &L.down, &L.expert_stride_down));
    }
  }
  return Status::Ok();
}

}  // namespace nflash
