// The FFN activation kinds nflash runs; their names are the values of the GGUF key nflash.ffn_activation.
#pragma once

#include <algorithm>
#include <cmath>
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

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// One FFN neuron: from its gate and up projections, the activated gate (act(gate), the value an "is this neuron
// active" test looks at) and the hidden value the down projection multiplies. The dense engine and every sparse path
// use this one definition, so their numerics agree.
inline float ActivateNeuron(FfnActivation a, float gate, float up, float* gate_act) {
  switch (a) {
    case FfnActivation::kSilu: *gate_act = Silu(gate); return *gate_act * up;
    case FfnActivation::kRelu: *gate_act = std::max(gate, 0.0f); return *gate_act * up;
    case FfnActivation::kDRelu: *gate_act = std::max(gate, 0.0f); return *gate_act * std::max(up, 0.0f);
  }
  *gate_act = 0.0f;
  return 0.0f;
}

}  // namespace nflash
