// Unit tests of the Hugging Face input side: safetensors reading and corrupt-input rejection, the SentencePiece
// protobuf decoder, tokenizer.json parsing, and config.json parsing. Fixtures are written by hand here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "converter/hf_reader.h"
#include "converter/hf_tokenizer.h"
#include "converter/safetensors.h"
#include "runtime/core/file.h"
#include "tests/test_util.h"

namespace nflash::converter {
namespace {

// `text` contains `part` (gtest without gmock: the test executables do not link gmock).
#define EXPECT_CONTAINS(text, part)                                                              \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "\"" << (text) << "\" lacks \"" << (part) << "\""

// One tensor of a hand-built file: name, dtype string, shape, little-endian data bytes.
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// The file layout written from scratch: u64 header length, JSON, data.
std::vector<uint8_t> RawFile(const std::string& header, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  PutU64(&out, header.size());
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> BuildFile(const std::vector<TensorSpec>& tensors, const std::string& metadata_json = "") {
  std::string header = "{";
  std::vector<uint8_t> data;
  if (!metadata_json.empty()) header += "\"__metadata__\":" + metadata_json + ",";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    std::string shape;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) shape += ',';
      shape += std::to_string(t.shape[d]);
    }
    if (i > 0) header += ',';
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
              std::to_string(data.size()) + "," + std::to_string(data.size() + t.data.size()) + "]}";
    data.insert(data.end(), t.data.begin(), t.data.end());
  }
  header += "}";
  // Pad the header to a multiple of 8 with spaces, as the reference writer does.
  while (header.size() % 8 != 0) header += ' ';
  return RawFile(header, data);
}

std::vector<uint8_t> F32Bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());  // the test host is little-endian (x86-64)
  return out;
}
std::vector<uint8_t> U16Bytes(const std::vector<uint16_t>& v) {
  std::vector<uint8_t> out;
  for (uint16_t x : v) {
    out.push_back(static_cast<uint8_t>(x));
    out.push_back(static_cast<uint8_t>(x >> 8));
  }
  return out;
}

Result<SafetensorsFile> OpenBytes(std::vector<uint8_t> bytes) {
  return SafetensorsFile::Open(std::make_shared<MemoryFile>("test.safetensors", std::move(bytes)));
}

// Expects Open to fail with `code` and a message containing each of `parts`.
void ExpectRejected(std::vector<uint8_t> bytes, StatusCode code, const std::vector<std::string>& parts) {
  Result<SafetensorsFile> r = OpenBytes(std::move(bytes));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status().ToString();
  EXPECT_CONTAINS(r.status().message(), "test.safetensors");
  for (const std::string& p : parts) EXPECT_CONTAINS(r.status().message(), p);
}

TEST(Safetensors, ReadsF32F16Bf16) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> f32(6 * 5);
  for (float& x : f32) x = dist(rng);
  // F16 values with their IEEE half encodings, written out by hand (normals, a subnormal, the largest finite).
  const std::vector<uint16_t> f16_bits = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x0000, 0x8000, 0x3555};
  const std::vector<float> f16_want = {1.0f, -2.0f, 0.5f, 65504.0f, 5.9604644775390625e-8f, 0.0f, -0.0f,
                                       0.333251953125f};
  // BF16 is the top half of an F32: truncated random floats are exactly representable.
  std::vector<uint16_t> bf16_bits(12);
  std::vector<float> bf16_want(12);
  for (size_t i = 0; i < bf16_bits.size(); ++i) {
    float x = dist(rng);
    uint32_t u;
    std::memcpy(&u, &x, 4);
    bf16_bits[i] = static_cast<uint16_t>(u >> 16);
    u &= 0xFFFF0000u;
    std::memcpy(&bf16_want[i], &u, 4);
  }
  auto bytes = BuildFile({{"a.weight", "F32", {6, 5}, F32Bytes(f32)},
                          {"b.f16", "F16", {2, 4}, U16Bytes(f16_bits)},
                          {"c.bf16", "BF16", {3, 2, 2}, U16Bytes(bf16_bits)},
                          {"empty", "F32", {0, 7}, {}}},
                         R"({"format":"pt","note":"x"})");
  Result<SafetensorsFile> r = OpenBytes(bytes);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const SafetensorsFile& st = *r;
  ASSERT_EQ(st.tensors().size(), 4u);
  const SafetensorsTensor* a = st.Find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{6, 5}));
  EXPECT_EQ(a->n_elements, 30u);
  EXPECT_EQ(a->n_bytes, 120u);
  EXPECT_EQ(a->offset, st.data_offset());
  EXPECT_EQ(st.data_offset() % 8, 0u);
  EXPECT_EQ(st.total_tensor_bytes(), 120u + 16u + 24u);
  ASSERT_EQ(st.metadata().size(), 2u);
  EXPECT_EQ(st.metadata()[0], (std::pair<std::string, std::string>{"format", "pt"}));

  auto fa = st.ReadF32("a.weight");
  ASSERT_TRUE(fa.ok());
  EXPECT_EQ(*fa, f32);
  auto fb = st.ReadF32("b.f16");
  ASSERT_TRUE(fb.ok());
  ASSERT_EQ(fb->size(), f16_want.size());
  for (size_t i = 0; i < f16_want.size(); ++i) {
    EXPECT_EQ((*fb)[i], f16_want[i]) << i;
    EXPECT_EQ(std::signbit((*fb)[i]), std::signbit(f16_want[i])) << i;
  }
  auto fc = st.ReadF32("c.bf16");
  ASSERT_TRUE(fc.ok());
  EXPECT_EQ(*fc, bf16_want);
  EXPECT_EQ(st.Find("c.bf16")->shape, (std::vector<uint64_t>{3, 2, 2}));
  auto fe = st.ReadF32("empty");
  ASSERT_TRUE(fe.ok());
  EXPECT_TRUE(fe->empty());

  auto raw = st.ReadRaw(*st.Find("b.f16"));
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(*raw, U16Bytes(f16_bits));

  auto missing = st.ReadF32("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_CONTAINS(missing.status().message(), "nope");
}

TEST(Safetensors, OpensFromDiskAndReportsReadErrors) {
  testing::TempDir dir;
  const std::vector<float> v = {1, 2, 3, 4};
  auto bytes = BuildFile({{"w", "F32", {2, 2}, F32Bytes(v)}});
  testing::WriteBytes(dir.File("m.safetensors"), bytes);
  auto r = SafetensorsFile::OpenPath(dir.File("m.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto got = r->ReadF32("w");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, v);

  // An I/O error while reading the data section surfaces with the tensor's name.
  auto base = std::make_shared<MemoryFile>("faulty.safetensors", bytes);
  auto faulty = std::make_shared<FaultInjectingFile>(base);
  faulty->AddRule({FaultInjectingFile::Fault::kEio, bytes.size() - 16, 16, -1});
  auto st = SafetensorsFile::Open(faulty);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto bad = st->ReadF32("w");
  ASSERT_FALSE(bad.ok());
  EXPECT_CONTAINS(bad.status().message(), "\"w\"");
}

TEST(SafetensorsCorrupt, TruncatedHeaderLength) {
  ExpectRejected({1, 0, 0}, StatusCode::kCorruption, {"header length", "too short"});
}

TEST(SafetensorsCorrupt, HeaderLengthBeyondFile) {
  auto bytes = BuildFile({{"w", "F32", {1}, F32Bytes({1.0f})}});
  bytes.resize(8 + 10);  // the header says more than remains
  ExpectRejected(bytes, StatusCode::kCorruption, {"header length", "offset 0"});
  std::vector<uint8_t> huge;
  PutU64(&huge, uint64_t{1} << 62);
  ExpectRejected(huge, StatusCode::kCorruption, {"header length"});
}

TEST(SafetensorsCorrupt, BadJson) {
  ExpectRejected(RawFile(R"({"w": {"dtype": "F32", "shape": [1)", {0, 0, 0, 0}), StatusCode::kCorruption,
                 {"JSON", "parse"});
  ExpectRejected(RawFile("[1, 2]", {}), StatusCode::kCorruption, {"expected an object"});
}

TEST(SafetensorsCorrupt, UnknownOrUnsupportedDtype) {
  ExpectRejected(BuildFile({{"w", "F99", {1}, {0, 0, 0, 0}}}), StatusCode::kCorruption,
                 {"\"w\"", "dtype", "F99"});
  ExpectRejected(BuildFile({{"w", "I32", {1}, {0, 0, 0, 0}}}), StatusCode::kUnsupported, {"\"w\"", "dtype", "I32"});
}

TEST(SafetensorsCorrupt, NegativeShape) {
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", {}),
                 StatusCode::kCorruption, {"\"w\"", "shape", "-1"});
}

TEST(SafetensorsCorrupt, MissingField) {
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", {0, 0, 0, 0}), StatusCode::kCorruption,
                 {"\"w\"", "data_offsets"});
}

TEST(SafetensorsCorrupt, DataOffsetsOutOfRange) {
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::vector<uint8_t>(8)),
                 StatusCode::kCorruption, {"\"w\"", "data_offsets", "[4, 12]", "8 bytes"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", std::vector<uint8_t>(8)),
                 StatusCode::kCorruption, {"\"w\"", "data_offsets", "begin is after end"});
}

TEST(SafetensorsCorrupt, SizeMismatchWithShape) {
  ExpectRejected(RawFile(R"({"w":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,8]}})", std::vector<uint8_t>(8)),
                 StatusCode::kCorruption, {"\"w\"", "data_offsets", "8 bytes", "expected 12", "[3, 2]", "BF16"});
}

// Each structural check names the tensor, the field and what it found (one case per check).
TEST(SafetensorsCorrupt, EachMalformedFieldIsNamed) {
  const std::vector<uint8_t> four(4);
  ExpectRejected(RawFile(R"({"w":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", four), StatusCode::kCorruption,
                 {"\"w\"", "field \"dtype\": expected a string, found number"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four),
                 StatusCode::kCorruption, {"\"w\"", "field \"shape\"[0]: expected a non-negative integer, found -1"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,4]}})", four), StatusCode::kCorruption,
                 {"\"w\"", "field \"shape\": expected an array, found number"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}})", four),
                 StatusCode::kCorruption, {"\"w\"", "[4294967296, 4294967296, 4] overflows 64 bits"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", four), StatusCode::kCorruption,
                 {"\"w\"", "field \"data_offsets\": expected an array [begin, end], found [0]"});
  ExpectRejected(RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", four), StatusCode::kCorruption,
                 {"\"w\"", "missing field \"data_offsets\""});
  ExpectRejected(RawFile(R"({"w":[1, 2]})", four), StatusCode::kCorruption,
                 {"\"w\"", "expected an object, found array"});
  ExpectRejected(RawFile(R"({"__metadata__":"v1","w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four),
                 StatusCode::kCorruption, {"__metadata__: expected an object, found string"});
  // A header length of 1 (the file has that byte) cannot hold a JSON object.
  std::vector<uint8_t> one;
  PutU64(&one, 1);
  one.push_back('{');
  ExpectRejected(one, StatusCode::kCorruption, {"header length (u64 at offset 0) is 1 bytes", "too short for a JSON"});
  // A header above the 100 MiB limit is refused before it is read, even when the file holds it.
  std::vector<uint8_t> big;
  PutU64(&big, SafetensorsFile::kMaxHeaderBytes + 1);
  big.resize(8 + SafetensorsFile::kMaxHeaderBytes + 1, ' ');
  ExpectRejected(std::move(big), StatusCode::kCorruption, {"header length", "above the 104857600-byte limit"});
}

TEST(SafetensorsCorrupt, OverlappingTensors) {
  ExpectRejected(RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F16","shape":[2],"data_offsets":[6,10]}})",
                         std::vector<uint8_t>(12)),
                 StatusCode::kCorruption, {"\"b\"", "\"a\"", "overlap"});
}

// ---- SentencePiece protobuf, encoded by hand ----

void Varint(std::vector<uint8_t>* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<uint8_t>(v));
}
void Tag(std::vector<uint8_t>* out, uint32_t field, uint32_t wire) { Varint(out, (field << 3) | wire); }
void LenField(std::vector<uint8_t>* out, uint32_t field, const std::vector<uint8_t>& payload) {
  Tag(out, field, 2);
  Varint(out, payload.size());
  out->insert(out->end(), payload.begin(), payload.end());
}
std::vector<uint8_t> Piece(const std::string& text, std::optional<float> score, std::optional<int> type) {
  std::vector<uint8_t> p;
  LenField(&p, 1, std::vector<uint8_t>(text.begin(), text.end()));
  if (score) {
    Tag(&p, 2, 5);
    uint32_t u;
    std::memcpy(&u, &*score, 4);
    for (int i = 0; i < 4; ++i) p.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  if (type) {
    Tag(&p, 3, 0);
    Varint(&p, static_cast<uint64_t>(*type));
  }
  return p;
}

std::vector<uint8_t> TinySentencePieceModel() {
  std::vector<uint8_t> m;
  LenField(&m, 1, Piece("<unk>", 0.0f, 2));
  LenField(&m, 1, Piece("<s>", 0.0f, 3));
  LenField(&m, 1, Piece("</s>", 0.0f, 3));
  LenField(&m, 1, Piece("<0x41>", 0.0f, 6));
  // trainer_spec (field 2) with a nested varint; the reader skips it by wire type.
  std::vector<uint8_t> trainer;
  Tag(&trainer, 3, 0);
  Varint(&trainer, 2);
  LenField(&m, 2, trainer);
  LenField(&m, 1, Piece("\xE2\x96\x81" "a", -1.5f, std::nullopt));  // "▁a", type defaults to NORMAL
  LenField(&m, 1, Piece("b", std::nullopt, 1));                      // score defaults to 0
  LenField(&m, 1, Piece("<pad>", 0.0f, 5));
  // Unknown top-level fields of every wire type.
  Tag(&m, 10, 0);
  Varint(&m, 300);
  Tag(&m, 11, 1);
  for (int i = 0; i < 8; ++i) m.push_back(0xAB);
  Tag(&m, 12, 5);
  for (int i = 0; i < 4; ++i) m.push_back(0xCD);
  LenField(&m, 3, {0x0A, 0x03, 'n', 'm', 't'});  // normalizer_spec
  return m;
}

TEST(SentencePiece, DecodesHandEncodedModel) {
  auto r = ParseSentencePieceModel(TinySentencePieceModel(), "tokenizer.model");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const TokenizerData& t = *r;
  EXPECT_EQ(t.model, "llama");
  EXPECT_EQ(t.tokens, (std::vector<std::string>{"<unk>", "<s>", "</s>", "<0x41>", "\xE2\x96\x81" "a", "b", "<pad>"}));
  EXPECT_EQ(t.scores, (std::vector<float>{0, 0, 0, 0, -1.5f, 0, 0}));
  EXPECT_EQ(t.token_types, (std::vector<int32_t>{2, 3, 3, 6, 1, 1, 5}));
  EXPECT_EQ(t.unk_id, 0);
  EXPECT_EQ(t.bos_id, 1);
  EXPECT_EQ(t.eos_id, 2);
  EXPECT_EQ(t.pad_id, 6);
}

TEST(SentencePiece, RejectsCorruptModels) {
  auto model = TinySentencePieceModel();
  std::vector<uint8_t> truncated(model.begin(), model.begin() + 12);  // cuts the second piece
  auto r = ParseSentencePieceModel(truncated, "tokenizer.model");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_CONTAINS(r.status().message(), "tokenizer.model");
  EXPECT_CONTAINS(r.status().message(), "offset");

  std::vector<uint8_t> bad_type;
  LenField(&bad_type, 1, Piece("x", 0.0f, 9));
  r = ParseSentencePieceModel(bad_type, "tokenizer.model");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "found 9");

  std::vector<uint8_t> group;
  Tag(&group, 7, 3);  // deprecated group wire type
  r = ParseSentencePieceModel(group, "tokenizer.model");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "wire type 3");

  r = ParseSentencePieceModel({}, "tokenizer.model");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "no pieces");

  std::vector<uint8_t> textless;  // a piece with a score and a type but no string
  LenField(&textless, 1, Piece("<unk>", 0.0f, 2));
  std::vector<uint8_t> no_text;
  Tag(&no_text, 3, 0);
  Varint(&no_text, 1);
  LenField(&textless, 1, no_text);
  r = ParseSentencePieceModel(textless, "tokenizer.model");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "piece 1 at offset");
  EXPECT_CONTAINS(r.status().message(), "has no piece string (field 1)");
}

// ---- tokenizer.json ----

// A Llama-2 style export: byte_fallback BPE with the specials as added tokens.
constexpr const char* kLlamaBpeJson = R"({
  "added_tokens": [
    {"id": 0, "content": "<unk>", "special": true},
    {"id": 1, "content": "<s>", "special": true},
    {"id": 2, "content": "</s>", "special": true},
    {"id": 9, "content": "<extra>", "special": false}
  ],
  "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"},
  "decoder": {"type": "Sequence", "decoders": []},
  "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>",
    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x00>": 3, "<0xFF>": 4, "\u2581": 5, "t": 6, "\u2581t": 7, "he": 8},
    "merges": ["\u2581 t", "h e"]}
})";

TEST(TokenizerJson, ByteFallbackBpeIsLlama) {
  auto r = ParseTokenizerJson(kLlamaBpeJson, "tokenizer.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const TokenizerData& t = *r;
  EXPECT_EQ(t.model, "llama");
  ASSERT_EQ(t.tokens.size(), 10u);
  EXPECT_EQ(t.tokens[7], "\xE2\x96\x81t");
  EXPECT_EQ(t.tokens[9], "<extra>");
  EXPECT_EQ(t.token_types, (std::vector<int32_t>{2, 3, 3, 6, 6, 1, 1, 1, 1, 4}));
  // Merge results score -rank; tokens no merge produces score -(2 merges) - 1; specials and bytes 0.
  EXPECT_EQ(t.scores, (std::vector<float>{0, 0, 0, 0, 0, -3, -3, -0.0f, -1, -3}));
  EXPECT_TRUE(t.merges.empty());
  EXPECT_EQ(t.unk_id, 0);
  EXPECT_EQ(t.bos_id, 1);
  EXPECT_EQ(t.eos_id, 2);
}

std::string ByteLevelJson(const std::string& merges) {
  return std::string(R"({
  "added_tokens": [{"id": 5, "content": "<|end|>", "special": true}, {"id": 6, "content": "<|tool|>", "special": false}],
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
     {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated"},
     {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
  "model": {"type": "BPE", "byte_fallback": false, "ignore_merges": true,
    "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4},
    "merges": )") + merges + "}}";
}

TEST(TokenizerJson, ByteLevelBpeIsGpt2WithBothMergeSyntaxes) {
  for (const std::string merges : {R"(["a b", "Ġ ab"])", R"([["a", "b"], ["Ġ", "ab"]])"}) {
    auto r = ParseTokenizerJson(ByteLevelJson(merges), "tokenizer.json");
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const TokenizerData& t = *r;
    EXPECT_EQ(t.model, "gpt2");
    EXPECT_EQ(t.pre, "llama-bpe");
    EXPECT_EQ(t.tokens, (std::vector<std::string>{"a", "b", "ab", "\xC4\xA0", "\xC4\xA0" "ab", "<|end|>", "<|tool|>"}));
    EXPECT_EQ(t.merges, (std::vector<std::string>{"a b", "\xC4\xA0 ab"}));
    EXPECT_EQ(t.token_types, (std::vector<int32_t>{1, 1, 1, 1, 1, 3, 4}));
    EXPECT_TRUE(t.scores.empty());
  }
}

TEST(TokenizerJson, ConfigSetsBosEosAndFlags) {
  auto r = ParseTokenizerJson(ByteLevelJson(R"(["a b"])"), "tokenizer.json");
  ASSERT_TRUE(r.ok());
  TokenizerData t = *r;
  Status s = ApplyTokenizerConfig(R"({"bos_token": {"content": "<|end|>"}, "eos_token": "<|tool|>",
                                     "add_bos_token": true, "add_eos_token": false})",
                                  R"({"bos_token_id": 0, "eos_token_id": 1})", "/m", &t);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(t.bos_id, 5);  // tokenizer_config's token text wins over config.json's id
  EXPECT_EQ(t.eos_id, 6);
  EXPECT_EQ(t.add_bos, true);
  EXPECT_EQ(t.add_eos, false);

  TokenizerData u = *r;
  ASSERT_TRUE(ApplyTokenizerConfig("", R"({"bos_token_id": 2, "eos_token_id": 3})", "/m", &u).ok());
  EXPECT_EQ(u.bos_id, 2);
  EXPECT_EQ(u.eos_id, 3);
  EXPECT_FALSE(u.add_bos.has_value());
  // A list of end ids (Llama-3.1 style) selects the first; ids outside the vocabulary are ignored.
  ASSERT_TRUE(ApplyTokenizerConfig("", R"({"eos_token_id": [4, 1], "bos_token_id": 99})", "/m", &u).ok());
  EXPECT_EQ(u.eos_id, 4);
  EXPECT_EQ(u.bos_id, 2);

  Status bad = ApplyTokenizerConfig("{", "", "/m", &u);
  EXPECT_FALSE(bad.ok());
  EXPECT_CONTAINS(bad.message(), "tokenizer_config.json");
  bad = ApplyTokenizerConfig("[1]", "", "/m", &u);
  EXPECT_FALSE(bad.ok());
  EXPECT_CONTAINS(bad.message(), "/m/tokenizer_config.json: expected a JSON object");
}

TEST(TokenizerJson, RejectsUnsupportedAndCorrupt) {
  auto r = ParseTokenizerJson(R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})", "tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_CONTAINS(r.status().message(), "Unigram");

  r = ParseTokenizerJson(R"({"model": {"type": "BPE", "vocab": {"a": 0, "c": 2}, "merges": []},
                            "pre_tokenizer": {"type": "ByteLevel"}})",
                         "tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "id 1");

  r = ParseTokenizerJson(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [3]},
                            "pre_tokenizer": {"type": "ByteLevel"}})",
                         "tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "merges[0]");

  r = ParseTokenizerJson("{not json", "tokenizer.json");
  ASSERT_FALSE(r.ok());
  EXPECT_CONTAINS(r.status().message(), "tokenizer.json");

  // Structural errors name the field and what was found.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"version": "1.0"})", "missing object field \"model\""},
      {R"({"model": {"type": "BPE", "merges": []}, "pre_tokenizer": {"type": "ByteLevel"}})",
       "model.vocab: expected an object of token -> id"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": -4}}, "pre_tokenizer": {"type": "ByteLevel"}})",
       "model.vocab[\"b\"]: expected a non-negative id, found -4"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "ByteLevel"}})", "model.vocab is empty"},
  };
  for (const auto& [text, want] : cases) {
    r = ParseTokenizerJson(text, "tokenizer.json");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << text;
    EXPECT_CONTAINS(r.status().message(), "tokenizer.json: " + want) << text;
  }
}

TEST(HfTokenizer, PrefersTokenizerModelAndPadsNothing) {
  testing::TempDir dir;
  EXPECT_EQ(ReadHfTokenizer(dir.path()).status().code(), StatusCode::kNotFound);
  testing::WriteText(dir.File("tokenizer.json"), ByteLevelJson(R"(["a b"])"));
  auto from_json = ReadHfTokenizer(dir.path());
  ASSERT_TRUE(from_json.ok()) << from_json.status().ToString();
  EXPECT_EQ(from_json->model, "gpt2");
  testing::WriteBytes(dir.File("tokenizer.model"), TinySentencePieceModel());
  testing::WriteText(dir.File("added_tokens.json"), R"({"<|im_start|>": 7, "b": 5})");
  testing::WriteText(dir.File("tokenizer_config.json"),
                     R"({"added_tokens_decoder": {"7": {"content": "<|im_start|>", "special": true}}})");
  auto r = ReadHfTokenizer(dir.path());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "llama");
  ASSERT_EQ(r->tokens.size(), 8u);
  EXPECT_EQ(r->tokens[7], "<|im_start|>");
  EXPECT_EQ(r->token_types[7], 3);

  // An added token must take the next id: a gap would leave an id without a token.
  testing::WriteText(dir.File("added_tokens.json"), R"({"<|im_start|>": 7, "<|im_end|>": 9})");
  auto gap = ReadHfTokenizer(dir.path());
  ASSERT_FALSE(gap.ok());
  EXPECT_CONTAINS(gap.status().message(), "added_tokens.json: token \"<|im_end|>\" has id 9, expected the next id 8");
}

// ---- config.json ----

constexpr const char* kLlamaConfig = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8, "max_position_embeddings": 512,
  "vocab_size": 512, "rms_norm_eps": 1e-05)";

TEST(HfConfig, ParsesFieldsAndDefaults) {
  auto r = ParseHfConfig(std::string(kLlamaConfig) + "}", "config.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dim, 64);
  EXPECT_EQ(r->n_ff, 172);
  EXPECT_EQ(r->n_layers, 5);
  EXPECT_EQ(r->n_heads, 8);
  EXPECT_EQ(r->n_kv_heads, 8);  // default = heads
  EXPECT_EQ(r->context_length, 512);
  EXPECT_EQ(r->n_vocab, 512);
  EXPECT_EQ(r->norm_eps, 1e-5f);
  EXPECT_EQ(r->rope_theta, 10000.0f);
  EXPECT_EQ(r->rope_scale_linear, 1.0f);
  EXPECT_FALSE(r->tied_embeddings);
  EXPECT_EQ(r->activation, FfnActivation::kSilu);
  EXPECT_EQ(r->n_experts, 0);

  r = ParseHfConfig(std::string(kLlamaConfig) +
                        R"(, "num_key_value_heads": 4, "rope_theta": 500000.0, "tie_word_embeddings": true,
                        "hidden_act": "relu", "rope_scaling": {"rope_type": "linear", "factor": 4.0}})",
                    "config.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->n_kv_heads, 4);
  EXPECT_EQ(r->rope_theta, 500000.0f);
  EXPECT_TRUE(r->tied_embeddings);
  EXPECT_EQ(r->activation, FfnActivation::kRelu);
  EXPECT_EQ(r->rope_scale_linear, 4.0f);

  r = ParseHfConfig(std::string(kLlamaConfig) + R"(, "hidden_act": "relu", "nflash_ffn_activation": "drelu"})",
                    "config.json");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->activation, FfnActivation::kDRelu);

  r = ParseHfConfig(R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64, "vocab_size": 10,
    "rms_norm_eps": 1e-6, "num_local_experts": 8, "num_experts_per_tok": 2})",
                    "config.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->n_experts, 8);
  EXPECT_EQ(r->n_experts_used, 2);
}

// Llama 3.2 1B's rope_scaling (head_dim 64, theta 500000): 32 factors, one per rotary pair, from 1 (wavelengths
// under 8192 / 4 keep their frequency) to 32 (over 8192 / 1: slowed by the factor), rising in between; computed here
// in transformers' form (the scaled inverse frequency) for comparison.
TEST(HfConfig, Llama3RopeScalingGivesAFactorPerRotaryPair) {
  auto r = ParseHfConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": true,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})",
                         "config.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->rope_freq_factors.size(), 32u);
  EXPECT_EQ(r->rope_scale_linear, 1.0f);
  int kept = 0, slowed = 0;
  for (size_t i = 0; i < 32; ++i) {
    const double inv = std::pow(500000.0, -2.0 * static_cast<double>(i) / 64.0), wavelen = 2 * M_PI / inv;
    double scaled = inv;
    if (wavelen > 8192.0) {
      scaled = inv / 32.0;
      ++slowed;
    } else if (wavelen < 2048.0) {
      ++kept;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / 3.0;
      scaled = (1 - smooth) * inv / 32.0 + smooth * inv;
    }
    EXPECT_NEAR(r->rope_freq_factors[i], inv / scaled, 1e-5 * inv / scaled) << "pair " << i;
    if (i > 0) {
      EXPECT_GE(r->rope_freq_factors[i], r->rope_freq_factors[i - 1]) << "pair " << i;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(slowed, 0);
  EXPECT_LT(kept + slowed, 32) << "some pairs are interpolated";
  // No rope_scaling, or the default type: no factors.
  auto plain = ParseHfConfig(std::string(kLlamaConfig) + R"(, "rope_scaling": {"rope_type": "default"}})", "c.json");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_TRUE(plain->rope_freq_factors.empty());
}

// The sliding window as transformers' config classes read it: MistralConfig defaults to 4096 when the field is
// absent, null means none; Phi-3 and Mixtral default to none; Llama has no window, whatever the file says.
TEST(HfConfig, SlidingWindowFollowsTransformersDefaults) {
  auto with_arch = [](const std::string& arch, const std::string& extra) {
    std::string json = std::string(kLlamaConfig) + extra + "}";
    json.replace(json.find("LlamaForCausalLM"), std::string("LlamaForCausalLM").size(), arch);
    return ParseHfConfig(json, "c.json");
  };
  const struct {
    std::string arch, extra;
    int64_t want;
  } cases[] = {
      {"MistralForCausalLM", "", 4096},
      {"MistralForCausalLM", R"(, "sliding_window": null)", 0},
      {"MistralForCausalLM", R"(, "sliding_window": 100)", 100},
      {"Phi3ForCausalLM", "", 0},
      {"Phi3ForCausalLM", R"(, "sliding_window": 2047)", 2047},
      {"LlamaForCausalLM", R"(, "sliding_window": 100)", 0},
      {"Qwen2ForCausalLM", R"(, "sliding_window": 100, "use_sliding_window": false)", 0},
  };
  for (const auto& c : cases) {
    auto r = with_arch(c.arch, c.extra);
    ASSERT_TRUE(r.ok()) << c.arch << c.extra << ": " << r.status().ToString();
    EXPECT_EQ(r->sliding_window, c.want) << c.arch << c.extra;
  }
  auto zero = with_arch("MistralForCausalLM", R"(, "sliding_window": 0)");
  ASSERT_FALSE(zero.ok());
  EXPECT_CONTAINS(zero.status().message(), "field \"sliding_window\": expected null or a positive number");
}

TEST(HfConfig, RejectsBadConfigsNamingTheField) {
  struct Case {
    std::string json;
    std::string want;
  };
  const std::vector<Case> cases = {
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})", "intermediate_size"},
      {std::string(kLlamaConfig) + R"(, "rope_scaling": {"type": "yarn", "factor": 2}})", "yarn"},
      {std::string(kLlamaConfig) + R"(, "rope_scaling": {"type": "yarn", "factor": 2}})",
       "only \"linear\", \"llama3\" and \"longrope\""},
      {std::string(kLlamaConfig) + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4,
           "original_max_position_embeddings": 8192}})",
       "\"low_freq_factor\" must be a positive number"},
      {std::string(kLlamaConfig) + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
           "high_freq_factor": 4, "original_max_position_embeddings": 8192}})",
       "high_freq_factor 4.000000 must exceed low_freq_factor 4.000000"},
      {std::string(kLlamaConfig) + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1,
           "high_freq_factor": 4, "original_max_position_embeddings": 8192}})",
       "\"factor\" must be a positive number"},
      {std::string(kLlamaConfig) + R"(, "hidden_act": "gelu"})", "gelu"},
      {std::string(kLlamaConfig) + R"(, "mlp_bias": true})", "\"mlp_bias\" is true"},
      {std::string(kLlamaConfig) + R"(, "attention_bias": true})", "\"attention_bias\" is true: Llama's"},
      {std::string(kLlamaConfig) + R"(, "partial_rotary_factor": 0.5})", "\"partial_rotary_factor\" is 0.5"},
      {std::string(kLlamaConfig) + R"(, "num_key_value_heads": 3})", "num_key_value_heads"},
      {std::string(kLlamaConfig) + R"(, "nflash_ffn_activation": "tanh"})", "nflash_ffn_activation"},
      {std::string(kLlamaConfig) + R"(, "head_dim": 7})", "field \"head_dim\": expected a positive even number"},
      {R"({"architectures": ["GPT2LMHeadModel"]})", "GPT2LMHeadModel"},
      {R"({"hidden_size": 64})", "missing required field \"architectures\""},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 24, "intermediate_size": 172,
           "num_hidden_layers": 5, "num_attention_heads": 8, "max_position_embeddings": 512, "vocab_size": 512,
           "rms_norm_eps": 1e-05})",
       "hidden_size 24 / num_attention_heads 8 must be an even integer head size"},
      {"[1]", "expected a JSON object"},
      {R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64, "vocab_size": 10,
           "rms_norm_eps": 1e-6})",
       "num_local_experts"},
      {"{", "JSON"},
  };
  for (const Case& c : cases) {
    auto r = ParseHfConfig(c.json, "/m/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_CONTAINS(r.status().message(), "/m/config.json") << c.json;
    EXPECT_CONTAINS(r.status().message(), c.want) << c.json;
  }
}

}  // namespace
}  // namespace nflash::converter
