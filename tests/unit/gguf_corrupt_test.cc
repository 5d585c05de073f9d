// Corrupt-input suite for the GGUF reader, modelled on llama.cpp's tests/test-gguf.cpp: files broken on purpose, one
// field at a time, must be rejected with a message naming that field; truncations and random byte flips must be
// rejected (or parse) cleanly, never crash. Run it under -DNFLASH_SANITIZE=ON as well.
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <random>

#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

constexpr const char* kPath = "corrupt.gguf";

// ---- A hand-written GGUF builder, independent of GgufWriter, so every field can be set to anything. ----

void PutLe(std::vector<uint8_t>* b, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
std::vector<uint8_t> U32(uint32_t v) {
  std::vector<uint8_t> b;
  PutLe(&b, v, 4);
  return b;
}
std::vector<uint8_t> Str(const std::string& s) {
  std::vector<uint8_t> b;
  PutLe(&b, s.size(), 8);
  b.insert(b.end(), s.begin(), s.end());
  return b;
}
// An array payload: element type, count, then the already-encoded elements.
std::vector<uint8_t> Arr(uint32_t elem_type, uint64_t count, const std::vector<uint8_t>& elems) {
  std::vector<uint8_t> b;
  PutLe(&b, elem_type, 4);
  PutLe(&b, count, 8);
  b.insert(b.end(), elems.begin(), elems.end());
  return b;
}
std::vector<uint8_t> Cat(std::initializer_list<std::vector<uint8_t>> parts) {
  std::vector<uint8_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

struct KvSpec {
  std::string key;
  uint32_t type;
  std::vector<uint8_t> payload;  // the encoded value
  std::optional<uint64_t> key_len;  // overrides the key's length field
};
struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type;
  uint64_t offset;
  std::optional<uint32_t> n_dims;  // overrides dims.size()
};
struct FileSpec {
  std::string magic = "GGUF";
  uint32_t version = 3;
  std::optional<uint64_t> tensor_count;  // overrides tensors.size()
  std::optional<uint64_t> kv_count;      // overrides kvs.size()
  std::vector<KvSpec> kvs;
  std::vector<TensorSpec> tensors;
  uint32_t pad_to = 32;     // padding after the directory
  uint64_t data_bytes = 0;  // bytes of data section appended
};

std::vector<uint8_t> Build(const FileSpec& s) {
  std::vector<uint8_t> b(s.magic.begin(), s.magic.end());
  PutLe(&b, s.version, 4);
  PutLe(&b, s.tensor_count.value_or(s.tensors.size()), 8);
  PutLe(&b, s.kv_count.value_or(s.kvs.size()), 8);
  for (const KvSpec& kv : s.kvs) {
    PutLe(&b, kv.key_len.value_or(kv.key.size()), 8);
    b.insert(b.end(), kv.key.begin(), kv.key.end());
    PutLe(&b, kv.type, 4);
    b.insert(b.end(), kv.payload.begin(), kv.payload.end());
  }
  for (const TensorSpec& t : s.tensors) {
    PutLe(&b, t.name.size(), 8);
    b.insert(b.end(), t.name.begin(), t.name.end());
    PutLe(&b, t.n_dims.value_or(static_cast<uint32_t>(t.dims.size())), 4);
    for (uint64_t d : t.dims) PutLe(&b, d, 8);
    PutLe(&b, t.type, 4);
    PutLe(&b, t.offset, 8);
  }
  while (b.size() % s.pad_to != 0) b.push_back(0);
  for (uint64_t i = 0; i < s.data_bytes; ++i) b.push_back(static_cast<uint8_t>(i * 7 + 1));
  return b;
}

// GGUF value type ids and ggml type ids used below (from the spec, not from the code under test).
constexpr uint32_t kU32 = 4, kI32 = 5, kF32Val = 6, kBool = 7, kString = 8, kArray = 9;
constexpr uint32_t kTypeF32 = 0, kTypeF16 = 1, kTypeQ8_0 = 8, kTypeI8 = 24, kTypeI64 = 27;

// A small valid file: 5 KVs and 3 tensors, F32 8x2 (64 B), Q8_0 32 (34 B, padded to 64), F16 16 (32 B). The last
// tensor ends exactly at the end of the file, so cutting any byte removes something the reader needs.
FileSpec BaseSpec() {
  FileSpec s;
  s.kvs = {
      {"general.name", kString, Str("tiny"), {}},
      {"llama.block_count", kU32, U32(2), {}},
      {"tokenizer.ggml.tokens", kArray, Arr(kString, 3, Cat({Str("a"), Str("bb"), Str("<s>")})), {}},
      {"flag", kBool, {1}, {}},
      {"scores", kArray, Arr(kF32Val, 2, Cat({U32(0x3f000000), U32(0xbf800000)})), {}},
  };
  s.tensors = {
      {"w1", {8, 2}, kTypeF32, 0, {}},
      {"w2", {32}, kTypeQ8_0, 64, {}},
      {"w3", {16}, kTypeF16, 128, {}},
  };
  s.data_bytes = 160;
  return s;
}

KvSpec AlignmentKv(uint32_t type, uint32_t value) { return {"general.alignment", type, U32(value), {}}; }

Result<GgufFile> OpenBytes(std::vector<uint8_t> bytes) {
  return GgufFile::Open(std::make_shared<MemoryFile>(kPath, std::move(bytes)));
}

TEST(GgufCorruptTest, BaseFileIsValid) {
  auto g = OpenBytes(Build(BaseSpec()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->metadata().size(), 5u);
  ASSERT_EQ(g->tensors().size(), 3u);
  EXPECT_EQ(g->tensors()[2].offset + g->tensors()[2].n_bytes + g->data_offset(), g->file().Size());
}

struct Case {
  std::string name;
  std::function<void(FileSpec*)> mutate;
  StatusCode code;
  std::vector<std::string> must_contain;  // substrings of the message (besides the path)
};

std::vector<Case> Cases() {
  const uint64_t kHuge = uint64_t{1} << 40;
  return {
      {"HEADER_BAD_MAGIC", [](FileSpec* s) { s->magic = "FUGG"; }, StatusCode::kCorruption, {"magic", "offset 0"}},
      {"HEADER_BAD_VERSION_0", [](FileSpec* s) { s->version = 0; }, StatusCode::kUnsupported, {"version", "found 0"}},
      {"HEADER_BAD_VERSION_1", [](FileSpec* s) { s->version = 1; }, StatusCode::kUnsupported,
       {"version", "offset 4", "expected 2 or 3, found 1"}},
      {"HEADER_BAD_VERSION_FUTURE", [](FileSpec* s) { s->version = 4; }, StatusCode::kUnsupported, {"found 4"}},
      {"HEADER_BIG_ENDIAN", [](FileSpec* s) { s->version = 0x03000000; }, StatusCode::kUnsupported, {"big-endian"}},
      {"HEADER_BAD_N_TENSORS", [](FileSpec* s) { s->tensor_count = UINT64_MAX; }, StatusCode::kCorruption,
       {"tensor_count", "offset 8", "18446744073709551615"}},
      {"HEADER_HUGE_N_TENSORS", [=](FileSpec* s) { s->tensor_count = kHuge; }, StatusCode::kCorruption,
       {"tensor_count"}},
      {"HEADER_BAD_N_KV", [](FileSpec* s) { s->kv_count = UINT64_MAX; }, StatusCode::kCorruption,
       {"metadata_kv_count", "offset 16"}},
      {"HEADER_HUGE_N_KV", [=](FileSpec* s) { s->kv_count = kHuge; }, StatusCode::kCorruption,
       {"metadata_kv_count"}},
      {"KV_BAD_KEY_SIZE", [](FileSpec* s) { s->kvs[1].key_len = UINT64_MAX; }, StatusCode::kCorruption,
       {"metadata key #1", "key length"}},
      {"KV_EMPTY_KEY", [](FileSpec* s) { s->kvs[1].key = ""; }, StatusCode::kCorruption, {"non-empty key"}},
      {"KV_BAD_TYPE", [](FileSpec* s) { s->kvs[1].type = 13; }, StatusCode::kCorruption,
       {"'llama.block_count'", "value type", "found 13"}},
      {"KV_BAD_ARRAY_ELEMENT_TYPE", [](FileSpec* s) { s->kvs[4].payload = Arr(99, 0, {}); }, StatusCode::kCorruption,
       {"'scores'", "array element type", "found 99"}},
      {"KV_HUGE_ARRAY_COUNT", [=](FileSpec* s) { s->kvs[4].payload = Arr(kF32Val, kHuge, {}); },
       StatusCode::kCorruption, {"'scores'", "array count", "1099511627776"}},
      {"KV_HUGE_STRING", [](FileSpec* s) { s->kvs[0].payload = Str("tiny"); s->kvs[0].payload[7] = 0x10; },
       StatusCode::kCorruption, {"'general.name'", "string length"}},
      {"KV_HUGE_ARRAY_STRING",
       [](FileSpec* s) {
         s->kvs[2].payload = Arr(kString, 2, Cat({Str("a"), std::vector<uint8_t>{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0}}));
       },
       StatusCode::kCorruption, {"'tokenizer.ggml.tokens'[1]", "string length"}},
      {"KV_DUPLICATE_KEY", [](FileSpec* s) { s->kvs[3].key = "general.name"; }, StatusCode::kCorruption,
       {"'general.name'", "duplicate of key #0"}},
      {"KV_BAD_BOOL", [](FileSpec* s) { s->kvs[3].payload = {2}; }, StatusCode::kCorruption,
       {"'flag'", "bool value", "expected 0 or 1, found 2"}},
      {"KV_BAD_ALIGN", [](FileSpec* s) { s->kvs.push_back(AlignmentKv(kU32, 13)); }, StatusCode::kCorruption,
       {"general.alignment", "power of two", "found 13"}},
      {"KV_ZERO_ALIGN", [](FileSpec* s) { s->kvs.push_back(AlignmentKv(kU32, 0)); }, StatusCode::kCorruption,
       {"general.alignment", "power of two"}},
      {"KV_WRONG_TYPE_ALIGN", [](FileSpec* s) { s->kvs.push_back(AlignmentKv(kI32, 32)); }, StatusCode::kCorruption,
       {"general.alignment", "uint32", "found int32"}},
      {"KV_NESTED_TOO_DEEP",
       [](FileSpec* s) {
         std::vector<uint8_t> v = Arr(kU32, 0, {});
         for (int i = 0; i < kGgufMaxArrayDepth + 2; ++i) v = Arr(kArray, 1, v);
         s->kvs[4].payload = v;
       },
       StatusCode::kUnsupported, {"'scores'", "nested"}},
      {"TENSORS_EMPTY_NAME", [](FileSpec* s) { s->tensors[1].name = ""; }, StatusCode::kCorruption,
       {"tensor #1", "non-empty name"}},
      {"TENSORS_BAD_NAME_SIZE", [](FileSpec* s) { s->tensors[1].name = std::string(64, 'x'); },
       StatusCode::kCorruption, {"tensor #1", "name", "at most 63"}},
      {"TENSORS_DUPLICATE_NAME", [](FileSpec* s) { s->tensors[2].name = "w1"; }, StatusCode::kCorruption,
       {"tensor 'w1'", "duplicate of tensor #0"}},
      {"TENSORS_ZERO_N_DIMS", [](FileSpec* s) { s->tensors[0].n_dims = 0; s->tensors[0].dims.clear(); },
       StatusCode::kCorruption, {"'w1'", "n_dims", "found 0"}},
      {"TENSORS_BAD_N_DIMS", [](FileSpec* s) { s->tensors[0].dims = {8, 1, 1, 1, 2}; }, StatusCode::kCorruption,
       {"'w1'", "n_dims", "1..4", "found 5"}},
      {"TENSORS_BAD_SHAPE", [](FileSpec* s) { s->tensors[0].dims = {UINT64_MAX, 2}; }, StatusCode::kCorruption,
       {"'w1'", "dims[0]", "INT64_MAX"}},
      {"TENSORS_NE_TOO_BIG",
       [](FileSpec* s) { s->tensors[0].dims = {4 * uint64_t{INT32_MAX}, 4 * uint64_t{INT32_MAX}}; },
       StatusCode::kCorruption, {"'w1'", "dims", "INT64_MAX"}},
      {"TENSORS_NE_ABOVE_INT64_MAX",
       [](FileSpec* s) { s->tensors[0].dims = {uint64_t{1} << 62, 2}; },  // 2^63: fits u64, not int64
       StatusCode::kCorruption, {"'w1'", "dims", "INT64_MAX"}},
      {"TENSORS_NBYTES_TOO_BIG",
       [](FileSpec* s) { s->tensors[0].type = kTypeI64; s->tensors[0].dims = {uint64_t{1} << 62}; },
       StatusCode::kCorruption, {"'w1'", "byte size"}},
      {"TENSORS_BAD_TYPE", [](FileSpec* s) { s->tensors[1].type = 4; }, StatusCode::kUnsupported,
       {"'w2'", "type", "ggml type id 4"}},
      {"TENSORS_BAD_TYPE_HUGE", [](FileSpec* s) { s->tensors[1].type = 1000; }, StatusCode::kUnsupported,
       {"'w2'", "ggml type id 1000"}},
      {"TENSORS_ROW_NOT_BLOCK_MULTIPLE", [](FileSpec* s) { s->tensors[1].dims = {33}; }, StatusCode::kCorruption,
       {"'w2'", "row length", "block size 32", "found 33"}},
      {"TENSORS_BAD_OFFSET", [](FileSpec* s) { s->tensors[1].offset = UINT64_MAX; }, StatusCode::kCorruption,
       {"'w2'", "offset", "multiple of the alignment 32"}},
      {"TENSORS_MISALIGNED_OFFSET", [](FileSpec* s) { s->tensors[1].offset = 65; }, StatusCode::kCorruption,
       {"'w2'", "offset", "multiple of the alignment 32", "found 65"}},
      {"TENSORS_GAP", [](FileSpec* s) { s->tensors[1].offset = 96; }, StatusCode::kCorruption,
       {"'w2'", "offset", "expected 64", "found 96"}},
      {"TENSORS_OVERLAP", [](FileSpec* s) { s->tensors[2].offset = 32; }, StatusCode::kCorruption,
       {"'w3'", "offset", "expected 128", "found 32"}},
      {"TENSORS_INCONSISTENT_ALIGN",  // offsets computed with alignment 1, as in test-gguf.cpp
       [](FileSpec* s) { s->tensors[2].offset = 98; }, StatusCode::kCorruption, {"'w3'", "offset", "found 98"}},
      {"TENSORS_BAD_ALIGN", [](FileSpec* s) { s->kvs.push_back(AlignmentKv(kU32, 13)); }, StatusCode::kCorruption,
       {"alignment"}},
      {"DATA_NOT_ENOUGH_DATA", [](FileSpec* s) { s->data_bytes -= 1; }, StatusCode::kCorruption,
       {"'w3'", "data", "within the file"}},
      {"DATA_MISSING", [](FileSpec* s) { s->data_bytes = 0; }, StatusCode::kCorruption, {"'w1'", "data"}},
      {"DATA_MEM_SIZE_OVERFLOW",
       [](FileSpec* s) {
         const uint64_t big = 0x7FFFFFFFFFFFFFC0;  // as in test-gguf.cpp: two of these nearly fill 2^64
         s->tensors = {{"a", {big}, kTypeI8, 0, {}}, {"b", {big}, kTypeI8, big, {}}, {"c", {big}, kTypeI8, 2 * big, {}}};
         s->data_bytes = 32;
       },
       StatusCode::kCorruption, {"'c'", "overflow"}},
      {"DATA_TENSOR_BEYOND_FILE",
       [](FileSpec* s) {
         const uint64_t big = 0x7FFFFFFFFFFFFFC0;
         s->tensors = {{"a", {big}, kTypeI8, 0, {}}};
         s->data_bytes = 32;
       },
       StatusCode::kCorruption, {"'a'", "data", "within the file"}},
      {"TRUNCATED_HEADER", [](FileSpec* s) { *s = FileSpec(); s->magic = "GG"; s->pad_to = 1; },
       StatusCode::kCorruption, {"truncated"}},
  };
}

TEST(GgufCorruptTest, HandcraftedCorruptionsAreRejectedNamingTheField) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    FileSpec spec = BaseSpec();
    c.mutate(&spec);
    std::vector<uint8_t> bytes = Build(spec);
    if (c.name == "TRUNCATED_HEADER") bytes.resize(3);
    auto g = OpenBytes(bytes);
    ASSERT_FALSE(g.ok()) << c.name << " was accepted";
    EXPECT_EQ(g.status().code(), c.code) << g.status().ToString();
    const std::string& msg = g.status().message();
    EXPECT_EQ(msg.rfind(kPath, 0), 0u) << "message does not start with the path: " << msg;
    for (const std::string& s : c.must_contain) {
      EXPECT_NE(msg.find(s), std::string::npos) << "missing \"" << s << "\" in: " << msg;
    }
  }
}

// Valid variants from test-gguf.cpp's *_SUCCESS / *_CUSTOM_ALIGN / ZERO_DIM cases.
TEST(GgufCorruptTest, ValidVariantsAreAccepted) {
  {
    SCOPED_TRACE("HEADER_EMPTY");
    FileSpec s;
    auto g = OpenBytes(Build(s));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_TRUE(g->metadata().empty());
    EXPECT_TRUE(g->tensors().empty());
  }
  {
    SCOPED_TRACE("HEADER_ONLY_UNPADDED");
    FileSpec s;
    s.pad_to = 1;  // 24 bytes, no padding: gguf-py writes vocab-only files like this
    ASSERT_TRUE(OpenBytes(Build(s)).ok());
  }
  for (uint32_t align : {1u, 64u}) {
    SCOPED_TRACE("CUSTOM_ALIGN " + std::to_string(align));
    FileSpec s = BaseSpec();
    s.kvs.push_back(AlignmentKv(kU32, align));
    s.pad_to = align;
    // Sizes 64, 34, 32: offsets are the running sums of sizes padded to `align`.
    s.tensors[1].offset = 64;
    s.tensors[2].offset = align == 1 ? 98 : 128;
    s.data_bytes = s.tensors[2].offset + 32;
    auto g = OpenBytes(Build(s));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->alignment(), align);
  }
  {
    SCOPED_TRACE("TENSORS_ZERO_DIM");
    FileSpec s = BaseSpec();
    s.tensors[0].dims = {8, 0};  // zero bytes: the next tensor starts at 0
    s.tensors[1].offset = 0;
    s.tensors[2].offset = 64;
    s.data_bytes = 96;
    auto g = OpenBytes(Build(s));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->tensors()[0].n_bytes, 0u);
  }
}

void ExpectTruncationsRejected(const std::vector<uint8_t>& full) {
  ASSERT_TRUE(OpenBytes(full).ok());
  for (size_t len = 0; len < full.size(); ++len) {
    auto g = OpenBytes(std::vector<uint8_t>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len)));
    ASSERT_FALSE(g.ok()) << "truncated to " << len << " of " << full.size() << " bytes was accepted";
    EXPECT_EQ(g.status().code(), StatusCode::kCorruption) << len << ": " << g.status().ToString();
    EXPECT_EQ(g.status().message().rfind(kPath, 0), 0u) << g.status().message();
  }
}

TEST(GgufCorruptTest, EveryTruncationOfTheBaseFileIsRejected) { ExpectTruncationsRejected(Build(BaseSpec())); }

TEST(GgufCorruptTest, EveryTruncationOfAWriterFileIsRejected) {
  testing::TempDir dir;
  GgufWriter w;
  w.Set("general.alignment", uint32_t{64});
  w.Set("s", "string");
  w.Set("i64", int64_t{-3});
  w.Set("f64", 2.5);
  w.Set("nested", GgufArray{GgufType::kArray, {GgufArray{GgufType::kInt16, {int16_t{1}, int16_t{-1}}},
                                               GgufArray{GgufType::kString, {"x", ""}}}});
  ASSERT_TRUE(w.AddTensor("q8", GgmlType::kQ8_0, {32, 3}).ok());  // 102 B, padded to 128
  ASSERT_TRUE(w.AddTensor("f32", GgmlType::kF32, {16}).ok());     // 64 B: ends the file without padding
  ASSERT_TRUE(w.Begin(dir.File("w.gguf"), false).ok());
  ASSERT_TRUE(w.WriteTensorData("q8", std::vector<uint8_t>(102, 3)).ok());
  ASSERT_TRUE(w.WriteTensorData("f32", std::vector<uint8_t>(64, 4)).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto bytes = ReadWholeFile(dir.File("w.gguf"));
  ASSERT_TRUE(bytes.ok());
  ExpectTruncationsRejected(*bytes);
}

// Touches everything a parsed file offers, so that ASan/UBSan see any inconsistency a corrupt file slipped through.
void ExerciseParsed(const GgufFile& g, bool tolerate_io_errors = false) {
  for (const auto& [key, value] : g.metadata()) {
    (void)g.GetUint(key);
    (void)g.GetInt(key);
    (void)g.GetFloat(key);
    (void)g.GetBool(key);
    (void)g.GetString(key);
    (void)g.GetArray(key);
  }
  std::vector<uint8_t> scratch;
  for (const GgufTensorInfo& t : g.tensors()) {
    auto data = g.TensorData(t, &scratch);
    if (tolerate_io_errors && data.status().code() == StatusCode::kIOError) continue;
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    ASSERT_EQ(data->size(), t.n_bytes);
    volatile uint8_t sink = 0;
    for (uint8_t b : *data) sink = sink ^ b;
  }
}

TEST(GgufCorruptTest, RandomByteFlipsParseOrAreRejectedCleanly) {
  const std::vector<uint8_t> base = Build(BaseSpec());
  std::mt19937 rng(20240611);
  constexpr int kIterations = 4000;
  int accepted = 0;
  int rejected = 0;
  for (int it = 0; it < kIterations; ++it) {
    std::vector<uint8_t> bytes = base;
    int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      size_t pos = rng() % bytes.size();
      bytes[pos] ^= static_cast<uint8_t>(1 + rng() % 255);
    }
    auto g = OpenBytes(bytes);
    if (g.ok()) {
      ++accepted;
      ExerciseParsed(*g);
    } else {
      ++rejected;
      ASSERT_EQ(g.status().message().rfind(kPath, 0), 0u) << g.status().message();
    }
  }
  std::printf("random flips: %d accepted, %d rejected\n", accepted, rejected);
  // Flips in the data section or inside string bytes are harmless, flips in sizes and ids are not: both must occur.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, kIterations / 4);
}

TEST(GgufCorruptTest, InjectedBitFlipsAndShortReadsAreHandled) {
  auto base = std::make_shared<MemoryFile>(kPath, Build(BaseSpec()));
  for (uint64_t at = 0; at < base->Size(); at += 7) {
    for (auto fault : {FaultInjectingFile::Fault::kBitFlip, FaultInjectingFile::Fault::kShortRead}) {
      auto f = std::make_shared<FaultInjectingFile>(base);
      f->AddRule({fault, at, 1, 1});
      auto g = GgufFile::Open(f);
      if (g.ok()) {
        ExerciseParsed(*g, /*tolerate_io_errors=*/true);
      } else if (fault == FaultInjectingFile::Fault::kShortRead) {
        EXPECT_EQ(g.status().code(), StatusCode::kIOError) << g.status().ToString();
      }
    }
  }
}

}  // namespace
}  // namespace nflash
