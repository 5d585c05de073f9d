// Block quantization with llama.cpp's exact layouts (files interoperate): Q8_0 and Q4_0, blocks of 32 with an fp16
// scale; plus row conversion to/from F32, F16 and BF16.
#pragma once

#include <cstdint>

#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash {

// Elements per quantization block (ggml's QK8_0 / QK4_0).
inline constexpr int kQBlock = 32;

#pragma pack(push, 1)
// ggml block_q8_0: x[i] ~= d * qs[i].
struct BlockQ8_0 {
  uint16_t d;             // fp16 scale = max|x| / 127
  int8_t qs[kQBlock];
};
// ggml block_q4_0: x[i] ~= d * (q[i] - 8); byte j holds element j in its low nibble and element j+16 in its high.
struct BlockQ4_0 {
  uint16_t d;             // fp16 scale = (signed value of max|x|) / -8
  uint8_t qs[kQBlock / 2];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ8_0) == 34, "must match ggml block_q8_0");
static_assert(sizeof(BlockQ4_0) == 18, "must match ggml block_q4_0");

// Reference quantizers, bit-identical to ggml's quantize_row_*_ref. `n` must be a multiple of kQBlock.
void QuantizeRowQ8_0(const float* x, BlockQ8_0* y, int64_t n);
void QuantizeRowQ4_0(const float* x, BlockQ4_0* y, int64_t n);
// Q4_0 with an error-minimising scale per block (same layout, so any Q4_0 reader decodes it): tries 19 scales around
// ggml's max/-8 and keeps, for the best rounding, the least-squares scale (the idea of llama.cpp's make_qx_quants,
// unweighted). Its squared error per block is never above that of QuantizeRowQ4_0. The converter uses it by default
// (WriteOptions::q4_0_scale_search); about 20 times slower than QuantizeRowQ4_0.
void QuantizeRowQ4_0Optimal(const float* x, BlockQ4_0* y, int64_t n);
void DequantizeRowQ8_0(const BlockQ8_0* x, float* y, int64_t n);
void DequantizeRowQ4_0(const BlockQ4_0* x, float* y, int64_t n);

// True for the row types QuantizeRow / DequantizeRow and the kernels handle: F32, F16, BF16, Q8_0, Q4_0.
bool IsRowType(GgmlType type);

// The type a matrix of `row_type` rows keeps when it is stored by column (columns of `column_len` values): the
// FFN down projection of the sparse engines (one column per neuron, read on its own). F32/F16/BF16 unchanged (exact
// transposition); Q8_0/Q4_0 unchanged (each column requantized) when column_len % 32 == 0, else F32. The packer
// (bundle down columns) and the in-memory sparse FFN both follow it, so the two compute the same function.
GgmlType ColumnType(GgmlType row_type, int64_t column_len);

// Converts `n` floats to a row of `type` (F32, F16, BF16, Q8_0, Q4_0), bit-identical to ggml's reference quantizers; Unsupported for other types, InvalidArgument
// when n is not a multiple of the block size.
Status QuantizeRow(GgmlType type, const float* x, void* dst, int64_t n);
// Converts a row of `type` (F32, F16, BF16, Q8_0, Q4_0) to floats.
Status DequantizeRow(GgmlType type, const void* src, float* y, int64_t n);

}  // namespace nflash
