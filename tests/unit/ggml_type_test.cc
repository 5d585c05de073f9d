// The ggml type table (runtime/core/ggml_type.h) against ggml's own definitions: each quantized block's bytes summed
// from the fields of its struct in ggml-common.h (scales, minimums, high bits, quants), the type ids of the ggml_type
// enum that GGUF files store; names both ways; and the file hash (checksum.h) against one-shot XXH64.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "runtime/core/checksum.h"
#include "runtime/core/ggml_type.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

TEST(GgmlTypeTest, BlocksMatchGgmlsStructs) {
  constexpr uint64_t kHalf = 2, kFloat = 4, kInt16 = 2;
  struct Expected {
    uint32_t id;  // ggml_type enum value, as stored in GGUF
    const char* name;
    uint64_t block, bytes;
  };
  const std::vector<Expected> expected = {
      {0, "f32", 1, 4},
      {1, "f16", 1, 2},
      {2, "q4_0", 32, kHalf + 32 / 2},                          // d, 4-bit quants
      {3, "q4_1", 32, 2 * kHalf + 32 / 2},                      // d, m, 4-bit quants
      {6, "q5_0", 32, kHalf + 32 / 8 + 32 / 2},                 // d, high bits, low nibbles
      {7, "q5_1", 32, 2 * kHalf + 32 / 8 + 32 / 2},             // d, m, high bits, low nibbles
      {8, "q8_0", 32, kHalf + 32},                              // d, 8-bit quants
      {9, "q8_1", 32, 2 * kHalf + 32},                          // d, s, 8-bit quants
      {10, "q2_K", 256, 256 / 16 + 256 / 4 + 2 * kHalf},        // scales, 2-bit quants, d, dmin
      {11, "q3_K", 256, 256 / 8 + 256 / 4 + 12 + kHalf},        // high bits, low 2 bits, 6-bit scales, d
      {12, "q4_K", 256, 2 * kHalf + 12 + 256 / 2},              // d, dmin, 6-bit scales and mins, 4-bit quants
      {13, "q5_K", 256, 2 * kHalf + 12 + 256 / 8 + 256 / 2},    // d, dmin, scales, high bits, low nibbles
      {14, "q6_K", 256, 256 / 2 + 256 / 4 + 256 / 16 + kHalf},  // low 4 bits, high 2 bits, 8-bit scales, d
      {15, "q8_K", 256, kFloat + 256 + 256 / 16 * kInt16},      // d, 8-bit quants, sums of 16
      {24, "i8", 1, 1},
      {25, "i16", 1, 2},
      {26, "i32", 1, 4},
      {27, "i64", 1, 8},
      {28, "f64", 1, 8},
      {30, "bf16", 1, 2},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.name);
    const auto info = LookupGgmlType(e.id);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->name, e.name);
    EXPECT_EQ(info->block_size, e.block);
    EXPECT_EQ(info->type_size, e.bytes);
    EXPECT_EQ(ParseGgmlType(e.name), info->type);
    // A row of two blocks, and one that is not whole blocks (quantized types only).
    EXPECT_EQ(RowBytes(info->type, 2 * e.block), 2 * e.bytes);
    if (e.block > 1) {
      EXPECT_FALSE(RowBytes(info->type, e.block + 1).has_value());
    }
  }
  for (uint32_t id : {4u, 5u, 16u, 29u, 31u, 1000u}) EXPECT_FALSE(LookupGgmlType(id).has_value()) << id;
}

TEST(GgmlTypeTest, NamesParseInAnyCaseAndShapesPrintAsLists) {
  EXPECT_EQ(ParseGgmlType("Q4_0"), GgmlType::kQ4_0);
  EXPECT_EQ(ParseGgmlType("q6_k"), GgmlType::kQ6_K);
  EXPECT_EQ(ParseGgmlType("BF16"), GgmlType::kBF16);
  EXPECT_FALSE(ParseGgmlType("q4").has_value());
  EXPECT_FALSE(ParseGgmlType("").has_value());
  EXPECT_EQ(ShapeToString({4096, 32000}), "[4096, 32000]");
  EXPECT_EQ(ShapeToString({7}), "[7]");
  EXPECT_EQ(ShapeToString({}), "[]");
}

// HashFile reads in 8 MiB chunks: a 20 MiB file (two whole chunks and a part) hashes as one XXH64 call over its
// bytes; an empty file gives XXH64's published value for empty input; hex is 16 lower-case digits.
TEST(ChecksumFileTest, HashFileIsXxh64OfTheWholeFile) {
  testing::TempDir dir;
  std::vector<uint8_t> bytes((size_t{20} << 20) + 12345);
  std::mt19937_64 rng(11);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  testing::WriteBytes(dir.File("big.bin"), bytes);
  const auto h = HashFile(dir.File("big.bin"));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(*h, Xxh64(bytes.data(), bytes.size(), 0));
  testing::WriteBytes(dir.File("empty.bin"), {});
  const auto e = HashFile(dir.File("empty.bin"));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(*e, 0xEF46DB3751D8E999ull);
  EXPECT_EQ(HashToHex(0xEF46DB3751D8E999ull), "ef46db3751d8e999");
  EXPECT_EQ(HashToHex(1), "0000000000000001");
  EXPECT_FALSE(HashFile(dir.File("missing.bin")).ok());
}

}  // namespace
}  // namespace nflash
