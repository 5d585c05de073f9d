// Dense engine tests on real weights: the published greedy outputs of stories260K-relu (token ids from its README),
// batched prefill == token-by-token decode, and a small mixture-of-experts model (batched == sequential, router top-k
// checked against a direct computation).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "converter/readers.h"
#include "runtime/core/gguf.h"
#include "runtime/core/kernels.h"
#include "runtime/core/quant.h"
#include "runtime/engine/context.h"
#include "runtime/engine/generate.h"
#include "runtime/engine/model.h"
#include "runtime/text/tokenizer.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using testing::ReadText;

// Converts a llama2.c checkpoint from ../shared to a GGUF of `type` in `dir`.
// `sliding_window` > 0 gives the model that attention window (llama.attention.sliding_window).
std::string ConvertShared(const testing::TempDir& dir, const std::string& model, FfnActivation act, GgmlType type,
                          int64_t sliding_window = 0) {
  auto src = converter::ReadLlama2c(testing::SharedPath(model), testing::SharedPath("models/stories260K/tok512.bin"), act);
  EXPECT_TRUE(src.ok()) << src.status().ToString();
  src->config.sliding_window = sliding_window;
  converter::WriteOptions opt;
  opt.path = dir.File("model-" + std::string(GgmlTypeName(type)) + "-w" + std::to_string(sliding_window) + ".gguf");
  opt.type = type;
  opt.progress = false;
  Status s = converter::WriteModelGguf(*src, opt);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return opt.path;
}

std::vector<int32_t> Greedy(InferenceContext& ctx, int64_t n_vocab, std::vector<int32_t> prompt, int n, bool batched_prompt) {
  if (batched_prompt) {
    EXPECT_TRUE(ctx.Eval(prompt, false).ok());
  } else {
    for (int32_t t : prompt) EXPECT_TRUE(ctx.Eval({&t, 1}, false).ok());
  }
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const float* lg = ctx.logits();
    int32_t next = static_cast<int32_t>(std::max_element(lg, lg + n_vocab) - lg);
    out.push_back(next);
    if (i + 1 < n) {
      EXPECT_TRUE(ctx.Eval({&next, 1}, false).ok());
    }
  }
  return out;
}

// The 100 greedy ids after the prompt that models/stories260K-relu/README.md lists (checked there by NumPy, PyTorch
// and llama2.c); empty when the README has no such block.
std::vector<int32_t> PublishedReluIds() {
  std::string readme = ReadText(testing::SharedPath("models/stories260K-relu/README.md"));
  std::smatch m;
  std::vector<int32_t> ids;
  if (!std::regex_search(readme, m, std::regex(R"(```\s*\n\[([0-9, ]+)\]\s*\n```)"))) return ids;
  std::stringstream ss(m[1].str());
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoi(item));
  return ids;
}

TEST(EngineTest, ReluModelMatchesPublishedGreedyIds) {
  const std::vector<int32_t> expected = PublishedReluIds();
  ASSERT_EQ(expected.size(), 100u);

  testing::TempDir dir;
  std::string path = ConvertShared(dir, "models/stories260K-relu/stories260K-relu.bin", FfnActivation::kRelu,
                                   GgmlType::kF32);
  auto model = Model::Load(path, {});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->hparams().activation, FfnActivation::kRelu);
  ThreadPool pool(2);
  // Context 105 (the 104 positions this needs, plus one) ends the key cache in a block of 41 positions instead of 64
  // (KeyCacheIndex: the last block is narrower), which positions 64-103 then use.
  for (int64_t n_ctx : {512, 105}) {
    for (bool batched : {true, false}) {
      InferenceContext ctx(**model, &pool, n_ctx);
      EXPECT_EQ(Greedy(ctx, (*model)->hparams().n_vocab, {1, 403, 407, 261, 378}, 100, batched), expected)
          << "batched prompt: " << batched << ", context " << n_ctx;
    }
  }
}

TEST(EngineTest, PrefillEqualsTokenByToken) {
  testing::TempDir dir;
  for (GgmlType type : {GgmlType::kF32, GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    std::string path = ConvertShared(dir, "models/stories260K/stories260K.bin", FfnActivation::kSilu, type);
    auto model = Model::Load(path, {});
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    ThreadPool pool(2);
    std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426};
    InferenceContext batched(**model, &pool, 64), single(**model, &pool, 64);
    ASSERT_TRUE(batched.Eval(prompt, true).ok());
    const int64_t nv = (*model)->hparams().n_vocab;
    for (size_t t = 0; t < prompt.size(); ++t) {
      ASSERT_TRUE(single.Eval({&prompt[t], 1}, false).ok());
      const float* a = batched.logits(static_cast<int64_t>(t));
      const float* b = single.logits();
      float max_diff = 0;
      for (int64_t i = 0; i < nv; ++i) max_diff = std::max(max_diff, std::fabs(a[i] - b[i]));
      // The kernels compute each output with the same code and order for a batch and a single token.
      EXPECT_LE(max_diff, 1e-4f) << GgmlTypeName(type) << " token " << t;
    }
  }
}

// A batch longer than max_batch runs in chunks (here 16 tokens as 4 chunks of 4): every position's logits equal the
// one-batch run's bit for bit, and the scratch stays the chunk's (what ReserveBatch allocates for it), not the batch's.
TEST(EngineTest, ChunkedPrefillEqualsOneBatchInAChunksScratch) {
  testing::TempDir dir;
  for (GgmlType type : {GgmlType::kF32, GgmlType::kQ4_0}) {
    std::string path = ConvertShared(dir, "models/stories260K/stories260K.bin", FfnActivation::kSilu, type);
    auto model = Model::Load(path, {});
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    ThreadPool pool(2);
    std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426};
    InferenceContext whole(**model, &pool, 64), chunked(**model, &pool, 64), reserved(**model, &pool, 64);
    chunked.SetMaxBatch(4);
    reserved.SetMaxBatch(4);
    reserved.ReserveBatch(100, /*ffn=*/true);  // capped at max_batch
    ASSERT_TRUE(whole.Eval(prompt, true).ok());
    ASSERT_TRUE(chunked.Eval(prompt, true).ok());
    ASSERT_EQ(chunked.pos(), static_cast<int64_t>(prompt.size()));
    const int64_t nv = (*model)->hparams().n_vocab;
    for (size_t t = 0; t < prompt.size(); ++t) {
      ASSERT_EQ(0, std::memcmp(whole.logits(static_cast<int64_t>(t)), chunked.logits(static_cast<int64_t>(t)),
                               sizeof(float) * static_cast<size_t>(nv)))
          << GgmlTypeName(type) << " position " << t;
    }
    // The logits of every position are the caller's (16 x n_vocab floats in both); the rest is the chunk's scratch.
    const uint64_t logits_bytes = prompt.size() * static_cast<uint64_t>(nv) * sizeof(float);
    EXPECT_EQ(chunked.state_bytes(), reserved.state_bytes() + logits_bytes) << GgmlTypeName(type);
    EXPECT_LT(chunked.state_bytes(), whole.state_bytes()) << GgmlTypeName(type);
    // Decode after a chunked prompt: the same next logits.
    const int32_t next = 300;
    ASSERT_TRUE(whole.Eval({&next, 1}, false).ok());
    ASSERT_TRUE(chunked.Eval({&next, 1}, false).ok());
    EXPECT_EQ(0, std::memcmp(whole.logits(), chunked.logits(), sizeof(float) * static_cast<size_t>(nv)));
  }
}

// The F16 KV cache: the same published greedy ids (an independent reference: NumPy, PyTorch and llama2.c computed
// them with an F32 cache), batched prefill equal to token-by-token decode, logits close to the F32 cache's but not
// equal to them (the keys and values really are rounded), and half the cache memory.
TEST(EngineTest, HalfKvCacheKeepsThePublishedIdsInHalfTheMemory) {
  const std::vector<int32_t> expected = PublishedReluIds();
  ASSERT_EQ(expected.size(), 100u);
  testing::TempDir dir;
  const std::string path = ConvertShared(dir, "models/stories260K-relu/stories260K-relu.bin", FfnActivation::kRelu,
                                         GgmlType::kF32);
  auto model = Model::Load(path, {});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ThreadPool pool(2);
  for (int64_t n_ctx : {512, 105}) {
    for (bool batched : {true, false}) {
      InferenceContext ctx(**model, &pool, n_ctx, KvType::kF16);
      EXPECT_EQ(Greedy(ctx, hp.n_vocab, {1, 403, 407, 261, 378}, 100, batched), expected)
          << "batched prompt: " << batched << ", context " << n_ctx;
    }
  }
  // Every ISA's attention (the scalar one widens with Fp16ToFp32, the others with F16C).
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (!SetKernelIsa(isa)) continue;
    InferenceContext ctx(**model, &pool, 128, KvType::kF16);
    EXPECT_EQ(Greedy(ctx, hp.n_vocab, {1, 403, 407, 261, 378}, 100, true), expected) << KernelIsaName(isa);
  }
  SetKernelIsa(BestKernelIsa());
  InferenceContext f32(**model, &pool, 64), f16(**model, &pool, 64, KvType::kF16),
      f16_single(**model, &pool, 64, KvType::kF16);
  EXPECT_EQ(f16.kv_type(), KvType::kF16);
  // K and V: n_layers x n_ctx x kv_dim elements each, 2 bytes instead of 4 (the scratch grows by two widened blocks
  // per thread: 2 x 64 x head_dim floats).
  const uint64_t kv_elements = static_cast<uint64_t>(2 * hp.n_layers * 64 * hp.kv_dim());
  const uint64_t widened = 2ull * 64 * static_cast<uint64_t>(hp.head_dim) * 4 * static_cast<uint64_t>(pool.NumThreads());
  EXPECT_EQ(f32.state_bytes() - f16.state_bytes(), kv_elements * 2 - widened);
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426};
  ASSERT_TRUE(f32.Eval(prompt, true).ok());
  ASSERT_TRUE(f16.Eval(prompt, true).ok());
  float max_f32_diff = 0, max_batch_diff = 0, max_logit = 0;
  for (size_t t = 0; t < prompt.size(); ++t) {
    ASSERT_TRUE(f16_single.Eval({&prompt[t], 1}, false).ok());
    for (int64_t i = 0; i < hp.n_vocab; ++i) {
      const float a = f16.logits(static_cast<int64_t>(t))[i];
      max_f32_diff = std::max(max_f32_diff, std::fabs(a - f32.logits(static_cast<int64_t>(t))[i]));
      max_batch_diff = std::max(max_batch_diff, std::fabs(a - f16_single.logits()[i]));
      max_logit = std::max(max_logit, std::fabs(a));
    }
  }
  EXPECT_LE(max_batch_diff, 1e-4f);  // as PrefillEqualsTokenByToken for the F32 cache
  // Half precision keeps ~3 decimal digits of each key and value: logits move by a small fraction of their range.
  EXPECT_GT(max_f32_diff, 0.0f) << "the F16 cache gave the F32 cache's logits bit for bit: is it used?";
  EXPECT_LT(max_f32_diff, 0.01f * max_logit) << "largest |logit| " << max_logit;
  EXPECT_FALSE(ParseKvType("q8_0").ok());
  EXPECT_EQ(*ParseKvType("f16"), KvType::kF16);
  EXPECT_STREQ(KvTypeName(KvType::kF32), "f32");
}

// A small random Mixtral-shape model written directly with GgufWriter (F32), independent of the converter.
std::string WriteTinyMoe(const testing::TempDir& dir, int64_t n_exp, int64_t top_k,
                         const std::string& arch = "llama", const std::string& skip_tensor = "",
                         const std::string& name = "moe.gguf", uint64_t q_rows = 64) {
  const int64_t dim = 64, n_ff = 96, layers = 2, vocab = 40, heads = 4, kv_heads = 2, kv_dim = dim / heads * kv_heads;
  GgufWriter w;
  w.Set("general.architecture", arch);
  w.Set("general.name", "tiny moe test");
  w.Set("llama.context_length", uint32_t{64});
  w.Set("llama.embedding_length", uint32_t(dim));
  w.Set("llama.block_count", uint32_t(layers));
  w.Set("llama.feed_forward_length", uint32_t(n_ff));
  w.Set("llama.attention.head_count", uint32_t(heads));
  w.Set("llama.attention.head_count_kv", uint32_t(kv_heads));
  w.Set("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.Set("llama.expert_count", uint32_t(n_exp));
  w.Set("llama.expert_used_count", uint32_t(top_k));
  std::vector<std::pair<std::string, std::vector<uint64_t>>> tensors = {{"token_embd.weight", {dim, vocab}},
                                                                        {"output_norm.weight", {dim}}};
  for (int l = 0; l < layers; ++l) {
    std::string p = "blk." + std::to_string(l) + ".";
    tensors.push_back({p + "attn_norm.weight", {dim}});
    tensors.push_back({p + "attn_q.weight", {dim, l == 0 ? q_rows : dim}});
    tensors.push_back({p + "attn_k.weight", {dim, uint64_t(kv_dim)}});
    tensors.push_back({p + "attn_v.weight", {dim, uint64_t(kv_dim)}});
    tensors.push_back({p + "attn_output.weight", {dim, dim}});
    tensors.push_back({p + "ffn_norm.weight", {dim}});
    tensors.push_back({p + "ffn_gate_inp.weight", {dim, uint64_t(n_exp)}});
    tensors.push_back({p + "ffn_gate_exps.weight", {dim, n_ff, uint64_t(n_exp)}});
    tensors.push_back({p + "ffn_up_exps.weight", {dim, n_ff, uint64_t(n_exp)}});
    tensors.push_back({p + "ffn_down_exps.weight", {n_ff, dim, uint64_t(n_exp)}});
  }
  if (!skip_tensor.empty()) {
    std::erase_if(tensors, [&](const auto& t) { return t.first == skip_tensor; });
  }
  for (auto& [tname, dims] : tensors) EXPECT_TRUE(w.AddTensor(tname, GgmlType::kF32, dims).ok());
  std::string path = dir.File(name);
  EXPECT_TRUE(w.Begin(path, true).ok());
  std::mt19937 rng(7);
  for (auto& [name, dims] : tensors) {
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    std::vector<float> v(n);
    bool norm = dims.size() == 1;
    std::normal_distribution<float> nd(0.0f, name == "token_embd.weight" ? 1.0f : 0.2f);
    for (auto& x : v) x = norm ? 1.0f + 0.1f * nd(rng) : nd(rng);
    EXPECT_TRUE(w.WriteTensorData(name, {reinterpret_cast<const uint8_t*>(v.data()), n * 4}).ok());
  }
  EXPECT_TRUE(w.Finish().ok());
  return path;
}

TEST(EngineTest, MixtureOfExpertsBatchedEqualsSequentialAndRoutesTopK) {
  testing::TempDir dir;
  const int64_t n_exp = 4, top_k = 2;
  auto model = Model::Load(WriteTinyMoe(dir, n_exp, top_k), {});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ThreadPool pool(2);
  std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 2, 4};

  // Which experts ran for each (layer, token), and the FFN input they saw.
  struct Seen {
    std::set<int64_t> experts;
    std::vector<float> input;
  };
  using SeenMap = std::map<std::pair<int64_t, int64_t>, Seen>;
  auto record_into = [&hp](SeenMap* map) {
    return [map, &hp](const FfnObservation& o) {
      for (int64_t j = 0; j < o.n_tokens; ++j) {
        Seen& s = (*map)[{o.layer, o.token_index[j]}];
        s.experts.insert(o.expert);
        s.input.assign(o.ffn_input + j * hp.dim, o.ffn_input + (j + 1) * hp.dim);
      }
    };
  };
  SeenMap seen;
  InferenceContext batched(**model, &pool, 64);
  batched.SetFfnObserver(record_into(&seen));
  ASSERT_TRUE(batched.Eval(prompt, true).ok());
  ASSERT_EQ(seen.size(), static_cast<size_t>(hp.n_layers) * prompt.size());
  // In chunks of at most 5 tokens (5 + 4 + ...: 12 as 4, 4, 4): the observations name the same tokens of the batch,
  // with the same FFN inputs, and the logits are equal.
  {
    SeenMap seen_chunked;
    InferenceContext chunked(**model, &pool, 64);
    chunked.SetMaxBatch(5);
    chunked.SetFfnObserver(record_into(&seen_chunked));
    ASSERT_TRUE(chunked.Eval(prompt, true).ok());
    ASSERT_EQ(seen_chunked.size(), seen.size());
    for (const auto& [key, s] : seen) {
      auto it = seen_chunked.find(key);
      ASSERT_NE(it, seen_chunked.end()) << "layer " << key.first << " token " << key.second;
      EXPECT_EQ(it->second.experts, s.experts) << "layer " << key.first << " token " << key.second;
      EXPECT_EQ(it->second.input, s.input) << "layer " << key.first << " token " << key.second;
    }
    for (size_t t = 0; t < prompt.size(); ++t) {
      EXPECT_EQ(0, std::memcmp(batched.logits(int64_t(t)), chunked.logits(int64_t(t)), sizeof(float) * hp.n_vocab))
          << "token " << t;
    }
  }
  for (auto& [key, s] : seen) {
    // Direct computation of the router logits from the weights and the observed FFN input.
    const MatrixView& r = (*model)->layers()[key.first].router;
    std::vector<std::pair<float, int64_t>> logits;
    for (int64_t e = 0; e < n_exp; ++e) {
      const float* row = reinterpret_cast<const float*>(static_cast<const uint8_t*>(r.data) + e * r.row_bytes);
      double d = 0;
      for (int64_t i = 0; i < hp.dim; ++i) d += double(row[i]) * s.input[i];
      logits.push_back({float(d), e});
    }
    std::sort(logits.rbegin(), logits.rend());
    std::set<int64_t> expected = {logits[0].second, logits[1].second};
    EXPECT_EQ(s.experts, expected) << "layer " << key.first << " token " << key.second;
  }

  InferenceContext single(**model, &pool, 64);
  for (size_t t = 0; t < prompt.size(); ++t) {
    ASSERT_TRUE(single.Eval({&prompt[t], 1}, false).ok());
    float max_diff = 0;
    for (int64_t i = 0; i < hp.n_vocab; ++i) {
      max_diff = std::max(max_diff, std::fabs(batched.logits(int64_t(t))[i] - single.logits()[i]));
    }
    EXPECT_LE(max_diff, 1e-4f) << "token " << t;
  }
}

// The engine's hyper-parameter reader, one bad key at a time, on a file holding only metadata and the embedding:
// each error names the key and the value (a llama.cpp GGUF from elsewhere meets these checks first).
TEST(EngineTest, HparamsOutOfRangeAreNamed) {
  testing::TempDir dir;
  auto write = [&](const std::map<std::string, GgufValue>& changes, std::vector<uint64_t> embd_dims) {
    std::map<std::string, GgufValue> kv = {
        {"general.architecture", GgufValue(std::string("llama"))},
        {"llama.embedding_length", GgufValue(uint32_t{64})},
        {"llama.block_count", GgufValue(uint32_t{2})},
        {"llama.feed_forward_length", GgufValue(uint32_t{96})},
        {"llama.attention.head_count", GgufValue(uint32_t{4})},
        {"llama.attention.head_count_kv", GgufValue(uint32_t{2})},
        {"llama.context_length", GgufValue(uint32_t{128})},
        {"llama.rope.dimension_count", GgufValue(uint32_t{16})},
    };
    for (const auto& [k, v] : changes) kv.insert_or_assign(k, v);
    GgufWriter w;
    for (const auto& [k, v] : kv) w.Set(k, v);
    const std::string path = dir.File("h.gguf");
    EXPECT_TRUE(w.AddTensor("token_embd.weight", GgmlType::kF32, embd_dims).ok());
    EXPECT_TRUE(w.Begin(path, true).ok());
    uint64_t n = 1;
    for (uint64_t d : embd_dims) n *= d;
    EXPECT_TRUE(w.WriteTensorData("token_embd.weight", std::vector<uint8_t>(n * 4)).ok());
    EXPECT_TRUE(w.Finish().ok());
    auto f = GgufFile::OpenPath(path);
    EXPECT_TRUE(f.ok());
    return f.ok() ? ReadLlamaHparams(*f) : Result<LlamaHparams>(f.status());
  };
  auto good = write({}, {64, 10});
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->n_vocab, 10);
  EXPECT_EQ(good->n_kv_heads, 2);
  EXPECT_EQ(good->head_dim, 16);
  // A head size other than embedding_length / head_count (Mistral Nemo's layout): q is 4 heads of 32.
  auto keyed = write({{"llama.attention.key_length", GgufValue(uint32_t{32})},
                      {"llama.attention.value_length", GgufValue(uint32_t{32})},
                      {"llama.rope.dimension_count", GgufValue(uint32_t{32})}},
                     {64, 10});
  ASSERT_TRUE(keyed.ok()) << keyed.status().ToString();
  EXPECT_EQ(keyed->head_dim, 32);
  EXPECT_EQ(keyed->q_dim(), 128);
  EXPECT_EQ(keyed->kv_dim(), 64);
  struct Case {
    const char* what;
    std::map<std::string, GgufValue> changes;
    std::vector<uint64_t> embd_dims;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"zero layers", {{"llama.block_count", GgufValue(uint32_t{0})}}, {64, 10},
       "llama.block_count = 0 is out of range"},
      {"partial rotary", {{"llama.rope.dimension_count", GgufValue(uint32_t{8})}}, {64, 10},
       "llama.rope.dimension_count = 8, expected the head size 16"},
      {"value length", {{"llama.attention.key_length", GgufValue(uint32_t{8})},
                        {"llama.attention.value_length", GgufValue(uint32_t{16})}}, {64, 10},
       "llama.attention.value_length = 16, expected the key length 8"},
      {"odd key length",
       {{"llama.attention.key_length", GgufValue(uint32_t{7})}, {"llama.rope.dimension_count", GgufValue(uint32_t{7})}},
       {64, 10},
       "inconsistent heads: embedding_length 64, head_count 4, head_count_kv 2, head size 7"},
      {"kv heads", {{"llama.attention.head_count_kv", GgufValue(uint32_t{3})}}, {64, 10},
       "inconsistent heads: embedding_length 64, head_count 4, head_count_kv 3"},
      {"rope scaling type", {{"llama.rope.scaling.type", GgufValue(std::string("yarn"))}}, {64, 10},
       "llama.rope.scaling.type \"yarn\" (only linear)"},
      {"rope scaling factor",
       {{"llama.rope.scaling.type", GgufValue(std::string("linear"))},
        {"llama.rope.scaling.factor", GgufValue(0.0f)}},
       {64, 10}, "llama.rope.scaling.factor must be > 0"},
      {"experts used",
       {{"llama.expert_count", GgufValue(uint32_t{4})}, {"llama.expert_used_count", GgufValue(uint32_t{5})}},
       {64, 10}, "llama.expert_used_count 5 > llama.expert_count 4"},
      {"activation", {{"nflash.ffn_activation", GgufValue(std::string("tanh"))}}, {64, 10},
       "nflash.ffn_activation is \"tanh\", expected silu, relu or drelu"},
      {"embedding 1-D", {}, {640}, "token_embd.weight must be 2-D"},
  };
  for (const Case& c : cases) {
    auto hp = write(c.changes, c.embd_dims);
    ASSERT_FALSE(hp.ok()) << c.what;
    EXPECT_NE(hp.status().message().find(c.message), std::string::npos) << c.what << ": " << hp.status().ToString();
  }
  // No embedding: the vocabulary size cannot be known.
  ASSERT_TRUE(write({}, {64, 10}).ok());
  ASSERT_EQ(testing::RewriteGguf(dir.File("h.gguf"), dir.File("noembd.gguf"), nullptr,
                                 [](testing::GgufTensorCopy* t) { t->name = "tok_embeddings.weight"; }),
            "");
  auto no_embd = GgufFile::OpenPath(dir.File("noembd.gguf"));
  ASSERT_TRUE(no_embd.ok());
  auto missing = ReadLlamaHparams(*no_embd);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("tensor token_embd.weight is missing"), std::string::npos);
  // The engine computes from memory: a file read through pread (not mapped, not loaded) is refused by name.
  ASSERT_TRUE(write({}, {64, 10}).ok());
  auto pread = OpenPreadFile(dir.File("h.gguf"));
  ASSERT_TRUE(pread.ok());
  auto unmapped = GgufFile::Open(std::shared_ptr<const ReadableFile>(std::move(pread).value()));
  ASSERT_TRUE(unmapped.ok());
  auto m = Model::FromGguf(std::make_shared<const GgufFile>(std::move(unmapped).value()));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("the engine needs the file mapped or in memory"), std::string::npos)
      << m.status().ToString();
}

// The decode loop every front end shares refuses what it cannot run, by name: an empty prompt, a context not at
// position 0, a prompt that fills the context, a negative token budget. A prompt one short of the context leaves room
// for one token, whatever the budget asks.
TEST(EngineTest, GenerateRefusesWhatItCannotRun) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertShared(dir, "models/stories260K/stories260K.bin", FfnActivation::kSilu,
                                         GgmlType::kF32),
                           LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto tok = LoadTokenizer((*model)->gguf());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ThreadPool pool(1);
  InferenceContext ctx(**model, &pool, 8);
  GenerateOptions o;
  o.sampler.temperature = 0;
  o.max_tokens = 4;
  auto sink = [](std::string_view) { return true; };
  const std::vector<int32_t> none;
  auto r = Generate(ctx, **tok, none, o, sink);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("the prompt is empty"), std::string::npos) << r.status().ToString();
  const std::vector<int32_t> full = {1, 403, 407, 261, 378, 300, 301, 302};  // 8 tokens: the whole context
  r = Generate(ctx, **tok, full, o, sink);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the prompt has 8 tokens, more than the context size 8"), std::string::npos)
      << r.status().ToString();
  o.max_tokens = -1;
  r = Generate(ctx, **tok, std::span<const int32_t>(full).first(2), o, sink);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("max tokens -1 < 0"), std::string::npos) << r.status().ToString();
  o.max_tokens = 4;
  o.ignore_eos = true;
  r = Generate(ctx, **tok, std::span<const int32_t>(full).first(7), o, sink);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->generated_tokens, 1);
  EXPECT_EQ(r->reason, StopReason::kMaxTokens);
  EXPECT_EQ(ctx.pos(), 7);  // the last token is sampled, not evaluated
  r = Generate(ctx, **tok, std::span<const int32_t>(full).first(2), o, sink);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("the context is at position 7"), std::string::npos) << r.status().ToString();
}

// Whether `a` and `b` hold the same n floats, bit for bit.
bool SameFloats(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, sizeof(float) * static_cast<size_t>(n)) == 0;
}

// A context sent back to an earlier position (InferenceContext::Rewind: the server's prompt cache) continues as a
// fresh context that evaluated only the tokens before that position, bit for bit: a batch after the rewind (every
// position's logits) and a single token after that, with F32 and Q4_0 weights and F32 and F16 caches. With a sliding
// window of 40 the KV cache is a ring of 128 positions (40 + a 64-token tile, rounded up to a key block); after 150
// tokens position p sits where p + 128 has overwritten it for p < 22, so a rewind to 60 (whose query sees keys 21..60)
// is refused and one to 61 (keys 22..61) is not.
TEST(EngineTest, RewoundContextEqualsAFreshOne) {
  testing::TempDir dir;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> id(3, 511);
  std::vector<int32_t> first(150), rest(40);
  for (int32_t& t : first) t = id(rng);
  for (int32_t& t : rest) t = id(rng);
  first[0] = 1;
  ThreadPool pool(2);
  struct Case {
    GgmlType type;
    KvType kv;
    int64_t window;
    std::vector<int64_t> rewinds;
  };
  for (const Case& c : {Case{GgmlType::kF32, KvType::kF32, 0, {1, 77, 149, 150}},
                        Case{GgmlType::kQ4_0, KvType::kF16, 0, {100}},
                        Case{GgmlType::kF32, KvType::kF32, 40, {61, 149}}}) {
    auto model = Model::Load(ConvertShared(dir, "models/stories260K/stories260K.bin", FfnActivation::kSilu, c.type,
                                           c.window),
                             LoadOptions());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const int64_t nv = (*model)->hparams().n_vocab;
    for (int64_t k : c.rewinds) {
      const std::string what = std::string(GgmlTypeName(c.type)) + " " + KvTypeName(c.kv) + " window " +
                               std::to_string(c.window) + ", rewind to " + std::to_string(k);
      InferenceContext used(**model, &pool, 0, c.kv), fresh(**model, &pool, 0, c.kv);
      ASSERT_TRUE(used.Eval(first, false).ok()) << what;
      ASSERT_TRUE(used.CanRewind(k)) << what;
      ASSERT_TRUE(used.Rewind(k).ok()) << what;
      EXPECT_EQ(used.pos(), k);
      std::vector<int32_t> expected(first.begin(), first.begin() + k);
      expected.insert(expected.end(), rest.begin(), rest.end());
      ASSERT_TRUE(used.Eval(rest, true).ok()) << what;
      ASSERT_TRUE(fresh.Eval(expected, true).ok()) << what;
      for (int64_t t = 0; t < static_cast<int64_t>(rest.size()); ++t) {
        ASSERT_TRUE(SameFloats(used.logits(t), fresh.logits(k + t), nv)) << what << ", token " << t << " of the rest";
      }
      const int32_t next = 300;
      ASSERT_TRUE(used.Eval({&next, 1}, false).ok());
      ASSERT_TRUE(fresh.Eval({&next, 1}, false).ok());
      EXPECT_TRUE(SameFloats(used.logits(), fresh.logits(), nv)) << what << ", the token after";
    }
    InferenceContext ctx(**model, &pool, 0, c.kv);
    ASSERT_TRUE(ctx.Eval(first, false).ok());
    EXPECT_FALSE(ctx.CanRewind(-1));
    EXPECT_FALSE(ctx.CanRewind(151));
    EXPECT_EQ(ctx.CanRewind(60), c.window == 0);
    EXPECT_EQ(ctx.CanRewind(0), c.window == 0);
    if (c.window > 0) {
      EXPECT_EQ(ctx.kv_positions(), 128);
      const Status s = ctx.Rewind(60);
      EXPECT_EQ(s.code(), StatusCode::kInternal);
      EXPECT_NE(s.message().find("cannot rewind the context from position 150 to 60 (KV ring of 128 positions, "
                                 "sliding window 40)"),
                std::string::npos)
          << s.ToString();
      EXPECT_EQ(ctx.pos(), 150);
    }
  }
}

// GenerateCached keeps the longest prefix the context holds of a new prompt (never the prompt's last token) and gives
// the text Generate gives from position 0, bit-identical logits making it the same greedy and seeded text; `held`
// follows what the context holds. Not reused: with reuse off, a ring that has overwritten the prefix's keys, or a held
// list that does not match the context (Internal).
TEST(EngineTest, GenerateCachedContinuesFromTheHeldPrefix) {
  testing::TempDir dir;
  ThreadPool pool(2);
  for (int64_t window : {0, 16}) {
    auto model = Model::Load(ConvertShared(dir, "models/stories260K/stories260K.bin", FfnActivation::kSilu,
                                           GgmlType::kQ8_0, window),
                             LoadOptions());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto tok = LoadTokenizer((*model)->gguf());
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    GenerateOptions o;
    o.sampler.seed = 11;
    o.max_tokens = 30;
    o.ignore_eos = true;
    auto text_of = [&](InferenceContext& ctx, HeldTokens* held, bool reuse, const std::vector<int32_t>& prompt,
                       GenerateResult* result) {
      std::string text;
      auto r = held ? GenerateCached(ctx, held, reuse, **tok, prompt, o, [&](std::string_view p) {
        text += p;
        return true;
      })
                    : Generate(ctx, **tok, prompt, o, [&](std::string_view p) {
                        text += p;
                        return true;
                      });
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) *result = *r;
      return text;
    };
    const std::vector<int32_t> one = (*tok)->Encode("Once upon a time, there was a little dog", true);
    std::vector<int32_t> two = one;
    for (int32_t t : (*tok)->Encode(" who liked to play in the park", false)) two.push_back(t);
    InferenceContext ctx(**model, &pool, 256);
    HeldTokens held;
    GenerateResult first, again, reference;
    for (float temperature : {0.0f, 0.8f}) {
      o.sampler.temperature = temperature;
      const std::string what = "window " + std::to_string(window) + ", temperature " + std::to_string(temperature);
      const std::string text_one = text_of(ctx, &held, true, one, &first);
      EXPECT_EQ(static_cast<int64_t>(held.ids.size()), ctx.pos()) << what;
      EXPECT_EQ(ctx.pos(), static_cast<int64_t>(one.size()) + first.generated_tokens - 1) << what;
      EXPECT_TRUE(std::equal(one.begin(), one.end(), held.ids.begin())) << what;
      const std::string text_two = text_of(ctx, &held, true, two, &again);
      InferenceContext fresh(**model, &pool, 256);
      EXPECT_EQ(text_two, text_of(fresh, nullptr, false, two, &reference)) << what;
      EXPECT_GT(reference.generated_tokens, 10) << what;
      // The held sequence (one, then its 29 evaluated tokens) shares `one` with `two`. With a window of 16 the ring
      // (16 + 64 rounded up: 128 positions) still holds every key `two`'s queries see: 11 + 29 < 128.
      EXPECT_EQ(again.cached_tokens, static_cast<int64_t>(one.size())) << what;
      EXPECT_EQ(again.prompt_tokens, static_cast<int64_t>(two.size())) << what;
      // The same prompt again: all of it kept but its last token.
      EXPECT_EQ(text_of(ctx, &held, true, two, &again), text_two) << what;
      EXPECT_EQ(again.cached_tokens, static_cast<int64_t>(two.size()) - 1) << what;
      EXPECT_EQ(text_of(ctx, &held, false, two, &again), text_two) << what;
      EXPECT_EQ(again.cached_tokens, 0) << what;
    }
    // A long generation wraps the window's ring: the prefix's keys are gone and the prompt is evaluated anew.
    o.max_tokens = 200;
    o.sampler.temperature = 0;
    text_of(ctx, &held, true, one, &first);
    ASSERT_EQ(ctx.pos(), static_cast<int64_t>(one.size()) + 199);
    const std::string text_two = text_of(ctx, &held, true, two, &again);
    EXPECT_EQ(again.cached_tokens, window == 0 ? static_cast<int64_t>(one.size()) : 0) << window;
    InferenceContext fresh(**model, &pool, 256);
    EXPECT_EQ(text_two, text_of(fresh, nullptr, false, two, &reference)) << window;
    // A forward pass that fails mid-generation (as a flash read error would) leaves nothing held: the next request
    // starts over.
    struct FailingFfn : FfnBackend {
      int64_t calls_left = 0;
      Result<bool> Forward(int64_t, int64_t, const Activation&, float*) override {
        if (--calls_left < 0) return Status::IOError("injected FFN failure");
        return false;  // the dense path
      }
    } failing;
    failing.calls_left = 3 * (*model)->hparams().n_layers;  // the rest of the prompt and two tokens, then a failure
    ctx.SetFfnBackend(&failing);
    auto failed = GenerateCached(ctx, &held, true, **tok, two, o, [](std::string_view) { return true; });
    ctx.SetFfnBackend(nullptr);
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("injected FFN failure"), std::string::npos) << failed.status().ToString();
    EXPECT_TRUE(held.ids.empty());
    EXPECT_EQ(ctx.pos(), 0);
    EXPECT_EQ(text_of(ctx, &held, true, two, &again), text_two) << window;
    EXPECT_EQ(again.cached_tokens, 0) << window;
    // A held list that is not the context's.
    held.ids.pop_back();
    auto r = GenerateCached(ctx, &held, true, **tok, two, o, [](std::string_view) { return true; });
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInternal);
    EXPECT_NE(r.status().message().find("held tokens for a context at position"), std::string::npos)
        << r.status().ToString();
  }
}

TEST(EngineTest, RejectsBadInput) {
  testing::TempDir dir;
  auto model = Model::Load(WriteTinyMoe(dir, 4, 2), {});
  ASSERT_TRUE(model.ok());
  ThreadPool pool(1);
  InferenceContext ctx(**model, &pool, 8);
  int32_t bad = 40;
  Status s = ctx.Eval({&bad, 1}, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("40"), std::string::npos);
  bad = -1;
  s = ctx.Eval({&bad, 1}, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token id -1 is outside the vocabulary"), std::string::npos) << s.message();
  s = ctx.Eval({}, false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("empty batch"), std::string::npos) << s.message();
  std::vector<int32_t> nine(9, 1);
  s = ctx.Eval(nine, false);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("context full: position 0 + 9 tokens exceeds the context size 8"), std::string::npos)
      << s.message();
  std::vector<int32_t> eight(8, 1);
  EXPECT_TRUE(ctx.Eval(eight, false).ok()) << "exactly the context size fits";
  auto missing = Model::Load(dir.File("nope.gguf"), {});
  EXPECT_FALSE(missing.ok());

  auto arch = Model::Load(WriteTinyMoe(dir, 4, 2, "gpt2", "", "arch.gguf"), {});
  ASSERT_FALSE(arch.ok());
  EXPECT_EQ(arch.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(arch.status().message().find("\"gpt2\""), std::string::npos) << arch.status().message();

  auto no_tensor = Model::Load(WriteTinyMoe(dir, 4, 2, "llama", "blk.1.attn_v.weight", "missing.gguf"), {});
  ASSERT_FALSE(no_tensor.ok());
  EXPECT_NE(no_tensor.status().message().find("blk.1.attn_v.weight"), std::string::npos);

  auto shape = Model::Load(WriteTinyMoe(dir, 4, 2, "llama", "", "shape.gguf", 32), {});
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("blk.0.attn_q.weight has shape [64, 32], expected [64, 64]"),
            std::string::npos)
      << shape.status().message();
}

}  // namespace
}  // namespace nflash
