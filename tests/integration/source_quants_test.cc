// The converter's reading of ggml block types nflash never computes with (Q4_1, Q5_0, Q5_1, Q2_K..Q6_K): values worked
// by hand from the block layouts, agreement with the independent NumPy reader on random blocks, and a GGUF source
// holding such tensors converted to the values the reference reads from it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "converter/readers.h"
#include "converter/source_quants.h"
#include "runtime/core/float16.h"
#include "runtime/core/gguf.h"
#include "runtime/core/quant.h"
#include "tests/test_util.h"

namespace nflash::converter {
namespace {

constexpr uint16_t kOne = 0x3C00, kHalf = 0x3800, kTwo = 0x4000;  // fp16 1.0, 0.5, 2.0

void PutHalf(std::vector<uint8_t>* b, size_t at, uint16_t h) { std::memcpy(b->data() + at, &h, 2); }

std::vector<float> Dequantize(GgmlType type, const std::vector<uint8_t>& block) {
  std::vector<float> y(TypeInfo(type).block_size * (block.size() / TypeInfo(type).type_size));
  const Status s = DequantizeSourceRow(type, block.data(), y.data(), static_cast<int64_t>(y.size()));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return y;
}

// Q4_K: {d, dmin, scales[12], qs[128]}. Sub-block 0's scale and min are the low 6 bits of bytes 0 and 4; sub-block
// 5's scale is byte 9's low nibble with byte 1's top two bits above it (1 | 1 << 4 = 17) and its min byte 9's high
// nibble with byte 5's top bits (2). Value 0 is the low nibble of qs[0]: 1 * 3 * 7 - 0.5 * 2 = 20; value 32 (sub-block
// 1, scale byte 1 & 63 = 0, min 0) is 0; value 163 (sub-block 5, position 3: the high nibble of qs[2 * 32 + 3] = 11)
// is 1 * 17 * 11 - 0.5 * 2 = 186.
TEST(SourceQuants, Q4KValuesWorkedByHand) {
  std::vector<uint8_t> b(144, 0);
  PutHalf(&b, 0, kOne);
  PutHalf(&b, 2, kHalf);
  uint8_t* scales = b.data() + 4;
  uint8_t* qs = b.data() + 16;
  scales[0] = 3;
  scales[4] = 2;
  scales[9] = 0x21;
  scales[1] = 0x40;
  qs[0] = 0x97;
  qs[67] = 0xB0;
  const std::vector<float> y = Dequantize(GgmlType::kQ4_K, b);
  EXPECT_EQ(y[0], 20.0f);
  EXPECT_EQ(y[32], 0.0f);
  EXPECT_EQ(y[163], 186.0f);
  EXPECT_EQ(y[1], -1.0f);    // quant 0 of sub-block 0: - 0.5 * 2
  EXPECT_EQ(y[160], -1.0f);  // quant 0 of sub-block 5
}

// Q6_K: {ql[128], qh[64], int8 scales[16], d}. Value 0: ql[0] low nibble 10, qh[0] bits 0-1 = 2: 10 + 32 - 32 = 10,
// scale[0] = -3, d 0.5: -15. Value 161 (second half, group 1, position 1): ql[64 + 32 + 1] low nibble 3, qh[32 + 1]
// bits 2-3 = 1: 3 + 16 - 32 = -13, scale[8 + 0 + 2] = 5: 0.5 * 5 * -13 = -32.5.
TEST(SourceQuants, Q6KValuesWorkedByHand) {
  std::vector<uint8_t> b(210, 0);
  PutHalf(&b, 208, kHalf);
  auto* sc = reinterpret_cast<int8_t*>(b.data() + 192);
  sc[0] = -3;
  sc[10] = 5;
  b[0] = 0x0A;
  b[128] = 0x02;
  b[97] = 0x03;
  b[128 + 33] = 0x04;
  const std::vector<float> y = Dequantize(GgmlType::kQ6_K, b);
  EXPECT_EQ(y[0], -15.0f);
  EXPECT_EQ(y[161], -32.5f);
  EXPECT_EQ(y[1], 0.5f * -3 * -32);  // every other quant of sub-block 0 is 0 - 32
}

// Q3_K: {hmask[32], qs[64], scales[12], d}. Sub-block 9's scale: byte 1's high nibble 7, and bits 4-5 of byte 9 (the
// 12 bytes' third word holds the top two bits) = 2: 7 | 2 << 4 = 39, minus 32 = 7. Value 150 (second half, group 0,
// position 22): 2 bits of qs[32 + 22] at shift 0 = 3; its high bit is bit 4 of hmask[22]: clear, 3 - 4 = -1, so
// 2 * 7 * -1 = -14; set, 2 * 7 * 3 = 42.
TEST(SourceQuants, Q3KValuesWorkedByHand) {
  std::vector<uint8_t> b(110, 0);
  PutHalf(&b, 108, kTwo);
  b[96 + 1] = 0x70;
  b[96 + 9] = 0x20;
  b[32 + 54] = 0x03;
  EXPECT_EQ(Dequantize(GgmlType::kQ3_K, b)[150], -14.0f);
  b[22] = 0x10;
  EXPECT_EQ(Dequantize(GgmlType::kQ3_K, b)[150], 42.0f);
}

// Q5_0 {d, qh[4], qs[16]}: value 17 is qs[1]'s high nibble with bit 17 of qh as its fifth bit: (9 | 16) - 16 = 9, times
// d 2 = 18; value 1 without its bit: 4 - 16 = -12 -> -24. Q5_1 {d, m, qh, qs}: the same quants, d * q + m.
TEST(SourceQuants, Q5ValuesWorkedByHand) {
  std::vector<uint8_t> b(22, 0);
  PutHalf(&b, 0, kTwo);
  const uint32_t qh = 1u << 17;
  std::memcpy(b.data() + 2, &qh, 4);
  b[6 + 1] = 0x94;
  std::vector<float> y = Dequantize(GgmlType::kQ5_0, b);
  EXPECT_EQ(y[17], 18.0f);
  EXPECT_EQ(y[1], -24.0f);
  std::vector<uint8_t> b1(24, 0);
  PutHalf(&b1, 0, kTwo);
  PutHalf(&b1, 2, kHalf);
  std::memcpy(b1.data() + 4, &qh, 4);
  b1[8 + 1] = 0x94;
  y = Dequantize(GgmlType::kQ5_1, b1);
  EXPECT_EQ(y[17], 2.0f * 25 + 0.5f);
  EXPECT_EQ(y[1], 2.0f * 4 + 0.5f);
}

// Random blocks (their fp16 fields finite values in [-2, 2]) of every source-only type: nflash's values are the NumPy
// reader's (tests/reference/gguf_numpy.py, which gathers each value from its place in the layout instead of walking
// ggml's loops), bit for bit.
TEST(SourceQuants, RandomBlocksMatchTheNumpyReader) {
  testing::TempDir tmp;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  struct Halves {
    GgmlType type;
    std::vector<size_t> at;  // the fp16 fields
  };
  for (const Halves& h : {Halves{GgmlType::kQ4_1, {0, 2}}, Halves{GgmlType::kQ5_0, {0}}, Halves{GgmlType::kQ5_1, {0, 2}},
                          Halves{GgmlType::kQ2_K, {80, 82}}, Halves{GgmlType::kQ3_K, {108}},
                          Halves{GgmlType::kQ4_K, {0, 2}}, Halves{GgmlType::kQ5_K, {0, 2}},
                          Halves{GgmlType::kQ6_K, {208}}}) {
    const GgmlTypeInfo& info = TypeInfo(h.type);
    const size_t blocks = 12;
    std::vector<uint8_t> raw(blocks * info.type_size);
    for (uint8_t& x : raw) x = static_cast<uint8_t>(rng());
    for (size_t i = 0; i < blocks; ++i) {
      for (size_t at : h.at) PutHalf(&raw, i * info.type_size + at, Fp32ToFp16(scale(rng)));
    }
    const std::vector<float> ours = Dequantize(h.type, raw);
    const std::string bin = tmp.File(std::string(info.name) + ".bin"), npy = tmp.File(std::string(info.name) + ".npy");
    testing::WriteBytes(bin, raw);
    const testing::CommandResult r = testing::RunCommand(std::string(NFLASH_PYTHON) + " " + NFLASH_SOURCE_DIR +
                                                         "/tests/reference/gguf_numpy.py --dequantize " +
                                                         std::to_string(static_cast<uint32_t>(h.type)) + " " + bin +
                                                         " " + npy);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<float> ref = testing::ReadNpyF32(npy, ours.size());
    ASSERT_EQ(ref.size(), ours.size()) << info.name;
    size_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      differ += ours[i] != ref[i];
      nonzero += ours[i] != 0.0f;
    }
    EXPECT_EQ(differ, 0u) << info.name;
    EXPECT_GT(nonzero, ours.size() / 2) << info.name;
  }
  // A row that is not whole blocks is refused, naming the type and block.
  float y[300];
  const uint8_t zeros[210] = {};
  const Status s = DequantizeSourceRow(GgmlType::kQ6_K, zeros, y, 300);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a row of 300 values is not a whole number of q6_K blocks (256)"), std::string::npos)
      << s.ToString();
}

// A llama GGUF source (stories260K's conversion) with its q projections in Q4_1, Q5_0 and Q5_1 (random blocks; rows of
// 64 are two blocks): converted to F32, each holds the values the NumPy reader reads from the source.
TEST(SourceQuants, GgufSourceTensorsConvertToTheReferenceValues) {
  testing::TempDir tmp;
  const std::string stories = testing::SharedPath("models/stories260K/stories260K.bin");
  const std::string f32 = tmp.File("stories.gguf");
  {
    auto model = ReadLlama2c(stories, *FindLlama2cTokenizer(stories), FfnActivation::kSilu);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    WriteOptions o;
    o.path = f32;
    o.progress = false;
    ASSERT_TRUE(WriteModelGguf(*model, o).ok());
  }
  const std::vector<std::pair<std::string, GgmlType>> retyped = {
      {"blk.0.attn_q.weight", GgmlType::kQ4_1}, {"blk.1.attn_q.weight", GgmlType::kQ5_0},
      {"blk.2.attn_q.weight", GgmlType::kQ5_1}};
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> scale(-0.1f, 0.1f);
  const std::string src = tmp.File("mixed.gguf");
  ASSERT_EQ(testing::RewriteGguf(f32, src, nullptr,
                                 [&](testing::GgufTensorCopy* c) {
                                   for (const auto& [name, type] : retyped) {
                                     if (c->name != name) continue;
                                     c->type = type;
                                     c->ZeroData();
                                     const GgmlTypeInfo& info = TypeInfo(type);
                                     for (uint8_t& x : c->bytes) x = static_cast<uint8_t>(rng());
                                     for (size_t i = 0; i < c->bytes.size(); i += info.type_size) {
                                       PutHalf(&c->bytes, i, Fp32ToFp16(scale(rng)));
                                       if (type != GgmlType::kQ5_0) PutHalf(&c->bytes, i + 2, Fp32ToFp16(scale(rng)));
                                     }
                                   }
                                 }),
            "");
  auto model = ReadGgufModel(src);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const std::string out = tmp.File("out.gguf");
  WriteOptions o;
  o.path = out;
  o.progress = false;
  ASSERT_TRUE(WriteModelGguf(*model, o).ok());
  auto f = GgufFile::OpenPath(out);
  ASSERT_TRUE(f.ok());
  for (const auto& [name, type] : retyped) {
    const GgufTensorInfo* t = f->FindTensor(name);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->type, GgmlType::kF32);
    std::vector<uint8_t> scratch;
    auto bytes = f->TensorData(*t, &scratch);
    ASSERT_TRUE(bytes.ok());
    std::vector<float> ours(t->n_elements);
    std::memcpy(ours.data(), bytes->data(), bytes->size());
    // The reference reads the tensor from the source file itself.
    const std::string npy = tmp.File(name + ".npy");
    const testing::CommandResult r = testing::RunCommand(
        std::string(NFLASH_PYTHON) + " -c \"import sys; sys.path.insert(0, '" + NFLASH_SOURCE_DIR +
        "/tests/reference'); import gguf_numpy as g, numpy as np; np.save('" + npy + "', g.GGUFReader('" + src +
        "').tensor('" + name + "').reshape(-1))\"");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(testing::ReadNpyF32(npy, ours.size()) == ours) << name << " (" << GgmlTypeName(type) << ")";
  }
}

}  // namespace
}  // namespace nflash::converter
