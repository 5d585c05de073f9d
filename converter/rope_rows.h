// The row order RoPE's two conventions need of the q and k projections, shared by the readers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace nflash::converter {

// Rows of a q or k projection (or bias) kept in rotate-half order (Hugging Face checkpoints; llama.cpp's NEOX RoPE
// architectures such as qwen2 and phi3), put in the order of RoPE on consecutive pairs (GGUF's llama architecture):
// row h * head_dim + 2i + j of the result is row h * head_dim + j * head_dim / 2 + i of `src`, for each of `n_heads`
// heads of head_dim = rows / n_heads rows. A row is `row_elems` elements of T (floats, or the bytes of a quantized
// row, which move whole). Requires src.size() == rows * row_elems and an even head_dim.
template <typename T>
std::vector<T> InterleaveRopeRows(std::span<const T> src, int64_t n_heads, int64_t rows, size_t row_elems) {
  std::vector<T> out(src.size());
  const int64_t head_dim = rows / n_heads;
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        const T* from = src.data() + static_cast<size_t>(h * head_dim + j * half + i) * row_elems;
        std::copy(from, from + row_elems, out.data() + static_cast<size_t>(h * head_dim + 2 * i + j) * row_elems);
      }
    }
  }
  return out;
}

}  // namespace nflash::converter
