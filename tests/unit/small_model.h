// The small synthetic model the packer and planner-input tests pack: dim 64 (two quant blocks), n_ff 96 (three blocks:
// down rows quantize too), 2 layers, 4 heads, the byte tokenizer.
#pragma once

#include <cstdint>
#include <string>

#include "converter/readers.h"
#include "converter/synth.h"

namespace nflash::testing {

// Writes it to `path` ("" when written, else what failed); `experts` > 0: MoE of that many experts, 2 per token.
inline std::string WriteSmallModel(const std::string& path, GgmlType type, int64_t experts = 0,
                                   FfnActivation activation = FfnActivation::kRelu) {
  converter::SynthOptions o;
  o.shape = "custom";
  o.dim = 64;
  o.ffn = 96;
  o.layers = 2;
  o.heads = 4;
  o.vocab = 260;  // the synthetic byte tokenizer needs 3 specials + 256 bytes
  o.context = 64;
  o.experts = experts;
  o.activation = activation;
  o.type = type;
  o.calib_sequences = 2;
  o.calib_tokens = 8;
  o.threads = 1;
  auto model = converter::BuildSyntheticModel(o, nullptr);
  if (!model.ok()) return model.status().ToString();
  converter::WriteOptions w;
  w.path = path;
  w.type = type;
  w.overwrite = true;
  w.progress = false;
  w.threads = 1;
  w.q4_0_scale_search = false;  // faster; the packer does not care which Q4_0 rounding made the file
  const Status s = converter::WriteModelGguf(*model, w);
  return s.ok() ? "" : s.ToString();
}

}  // namespace nflash::testing
