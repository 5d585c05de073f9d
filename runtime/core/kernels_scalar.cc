// Portable scalar kernels: the fallback on CPUs without AVX2 and the baseline the AVX2 path is tested against.
#include <array>
#include <cstring>

#include "runtime/core/float16.h"
#include "runtime/core/kernels_internal.h"

namespace nflash::internal {
namespace {

// fp16 -> fp32 by table: Fp16ToFp32 branches per element, which makes F16 rows several times slower. 256 KiB,
// built once on first use (thread-safe static initialization).
const float* Fp16Table() {
  static const std::array<float, 65536>* table = [] {
    auto* t = new std::array<float, 65536>;
    for (uint32_t h = 0; h < 65536; ++h) (*t)[h] = Fp16ToFp32(static_cast<uint16_t>(h));
    return t;
  }();
  return table->data();
}

// Element c of a float-like row.
inline float LoadElem(GgmlType type, const uint8_t* row, int64_t c, const float* f16) {
  switch (type) {
    case GgmlType::kF32: {
      float v;
      std::memcpy(&v, row + 4 * c, 4);
      return v;
    }
    case GgmlType::kF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * c, 2);
      return f16[h];
    }
    default: {  // kBF16
      uint16_t b;
      std::memcpy(&b, row + 2 * c, 2);
      return Bf16ToFp32(b);
    }
  }
}

// Eight partial sums (lane c % 8, like the AVX2 path) keep the error growth at cols/8 instead of cols.
float DotFloat(GgmlType type, const uint8_t* row, const float* x, int64_t cols, const float* f16) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += LoadElem(type, row, c + l, f16) * x[c + l];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; c < cols; ++c) s += LoadElem(type, row, c, f16) * x[c];
  return s;
}

// As ggml_vec_dot_q8_0_q8_0: exact integer dot per block, scaled by d_w * d_x.
float DotQ8_0(const uint8_t* row, const BlockQ8_0* x, int64_t nb, const float* f16) {
  const auto* w = reinterpret_cast<const BlockQ8_0*>(row);
  float s = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < kQBlock; ++j) sumi += static_cast<int>(w[b].qs[j]) * static_cast<int>(x[b].qs[j]);
    s += static_cast<float>(sumi) * (f16[w[b].d] * f16[x[b].d]);
  }
  return s;
}

// As ggml_vec_dot_q4_0_q8_0: nibble j is element j, nibble j+16 the high half.
float DotQ4_0(const uint8_t* row, const BlockQ8_0* x, int64_t nb, const float* f16) {
  const auto* w = reinterpret_cast<const BlockQ4_0*>(row);
  float s = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int sumi = 0;
    for (int j = 0; j < kQBlock / 2; ++j) {
      const int lo = (w[b].qs[j] & 0x0f) - 8;
      const int hi = (w[b].qs[j] >> 4) - 8;
      sumi += lo * x[b].qs[j] + hi * x[b].qs[j + kQBlock / 2];
    }
    s += static_cast<float>(sumi) * (f16[w[b].d] * f16[x[b].d]);
  }
  return s;
}

void DotRowsScalar(GgmlType type, const RowSet& rows, int64_t begin, int64_t end, const TokenSet& x, float* y,
                   int64_t y_stride) {
  const float* f16 = Fp16Table();
  const int64_t nb = x.cols / kQBlock;
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* row = rows.Row(i);
    for (int64_t t = 0; t < x.n; ++t) {
      float v;
      switch (type) {
        case GgmlType::kQ8_0:
          v = DotQ8_0(row, x.q8 + t * nb, nb, f16);
          break;
        case GgmlType::kQ4_0:
          v = DotQ4_0(row, x.q8 + t * nb, nb, f16);
          break;
        default:
          v = DotFloat(type, row, x.f32 + t * x.cols, x.cols, f16);
          break;
      }
      y[t * y_stride + i] = v;
    }
  }
}

void AccumulateScalar(GgmlType type, const RowSet& rows, int64_t count, const float* a, int64_t c0, int64_t c1,
                      float* y) {
  const float* f16 = Fp16Table();
  for (int64_t k = 0; k < count; ++k) {
    const uint8_t* row = rows.Row(k);
    const float ak = a[k];
    if (type == GgmlType::kQ8_0) {
      const auto* w = reinterpret_cast<const BlockQ8_0*>(row);
      for (int64_t b = c0 / kQBlock; b < c1 / kQBlock; ++b) {
        const float s = ak * f16[w[b].d];
        float* yb = y + b * kQBlock;
        for (int j = 0; j < kQBlock; ++j) yb[j] += s * static_cast<float>(w[b].qs[j]);
      }
    } else if (type == GgmlType::kQ4_0) {
      const auto* w = reinterpret_cast<const BlockQ4_0*>(row);
      for (int64_t b = c0 / kQBlock; b < c1 / kQBlock; ++b) {
        const float s = ak * f16[w[b].d];
        float* yb = y + b * kQBlock;
        for (int j = 0; j < kQBlock / 2; ++j) {
          yb[j] += s * static_cast<float>((w[b].qs[j] & 0x0f) - 8);
          yb[j + kQBlock / 2] += s * static_cast<float>((w[b].qs[j] >> 4) - 8);
        }
      }
    } else {
      for (int64_t c = c0; c < c1; ++c) y[c] += ak * LoadElem(type, row, c, f16);
    }
  }
}

}  // namespace

const IsaKernels kScalarKernels = {DotRowsScalar, AccumulateScalar, QuantizeRowQ8_0};

}  // namespace nflash::internal
