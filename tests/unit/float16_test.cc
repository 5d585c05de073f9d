// Tests of the fp16/bf16 conversions: exhaustive fp16 decoding against the IEEE formula, round trips, and
// round-to-nearest-even / overflow / subnormal cases worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "runtime/core/float16.h"

namespace nflash {
namespace {

bool IsFp16Nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// IEEE 754 binary16 value from its fields, computed in double (independent of the code under test).
double Fp16Formula(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 31) return sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  return sign * std::ldexp(1.0 + mant / 1024.0, exp - 15);
}

TEST(Float16Test, DecodesEveryValueAsTheIeeeFormula) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    if (IsFp16Nan(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), Fp16Formula(static_cast<uint16_t>(h))) << std::hex << h;
    if (h == 0x8000) {
      EXPECT_TRUE(std::signbit(f)) << "negative zero keeps its sign";
    }
  }
}

TEST(Float16Test, EveryValueRoundTripsThroughFp32) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = Fp32ToFp16(Fp16ToFp32(static_cast<uint16_t>(h)));
    if (IsFp16Nan(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(IsFp16Nan(back)) << std::hex << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(Float16Test, RoundsToNearestEvenOnHandPickedCases) {
  struct Case {
    float in;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      // 1 + 2^-11 is halfway between 1 (mantissa 0, even) and 1 + 2^-10: goes to the even one.
      {1.0f + 0x1p-11f, 0x3c00},
      // 1 + 3*2^-11 is halfway between 0x3c01 (odd) and 0x3c02 (even).
      {1.0f + 3 * 0x1p-11f, 0x3c02},
      // Just above the halfway point rounds up.
      {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},
      // Just below the next halfway point rounds down.
      {1.0f + 3 * 0x1p-11f - 0x1p-20f, 0x3c01},
      {65504.0f, 0x7bff},      // largest finite fp16
      {65519.0f, 0x7bff},      // below the halfway point to 65536
      {65520.0f, 0x7c00},      // halfway to 65536; the even neighbour is the overflow: inf
      {-65520.0f, 0xfc00},
      {1e10f, 0x7c00},
      {-1e10f, 0xfc00},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      // Subnormals: the unit is 2^-24.
      {0x1p-24f, 0x0001},
      {0x1p-25f, 0x0000},                // halfway between 0 and 2^-24: to even (0)
      {3 * 0x1p-25f, 0x0002},            // halfway between 1 and 2 units: to even (2)
      {0x1p-25f + 0x1p-30f, 0x0001},     // just above halfway
      {1023 * 0x1p-24f, 0x03ff},         // largest subnormal
      {0x1p-14f, 0x0400},                // smallest normal
      {0x1p-14f - 0x1p-25f, 0x0400},     // halfway between 0x03ff (odd) and 0x0400 (even)
      {0x1p-30f, 0x0000},                // underflow to zero
      {-0x1p-30f, 0x8000},               // keeps the sign
      {-0x1p-24f, 0x8001},
  };
  for (const Case& c : cases) EXPECT_EQ(Fp32ToFp16(c.in), c.want) << c.in;
  EXPECT_TRUE(IsFp16Nan(Fp32ToFp16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsFp16Nan(Fp32ToFp16(-std::numeric_limits<float>::quiet_NaN())));
}

// Nearest fp16 by search over the ordered positive encodings, ties to the even encoding (independent reference).
uint16_t NearestFp16(float f) {
  const double a = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (a >= 65520.0) return sign | 0x7c00;
  // Positive finite encodings 0x0000..0x7bff increase with their value.
  uint32_t lo = 0, hi = 0x7bff;
  while (lo < hi) {  // first encoding whose value is >= a
    const uint32_t mid = (lo + hi) / 2;
    if (Fp16Formula(static_cast<uint16_t>(mid)) < a) lo = mid + 1; else hi = mid;
  }
  uint32_t best = lo;
  if (lo > 0) {
    const double up = Fp16Formula(static_cast<uint16_t>(lo)) - a;
    const double down = a - Fp16Formula(static_cast<uint16_t>(lo - 1));
    if (down < up || (down == up && ((lo - 1) & 1) == 0)) best = lo - 1;
  }
  return sign | static_cast<uint16_t>(best);
}

TEST(Float16Test, RandomFloatsRoundLikeTheNearestSearch) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> exp_dist(-28.0f, 17.0f);
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(unit(rng), static_cast<int>(exp_dist(rng)));
    if (i & 1) f = -f;
    ASSERT_EQ(Fp32ToFp16(f), NearestFp16(f)) << f;
  }
  // Every exact halfway point between adjacent positive fp16 values (all are representable in fp32).
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double mid = (Fp16Formula(static_cast<uint16_t>(h)) + Fp16Formula(static_cast<uint16_t>(h + 1))) / 2;
    const float f = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(f), mid);
    ASSERT_EQ(Fp32ToFp16(f), (h & 1) == 0 ? h : h + 1) << "tie above " << std::hex << h;
  }
}

TEST(Bfloat16Test, EveryValueRoundTripsAndDecodesAsTheHighHalf) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16ToFp32(static_cast<uint16_t>(b));
    EXPECT_EQ(FloatToBits(f), b << 16);
    const bool nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
    const uint16_t back = Fp32ToBf16(f);
    if (nan) {
      EXPECT_TRUE(std::isnan(Bf16ToFp32(back))) << std::hex << b;
    } else {
      ASSERT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(Bfloat16Test, RoundsToNearestEven) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Fp32ToBf16(1.0f + 0x1p-8f), 0x3f80);                // halfway, to even
  EXPECT_EQ(Fp32ToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);            // halfway, to even (up)
  EXPECT_EQ(Fp32ToBf16(1.0f + 0x1p-8f + 0x1p-16f), 0x3f81);     // above halfway
  EXPECT_EQ(Fp32ToBf16(-1.0f - 0x1p-8f - 0x1p-16f), 0xbf81);
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  const uint16_t nan = Fp32ToBf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(Bf16ToFp32(nan)));
  // A signalling-looking NaN whose payload lives only in the low 16 bits must not collapse to inf.
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(BitsToFloat(0x7f800001u)))));
}

}  // namespace
}  // namespace nflash
