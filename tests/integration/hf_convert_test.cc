// Integration tests of the HF reader: stories260K written as a Hugging Face directory (HF names, HF q/k row
// permutation, SentencePiece tokenizer.model) converts to the same GGUF as the llama2.c original; sharded weights give
// the same result; broken directories fail with clear errors; a synthetic Mixtral's experts are stacked correctly.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "converter/hf_reader.h"
#include "converter/readers.h"
#include "converter/synth.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "tests/integration/numpy_reference.h"
#include "runtime/text/chat_template.h"
#include "runtime/text/tokenizer.h"
#include "tests/test_util.h"

namespace nflash::converter {
namespace {

#define EXPECT_CONTAINS(text, part)                                                              \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "\"" << (text) << "\" lacks \"" << (part) << "\""

using Floats = std::vector<float>;

// ---- fixture writers, independent of the code under test ----

struct HfTensor {
  std::string name;
  std::vector<uint64_t> shape;  // HF order
  Floats data;
  bool bf16 = false;  // stored as BF16 (the top half of each F32)
};

std::vector<uint8_t> SafetensorsBytes(const std::vector<HfTensor>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::vector<uint8_t> data;
  for (const HfTensor& t : tensors) {
    std::string shape;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) shape += ',';
      shape += std::to_string(t.shape[d]);
    }
    const size_t begin = data.size();
    for (float f : t.data) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      if (t.bf16) {
        data.push_back(static_cast<uint8_t>(u >> 16));
        data.push_back(static_cast<uint8_t>(u >> 24));
      } else {
        for (int i = 0; i < 4; ++i) data.push_back(static_cast<uint8_t>(u >> (8 * i)));
      }
    }
    header += ",\"" + t.name + "\":{\"dtype\":\"" + (t.bf16 ? "BF16" : "F32") + "\",\"shape\":[" + shape +
              "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// HF's q/k row order from the interleaved-pairs (llama2.c / GGUF) order. By definition, within each head the
// interleaved rows are pairs (2i, 2i+1) rotated together; HF's rotate-half layout lists the first element of every
// pair, then the second: HF row (j * head_dim/2 + i) = interleaved row (2i + j).
Floats ToHfRopeOrder(const Floats& w, int64_t n_heads, int64_t rows, int64_t cols) {
  Floats out(w.size());
  const int64_t hd = rows / n_heads;
  for (int64_t h = 0; h < n_heads; ++h) {
    int64_t hf_row = h * hd;
    for (int64_t j = 0; j < 2; ++j) {       // even-indexed rows first, then odd-indexed rows
      for (int64_t r = j; r < hd; r += 2) {  // r = 2i + j
        std::memcpy(&out[(hf_row++) * cols], &w[(h * hd + r) * cols], cols * sizeof(float));
      }
    }
  }
  return out;
}

// Protobuf encoding of a SentencePiece ModelProto with the given pieces.
std::vector<uint8_t> SentencePieceProto(const std::vector<std::string>& pieces, const Floats& scores,
                                        const std::vector<int>& types) {
  auto varint = [](std::vector<uint8_t>* o, uint64_t v) {
    while (v >= 0x80) {
      o->push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    o->push_back(static_cast<uint8_t>(v));
  };
  std::vector<uint8_t> model;
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::vector<uint8_t> p;
    p.push_back(0x0A);  // field 1, wire type 2
    varint(&p, pieces[i].size());
    p.insert(p.end(), pieces[i].begin(), pieces[i].end());
    p.push_back(0x15);  // field 2, wire type 5
    uint32_t u;
    std::memcpy(&u, &scores[i], 4);
    for (int b = 0; b < 4; ++b) p.push_back(static_cast<uint8_t>(u >> (8 * b)));
    p.push_back(0x18);  // field 3, wire type 0
    varint(&p, static_cast<uint64_t>(types[i]));
    model.push_back(0x0A);
    varint(&model, p.size());
    model.insert(model.end(), p.begin(), p.end());
  }
  return model;
}

// ---- stories260K, read straight from its documented layout (models/stories260K/README.md) ----

struct Stories {
  int32_t dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len;
  Floats emb, rms_final;
  std::vector<Floats> rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3;
  std::vector<std::string> pieces;
  Floats scores;
};

Stories LoadStories() {
  Stories s{};
  auto bytes = ReadWholeFile(testing::SharedPath("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(bytes.ok());
  const uint8_t* p = bytes->data();
  int32_t hdr[7];
  std::memcpy(hdr, p, sizeof(hdr));
  p += sizeof(hdr);
  s.dim = hdr[0];
  s.hidden = hdr[1];
  s.n_layers = hdr[2];
  s.n_heads = hdr[3];
  s.n_kv_heads = hdr[4];
  s.vocab = hdr[5];
  s.seq_len = hdr[6];
  const int64_t kv_dim = s.dim / s.n_heads * s.n_kv_heads;
  auto take = [&](int64_t n) {
    Floats v(n);
    std::memcpy(v.data(), p, n * 4);
    p += n * 4;
    return v;
  };
  auto per_layer = [&](int64_t n) {
    std::vector<Floats> v;
    for (int l = 0; l < s.n_layers; ++l) v.push_back(take(n));
    return v;
  };
  s.emb = take(int64_t{s.vocab} * s.dim);
  s.rms_att = per_layer(s.dim);
  s.wq = per_layer(int64_t{s.dim} * s.dim);
  s.wk = per_layer(kv_dim * s.dim);
  s.wv = per_layer(kv_dim * s.dim);
  s.wo = per_layer(int64_t{s.dim} * s.dim);
  s.rms_ffn = per_layer(s.dim);
  s.w1 = per_layer(int64_t{s.hidden} * s.dim);
  s.w2 = per_layer(int64_t{s.dim} * s.hidden);
  s.w3 = per_layer(int64_t{s.hidden} * s.dim);
  s.rms_final = take(s.dim);

  auto tok = ReadWholeFile(testing::SharedPath("models/stories260K/tok512.bin"));
  EXPECT_TRUE(tok.ok());
  const uint8_t* t = tok->data() + 4;  // max_token_length
  for (int i = 0; i < s.vocab; ++i) {
    float score;
    int32_t len;
    std::memcpy(&score, t, 4);
    std::memcpy(&len, t + 4, 4);
    s.pieces.emplace_back(reinterpret_cast<const char*>(t + 8), len);
    s.scores.push_back(score);
    t += 8 + len;
  }
  return s;
}

const Stories& GetStories() {
  static const Stories* s = new Stories(LoadStories());
  return *s;
}

// How to damage the HF directory for the error tests.
struct HfOptions {
  bool sharded = false;
  std::string architecture = "LlamaForCausalLM";
  bool tokenizer = true;
  bool truncated_header = false;
  bool transposed_gate = false;
  bool drop_final_norm = false;
  std::string rope_scaling = "null";  // config.json's rope_scaling, as JSON
  bool qkv_bias = false;               // q_proj, k_proj and v_proj biases (StoriesBias), as Qwen2 has
  std::string hidden_act = "silu";
  bool fused = false;                  // Phi-3's layout: qkv_proj (rows q, k, v) and gate_up_proj (rows gate, up)
  std::string extra_config;            // more config.json members, each followed by a comma
  // config.json's head_dim, when not 0: every head of q, k, v (and o_proj's columns) widened from stories' 8 to this
  // many rows, the extra ones a fixed pattern (Mistral Nemo's layout: heads x head_dim != hidden_size).
  int head_dim = 0;
  bool qk_norm = false;  // Qwen3's per-head self_attn.q_norm and k_norm weights (QkNormWeights)
  // Qwen3-MoE's FFN: this many experts per layer (ExpertWeights of stories' FFN, a RouterWeights router), 2 used.
  int moe_experts = 0;
};

// The rows of `w` (`heads` heads of `hd` rows, `cols` columns each) in heads of `wide` rows: each head's own rows,
// then wide - hd rows of a fixed pattern.
Floats WidenHeadRows(const Floats& w, int heads, int hd, int wide, int cols, int salt) {
  Floats out;
  for (int h = 0; h < heads; ++h) {
    out.insert(out.end(), w.begin() + int64_t{h} * hd * cols, w.begin() + int64_t{h + 1} * hd * cols);
    for (int r = hd; r < wide; ++r) {
      for (int c = 0; c < cols; ++c) out.push_back(0.08f * std::sin(0.37f * r + 0.11f * c + 1.3f * h + 0.7f * salt));
    }
  }
  return out;
}

// The columns of the row-major `w` (`rows` rows of `heads` x `hd` columns) likewise: o_proj's input side.
Floats WidenHeadColumns(const Floats& w, int rows, int heads, int hd, int wide, int salt) {
  Floats out;
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      const float* src = w.data() + int64_t{r} * heads * hd + int64_t{h} * hd;
      out.insert(out.end(), src, src + hd);
      for (int c = hd; c < wide; ++c) out.push_back(0.08f * std::cos(0.29f * r + 0.53f * c + 0.9f * h + 0.7f * salt));
    }
  }
  return out;
}

// Rows of `parts` stacked (each a row-major matrix with `cols` columns): a fused projection.
Floats StackRows(const std::vector<const Floats*>& parts) {
  Floats out;
  for (const Floats* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// Layer l's q (m 0) or k (1) norm weights, hd values in the head's own (HF) order: a fixed pattern far enough from 1
// to move the logits.
Floats QkNormWeights(int l, int m, int hd) {
  Floats w(static_cast<size_t>(hd));
  for (int i = 0; i < hd; ++i) w[static_cast<size_t>(i)] = 1.0f + 0.6f * std::sin(0.9f * i + 0.5f * l + 1.7f * m);
  return w;
}

// Expert e's version of one of stories' FFN matrices `w`: scaled and shifted by a pattern of its own, so that which
// experts the router picks, and their weights, change the output.
Floats ExpertWeights(const Floats& w, int e, int salt) {
  Floats out(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    out[i] = w[i] * (1.0f + 0.3f * static_cast<float>(e)) + 0.02f * std::sin(0.7f * static_cast<float>(i) + 1.9f * e +
                                                                              0.3f * salt);
  }
  return out;
}

// Layer l's router (experts x dim, row-major): a fixed pattern whose logits differ by about one between experts.
Floats RouterWeights(int l, int experts, int dim) {
  Floats r(static_cast<size_t>(experts) * dim);
  for (int e = 0; e < experts; ++e) {
    for (int i = 0; i < dim; ++i) r[size_t(e) * dim + i] = 0.4f * std::sin(1.1f * i + 2.3f * e + 0.9f * l);
  }
  return r;
}

// Layer l's bias of q (m 0), k (1) or v (2), n values in GGUF's interleaved order: a fixed pattern large enough to
// move the logits.
Floats StoriesBias(int l, int m, uint64_t n) {
  Floats b(n);
  for (uint64_t i = 0; i < n; ++i) b[i] = 0.5f * std::sin(1.3f * static_cast<float>(i) + 0.7f * l + 2.1f * m);
  return b;
}

void WriteStoriesHf(const std::string& dir, const HfOptions& o) {
  const Stories& s = GetStories();
  const int hd0 = s.dim / s.n_heads, hd = o.head_dim > 0 ? o.head_dim : hd0;
  const uint64_t dim = s.dim, hidden = s.hidden, kv_dim = uint64_t(hd) * s.n_kv_heads, q_dim = uint64_t(hd) * s.n_heads;
  std::vector<HfTensor> t;
  t.push_back({"model.embed_tokens.weight", {uint64_t(s.vocab), dim}, s.emb});
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {dim}, s.rms_att[l]});
    const Floats wq = WidenHeadRows(s.wq[l], s.n_heads, hd0, hd, s.dim, 3 * l);
    const Floats wk = WidenHeadRows(s.wk[l], s.n_kv_heads, hd0, hd, s.dim, 3 * l + 1);
    const Floats wv = WidenHeadRows(s.wv[l], s.n_kv_heads, hd0, hd, s.dim, 3 * l + 2);
    const Floats q = ToHfRopeOrder(wq, s.n_heads, q_dim, dim), k = ToHfRopeOrder(wk, s.n_kv_heads, kv_dim, dim);
    if (o.fused) {
      t.push_back({p + "self_attn.qkv_proj.weight", {q_dim + 2 * kv_dim, dim}, StackRows({&q, &k, &wv})});
    } else {
      t.push_back({p + "self_attn.q_proj.weight", {q_dim, dim}, q});
      t.push_back({p + "self_attn.k_proj.weight", {kv_dim, dim}, k});
      t.push_back({p + "self_attn.v_proj.weight", {kv_dim, dim}, wv});
    }
    t.push_back({p + "self_attn.o_proj.weight", {dim, q_dim}, WidenHeadColumns(s.wo[l], s.dim, s.n_heads, hd0, hd, l)});
    if (o.qk_norm) {
      t.push_back({p + "self_attn.q_norm.weight", {uint64_t(hd)}, QkNormWeights(l, 0, hd)});
      t.push_back({p + "self_attn.k_norm.weight", {uint64_t(hd)}, QkNormWeights(l, 1, hd)});
    }
    if (o.qkv_bias) {  // HF keeps q and k biases in the rotate-half order of their rows
      t.push_back({p + "self_attn.q_proj.bias", {q_dim}, ToHfRopeOrder(StoriesBias(l, 0, q_dim), s.n_heads, q_dim, 1)});
      t.push_back({p + "self_attn.k_proj.bias", {kv_dim},
                   ToHfRopeOrder(StoriesBias(l, 1, kv_dim), s.n_kv_heads, kv_dim, 1)});
      t.push_back({p + "self_attn.v_proj.bias", {kv_dim}, StoriesBias(l, 2, kv_dim)});
    }
    // Old HF checkpoints carry this buffer; the reader must skip it.
    t.push_back({p + "self_attn.rotary_emb.inv_freq", {4}, {1, 0.1f, 0.01f, 0.001f}});
    t.push_back({p + "post_attention_layernorm.weight", {dim}, s.rms_ffn[l]});
    if (o.moe_experts > 0) {  // Qwen3-MoE: mlp.gate routes to mlp.experts.E
      t.push_back({p + "mlp.gate.weight", {uint64_t(o.moe_experts), dim}, RouterWeights(l, o.moe_experts, s.dim)});
      for (int e = 0; e < o.moe_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        t.push_back({x + "gate_proj.weight", {hidden, dim}, ExpertWeights(s.w1[l], e, 1)});
        t.push_back({x + "down_proj.weight", {dim, hidden}, ExpertWeights(s.w2[l], e, 2)});
        t.push_back({x + "up_proj.weight", {hidden, dim}, ExpertWeights(s.w3[l], e, 3)});
      }
      continue;
    }
    if (o.fused) {
      t.push_back({p + "mlp.gate_up_proj.weight", {2 * hidden, dim}, StackRows({&s.w1[l], &s.w3[l]})});
    } else if (o.transposed_gate && l == 0) {
      t.push_back({p + "mlp.gate_proj.weight", {dim, hidden}, s.w1[l]});
    } else {
      t.push_back({p + "mlp.gate_proj.weight", {hidden, dim}, s.w1[l]});
    }
    t.push_back({p + "mlp.down_proj.weight", {dim, hidden}, s.w2[l]});
    if (!o.fused) t.push_back({p + "mlp.up_proj.weight", {hidden, dim}, s.w3[l]});
  }
  if (!o.drop_final_norm) t.push_back({"model.norm.weight", {dim}, s.rms_final});

  char config[4096];
  std::snprintf(config, sizeof(config),
                R"({"architectures": ["%s"], "model_type": "llama", %s "hidden_size": %d, "intermediate_size": %d,
  "num_hidden_layers": %d, "num_attention_heads": %d, "num_key_value_heads": %d, "max_position_embeddings": %d,
  "vocab_size": %d, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "%s", "tie_word_embeddings": true,
  "rope_scaling": %s, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2})",
                o.architecture.c_str(),
                (o.extra_config + (o.head_dim > 0 ? "\"head_dim\": " + std::to_string(o.head_dim) + ", " : "") +
                 (o.moe_experts > 0 ? "\"num_experts\": " + std::to_string(o.moe_experts) +
                                          ", \"num_experts_per_tok\": 2, \"moe_intermediate_size\": " +
                                          std::to_string(s.hidden) + ", " +
                                          (o.extra_config.find("norm_topk_prob") == std::string::npos
                                               ? "\"norm_topk_prob\": true, "
                                               : "")
                                    : ""))
                    .c_str(),
                // Qwen3-MoE's intermediate_size is a dense FFN's (none here), other than moe_intermediate_size.
                s.dim, o.moe_experts > 0 ? 4 * s.hidden : s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.seq_len,
                s.vocab,
                o.hidden_act.c_str(), o.rope_scaling.c_str());
  testing::WriteText(dir + "/config.json", config);

  if (o.sharded) {
    // Shard 1: the embedding and layers 0..2; shard 2: the rest.
    std::vector<HfTensor> a, b;
    std::string map;
    for (const HfTensor& x : t) {
      const bool first = x.name == "model.embed_tokens.weight" || x.name.rfind("model.layers.0.", 0) == 0 ||
                         x.name.rfind("model.layers.1.", 0) == 0 || x.name.rfind("model.layers.2.", 0) == 0;
      const std::string shard = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
      (first ? a : b).push_back(x);
      map += std::string(map.empty() ? "" : ",") + "\"" + x.name + "\":\"" + shard + "\"";
    }
    testing::WriteBytes(dir + "/model-00001-of-00002.safetensors", SafetensorsBytes(a));
    testing::WriteBytes(dir + "/model-00002-of-00002.safetensors", SafetensorsBytes(b));
    testing::WriteText(dir + "/model.safetensors.index.json",
                       "{\"metadata\":{\"total_size\":0},\"weight_map\":{" + map + "}}");
  } else {
    std::vector<uint8_t> bytes = SafetensorsBytes(t);
    if (o.truncated_header) bytes.resize(64);  // the header length now points past the end
    testing::WriteBytes(dir + "/model.safetensors", bytes);
  }

  if (o.tokenizer) {
    // Piece types as tok512.bin's README describes them: <unk>, <s>, </s>, then the 256 byte pieces.
    std::vector<int> types(s.vocab, 1);
    types[0] = 2;
    types[1] = types[2] = 3;
    for (int i = 3; i < 259; ++i) types[i] = 6;
    testing::WriteBytes(dir + "/tokenizer.model", SentencePieceProto(s.pieces, s.scores, types));
  }
}

std::string Render(const GgufValue& v) {
  return std::to_string(static_cast<int>(v.type())) + ":" +
         std::visit(
             [](const auto& x) -> std::string {
               using T = std::decay_t<decltype(x)>;
               if constexpr (std::is_same_v<T, std::string>) {
                 return x;
               } else if constexpr (std::is_same_v<T, GgufArray>) {
                 std::string s = "[";
                 for (const GgufValue& e : x.items) s += Render(e) + ",";
                 return s + "]";
               } else if constexpr (std::is_floating_point_v<T>) {
                 char buf[64];
                 std::snprintf(buf, sizeof(buf), "%a", static_cast<double>(x));
                 return buf;
               } else {
                 return std::to_string(x);
               }
             },
             v.v);
}

std::vector<uint8_t> TensorBytes(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* info = f.FindTensor(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  std::vector<uint8_t> scratch;
  auto span = f.TensorData(*info, &scratch);
  EXPECT_TRUE(span.ok()) << span.status().ToString();
  return {span->begin(), span->end()};
}

std::vector<uint8_t> FloatBytes(const Floats& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Asserts two GGUF files hold the same tensors (names, dims, types, bytes) and the same llama.* keys.
void ExpectSameModel(const std::string& path_a, const std::string& path_b) {
  auto a = GgufFile::OpenPath(path_a);
  auto b = GgufFile::OpenPath(path_b);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const GgufTensorInfo& ta : a->tensors()) {
    const GgufTensorInfo* tb = b->FindTensor(ta.name);
    ASSERT_NE(tb, nullptr) << ta.name;
    EXPECT_EQ(ta.dims, tb->dims) << ta.name;
    EXPECT_EQ(ta.type, tb->type) << ta.name;
    EXPECT_TRUE(TensorBytes(*a, ta.name) == TensorBytes(*b, ta.name)) << ta.name;
  }
  // The model keys, under the architecture's prefix (llama., qwen3.).
  const std::string arch = *a->GetString("general.architecture"), prefix = arch + ".";
  EXPECT_EQ(*b->GetString("general.architecture"), arch);
  size_t n_model_keys = 0;
  for (const auto& [key, value] : a->metadata()) {
    if (key.rfind(prefix, 0) != 0) continue;
    ++n_model_keys;
    const GgufValue* other = b->Find(key);
    ASSERT_NE(other, nullptr) << key;
    EXPECT_EQ(Render(value), Render(*other)) << key;
  }
  size_t n_model_keys_b = 0;
  for (const auto& kv : b->metadata()) n_model_keys_b += kv.first.rfind(prefix, 0) == 0;
  EXPECT_EQ(n_model_keys, n_model_keys_b);
  EXPECT_GE(n_model_keys, 9u);
}

Status ConvertTo(Result<SourceModel> model, const std::string& out) {
  if (!model.ok()) return model.status();
  WriteOptions options;
  options.path = out;
  options.type = GgmlType::kF32;
  options.progress = false;
  return WriteModelGguf(*model, options);
}

TEST(HfConvert, Stories260KMatchesLlama2cConversion) {
  testing::TempDir tmp;
  const std::string hf_dir = tmp.File("stories260K-hf");
  ASSERT_EQ(::mkdir(hf_dir.c_str(), 0755), 0);
  WriteStoriesHf(hf_dir, {});

  const std::string from_llama2c = tmp.File("llama2c.gguf");
  const std::string from_hf = tmp.File("hf.gguf");
  Status s = ConvertTo(ReadLlama2c(testing::SharedPath("models/stories260K/stories260K.bin"),
                                   testing::SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu),
                       from_llama2c);
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto hf_model = ReadHfDirectory(hf_dir);
  ASSERT_TRUE(hf_model.ok()) << hf_model.status().ToString();
  EXPECT_EQ(hf_model->source_format, "hf-safetensors");
  EXPECT_TRUE(hf_model->config.tied_embeddings);
  EXPECT_EQ(hf_model->tokenizer.model, "llama");
  EXPECT_EQ(hf_model->tokenizer.tokens, GetStories().pieces);
  EXPECT_EQ(hf_model->tokenizer.bos_id, 1);
  EXPECT_EQ(hf_model->tokenizer.eos_id, 2);
  EXPECT_EQ(hf_model->tokenizer.unk_id, 0);
  s = ConvertTo(std::move(hf_model), from_hf);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectSameModel(from_llama2c, from_hf);

  // And against the raw checkpoint, independently of the llama2.c reader: GGUF q/k are llama2.c's interleaved rows.
  auto f = GgufFile::OpenPath(from_hf);
  ASSERT_TRUE(f.ok());
  const Stories& st = GetStories();
  EXPECT_TRUE(TensorBytes(*f, "blk.3.attn_q.weight") == FloatBytes(st.wq[3]));
  EXPECT_TRUE(TensorBytes(*f, "blk.4.attn_k.weight") == FloatBytes(st.wk[4]));
  EXPECT_TRUE(TensorBytes(*f, "token_embd.weight") == FloatBytes(st.emb));
  EXPECT_EQ(f->FindTensor("output.weight"), nullptr);
  EXPECT_EQ(f->FindTensor("blk.0.attn_q.weight")->dims, (std::vector<uint64_t>{64, 64}));
  EXPECT_EQ(f->FindTensor("blk.0.attn_k.weight")->dims, (std::vector<uint64_t>{64, 32}));
  EXPECT_EQ(f->FindTensor("blk.0.ffn_down.weight")->dims, (std::vector<uint64_t>{172, 64}));
}

// The model's chat template travels with its tokenizer: from tokenizer_config.json (a string, or transformers' list of
// named templates, "default" chosen), or chat_template.jinja / chat_template.json beside it, into the GGUF's
// tokenizer.chat_template, through a GGUF re-conversion, to the runtime's tokenizer, whose format nflash recognises.
// A malformed one is refused, naming the file and field.
TEST(HfConvert, ChatTemplateTravelsWithTheTokenizer) {
  const std::string chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                             "message['content'] + '<|im_end|>\\n'}}{% endfor %}";
  const std::string llama3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}";
  const nlohmann::json listed = nlohmann::json::array(
      {{{"name", "tool_use"}, {"template", llama3}}, {{"name", "default"}, {"template", chatml}}});
  struct Case {
    std::string file, text, expected;
  };
  const std::vector<Case> cases = {
      {"tokenizer_config.json", nlohmann::json({{"chat_template", chatml}}).dump(), chatml},
      {"tokenizer_config.json", nlohmann::json({{"chat_template", listed}}).dump(), chatml},
      {"chat_template.jinja", llama3, llama3},
      {"chat_template.json", nlohmann::json({{"chat_template", llama3}}).dump(), llama3},
  };
  for (const Case& c : cases) {
    testing::TempDir tmp;
    WriteStoriesHf(tmp.path(), {});
    testing::WriteText(tmp.File(c.file), c.text);
    auto hf = ReadHfDirectory(tmp.path());
    ASSERT_TRUE(hf.ok()) << hf.status().ToString();
    EXPECT_EQ(hf->tokenizer.chat_template, c.expected) << c.file;
    ASSERT_TRUE(ConvertTo(std::move(hf), tmp.File("a.gguf")).ok());
    ASSERT_TRUE(ConvertTo(ReadGgufModel(tmp.File("a.gguf")), tmp.File("b.gguf")).ok());
    auto f = GgufFile::OpenPath(tmp.File("b.gguf"));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    auto stored = f->GetString("tokenizer.chat_template");
    ASSERT_TRUE(stored.ok()) << stored.status().ToString();
    EXPECT_EQ(*stored, c.expected) << c.file;
    auto tok = LoadTokenizer(*f);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    EXPECT_EQ((*tok)->chat_template(), c.expected) << c.file;
    const auto detected = DetectChatTemplate((*tok)->chat_template());
    ASSERT_TRUE(detected.has_value()) << c.file;
    EXPECT_EQ(ChatFormatName(detected->format), std::string(c.expected == chatml ? "chatml" : "llama3"));
  }
  // Without one, the GGUF has no such key.
  testing::TempDir tmp;
  WriteStoriesHf(tmp.path(), {});
  ASSERT_TRUE(ConvertTo(ReadHfDirectory(tmp.path()), tmp.File("none.gguf")).ok());
  auto f = GgufFile::OpenPath(tmp.File("none.gguf"));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->Find("tokenizer.chat_template"), nullptr);
  const std::vector<Case> bad = {
      {"tokenizer_config.json", R"({"chat_template": 7})",
       "tokenizer_config.json: chat_template: expected a string or a list of {\"name\", \"template\"}, found 7"},
      {"tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})",
       "tokenizer_config.json: chat_template: a list without a template named \"default\""},
      {"chat_template.json", R"({"template": "x"})", "chat_template.json: expected an object with a \"chat_template\""},
  };
  for (const Case& c : bad) {
    testing::TempDir t;
    WriteStoriesHf(t.path(), {});
    testing::WriteText(t.File(c.file), c.text);
    auto r = ReadHfDirectory(t.path());
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_CONTAINS(r.status().message(), c.expected);
  }
}

// Builds a damaged directory and expects ReadHfDirectory to fail naming every one of `parts`.
void ExpectBadDirectory(const HfOptions& o, const std::vector<std::string>& parts) {
  testing::TempDir tmp;
  WriteStoriesHf(tmp.path(), o);
  auto r = ReadHfDirectory(tmp.path());
  ASSERT_FALSE(r.ok());
  for (const std::string& p : parts) EXPECT_CONTAINS(r.status().message(), p);
}

// WriteStoriesHf(o) into tmp/name, converted (F32) to tmp/name.gguf, whose path it returns.
std::string ConvertStoriesHf(const testing::TempDir& tmp, const std::string& name, const HfOptions& o) {
  const std::string dir = tmp.File(name);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0);
  WriteStoriesHf(dir, o);
  const std::string out = dir + ".gguf";
  const Status s = ConvertTo(ReadHfDirectory(dir), out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

// The engine's logits on `model` are the NumPy reference's (F32 against F64 rounding), and those on `without` (the
// same model without the feature, `what`) are far from them: the comparison can fail.
void ExpectReferenceLogits(const std::string& model, const std::string& without, const std::string& what,
                           const std::vector<int32_t>& ids = testing::kReferenceIds) {
  auto loaded = Model::Load(model, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const std::vector<float> ref =
      testing::NumpyReferenceLogits(model, ids, (*loaded)->hparams().n_vocab, model + ".npy");
  EXPECT_LE(testing::EngineLogitGap(model, ids, ref).max_diff, 1e-3)
      << "the engine with " << what << " against the reference";
  EXPECT_GT(testing::EngineLogitGap(without, ids, ref).max_diff, 0.1) << "without " << what << " the logits differ";
}

// The engine's logits on `gguf`, converted from the HF directory `dir`, are those of the HF-directory reference
// (transformers' definitions on the checkpoint as stored: rotate-half RoPE, fused projections, LongRoPE's factors
// and attention factor), and those of `without` are far from them.
void ExpectHfReferenceLogits(const std::string& dir, const std::string& gguf, const std::string& without,
                             const std::string& what, const std::vector<int32_t>& ids = testing::kReferenceIds) {
  auto loaded = Model::Load(gguf, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const std::vector<float> ref = testing::HfReferenceLogits(dir, ids, (*loaded)->hparams().n_vocab, gguf + ".hf.npy");
  EXPECT_LE(testing::EngineLogitGap(gguf, ids, ref).max_diff, 1e-3)
      << "the engine on " << gguf << " against the HF reference on " << dir;
  EXPECT_GT(testing::EngineLogitGap(without, ids, ref).max_diff, 0.1) << "without " << what << " the logits differ";
}

// The logits of every token of `ids` on `gguf`: in one batch, or fed one token at a time (F32 or F16 KV cache).
std::vector<float> EngineLogits(const std::string& gguf, const std::vector<int32_t>& ids, bool one_by_one,
                                KvType kv_type) {
  auto model = Model::Load(gguf, {});
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return {};
  const auto nv = static_cast<size_t>((*model)->hparams().n_vocab);
  ThreadPool pool(2);
  InferenceContext ctx(**model, &pool, static_cast<int64_t>(ids.size()), kv_type);
  std::vector<float> out(ids.size() * nv);
  if (!one_by_one) {
    EXPECT_TRUE(ctx.Eval(ids, true).ok());
    for (size_t t = 0; t < ids.size(); ++t) std::copy_n(ctx.logits(static_cast<int64_t>(t)), nv, &out[t * nv]);
    return out;
  }
  for (size_t t = 0; t < ids.size(); ++t) {
    EXPECT_TRUE(ctx.Eval(std::span<const int32_t>(&ids[t], 1), false).ok());
    std::copy_n(ctx.logits(), nv, &out[t * nv]);
  }
  return out;
}

// `tensor` of `model` one value short (a GGUF source made elsewhere): the engine refuses its shape, and so does a
// conversion of it (the writer's check), each naming the tensor, `got` and `want` elements.
void ExpectShortTensorRefused(const std::string& model, const std::string& tensor, uint64_t got, uint64_t want) {
  const std::string bad = model + ".short.gguf";
  ASSERT_EQ(testing::RewriteGguf(model, bad, nullptr,
                                 [&](testing::GgufTensorCopy* c) {
                                   if (c->name != tensor) return;
                                   c->dims = {c->dims[0] - 1};
                                   c->bytes.resize(c->bytes.size() - sizeof(float));
                                 }),
            "");
  auto refused = Model::Load(bad, {});
  ASSERT_FALSE(refused.ok());
  const std::string shape = "[" + std::to_string(got) + "], expected [" + std::to_string(want) + "]";
  EXPECT_NE(refused.status().message().find(tensor + " has shape " + shape), std::string::npos)
      << refused.status().ToString();
  const Status s = ConvertTo(ReadGgufModel(bad), bad + ".converted.gguf");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(tensor + " has dims " + shape), std::string::npos) << s.ToString();
}

// Llama 3's RoPE scaling (rope_scaling type "llama3", as Llama 3.1 and 3.2 ship it): the converter writes one
// factor per rotary pair into rope_freqs.weight (llama.cpp's form), and the engine's logits are the NumPy reference's,
// which reads the factors from the file and applies them on its own; without them the logits are far from it.
TEST(HfConvert, Llama3RopeScalingMatchesTheNumpyReference) {
  testing::TempDir tmp;
  // Stories: head_dim 8, so 4 rotary pairs with wavelengths 2 pi x 1, 10, 100, 1000 against 64 / 4 and 64 / 1: one
  // pair kept, one interpolated, two slowed by the factor.
  HfOptions o;
  o.rope_scaling = R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64})";
  const std::string scaled = ConvertStoriesHf(tmp, "scaled", o), plain = ConvertStoriesHf(tmp, "plain", {});

  // The factors against transformers' form of the rule (the scaled inverse frequency itself, not the factor).
  auto f = GgufFile::OpenPath(scaled);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufTensorInfo* t = f->FindTensor("rope_freqs.weight");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->dims, (std::vector<uint64_t>{4}));
  ASSERT_EQ(t->type, GgmlType::kF32);
  std::vector<uint8_t> raw = TensorBytes(*f, "rope_freqs.weight");
  std::vector<float> factors(4);
  std::memcpy(factors.data(), raw.data(), 16);
  for (int i = 0; i < 4; ++i) {
    const double inv = std::pow(10000.0, -2.0 * i / 8.0), wavelen = 2 * M_PI / inv;
    double scaled_inv = inv;
    if (wavelen > 64.0) {
      scaled_inv = inv / 8.0;
    } else if (wavelen >= 16.0) {
      const double smooth = (64.0 / wavelen - 1.0) / (4.0 - 1.0);
      scaled_inv = (1 - smooth) * inv / 8.0 + smooth * inv;
    }
    EXPECT_NEAR(factors[i], inv / scaled_inv, 1e-5 * inv / scaled_inv) << "pair " << i;
  }
  EXPECT_EQ(factors[0], 1.0f);
  EXPECT_GT(factors[1], 1.0f);
  EXPECT_LT(factors[1], 8.0f);
  EXPECT_EQ(factors[3], 8.0f);
  auto pf = GgufFile::OpenPath(plain);
  ASSERT_TRUE(pf.ok());
  EXPECT_EQ(pf->FindTensor("rope_freqs.weight"), nullptr);

  auto loaded = Model::Load(scaled, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_NE((*loaded)->rope_freqs(), nullptr);
  ExpectReferenceLogits(scaled, plain, "the factors");
  ExpectHfReferenceLogits(tmp.File("scaled"), scaled, plain, "the factors");  // transformers' form, on the HF weights

  // A factor that is not a positive number is refused on load, naming the element.
  const std::string bad = tmp.File("bad.gguf");
  ASSERT_EQ(testing::RewriteGguf(scaled, bad, nullptr,
                                 [](testing::GgufTensorCopy* c) {
                                   if (c->name != "rope_freqs.weight") return;
                                   const float zero = 0.0f;
                                   std::memcpy(c->bytes.data() + 2 * sizeof(float), &zero, sizeof(float));
                                 }),
            "");
  auto refused = Model::Load(bad, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kCorruption);
  EXPECT_NE(refused.status().message().find("rope_freqs.weight[2] is 0"), std::string::npos)
      << refused.status().ToString();
  ExpectShortTensorRefused(scaled, "rope_freqs.weight", 3, 4);
}

// Qwen2: Llama with biases on q, k and v. They land in blk.N.attn_{q,k,v}.bias in GGUF's interleaved order (q and k
// permuted like their rows: compared with the pattern the directory was made from), and the engine's logits are the
// NumPy reference's, which adds the biases on its own; without them the logits are far from it.
TEST(HfConvert, Qwen2AttentionBiasesMatchTheNumpyReference) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen2ForCausalLM";
  o.qkv_bias = true;
  const std::string qwen = ConvertStoriesHf(tmp, "qwen2", o), plain = ConvertStoriesHf(tmp, "plain", {});
  auto f = GgufFile::OpenPath(qwen);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const Stories& st = GetStories();
  const uint64_t kv_dim = st.dim / st.n_heads * st.n_kv_heads;
  for (int l = 0; l < st.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    EXPECT_TRUE(TensorBytes(*f, p + "attn_q.bias") == FloatBytes(StoriesBias(l, 0, st.dim))) << l;
    EXPECT_TRUE(TensorBytes(*f, p + "attn_k.bias") == FloatBytes(StoriesBias(l, 1, kv_dim))) << l;
    EXPECT_TRUE(TensorBytes(*f, p + "attn_v.bias") == FloatBytes(StoriesBias(l, 2, kv_dim))) << l;
  }
  auto loaded = Model::Load(qwen, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_NE((*loaded)->layers()[0].bq, nullptr);
  ExpectReferenceLogits(qwen, plain, "the biases");
  ExpectHfReferenceLogits(tmp.File("qwen2"), qwen, plain, "the biases");
  ExpectShortTensorRefused(qwen, "blk.1.attn_k.bias", 31, 32);

  // Qwen2 without its biases: the missing tensors are named. A sliding window: refused.
  o.qkv_bias = false;
  ExpectBadDirectory(o, {"model.layers.0.self_attn.q_proj.bias"});
  auto sliding = ParseHfConfig(R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8, "max_position_embeddings": 512,
    "vocab_size": 512, "rms_norm_eps": 1e-06, "use_sliding_window": true})",
                               "config.json");
  ASSERT_FALSE(sliding.ok());
  EXPECT_NE(sliding.status().message().find("use_sliding_window"), std::string::npos) << sliding.status().ToString();
}

// Mistral v0.1's sliding window: config.json's sliding_window becomes llama.attention.sliding_window, and the
// engine's logits are the NumPy reference's, which hides keys W or more positions back on its own; the same model
// without the window is far from it. 320 tokens under a window of 70 cross the key cache's blocks of 64 positions,
// the window starting inside one, and wrap its ring of 192 positions; fed one token at a time the engine gives the
// batch's logits bit for bit, with an F32 and an F16 KV cache.
TEST(HfConvert, SlidingWindowMatchesTheNumpyReference) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "MistralForCausalLM";
  o.extra_config = R"("sliding_window": 70,)";
  const std::string windowed = ConvertStoriesHf(tmp, "mistral", o), plain = ConvertStoriesHf(tmp, "plain", {});
  auto f = GgufFile::OpenPath(windowed);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto w = f->GetUint("llama.attention.sliding_window");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(*w, 70u);
  auto pf = GgufFile::OpenPath(plain);
  ASSERT_TRUE(pf.ok());
  EXPECT_EQ(pf->Find("llama.attention.sliding_window"), nullptr);
  auto loaded = Model::Load(windowed, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->hparams().sliding_window, 70);
  const testing::CommandResult inspected = testing::RunCommand(testing::NflashBinary() + " inspect " + windowed + " --json");
  ASSERT_EQ(inspected.exit_code, 0) << inspected.output;
  EXPECT_EQ(nlohmann::json::parse(inspected.output)["hyper_parameters"].value("attention.sliding_window", 0), 70)
      << inspected.output;

  // 320 tokens: the KV cache becomes a ring of 70 + 64 positions rounded up to whole blocks of 64, which wraps.
  std::vector<int32_t> ids;
  for (int r = 0; r < 10; ++r) ids.insert(ids.end(), testing::kReferenceIds.begin(), testing::kReferenceIds.end());
  ThreadPool pool(1);
  InferenceContext ring(**loaded, &pool, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(ring.kv_positions(), 192);
  auto plain_model = Model::Load(plain, {});
  ASSERT_TRUE(plain_model.ok());
  InferenceContext full(**plain_model, &pool, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(full.kv_positions(), 320);
  EXPECT_LT(ring.state_bytes(), full.state_bytes());
  ExpectReferenceLogits(windowed, plain, "the window", ids);
  ExpectHfReferenceLogits(tmp.File("mistral"), windowed, plain, "the window", ids);
  for (KvType kv : {KvType::kF32, KvType::kF16}) {
    EXPECT_TRUE(EngineLogits(windowed, ids, true, kv) == EngineLogits(windowed, ids, false, kv))
        << "token by token against one batch, " << (kv == KvType::kF16 ? "F16" : "F32") << " KV cache";
  }
  // Converting the GGUF again keeps the window. A negative one (an int32 key) is refused by the converter and the
  // engine, each naming the key.
  const std::string again = tmp.File("again.gguf");
  const Status converted = ConvertTo(ReadGgufModel(windowed), again);
  ASSERT_TRUE(converted.ok()) << converted.ToString();
  ExpectSameModel(windowed, again);
  const std::string negative = tmp.File("negative.gguf");
  ASSERT_EQ(testing::RewriteGguf(windowed, negative,
                                 testing::SetGgufKey("llama.attention.sliding_window", GgufValue(int32_t{-1})), nullptr),
            "");
  auto refused_gguf = ReadGgufModel(negative);
  ASSERT_FALSE(refused_gguf.ok());
  EXPECT_NE(refused_gguf.status().message().find("llama.attention.sliding_window is -1"), std::string::npos)
      << refused_gguf.status().ToString();
  auto refused_model = Model::Load(negative, {});
  ASSERT_FALSE(refused_model.ok());
  EXPECT_NE(refused_model.status().message().find("llama.attention.sliding_window"), std::string::npos)
      << refused_model.status().ToString();

  // A window of null, as Mistral v0.2 writes it: none.
  o.extra_config = R"("sliding_window": null,)";
  ExpectSameModel(ConvertStoriesHf(tmp, "v02", o), plain);
  o.extra_config = R"("sliding_window": -4,)";
  const std::string bad = tmp.File("bad");
  ASSERT_EQ(::mkdir(bad.c_str(), 0755), 0);
  WriteStoriesHf(bad, o);
  auto refused = ReadHfDirectory(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("field \"sliding_window\": expected null or a positive number"),
            std::string::npos)
      << refused.status().ToString();
}

// A Phi3ForCausalLM config.json of stories260K's shape with the members `extra`: refused, the message holding `want`.
void ExpectPhi3ConfigRefused(const std::string& extra, const std::string& want) {
  auto r = ParseHfConfig(R"({"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
    "num_hidden_layers": 5, "num_attention_heads": 8, "max_position_embeddings": 512, "vocab_size": 512,
    "rms_norm_eps": 1e-05, )" + extra + "}",
                         "config.json");
  ASSERT_FALSE(r.ok()) << extra;
  EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().ToString();
}

// The JSON object a `nflash ... --json` command printed (EXPECT failure when it failed).
nlohmann::json CliJson(const testing::CommandResult& r) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t brace = r.output.find('{');
  return brace == std::string::npos ? nlohmann::json::object() : nlohmann::json::parse(r.output.substr(brace));
}

// The in-memory sparse engine's greedy text (oracle active set) of `n` tokens after "Once upon a time" on `model`.
std::string InMemoryText(const std::string& model, int n) {
  return CliJson(testing::RunCommand(testing::NflashBinary() + " -q run -m " + model +
                                     " --sparse oracle -p 'Once upon a time' -n " + std::to_string(n) +
                                     " --temp 0 --json"))
      .value("text", "");
}

// `model` profiled on the calibration text and packed into tmp/deploy, whose path it returns.
std::string ProfileAndPack(const testing::TempDir& tmp, const std::string& model) {
  const std::string nf = testing::NflashBinary();
  auto p = testing::RunCommand(nf + " -q profile -m " + model + " -f " +
                               testing::SharedPath("text/tinystories_calib.txt") + " --tokens 2000 -t 2 -o " +
                               tmp.File("m.prof"));
  EXPECT_EQ(p.exit_code, 0) << p.output;
  auto k = testing::RunCommand(nf + " -q pack -m " + model + " -p " + tmp.File("m.prof") + " -o " + tmp.File("deploy"));
  EXPECT_EQ(k.exit_code, 0) << k.output;
  return tmp.File("deploy");
}

// `model` profiled, packed and decoded from flash under `memory` (oracle active set, 40 tokens after "Once upon a
// time"): its text equals the in-memory sparse engine's, which is returned.
std::string ExpectOffloadedAsInMemory(const testing::TempDir& tmp, const std::string& model, const std::string& memory) {
  const std::string in_memory = InMemoryText(model, 40);
  EXPECT_FALSE(in_memory.empty()) << model;
  const std::string deploy = ProfileAndPack(tmp, model);
  const std::string offloaded = CliJson(testing::RunCommand(testing::NflashBinary() + " -q offload -d " + deploy +
                                                            " --active-set oracle -p 'Once upon a time' -n 40 --json "
                                                            "--memory " + memory)).value("text", "");
  EXPECT_EQ(offloaded, in_memory) << model;
  return in_memory;
}

// Qwen3: Qwen2 without biases, with each head of q and k RMS-normalised (its own weights) before RoPE. Written as
// llama.cpp's qwen3 architecture (keys under "qwen3."; the llama one has no place for the norms): the q and k rows
// and the norms as the checkpoint stores them (compared with the directory's own values), for NEOX RoPE. The engine's
// logits on it are the HF reference's, and those of the llama file of the same weights without the norms are far
// from them; the same rows rotated as llama pairs would be too. A ReLU Qwen3, profiled and packed, decodes from flash
// (oracle active set) to the in-memory sparse engine's text.
TEST(HfConvert, Qwen3QkNormsMatchTheHfReference) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen3ForCausalLM";
  o.qk_norm = true;
  o.head_dim = 16;  // wider than hidden / heads, as Qwen3's (128 over 1024 / 16 in Qwen3-0.6B)
  const std::string qwen3 = ConvertStoriesHf(tmp, "qwen3", o);
  auto f = GgufFile::OpenPath(qwen3);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*f->GetString("general.architecture"), "qwen3");
  EXPECT_EQ(*f->GetUint("qwen3.attention.key_length"), 16u);
  EXPECT_EQ(f->Find("llama.embedding_length"), nullptr);
  const Stories& st = GetStories();
  const int hd0 = st.dim / st.n_heads;
  const uint64_t q_dim = 16 * uint64_t(st.n_heads);
  EXPECT_TRUE(TensorBytes(*f, "blk.2.attn_q.weight") ==
              FloatBytes(ToHfRopeOrder(WidenHeadRows(st.wq[2], st.n_heads, hd0, 16, st.dim, 6), st.n_heads, q_dim,
                                       uint64_t(st.dim))));
  EXPECT_TRUE(TensorBytes(*f, "blk.3.attn_q_norm.weight") == FloatBytes(QkNormWeights(3, 0, 16)));
  EXPECT_TRUE(TensorBytes(*f, "blk.1.attn_k_norm.weight") == FloatBytes(QkNormWeights(1, 1, 16)));
  auto loaded = Model::Load(qwen3, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE((*loaded)->hparams().rope_neox);
  EXPECT_NE((*loaded)->layers()[0].q_norm, nullptr);
  HfOptions wide;
  wide.head_dim = 16;
  ExpectHfReferenceLogits(tmp.File("qwen3"), qwen3, ConvertStoriesHf(tmp, "wide", wide), "the q/k norms");
  // The same file relabelled qwen2 (no norms; NEOX RoPE): refused, as the norms belong to qwen3 only.
  const std::string as_qwen2 = tmp.File("as-qwen2.gguf");
  ASSERT_EQ(testing::RewriteGguf(qwen3, as_qwen2,
                                 [](std::vector<std::pair<std::string, GgufValue>>* kv) {
                                   for (auto& [key, value] : *kv) {
                                     if (key == "general.architecture") value = GgufValue(std::string("qwen2"));
                                     if (key.rfind("qwen3.", 0) == 0) key = "qwen2." + key.substr(6);
                                   }
                                 },
                                 nullptr),
            "");
  auto refused = Model::Load(as_qwen2, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_CONTAINS(refused.status().message(), "attn_q_norm.weight or attn_k_norm.weight in a qwen2 model");
  ExpectShortTensorRefused(qwen3, "blk.1.attn_k_norm.weight", 15, 16);

  // Without its norms, with biases (which would include o_proj's), or without head_dim (Qwen3Config's 128, which
  // these weights do not have): refused, naming the tensor or field.
  o.qk_norm = false;
  ExpectBadDirectory(o, {"model.layers.0.self_attn.q_norm.weight"});
  o.qk_norm = true;
  o.extra_config = R"("attention_bias": true,)";
  ExpectBadDirectory(o, {"field \"attention_bias\" is true: Qwen3's attention biases include o_proj's"});
  o.extra_config.clear();
  o.head_dim = 0;
  o.qk_norm = false;
  ExpectBadDirectory(o, {"model.layers.0.self_attn.q_proj.weight"});

  HfOptions relu = o;
  relu.qk_norm = true;
  relu.head_dim = 16;
  relu.hidden_act = "relu";
  const std::string in_memory = ExpectOffloadedAsInMemory(tmp, ConvertStoriesHf(tmp, "qwen3-relu", relu), "3M");
  relu.architecture = "LlamaForCausalLM";
  relu.qk_norm = false;
  EXPECT_NE(in_memory, InMemoryText(ConvertStoriesHf(tmp, "llama-relu", relu), 40)) << "the norms change the text";
}

// Qwen3-MoE (Qwen3-30B-A3B's architecture): Qwen3's attention, every FFN a router over experts of
// moe_intermediate_size, the chosen experts weighted by their renormalised softmax. Written as llama.cpp's qwen3moe
// (experts stacked in ffn_{gate,up,down}_exps, expert_feed_forward_length); the engine's logits on it are the HF
// reference's (Qwen3MoeSparseMoeBlock), and those of the dense Qwen3 with stories' own FFN are far from them. Configs
// the runtime would compute otherwise are refused, naming the field. A ReLU Qwen3-MoE, profiled and packed (each
// expert its own region), decodes from flash (oracle active set) to the in-memory sparse engine's text.
TEST(HfConvert, Qwen3MoeMatchesTheHfReference) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen3MoeForCausalLM";
  o.qk_norm = true;
  o.head_dim = 16;
  o.moe_experts = 4;
  const std::string moe = ConvertStoriesHf(tmp, "qwen3moe", o);
  auto f = GgufFile::OpenPath(moe);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const Stories& st = GetStories();
  EXPECT_EQ(*f->GetString("general.architecture"), "qwen3moe");
  EXPECT_EQ(*f->GetUint("qwen3moe.expert_count"), 4u);
  EXPECT_EQ(*f->GetUint("qwen3moe.expert_used_count"), 2u);
  EXPECT_EQ(*f->GetUint("qwen3moe.expert_feed_forward_length"), uint64_t(st.hidden));
  // Expert 2 of layer 1 is the third block of the stacked gate tensor.
  const std::vector<uint8_t> gates = TensorBytes(*f, "blk.1.ffn_gate_exps.weight");
  const std::vector<uint8_t> want = FloatBytes(ExpertWeights(st.w1[1], 2, 1));
  ASSERT_EQ(gates.size(), 4 * want.size());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), gates.begin() + 2 * static_cast<std::ptrdiff_t>(want.size())));
  auto loaded = Model::Load(moe, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->hparams().n_experts, 4);
  HfOptions dense = o;
  dense.architecture = "Qwen3ForCausalLM";
  dense.moe_experts = 0;
  ExpectHfReferenceLogits(tmp.File("qwen3moe"), moe, ConvertStoriesHf(tmp, "qwen3", dense), "the experts");

  for (const auto& [config, message] : std::vector<std::pair<std::string, std::string>>{
           {R"("norm_topk_prob": false,)", "field \"norm_topk_prob\" is false: only true is supported"},
           {R"("norm_topk_prob": true, "decoder_sparse_step": 2,)", "field \"decoder_sparse_step\": expected 1"},
           {R"("norm_topk_prob": true, "mlp_only_layers": [1],)", "field \"mlp_only_layers\": expected []"}}) {
    HfOptions bad = o;
    bad.extra_config = config;
    ExpectBadDirectory(bad, {message});
  }

  HfOptions relu = o;
  relu.hidden_act = "relu";
  ExpectOffloadedAsInMemory(tmp, ConvertStoriesHf(tmp, "qwen3moe-relu", relu), "4M");
}

// Phi-3: Llama with q, k, v fused into qkv_proj and gate, up into gate_up_proj. Split by rows they give the very
// file of the Llama layout (every tensor's bytes and every llama.* key), and the engine's logits on it are those of
// the HF reference on the fused directory.
TEST(HfConvert, Phi3FusedProjectionsGiveTheLlamaFile) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Phi3ForCausalLM";
  o.fused = true;
  o.extra_config = R"("sliding_window": null, "original_max_position_embeddings": 512,)";
  const std::string phi3 = ConvertStoriesHf(tmp, "phi3", o), llama = ConvertStoriesHf(tmp, "llama", {});
  ExpectSameModel(phi3, llama);
  HfOptions relu;
  relu.hidden_act = "relu";
  ExpectHfReferenceLogits(tmp.File("phi3"), phi3, ConvertStoriesHf(tmp, "relu", relu), "the FFN's gate");

  // The unfused names under Phi3ForCausalLM: the fused tensors are reported missing, each once.
  o.fused = false;
  ExpectBadDirectory(o, {"10 required tensor(s) missing: model.layers.0.self_attn.qkv_proj.weight, "
                         "model.layers.0.mlp.gate_up_proj.weight, model.layers.1"});
  // Phi-4-mini's partial rotary embedding: refused, naming the field.
  ExpectPhi3ConfigRefused(R"("partial_rotary_factor": 0.75)", "\"partial_rotary_factor\" is 0.75");
}

// A Phi-3 with LongRoPE (short and long factors for head_dim 8, context 512 over an original 64) and a sliding window
// of 20.
HfOptions Phi3LongRope() {
  HfOptions o;
  o.architecture = "Phi3ForCausalLM";
  o.fused = true;
  o.rope_scaling = R"({"type": "longrope", "short_factor": [1.0, 1.5, 3.0, 7.0], "long_factor": [1.0, 2.0, 4.0, 8.0]})";
  o.extra_config = R"("sliding_window": 20, "original_max_position_embeddings": 64,)";
  return o;
}

// Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5-mini), within original_max_position_embeddings: the short factors are
// written as rope_freqs.weight and the attention factor (here sqrt(1 + ln 8 / ln 64), from max_position_embeddings
// 512 over 64) is folded into q and k; the engine's logits on the file are the HF reference's, which multiplies cos
// and sin by the factor on the checkpoint as stored, with a sliding window of 20 on top; the context is capped at 64.
// The model without LongRoPE is far from it, and so is the file converted with the factor left out.
TEST(HfConvert, Phi3LongRopeMatchesTheHfReference) {
  testing::TempDir tmp;
  HfOptions o = Phi3LongRope();
  const std::string phi3 = ConvertStoriesHf(tmp, "phi3", o);
  o.extra_config = R"("original_max_position_embeddings": 64,)";
  const std::string no_window = ConvertStoriesHf(tmp, "no_window", o);
  auto f = GgufFile::OpenPath(phi3);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::vector<uint8_t> raw = TensorBytes(*f, "rope_freqs.weight");
  ASSERT_EQ(raw.size(), 16u);
  Floats factors(4);
  std::memcpy(factors.data(), raw.data(), 16);
  EXPECT_EQ(factors, (Floats{1.0f, 1.5f, 3.0f, 7.0f}));
  EXPECT_EQ(*f->GetUint("llama.context_length"), 64u);
  EXPECT_EQ(*f->GetUint("llama.attention.sliding_window"), 20u);
  // q (and k) scaled by the attention factor: element by element against the unscaled Llama conversion.
  const std::string llama = ConvertStoriesHf(tmp, "llama", {});
  auto lf = GgufFile::OpenPath(llama);
  ASSERT_TRUE(lf.ok());
  const double attention = std::sqrt(1.0 + std::log(8.0) / std::log(64.0));
  for (const char* name : {"blk.2.attn_q.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight"}) {
    std::vector<uint8_t> a = TensorBytes(*f, name), b = TensorBytes(*lf, name);
    ASSERT_EQ(a.size(), b.size());
    Floats x(a.size() / 4), y(b.size() / 4);
    std::memcpy(x.data(), a.data(), a.size());
    std::memcpy(y.data(), b.data(), b.size());
    const double want = std::string(name).find("attn_v") == std::string::npos ? attention : 1.0;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], y[i] * want, 1e-6 * std::fabs(y[i]) + 1e-9) << name << i;
  }
  ExpectHfReferenceLogits(tmp.File("phi3"), phi3, llama, "LongRoPE");
  ExpectHfReferenceLogits(tmp.File("no_window"), no_window, phi3, "the window");

  // An attention factor given in rope_scaling replaces the computed one; the HF reference agrees, and the file
  // converted with the computed one is far from it.
  o.rope_scaling = R"({"type": "longrope", "short_factor": [1.0, 1.5, 3.0, 7.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
                       "attention_factor": 1.7})";
  const std::string given = ConvertStoriesHf(tmp, "given", o);
  ExpectHfReferenceLogits(tmp.File("given"), given, no_window, "the given attention factor");

  // Factors of the wrong length, or a missing original_max_position_embeddings: refused, naming the field.
  ExpectPhi3ConfigRefused(R"("original_max_position_embeddings": 64,
    "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1], "long_factor": [1, 1, 1, 1]})",
                          "\"short_factor\" must be a list of head_dim / 2 = 4 numbers");
  ExpectPhi3ConfigRefused(R"("rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1]})",
                          "missing required field \"original_max_position_embeddings\"");
}

// The offloaded runtime reads the new tensors from the deployment's resident part: a Qwen2 model with Llama 3 RoPE
// scaling and a ReLU FFN, profiled and packed, decodes from flash (oracle active set) to the text of the in-memory
// sparse engine on the GGUF itself, which the reference tests above tie to the NumPy reference; the same text
// without the biases and factors differs.
TEST(HfConvert, BiasesAndRopeFactorsReachTheOffloadedRuntime) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen2ForCausalLM";
  o.qkv_bias = true;
  o.hidden_act = "relu";
  o.rope_scaling = R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64})";
  const std::string model = ConvertStoriesHf(tmp, "qwen2-llama3", o);
  HfOptions plain_options;
  plain_options.hidden_act = "relu";
  const std::string plain = ConvertStoriesHf(tmp, "plain", plain_options);
  const std::string nf = testing::NflashBinary();
  const std::string in_memory = InMemoryText(model, 40);
  ASSERT_FALSE(in_memory.empty());
  EXPECT_NE(in_memory, InMemoryText(plain, 40)) << "the biases and factors change the text";
  const std::string deploy = ProfileAndPack(tmp, model);
  for (const char* args : {"--memory 3M", "--hot-slots 0 --cold-slots 0"}) {
    const std::string offloaded = CliJson(testing::RunCommand(nf + " -q offload -d " + deploy +
                                                              " --active-set oracle -p 'Once upon a time' -n 40 --json " +
                                                              args)).value("text", "");
    EXPECT_EQ(offloaded, in_memory) << args;
  }
}

// The sliding window through a deployment: a ReLU Phi-3 with a window of 40, profiled and packed, decodes 300 tokens
// from flash (oracle active set, past its KV ring of 128 positions) to the text of the in-memory sparse engine on the
// GGUF, which the reference tests above tie to both NumPy references; the memory it accounts for the KV cache is the
// ring's, and the same model without the window writes other text.
TEST(HfConvert, SlidingWindowReachesTheOffloadedRuntime) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Phi3ForCausalLM";
  o.fused = true;
  o.hidden_act = "relu";
  o.extra_config = R"("sliding_window": 40,)";
  const std::string model = ConvertStoriesHf(tmp, "phi3", o);
  o.extra_config = R"("sliding_window": null,)";
  const std::string plain = ConvertStoriesHf(tmp, "plain", o);
  const std::string nf = testing::NflashBinary();
  const std::string in_memory = InMemoryText(model, 300);
  ASSERT_FALSE(in_memory.empty());
  EXPECT_NE(in_memory, InMemoryText(plain, 300)) << "the window changes the text";
  const std::string deploy = ProfileAndPack(tmp, model);
  const nlohmann::json offloaded = CliJson(testing::RunCommand(
      nf + " -q offload -d " + deploy + " --active-set oracle -p 'Once upon a time' -n 300 --json --memory 3M"));
  EXPECT_EQ(offloaded.value("text", ""), in_memory);
  EXPECT_EQ(offloaded.value("generated", 0), 300) << "positions past the ring's 128";
  const Stories& st = GetStories();
  const uint64_t kv_dim = st.dim / st.n_heads * st.n_kv_heads;
  EXPECT_EQ(offloaded.value("kv_cache_bytes", uint64_t{0}), uint64_t(st.n_layers) * 128 * kv_dim * 2 * sizeof(float));
}

// A head size other than hidden_size / num_attention_heads (Mistral Nemo: 32 heads of 128 over 5120): stories' heads
// widened to 16 rows each (q 8 x 16 = 128 rows over a hidden size of 64, k and v 4 x 16, o_proj 128 columns). The
// converter writes llama.attention.key_length and value_length (llama.cpp's keys) and the wider tensors; the engine's
// logits on the file are the HF reference's on the directory and the GGUF reference's on the file (each reads the head
// size on its own), and the plain stories model's are far from them. Through a deployment, a ReLU version decodes
// from flash (oracle active set) to the in-memory sparse engine's text.
TEST(HfConvert, HeadSizeOtherThanHiddenOverHeads) {
  testing::TempDir tmp;
  HfOptions o;
  o.head_dim = 16;
  const std::string wide = ConvertStoriesHf(tmp, "wide", o), plain = ConvertStoriesHf(tmp, "plain", {});
  auto f = GgufFile::OpenPath(wide);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*f->GetUint("llama.attention.key_length"), 16u);
  EXPECT_EQ(*f->GetUint("llama.attention.value_length"), 16u);
  EXPECT_EQ(*f->GetUint("llama.rope.dimension_count"), 16u);
  EXPECT_EQ(f->FindTensor("blk.0.attn_q.weight")->dims, (std::vector<uint64_t>{64, 128}));
  EXPECT_EQ(f->FindTensor("blk.0.attn_k.weight")->dims, (std::vector<uint64_t>{64, 64}));
  EXPECT_EQ(f->FindTensor("blk.0.attn_output.weight")->dims, (std::vector<uint64_t>{128, 64}));
  auto pf = GgufFile::OpenPath(plain);
  ASSERT_TRUE(pf.ok());
  EXPECT_EQ(pf->Find("llama.attention.key_length"), nullptr) << "written only when the heads are not dim / n_heads";
  auto loaded = Model::Load(wide, {});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ((*loaded)->hparams().head_dim, 16);
  ExpectHfReferenceLogits(tmp.File("wide"), wide, plain, "the wider heads");
  ExpectReferenceLogits(wide, plain, "the wider heads");

  o.hidden_act = "relu";
  const std::string relu = ConvertStoriesHf(tmp, "wide-relu", o);
  const std::string in_memory = InMemoryText(relu, 60);
  ASSERT_FALSE(in_memory.empty());
  const nlohmann::json offloaded = CliJson(testing::RunCommand(
      testing::NflashBinary() + " -q offload -d " + ProfileAndPack(tmp, relu) +
      " --active-set oracle -p 'Once upon a time' -n 60 --json --memory 3M"));
  EXPECT_EQ(offloaded.value("text", ""), in_memory);
  const Stories& st = GetStories();
  EXPECT_EQ(offloaded.value("kv_cache_bytes", uint64_t{0}) % (uint64_t(st.n_layers) * 16 * st.n_kv_heads * 2 * 4), 0u);

  // An odd head size is refused, naming the field.
  auto odd = ParseHfConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
    "num_hidden_layers": 5, "num_attention_heads": 8, "max_position_embeddings": 512, "vocab_size": 512,
    "rms_norm_eps": 1e-05, "head_dim": 15})",
                           "config.json");
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("field \"head_dim\": expected a positive even number (RoPE rotates pairs), "
                                        "found 15"),
            std::string::npos)
      << odd.status().ToString();
}

TEST(HfConvert, ShardedWeightsGiveTheSameFile) {
  testing::TempDir tmp;
  const std::string single = tmp.File("single");
  const std::string sharded = tmp.File("sharded");
  ASSERT_EQ(::mkdir(single.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(sharded.c_str(), 0755), 0);
  WriteStoriesHf(single, {});
  HfOptions o;
  o.sharded = true;
  WriteStoriesHf(sharded, o);
  Status s = ConvertTo(ReadHfDirectory(single), tmp.File("single.gguf"));
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = ConvertTo(ReadHfDirectory(sharded), tmp.File("sharded.gguf"));
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectSameModel(tmp.File("single.gguf"), tmp.File("sharded.gguf"));
}

TEST(HfConvertErrors, TruncatedSafetensorsHeader) {
  HfOptions o;
  o.truncated_header = true;
  ExpectBadDirectory(o, {"model.safetensors", "header length"});
}

TEST(HfConvertErrors, TensorShapeMismatchWithConfig) {
  HfOptions o;
  o.transposed_gate = true;
  ExpectBadDirectory(o, {"model.layers.0.mlp.gate_proj.weight", "[64, 172]", "[172, 64]"});
}

TEST(HfConvertErrors, UnknownArchitecture) {
  HfOptions o;
  o.architecture = "GPTNeoXForCausalLM";
  ExpectBadDirectory(o, {"config.json", "GPTNeoXForCausalLM"});
}

TEST(HfConvertErrors, MissingTokenizer) {
  HfOptions o;
  o.tokenizer = false;
  ExpectBadDirectory(o, {"tokenizer.model", "tokenizer.json"});
}

TEST(HfConvertErrors, MissingTensor) {
  HfOptions o;
  o.drop_final_norm = true;
  ExpectBadDirectory(o, {"model.norm.weight", "missing"});
}

TEST(HfConvertErrors, MissingConfig) {
  testing::TempDir tmp;
  auto r = ReadHfDirectory(tmp.path());
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "config.json: no such file (not a HF model directory?)");
}

using testing::ReadText;

// `text` with its one occurrence of `from` replaced by `to` (the fixture's own JSON, edited to break one thing).
std::string ReplaceOnce(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

// A sharded directory broken one way at a time: each error names the file, the entry and what is wrong.
TEST(HfConvertErrors, BrokenShardIndexNamesTheEntry) {
  const std::string kIndex = "model.safetensors.index.json";
  const std::string kShard2 = "model-00002-of-00002.safetensors";
  struct Case {
    const char* what;
    std::function<void(const std::string& dir)> spoil;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"no weight_map", [&](const std::string& d) { testing::WriteText(d + "/" + kIndex, R"({"metadata":{}})"); },
       {kIndex, "missing object field \"weight_map\""}},
      {"not a file name",
       [&](const std::string& d) {
         testing::WriteText(d + "/" + kIndex, ReplaceOnce(ReadText(d + "/" + kIndex), "\"" + kShard2 + "\"", "5"));
       },
       {kIndex, "expected a file name, found 5"}},
      {"leaves the directory",
       [&](const std::string& d) {
         testing::WriteText(d + "/" + kIndex,
                            ReplaceOnce(ReadText(d + "/" + kIndex), kShard2 + "\"", "../" + kShard2 + "\""));
       },
       {kIndex, "../" + kShard2, "not a file name inside the model directory"}},
      {"absolute",
       [&](const std::string& d) {
         testing::WriteText(d + "/" + kIndex, ReplaceOnce(ReadText(d + "/" + kIndex), kShard2, "/etc/hostname"));
       },
       {kIndex, "/etc/hostname", "not a file name inside the model directory"}},
      {"missing shard", [&](const std::string& d) { std::filesystem::remove(d + "/" + kShard2); },
       {kIndex, kShard2, "which does not exist"}},
      {"tensor not in its shard",
       [&](const std::string& d) {
         const std::string text = ReadText(d + "/" + kIndex);
         testing::WriteText(d + "/" + kIndex, ReplaceOnce(text, "\"model.norm.weight\":\"" + kShard2,
                                                          "\"model.norm.weight\":\"model-00001-of-00002.safetensors"));
       },
       {kIndex, "weight_map[\"model.norm.weight\"]", "which has no such tensor"}},
      {"pytorch",
       [&](const std::string& d) {
         std::filesystem::remove(d + "/" + kIndex);
         testing::WriteText(d + "/pytorch_model.bin", "PK");
       },
       {"PyTorch .bin checkpoints are not supported"}},
      {"config not an object", [](const std::string& d) { testing::WriteText(d + "/config.json", "[1]"); },
       {"config.json", "expected a JSON object"}},
      {"no architectures",
       [](const std::string& d) {
         const std::string config = ReadText(d + "/config.json");
         testing::WriteText(d + "/config.json", ReplaceOnce(config, R"("architectures": ["LlamaForCausalLM"], )", ""));
       },
       {"config.json", "missing required field \"architectures\""}},
      {"vocabulary smaller than the tokenizer",
       [](const std::string& d) {
         testing::WriteText(d + "/config.json",
                            ReplaceOnce(ReadText(d + "/config.json"), R"("vocab_size": 512)", R"("vocab_size": 500)"));
       },
       {"the tokenizer has 512 tokens, more than config.json vocab_size 500"}},
  };
  for (const Case& c : cases) {
    testing::TempDir tmp;
    HfOptions o;
    o.sharded = true;
    WriteStoriesHf(tmp.path(), o);
    c.spoil(tmp.path());
    auto r = ReadHfDirectory(tmp.path());
    ASSERT_FALSE(r.ok()) << c.what;
    for (const std::string& p : c.message) EXPECT_CONTAINS(r.status().message(), p) << c.what;
  }
}

// ---- a tiny synthetic Mixtral ----

TEST(HfConvert, MixtralExpertsAreStacked) {
  constexpr int64_t kDim = 32, kHeads = 4, kKvHeads = 2, kFf = 24, kLayers = 2, kExperts = 2, kVocab = 8;
  constexpr int64_t kKvDim = kDim / kHeads * kKvHeads;
  std::mt19937 rng(20240607);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto random = [&](int64_t n) {
    Floats v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  auto bf16_exact = [&](int64_t n) {  // values exactly representable in BF16
    Floats v = random(n);
    for (float& x : v) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      u &= 0xFFFF0000u;
      std::memcpy(&x, &u, 4);
    }
    return v;
  };

  std::vector<HfTensor> t;
  const Floats emb = random(kVocab * kDim), head = random(kVocab * kDim), norm = random(kDim);
  t.push_back({"model.embed_tokens.weight", {kVocab, kDim}, emb});
  t.push_back({"lm_head.weight", {kVocab, kDim}, head});
  t.push_back({"model.norm.weight", {kDim}, norm});
  // [layer][expert]
  std::vector<std::vector<Floats>> w1(kLayers), w2(kLayers), w3(kLayers);
  std::vector<Floats> router(kLayers), q_gguf(kLayers), attn_norm(kLayers);
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    attn_norm[l] = bf16_exact(kDim);
    HfTensor an{p + "input_layernorm.weight", {kDim}, attn_norm[l]};
    an.bf16 = true;
    t.push_back(an);
    q_gguf[l] = random(kDim * kDim);
    t.push_back({p + "self_attn.q_proj.weight", {kDim, kDim}, ToHfRopeOrder(q_gguf[l], kHeads, kDim, kDim)});
    t.push_back({p + "self_attn.k_proj.weight", {kKvDim, kDim}, random(kKvDim * kDim)});
    t.push_back({p + "self_attn.v_proj.weight", {kKvDim, kDim}, random(kKvDim * kDim)});
    t.push_back({p + "self_attn.o_proj.weight", {kDim, kDim}, random(kDim * kDim)});
    t.push_back({p + "post_attention_layernorm.weight", {kDim}, random(kDim)});
    router[l] = random(kExperts * kDim);
    t.push_back({p + "block_sparse_moe.gate.weight", {kExperts, kDim}, router[l]});
    for (int64_t e = 0; e < kExperts; ++e) {
      const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      w1[l].push_back(random(kFf * kDim));
      w2[l].push_back(random(kDim * kFf));
      w3[l].push_back(random(kFf * kDim));
      t.push_back({x + "w1.weight", {kFf, kDim}, w1[l][e]});
      t.push_back({x + "w2.weight", {kDim, kFf}, w2[l][e]});
      t.push_back({x + "w3.weight", {kFf, kDim}, w3[l][e]});
    }
  }
  testing::TempDir dir;
  testing::WriteBytes(dir.File("model.safetensors"), SafetensorsBytes(t));
  testing::WriteText(dir.File("config.json"), R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 32,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "vocab_size": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "num_local_experts": 2, "num_experts_per_tok": 2, "sliding_window": null})");
  // A byte-level BPE tokenizer with 7 tokens: the eighth embedding row becomes [PAD7].
  testing::WriteText(dir.File("tokenizer.json"), R"({
    "added_tokens": [{"id": 6, "content": "<|endoftext|>", "special": true}],
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "\u0120": 5},
              "merges": [["a", "b"], ["ab", "c"]]}})");
  testing::WriteText(dir.File("tokenizer_config.json"), R"({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})");

  auto model = ReadHfDirectory(dir.path());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.n_experts, 2);
  EXPECT_EQ(c.n_experts_used, 2);
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_FALSE(c.tied_embeddings);
  const TokenizerData& tok = model->tokenizer;
  EXPECT_EQ(tok.model, "gpt2");
  EXPECT_EQ(tok.pre, "gpt-2");
  ASSERT_EQ(tok.tokens.size(), 8u);
  EXPECT_EQ(tok.tokens[7], "[PAD7]");
  EXPECT_EQ(tok.token_types[6], 3);
  EXPECT_EQ(tok.token_types[7], 5);
  EXPECT_EQ(tok.merges, (std::vector<std::string>{"a b", "ab c"}));
  EXPECT_EQ(tok.bos_id, 6);
  EXPECT_EQ(tok.eos_id, 6);

  // Expected stacked tensors, built here from the per-expert source arrays.
  std::map<std::string, std::pair<std::vector<uint64_t>, Floats>> want;
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    Floats gate, down, up;
    for (int64_t e = 0; e < kExperts; ++e) {
      gate.insert(gate.end(), w1[l][e].begin(), w1[l][e].end());
      down.insert(down.end(), w2[l][e].begin(), w2[l][e].end());
      up.insert(up.end(), w3[l][e].begin(), w3[l][e].end());
    }
    want[b + "ffn_gate_exps.weight"] = {{kDim, kFf, kExperts}, gate};
    want[b + "ffn_down_exps.weight"] = {{kFf, kDim, kExperts}, down};
    want[b + "ffn_up_exps.weight"] = {{kDim, kFf, kExperts}, up};
    want[b + "ffn_gate_inp.weight"] = {{kDim, kExperts}, router[l]};
    want[b + "attn_q.weight"] = {{kDim, kDim}, q_gguf[l]};
    want[b + "attn_norm.weight"] = {{kDim}, attn_norm[l]};
  }
  want["output.weight"] = {{kDim, kVocab}, head};

  size_t checked = 0;
  for (const SourceTensor& st : model->tensors) {
    auto it = want.find(st.name);
    if (it == want.end()) continue;
    ++checked;
    EXPECT_EQ(st.dims, it->second.first) << st.name;
    auto data = st.load_f32();
    ASSERT_TRUE(data.ok()) << st.name << ": " << data.status().ToString();
    EXPECT_EQ(*data, it->second.second) << st.name;
  }
  EXPECT_EQ(checked, want.size());
  EXPECT_EQ(model->tensors.size(), 1 + kLayers * 10 + 2u);

  // Through the writer: the GGUF holds the same bytes and the expert keys.
  const std::string out = dir.File("mixtral.gguf");
  Status s = ConvertTo(std::move(model), out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  auto f = GgufFile::OpenPath(out);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  for (const auto& [name, dims_data] : want) {
    const GgufTensorInfo* info = f->FindTensor(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dims, dims_data.first) << name;
    EXPECT_EQ(info->type, GgmlType::kF32) << name;
    EXPECT_TRUE(TensorBytes(*f, name) == FloatBytes(dims_data.second)) << name;
  }
  auto experts = f->GetUint("llama.expert_count");
  ASSERT_TRUE(experts.ok());
  EXPECT_EQ(*experts, 2u);
  auto used = f->GetUint("llama.expert_used_count");
  ASSERT_TRUE(used.ok());
  EXPECT_EQ(*used, 2u);
  auto tok_model = f->GetString("tokenizer.ggml.model");
  ASSERT_TRUE(tok_model.ok());
  EXPECT_EQ(*tok_model, "gpt2");
}

// `nflash inspect` of a safetensors file written here: the header length, file size, tensor offsets (in the file:
// after the 8-byte length and the header) and bytes, their sums overall and by dtype are the ones the writer above
// laid out (an F32 [3, 4] tensor, 48 bytes at data offset 0, a BF16 [8] one, 16 bytes at 48, an F32 [2] one, 8 bytes
// at 64), and the text view says the same.
TEST(HfInspect, SafetensorsFiguresAreTheWritersLayout) {
  testing::TempDir dir;
  const std::vector<HfTensor> t = {{"a.weight", {3, 4}, Floats(12, 0.5f), false},
                                   {"b.weight", {8}, Floats(8, 0.25f), true},
                                   {"c.weight", {2}, Floats(2, 1.0f), false}};
  const std::vector<uint8_t> bytes = SafetensorsBytes(t);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  const std::string path = dir.File("x.safetensors");
  testing::WriteBytes(path, bytes);
  auto r = testing::RunCommand(testing::NflashBinary() + " -q inspect --json --tensors " + path,
                               /*capture_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["format"], "safetensors");
  EXPECT_EQ(j["file_bytes"].get<uint64_t>(), bytes.size());
  EXPECT_EQ(j["header_bytes"].get<uint64_t>(), header);
  EXPECT_EQ(bytes.size(), 8 + header + 72);
  EXPECT_EQ(j["metadata"]["format"], "pt");
  EXPECT_EQ(j["tensor_count"], 3);
  EXPECT_EQ(j["tensor_bytes"].get<uint64_t>(), 72u);
  EXPECT_EQ(j["bytes_by_type"]["F32"]["count"], 2);
  EXPECT_EQ(j["bytes_by_type"]["F32"]["bytes"], 56);
  EXPECT_EQ(j["bytes_by_type"]["BF16"]["count"], 1);
  EXPECT_EQ(j["bytes_by_type"]["BF16"]["bytes"], 16);
  ASSERT_EQ(j["tensors"].size(), 3u);
  std::map<std::string, nlohmann::json> by_name;
  for (const auto& e : j["tensors"]) by_name[e["name"]] = e;
  EXPECT_EQ(by_name["a.weight"]["offset"].get<uint64_t>(), 8 + header);
  EXPECT_EQ(by_name["a.weight"]["bytes"], 48);
  EXPECT_EQ(by_name["a.weight"]["shape"], nlohmann::json::array({3, 4}));
  EXPECT_EQ(by_name["b.weight"]["offset"].get<uint64_t>(), 8 + header + 48);
  EXPECT_EQ(by_name["b.weight"]["bytes"], 16);
  EXPECT_EQ(by_name["b.weight"]["dtype"], "BF16");
  EXPECT_EQ(by_name["c.weight"]["offset"].get<uint64_t>(), 8 + header + 64);
  EXPECT_EQ(by_name["c.weight"]["bytes"], 8);
  r = testing::RunCommand(testing::NflashBinary() + " inspect " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "safetensors, " + std::to_string(bytes.size()) + " bytes, JSON header " +
                                std::to_string(header) + " bytes");
  EXPECT_CONTAINS(r.output, "tensors: 3, 72 bytes");
  // Metadata only: the header runs to the end of the file, and it is still a safetensors file.
  const std::vector<uint8_t> empty = SafetensorsBytes({});
  std::memcpy(&header, empty.data(), 8);
  ASSERT_EQ(empty.size(), 8 + header);
  testing::WriteBytes(path, empty);
  r = testing::RunCommand(testing::NflashBinary() + " -q inspect --json " + path, /*capture_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto e = nlohmann::json::parse(r.output);
  EXPECT_EQ(e["format"], "safetensors");
  EXPECT_EQ(e["tensor_count"], 0);
  EXPECT_EQ(e["tensor_bytes"], 0);
}


// tests/reference/llamacpp_gguf.py on the HF directory `dir`: llama.cpp's qwen2 or phi3 GGUF of it (2-D weights in
// `type`), its tokenizer keys taken from `tokenizer_from`. Returns the file's path.
std::string LlamaCppGguf(const std::string& dir, const std::string& tokenizer_from, const std::string& type) {
  const std::string out = dir + ".llamacpp-" + type + ".gguf";
  const testing::CommandResult r =
      testing::RunCommand(std::string(NFLASH_PYTHON) + " " + NFLASH_SOURCE_DIR + "/tests/reference/llamacpp_gguf.py" +
                          " --dir " + dir + " --out " + out + " --tokenizer-from " + tokenizer_from + " --type " + type);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

// `path` converted to `type` (with the writer's summary).
Status ConvertGguf(const std::string& path, const std::string& out, GgmlType type, WriteSummary* summary = nullptr) {
  auto model = ReadGgufModel(path);
  if (!model.ok()) return model.status();
  WriteOptions options;
  options.path = out;
  options.type = type;
  options.progress = false;
  return WriteModelGguf(*model, options, summary);
}

// Tensor `name` of `path` dequantized to F32.
Floats TensorF32(const std::string& path, const std::string& name) {
  auto f = GgufFile::OpenPath(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return {};
  const GgufTensorInfo* t = f->FindTensor(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  const std::vector<uint8_t> raw = TensorBytes(*f, name);
  const uint64_t row = t->dims[0], rows = t->n_elements / row;
  const uint64_t row_bytes = raw.size() / rows;
  Floats out(t->n_elements);
  for (uint64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(DequantizeRow(t->type, raw.data() + r * row_bytes, out.data() + r * row, int64_t(row)).ok());
  }
  return out;
}

// llama.cpp's qwen2 architecture (written by tests/reference/llamacpp_gguf.py from llama.cpp's conventions: NEOX
// RoPE, so the q and k rows and biases stay in the HF checkpoint's rotate-half order, keys under "qwen2."): converted,
// it is the file the HF reader makes of the same directory, tensor for tensor and byte for byte, and that file's
// logits are the HF reference's (HfConvert.Qwen2AttentionBiasesMatchTheNumpyReference). Its q rows as stored are not
// the llama layout's, so the comparison can fail. From Q8_0 weights, the rows are moved whole (copied, not
// requantized) and dequantize to exactly what the F32 conversion of the same file holds.
TEST(LlamaCppGguf, Qwen2GivesTheHfConversion) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen2ForCausalLM";
  o.qkv_bias = true;
  const std::string hf = ConvertStoriesHf(tmp, "qwen2", o);
  const std::string qwen2 = LlamaCppGguf(tmp.File("qwen2"), hf, "f32");
  auto src = GgufFile::OpenPath(qwen2);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  EXPECT_EQ(*src->GetString("general.architecture"), "qwen2");
  EXPECT_NE(src->Find("qwen2.attention.head_count_kv"), nullptr);
  auto hf_file = GgufFile::OpenPath(hf);
  ASSERT_TRUE(hf_file.ok());
  EXPECT_FALSE(TensorBytes(*src, "blk.1.attn_q.weight") == TensorBytes(*hf_file, "blk.1.attn_q.weight"));
  EXPECT_FALSE(TensorBytes(*src, "blk.1.attn_k.bias") == TensorBytes(*hf_file, "blk.1.attn_k.bias"));

  const std::string converted = tmp.File("qwen2-converted.gguf");
  ASSERT_TRUE(ConvertGguf(qwen2, converted, GgmlType::kF32).ok());
  ExpectSameModel(converted, hf);

  const std::string q8 = LlamaCppGguf(tmp.File("qwen2"), hf, "q8_0");
  const std::string as_q8 = tmp.File("q8-q8.gguf"), as_f32 = tmp.File("q8-f32.gguf");
  WriteSummary summary;
  const Status s = ConvertGguf(q8, as_q8, GgmlType::kQ8_0, &summary);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_TRUE(ConvertGguf(q8, as_f32, GgmlType::kF32).ok());
  EXPECT_GE(summary.raw_copies, size_t(GetStories().n_layers) * 7);  // q, k, v, o, gate, up, down of every layer
  for (const std::string name : {"blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.4.attn_v.weight",
                                 "blk.2.ffn_down.weight", "token_embd.weight"}) {
    const Floats a = TensorF32(as_q8, name), b = TensorF32(as_f32, name);
    ASSERT_EQ(a.size(), b.size()) << name;
    EXPECT_TRUE(a == b) << name;
  }
  EXPECT_FALSE(TensorF32(as_q8, "blk.0.attn_q.weight") == TensorF32(q8, "blk.0.attn_q.weight"));

  // With a head size other than hidden_size / heads, which llama.cpp writes as qwen2.attention.key_length.
  o.head_dim = 16;
  const std::string wide_hf = ConvertStoriesHf(tmp, "wide", o);
  const std::string wide = LlamaCppGguf(tmp.File("wide"), wide_hf, "f32");
  auto wf = GgufFile::OpenPath(wide);
  ASSERT_TRUE(wf.ok());
  EXPECT_EQ(*wf->GetUint("qwen2.attention.key_length"), 16u);
  const std::string wide_converted = tmp.File("wide-converted.gguf");
  ASSERT_TRUE(ConvertGguf(wide, wide_converted, GgmlType::kF32).ok());
  ExpectSameModel(wide_converted, wide_hf);
}

// llama.cpp's qwen2, qwen3 and qwen3moe files as they are: the engine reads them natively (keys under the
// architecture's prefix, NEOX RoPE on the rows as stored, Qwen3's q/k norms, qwen3moe's stacked experts and
// expert_feed_forward_length), and its logits on each are the HF reference's on the directory the file was made from
// (llamacpp_gguf.py, written from llama.cpp's conventions, not nflash's). qwen3 and qwen3moe files convert to the
// files the HF reader makes of the same directories, byte for byte and key for key (they keep their architecture);
// from Q8_0 weights, rows are copied, not requantized.
TEST(LlamaCppGguf, EngineReadsQwen2Qwen3AndQwen3MoeNatively) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Qwen2ForCausalLM";
  o.qkv_bias = true;
  const std::string qwen2_hf = ConvertStoriesHf(tmp, "qwen2", o);
  const std::string qwen2 = LlamaCppGguf(tmp.File("qwen2"), qwen2_hf, "f32");
  const std::string plain = ConvertStoriesHf(tmp, "plain", {});
  ExpectHfReferenceLogits(tmp.File("qwen2"), qwen2, plain, "the biases (qwen2 as llama.cpp writes it)");

  HfOptions q3;
  q3.architecture = "Qwen3ForCausalLM";
  q3.qk_norm = true;
  q3.head_dim = 16;
  const std::string qwen3_hf = ConvertStoriesHf(tmp, "qwen3", q3);
  const std::string qwen3 = LlamaCppGguf(tmp.File("qwen3"), qwen3_hf, "f32");
  auto src = GgufFile::OpenPath(qwen3);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  EXPECT_EQ(*src->GetString("general.architecture"), "qwen3");
  HfOptions wide;
  wide.head_dim = 16;
  ExpectHfReferenceLogits(tmp.File("qwen3"), qwen3, ConvertStoriesHf(tmp, "wide", wide),
                          "the q/k norms (qwen3 as llama.cpp writes it)");
  const std::string converted = tmp.File("qwen3-converted.gguf");
  ASSERT_TRUE(ConvertGguf(qwen3, converted, GgmlType::kF32).ok());
  ExpectSameModel(converted, qwen3_hf);

  HfOptions moe_options = q3;
  moe_options.architecture = "Qwen3MoeForCausalLM";
  moe_options.moe_experts = 4;
  const std::string moe_hf = ConvertStoriesHf(tmp, "qwen3moe", moe_options);
  const std::string moe = LlamaCppGguf(tmp.File("qwen3moe"), moe_hf, "f32");
  ExpectHfReferenceLogits(tmp.File("qwen3moe"), moe, qwen3_hf, "the experts (qwen3moe as llama.cpp writes it)");
  const std::string moe_converted = tmp.File("qwen3moe-converted.gguf");
  ASSERT_TRUE(ConvertGguf(moe, moe_converted, GgmlType::kF32).ok());
  ExpectSameModel(moe_converted, moe_hf);

  const std::string q8 = LlamaCppGguf(tmp.File("qwen3"), qwen3_hf, "q8_0");
  const std::string as_q8 = tmp.File("q8-q8.gguf");
  WriteSummary summary;
  const Status s = ConvertGguf(q8, as_q8, GgmlType::kQ8_0, &summary);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(summary.raw_copies, size_t(GetStories().n_layers) * 7);  // q, k, v, o, gate, up, down of every layer
  for (const std::string name : {"blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.2.ffn_down.weight"}) {
    EXPECT_TRUE(TensorBytes(*GgufFile::OpenPath(as_q8), name) == TensorBytes(*GgufFile::OpenPath(q8), name)) << name;
  }
}

// The GGUF reference (llama_numpy.py) reads llama.cpp's qwen2, qwen3 and qwen3moe files as the HF reference reads
// their checkpoints (two independent readings of the same weights); on SYNTHETIC qwen3 and qwen3moe files (q wider
// than the residual, constant q/k norm gains) the engine's logits are the GGUF reference's.
TEST(LlamaCppGguf, GgufReferenceReadsTheQwenArchitectures) {
  testing::TempDir tmp;
  auto gap = [](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, double(std::fabs(a[i] - b[i])));
    return d;
  };
  const int64_t n_vocab = std::abs(GetStories().vocab);
  HfOptions q2;
  q2.architecture = "Qwen2ForCausalLM";
  q2.qkv_bias = true;
  HfOptions q3;
  q3.architecture = "Qwen3ForCausalLM";
  q3.qk_norm = true;
  q3.head_dim = 16;
  HfOptions q3moe = q3;
  q3moe.architecture = "Qwen3MoeForCausalLM";
  q3moe.moe_experts = 4;
  std::vector<float> first;
  for (const auto& [name, o] : {std::pair<std::string, HfOptions>{"qwen2", q2}, {"qwen3", q3}, {"qwen3moe", q3moe}}) {
    const std::string gguf = LlamaCppGguf(tmp.File(name), ConvertStoriesHf(tmp, name, o), "f32");
    const std::vector<float> hf = testing::HfReferenceLogits(tmp.File(name), testing::kReferenceIds, n_vocab,
                                                             tmp.File(name + ".hf.npy"));
    const std::vector<float> ref = testing::NumpyReferenceLogits(gguf, testing::kReferenceIds, n_vocab,
                                                                 tmp.File(name + ".ref.npy"));
    EXPECT_LE(gap(ref, hf), 1e-4) << name << ": the GGUF reference against the HF reference";
    if (first.empty()) first = hf;
    if (name != "qwen2") {
      EXPECT_GT(gap(hf, first), 0.1) << name << " is not the qwen2 model";
    }
  }
  for (const char* arch : {"qwen3", "qwen3moe"}) {
    converter::SynthOptions o;
    o.shape = "custom";
    o.arch = arch;
    o.dim = 256;
    o.ffn = 256;
    o.heads = 8;
    o.kv_heads = 2;
    o.head_dim = 64;
    o.experts = std::string(arch) == "qwen3moe" ? 4 : 0;
    o.vocab = 512;
    o.layers = 3;
    o.type = GgmlType::kF32;  // the engine's Q8_0 dot products round the activations too: F32 compares at 1e-3
    auto model = converter::BuildSyntheticModel(o, nullptr);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    converter::WriteOptions w;
    w.path = tmp.File(std::string(arch) + "-synth.gguf");
    w.type = o.type;
    w.progress = false;
    w.q4_0_scale_search = false;
    ASSERT_TRUE(converter::WriteModelGguf(*model, w).ok());
    const std::vector<float> ref =
        testing::NumpyReferenceLogits(w.path, testing::kReferenceIds, o.vocab, w.path + ".npy");
    const testing::LogitGap g = testing::EngineLogitGap(w.path, testing::kReferenceIds, ref);
    EXPECT_LE(g.max_diff, 1e-3) << arch << " (synthetic): the engine against the GGUF reference";
    EXPECT_GT(g.max_abs, 0.1) << arch << ": logits that say something";
  }
}

// llama.cpp's phi3 architecture: q, k and v fused in attn_qkv, gate and up in ffn_up, LongRoPE's factors as
// rope_factors_short/long.weight with rope.scaling.attn_factor and original_context_length, a sliding window.
// Converted, it is the file the HF reader makes of the same directory (short factors as rope_freqs.weight, the
// attention factor folded into q and k, the context capped at 64, the window kept), whose logits
// HfConvert.Phi3LongRopeMatchesTheHfReference ties to the HF reference; and without LongRoPE, the plain Phi-3 file.
TEST(LlamaCppGguf, Phi3GivesTheHfConversion) {
  testing::TempDir tmp;
  HfOptions o = Phi3LongRope();
  const std::string hf = ConvertStoriesHf(tmp, "longrope", o);
  const std::string phi3 = LlamaCppGguf(tmp.File("longrope"), hf, "f32");
  auto src = GgufFile::OpenPath(phi3);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  EXPECT_EQ(*src->GetString("general.architecture"), "phi3");
  EXPECT_NE(src->FindTensor("blk.0.attn_qkv.weight"), nullptr);
  EXPECT_NE(src->FindTensor("rope_factors_long.weight"), nullptr);
  EXPECT_NEAR(*src->GetFloat("phi3.rope.scaling.attn_factor"), std::sqrt(1.0 + std::log(8.0) / std::log(64.0)), 1e-6);
  const std::string converted = tmp.File("longrope-converted.gguf");
  const Status s = ConvertGguf(phi3, converted, GgmlType::kF32);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectSameModel(converted, hf);
  // Without rope.scaling.attn_factor the factor is transformers' default, the one the script wrote; a short factor
  // list of the wrong length is refused, naming the tensor.
  const std::string no_key = tmp.File("no-attn-key.gguf"), no_key_converted = tmp.File("no-attn-key-converted.gguf");
  ASSERT_EQ(testing::RewriteGguf(phi3, no_key, testing::SetGgufKey("phi3.rope.scaling.attn_factor", std::nullopt),
                                 nullptr),
            "");
  ASSERT_TRUE(ConvertGguf(no_key, no_key_converted, GgmlType::kF32).ok());
  ExpectSameModel(no_key_converted, hf);
  const std::string short3 = tmp.File("short3.gguf");
  ASSERT_EQ(testing::RewriteGguf(phi3, short3, nullptr,
                                 [](testing::GgufTensorCopy* c) {
                                   if (c->name != "rope_factors_short.weight") return;
                                   c->dims = {3};
                                   c->bytes.resize(3 * sizeof(float));
                                 }),
            "");
  const std::string negative = tmp.File("negative.gguf");
  ASSERT_EQ(testing::RewriteGguf(phi3, negative, testing::SetGgufKey("phi3.rope.scaling.attn_factor", GgufValue(-1.0f)),
                                 nullptr),
            "");
  const Status refused = ConvertGguf(negative, tmp.File("negative-converted.gguf"), GgmlType::kF32);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("phi3.rope.scaling.attn_factor is -1.000000, expected a positive number"),
            std::string::npos)
      << refused.ToString();
  const Status bad = ConvertGguf(short3, tmp.File("short3-converted.gguf"), GgmlType::kF32);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("rope_factors_short.weight must be F32 [4] (head size / 2), found f32 with 3 elements"),
            std::string::npos)
      << bad.ToString();

  o.rope_scaling = "null";
  o.extra_config = R"("sliding_window": null,)";
  const std::string plain_hf = ConvertStoriesHf(tmp, "plain", o);
  const std::string plain = tmp.File("plain-converted.gguf");
  ASSERT_TRUE(ConvertGguf(LlamaCppGguf(tmp.File("plain"), plain_hf, "f32"), plain, GgmlType::kF32).ok());
  ExpectSameModel(plain, plain_hf);
  auto a = GgufFile::OpenPath(converted), b = GgufFile::OpenPath(plain);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(TensorBytes(*a, "blk.0.attn_q.weight") == TensorBytes(*b, "blk.0.attn_q.weight"));
  EXPECT_EQ(b->FindTensor("rope_freqs.weight"), nullptr);
}

// A converted file's error names the file, the tensor or key, what was expected and what was found; the engine refuses
// a phi3 file as it is, saying to convert it.
TEST(LlamaCppGguf, BadFilesAreRefusedWithTheField) {
  testing::TempDir tmp;
  HfOptions o;
  o.architecture = "Phi3ForCausalLM";
  o.fused = true;
  o.extra_config = R"("sliding_window": null,)";
  const std::string hf = ConvertStoriesHf(tmp, "phi3", o);
  const std::string phi3 = LlamaCppGguf(tmp.File("phi3"), hf, "f32");
  auto expect_refused = [&](const testing::GgufKvEdit& kv, const std::function<void(testing::GgufTensorCopy*)>& t,
                            const std::string& want) {
    const std::string bad = tmp.File("bad.gguf");
    ASSERT_EQ(testing::RewriteGguf(phi3, bad, kv, t), "");
    const Status s = ConvertGguf(bad, tmp.File("bad-converted.gguf"), GgmlType::kF32);
    ASSERT_FALSE(s.ok()) << want;
    EXPECT_NE(s.message().find(want), std::string::npos) << s.ToString();
    EXPECT_FALSE(FileExists(tmp.File("bad-converted.gguf")));
  };
  const Stories& st = GetStories();
  const uint64_t qkv_rows = st.dim + 2 * (st.dim / st.n_heads * st.n_kv_heads);
  auto drop_row = [&](const std::string& name) {
    return [name](testing::GgufTensorCopy* c) {
      if (c->name != name) return;
      c->dims.back() -= 1;
      c->bytes.resize(c->bytes.size() - c->dims[0] * sizeof(float));
    };
  };
  expect_refused(nullptr, drop_row("blk.1.attn_qkv.weight"),
                 "tensor blk.1.attn_qkv.weight has dims [" + std::to_string(st.dim) + ", " +
                     std::to_string(qkv_rows - 1) + "], expected " + std::to_string(qkv_rows) + " rows");
  expect_refused(nullptr, drop_row("blk.2.ffn_up.weight"),
                 "tensor blk.2.ffn_up.weight has dims [" + std::to_string(st.dim) + ", " +
                     std::to_string(2 * st.hidden - 1) + "], expected " + std::to_string(2 * st.hidden) +
                     " rows (gate and up");
  expect_refused(testing::SetGgufKey("phi3.rope.dimension_count", GgufValue(uint32_t{6})), nullptr,
                 "phi3.rope.dimension_count is 6, expected the head size 8 (partial rotary");
  expect_refused(testing::SetGgufKey("general.architecture", GgufValue(std::string("gemma"))), nullptr,
                 "general.architecture is \"gemma\"; nflash converts \"llama\", \"qwen2\", \"qwen3\", \"qwen3moe\" "
                 "and \"phi3\"");
  expect_refused(testing::SetGgufKey("phi3.rope.scaling.attn_factor", GgufValue(1.5f)), nullptr,
                 "phi3.rope.scaling.attn_factor is 1.5");
  expect_refused(
      [](std::vector<std::pair<std::string, GgufValue>>* kv) {
        testing::SetGgufKey("phi3.attention.key_length", GgufValue(uint32_t{8}))(kv);
        testing::SetGgufKey("phi3.attention.value_length", GgufValue(uint32_t{16}))(kv);
      },
      nullptr, "phi3.attention.key_length 8 and phi3.attention.value_length 16: only equal key and value head sizes");

  auto refused = Model::Load(phi3, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("general.architecture is \"phi3\", expected \"llama\", \"qwen2\", "
                                            "\"qwen3\" or \"qwen3moe\": convert the file first (nflash convert " +
                                            phi3),
            std::string::npos)
      << refused.status().ToString();
}

}  // namespace
}  // namespace nflash::converter
