// The table of ggml tensor types.
#include "runtime/core/ggml_type.h"

#include <array>
#include <cctype>
#include <cstdlib>
#include <string>

namespace nflash {
namespace {

// Block geometry from ggml's type traits (ggml.c: blck_size, type_size).
constexpr std::array<GgmlTypeInfo, 20> kTypes = {{
    {GgmlType::kF32, "f32", 1, 4},       {GgmlType::kF16, "f16", 1, 2},
    {GgmlType::kQ4_0, "q4_0", 32, 18},   {GgmlType::kQ4_1, "q4_1", 32, 20},
    {GgmlType::kQ5_0, "q5_0", 32, 22},   {GgmlType::kQ5_1, "q5_1", 32, 24},
    {GgmlType::kQ8_0, "q8_0", 32, 34},   {GgmlType::kQ8_1, "q8_1", 32, 36},
    {GgmlType::kQ2_K, "q2_K", 256, 84},  {GgmlType::kQ3_K, "q3_K", 256, 110},
    {GgmlType::kQ4_K, "q4_K", 256, 144}, {GgmlType::kQ5_K, "q5_K", 256, 176},
    {GgmlType::kQ6_K, "q6_K", 256, 210}, {GgmlType::kQ8_K, "q8_K", 256, 292},
    {GgmlType::kI8, "i8", 1, 1},         {GgmlType::kI16, "i16", 1, 2},
    {GgmlType::kI32, "i32", 1, 4},       {GgmlType::kI64, "i64", 1, 8},
    {GgmlType::kF64, "f64", 1, 8},       {GgmlType::kBF16, "bf16", 1, 2},
}};

}  // namespace

std::optional<GgmlTypeInfo> LookupGgmlType(uint32_t id) {
  for (const auto& t : kTypes) {
    if (static_cast<uint32_t>(t.type) == id) return t;
  }
  return std::nullopt;
}

const GgmlTypeInfo& TypeInfo(GgmlType type) {
  for (const auto& t : kTypes) {
    if (t.type == type) return t;
  }
  std::abort();  // every enum value is in the table
}

std::string_view GgmlTypeName(GgmlType type) { return TypeInfo(type).name; }

std::optional<GgmlType> ParseGgmlType(std::string_view name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& t : kTypes) {
    std::string tn;
    for (char c : t.name) tn += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (tn == lower) return t.type;
  }
  return std::nullopt;
}

std::string ShapeToString(const std::vector<uint64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::optional<uint64_t> RowBytes(GgmlType type, uint64_t n) {
  const GgmlTypeInfo& t = TypeInfo(type);
  if (n % t.block_size != 0) return std::nullopt;
  uint64_t blocks = n / t.block_size;
  if (blocks > UINT64_MAX / t.type_size) return std::nullopt;
  return blocks * t.type_size;
}

}  // namespace nflash
