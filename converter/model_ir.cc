// Names of the converter's model-description enums (FFN activation), shared by readers, the writer and the CLI.
#include "converter/model_ir.h"

namespace nflash::converter {

const char* FfnActivationName(FfnActivation a) {
  switch (a) {
    case FfnActivation::kSilu:
      return "silu";
    case FfnActivation::kRelu:
      return "relu";
    case FfnActivation::kDRelu:
      return "drelu";
  }
  return "unknown";
}

std::optional<FfnActivation> ParseFfnActivation(std::string_view s) {
  for (FfnActivation a : {FfnActivation::kSilu, FfnActivation::kRelu, FfnActivation::kDRelu}) {
    if (s == FfnActivationName(a)) return a;
  }
  return std::nullopt;
}

}  // namespace nflash::converter
