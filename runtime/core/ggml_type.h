// Tensor element types with ggml's numeric ids (as stored in GGUF tensor infos) and their block geometry.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace nflash {

// Values are ggml's `enum ggml_type`; they are written to files and must never change.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kBF16 = 30,
};

struct GgmlTypeInfo {
  GgmlType type;
  std::string_view name;  // ggml's name: "f32", "q4_0", ...
  uint32_t block_size;    // elements per block
  uint32_t type_size;     // bytes per block
};

// Geometry of a type id read from a file; nullopt for ids nflash does not know (their sizes cannot be checked).
std::optional<GgmlTypeInfo> LookupGgmlType(uint32_t id);
const GgmlTypeInfo& TypeInfo(GgmlType type);  // for a known enum value
std::string_view GgmlTypeName(GgmlType type);
// Parses "f32", "f16", "bf16", "q8_0", "q4_0" (case-insensitive) into a type.
std::optional<GgmlType> ParseGgmlType(std::string_view name);

// "[a, b, c]": a tensor's dims (or shape) for messages and listings.
std::string ShapeToString(const std::vector<uint64_t>& dims);

// Bytes of `n` elements of `type`; nullopt if `n` is not a multiple of the block size or the size overflows.
std::optional<uint64_t> RowBytes(GgmlType type, uint64_t n);

}  // namespace nflash
