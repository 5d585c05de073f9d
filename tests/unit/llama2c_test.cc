// llama2.c reader: v0 and v1 checkpoints written byte by byte by the test, corrupt headers, and the tokenizer format.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "converter/llama2c_reader.h"
#include "converter/readers.h"
#include "tests/test_util.h"

namespace nflash::converter {
namespace {

using nflash::testing::SharedPath;
using nflash::testing::TempDir;
using nflash::testing::WriteBytes;

// A tiny model: hidden 40 is deliberately not a multiple of 32 (as stories260K's 172), kv heads < heads (GQA).
struct Dims {
  int32_t dim = 16, hidden = 40, layers = 2, heads = 4, kv_heads = 2, vocab = 10, seq_len = 8;
  int32_t kv_dim() const { return dim / heads * kv_heads; }
  int32_t head_size() const { return dim / heads; }
};

// llama2.c's arrays (all layers concatenated), filled from a seed; the test's own description of the format.
struct Arrays {
  std::map<std::string, std::vector<float>> a;
};

Arrays MakeArrays(const Dims& d, bool shared, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
  };
  const size_t L = d.layers, D = d.dim, H = d.hidden, V = d.vocab, KV = d.kv_dim();
  Arrays r;
  r.a["tok"] = fill(V * D);
  r.a["rms_att"] = fill(L * D);
  r.a["wq"] = fill(L * D * D);
  r.a["wk"] = fill(L * KV * D);
  r.a["wv"] = fill(L * KV * D);
  r.a["wo"] = fill(L * D * D);
  r.a["rms_ffn"] = fill(L * D);
  r.a["w1"] = fill(L * H * D);
  r.a["w2"] = fill(L * D * H);
  r.a["w3"] = fill(L * H * D);
  r.a["rms_final"] = fill(D);
  r.a["freq_real"] = fill(size_t(d.seq_len) * d.head_size() / 2);
  r.a["freq_imag"] = fill(size_t(d.seq_len) * d.head_size() / 2);
  if (!shared) r.a["wcls"] = fill(V * D);
  return r;
}

void PutI32(std::vector<uint8_t>* out, int32_t v) {
  uint8_t b[4];
  std::memcpy(b, &v, 4);
  out->insert(out->end(), b, b + 4);
}
void PutF32s(std::vector<uint8_t>* out, const std::vector<float>& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  out->insert(out->end(), p, p + v.size() * 4);
}

// v0: 7 int32 (vocab negative when the classifier is separate), then export.py legacy_export's order.
std::vector<uint8_t> EncodeV0(const Dims& d, bool shared, const Arrays& r) {
  std::vector<uint8_t> out;
  for (int32_t v : {d.dim, d.hidden, d.layers, d.heads, d.kv_heads, shared ? d.vocab : -d.vocab, d.seq_len}) {
    PutI32(&out, v);
  }
  for (const char* k : {"tok", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final", "freq_real",
                        "freq_imag"}) {
    PutF32s(&out, r.a.at(k));
  }
  if (!shared) PutF32s(&out, r.a.at("wcls"));
  return out;
}

// v1: magic, version, 7 int32, u8 shared flag, zeros to 256; then export.py version1_export's order (norms first).
std::vector<uint8_t> EncodeV1(const Dims& d, bool shared, const Arrays& r, int32_t version = 1) {
  std::vector<uint8_t> out;
  PutI32(&out, 0x616b3432);
  PutI32(&out, version);
  for (int32_t v : {d.dim, d.hidden, d.layers, d.heads, d.kv_heads, d.vocab, d.seq_len}) PutI32(&out, v);
  out.push_back(shared ? 1 : 0);
  out.resize(256, 0);
  for (const char* k : {"rms_att", "rms_ffn", "rms_final", "tok", "wq", "wk", "wv", "wo", "w1", "w2", "w3"}) {
    PutF32s(&out, r.a.at(k));
  }
  if (!shared) PutF32s(&out, r.a.at("wcls"));
  return out;
}

// A tokenizer.bin with one token of each kind llama.cpp distinguishes.
std::vector<uint8_t> EncodeTokenizer(const std::vector<std::string>& tokens) {
  std::vector<uint8_t> out;
  PutI32(&out, 8);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float score = -static_cast<float>(i);
    PutF32s(&out, {score});
    PutI32(&out, static_cast<int32_t>(tokens[i].size()));
    out.insert(out.end(), tokens[i].begin(), tokens[i].end());
  }
  return out;
}
const std::vector<std::string> kTokens = {"<unk>", "\n<s>\n", "\n</s>\n", "<0x0A>", "<0xff>",
                                          " a",    "b c",     "",         "hi",     " the"};

// Expected GGUF tensors: name -> (dims, values), sliced from the llama2.c arrays by layer.
std::map<std::string, std::pair<std::vector<uint64_t>, std::vector<float>>> Expected(const Dims& d, bool shared,
                                                                                    const Arrays& r) {
  std::map<std::string, std::pair<std::vector<uint64_t>, std::vector<float>>> e;
  const uint64_t D = d.dim, H = d.hidden, V = d.vocab, KV = d.kv_dim();
  auto slice = [&](const char* k, int l, uint64_t n) {
    const auto& v = r.a.at(k);
    return std::vector<float>(v.begin() + l * n, v.begin() + (l + 1) * n);
  };
  e["token_embd.weight"] = {{D, V}, r.a.at("tok")};
  e["output_norm.weight"] = {{D}, r.a.at("rms_final")};
  if (!shared) e["output.weight"] = {{D, V}, r.a.at("wcls")};
  for (int l = 0; l < d.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    e[p + "attn_norm.weight"] = {{D}, slice("rms_att", l, D)};
    e[p + "attn_q.weight"] = {{D, D}, slice("wq", l, D * D)};
    e[p + "attn_k.weight"] = {{D, KV}, slice("wk", l, KV * D)};
    e[p + "attn_v.weight"] = {{D, KV}, slice("wv", l, KV * D)};
    e[p + "attn_output.weight"] = {{D, D}, slice("wo", l, D * D)};
    e[p + "ffn_norm.weight"] = {{D}, slice("rms_ffn", l, D)};
    e[p + "ffn_gate.weight"] = {{D, H}, slice("w1", l, H * D)};
    e[p + "ffn_down.weight"] = {{H, D}, slice("w2", l, D * H)};
    e[p + "ffn_up.weight"] = {{D, H}, slice("w3", l, H * D)};
  }
  return e;
}

template <typename T>
T Get(const Result<T>& r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r.value() : T{};
}

class Llama2cTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  TempDir dir_;
};

TEST_P(Llama2cTest, ReadsEveryTensorAtItsNameAndShape) {
  const auto [version, shared] = GetParam();
  Dims d;
  Arrays r = MakeArrays(d, shared, 1234 + version * 10 + shared);
  const std::string model = dir_.File("model.bin");
  WriteBytes(model, version == 0 ? EncodeV0(d, shared, r) : EncodeV1(d, shared, r));
  WriteBytes(dir_.File("tok.bin"), EncodeTokenizer(kTokens));

  auto m = ReadLlama2c(model, dir_.File("tok.bin"), FfnActivation::kRelu);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->source_format, version == 0 ? "llama2c-v0" : "llama2c-v1");
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.dim, 16);
  EXPECT_EQ(c.n_ff, 40);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.n_vocab, 10);
  EXPECT_EQ(c.context_length, 8);
  EXPECT_EQ(c.tied_embeddings, shared);
  EXPECT_EQ(c.activation, FfnActivation::kRelu);
  EXPECT_EQ(c.name, "model");

  auto expected = Expected(d, shared, r);
  ASSERT_EQ(m->tensors.size(), expected.size());
  EXPECT_EQ(m->tensors.front().name, "token_embd.weight");
  for (const SourceTensor& t : m->tensors) {
    auto it = expected.find(t.name);
    ASSERT_NE(it, expected.end()) << "unexpected tensor " << t.name;
    EXPECT_EQ(t.dims, it->second.first) << t.name;
    EXPECT_EQ(t.source_type, GgmlType::kF32);
    auto values = t.load_f32();
    ASSERT_TRUE(values.ok()) << values.status().ToString();
    EXPECT_EQ(*values, it->second.second) << t.name;
    auto raw = t.load_raw();
    ASSERT_TRUE(raw.ok());
    ASSERT_EQ(raw->size(), it->second.second.size() * 4);
    EXPECT_EQ(std::memcmp(raw->data(), it->second.second.data(), raw->size()), 0) << t.name;
  }
}

INSTANTIATE_TEST_SUITE_P(VersionsAndClassifier, Llama2cTest,
                         ::testing::Combine(::testing::Values(0, 1), ::testing::Bool()));

TEST(Llama2cTokenizer, MapsTokensToGgufLlamaConventions) {
  TempDir dir;
  WriteBytes(dir.File("tok.bin"), EncodeTokenizer(kTokens));
  auto t = ReadLlama2cTokenizer(dir.File("tok.bin"), 10);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->model, "llama");
  const std::vector<std::string> want = {"<unk>", "<s>", "</s>", "<0x0A>", "<0xff>",
                                         "\xe2\x96\x81" "a", "b\xe2\x96\x81" "c", "", "hi", "\xe2\x96\x81the"};
  EXPECT_EQ(t->tokens, want);
  EXPECT_EQ(t->token_types, (std::vector<int32_t>{2, 3, 3, 6, 6, 1, 1, 3, 1, 1}));
  ASSERT_EQ(t->scores.size(), 10u);
  EXPECT_EQ(t->scores[9], -9.0f);
  EXPECT_EQ(t->bos_id, 1);
  EXPECT_EQ(t->eos_id, 2);
  EXPECT_EQ(t->unk_id, 0);
  EXPECT_EQ(t->add_bos, std::optional<bool>(true));
}

TEST(Llama2cTokenizer, ParsesStories260KTokenizer) {
  auto t = ReadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"), 512);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->tokens.size(), 512u);
  EXPECT_EQ(t->tokens[0], "<unk>");
  EXPECT_EQ(t->tokens[1], "<s>");
  EXPECT_EQ(t->tokens[2], "</s>");
  for (int b = 0; b < 256; ++b) {
    char want[8];
    std::snprintf(want, sizeof want, "<0x%02X>", b);
    EXPECT_EQ(t->tokens[3 + b], want);
    EXPECT_EQ(t->token_types[3 + b], 6) << b;
  }
  EXPECT_EQ(t->tokens[259], "\xe2\x96\x81t");  // " t" in tok512.bin
  EXPECT_EQ(t->token_types[259], 1);
  EXPECT_EQ(t->scores[260], -1.0f);
  // Without an expected count the whole file is read: the same 512 tokens.
  auto all = ReadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"), 0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->tokens.size(), 512u);
}

TEST(Llama2cTokenizer, RejectsWrongVocabularySizeAndTruncation) {
  auto more = ReadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"), 100);
  ASSERT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("vocab_size 100"), std::string::npos) << more.status().ToString();
  auto fewer = ReadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"), 600);
  ASSERT_FALSE(fewer.ok());
  EXPECT_NE(fewer.status().message().find("token 512"), std::string::npos) << fewer.status().ToString();

  TempDir dir;
  std::vector<uint8_t> bytes = EncodeTokenizer(kTokens);
  bytes.resize(bytes.size() - 2);  // cut inside " the"
  WriteBytes(dir.File("tok.bin"), bytes);
  auto cut = ReadLlama2cTokenizer(dir.File("tok.bin"), 10);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), StatusCode::kCorruption);
  EXPECT_NE(cut.status().message().find("token 9"), std::string::npos) << cut.status().ToString();
}

TEST(Llama2cTokenizer, CorruptFilesNameTheFieldAndOffset) {
  TempDir dir;
  struct Case {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* needle;
  };
  std::vector<uint8_t> zero_max = EncodeTokenizer(kTokens);
  std::fill(zero_max.begin(), zero_max.begin() + 4, 0);
  std::vector<uint8_t> negative = EncodeTokenizer(kTokens);
  const int32_t minus5 = -5;
  std::memcpy(negative.data() + 4 + 4, &minus5, 4);  // token 0's length
  std::vector<uint8_t> past_end = EncodeTokenizer(kTokens);
  const int32_t long_len = 6;  // " the" is 4 bytes and the last token
  std::memcpy(past_end.data() + past_end.size() - 4 - 4, &long_len, 4);
  const std::vector<Case> cases = {
      {"3 bytes", {8, 0, 0}, "3 bytes is too short"},
      {"max_token_length 0", zero_max, "max_token_length at offset 0 is 0"},
      {"negative length", negative, "token 0 at offset 8 has length -5"},
      {"length past the end", past_end, "has length 6, but 4 bytes remain"},
      {"two tokens", EncodeTokenizer({"<unk>", "\n<s>\n"}), "has 2 tokens; at least <unk>, <s>, </s>"},
  };
  for (const Case& c : cases) {
    WriteBytes(dir.File("tok.bin"), c.bytes);
    for (int64_t n_vocab : {int64_t{0}, static_cast<int64_t>(kTokens.size())}) {
      if (std::string(c.what) == "two tokens" && n_vocab != 0) continue;  // a count would report the cut instead
      auto t = ReadLlama2cTokenizer(dir.File("tok.bin"), n_vocab);
      ASSERT_FALSE(t.ok()) << c.what;
      EXPECT_EQ(t.status().code(), StatusCode::kCorruption) << c.what;
      EXPECT_NE(t.status().message().find(c.needle), std::string::npos) << c.what << ": " << t.status().ToString();
    }
  }
}

class Llama2cCorruptTest : public ::testing::Test {
 protected:
  // Writes `bytes` as a checkpoint beside a valid tokenizer and returns ReadLlama2c's status.
  Status Read(const std::vector<uint8_t>& bytes) {
    WriteBytes(dir_.File("m.bin"), bytes);
    WriteBytes(dir_.File("tok.bin"), EncodeTokenizer(kTokens));
    auto m = ReadLlama2c(dir_.File("m.bin"), dir_.File("tok.bin"), FfnActivation::kSilu);
    return m.status();
  }
  TempDir dir_;
  Dims d_;
};

TEST_F(Llama2cCorruptTest, WrongFileSizeNamesExpectedAndFound) {
  std::vector<uint8_t> good = EncodeV0(d_, true, MakeArrays(d_, true, 7));
  std::vector<uint8_t> cut(good.begin(), good.end() - 4);
  Status s = Read(cut);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find(std::to_string(good.size())), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(std::to_string(cut.size())), std::string::npos) << s.ToString();

  std::vector<uint8_t> longer = good;
  longer.resize(good.size() + 8);
  s = Read(longer);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(std::to_string(longer.size())), std::string::npos) << s.ToString();

  // A v0 file read with the wrong shared flag (positive vocab but wcls present) is caught by size as well.
  std::vector<uint8_t> separate = EncodeV0(d_, false, MakeArrays(d_, false, 7));
  int32_t positive = d_.vocab;
  std::memcpy(separate.data() + 20, &positive, 4);
  EXPECT_FALSE(Read(separate).ok());
}

TEST_F(Llama2cCorruptTest, VersionsAndMagic) {
  Arrays r = MakeArrays(d_, true, 8);
  Status s = Read(EncodeV1(d_, true, r, 2));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("version 2"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("int8"), std::string::npos) << s.ToString();

  s = Read(EncodeV1(d_, true, r, 7));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("version 7"), std::string::npos) << s.ToString();

  // A damaged magic makes the file a "v0" whose first field (dim) is absurd: the error says which layout was assumed.
  std::vector<uint8_t> bad = EncodeV1(d_, true, r);
  bad[0] ^= 0x01;
  s = Read(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("dim"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("ak42"), std::string::npos) << s.ToString();

  // Shorter than any header.
  s = Read({1, 2, 3});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("3 bytes is too short"), std::string::npos) << s.ToString();

  // The magic, then less than a v1 header.
  std::vector<uint8_t> stub(bad.begin(), bad.begin() + 40);  // a v0 header fits, a v1 one (256 bytes) not
  stub[0] ^= 0x01;  // the magic restored
  s = Read(stub);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("'ak42' magic but only 40 bytes"), std::string::npos) << s.ToString();
}

TEST_F(Llama2cCorruptTest, NonPositiveAndInconsistentDimsNameTheField) {
  Arrays r = MakeArrays(d_, true, 9);
  struct Case {
    int field;  // index among the 7 params
    int32_t value;
    const char* needle;
  };
  for (const Case& c : {Case{0, -16, "dim"}, Case{1, 0, "hidden_dim"}, Case{2, -1, "n_layers"},
                        Case{3, 0, "n_heads"}, Case{4, -2, "n_kv_heads"}, Case{6, 0, "seq_len"},
                        Case{3, 3, "n_heads"}, Case{4, 3, "n_kv_heads"},
                        Case{3, 6, "dim 16 is not a multiple of n_heads 6"},  // 6 is a multiple of n_kv_heads 2
                        Case{3, 16, "head size dim/n_heads = 1 is odd"}}) {
    for (int version : {0, 1}) {
      std::vector<uint8_t> bytes = version == 0 ? EncodeV0(d_, true, r) : EncodeV1(d_, true, r);
      std::memcpy(bytes.data() + (version == 0 ? 0 : 8) + 4 * c.field, &c.value, 4);
      Status s = Read(bytes);
      ASSERT_FALSE(s.ok()) << "field " << c.field << " = " << c.value;
      EXPECT_EQ(s.code(), StatusCode::kCorruption);
      EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.ToString();
    }
  }
  // Every field at its largest (2^24): the tensors would end past 2^64 bytes, said so rather than wrapped around.
  std::vector<uint8_t> huge = EncodeV1(d_, true, r);
  for (int field : {0, 1, 2, 5}) {
    const int32_t big = 1 << 24;
    std::memcpy(huge.data() + 8 + 4 * field, &big, 4);
  }
  Status big = Read(huge);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.message().find("larger than 2^64 bytes"), std::string::npos) << big.ToString();

  // v1 has no sign convention: a negative vocab_size is corrupt there.
  std::vector<uint8_t> v1 = EncodeV1(d_, true, r);
  int32_t neg = -d_.vocab;
  std::memcpy(v1.data() + 8 + 20, &neg, 4);
  Status s = Read(v1);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("vocab_size"), std::string::npos) << s.ToString();
}

TEST_F(Llama2cCorruptTest, HeaderReportsLayoutForInspect) {
  WriteBytes(dir_.File("m.bin"), EncodeV0(d_, false, MakeArrays(d_, false, 3)));
  auto f = OpenPreadFile(dir_.File("m.bin"));
  ASSERT_TRUE(f.ok());
  auto h = ReadLlama2cHeader(**f);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->version, 0);
  EXPECT_FALSE(h->shared_classifier);
  EXPECT_EQ(h->vocab_size, 10);
  EXPECT_EQ(h->expected_file_bytes, h->file_bytes);
  // 28-byte header + every array of MakeArrays, counted independently.
  const uint64_t floats = 10 * 16 + 2 * 16 + 2 * 256 + 2 * 128 + 2 * 128 + 2 * 256 + 2 * 16 + 3 * 2 * 640 + 16 +
                          2 * 8 * 2 + 10 * 16;
  EXPECT_EQ(h->expected_file_bytes, 28 + 4 * floats);
  auto layout = Llama2cLayout(*h);
  int skipped = 0;
  for (const auto& t : layout) skipped += t.name.empty();
  EXPECT_EQ(skipped, 2);  // freq_cis_real / freq_cis_imag
  EXPECT_EQ(layout.back().name, "output.weight");
}

TEST(Llama2cReader, FindsTheTokenizerBesideTheCheckpoint) {
  EXPECT_EQ(Get(FindLlama2cTokenizer(SharedPath("models/stories260K/stories260K.bin"))),
            SharedPath("models/stories260K/tok512.bin"));
  auto none = FindLlama2cTokenizer(SharedPath("models/stories260K-relu/stories260K-relu.bin"));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("missing tokenizer: pass --tokenizer"), std::string::npos);

  TempDir dir;
  WriteBytes(dir.File("model.bin"), {0});
  WriteBytes(dir.File("tok1.bin"), {0});
  WriteBytes(dir.File("tok2.bin"), {0});
  auto two = FindLlama2cTokenizer(dir.File("model.bin"));
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("ambiguous"), std::string::npos) << two.status().ToString();
  WriteBytes(dir.File("tokenizer.bin"), {0});  // the canonical name wins
  EXPECT_EQ(Get(FindLlama2cTokenizer(dir.File("model.bin"))), dir.File("tokenizer.bin"));
}

TEST(Llama2cReader, MissingFilesAreReported) {
  TempDir dir;
  auto m = ReadLlama2c(dir.File("absent.bin"), dir.File("tok.bin"), FfnActivation::kSilu);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("absent.bin"), std::string::npos);

  Dims d;
  WriteBytes(dir.File("m.bin"), EncodeV0(d, true, MakeArrays(d, true, 5)));
  m = ReadLlama2c(dir.File("m.bin"), dir.File("no-tokenizer.bin"), FfnActivation::kSilu);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("no-tokenizer.bin"), std::string::npos);
}

}  // namespace
}  // namespace nflash::converter
