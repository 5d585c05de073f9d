// Tests of the GGUF reader and writer: round trips, a hand-built byte layout, typed getters, writer misuse, and the
// real llama SPM vocabulary file from ../shared.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using testing::SharedPath;
using testing::TempDir;

// Deep equality written independently of the reader: same type, same value; floats compared by bit pattern so NaN
// payloads and -0.0 count.
::testing::AssertionResult SameValue(const GgufValue& a, const GgufValue& b, const std::string& where) {
  if (a.v.index() != b.v.index()) {
    return ::testing::AssertionFailure() << where << ": type " << GgufTypeName(a.type()) << " vs "
                                         << GgufTypeName(b.type());
  }
  if (const auto* x = std::get_if<float>(&a.v)) {
    if (std::bit_cast<uint32_t>(*x) != std::bit_cast<uint32_t>(std::get<float>(b.v))) {
      return ::testing::AssertionFailure() << where << ": float bits differ";
    }
  } else if (const auto* d = std::get_if<double>(&a.v)) {
    if (std::bit_cast<uint64_t>(*d) != std::bit_cast<uint64_t>(std::get<double>(b.v))) {
      return ::testing::AssertionFailure() << where << ": double bits differ";
    }
  } else if (const auto* arr = std::get_if<GgufArray>(&a.v)) {
    const auto& brr = std::get<GgufArray>(b.v);
    if (arr->element_type != brr.element_type || arr->items.size() != brr.items.size()) {
      return ::testing::AssertionFailure() << where << ": array type/size " << GgufTypeName(arr->element_type) << "/"
                                           << arr->items.size() << " vs " << GgufTypeName(brr.element_type) << "/"
                                           << brr.items.size();
    }
    for (size_t i = 0; i < arr->items.size(); ++i) {
      auto r = SameValue(arr->items[i], brr.items[i], where + "[" + std::to_string(i) + "]");
      if (!r) return r;
    }
  } else {
    bool same = std::visit(
        [&b](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, GgufArray>) {
            return false;  // handled above
          } else {
            return x == std::get<T>(b.v);
          }
        },
        a.v);
    if (!same) return ::testing::AssertionFailure() << where << ": values differ";
  }
  return ::testing::AssertionSuccess();
}

GgufArray MakeArray(GgufType type, std::vector<GgufValue> items) { return GgufArray{type, std::move(items)}; }

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Every value type, extremes, NaN payloads, embedded NULs, empty and nested arrays.
std::vector<std::pair<std::string, GgufValue>> AllTypesMetadata() {
  std::vector<std::pair<std::string, GgufValue>> kv;
  kv.emplace_back("t.u8", uint8_t{255});
  kv.emplace_back("t.i8", int8_t{-128});
  kv.emplace_back("t.u16", uint16_t{65535});
  kv.emplace_back("t.i16", int16_t{-32768});
  kv.emplace_back("t.u32", uint32_t{4294967295u});
  kv.emplace_back("t.i32", std::numeric_limits<int32_t>::min());
  kv.emplace_back("t.f32", -1.5f);
  kv.emplace_back("t.f32_nan", std::bit_cast<float>(uint32_t{0x7fc00001}));
  kv.emplace_back("t.bool_true", true);
  kv.emplace_back("t.bool_false", false);
  kv.emplace_back("t.str", std::string("h\xc3\xa9llo\0w\xc3\xb6rld", 13));
  kv.emplace_back("t.empty_str", std::string());
  kv.emplace_back("t.u64", std::numeric_limits<uint64_t>::max());
  kv.emplace_back("t.i64", std::numeric_limits<int64_t>::min());
  kv.emplace_back("t.f64", 3.141592653589793);
  kv.emplace_back("t.f64_neg0", -0.0);
  kv.emplace_back("general.alignment", uint32_t{64});
  kv.emplace_back("a.u8", MakeArray(GgufType::kUint8, {uint8_t{0}, uint8_t{1}, uint8_t{255}}));
  kv.emplace_back("a.i8", MakeArray(GgufType::kInt8, {int8_t{-1}, int8_t{127}}));
  kv.emplace_back("a.u16", MakeArray(GgufType::kUint16, {uint16_t{1}, uint16_t{0xBEEF}}));
  kv.emplace_back("a.i16", MakeArray(GgufType::kInt16, {int16_t{-2}, int16_t{3}}));
  kv.emplace_back("a.u32", MakeArray(GgufType::kUint32, {uint32_t{7}, uint32_t{0xDEADBEEF}}));
  kv.emplace_back("a.i32", MakeArray(GgufType::kInt32, {int32_t{-7}, int32_t{1 << 30}}));
  kv.emplace_back("a.f32", MakeArray(GgufType::kFloat32, {0.25f, -0.0f, std::numeric_limits<float>::infinity()}));
  kv.emplace_back("a.bool", MakeArray(GgufType::kBool, {true, false, true}));
  kv.emplace_back("a.str", MakeArray(GgufType::kString, {"a", "", "ccc"}));
  kv.emplace_back("a.u64", MakeArray(GgufType::kUint64, {uint64_t{1} << 63}));
  kv.emplace_back("a.i64", MakeArray(GgufType::kInt64, {int64_t{-1}, int64_t{1} << 40}));
  kv.emplace_back("a.f64", MakeArray(GgufType::kFloat64, {1e-300, -2.5}));
  kv.emplace_back("a.empty", MakeArray(GgufType::kUint32, {}));
  // Inner arrays carry their own element types, which may differ between siblings.
  kv.emplace_back("a.nested",
                  MakeArray(GgufType::kArray, {MakeArray(GgufType::kUint16, {uint16_t{1}, uint16_t{2}}),
                                               MakeArray(GgufType::kString, {"x"}),
                                               MakeArray(GgufType::kArray, {MakeArray(GgufType::kBool, {false})}),
                                               MakeArray(GgufType::kInt8, {})}));
  return kv;
}

struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> dims;
  uint64_t n_bytes;  // computed by hand from ggml's block geometry, not by the code under test
  uint64_t offset;   // running sum of sizes padded to 64
};

// F32 7x3 = 84 B; F16 5 = 10 B; Q8_0 64x2 = 4 blocks x 34 B; Q4_0 32x3x2 = 6 blocks x 18 B; F32 1x2x1x2 = 16 B.
const std::vector<TensorSpec> kTensors = {
    {"tok_embd.weight", GgmlType::kF32, {7, 3}, 84, 0},
    {"norm", GgmlType::kF16, {5}, 10, 128},
    {"blk.0.q8", GgmlType::kQ8_0, {64, 2}, 136, 192},
    {"blk.0.q4", GgmlType::kQ4_0, {32, 3, 2}, 108, 384},
    {"four_d", GgmlType::kF32, {1, 2, 1, 2}, 16, 512},
};

std::string WriteRoundTripFile(const TempDir& dir) {
  std::string path = dir.File("rt.gguf");
  GgufWriter w;
  for (auto& [k, v] : AllTypesMetadata()) w.Set(k, v);
  for (const auto& t : kTensors) EXPECT_TRUE(w.AddTensor(t.name, t.type, t.dims).ok()) << t.name;
  Status s = w.Begin(path, false);
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (size_t i = 0; i < kTensors.size(); ++i) {
    auto bytes = RandomBytes(kTensors[i].n_bytes, 100 + static_cast<uint32_t>(i));
    s = w.WriteTensorData(kTensors[i].name, bytes);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  s = w.Finish();
  EXPECT_TRUE(s.ok()) << s.ToString();
  return path;
}

void CheckRoundTrip(const GgufFile& g) {
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 64u);
  EXPECT_EQ(g.data_offset() % 64, 0u);
  auto expected = AllTypesMetadata();
  ASSERT_EQ(g.metadata().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(g.metadata()[i].first, expected[i].first);
    EXPECT_TRUE(SameValue(g.metadata()[i].second, expected[i].second, expected[i].first));
    EXPECT_EQ(g.Find(expected[i].first), &g.metadata()[i].second);
  }
  ASSERT_EQ(g.tensors().size(), kTensors.size());
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    const TensorSpec& e = kTensors[i];
    const GgufTensorInfo& t = g.tensors()[i];
    EXPECT_EQ(t.name, e.name);
    EXPECT_EQ(t.type, e.type);
    EXPECT_EQ(t.dims, e.dims);
    EXPECT_EQ(t.n_bytes, e.n_bytes) << e.name;
    EXPECT_EQ(t.offset, e.offset) << e.name;
    EXPECT_EQ(g.FindTensor(e.name), &t);
    auto data = g.TensorData(t, &scratch);
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    auto want = RandomBytes(e.n_bytes, 100 + static_cast<uint32_t>(i));
    ASSERT_EQ(data->size(), want.size());
    EXPECT_EQ(std::memcmp(data->data(), want.data(), want.size()), 0) << e.name;
  }
  // Last tensor (16 B) padded to 64: the file ends there.
  EXPECT_EQ(g.file().Size(), g.data_offset() + 512 + 64);
  EXPECT_EQ(g.FindTensor("missing"), nullptr);
  EXPECT_EQ(g.Find("missing"), nullptr);
}

TEST(GgufTest, RoundTripEveryTypeAndTensorsWithAlignment64) {
  TempDir dir;
  std::string path = WriteRoundTripFile(dir);
  for (bool mmap : {true, false}) {
    SCOPED_TRACE(mmap ? "mmap" : "pread");
    auto g = GgufFile::OpenPath(path, mmap);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    CheckRoundTrip(*g);
  }
  // Through the ReadAt-only path (Data() is null for the fault-injecting wrapper without rules).
  auto mem = ReadFileToMemory(path);
  ASSERT_TRUE(mem.ok());
  auto wrapped = std::make_shared<FaultInjectingFile>(std::shared_ptr<const ReadableFile>(std::move(*mem)));
  auto g = GgufFile::Open(wrapped);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  CheckRoundTrip(*g);
}

// A tiny file written byte by byte from the spec, independent of the writer.
std::vector<uint8_t> HandBuiltTiny() {
  std::vector<uint8_t> b = {
      'G', 'G', 'U', 'F', 3, 0, 0, 0,  // magic, version 3
      1, 0, 0, 0, 0, 0, 0, 0,          // tensor_count = 1
      3, 0, 0, 0, 0, 0, 0, 0,          // metadata_kv_count = 3
      // "name" = string "x"
      4, 0, 0, 0, 0, 0, 0, 0, 'n', 'a', 'm', 'e', 8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 'x',
      // "n" = uint32 0x01020304
      1, 0, 0, 0, 0, 0, 0, 0, 'n', 4, 0, 0, 0, 0x04, 0x03, 0x02, 0x01,
      // "arr" = array of int16 {-1, 2}
      3, 0, 0, 0, 0, 0, 0, 0, 'a', 'r', 'r', 9, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 2, 0,
      // tensor "t": n_dims 1, dims {4}, type f32 (0), offset 0
      1, 0, 0, 0, 0, 0, 0, 0, 't', 1, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
  };
  EXPECT_EQ(b.size(), 24u + 25 + 17 + 31 + 33);  // 130
  b.resize(160, 0);                                // padding to the default alignment 32
  const uint8_t data[16] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0, 0, 0, 0, 0x3f, 0, 0, 0, 0};  // 1, -2, 0.5, 0
  b.insert(b.end(), data, data + 16);
  b.resize(192, 0);  // the tensor padded to 32
  return b;
}

TEST(GgufTest, ReadsHandBuiltBytes) {
  auto g = GgufFile::Open(std::make_shared<MemoryFile>("tiny.gguf", HandBuiltTiny()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->version(), 3u);
  EXPECT_EQ(g->alignment(), 32u);
  EXPECT_EQ(g->data_offset(), 160u);
  ASSERT_EQ(g->metadata().size(), 3u);
  EXPECT_EQ(*g->GetString("name"), "x");
  EXPECT_EQ(*g->GetUint("n"), 0x01020304u);
  auto arr = g->GetArray("arr");
  ASSERT_TRUE(arr.ok());
  EXPECT_TRUE(SameValue(**arr, MakeArray(GgufType::kInt16, {int16_t{-1}, int16_t{2}}), "arr"));
  ASSERT_EQ(g->tensors().size(), 1u);
  const GgufTensorInfo& t = g->tensors()[0];
  EXPECT_EQ(t.name, "t");
  EXPECT_EQ(t.dims, std::vector<uint64_t>{4});
  EXPECT_EQ(t.type, GgmlType::kF32);
  EXPECT_EQ(t.offset, 0u);
  EXPECT_EQ(t.n_elements, 4u);
  EXPECT_EQ(t.n_bytes, 16u);
  std::vector<uint8_t> scratch;
  auto data = g->TensorData(t, &scratch);
  ASSERT_TRUE(data.ok());
  float f[4];
  std::memcpy(f, data->data(), 16);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0.5f);
  EXPECT_EQ(f[3], 0.0f);
}

// Rebind keeps the parsed directory and reads tensors from the new copy (here a copy whose tensor bytes differ, to
// show which file the data comes from); a copy of another size is refused with both names.
TEST(GgufTest, RebindReadsTensorsFromTheNewCopy) {
  auto g = GgufFile::Open(std::make_shared<MemoryFile>("first.gguf", HandBuiltTiny()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  std::vector<uint8_t> copy = HandBuiltTiny();
  const float two = 2.0f;
  std::memcpy(copy.data() + 160, &two, sizeof two);  // the data section starts at 160 (ReadsHandBuiltBytes)
  auto r = std::move(*g).Rebind(std::make_shared<MemoryFile>("second.gguf", copy));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->path(), "second.gguf");
  EXPECT_EQ(*r->GetString("name"), "x");
  ASSERT_EQ(r->tensors().size(), 1u);
  std::vector<uint8_t> scratch;
  auto data = r->TensorData(r->tensors()[0], &scratch);
  ASSERT_TRUE(data.ok());
  float f0 = 0.0f;
  std::memcpy(&f0, data->data(), sizeof f0);
  EXPECT_EQ(f0, 2.0f);

  auto h = GgufFile::Open(std::make_shared<MemoryFile>("first.gguf", HandBuiltTiny()));
  ASSERT_TRUE(h.ok());
  std::vector<uint8_t> longer = HandBuiltTiny();
  longer.push_back(0);
  auto bad = std::move(*h).Rebind(std::make_shared<MemoryFile>("longer.gguf", longer));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("longer.gguf"), std::string::npos) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("first.gguf"), std::string::npos) << bad.status().ToString();
}

TEST(GgufTest, WriterOutputEqualsHandBuiltBytes) {
  TempDir dir;
  GgufWriter w;
  w.Set("name", "x");
  w.Set("n", uint32_t{0x01020304});
  w.Set("arr", MakeArray(GgufType::kInt16, {int16_t{-1}, int16_t{2}}));
  ASSERT_TRUE(w.AddTensor("t", GgmlType::kF32, {4}).ok());
  ASSERT_TRUE(w.Begin(dir.File("w.gguf"), false).ok());
  const float f[4] = {1.0f, -2.0f, 0.5f, 0.0f};
  ASSERT_TRUE(w.WriteTensorData("t", std::span(reinterpret_cast<const uint8_t*>(f), 16)).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto bytes = ReadWholeFile(dir.File("w.gguf"));
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, HandBuiltTiny());
}

TEST(GgufTest, ReadsVersion2) {
  auto bytes = HandBuiltTiny();
  bytes[4] = 2;  // v2 has the same layout as v3
  auto g = GgufFile::Open(std::make_shared<MemoryFile>("v2.gguf", bytes));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->version(), 2u);
}

TEST(GgufTest, ZeroSizedTensorIsAcceptedLikeGgml) {
  // ggml (test-gguf.cpp, TENSORS_ZERO_DIM) loads tensors with a zero dimension; nflash does the same.
  TempDir dir;
  GgufWriter w;
  ASSERT_TRUE(w.AddTensor("empty", GgmlType::kF32, {4, 0}).ok());
  ASSERT_TRUE(w.AddTensor("next", GgmlType::kF32, {8}).ok());
  ASSERT_TRUE(w.Begin(dir.File("z.gguf"), false).ok());
  ASSERT_TRUE(w.WriteTensorData("empty", {}).ok());
  std::vector<uint8_t> data(32, 7);
  ASSERT_TRUE(w.WriteTensorData("next", data).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto g = GgufFile::OpenPath(dir.File("z.gguf"));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->tensors()[0].n_elements, 0u);
  EXPECT_EQ(g->tensors()[0].n_bytes, 0u);
  EXPECT_EQ(g->tensors()[1].offset, 0u);  // a zero-size tensor occupies no padded space
  std::vector<uint8_t> scratch;
  EXPECT_TRUE(g->TensorData(g->tensors()[0], &scratch)->empty());
}

// The metadata's heap estimate against what the allocator hands out while the file is parsed (an independent count):
// a vocabulary-sized array of 100000 strings, half inline (short) and half on the heap, and an array of as many floats,
// one tensor. With glibc the estimate (its chunk sizes) must be the heap's within 2% (it was within 0.01% when written;
// without the chunk overhead it was 8% short).
TEST(GgufTest, MetadataHeapEstimateMatchesTheAllocator) {
  TempDir dir;
  GgufWriter w;
  GgufArray tokens, scores;
  tokens.element_type = GgufType::kString;
  scores.element_type = GgufType::kFloat32;
  for (int i = 0; i < 100000; ++i) {
    tokens.items.emplace_back(i % 2 ? "t" + std::to_string(i) : "a-longer-token-text-" + std::to_string(i));
    scores.items.emplace_back(static_cast<float>(i));
  }
  w.Set("tokenizer.ggml.tokens", GgufValue(std::move(tokens)));
  w.Set("tokenizer.ggml.scores", GgufValue(std::move(scores)));
  w.Set("general.name", GgufValue(std::string("heap")));
  ASSERT_TRUE(w.AddTensor("t", GgmlType::kF32, {8}).ok());
  ASSERT_TRUE(w.Begin(dir.File("h.gguf"), false).ok());
  std::vector<uint8_t> data(32, 1);
  ASSERT_TRUE(w.WriteTensorData("t", data).ok());
  ASSERT_TRUE(w.Finish().ok());
  const size_t before = testing::HeapInUse();
  auto g = GgufFile::OpenPathUncached(dir.File("h.gguf"));
  const size_t after = testing::HeapInUse();
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  const double held = static_cast<double>(after - before), estimate = static_cast<double>(g->MetadataHeapBytes());
  std::printf("metadata heap: estimate %.0f, allocator %.0f bytes\n", estimate, held);
  EXPECT_GT(estimate, testing::kHeapEstimateLow * held);
  EXPECT_LT(estimate, testing::kHeapEstimateHigh * held);
}

TEST(GgufTest, TypedGetters) {
  TempDir dir;
  GgufWriter w;
  w.Set("u8", uint8_t{200});
  w.Set("i32_neg", int32_t{-5});
  w.Set("i16_pos", int16_t{12});
  w.Set("u64_big", uint64_t{1} << 63);
  w.Set("f32", 0.5f);
  w.Set("f64", 0.25);
  w.Set("b", true);
  w.Set("s", "text");
  w.Set("arr", MakeArray(GgufType::kString, {"a"}));
  ASSERT_TRUE(w.Begin(dir.File("g.gguf"), false).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto g = GgufFile::OpenPath(dir.File("g.gguf"));
  ASSERT_TRUE(g.ok());

  EXPECT_EQ(*g->GetUint("u8"), 200u);
  EXPECT_EQ(*g->GetInt("u8"), 200);
  EXPECT_EQ(*g->GetUint("i16_pos"), 12u);
  EXPECT_EQ(*g->GetInt("i32_neg"), -5);
  EXPECT_EQ(*g->GetUint("u64_big"), uint64_t{1} << 63);
  EXPECT_EQ(*g->GetFloat("f32"), 0.5);
  EXPECT_EQ(*g->GetFloat("f64"), 0.25);
  EXPECT_TRUE(*g->GetBool("b"));
  EXPECT_EQ(*g->GetString("s"), "text");
  EXPECT_EQ((*g->GetArray("arr"))->items.size(), 1u);

  auto neg = g->GetUint("i32_neg");  // does not fit
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), StatusCode::kCorruption);
  EXPECT_NE(neg.status().message().find("'i32_neg'"), std::string::npos) << neg.status().message();
  EXPECT_NE(neg.status().message().find("-5"), std::string::npos) << neg.status().message();
  auto big = g->GetInt("u64_big");  // does not fit
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("9223372036854775808"), std::string::npos) << big.status().message();
  auto wrong = g->GetString("u8");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kCorruption);
  EXPECT_NE(wrong.status().message().find("expected string, found uint8"), std::string::npos)
      << wrong.status().message();
  EXPECT_NE(wrong.status().message().find("g.gguf"), std::string::npos);
  EXPECT_FALSE(g->GetUint("b").ok());  // bool is not an integer
  EXPECT_FALSE(g->GetFloat("u8").ok());
  EXPECT_FALSE(g->GetBool("u8").ok());
  EXPECT_FALSE(g->GetArray("s").ok());
  auto missing = g->GetUint("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
}

TEST(GgufTest, SetReplacesInPlace) {
  TempDir dir;
  GgufWriter w;
  w.Set("a", uint32_t{1});
  w.Set("b", uint32_t{2});
  w.Set("a", "replaced");
  ASSERT_TRUE(w.Begin(dir.File("s.gguf"), false).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto g = GgufFile::OpenPath(dir.File("s.gguf"));
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(g->metadata().size(), 2u);
  EXPECT_EQ(g->metadata()[0].first, "a");
  EXPECT_EQ(*g->GetString("a"), "replaced");
  EXPECT_EQ(g->metadata()[1].first, "b");
}

TEST(GgufTest, WriterRejectsBadTensorsAndMisuse) {
  TempDir dir;
  GgufWriter w;
  ASSERT_TRUE(w.AddTensor("a", GgmlType::kQ8_0, {64}).ok());
  EXPECT_EQ(w.AddTensor("a", GgmlType::kF32, {1}).code(), StatusCode::kInvalidArgument);      // duplicate
  EXPECT_EQ(w.AddTensor("b", GgmlType::kF32, {}).code(), StatusCode::kInvalidArgument);       // no dims
  EXPECT_EQ(w.AddTensor("b", GgmlType::kF32, {1, 1, 1, 1, 1}).code(), StatusCode::kInvalidArgument);
  Status rows = w.AddTensor("b", GgmlType::kQ8_0, {33});                                        // not a block multiple
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("block size 32"), std::string::npos) << rows.message();
  EXPECT_FALSE(w.AddTensor("", GgmlType::kF32, {1}).ok());
  EXPECT_FALSE(w.AddTensor(std::string(64, 'n'), GgmlType::kF32, {1}).ok());  // ggml's name limit
  EXPECT_FALSE(w.AddTensor("huge", GgmlType::kF32, {uint64_t{1} << 32, uint64_t{1} << 32}).ok());
  ASSERT_TRUE(w.AddTensor("c", GgmlType::kF32, {2}).ok());

  std::string path = dir.File("m.gguf");
  ASSERT_TRUE(w.Begin(path, false).ok());
  EXPECT_FALSE(w.AddTensor("late", GgmlType::kF32, {1}).ok());
  std::vector<uint8_t> q8(68);
  Status order = w.WriteTensorData("c", std::vector<uint8_t>(8));
  EXPECT_NE(order.message().find("expected tensor 'a'"), std::string::npos) << order.message();
  Status size = w.WriteTensorData("a", std::vector<uint8_t>(67));
  EXPECT_EQ(size.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(size.message().find("'a': expected 68 bytes, given 67"), std::string::npos) << size.message();
  ASSERT_TRUE(w.WriteTensorData("a", q8).ok());
  Status missing = w.Finish();
  EXPECT_NE(missing.message().find("'c'"), std::string::npos) << missing.message();
  EXPECT_FALSE(FileExists(path));  // nothing committed
  ASSERT_TRUE(w.WriteTensorData("c", std::vector<uint8_t>(8)).ok());
  EXPECT_FALSE(w.WriteTensorData("d", std::vector<uint8_t>(8)).ok());
  ASSERT_TRUE(w.Finish().ok());
  EXPECT_TRUE(FileExists(path));
  // The file exists now: a second writer without overwrite must refuse.
  GgufWriter again;
  EXPECT_FALSE(again.Begin(path, false).ok());
}

// Each misuse of the writer's API gets its own message (none of them writes a file).
TEST(GgufTest, WriterMisuseIsNamed) {
  TempDir dir;
  {
    GgufWriter w;
    EXPECT_NE(w.WriteTensorData("a", std::vector<uint8_t>(4)).message().find("without a successful Begin"),
              std::string::npos);
    EXPECT_NE(w.Finish().message().find("Finish without a successful Begin"), std::string::npos);
    // 2^62 f32 values: fewer than INT64_MAX elements, but 2^64 bytes.
    Status bytes = w.AddTensor("big", GgmlType::kF32, {uint64_t{1} << 31, uint64_t{1} << 31});
    EXPECT_NE(bytes.message().find("tensor 'big' byte size overflows"), std::string::npos) << bytes.message();
  }
  {
    GgufWriter w;
    ASSERT_TRUE(w.AddTensor("a", GgmlType::kF32, {uint64_t{1} << 30, uint64_t{1} << 31}).ok());  // 2^63 bytes
    ASSERT_TRUE(w.AddTensor("b", GgmlType::kF32, {uint64_t{1} << 30, uint64_t{1} << 31}).ok());
    Status s = w.Begin(dir.File("huge.gguf"), false);
    EXPECT_NE(s.message().find("the data section would exceed 2^64 bytes at tensor 'b'"), std::string::npos)
        << s.message();
  }
  {
    GgufWriter w;
    w.Set("", uint8_t{1});
    EXPECT_NE(w.Begin(dir.File("e.gguf"), false).message().find("metadata keys must not be empty"),
              std::string::npos);
  }
  {
    GgufArray nested;
    nested.element_type = GgufType::kUint8;
    nested.items.emplace_back(uint8_t{1});
    for (int depth = 1; depth <= kGgufMaxArrayDepth; ++depth) {
      GgufArray outer;
      outer.element_type = GgufType::kArray;
      outer.items.emplace_back(std::move(nested));
      nested = std::move(outer);
    }
    GgufWriter w;
    w.Set("deep", nested);
    Status s = w.Begin(dir.File("deep.gguf"), false);
    EXPECT_NE(s.message().find("'deep': arrays nested more than 16 deep"), std::string::npos) << s.message();
  }
  {
    GgufWriter w;
    ASSERT_TRUE(w.Begin(dir.File("twice.gguf"), false).ok());
    EXPECT_NE(w.Begin(dir.File("twice.gguf"), false).message().find("called twice"), std::string::npos);
  }
  for (const char* f : {"huge.gguf", "e.gguf", "deep.gguf", "twice.gguf"}) EXPECT_FALSE(FileExists(dir.File(f))) << f;
  EXPECT_NE(GgufFile::Open(nullptr).status().message().find("null file"), std::string::npos);
}

TEST(GgufTest, WriterRejectsBadAlignmentAndArrays) {
  TempDir dir;
  {
    GgufWriter w;
    w.Set("general.alignment", uint64_t{64});  // ggml reads it as u32 only
    Status s = w.Begin(dir.File("a.gguf"), false);
    EXPECT_NE(s.message().find("general.alignment must be a uint32"), std::string::npos) << s.message();
  }
  {
    GgufWriter w;
    w.Set("general.alignment", uint32_t{48});
    EXPECT_NE(w.Begin(dir.File("b.gguf"), false).message().find("power of two"), std::string::npos);
  }
  {
    GgufWriter w;
    w.Set("mixed", MakeArray(GgufType::kUint8, {uint8_t{1}, uint16_t{2}}));
    EXPECT_NE(w.Begin(dir.File("c.gguf"), false).message().find("element 1 is uint16"), std::string::npos);
  }
  {
    GgufWriter w;
    ASSERT_TRUE(w.Begin(dir.File("d.gguf"), false).ok());
    w.Set("late", uint8_t{1});  // after Begin: reported by Finish
    EXPECT_NE(w.Finish().message().find("after Begin"), std::string::npos);
  }
  EXPECT_FALSE(FileExists(dir.File("a.gguf")));
  EXPECT_FALSE(FileExists(dir.File("d.gguf")));
}

TEST(GgufTest, ReadErrorsPropagate) {
  auto base = std::make_shared<MemoryFile>("io.gguf", HandBuiltTiny());
  auto faulty = std::make_shared<FaultInjectingFile>(base);
  faulty->AddRule({FaultInjectingFile::Fault::kEio, 0, UINT64_MAX, -1});
  auto g = GgufFile::Open(faulty);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kIOError);
  // TensorData through ReadAt reports the error too.
  auto faulty_data = std::make_shared<FaultInjectingFile>(base);
  auto g2 = GgufFile::Open(faulty_data);
  ASSERT_TRUE(g2.ok()) << g2.status().ToString();
  faulty_data->AddRule({FaultInjectingFile::Fault::kEio, 160, 16, -1});  // after parsing: fail the data section
  std::vector<uint8_t> scratch;
  EXPECT_EQ(g2->TensorData(g2->tensors()[0], &scratch).status().code(), StatusCode::kIOError);
}

// The real llama SPM vocabulary. Expected values come from the file's README (an independent source) and from the
// well-known layout of the Llama-2 SentencePiece vocabulary (ids 0..2 are <unk>, <s>, </s>; 3 is the byte <0x00>).
TEST(GgufTest, RealVocabFile) {
  const std::string path = SharedPath("models/vocab/ggml-vocab-llama-spm.gguf");
  for (bool mmap : {true, false}) {
    SCOPED_TRACE(mmap ? "mmap" : "pread");
    auto t0 = std::chrono::steady_clock::now();
    auto g = GgufFile::OpenPath(path, mmap);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    std::printf("parsed %s (%s) in %.2f ms\n", path.c_str(), mmap ? "mmap" : "pread", ms);
    EXPECT_EQ(g->version(), 3u);
    EXPECT_EQ(g->tensors().size(), 0u);
    EXPECT_EQ(g->metadata().size(), 22u);
    auto tokens = g->GetArray("tokenizer.ggml.tokens");
    ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
    EXPECT_EQ((*tokens)->element_type, GgufType::kString);
    ASSERT_EQ((*tokens)->items.size(), 32000u);
    EXPECT_EQ(std::get<std::string>((*tokens)->items[0].v), "<unk>");
    EXPECT_EQ(std::get<std::string>((*tokens)->items[1].v), "<s>");
    EXPECT_EQ(std::get<std::string>((*tokens)->items[2].v), "</s>");
    EXPECT_EQ(std::get<std::string>((*tokens)->items[3].v), "<0x00>");
    EXPECT_EQ(*g->GetUint("llama.block_count"), 32u);
    EXPECT_EQ(*g->GetUint("llama.embedding_length"), 4096u);
    EXPECT_EQ(*g->GetUint("llama.feed_forward_length"), 11008u);
    EXPECT_EQ(*g->GetUint("llama.attention.head_count"), 32u);
    EXPECT_EQ(*g->GetString("general.architecture"), "llama");
  }
}

// Writing the vocabulary back reproduces the original byte for byte, except that the original (723869 bytes) stops
// right after its last KV while the writer, like ggml's gguf_write, pads the header to the alignment (32): the
// output is the original followed by 3 zero bytes.
TEST(GgufTest, RealVocabFileRewriteIsByteIdentical) {
  const std::string path = SharedPath("models/vocab/ggml-vocab-llama-spm.gguf");
  auto original = ReadWholeFile(path);
  ASSERT_TRUE(original.ok()) << original.status().ToString();
  auto g = GgufFile::OpenPath(path);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  ASSERT_EQ(g->Find("general.alignment"), nullptr);  // default alignment 32 applies
  TempDir dir;
  GgufWriter w;
  for (const auto& [k, v] : g->metadata()) w.Set(k, v);
  ASSERT_TRUE(w.Begin(dir.File("vocab.gguf"), false).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto rewritten = ReadWholeFile(dir.File("vocab.gguf"));
  ASSERT_TRUE(rewritten.ok());
  EXPECT_EQ(original->size(), 723869u);
  ASSERT_EQ(rewritten->size(), 723872u);  // next multiple of 32
  EXPECT_TRUE(std::equal(original->begin(), original->end(), rewritten->begin()));
  for (size_t i = original->size(); i < rewritten->size(); ++i) EXPECT_EQ((*rewritten)[i], 0) << i;
}

}  // namespace
}  // namespace nflash
