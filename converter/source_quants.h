// ggml block types the converter reads from a GGUF source but nflash never computes with: the legacy Q4_1, Q5_0 and
// Q5_1 and the K-quants Q2_K..Q6_K (llama.cpp's Q4_K_M, Q5_K_M, Q6_K, ... files). Dequantized to F32 on reading, then
// written in the type the user asks for.
#pragma once

#include <cstdint>

#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// True for the types DequantizeSourceRow reads beyond runtime/core/quant.h's (F32, F16, BF16, Q8_0, Q4_0).
bool IsSourceOnlyType(GgmlType type);

// Dequantizes `n` values of a row of `type` at `src` (RowBytes(type, n) bytes) into `y`: the core types through
// DequantizeRow, the others as ggml's dequantize_row_* define them (layouts in docs/formats.md, "Source-only types").
// InvalidArgument when n is not a whole number of the type's blocks; Unsupported for other types.
Status DequantizeSourceRow(GgmlType type, const uint8_t* src, float* y, int64_t n);

}  // namespace nflash::converter
