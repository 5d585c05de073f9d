// IEEE half and bfloat16 conversions, bit-exact with ggml's scalar reference (round to nearest even, NaN kept).
#pragma once

#include <cstdint>
#include <cstring>

namespace nflash {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// fp16 -> fp32, exact for every input (normals, subnormals, inf, NaN).
inline float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // subnormal: mant * 2^-24
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

// fp32 -> fp16 with round-to-nearest-even; overflow gives inf, NaN stays NaN.
inline uint16_t Fp32ToFp16(float f) {
  const uint32_t x = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest fp16 normal (2^-14): subnormal or zero
    // value * 2^24 rounded to nearest even is the subnormal mantissa.
    const float v = BitsToFloat(abs) * 16777216.0f;
    // v < 1024; nearbyint under the default rounding mode rounds half to even.
    float r = v + 8388608.0f;  // 2^23: forces rounding to an integer in the mantissa (ties to even)
    r -= 8388608.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits, ties to even (carry may bump the exponent: correct).
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((m - 0x38000000u) >> 13));
}

inline float Bf16ToFp32(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest even, NaN kept quiet (as ggml_compute_fp32_to_bf16).
inline uint16_t Fp32ToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64);
  return static_cast<uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

}  // namespace nflash
