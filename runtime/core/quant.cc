// Reference quantizers and row conversions, bit-identical to ggml's quantize_row_*_ref / dequantize_row_*.
#include "runtime/core/quant.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "runtime/core/float16.h"

namespace nflash {

void QuantizeRowQ8_0(const float* x, BlockQ8_0* y, int64_t n) {
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * kQBlock;
    float amax = 0.0f;
    for (int j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    // ggml computes the quants with the fp32 d (not the fp16-rounded one it stores).
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = Fp32ToFp16(d);
    for (int j = 0; j < kQBlock; ++j) y[i].qs[j] = static_cast<int8_t>(std::round(xb[j] * id));
  }
}

void QuantizeRowQ4_0(const float* x, BlockQ4_0* y, int64_t n) {
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * kQBlock;
    float amax = 0.0f;
    float max = 0.0f;  // the signed value with the largest magnitude (first one on ties, as ggml)
    for (int j = 0; j < kQBlock; ++j) {
      if (amax < std::fabs(xb[j])) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = Fp32ToFp16(d);
    for (int j = 0; j < kQBlock / 2; ++j) {
      // x*id lies in [-8, 8]; +8.5 then truncation rounds to nearest, and 16 (the opposite extreme) clamps to 15.
      const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(xb[j] * id + 8.5f)));
      const int q1 = std::min(15, static_cast<int>(static_cast<int8_t>(xb[j + kQBlock / 2] * id + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

void QuantizeRowQ4_0Optimal(const float* x, BlockQ4_0* y, int64_t n) {
  // Start from ggml's rounding (so the result can only improve on it), then search nearby inverse scales. The squared
  // error of codes l with scale d is sum(x^2) - 2 d sum(x l) + d^2 sum(l^2), evaluated with d rounded to fp16.
  QuantizeRowQ4_0(x, y, n);
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * kQBlock;
    double sum_xx = 0, ref_xl = 0, ref_ll = 0;
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < kQBlock; ++j) {
      const int q = (j < kQBlock / 2 ? (y[i].qs[j] & 0x0f) : (y[i].qs[j - kQBlock / 2] >> 4)) - 8;
      sum_xx += static_cast<double>(xb[j]) * xb[j];
      ref_xl += static_cast<double>(xb[j]) * q;
      ref_ll += static_cast<double>(q) * q;
      if (amax < std::fabs(xb[j])) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    if (amax == 0.0f) continue;
    const double d_ref = Fp16ToFp32(y[i].d);
    double best = sum_xx - 2 * d_ref * ref_xl + d_ref * d_ref * ref_ll;
    for (int step = -9; step <= 9; ++step) {
      // Inverse scale mapping `max` to -(8 + step/10): rounding boundaries move, the clamp keeps codes in -8..7.
      const float iscale = -(8.0f + 0.1f * static_cast<float>(step)) / max;
      // Float sums and branch-free rounding (adding 1.5 * 2^23 rounds to nearest even for |v| < 2^22) let the
      // compiler vectorise this loop; it runs 19 times per block, so it dominates conversion time.
      // Eight independent partial sums, so no reassociation is needed to vectorise.
      float lq[kQBlock];
      float pxl[8] = {}, pll[8] = {};
      for (int j0 = 0; j0 < kQBlock; j0 += 8) {
        for (int k = 0; k < 8; ++k) {
          const float r = (iscale * xb[j0 + k] + 12582912.0f) - 12582912.0f;
          const float q = r < -8.0f ? -8.0f : (r > 7.0f ? 7.0f : r);
          lq[j0 + k] = q;
          pxl[k] += xb[j0 + k] * q;
          pll[k] += q * q;
        }
      }
      double sum_xl = 0, sum_ll = 0;
      for (int k = 0; k < 8; ++k) {
        sum_xl += pxl[k];
        sum_ll += pll[k];
      }
      if (sum_ll == 0) continue;
      const uint16_t d16 = Fp32ToFp16(static_cast<float>(sum_xl / sum_ll));  // least-squares scale for these codes
      const double d = Fp16ToFp32(d16);
      const double e = sum_xx - 2 * d * sum_xl + d * d * sum_ll;
      if (e < best) {
        best = e;
        y[i].d = d16;
        for (int j = 0; j < kQBlock / 2; ++j) {
          const int lo = static_cast<int>(lq[j]) + 8, hi = static_cast<int>(lq[j + kQBlock / 2]) + 8;
          y[i].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
    }
  }
}

void DequantizeRowQ8_0(const BlockQ8_0* x, float* y, int64_t n) {
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = Fp16ToFp32(x[i].d);
    for (int j = 0; j < kQBlock; ++j) y[i * kQBlock + j] = static_cast<float>(x[i].qs[j]) * d;
  }
}

void DequantizeRowQ4_0(const BlockQ4_0* x, float* y, int64_t n) {
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float d = Fp16ToFp32(x[i].d);
    for (int j = 0; j < kQBlock / 2; ++j) {
      const int q0 = (x[i].qs[j] & 0x0f) - 8;
      const int q1 = (x[i].qs[j] >> 4) - 8;
      y[i * kQBlock + j] = static_cast<float>(q0) * d;
      y[i * kQBlock + j + kQBlock / 2] = static_cast<float>(q1) * d;
    }
  }
}

namespace {

Status CheckRowLength(GgmlType type, int64_t n, const char* what) {
  if (n < 0) {
    return Status::InvalidArgument(std::string(what) + ": negative row length " + std::to_string(n));
  }
  const uint32_t block = TypeInfo(type).block_size;
  if (n % block != 0) {
    return Status::InvalidArgument(std::string(what) + ": row of " + std::to_string(n) + " elements is not a multiple of " +
                                   std::to_string(block) + " (block size of " + std::string(GgmlTypeName(type)) + ")");
  }
  return Status::Ok();
}

}  // namespace

GgmlType ColumnType(GgmlType row_type, int64_t column_len) {
  switch (row_type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return row_type;
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
      return column_len % kQBlock == 0 ? row_type : GgmlType::kF32;
    default:
      return GgmlType::kF32;  // callers reject unknown row types before this matters
  }
}

bool IsRowType(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
      return true;
    default:
      return false;
  }
}

Status QuantizeRow(GgmlType type, const float* x, void* dst, int64_t n) {
  if (!IsRowType(type)) {
    return Status::Unsupported("QuantizeRow: type " + std::string(GgmlTypeName(type)) +
                               " is not supported (expected f32, f16, bf16, q8_0 or q4_0)");
  }
  NF_RETURN_IF_ERROR(CheckRowLength(type, n, "QuantizeRow"));
  switch (type) {
    case GgmlType::kF32:
      std::copy(x, x + n, static_cast<float*>(dst));
      break;
    case GgmlType::kF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = Fp32ToFp16(x[i]);
      break;
    }
    case GgmlType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = Fp32ToBf16(x[i]);
      break;
    }
    case GgmlType::kQ8_0:
      QuantizeRowQ8_0(x, static_cast<BlockQ8_0*>(dst), n);
      break;
    case GgmlType::kQ4_0:
      QuantizeRowQ4_0(x, static_cast<BlockQ4_0*>(dst), n);
      break;
    default:
      break;
  }
  return Status::Ok();
}

Status DequantizeRow(GgmlType type, const void* src, float* y, int64_t n) {
  if (!IsRowType(type)) {
    return Status::Unsupported("DequantizeRow: type " + std::string(GgmlTypeName(type)) +
                               " is not supported (expected f32, f16, bf16, q8_0 or q4_0)");
  }
  NF_RETURN_IF_ERROR(CheckRowLength(type, n, "DequantizeRow"));
  switch (type) {
    case GgmlType::kF32: {
      const auto* in = static_cast<const float*>(src);
      std::copy(in, in + n, y);
      break;
    }
    case GgmlType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = Fp16ToFp32(in[i]);
      break;
    }
    case GgmlType::kBF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = Bf16ToFp32(in[i]);
      break;
    }
    case GgmlType::kQ8_0:
      DequantizeRowQ8_0(static_cast<const BlockQ8_0*>(src), y, n);
      break;
    case GgmlType::kQ4_0:
      DequantizeRowQ4_0(static_cast<const BlockQ4_0*>(src), y, n);
      break;
    default:
      break;
  }
  return Status::Ok();
}

}  // namespace nflash
