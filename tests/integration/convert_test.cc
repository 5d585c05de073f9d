// Converter end to end through the library: stories260K (llama2.c) to F32/Q8_0/Q4_0 GGUF, GGUF to GGUF, PowerInfer
// extras, overwrite refusal and no partial output on failure. Source values are read by the test itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "converter/readers.h"
#include "runtime/core/float16.h"
#include "runtime/core/gguf.h"
#include "runtime/core/quant.h"
#include "tests/test_util.h"

namespace nflash::converter {
namespace {

namespace fs = std::filesystem;
using nflash::testing::SharedPath;
using nflash::testing::TempDir;

using TensorMap = std::map<std::string, std::pair<std::vector<uint64_t>, std::vector<float>>>;

// stories260K.bin read directly, with offsets from models/stories260K/README.md (v0 layout, shared classifier).
const TensorMap& Stories260K() {
  static const TensorMap m = [] {
    std::ifstream in(SharedPath("models/stories260K/stories260K.bin"), std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes.size(), 1056540u);
    int32_t hdr[7];
    std::memcpy(hdr, bytes.data(), sizeof hdr);
    EXPECT_EQ(std::vector<int32_t>(hdr, hdr + 7), (std::vector<int32_t>{64, 172, 5, 8, 4, 512, 512}));
    const uint64_t D = 64, H = 172, L = 5, V = 512, KV = 32;
    uint64_t off = 28;
    auto take = [&](uint64_t n) {
      std::vector<float> v(n);
      std::memcpy(v.data(), bytes.data() + off, n * 4);
      off += n * 4;
      return v;
    };
    TensorMap t;
    t["token_embd.weight"] = {{D, V}, take(V * D)};
    auto per_layer = [&](const char* name, std::vector<uint64_t> dims, uint64_t n) {
      for (uint64_t l = 0; l < L; ++l) t["blk." + std::to_string(l) + "." + name + ".weight"] = {dims, take(n)};
    };
    per_layer("attn_norm", {D}, D);
    per_layer("attn_q", {D, D}, D * D);
    per_layer("attn_k", {D, KV}, KV * D);
    per_layer("attn_v", {D, KV}, KV * D);
    per_layer("attn_output", {D, D}, D * D);
    per_layer("ffn_norm", {D}, D);
    per_layer("ffn_gate", {D, H}, H * D);
    per_layer("ffn_down", {H, D}, D * H);
    per_layer("ffn_up", {D, H}, H * D);
    t["output_norm.weight"] = {{D}, take(D)};
    off += 2 * 512 * 4 * 4;  // freq_cis_real and freq_cis_imag: [seq_len 512][head_size/2 = 4] each
    EXPECT_EQ(off, bytes.size());
    return t;
  }();
  return m;
}

Status ConvertStories(const std::string& out, GgmlType type, FfnActivation act = FfnActivation::kSilu) {
  auto model = ReadLlama2c(SharedPath("models/stories260K/stories260K.bin"),
                           SharedPath("models/stories260K/tok512.bin"), act);
  if (!model.ok()) return model.status();
  WriteOptions o;
  o.path = out;
  o.type = type;
  o.progress = false;
  return WriteModelGguf(*model, o);
}

std::vector<float> Dequantize(const GgufFile& f, const GgufTensorInfo& t) {
  std::vector<uint8_t> scratch;
  auto data = f.TensorData(t, &scratch);
  EXPECT_TRUE(data.ok());
  std::vector<float> out(t.n_elements);
  const uint64_t row = t.dims[0], row_bytes = *RowBytes(t.type, row);
  for (uint64_t r = 0; r < t.n_elements / row; ++r) {
    EXPECT_TRUE(DequantizeRow(t.type, data->data() + r * row_bytes, out.data() + r * row, row).ok());
  }
  return out;
}

template <typename T>
T Get(const Result<T>& r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : T{};
}

TEST(ConvertStories260K, F32MatchesSourceAndMetadata) {
  TempDir dir;
  const std::string out = dir.File("s.gguf");
  ASSERT_TRUE(ConvertStories(out, GgmlType::kF32).ok());
  auto f = GgufFile::OpenPath(out);
  ASSERT_TRUE(f.ok()) << f.status().ToString();

  EXPECT_EQ(Get(f->GetString("general.architecture")), "llama");
  EXPECT_EQ(Get(f->GetString("general.name")), "stories260K");
  EXPECT_EQ(Get(f->GetUint("general.file_type")), 0u);
  EXPECT_EQ(Get(f->GetUint("general.quantization_version")), 2u);
  EXPECT_EQ(f->Find("general.alignment"), nullptr);
  EXPECT_EQ(Get(f->GetUint("llama.embedding_length")), 64u);
  EXPECT_EQ(Get(f->GetUint("llama.block_count")), 5u);
  EXPECT_EQ(Get(f->GetUint("llama.attention.head_count")), 8u);
  EXPECT_EQ(Get(f->GetUint("llama.attention.head_count_kv")), 4u);
  EXPECT_EQ(Get(f->GetUint("llama.feed_forward_length")), 172u);
  EXPECT_EQ(Get(f->GetUint("llama.vocab_size")), 512u);
  EXPECT_EQ(Get(f->GetUint("llama.context_length")), 512u);
  EXPECT_EQ(Get(f->GetUint("llama.rope.dimension_count")), 8u);
  EXPECT_FLOAT_EQ(Get(f->GetFloat("llama.attention.layer_norm_rms_epsilon")), 1e-5);
  EXPECT_FLOAT_EQ(Get(f->GetFloat("llama.rope.freq_base")), 10000.0);
  EXPECT_EQ(f->Find("llama.rope.scaling.type"), nullptr);
  EXPECT_EQ(f->Find("llama.expert_count"), nullptr);
  EXPECT_EQ(Get(f->GetString("nflash.ffn_activation")), "silu");
  EXPECT_EQ(Get(f->GetString("tokenizer.ggml.model")), "llama");
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.bos_token_id")), 1u);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.eos_token_id")), 2u);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.unknown_token_id")), 0u);
  EXPECT_TRUE(Get(f->GetBool("tokenizer.ggml.add_bos_token")));
  auto tokens = f->GetArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ((*tokens)->items.size(), 512u);
  EXPECT_EQ(std::get<std::string>((*tokens)->items[1].v), "<s>");
  EXPECT_EQ(std::get<std::string>((*tokens)->items[261].v), "\xe2\x96\x81" "a");
  auto types = f->GetArray("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ(std::get<int32_t>((*types)->items[3].v), 6);
  auto scores = f->GetArray("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.ok());
  EXPECT_EQ(std::get<float>((*scores)->items[262].v), -3.0f);

  const TensorMap& src = Stories260K();
  ASSERT_EQ(f->tensors().size(), src.size());  // 47: no output.weight (tied embeddings)
  EXPECT_EQ(src.size(), 47u);
  EXPECT_EQ(f->FindTensor("output.weight"), nullptr);
  for (const GgufTensorInfo& t : f->tensors()) {
    auto it = src.find(t.name);
    ASSERT_NE(it, src.end()) << t.name;
    EXPECT_EQ(t.type, GgmlType::kF32) << t.name;
    EXPECT_EQ(t.dims, it->second.first) << t.name;
    std::vector<uint8_t> scratch;
    auto data = f->TensorData(t, &scratch);
    ASSERT_TRUE(data.ok());
    ASSERT_EQ(data->size(), it->second.second.size() * 4);
    EXPECT_EQ(std::memcmp(data->data(), it->second.second.data(), data->size()), 0) << t.name;
  }
}

class ConvertQuantized : public ::testing::TestWithParam<GgmlType> {};

TEST_P(ConvertQuantized, ErrorWithinBlockBoundAndF16Fallback) {
  const GgmlType type = GetParam();
  TempDir dir;
  const std::string out = dir.File("q.gguf");
  ASSERT_TRUE(ConvertStories(out, type).ok());
  auto f = GgufFile::OpenPath(out);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(Get(f->GetUint("general.file_type")), type == GgmlType::kQ8_0 ? 7u : 2u);

  const TensorMap& src = Stories260K();
  int fallbacks = 0;
  for (const GgufTensorInfo& t : f->tensors()) {
    const auto& [dims, x] = src.at(t.name);
    const bool is_norm = dims.size() == 1;
    const bool is_down = t.name.ends_with("ffn_down.weight");  // rows of 172: not a multiple of 32
    // The tied embedding is also the output head, which stays at 8 bits under Q4_0 (as llama.cpp keeps it at 6+).
    const bool is_head = t.name == "token_embd.weight";
    const GgmlType want = is_norm ? GgmlType::kF32
                          : is_down ? GgmlType::kF16
                          : (is_head && type == GgmlType::kQ4_0) ? GgmlType::kQ8_0
                                                                  : type;
    ASSERT_EQ(t.type, want) << t.name;
    fallbacks += is_down;
    const std::vector<float> y = Dequantize(*f, t);
    ASSERT_EQ(y.size(), x.size());
    if (want == GgmlType::kF32) {
      EXPECT_EQ(y, x) << t.name;
    } else if (want == GgmlType::kF16) {
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) * 0x1p-11f + 0x1p-24f) << t.name << " [" << i << "]";
      }
    } else {
      // Per block of 32: Q8_0 rounds to d = amax/127 steps (error d/2 per element). Q4_0 with ggml's rounding has
      // steps d = amax/8 and clips the element opposite the extreme to 7d (error up to d); the converter's
      // error-minimising scale never has a larger squared error per block, so the block's sum of squared errors is
      // at most 32 d^2. Both get the fp16 rounding of d on top.
      for (size_t b = 0; b < x.size(); b += 32) {
        float amax = 0;
        double sse = 0;
        for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        for (size_t i = b; i < b + 32; ++i) sse += double(y[i] - x[i]) * (y[i] - x[i]);
        if (want == GgmlType::kQ8_0) {
          for (size_t i = b; i < b + 32; ++i) {
            ASSERT_LE(std::fabs(y[i] - x[i]), amax / 127 * 0.6f + 1e-7f) << t.name << " [" << i << "]";
          }
        } else {
          const double d = amax / 8.0 * 1.01;
          ASSERT_LE(sse, 32 * d * d + 1e-12) << t.name << " block at " << b;
        }
      }
    }
  }
  EXPECT_EQ(fallbacks, 5);
}

INSTANTIATE_TEST_SUITE_P(Types, ConvertQuantized, ::testing::Values(GgmlType::kQ8_0, GgmlType::kQ4_0),
                         [](const auto& info) { return std::string(GgmlTypeName(info.param)); });

// Q4_0 weights are the error-minimising quantizer's blocks by default and ggml's rounding with the search off, byte
// for byte (each quantizer is checked against its definition in quant_test).
TEST(ConvertQ4_0, ScaleSearchByDefaultAndGgmlRoundingWithoutIt) {
  auto model = ReadLlama2c(SharedPath("models/stories260K/stories260K.bin"),
                           SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  TempDir dir;
  for (bool search : {true, false}) {
    WriteOptions o;
    o.path = dir.File(search ? "search.gguf" : "ggml.gguf");
    o.type = GgmlType::kQ4_0;
    o.progress = false;
    o.q4_0_scale_search = search;
    ASSERT_TRUE(WriteModelGguf(*model, o).ok());
    auto f = GgufFile::OpenPath(o.path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    int checked = 0;
    for (const GgufTensorInfo& t : f->tensors()) {
      if (t.type != GgmlType::kQ4_0) continue;
      const std::vector<float>& x = Stories260K().at(t.name).second;
      std::vector<BlockQ4_0> want(x.size() / kQBlock);
      for (size_t r = 0; r < x.size() / t.dims[0]; ++r) {
        const int64_t row = static_cast<int64_t>(t.dims[0]);
        (search ? QuantizeRowQ4_0Optimal : QuantizeRowQ4_0)(x.data() + r * row, want.data() + r * row / kQBlock, row);
      }
      std::vector<uint8_t> scratch;
      auto data = f->TensorData(t, &scratch);
      ASSERT_TRUE(data.ok());
      ASSERT_EQ(data->size(), want.size() * sizeof(BlockQ4_0));
      EXPECT_EQ(std::memcmp(data->data(), want.data(), data->size()), 0) << t.name << (search ? " search" : " ggml");
      ++checked;
    }
    EXPECT_EQ(checked, 30);  // q, k, v, o, gate, up of 5 layers (down rows of 172: F16; the tied head: Q8_0)
  }
}

TEST(ConvertGguf, RequantizeAndRoundTrip) {
  TempDir dir;
  ASSERT_TRUE(ConvertStories(dir.File("f32.gguf"), GgmlType::kF32, FfnActivation::kRelu).ok());

  // F32 GGUF -> Q8_0 GGUF, with a PowerInfer-style key carried along.
  auto f32_model = ReadGgufModel(dir.File("f32.gguf"));
  ASSERT_TRUE(f32_model.ok()) << f32_model.status().ToString();
  EXPECT_EQ(f32_model->config.activation, FfnActivation::kRelu);
  EXPECT_TRUE(f32_model->config.tied_embeddings);
  EXPECT_EQ(f32_model->config.n_vocab, 512);
  EXPECT_EQ(f32_model->config.n_ff, 172);
  f32_model->extra_metadata.emplace_back("powerinfer.sparse_threshold", 0.25f);
  WriteOptions o;
  o.path = dir.File("q8.gguf");
  o.type = GgmlType::kQ8_0;
  o.progress = false;
  WriteSummary summary;
  ASSERT_TRUE(WriteModelGguf(*f32_model, o, &summary).ok());
  EXPECT_EQ(summary.n_tensors, 47u);
  EXPECT_EQ(summary.f16_fallbacks, 5u);
  EXPECT_EQ(summary.raw_copies, 11u);  // the F32 norms: same type, copied
  EXPECT_EQ(summary.tensors_by_type[GgmlType::kQ8_0], 31u);

  // Q8_0 -> F32: every value equals the Q8_0 (or F16) dequantization, read directly from the Q8_0 file.
  auto q8_model = ReadGgufModel(dir.File("q8.gguf"));
  ASSERT_TRUE(q8_model.ok()) << q8_model.status().ToString();
  ASSERT_EQ(q8_model->extra_metadata.size(), 1u);
  EXPECT_EQ(q8_model->extra_metadata[0].first, "powerinfer.sparse_threshold");
  o.path = dir.File("back.gguf");
  o.type = GgmlType::kF32;
  ASSERT_TRUE(WriteModelGguf(*q8_model, o).ok());
  auto q8 = GgufFile::OpenPath(dir.File("q8.gguf"));
  auto back = GgufFile::OpenPath(dir.File("back.gguf"));
  ASSERT_TRUE(q8.ok() && back.ok());
  EXPECT_EQ(Get(back->GetString("nflash.ffn_activation")), "relu");
  EXPECT_FLOAT_EQ(Get(back->GetFloat("powerinfer.sparse_threshold")), 0.25);
  for (const GgufTensorInfo& t : q8->tensors()) {
    const GgufTensorInfo* b = back->FindTensor(t.name);
    ASSERT_NE(b, nullptr) << t.name;
    EXPECT_EQ(b->type, GgmlType::kF32);
    EXPECT_EQ(Dequantize(*back, *b), Dequantize(*q8, t)) << t.name;
  }

  // Q8_0 -> Q8_0: every tensor copied bit for bit.
  o.path = dir.File("same.gguf");
  o.type = GgmlType::kQ8_0;
  ASSERT_TRUE(WriteModelGguf(*q8_model, o, &summary).ok());
  EXPECT_EQ(summary.raw_copies, 47u);
  auto same = GgufFile::OpenPath(dir.File("same.gguf"));
  ASSERT_TRUE(same.ok());
  for (const GgufTensorInfo& t : q8->tensors()) {
    const GgufTensorInfo* s = same->FindTensor(t.name);
    ASSERT_NE(s, nullptr);
    ASSERT_EQ(s->type, t.type);
    std::vector<uint8_t> a, b;
    auto da = q8->TensorData(t, &a);
    auto db = same->TensorData(*s, &b);
    ASSERT_TRUE(da.ok() && db.ok());
    ASSERT_EQ(da->size(), db->size());
    EXPECT_EQ(std::memcmp(da->data(), db->data(), da->size()), 0) << t.name;
  }
  // Tokenizer survives both hops.
  auto toks_a = q8->GetArray("tokenizer.ggml.tokens");
  auto toks_b = same->GetArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(toks_a.ok() && toks_b.ok());
  ASSERT_EQ((*toks_b)->items.size(), 512u);
  for (size_t i = 0; i < 512; ++i) {
    EXPECT_EQ(std::get<std::string>((*toks_a)->items[i].v), std::get<std::string>((*toks_b)->items[i].v));
  }
}

// Every tokenizer and RoPE field a SourceModel can carry reaches the file under llama.cpp's key and type, read back
// with GgufFile (not the converter's reader), then through ReadGgufModel unchanged.
TEST(ConvertGguf, WritesEveryTokenizerAndRopeField) {
  auto model = ReadLlama2c(SharedPath("models/stories260K/stories260K.bin"),
                           SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  TokenizerData& t = model->tokenizer;
  t.model = "gpt2";
  t.pre = "llama-bpe";
  t.scores.clear();
  t.token_types.assign(t.tokens.size(), 1);
  t.token_types[3] = 3;
  t.merges = {"a b", "ab c", "\xc4\xa0 t"};
  t.bos_id = 1;
  t.eos_id = 2;
  t.unk_id = 0;
  t.pad_id = 7;
  t.add_bos = true;
  t.add_eos = false;
  model->config.rope_scale_linear = 4.0f;
  model->config.rope_theta = 500000.0f;
  model->config.context_length = 2048;
  model->config.name = "stories-bpe";
  TempDir dir;
  WriteOptions o;
  o.path = dir.File("bpe.gguf");
  o.progress = false;
  ASSERT_TRUE(WriteModelGguf(*model, o).ok());

  auto f = GgufFile::OpenPath(o.path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(Get(f->GetString("general.name")), "stories-bpe");
  EXPECT_EQ(Get(f->GetString("tokenizer.ggml.model")), "gpt2");
  EXPECT_EQ(Get(f->GetString("tokenizer.ggml.pre")), "llama-bpe");
  EXPECT_EQ(f->Find("tokenizer.ggml.scores"), nullptr);
  const GgufArray* merges = Get(f->GetArray("tokenizer.ggml.merges"));
  ASSERT_NE(merges, nullptr);
  ASSERT_EQ(merges->element_type, GgufType::kString);
  ASSERT_EQ(merges->items.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(std::get<std::string>(merges->items[i].v), t.merges[i]);
  const GgufArray* types = Get(f->GetArray("tokenizer.ggml.token_type"));
  ASSERT_NE(types, nullptr);
  ASSERT_EQ(types->element_type, GgufType::kInt32);
  ASSERT_EQ(types->items.size(), 512u);
  EXPECT_EQ(std::get<int32_t>(types->items[3].v), 3);
  EXPECT_EQ(std::get<int32_t>(types->items[4].v), 1);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.bos_token_id")), 1u);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.eos_token_id")), 2u);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.unknown_token_id")), 0u);
  EXPECT_EQ(Get(f->GetUint("tokenizer.ggml.padding_token_id")), 7u);
  EXPECT_TRUE(Get(f->GetBool("tokenizer.ggml.add_bos_token")));
  ASSERT_NE(f->Find("tokenizer.ggml.add_eos_token"), nullptr);
  EXPECT_FALSE(Get(f->GetBool("tokenizer.ggml.add_eos_token")));
  EXPECT_EQ(Get(f->GetString("llama.rope.scaling.type")), "linear");
  EXPECT_EQ(Get(f->GetFloat("llama.rope.scaling.factor")), 4.0);
  EXPECT_EQ(Get(f->GetFloat("llama.rope.freq_base")), 500000.0);
  EXPECT_EQ(Get(f->GetUint("llama.context_length")), 2048u);
  EXPECT_EQ(Get(f->GetUint("llama.rope.dimension_count")), 8u);  // dim 64 / 8 heads

  auto back = ReadGgufModel(o.path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const TokenizerData& b = back->tokenizer;
  EXPECT_EQ(b.model, t.model);
  EXPECT_EQ(b.pre, t.pre);
  EXPECT_EQ(b.tokens, t.tokens);
  EXPECT_TRUE(b.scores.empty());
  EXPECT_EQ(b.token_types, t.token_types);
  EXPECT_EQ(b.merges, t.merges);
  EXPECT_EQ(std::vector<int32_t>({b.bos_id, b.eos_id, b.unk_id, b.pad_id}), std::vector<int32_t>({1, 2, 0, 7}));
  EXPECT_EQ(b.add_bos, std::optional<bool>(true));
  EXPECT_EQ(b.add_eos, std::optional<bool>(false));
  EXPECT_EQ(back->config.rope_scale_linear, 4.0f);
  EXPECT_EQ(back->config.rope_theta, 500000.0f);
  EXPECT_EQ(back->config.context_length, 2048);

  // Without scaling the keys are absent (llama.cpp would read a factor of 0 as "none" but a type as a request).
  model->config.rope_scale_linear = 1.0f;
  o.overwrite = true;
  ASSERT_TRUE(WriteModelGguf(*model, o).ok());
  auto plain = GgufFile::OpenPath(o.path);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->Find("llama.rope.scaling.type"), nullptr);
  EXPECT_EQ(plain->Find("llama.rope.scaling.factor"), nullptr);
}

// Copies `src` (an F32 GGUF of stories260K) to `dst` through GgufWriter the way PowerInfer lays files out: nflash.*
// keys dropped, the architecture replaced, each ffn_down replaced by its transpose ffn_down_t, and predictor tensors
// fc1/fc2 added per layer.
void WritePowerInferLike(const std::string& src, const std::string& dst, const std::string& arch) {
  auto f = GgufFile::OpenPath(src);
  ASSERT_TRUE(f.ok());
  GgufWriter w;
  for (const auto& [k, v] : f->metadata()) {
    if (k.starts_with("nflash.")) continue;
    w.Set(k, k == "general.architecture" ? GgufValue(arch) : v);
  }
  w.Set("powerinfer.sparse_threshold", 0.0f);
  std::vector<std::pair<std::string, std::vector<uint8_t>>> data;  // in declaration order
  auto add = [&](const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& v) {
    ASSERT_TRUE(w.AddTensor(name, GgmlType::kF32, dims).ok());
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    data.emplace_back(name, std::vector<uint8_t>(p, p + v.size() * 4));
  };
  const TensorMap& s = Stories260K();
  for (const GgufTensorInfo& t : f->tensors()) {
    ASSERT_EQ(t.type, GgmlType::kF32);
    const std::vector<float>& x = s.at(t.name).second;
    if (!t.name.ends_with(".ffn_down.weight")) {
      add(t.name, t.dims, x);
      continue;
    }
    // ffn_down dims {172, 64}: 64 rows of 172. Transposed: 172 rows of 64.
    std::vector<float> tr(x.size());
    for (size_t r = 0; r < 64; ++r) {
      for (size_t c = 0; c < 172; ++c) tr[c * 64 + r] = x[r * 172 + c];
    }
    const std::string layer = t.name.substr(0, t.name.size() - std::string("ffn_down.weight").size());
    add(layer + "ffn_down_t.weight", {64, 172}, tr);
    const int l = std::stoi(layer.substr(4));
    add(layer + "fc1.weight", {64, 16}, std::vector<float>(64 * 16, 0.5f + l));
    add(layer + "fc2.weight", {16, 172}, std::vector<float>(16 * 172, -0.25f * l));
  }
  ASSERT_TRUE(w.Begin(dst, false).ok());
  for (const auto& [name, bytes] : data) ASSERT_TRUE(w.WriteTensorData(name, bytes).ok());
  ASSERT_TRUE(w.Finish().ok());
}

TEST(ConvertGguf, KeepsPowerInferPredictorsAndKeys) {
  TempDir dir;
  ASSERT_TRUE(ConvertStories(dir.File("f32.gguf"), GgmlType::kF32).ok());
  WritePowerInferLike(dir.File("f32.gguf"), dir.File("pi.gguf"), "llama");
  auto m = ReadGgufModel(dir.File("pi.gguf"));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  // No nflash.ffn_activation: predictors imply a ReLU-family model.
  EXPECT_EQ(m->config.activation, FfnActivation::kRelu);
  ASSERT_EQ(m->extra_metadata.size(), 1u);
  EXPECT_EQ(m->extra_metadata[0].first, "powerinfer.sparse_threshold");
  EXPECT_EQ(m->tensors.size(), 47u + 10u);

  WriteOptions o;
  o.path = dir.File("out.gguf");
  o.type = GgmlType::kF16;
  o.progress = false;
  ASSERT_TRUE(WriteModelGguf(*m, o).ok());
  auto out = GgufFile::OpenPath(o.path);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(Get(out->GetString("nflash.ffn_activation")), "relu");
  EXPECT_EQ(Get(out->GetUint("general.file_type")), 1u);
  ASSERT_NE(out->Find("powerinfer.sparse_threshold"), nullptr);
  const GgufTensorInfo* fc2 = out->FindTensor("blk.3.fc2.weight");
  ASSERT_NE(fc2, nullptr);
  EXPECT_EQ(fc2->dims, (std::vector<uint64_t>{16, 172}));
  EXPECT_EQ(fc2->type, GgmlType::kF16);
  const std::vector<float> v = Dequantize(*out, *fc2);
  for (float x : v) ASSERT_EQ(x, -0.75f);
  EXPECT_EQ(out->FindTensor("blk.1.ffn_down.weight"), nullptr);
  const GgufTensorInfo* down_t = out->FindTensor("blk.1.ffn_down_t.weight");
  ASSERT_NE(down_t, nullptr);
  EXPECT_EQ(down_t->dims, (std::vector<uint64_t>{64, 172}));
  EXPECT_EQ(down_t->type, GgmlType::kF16);
  const std::vector<float> y = Dequantize(*out, *down_t);
  const std::vector<float>& down = Stories260K().at("blk.1.ffn_down.weight").second;
  for (size_t r = 0; r < 64; ++r) {
    for (size_t c = 0; c < 172; ++c) {
      const float x = down[r * 172 + c];
      ASSERT_LE(std::fabs(y[c * 64 + r] - x), std::fabs(x) * 0x1p-11f + 0x1p-24f) << r << "," << c;
    }
  }

  // Any other architecture is refused by name.
  WritePowerInferLike(dir.File("f32.gguf"), dir.File("bamboo.gguf"), "bamboo");
  auto other = ReadGgufModel(dir.File("bamboo.gguf"));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(other.status().message().find("bamboo"), std::string::npos) << other.status().ToString();
}

// Copies the GGUF `src` to `dst` through GgufWriter with one key changed (`value` nullopt: removed) or one tensor
// replaced (`tensor_name` renamed to `new_name`, or given `new_dims` / `new_type` with zero bytes of that size).
struct GgufEdit {
  std::string key;
  std::optional<GgufValue> value;
  std::string tensor_name, new_name;
  std::vector<uint64_t> new_dims;
  std::optional<GgmlType> new_type;
};
GgufEdit SetKey(std::string key, GgufValue value) {
  GgufEdit e;
  e.key = std::move(key);
  e.value = std::move(value);
  return e;
}
GgufEdit ChangeTensor(std::string name, std::string new_name, std::vector<uint64_t> new_dims = {},
                      std::optional<GgmlType> new_type = std::nullopt) {
  GgufEdit e;
  e.tensor_name = std::move(name);
  e.new_name = std::move(new_name);
  e.new_dims = std::move(new_dims);
  e.new_type = new_type;
  return e;
}
void RewriteGguf(const std::string& src, const std::string& dst, const GgufEdit& e) {
  const std::string error = nflash::testing::RewriteGguf(
      src, dst,
      [&](std::vector<std::pair<std::string, GgufValue>>* kv) {
        if (!e.key.empty()) nflash::testing::SetGgufKey(e.key, e.value)(kv);
      },
      [&](nflash::testing::GgufTensorCopy* t) {
        if (t->name != e.tensor_name) return;
        if (!e.new_name.empty()) t->name = e.new_name;
        if (e.new_dims.empty() && !e.new_type) return;
        if (!e.new_dims.empty()) t->dims = e.new_dims;
        if (e.new_type) t->type = *e.new_type;
        t->ZeroData();
      });
  ASSERT_EQ(error, "");
}

// Each of the GGUF reader's checks: the file and the key or tensor, what was found and what was expected.
TEST(ConvertGguf, BadSourcesNameTheKeyOrTensor) {
  TempDir dir;
  const std::string good = dir.File("f32.gguf");
  ASSERT_TRUE(ConvertStories(good, GgmlType::kF32).ok());
  auto f = GgufFile::OpenPath(good);
  ASSERT_TRUE(f.ok());
  const GgufArray scores = *Get(f->GetArray("tokenizer.ggml.scores"));
  const GgufArray types = *Get(f->GetArray("tokenizer.ggml.token_type"));
  auto shorter = [](GgufArray a) {
    a.items.pop_back();
    return GgufValue(std::move(a));
  };
  GgufArray numbers = types;  // int32 where strings belong
  struct Case {
    const char* what;
    GgufEdit edit;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"zero layers", SetKey("llama.block_count", GgufValue(uint32_t{0})),
       {"llama.block_count is 0, expected a positive"}},
      {"tokens not strings", SetKey("tokenizer.ggml.tokens", GgufValue(numbers)),
       {"tokenizer.ggml.tokens[0] has type", "expected string"}},
      {"scores short", SetKey("tokenizer.ggml.scores", shorter(scores)),
       {"tokenizer.ggml.scores has 511 entries, expected 512"}},
      {"types short", SetKey("tokenizer.ggml.token_type", shorter(types)),
       {"tokenizer.ggml.token_type has 511 entries, expected 512"}},
      {"kv heads", SetKey("llama.attention.head_count_kv", GgufValue(uint32_t{3})),
       {"inconsistent attention shape", "head_count 8, head_count_kv 3"}},
      {"activation", SetKey("nflash.ffn_activation", GgufValue(std::string("tanh"))),
       {"nflash.ffn_activation is \"tanh\", expected silu, relu or drelu"}},
      {"q8_1 tensor", ChangeTensor("blk.0.attn_q.weight", "", {}, GgmlType::kQ8_1),
       {"tensor blk.0.attn_q.weight has type q8_1", "converts from f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 and "
                                                   "the k-quants q2_K to q6_K"}},
      {"no embedding", ChangeTensor("token_embd.weight", "token_embd_x.weight"),
       {"tensor token_embd.weight is missing"}},
      {"embedding rows", ChangeTensor("token_embd.weight", "", {32, 1024}),
       {"token_embd.weight row length 32 does not match llama.embedding_length 64"}},
  };
  for (const Case& c : cases) {
    const std::string bad = dir.File("bad.gguf");
    RewriteGguf(good, bad, c.edit);
    auto m = ReadGgufModel(bad);
    ASSERT_FALSE(m.ok()) << c.what;
    EXPECT_NE(m.status().message().find(bad), std::string::npos) << c.what << ": " << m.status().ToString();
    for (const std::string& part : c.message) {
      EXPECT_NE(m.status().message().find(part), std::string::npos) << c.what << ": " << m.status().ToString();
    }
  }
}

TEST(ConvertSafety, RefusesToOverwriteWithoutForce) {
  TempDir dir;
  const std::string out = dir.File("exists.gguf");
  nflash::testing::WriteText(out, "precious");
  Status s = ConvertStories(out, GgmlType::kF32);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--force"), std::string::npos) << s.ToString();
  std::ifstream in(out);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "precious");

  auto model = ReadLlama2c(SharedPath("models/stories260K/stories260K.bin"),
                           SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(model.ok());
  WriteOptions o;
  o.path = out;
  o.overwrite = true;
  o.progress = false;
  ASSERT_TRUE(WriteModelGguf(*model, o).ok());
  EXPECT_TRUE(GgufFile::OpenPath(out).ok());
}

TEST(ConvertSafety, FailureMidWriteLeavesNoFileBehind) {
  TempDir dir;
  const std::string bin = dir.File("model.bin");
  fs::copy_file(SharedPath("models/stories260K/stories260K.bin"), bin);
  auto model = ReadLlama2c(bin, SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(model.ok());
  // The source shrinks after it was validated: the loaders of the last layers now read past its end.
  fs::resize_file(bin, 600000);
  WriteOptions o;
  o.path = dir.File("out.gguf");
  o.progress = false;
  Status s = WriteModelGguf(*model, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model.bin"), std::string::npos) << s.ToString();
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"model.bin"});
}

TEST(ConvertSafety, RejectsInconsistentModels) {
  auto model = ReadLlama2c(SharedPath("models/stories260K/stories260K.bin"),
                           SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(model.ok());
  TempDir dir;
  WriteOptions o;
  o.path = dir.File("x.gguf");
  o.progress = false;

  SourceModel missing = *model;
  std::erase_if(missing.tensors, [](const SourceTensor& t) { return t.name == "blk.2.ffn_up.weight"; });
  Status s = WriteModelGguf(missing, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("blk.2.ffn_up.weight"), std::string::npos) << s.ToString();

  SourceModel wrong_vocab = *model;
  wrong_vocab.tokenizer.tokens.pop_back();
  s = WriteModelGguf(wrong_vocab, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("511"), std::string::npos) << s.ToString();

  // Each inconsistency is refused before anything is written, naming what is wrong.
  struct Case {
    const char* what;
    std::function<void(SourceModel*)> spoil;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"vocab and tokens", [](SourceModel* m) {
         m->tokenizer.tokens.pop_back();
         m->tokenizer.scores.pop_back();
         m->tokenizer.token_types.pop_back();
       },
       {"511 tokens", "vocabulary is 512"}},
      {"scores", [](SourceModel* m) { m->tokenizer.scores.pop_back(); }, {"511 scores", "512 tokens"}},
      {"token types", [](SourceModel* m) { m->tokenizer.token_types.assign(3, 1); }, {"3 token types"}},
      {"kv heads", [](SourceModel* m) { m->config.n_kv_heads = 3; }, {"n_kv_heads 3"}},
      {"experts used", [](SourceModel* m) { m->config.n_experts = 4; m->config.n_experts_used = 5; },
       {"expert_used_count 5", "1..4"}},
      {"duplicate", [](SourceModel* m) { m->tensors.push_back(m->tensors[3]); },
       {model->tensors[3].name, "appears twice"}},
      {"k shape",
       [](SourceModel* m) {
         for (auto& t : m->tensors) {
           if (t.name == "blk.1.attn_k.weight") t.dims = {64, 64};
         }
       },
       {"blk.1.attn_k.weight", "[64, 32]"}},
      {"tied head", [](SourceModel* m) {
         SourceTensor head = m->tensors[0];
         head.name = "output.weight";
         m->tensors.push_back(head);
       }, {"tied_embeddings", "output.weight"}},
      {"down_t shape", [](SourceModel* m) {
         for (auto& t : m->tensors) if (t.name == "blk.4.ffn_down.weight") t.name = "blk.4.ffn_down_t.weight";
       }, {"blk.4.ffn_down_t.weight", "[64, 172]"}},
  };
  for (const Case& c : cases) {
    SourceModel bad = *model;
    c.spoil(&bad);
    s = WriteModelGguf(bad, o);
    ASSERT_FALSE(s.ok()) << c.what;
    for (const std::string& m : c.message) {
      EXPECT_NE(s.message().find(m), std::string::npos) << c.what << ": " << s.ToString();
    }
    EXPECT_FALSE(fs::exists(o.path)) << c.what;
  }

  // A source whose raw bytes disagree with its shape (a reader's bug) fails the write, leaving no file.
  SourceModel raw = *model;
  for (auto& t : raw.tensors) {
    if (t.name != "blk.0.attn_q.weight") continue;
    t.load_raw = [] { return Result<std::vector<uint8_t>>(std::vector<uint8_t>(100)); };
  }
  s = WriteModelGguf(raw, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("100 raw bytes"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(o.path));

  o.type = GgmlType::kQ4_1;
  s = WriteModelGguf(*model, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(o.path));
}

}  // namespace
}  // namespace nflash::converter
