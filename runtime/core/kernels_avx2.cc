// AVX2 + FMA + F16C kernels (this file alone is compiled with -mavx2 -mfma -mf16c; kernels.cc calls it only on CPUs
// that have all three). Quantized dots use the maddubs trick: |w| (unsigned) times sign-adjusted x gives exact int16
// pair sums, widened to int32 by madd with ones.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/core/float16.h"
#include "runtime/core/kernels_internal.h"

namespace nflash::internal {
namespace {

// Rows per micro-tile: 4 independent accumulator chains hide the FMA latency and share each activation load.
constexpr int kTileRows = 4;
// Tokens per micro-tile in Gemm: with 4 rows that is 8 accumulators plus 4 unpacked weight blocks, which fits the
// 16 ymm registers; each unpacked weight block is reused for 2 tokens.
constexpr int kTileTokens = 2;
// Rows per cache block in Gemm: 16 rows of a 4096-wide Q4_0 matrix are 36 KiB, so they stay in L1/L2 while every
// token tile streams past them; each weight row thus comes from DRAM once per Gemm call.
constexpr int64_t kBlockRows = 16;

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 consecutive elements of a float-like row, starting at element c.
template <GgmlType kType>
inline __m256 Load8(const uint8_t* row, int64_t c) {
  if constexpr (kType == GgmlType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c);
  } else if constexpr (kType == GgmlType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
  } else {  // kBF16: the 16 bits are the high half of an fp32
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

template <GgmlType kType>
inline float Load1(const uint8_t* row, int64_t c) {
  if constexpr (kType == GgmlType::kF32) {
    float v;
    std::memcpy(&v, row + 4 * c, 4);
    return v;
  } else if constexpr (kType == GgmlType::kF16) {
    return HalfToFloat(row + 2 * c);
  } else {
    uint16_t b;
    std::memcpy(&b, row + 2 * c, 2);
    return Bf16ToFp32(b);
  }
}

// Q4_0 block b as 32 unsigned nibble values 0..15 in element order (low nibbles are elements 0..15, high nibbles
// 16..31): the 16 bytes go to both 128-bit lanes and the high lane is shifted right by 4 before masking.
inline __m256i LoadQ4Nibbles(const uint8_t* blk) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
  const __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
}

// Block b of a quantized row as 32 signed bytes (element order) and its scale.
template <GgmlType kType>
inline __m256i LoadQuantBlock(const uint8_t* row, int64_t b, float* d) {
  if constexpr (kType == GgmlType::kQ8_0) {
    const uint8_t* blk = row + b * sizeof(BlockQ8_0);
    *d = HalfToFloat(blk);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const uint8_t* blk = row + b * sizeof(BlockQ4_0);
    *d = HalfToFloat(blk);
    return _mm256_sub_epi8(LoadQ4Nibbles(blk), _mm256_set1_epi8(8));
  }
}

// Exact int32 lanes whose sum is w . x for 32 signed bytes each. |w| <= 128 read unsigned and |x| <= 127 (Q8_0 of
// an activation never holds -128), so each int16 pair sum is at most 2 * 128 * 127 < 32767: no saturation.
inline __m256i DotI8(__m256i w, __m256i x) {
  const __m256i ax = _mm256_sign_epi8(w, w);
  const __m256i sx = _mm256_sign_epi8(x, w);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sx), _mm256_set1_epi16(1));
}

// y[t * y_stride + r] = row r . token t for R rows and T tokens. Every (r, t) pair goes through the same operation
// sequence whatever R and T are, so tiles and tails give identical values.
template <GgmlType kType, int R, int T>
inline void FloatTile(const uint8_t* const* rows, const float* x, int64_t cols, float* y, int64_t y_stride) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = Load8<kType>(rows[r], c);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * cols + c);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float s = HSum(acc[r][t]);
      for (int64_t cc = c; cc < cols; ++cc) s += Load1<kType>(rows[r], cc) * x[t * cols + cc];
      y[t * y_stride + r] = s;
    }
  }
}

// Q8_0 rows use DotI8 on signed weights. Q4_0 rows skip the sign work: maddubs takes the unsigned nibbles u = w + 8
// directly and 8 * x is subtracted per lane, (u - 8) . x = u . x - 8 . x, computed once per token and block and
// shared by the R rows. Both give the same exact int32 lanes.
//
// `prefetch` (R rows, or nullptr) are the rows of the next tile: short quantized rows (2304 bytes for 4096 Q4_0
// columns) end before the hardware prefetcher has ramped up on them, so each block step also prefetches the same
// offset in the next rows, one tile (~9 KiB) ahead. That is the difference between ~7 and ~20 GB/s per core.
template <GgmlType kType, int R, int T>
inline void QuantTile(const uint8_t* const* rows, const BlockQ8_0* x, int64_t nb, float* y, int64_t y_stride,
                      const uint8_t* const* prefetch) {
  constexpr size_t kBlockBytes = kType == GgmlType::kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
  // Prefetch every block for Q8_0 (34 bytes), every second one for Q4_0 (36 bytes): under 64 bytes per step, so
  // every cache line of the next rows is touched.
  constexpr int64_t kPrefetchMask = kType == GgmlType::kQ8_0 ? 0 : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch != nullptr && (b & kPrefetchMask) == 0) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(prefetch[r] + b * kBlockBytes), _MM_HINT_T0);
    }
    __m256i w[R];
    float dw[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * kBlockBytes;
      dw[r] = HalfToFloat(blk);
      if constexpr (kType == GgmlType::kQ8_0) {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      } else {
        w[r] = LoadQ4Nibbles(blk);
      }
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8_0& xb = x[t * nb + b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      const float dx = _cvtsh_ss(xb.d);
      [[maybe_unused]] __m256i corr;
      if constexpr (kType == GgmlType::kQ4_0) {
        corr = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xq), ones);
      }
      for (int r = 0; r < R; ++r) {
        __m256i dot;
        if constexpr (kType == GgmlType::kQ8_0) {
          dot = DotI8(w[r], xq);
        } else {
          // |x| <= 127 and u <= 15: pair sums <= 3810, no saturation.
          dot = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xq), ones), corr);
        }
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dw[r] * dx), _mm256_cvtepi32_ps(dot), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = HSum(acc[r][t]);
}

template <GgmlType kType, int R, int T>
inline void Tile(const uint8_t* const* rows, const TokenSet& x, int64_t t0, float* y, int64_t y_stride,
                 const uint8_t* const* prefetch) {
  if constexpr (kType == GgmlType::kQ8_0 || kType == GgmlType::kQ4_0) {
    const int64_t nb = x.cols / kQBlock;
    QuantTile<kType, R, T>(rows, x.q8 + t0 * nb, nb, y + t0 * y_stride, y_stride, prefetch);
  } else {
    FloatTile<kType, R, T>(rows, x.f32 + t0 * x.cols, x.cols, y + t0 * y_stride, y_stride);
  }
}

// Rows [i0, i1) against tokens [t0, t0 + T). The first token tile prefetches the next row tile; later token tiles
// find the rows in cache.
template <GgmlType kType, int T>
void RowsAgainstTokens(const RowSet& rs, int64_t i0, int64_t i1, const TokenSet& x, int64_t t0, float* y,
                       int64_t y_stride) {
  int64_t i = i0;
  const uint8_t* rows[kTileRows];
  const uint8_t* next[kTileRows];
  if (i + kTileRows <= i1) {
    for (int r = 0; r < kTileRows; ++r) next[r] = rs.Row(i + r);
  }
  for (; i + kTileRows <= i1; i += kTileRows) {
    for (int r = 0; r < kTileRows; ++r) rows[r] = next[r];
    const bool has_next = i + 2 * kTileRows <= i1;
    if (has_next) {
      for (int r = 0; r < kTileRows; ++r) next[r] = rs.Row(i + kTileRows + r);
    }
    Tile<kType, kTileRows, T>(rows, x, t0, y + i, y_stride, has_next && t0 == 0 ? next : nullptr);
  }
  for (; i < i1; ++i) {
    const uint8_t* row = rs.Row(i);
    Tile<kType, 1, T>(&row, x, t0, y + i, y_stride, nullptr);
  }
}

template <GgmlType kType>
void DotRowsT(const RowSet& rs, int64_t begin, int64_t end, const TokenSet& x, float* y, int64_t y_stride) {
  if (x.n == 1) {
    RowsAgainstTokens<kType, 1>(rs, begin, end, x, 0, y, y_stride);
    return;
  }
  for (int64_t i0 = begin; i0 < end; i0 += kBlockRows) {
    const int64_t i1 = std::min(end, i0 + kBlockRows);
    int64_t t = 0;
    for (; t + kTileTokens <= x.n; t += kTileTokens) RowsAgainstTokens<kType, kTileTokens>(rs, i0, i1, x, t, y, y_stride);
    for (; t < x.n; ++t) RowsAgainstTokens<kType, 1>(rs, i0, i1, x, t, y, y_stride);
  }
}

void DotRowsAvx2(GgmlType type, const RowSet& rows, int64_t begin, int64_t end, const TokenSet& x, float* y,
                 int64_t y_stride) {
  switch (type) {
    case GgmlType::kF32:
      return DotRowsT<GgmlType::kF32>(rows, begin, end, x, y, y_stride);
    case GgmlType::kF16:
      return DotRowsT<GgmlType::kF16>(rows, begin, end, x, y, y_stride);
    case GgmlType::kBF16:
      return DotRowsT<GgmlType::kBF16>(rows, begin, end, x, y, y_stride);
    case GgmlType::kQ8_0:
      return DotRowsT<GgmlType::kQ8_0>(rows, begin, end, x, y, y_stride);
    case GgmlType::kQ4_0:
      return DotRowsT<GgmlType::kQ4_0>(rows, begin, end, x, y, y_stride);
    default:
      return;  // kernels.cc validated the type
  }
}

// Rows accumulated per pass over y: y stays in registers for 4 rows, and the per-element order is still k-sequential.
constexpr int kAccumRows = 4;

// Bytes of a row that hold columns [c0, c1).
template <GgmlType kType>
inline void ByteRange(int64_t c0, int64_t c1, int64_t* begin, int64_t* end) {
  if constexpr (kType == GgmlType::kQ8_0 || kType == GgmlType::kQ4_0) {
    constexpr int64_t kBlockBytes = kType == GgmlType::kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);
    *begin = c0 / kQBlock * kBlockBytes;
    *end = (c1 + kQBlock - 1) / kQBlock * kBlockBytes;
  } else {
    constexpr int64_t kElemBytes = kType == GgmlType::kF32 ? 4 : 2;
    *begin = c0 * kElemBytes;
    *end = c1 * kElemBytes;
  }
}

// Prefetch of the next group's part of its rows while this group is computed: the selected rows are scattered,
// and this thread reads only a slice of each, too short for the hardware prefetcher to ramp up. Float rows are
// long enough for it once started, so only their first lines are prefetched.
constexpr int64_t kFloatPrefetchBytes = 512;

template <GgmlType kType>
void AccumulateT(const RowSet& rs, int64_t count, const float* a, int64_t c0, int64_t c1, float* y) {
  int64_t byte_begin, byte_end;
  ByteRange<kType>(c0, c1, &byte_begin, &byte_end);
  if constexpr (!(kType == GgmlType::kQ8_0 || kType == GgmlType::kQ4_0)) {
    byte_end = std::min(byte_end, byte_begin + kFloatPrefetchBytes);
  }
  for (int64_t k0 = 0; k0 < count; k0 += kAccumRows) {
    const int g = static_cast<int>(std::min<int64_t>(kAccumRows, count - k0));
    const uint8_t* rows[kAccumRows];
    for (int r = 0; r < g; ++r) rows[r] = rs.Row(k0 + r);
    for (int64_t k = k0 + kAccumRows; k < std::min(count, k0 + 2 * kAccumRows); ++k) {
      const char* p = reinterpret_cast<const char*>(rs.Row(k));
      for (int64_t off = byte_begin; off < byte_end; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
    if constexpr (kType == GgmlType::kQ8_0 || kType == GgmlType::kQ4_0) {
      for (int64_t b = c0 / kQBlock; b < c1 / kQBlock; ++b) {
        float* yb = y + b * kQBlock;
        __m256 acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_loadu_ps(yb + 8 * j);
        for (int r = 0; r < g; ++r) {
          float d;
          const __m256i q = LoadQuantBlock<kType>(rows[r], b, &d);
          const __m256 s = _mm256_set1_ps(a[k0 + r] * d);
          const __m128i lo = _mm256_castsi256_si128(q);
          const __m128i hi = _mm256_extracti128_si256(q, 1);
          const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
          for (int j = 0; j < 4; ++j) {
            const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j]));
            acc[j] = _mm256_fmadd_ps(qf, s, acc[j]);
          }
        }
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(yb + 8 * j, acc[j]);
      }
    } else {
      int64_t c = c0;
      for (; c + 8 <= c1; c += 8) {
        __m256 acc = _mm256_loadu_ps(y + c);
        for (int r = 0; r < g; ++r) acc = _mm256_fmadd_ps(_mm256_set1_ps(a[k0 + r]), Load8<kType>(rows[r], c), acc);
        _mm256_storeu_ps(y + c, acc);
      }
      for (; c < c1; ++c) {
        for (int r = 0; r < g; ++r) y[c] = std::fma(a[k0 + r], Load1<kType>(rows[r], c), y[c]);
      }
    }
  }
}

void AccumulateAvx2(GgmlType type, const RowSet& rows, int64_t count, const float* a, int64_t c0, int64_t c1,
                    float* y) {
  switch (type) {
    case GgmlType::kF32:
      return AccumulateT<GgmlType::kF32>(rows, count, a, c0, c1, y);
    case GgmlType::kF16:
      return AccumulateT<GgmlType::kF16>(rows, count, a, c0, c1, y);
    case GgmlType::kBF16:
      return AccumulateT<GgmlType::kBF16>(rows, count, a, c0, c1, y);
    case GgmlType::kQ8_0:
      return AccumulateT<GgmlType::kQ8_0>(rows, count, a, c0, c1, y);
    case GgmlType::kQ4_0:
      return AccumulateT<GgmlType::kQ4_0>(rows, count, a, c0, c1, y);
    default:
      return;
  }
}

}  // namespace

// QuantizeRowQ8_0 in 8-lane steps with the same IEEE operations: the block's largest magnitude, d = amax / 127 and
// id = 1 / d as scalars, x * id per lane, and std::round's halfway cases away from zero (truncate, then step away from
// zero where the dropped fraction is at least one half; x * id is at most 127 in magnitude, so both are exact).
void QuantizeQ8Avx2(const float* x, BlockQ8_0* y, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 one = _mm256_set1_ps(1.0f);
  const int64_t nb = n / kQBlock;
  for (int64_t i = 0; i < nb; ++i) {
    const float* xb = x + i * kQBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xb + 8 * k);
      m = _mm256_max_ps(m, _mm256_and_ps(v[k], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = Fp32ToFp16(d);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 s = _mm256_mul_ps(v[k], vid);
      const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 frac = _mm256_and_ps(_mm256_sub_ps(s, t), abs_mask);
      // +-1 (the sign of s) where the fraction is at least one half, else 0.
      const __m256 step = _mm256_and_ps(_mm256_or_ps(one, _mm256_andnot_ps(abs_mask, s)),
                                        _mm256_cmp_ps(frac, half, _CMP_GE_OQ));
      q[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, step));
    }
    // int32 -> int8 in element order (the packs interleave 128-bit lanes; the permute restores the order).
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[i].qs), ordered);
  }
}

const IsaKernels kAvx2Kernels = {DotRowsAvx2, AccumulateAvx2, QuantizeQ8Avx2};

}  // namespace nflash::internal
