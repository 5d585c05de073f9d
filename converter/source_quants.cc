// Dequantization of the source-only ggml block types (see source_quants.h), written from ggml's block layouts.
#include "converter/source_quants.h"

#include <cstring>
#include <string>

#include "runtime/core/float16.h"
#include "runtime/core/quant.h"

namespace nflash::converter {
namespace {

constexpr int kQK = 32;    // values per block of the legacy types
constexpr int kQKK = 256;  // values per K-quant super-block

uint16_t U16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float Half(const uint8_t* p) { return Fp16ToFp32(U16(p)); }

// Q4_1: {f16 d, f16 m, u8 qs[16]}: value j = d * nibble + m, low nibbles the first 16 values, high ones the next.
void Q4_1(const uint8_t* b, float* y) {
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
    y[j + kQK / 2] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

// Q5_0 {f16 d, u8 qh[4], u8 qs[16]} and Q5_1 {f16 d, f16 m, u8 qh[4], u8 qs[16]}: value j's fifth bit is bit j of the
// little-endian u32 qh; Q5_0 = d * (q - 16), Q5_1 = d * q + m.
void Q5(const uint8_t* b, float* y, bool with_min) {
  const float d = Half(b), m = with_min ? Half(b + 2) : 0.0f;
  const uint8_t* p = b + (with_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* qs = p + 4;
  const int offset = with_min ? 0 : 16;
  for (int j = 0; j < kQK / 2; ++j) {
    const int lo = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
    y[j] = d * static_cast<float>(lo - offset) + m;
    y[j + kQK / 2] = d * static_cast<float>(hi - offset) + m;
  }
}

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j (0..7) from their 12 packed bytes.
void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q2_K: {u8 scales[16], u8 qs[64], f16 d, f16 dmin}; 16 sub-blocks of 16 values, scale = d * (s & 15), min = dmin *
// (s >> 4); 2-bit quants, four to a byte: byte l of each 32-byte half holds values at shifts 0, 2, 4, 6 of groups 32
// apart.
void Q2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = Half(b + 80), dmin = Half(b + 82);
  int is = 0;
  for (int n = 0; n < kQKK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t s = scales[is++];
        const float dl = d * static_cast<float>(s & 0x0F), ml = dmin * static_cast<float>(s >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[l + 16 * half] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}

// Q3_K: {u8 hmask[32], u8 qs[64], u8 scales[12], f16 d}; 16 signed 6-bit scales (packed: low 4 bits in bytes 0..7,
// high 2 bits in bytes 8..11), value = d * (scale - 32) * (q2 - (high bit clear ? 4 : 0)).
void Q3_K(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 96;
  const float d = Half(b + 108);
  int scales[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? packed[i] & 0x0F : packed[i - 8] >> 4;
    const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    scales[i] = (low | (high << 4)) - 32;
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < kQKK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(scales[is++]);
        for (int l = 0; l < 16; ++l) {
          const int k = l + 16 * half;
          const int v = ((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// Q4_K {f16 d, f16 dmin, u8 scales[12], u8 qs[128]} and Q5_K {..., u8 qh[32], u8 qs[128]}: 8 sub-blocks of 32 with
// 6-bit scales and mins (ScaleMinK4); each 32 bytes of qs hold two sub-blocks (low nibbles, then high); Q5_K's fifth
// bits are bit 2i (low) and 2i + 1 (high) of qh for the i-th pair of sub-blocks. value = d * sc * q - dmin * m.
void Q45_K(const uint8_t* b, float* y, bool five) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + (five ? 48 : 16);
  for (int pair = 0; pair < 4; ++pair) {
    for (int half = 0; half < 2; ++half) {
      int sc, m;
      ScaleMinK4(2 * pair + half, scales, &sc, &m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        int v = half ? q[l] >> 4 : q[l] & 0x0F;
        if (five && ((qh[l] >> (2 * pair + half)) & 1)) v += 16;
        *y++ = dl * static_cast<float>(v) - ml;
      }
    }
    q += 32;
  }
}

// Q6_K: {u8 ql[128], u8 qh[64], i8 scales[16], f16 d}; 16 sub-blocks of 16 with signed 8-bit scales; a 6-bit quant is
// a nibble of ql and two bits of qh, minus 32. Per 128 values: ql bytes l and l + 32 (low, then high nibbles), qh
// byte l at shifts 0, 2, 4, 6 for the four groups of 32.
void Q6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int n = 0; n < kQKK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

}  // namespace

bool IsSourceOnlyType(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

Status DequantizeSourceRow(GgmlType type, const uint8_t* src, float* y, int64_t n) {
  if (!IsSourceOnlyType(type)) return DequantizeRow(type, src, y, n);
  const GgmlTypeInfo& info = TypeInfo(type);
  if (n < 0 || n % info.block_size != 0) {
    return Status::InvalidArgument("a row of " + std::to_string(n) + " values is not a whole number of " +
                                   std::string(info.name) + " blocks (" + std::to_string(info.block_size) + ")");
  }
  const int64_t blocks = n / info.block_size;
  for (int64_t i = 0; i < blocks; ++i, src += info.type_size, y += info.block_size) {
    switch (type) {
      case GgmlType::kQ4_1: Q4_1(src, y); break;
      case GgmlType::kQ5_0: Q5(src, y, false); break;
      case GgmlType::kQ5_1: Q5(src, y, true); break;
      case GgmlType::kQ2_K: Q2_K(src, y); break;
      case GgmlType::kQ3_K: Q3_K(src, y); break;
      case GgmlType::kQ4_K: Q45_K(src, y, false); break;
      case GgmlType::kQ5_K: Q45_K(src, y, true); break;
      case GgmlType::kQ6_K: Q6_K(src, y); break;
      default: break;
    }
  }
  return Status::Ok();
}

}  // namespace nflash::converter
