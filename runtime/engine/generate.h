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

// A sampled token's log-probability under the model: the log-softmax of the logits it was sampled from (before the
// sampler's temperature, penalties and truncation, as OpenAI's and vLLM's logprobs), with the `top` most likely
// tokens, most likely first (ties: lower id first).
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

// The TokenLogprob of `id` over `logits` (n_vocab values) with `n_top` alternatives (at most n_vocab).
TokenLogprob LogprobOf(std::span<const float> logits, int32_t id, int n_top);

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
  // >= 0: record each sampled token's TokenLogprob with this many alternatives (GenerateResult::logprobs).
  int top_logprobs = -1;
  // With top_logprobs >= 0: also each prompt token's after the first (GenerateResult::prompt_logprobs). The whole
  // prompt is then evaluated (no cached prefix: its logits are gone), in pieces of kPromptLogprobsPiece tokens whose
  // logits are all kept.
  bool prompt_logprobs = false;
  // With top_logprobs >= 0, when set: called with each TokenLogprob as it joins GenerateResult::logprobs (the same
  // list, in order: never for the end token that ends the text), before on_text gets the text it adds (a stream
  // sends each piece with the log-probabilities of the tokens since the previous one).
  std::function<void(const TokenLogprob&)> on_logprob;
};

// The tokens whose logits a prompt_logprobs prefill holds at once (a front end with a memory budget reserves them).
inline constexpr int64_t kPromptLogprobsPiece = 16;

struct GenerateResult {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;              // of the prompt, kept from the context (GenerateCached), not evaluated
  int64_t generated_tokens = 0;
  StopReason reason = StopReason::kNone;  // kNone when cancelled
  bool cancelled = false;                 // `on_text` returned false
  std::string stop_string;                // the stop string that ended it (reason kStopString)
  double prefill_ms = 0;                  // evaluating the prompt's tokens after the cached ones
  double decode_ms = 0;                   // from the end of the prefill to the last token
  std::vector<double> step_ms;            // each decode step's forward pass
  // With options.top_logprobs >= 0: one per generated token, in order; the end token that ended it (EOS, an
  // end-of-turn marker, a llama2.c model's BOS) is not listed, having no text; the tokens that spelled a stop string
  // are.
  std::vector<TokenLogprob> logprobs;
  // With options.prompt_logprobs: prompt tokens 1 .. n-1 (the first has no context to be predicted from).
  std::vector<TokenLogprob> prompt_logprobs;
};

// Called with each piece of visible text (never empty); return false to stop generating (e.g. the client went away).
using TextSink = std::function<bool(std::string_view piece)>;

// Generates from `ctx` (which must be at position 0: the caller resets it) after `prompt` (token ids, BOS included
// when the model wants it; not empty; fewer than ctx.n_ctx()). InvalidArgument for a bad prompt or sampler setting;
// the forward pass's errors as they are. Temperature 0 is greedy.
Result<GenerateResult> Generate(InferenceContext& ctx, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                const GenerateOptions& options, const TextSink& on_text);

// The tokens whose keys and values a context holds, at positions 0 .. pos()-1, so that a prompt that starts with the
// same tokens evaluates only the rest (a prompt cache, as llama.cpp's server keeps one per slot: a chat's next turn
// repeats the conversation so far). Thread-safety: a value type, used with its context under the same lock.
struct HeldTokens {
  std::vector<int32_t> ids;
};

// Generate, continuing from what `ctx` holds: `held` must list the tokens at its positions 0 .. ctx.pos()-1 (empty at
// position 0), else Internal. The longest prefix `held` shares with `prompt`, less the prompt's last token (whose
// logits the first sample needs), is kept when `reuse` and the context can go back to it (InferenceContext::
// CanRewind); the context starts over otherwise. Afterwards `held` lists what the context then holds (prompt and
// generated tokens; the last sampled token is not evaluated), and is cleared with the context reset when generation
// fails. result.cached_tokens counts the prompt tokens kept. With the dense engine the results equal Generate's from
// position 0 bit for bit; an FFN backend with a batch rule (the sparse runtimes' batched prefill of >= 64 tokens)
// may run a shorter rest of the prompt through another path (runtime/engine/sparse_ffn.h).
Result<GenerateResult> GenerateCached(InferenceContext& ctx, HeldTokens* held, bool reuse, const Tokenizer& tokenizer,
                                      std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const TextSink& on_text);

}  // namespace nflash
