// Tests of the Q8_0/Q4_0 quantizers: byte layouts of hand-computed blocks, rounding rules, round-trip error bounds
// derived from the formulas, and the QuantizeRow/DequantizeRow dispatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "runtime/core/float16.h"
#include "runtime/core/quant.h"

namespace nflash {
namespace {

TEST(QuantQ8_0Test, BlockOfZeroToThirtyOne) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j);
  BlockQ8_0 b;
  QuantizeRowQ8_0(x, &b, 32);
  // d = 31/127 = 0.2440944... = 2^-3 * 1.952755...; mantissa 0.952755 * 1024 = 975.6 -> 976 = 0x3d0; exponent
  // -3 + 15 = 12 -> 0x3000.
  EXPECT_EQ(b.d, 0x3000 + 0x3d0);
  for (int j = 0; j < 32; ++j) {
    // round(j * 127 / 31), half away from zero, in integers: floor((2*127*j + 31) / 62). No j lands on a tie.
    const int want = (2 * 127 * j + 31) / 62;
    EXPECT_EQ(b.qs[j], want) << j;
  }
  EXPECT_EQ(b.qs[31], 127);
}

TEST(QuantQ8_0Test, RoundsHalfAwayFromZeroLikeRoundf) {
  // amax 127 gives d = 1 exactly (fp16 0x3c00), so the quants are round(x) itself.
  float x[32] = {127.0f, 0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 2.49f, -2.51f, 0.0f, -127.0f, 63.5f};
  const int8_t want[12] = {127, 1, -1, 2, -2, 3, -3, 2, -3, 0, -127, 64};
  BlockQ8_0 b;
  QuantizeRowQ8_0(x, &b, 32);
  EXPECT_EQ(b.d, 0x3c00);
  for (int j = 0; j < 12; ++j) EXPECT_EQ(b.qs[j], want[j]) << j;
  for (int j = 12; j < 32; ++j) EXPECT_EQ(b.qs[j], 0) << j;
}

TEST(QuantQ8_0Test, ZeroBlockHasZeroScale) {
  float x[64] = {};
  BlockQ8_0 b[2];
  std::memset(b, 0x5a, sizeof(b));
  QuantizeRowQ8_0(x, b, 64);
  for (const auto& blk : b) {
    EXPECT_EQ(blk.d, 0);
    for (int8_t q : blk.qs) EXPECT_EQ(q, 0);
  }
}

TEST(QuantQ4_0Test, BlockOfZeroToThirtyOne) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j);
  BlockQ4_0 b;
  QuantizeRowQ4_0(x, &b, 32);
  // max = 31 -> d = 31 / -8 = -3.875 = -2^1 * 1.9375: sign 0x8000, exponent 16 -> 0x4000, mantissa 0.9375*1024 = 0x3c0.
  EXPECT_EQ(b.d, 0xc3c0);
  int q[32];
  for (int j = 0; j < 32; ++j) {
    // trunc(j * (-8/31) + 8.5) = floor((527 - 16 j) / 62) (never an integer, so float rounding cannot flip it).
    q[j] = (527 - 16 * j) / 62;
  }
  EXPECT_EQ(q[0], 8);
  EXPECT_EQ(q[31], 0);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(b.qs[j], q[j] | (q[j + 16] << 4)) << j;
}

TEST(QuantQ4_0Test, NegativeMaxAndClampOfTheOppositeExtreme) {
  float x[32] = {};
  x[0] = -8.0f;  // largest magnitude, negative: d = -8 / -8 = 1
  x[1] = 8.0f;   // same magnitude, later: does not replace the max; 8 + 8.5 = 16 clamps to 15
  x[2] = 3.0f;   // 11
  x[16] = -3.4f;  // trunc(5.1) = 5
  x[17] = 0.49f;  // trunc(8.99) = 8
  BlockQ4_0 b;
  QuantizeRowQ4_0(x, &b, 32);
  EXPECT_EQ(b.d, 0x3c00);
  EXPECT_EQ(b.qs[0], 0 | (5 << 4));
  EXPECT_EQ(b.qs[1], 15 | (8 << 4));
  EXPECT_EQ(b.qs[2], 11 | (8 << 4));
  for (int j = 3; j < 16; ++j) EXPECT_EQ(b.qs[j], 8 | (8 << 4)) << j;
  float y[32];
  DequantizeRowQ4_0(&b, y, 32);
  EXPECT_EQ(y[0], -8.0f);
  EXPECT_EQ(y[1], 7.0f);
  EXPECT_EQ(y[16], -3.0f);
  EXPECT_EQ(y[17], 0.0f);
}

TEST(QuantQ4_0Test, ZeroBlockQuantsAreEight) {
  float x[32] = {};
  BlockQ4_0 b;
  QuantizeRowQ4_0(x, &b, 32);
  // d = 0.0f / -8 is -0.0: ggml stores the fp16 negative zero.
  EXPECT_EQ(b.d, 0x8000);
  for (uint8_t q : b.qs) EXPECT_EQ(q, 0x88);
}

// Random rows whose blocks span magnitudes from 1e-3 to 1e3 (fp16 scales stay normal).
std::vector<float> RandomRow(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  std::vector<float> x(n);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float scale = std::pow(10.0f, log_scale(rng));
    for (int j = 0; j < 32; ++j) x[b * 32 + j] = normal(rng) * scale;
  }
  return x;
}

// Storing d in fp16 moves it by at most half an ulp: 2^-11 relative in the normal range, 2^-25 absolute below it
// (subnormals, reached by the 1e-3-scaled blocks). So q * d16 differs from q * d32 by at most |q| * Fp16Error(d32).
constexpr double kFp16Rel = 1.0 / 2048;
constexpr double kFp16SubnormalHalfUlp = 1.0 / (1 << 25);
double Fp16Error(double v) { return std::max(std::fabs(v) * kFp16Rel, kFp16SubnormalHalfUlp); }
// Slack for the fp32 products x * id and q * d (a few ulps of values <= 128 |d|).
constexpr double kFloatSlack = 1e-5;

TEST(QuantQ8_0Test, RoundTripErrorWithinHalfStepPlusScaleRounding) {
  const int64_t n = 32 * 500;
  const auto x = RandomRow(n, 7);
  std::vector<BlockQ8_0> q(n / 32);
  QuantizeRowQ8_0(x.data(), q.data(), n);
  std::vector<float> y(n);
  DequantizeRowQ8_0(q.data(), y.data(), n);
  for (int64_t b = 0; b < n / 32; ++b) {
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[b * 32 + j])));
    const double d = amax / 127;
    // round(x/d) is within 1/2 of x/d, and |q| <= 127.
    const double bound = d * (0.5 + kFloatSlack) + 127 * Fp16Error(d);
    for (int j = 0; j < 32; ++j) {
      const double err = std::fabs(static_cast<double>(y[b * 32 + j]) - x[b * 32 + j]);
      ASSERT_LE(err, bound) << "block " << b << " elem " << j;
    }
  }
}

TEST(QuantQ4_0Test, RoundTripErrorWithinHalfStepExceptTheClampedExtreme) {
  const int64_t n = 32 * 500;
  const auto x = RandomRow(n, 11);
  std::vector<BlockQ4_0> q(n / 32);
  QuantizeRowQ4_0(x.data(), q.data(), n);
  std::vector<float> y(n);
  DequantizeRowQ4_0(q.data(), y.data(), n);
  for (int64_t b = 0; b < n / 32; ++b) {
    double max = 0, amax = 0;
    for (int j = 0; j < 32; ++j) {
      const double v = x[b * 32 + j];
      if (std::fabs(v) > amax) amax = std::fabs(v), max = v;
    }
    const double d = max / -8;  // x/d lies in [-8, 8]
    for (int j = 0; j < 32; ++j) {
      const double r = x[b * 32 + j] / d;
      // q - 8 = round(r) for r < 7.5 (error <= |d|/2); r in [7.5, 8] is clamped to 7 (error <= |d|). |q - 8| <= 8.
      const double step = r < 7.5 - 1e-4 ? 0.5 : 1.0;
      const double bound = std::fabs(d) * (step + kFloatSlack) + 8 * Fp16Error(d);
      const double err = std::fabs(static_cast<double>(y[b * 32 + j]) - x[b * 32 + j]);
      ASSERT_LE(err, bound) << "block " << b << " elem " << j << " r=" << r;
    }
  }
}

TEST(QuantRowTest, DispatchesAndConvertsEachType) {
  const int64_t n = 64;
  const auto x = RandomRow(n, 3);
  std::vector<uint8_t> buf(n * 4);
  std::vector<float> y(n);

  ASSERT_TRUE(QuantizeRow(GgmlType::kF32, x.data(), buf.data(), n).ok());
  ASSERT_TRUE(DequantizeRow(GgmlType::kF32, buf.data(), y.data(), n).ok());
  EXPECT_EQ(std::memcmp(x.data(), y.data(), n * 4), 0);

  ASSERT_TRUE(QuantizeRow(GgmlType::kF16, x.data(), buf.data(), n).ok());
  ASSERT_TRUE(DequantizeRow(GgmlType::kF16, buf.data(), y.data(), n).ok());
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, buf.data() + 2 * i, 2);
    EXPECT_EQ(h, Fp32ToFp16(x[i]));
    EXPECT_EQ(y[i], Fp16ToFp32(h));
    EXPECT_LE(std::fabs(y[i] - x[i]), Fp16Error(x[i]) * 1.0001) << i;
  }

  ASSERT_TRUE(QuantizeRow(GgmlType::kBF16, x.data(), buf.data(), n).ok());
  ASSERT_TRUE(DequantizeRow(GgmlType::kBF16, buf.data(), y.data(), n).ok());
  for (int64_t i = 0; i < n; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) / 256 * 1.0001) << i;

  std::vector<BlockQ8_0> q8(n / 32);
  QuantizeRowQ8_0(x.data(), q8.data(), n);
  ASSERT_TRUE(QuantizeRow(GgmlType::kQ8_0, x.data(), buf.data(), n).ok());
  EXPECT_EQ(std::memcmp(buf.data(), q8.data(), sizeof(BlockQ8_0) * q8.size()), 0);
  std::vector<float> y2(n);
  DequantizeRowQ8_0(q8.data(), y2.data(), n);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ8_0, buf.data(), y.data(), n).ok());
  EXPECT_EQ(y, y2);

  // QuantizeRow's Q4_0 is ggml's reference rounding (the converter calls the error-minimising variant itself).
  std::vector<BlockQ4_0> q4(n / 32);
  QuantizeRowQ4_0(x.data(), q4.data(), n);
  ASSERT_TRUE(QuantizeRow(GgmlType::kQ4_0, x.data(), buf.data(), n).ok());
  EXPECT_EQ(std::memcmp(buf.data(), q4.data(), sizeof(BlockQ4_0) * q4.size()), 0);
  DequantizeRowQ4_0(q4.data(), y2.data(), n);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ4_0, buf.data(), y.data(), n).ok());
  EXPECT_EQ(y, y2);
}

double BlockSquaredError(const float* x, const BlockQ4_0& b) {
  float y[32];
  DequantizeRowQ4_0(&b, y, 32);
  double e = 0;
  for (int j = 0; j < 32; ++j) e += (static_cast<double>(y[j]) - x[j]) * (static_cast<double>(y[j]) - x[j]);
  return e;
}

TEST(QuantQ4_0Test, OptimalNeverWorseThanReferenceAndUsuallyBetter) {
  const int64_t n = 32 * 400;
  const auto x = RandomRow(n, 17);
  std::vector<BlockQ4_0> ref(n / 32), opt(n / 32);
  QuantizeRowQ4_0(x.data(), ref.data(), n);
  QuantizeRowQ4_0Optimal(x.data(), opt.data(), n);
  double total_ref = 0, total_opt = 0;
  for (int64_t b = 0; b < n / 32; ++b) {
    const double er = BlockSquaredError(x.data() + b * 32, ref[b]);
    const double eo = BlockSquaredError(x.data() + b * 32, opt[b]);
    ASSERT_LE(eo, er) << "block " << b;
    total_ref += er;
    total_opt += eo;
  }
  // Gaussian blocks: a searched scale beats max/-8 clearly (llama.cpp reports ~10-20 % lower RMSE).
  EXPECT_LT(total_opt, 0.95 * total_ref);
  // Tiny blocks: the scale is an fp16 subnormal (steps of 2^-24), so its rounding moves the error a lot; a search that
  // compared candidates by their unrounded scale would pick worse codes than the reference here.
  auto tiny = RandomRow(n, 23);
  for (float& v : tiny) v *= 2e-6f;
  QuantizeRowQ4_0(tiny.data(), ref.data(), n);
  QuantizeRowQ4_0Optimal(tiny.data(), opt.data(), n);
  for (int64_t b = 0; b < n / 32; ++b) {
    ASSERT_LE(BlockSquaredError(tiny.data() + b * 32, opt[b]), BlockSquaredError(tiny.data() + b * 32, ref[b]))
        << "tiny block " << b;
  }
  // A zero block stays all zero codes (8) with scale 0 as in the reference.
  float zeros[32] = {};
  BlockQ4_0 z;
  QuantizeRowQ4_0Optimal(zeros, &z, 32);
  for (uint8_t q : z.qs) EXPECT_EQ(q, 0x88);
  EXPECT_EQ(Fp16ToFp32(z.d), 0.0f);
}

TEST(QuantRowTest, RejectsUnsupportedTypesAndPartialBlocks) {
  float x[64] = {};
  uint8_t buf[256];
  Status s = QuantizeRow(GgmlType::kQ4_1, x, buf, 32);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("q4_1"), std::string::npos) << s.message();
  EXPECT_EQ(DequantizeRow(GgmlType::kQ6_K, buf, x, 256).code(), StatusCode::kUnsupported);
  s = QuantizeRow(GgmlType::kQ8_0, x, buf, 33);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("33"), std::string::npos) << s.message();
  EXPECT_EQ(DequantizeRow(GgmlType::kQ4_0, buf, x, 48).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeRow(GgmlType::kF16, x, buf, -1).code(), StatusCode::kInvalidArgument);
  // Element types have block size 1: any length works.
  EXPECT_TRUE(QuantizeRow(GgmlType::kF32, x, buf, 7).ok());
}

}  // namespace
}  // namespace nflash
