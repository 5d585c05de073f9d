// The FFN activation kinds nflash runs; their names are the values of the GGUF key nflash.ffn_activation.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace nflash {

// silu: down(silu(gate x) * up x); relu: down(relu(gate x) * up x); drelu: down(relu(gate x) * relu(up x)).
enum class FfnActivation : uint8_t { kSilu, kRelu, kDRelu };

inline const char* FfnActivationName(FfnActivation a) {
  switch (a) {
    case FfnActivation::kSilu: return "silu";
    case FfnActivation::kRelu: return "relu";
    case FfnActivation::kDRelu: return "drelu";
  }
  return "?";
}

inline std::optional<FfnActivation> ParseFfnActivation(std::string_view s) {
  if (s == "silu") return FfnActivation::kSilu;
  if (s == "relu") return FfnActivation::kRelu;
  if (s == "drelu") return FfnActivation::kDRelu;
  return std::nullopt;
}

}  // namespace nflash
