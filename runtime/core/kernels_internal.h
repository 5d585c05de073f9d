// Per-ISA kernel entry points behind kernels.h: kernels.cc validates, dispatches and splits work over threads; the
// scalar, AVX2 and AVX-512 files compute one thread's share.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/core/ggml_type.h"
#include "runtime/core/quant.h"

namespace nflash::internal {

// Rows of a matrix, either all of them in order (index == nullptr) or picked by an index list.
struct RowSet {
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  const int32_t* index = nullptr;
  const uint8_t* const* ptrs = nullptr;  // rows by address (GemvRowPtrs / AccumulateRowPtrs): base and index unused
  const uint8_t* Row(int64_t i) const {
    if (ptrs != nullptr) return ptrs[i];
    return base + row_bytes * static_cast<size_t>(index != nullptr ? static_cast<int64_t>(index[i]) : i);
  }
};

// `n` tokens: floats (stride cols) and, for quantized weights, Q8_0 blocks (stride cols / kQBlock).
struct TokenSet {
  const float* f32 = nullptr;
  const BlockQ8_0* q8 = nullptr;
  int64_t n = 0;
  int64_t cols = 0;
};

struct IsaKernels {
  // y[t * y_stride + i] = rows.Row(i) . token t, for i in [begin, end) and t < x.n. The value of each element must
  // depend only on the row and the token (never on begin/end or x.n), which keeps results partition-independent.
  void (*dot_rows)(GgmlType type, const RowSet& rows, int64_t begin, int64_t end, const TokenSet& x, float* y,
                   int64_t y_stride);
  // y[c] += sum over k < count (in order) of a[k] * rows.Row(k)[c], for c in [c0, c1). c0 is a multiple of 32;
  // c1 is too unless it is the row end.
  void (*accumulate)(GgmlType type, const RowSet& rows, int64_t count, const float* a, int64_t c0, int64_t c1,
                     float* y);
  // QuantizeRowQ8_0, byte for byte (the activations of every quantized product go through it).
  void (*quantize_q8)(const float* x, BlockQ8_0* y, int64_t n);
};

// The AVX2 Q8_0 quantizer (kernels_avx2.cc), named here so that the AVX-512 table can point at it in a constant
// initializer.
void QuantizeQ8Avx2(const float* x, BlockQ8_0* y, int64_t n);

extern const IsaKernels kScalarKernels;
extern const IsaKernels kAvx2Kernels;
// Q4_0/Q8_0 dots and every type's row accumulation in AVX-512; the other dots forward to kAvx2Kernels (a CPU with
// the one has the other).
extern const IsaKernels kAvx512Kernels;

}  // namespace nflash::internal
