// The decode loop every text-generating front end shares (`nflash run`, `nflash serve`): prefill the prompt, then
// sample, detokenize and check the stop conditions one token at a time, handing each piece of visible text to the
// caller as soon as it is known.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/engine/context.h"
#include "runtime/text/sampler.h"
#include "runtime/text/tokenizer.h"

namespace nflash {

struct GenerateOptions {
  SamplerConfig sampler;
  // Tokens to generate at most; capped by the room left in the context. 0: only the prompt is evaluated.
  int64_t max_tokens = 256;
  std::vector<std::string> stop_strings;
  // Hand the prompt's own text to `on_text` first (as `nflash run` echoes it); either way the prompt goes through the
  // same detokenizer, so the continuation keeps the space the prompt's last word is followed by.
  bool echo_prompt = false;
  // Keep generating through the end-of-text token (llama.cpp's ignore_eos): only max_tokens and stop strings end it.
  bool ignore_eos = false;
};

struct GenerateResult {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  StopReason reason = StopReason::kNone;  // kNone when cancelled
  bool cancelled = false;                 // `on_text` returned false
  std::string stop_string;                // the stop string that ended it (reason kStopString)
  double prefill_ms = 0;
  double decode_ms = 0;                   // from the end of the prefill to the last token
  std::vector<double> step_ms;            // each decode step's forward pass
};

// Called with each piece of visible text (never empty); return false to stop generating (e.g. the client went away).
using TextSink = std::function<bool(std::string_view piece)>;

// Generates from `ctx` (which must be at position 0: the caller resets it) after `prompt` (token ids, BOS included
// when the model wants it; not empty; fewer than ctx.n_ctx()). InvalidArgument for a bad prompt or sampler setting;
// the forward pass's errors as they are. Temperature 0 is greedy.
Result<GenerateResult> Generate(InferenceContext& ctx, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                const GenerateOptions& options, const TextSink& on_text);

}  // namespace nflash
