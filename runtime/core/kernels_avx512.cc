// AVX-512 (F, BW, VL, VNNI) kernels: Q4_0 and Q8_0 dot products and AccumulateRows (every type); float dots reuse
// the AVX2 code (this file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c;
// kernels.cc calls it only on CPUs that have all of them).
//
// One 512-bit step covers two consecutive 32-weight blocks (64 lanes of bytes: block b, then block b + 1). Weights
// become unsigned codes u = w + K (K = 8 for the Q4_0 nibbles, which already are w + 8; K = 128 for Q8_0, by flipping
// the sign bit), so `vpdpbusd` (unsigned x signed bytes, exact int32 sums of 4) multiplies them directly with the
// Q8_0 activation: (u - K) . x = u . x - K * sum(x). The K * sum(x) term is computed once per token and step,
// shared by the tile's rows, and seeds the dpbusd accumulator, so it costs the rows nothing.

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() values and warn about them (GCC bug 105593) wherever
// they are inlined; the warning is about the compiler's own header, so it is silenced for that header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstring>

#include "runtime/core/kernels_internal.h"

namespace nflash::internal {
namespace {

// Rows per micro-tile for T tokens: the more rows share a token step (load, scales, -K * sum(x): ~9 instructions),
// the less it costs per row; 8 rows x 1 token (8 accumulators, 8 weight steps of 2 registers) and 4 rows x 2 or 4
// tokens stay within the 32 zmm registers.
template <int T>
constexpr int kTileRowsFor = T == 1 ? 8 : 4;
// Tokens per micro-tile in Gemm: 4 x 4 accumulators plus 4 unpacked weight steps and their scales (8) plus one token
// step (3) use 27 of the 32 zmm registers; each unpacked weight step (permute, shift, mask, scale conversion: as
// many instructions as its 4 dpbusd) is reused for 4 tokens, which measured ~1.2x the GEMM rate of 2-token tiles.
constexpr int kTileTokens = 4;
// Rows per cache block in Gemm: 16 rows of a 4096-wide Q4_0 matrix are 36 KiB, so they stay in L1/L2 while every
// token tile streams past them; each weight row thus comes from DRAM once per Gemm call.
constexpr int64_t kBlockRows = 16;

template <GgmlType kType>
constexpr size_t kBlockBytes = kType == GgmlType::kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0);

inline float HSum(__m512 v) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX512F, not DQ
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One step of a weight row: the unsigned codes of blocks b and b + 1 (64 bytes, element order) and their scales
// (16 floats: d_b in lanes 0-7, d_b+1 in lanes 8-15, matching the int32 lanes dpbusd produces per block). With
// `kTwo` false only block b exists (odd block count): the loads are masked so nothing past it is read, and the
// upper half is all zero (codes and scale), which adds exactly 0 to the accumulators.
struct WeightStep {
  __m512i u;
  __m512 d;
};

template <GgmlType kType, bool kTwo>
inline WeightStep LoadWeightStep(const uint8_t* blk) {
  WeightStep s;
  if constexpr (kType == GgmlType::kQ4_0) {
    // Two 18-byte blocks are 18 words: d_b = word 0, qs_b = words 1-8, d_b+1 = word 9, qs_b+1 = words 10-17.
    const __m512i raw = _mm512_maskz_loadu_epi16(kTwo ? 0x3ffff : 0x1ff, blk);
    // 128-bit lanes: qs_b, qs_b, qs_b+1, qs_b+1; the odd lanes are shifted right by 4 (high nibbles = elements 16-31).
    const __m512i idx = _mm512_set_epi16(17, 16, 15, 14, 13, 12, 11, 10, 17, 16, 15, 14, 13, 12, 11, 10,  //
                                         8, 7, 6, 5, 4, 3, 2, 1, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m512i qs = _mm512_permutexvar_epi16(idx, raw);
    const __m512i shifted = _mm512_srlv_epi64(qs, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
    s.u = _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
    const __m512i didx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                                          9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0);
    s.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, raw)));
  } else {
    // Two 34-byte blocks are 34 words: d_b = word 0, qs_b = words 1-16, d_b+1 = word 17, qs_b+1 = words 18-33; the
    // last two words come from a second (masked) load.
    const __m512i lo = _mm512_maskz_loadu_epi16(kTwo ? ~0u : 0x1ffffu, blk);
    const __m512i hi = _mm512_maskz_loadu_epi16(kTwo ? 0x3u : 0u, blk + 64);
    // Indices >= 32 pick words of `hi`.
    const __m512i idx = _mm512_set_epi16(33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,  //
                                         16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m512i qs = _mm512_permutex2var_epi16(lo, idx, hi);
    // w + 128 as unsigned: flip the sign bit. The missing block's zero bytes would become 128; they meet zero
    // activation bytes, so they still add 0, but keep them 0 for clarity.
    s.u = _mm512_maskz_mov_epi8(kTwo ? ~0ull : 0xffffffffull, _mm512_xor_si512(qs, _mm512_set1_epi8(-128)));
    const __m512i didx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                                          17, 17, 17, 17, 17, 17, 17, 17, 0, 0, 0, 0, 0, 0, 0, 0);
    s.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, lo)));
  }
  return s;
}

// One step of a token: the activation bytes of blocks b and b + 1, their scales as in WeightStep, and -K * sum(x)
// per int32 lane (the dpbusd seed). Block b + 1 reads as zero when `kTwo` is false.
struct TokenStep {
  __m512i x;
  __m512 d;
  __m512i seed;
};

template <GgmlType kType, bool kTwo>
inline TokenStep LoadTokenStep(const BlockQ8_0* xb) {
  constexpr char kOffset = kType == GgmlType::kQ8_0 ? -128 : 8;  // K as an unsigned byte (0x80 = 128)
  TokenStep s;
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[0].qs));
  const __m256i x1 = kTwo ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[1].qs)) : _mm256_setzero_si256();
  s.x = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
  const __m256i dh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(static_cast<short>(xb[0].d))),
                                             _mm_set1_epi16(kTwo ? static_cast<short>(xb[1].d) : short{0}), 1);
  s.d = _mm512_cvtph_ps(dh);
  // |K * sum of 4 x| <= 128 * 4 * 127: exact.
  const __m512i k_sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(kOffset), s.x);
  s.seed = _mm512_sub_epi32(_mm512_setzero_si512(), k_sum);
  return s;
}

// Blocks b (and b + 1 when `kTwo`) of R rows against T tokens, added to acc.
template <GgmlType kType, int R, int T, bool kTwo>
inline void QuantStep(const uint8_t* const* rows, const BlockQ8_0* x, int64_t nb, int64_t b, __m512 (&acc)[R][T]) {
  WeightStep w[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) w[r] = LoadWeightStep<kType, kTwo>(rows[r] + b * kBlockBytes<kType>);
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const TokenStep xs = LoadTokenStep<kType, kTwo>(x + t * nb + b);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(xs.seed, w[r].u, xs.x);
      acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(w[r].d, xs.d), _mm512_cvtepi32_ps(dot), acc[r][t]);
    }
  }
}

// Q4_0, four blocks per step. Two blocks per step (above) spend two permutes, a shift and a mask per row to lay the
// nibbles out in element order; four blocks put the 4 x 16 code bytes in one register with one two-source word
// permute (the 18-byte blocks start on word boundaries) and dot its low nibbles (elements 0-15 of each block) and
// high nibbles (elements 16-31) with the token's bytes gathered the same way, once per token step and shared by
// the tile's rows. Per row and 4 blocks: 2 loads, 1 permute, shift, 2 masks, 2 dpbusd, scale permute + convert,
// multiply, convert, fma: 13 instructions instead of 20. Lanes 4k..4k+3 hold block k of the step.
struct WeightStep4 {
  __m512i lo, hi;
  __m512 d;
};

alignas(64) constexpr uint16_t kQ4x4CodeWords[32] = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12, 13, 14, 15, 16, 17,
                                                      19, 20, 21, 22, 23, 24, 25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
alignas(64) constexpr uint16_t kQ4x4ScaleWords[32] = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27};

inline WeightStep4 LoadWeightStep4(const uint8_t* blk) {
  // Four 18-byte blocks are 36 words: d_k = word 9k, qs_k = words 9k+1 .. 9k+8; words 32-35 come from a masked load.
  const __m512i a = _mm512_loadu_si512(blk);
  const __m512i b = _mm512_maskz_loadu_epi16(0xf, blk + 64);
  const __m512i qs = _mm512_permutex2var_epi16(a, _mm512_load_si512(kQ4x4CodeWords), b);
  WeightStep4 w;
  w.lo = _mm512_and_si512(qs, _mm512_set1_epi8(0x0f));
  w.hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), _mm512_set1_epi8(0x0f));
  w.d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(kQ4x4ScaleWords), a)));
  return w;
}

struct TokenStep4 {
  __m512i lo, hi;  // elements 0-15 / 16-31 of blocks b .. b+3, one 128-bit lane per block
  __m512 d;        // d_k in lanes 4k .. 4k+3
  __m512i seed;    // -8 * (sum of the 8 bytes a lane's two dpbusd multiply)
};

inline TokenStep4 LoadTokenStep4(const BlockQ8_0* xb) {
  auto lane = [&](int k, int half) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[k].qs + 16 * half));
  };
  TokenStep4 s;
  for (int half = 0; half < 2; ++half) {
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(lane(0, half)), lane(1, half), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(lane(2, half)), lane(3, half), 1);
    (half == 0 ? s.lo : s.hi) = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  const auto d = [&](int k) { return static_cast<short>(xb[k].d); };
  s.d = _mm512_cvtph_ps(_mm256_setr_epi16(d(0), d(0), d(0), d(0), d(1), d(1), d(1), d(1), d(2), d(2), d(2), d(2),
                                          d(3), d(3), d(3), d(3)));
  // |8 * sum of 8 x| <= 8 * 8 * 127: exact.
  const __m512i eight = _mm512_set1_epi8(8);
  const __m512i k_sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, s.lo), eight, s.hi);
  s.seed = _mm512_sub_epi32(_mm512_setzero_si512(), k_sum);
  return s;
}

// Blocks b .. b+3 of R Q4_0 rows against T tokens, added to acc.
template <int R, int T>
inline void Q4Step4(const uint8_t* const* rows, const BlockQ8_0* x, int64_t nb, int64_t b, __m512 (&acc)[R][T]) {
  WeightStep4 w[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) w[r] = LoadWeightStep4(rows[r] + b * sizeof(BlockQ4_0));
  #pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const TokenStep4 xs = LoadTokenStep4(x + t * nb + b);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(xs.seed, w[r].lo, xs.lo), w[r].hi, xs.hi);
      acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(w[r].d, xs.d), _mm512_cvtepi32_ps(dot), acc[r][t]);
    }
  }
}

// y[t * y_stride + r] = row r . token t for R rows and T tokens. Every (r, t) pair goes through the same operation
// sequence whatever R and T are, so tiles and tails give identical values. `prefetch` (R rows, or nullptr) are the
// rows of the next tile, touched one step ahead at the same offset (see the AVX2 file for why this matters).
template <GgmlType kType, int R, int T>
inline void QuantTile(const uint8_t* const* rows, const BlockQ8_0* x, int64_t nb, float* y, int64_t y_stride,
                      const uint8_t* const* prefetch) {
  constexpr size_t kStepBytes = 2 * kBlockBytes<kType>;
  __m512 acc[R][T];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t b = 0;
  if constexpr (kType == GgmlType::kQ4_0) {
    // Four blocks per step while they last (72 bytes: the prefetch touches both lines they can span), then the
    // two-block steps below for the last 1-3 blocks.
    for (; b + 4 <= nb; b += 4) {
      if (prefetch != nullptr) {
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const char* p = reinterpret_cast<const char*>(prefetch[r] + b * sizeof(BlockQ4_0));
          _mm_prefetch(p, _MM_HINT_T0);
          _mm_prefetch(p + 64, _MM_HINT_T0);
        }
      }
      Q4Step4<R, T>(rows, x, nb, b, acc);
    }
  }
  for (; b < nb; b += 2) {
    if (b + 2 > nb) {
      QuantStep<kType, R, T, false>(rows, x, nb, b, acc);
      break;
    }
    if (prefetch != nullptr) {
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(prefetch[r] + b * kBlockBytes<kType>);
        _mm_prefetch(p, _MM_HINT_T0);
        // A 68-byte Q8_0 step can span 2 lines beyond the first one touched; 36-byte Q4_0 steps cannot skip a line.
        if constexpr (kStepBytes > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
      }
    }
    QuantStep<kType, R, T, true>(rows, x, nb, b, acc);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < T; ++t) y[t * y_stride + r] = HSum(acc[r][t]);
}

// Rows [i0, i1) against tokens [t0, t0 + T). The first token tile prefetches the next row tile; later token tiles
// find the rows in cache.
template <GgmlType kType, int T>
void RowsAgainstTokens(const RowSet& rs, int64_t i0, int64_t i1, const TokenSet& x, int64_t t0, float* y,
                       int64_t y_stride) {
  const int64_t nb = x.cols / kQBlock;
  const BlockQ8_0* xt = x.q8 + t0 * nb;
  float* yt = y + t0 * y_stride;
  constexpr int kTileRows = kTileRowsFor<T>;
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
    QuantTile<kType, kTileRows, T>(rows, xt, nb, yt + i, y_stride, has_next && t0 == 0 ? next : nullptr);
  }
  if constexpr (kTileRows > 4) {
    for (; i + 4 <= i1; i += 4) {
      for (int r = 0; r < 4; ++r) rows[r] = rs.Row(i + r);
      QuantTile<kType, 4, T>(rows, xt, nb, yt + i, y_stride, nullptr);
    }
  }
  for (; i < i1; ++i) {
    const uint8_t* row = rs.Row(i);
    QuantTile<kType, 1, T>(&row, xt, nb, yt + i, y_stride, nullptr);
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
    for (; t + kTileTokens <= x.n; t += kTileTokens) {
      RowsAgainstTokens<kType, kTileTokens>(rs, i0, i1, x, t, y, y_stride);
    }
    // Token tails: 2 then 1 (every tile shape computes each (row, token) value identically).
    for (; t + 2 <= x.n; t += 2) RowsAgainstTokens<kType, 2>(rs, i0, i1, x, t, y, y_stride);
    for (; t < x.n; ++t) RowsAgainstTokens<kType, 1>(rs, i0, i1, x, t, y, y_stride);
  }
}

// Quantized types use the code above for every token count (Gemv, GemvRows and Gemm alike, so Gemm still equals
// Gemv bit for bit); float types run the AVX2 kernels, whose FMA throughput AVX-512 would not raise on this class of
// memory-bound loop.
void DotRowsAvx512(GgmlType type, const RowSet& rows, int64_t begin, int64_t end, const TokenSet& x, float* y,
                   int64_t y_stride) {
  switch (type) {
    case GgmlType::kQ8_0:
      return DotRowsT<GgmlType::kQ8_0>(rows, begin, end, x, y, y_stride);
    case GgmlType::kQ4_0:
      return DotRowsT<GgmlType::kQ4_0>(rows, begin, end, x, y, y_stride);
    default:
      return kAvx2Kernels.dot_rows(type, rows, begin, end, x, y, y_stride);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// AccumulateRows: y[c] += sum_k a_k * w_k[c]. Every output element goes through exactly the AVX2 kernel's operation
// sequence, so the two ISAs give the same bits (the offloaded and in-memory runs compare bitwise, and a run must not
// change with the ISA that happens to be picked): rows in the given order, one fused multiply-add per row and
// element, y = fma(w, s, y), with s = a_k for float rows and s = a_k * d_block (one float rounding) for Q8_0/Q4_0.
// What changes is the work around that FMA: 16-lane decodes (one vpermps table lookup per 16 Q4_0 nibbles instead of
// widen, convert and subtract per 8), 8 rows per pass over y instead of 4, and, for quantized rows, prefetches
// spread over the pass instead of issued at once.

// Rows applied per pass over the thread's columns: y (4 zmm per 64-column step) is loaded and stored once per 8
// rows, and the 8 coefficient broadcasts, 4 accumulators and the decode temporaries fit in the 32 zmm registers.
constexpr int kAccumRows = 8;
// Columns per step: 4 independent accumulator chains (one per 16 columns) cover the FMA latency across the rows.
constexpr int64_t kAccumStepCols = 64;
// Float rows: only the first bytes of the next group's rows are prefetched, all at once when a group starts, as in
// the AVX2 kernel; the hardware prefetcher follows a long float row once it has started, and prefetching every
// line of 8 rows in each step costs more than it saves (measured ~25% slower on L2-resident F16/F32 rows).
constexpr int64_t kFloatPrefetchBytes = 512;

template <GgmlType kType>
constexpr bool kIsQuant = kType == GgmlType::kQ8_0 || kType == GgmlType::kQ4_0;

// Bytes of a row per column (float types) or per 32-column block (quantized types).
template <GgmlType kType>
constexpr int64_t kUnitBytes = kType == GgmlType::kF32   ? 4
                               : kIsQuant<kType>         ? static_cast<int64_t>(kBlockBytes<kType>)
                                                         : 2;

// Byte offset of column c (a block start for quantized rows) in a row.
template <GgmlType kType>
constexpr int64_t ColumnOffset(int64_t c) {
  return kIsQuant<kType> ? c / kQBlock * kUnitBytes<kType> : c * kUnitBytes<kType>;
}

// Q4_0 codes u = 0..15 as the floats u - 8 (exact), looked up by vpermps, which reads only the low 4 bits of each
// index lane: the low nibble needs no mask, the high one a shift.
inline __m512 Q4Table() {
  return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

// 16 elements of a float-like row from element c; with `mask` only its lanes are read (the rest are 0).
template <GgmlType kType, bool kMasked>
inline __m512 LoadFloat16(const uint8_t* row, int64_t c, __mmask16 mask) {
  const uint8_t* p = row + c * kUnitBytes<kType>;
  if constexpr (kType == GgmlType::kF32) {
    return kMasked ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
  } else {
    const __m256i h =
        kMasked ? _mm256_maskz_loadu_epi16(mask, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kType == GgmlType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {  // kBF16: the 16 bits are the high half of an fp32
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// Quantized block at `blk` times coefficient `av` (broadcast), added to y lanes acc[0] (elements 0-15) and acc[1]
// (16-31). The scale product a_k * d is rounded to float first, as in the AVX2 kernel.
template <GgmlType kType>
inline void AccumulateBlock(const uint8_t* blk, __m512 av, __m512 q4_table, __m512* acc) {
  uint16_t dh;
  std::memcpy(&dh, blk, 2);
  const __m512 s = _mm512_mul_ps(av, _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(dh))));
  __m512 lo, hi;
  if constexpr (kType == GgmlType::kQ4_0) {
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    lo = _mm512_permutexvar_ps(u, q4_table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), q4_table);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
  }
  acc[0] = _mm512_fmadd_ps(lo, s, acc[0]);
  acc[1] = _mm512_fmadd_ps(hi, s, acc[1]);
}

// Columns [c, c + 16 * N) of y plus R rows (in order). Float types take any N; quantized ones an even N (whole
// blocks). With kMasked (float types, N = 1) only the lanes in `mask` are read and written.
template <GgmlType kType, int R, int N, bool kMasked = false>
inline void AccumulateStep(const uint8_t* const* rows, const __m512* av, int64_t c, float* y,
                           __mmask16 mask = 0xffff) {
  __m512 acc[N];
  #pragma GCC unroll 8
  for (int j = 0; j < N; ++j) acc[j] = kMasked ? _mm512_maskz_loadu_ps(mask, y + c) : _mm512_loadu_ps(y + c + 16 * j);
  if constexpr (kIsQuant<kType>) {
    const __m512 q4_table = Q4Table();
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 8
      for (int j = 0; j < N; j += 2) {
        AccumulateBlock<kType>(rows[r] + ColumnOffset<kType>(c + 16 * j), av[r], q4_table, acc + j);
      }
    }
  } else {
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        acc[j] = _mm512_fmadd_ps(av[r], LoadFloat16<kType, kMasked>(rows[r], c + 16 * j, mask), acc[j]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
    if constexpr (kMasked) {
      _mm512_mask_storeu_ps(y + c, mask, acc[j]);
    } else {
      _mm512_storeu_ps(y + c + 16 * j, acc[j]);
    }
  }
}

// R rows (coefficients a[0..R)) added to y over columns [c0, c1). `next` (R rows, or nullptr; quantized types only)
// is the next group: every step prefetches the bytes of its rows this step reads in the current ones, one group
// (8 rows x this thread's share of a row) ahead. The selected rows are scattered and a thread's share of a quantized
// row is short (1152 bytes for 4096 Q4_0 columns on 2 threads), so the hardware prefetcher does not find them.
template <GgmlType kType, int R>
void AccumulateGroup(const uint8_t* const* rows, const float* a, int64_t c0, int64_t c1, float* y,
                     const uint8_t* const* next) {
  __m512 av[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) av[r] = _mm512_set1_ps(a[r]);
  // Bytes of a row one 64-column step reads: 36 (Q4_0), 68 (Q8_0).
  constexpr int64_t kStepBytes = ColumnOffset<kType>(kAccumStepCols);
  int64_t c = c0;
  for (; c + kAccumStepCols <= c1; c += kAccumStepCols) {
    if (kIsQuant<kType> && next != nullptr) {
      const int64_t off = ColumnOffset<kType>(c);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        // ceil(step / 64) prefetches 64 bytes apart (Q4_0: 1, Q8_0: 2): the gap to the next step's first one is
        // then at most 64 bytes, so no line of the row is skipped.
        #pragma GCC unroll 8
        for (int64_t l = 0; l < (kStepBytes + 63) / 64; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(next[r] + off + 64 * l), _MM_HINT_T0);
        }
      }
    }
    AccumulateStep<kType, R, kAccumStepCols / 16>(rows, av, c, y);
  }
  if constexpr (kIsQuant<kType>) {
    if (c < c1) AccumulateStep<kType, R, 2>(rows, av, c, y);  // one last block (c1 - c == 32)
  } else {
    for (; c + 16 <= c1; c += 16) AccumulateStep<kType, R, 1>(rows, av, c, y);
    if (c < c1) {
      const auto mask = static_cast<__mmask16>((1u << (c1 - c)) - 1);
      AccumulateStep<kType, R, 1, true>(rows, av, c, y, mask);
    }
  }
}

// Prefetches rows [k0, k1) of rs over the bytes holding columns [c0, c1) (float rows: their first
// kFloatPrefetchBytes), all at once.
template <GgmlType kType>
void PrefetchRows(const RowSet& rs, int64_t k0, int64_t k1, int64_t c0, int64_t c1) {
  const int64_t begin = ColumnOffset<kType>(c0);
  const int64_t end = kIsQuant<kType> ? ColumnOffset<kType>(c1 + kQBlock - 1)
                                      : std::min(ColumnOffset<kType>(c1), begin + kFloatPrefetchBytes);
  for (int64_t k = k0; k < k1; ++k) {
    const char* p = reinterpret_cast<const char*>(rs.Row(k));
    for (int64_t off = begin; off < end; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

template <GgmlType kType>
void AccumulateT(const RowSet& rs, int64_t count, const float* a, int64_t c0, int64_t c1, float* y) {
  const uint8_t* rows[kAccumRows];
  const uint8_t* next[kAccumRows];
  int64_t k = 0;
  if (count >= kAccumRows) {
    for (int r = 0; r < kAccumRows; ++r) next[r] = rs.Row(r);
  }
  for (; k + kAccumRows <= count; k += kAccumRows) {
    for (int r = 0; r < kAccumRows; ++r) rows[r] = next[r];
    const bool has_next = k + 2 * kAccumRows <= count;
    if (has_next) {
      for (int r = 0; r < kAccumRows; ++r) next[r] = rs.Row(k + kAccumRows + r);
      if constexpr (!kIsQuant<kType>) PrefetchRows<kType>(rs, k + kAccumRows, k + 2 * kAccumRows, c0, c1);
    } else {
      PrefetchRows<kType>(rs, k + kAccumRows, count, c0, c1);  // the tail: fewer than kAccumRows rows
    }
    AccumulateGroup<kType, kAccumRows>(rows, a + k, c0, c1, y, has_next && kIsQuant<kType> ? next : nullptr);
  }
  for (; k + 4 <= count; k += 4) {
    for (int r = 0; r < 4; ++r) rows[r] = rs.Row(k + r);
    AccumulateGroup<kType, 4>(rows, a + k, c0, c1, y, nullptr);
  }
  for (; k < count; ++k) {
    rows[0] = rs.Row(k);
    AccumulateGroup<kType, 1>(rows, a + k, c0, c1, y, nullptr);
  }
}

void AccumulateAvx512(GgmlType type, const RowSet& rows, int64_t count, const float* a, int64_t c0, int64_t c1,
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
      return;  // kernels.cc validated the type
  }
}

}  // namespace

const IsaKernels kAvx512Kernels = {DotRowsAvx512, AccumulateAvx512, QuantizeQ8Avx2};

}  // namespace nflash::internal
