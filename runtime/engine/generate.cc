// The shared decode loop (see generate.h).
#include "runtime/engine/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace nflash {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

// Whether the prompt's own log-probabilities are recorded (GenerateOptions::prompt_logprobs).
bool ScoresPrompt(const GenerateOptions& options) { return options.prompt_logprobs && options.top_logprobs >= 0; }

// The decode loop from a context that holds prompt[0 .. ctx.pos()) (ctx.pos() < prompt.size(), prompt not empty); the
// ids sampled are appended to `sampled` when it is given.
Result<GenerateResult> GenerateFrom(InferenceContext& ctx, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                    const GenerateOptions& options, const TextSink& on_text,
                                    std::vector<int32_t>* sampled) {
  GenerateResult r;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  r.cached_tokens = ctx.pos();
  const int64_t room = ctx.n_ctx() - r.prompt_tokens;
  if (room <= 0) {
    return Status::InvalidArgument("the prompt has " + std::to_string(prompt.size()) +
                                   " tokens, more than the context size " + std::to_string(ctx.n_ctx()));
  }
  if (options.max_tokens < 0) return Status::InvalidArgument("max tokens " + std::to_string(options.max_tokens) + " < 0");
  NF_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(options.sampler));
  for (int32_t t : prompt) sampler.Accept(t);
  StopConfig stop_config;
  if (!options.ignore_eos) stop_config.end_ids = tokenizer.end_of_generation_ids();  // EOS among them
  stop_config.bos_id = options.ignore_eos ? -1 : tokenizer.bos_id();
  stop_config.max_tokens = std::min(options.max_tokens, room);
  stop_config.stop_strings = options.stop_strings;
  StopChecker stop(stop_config);
  Detokenizer detok(tokenizer);

  // Once the sink refuses a piece, nothing more is sent and generation ends after the current token.
  auto emit = [&](const std::string& s) {
    if (!s.empty() && !r.cancelled && !on_text(s)) r.cancelled = true;
  };
  for (int32_t t : prompt) {
    std::string s = detok.Push(t);
    if (options.echo_prompt) emit(s);
  }

  const auto t0 = Clock::now();
  if (ScoresPrompt(options)) {
    if (r.cached_tokens != 0) return Status::Internal("prompt log-probabilities need the whole prompt evaluated");
    // Row i of a piece starting at `at` predicts prompt token at + i + 1.
    for (size_t at = 0; at < prompt.size(); at += kPromptLogprobsPiece) {
      const size_t len = std::min<size_t>(kPromptLogprobsPiece, prompt.size() - at);
      NF_RETURN_IF_ERROR(ctx.Eval(prompt.subspan(at, len), true));
      for (size_t i = 0; i < len && at + i + 1 < prompt.size(); ++i) {
        r.prompt_logprobs.push_back(LogprobOf({ctx.logits(static_cast<int64_t>(i)), static_cast<size_t>(ctx.n_vocab())},
                                              prompt[at + i + 1], options.top_logprobs));
      }
    }
  } else {
    NF_RETURN_IF_ERROR(ctx.Eval(prompt.subspan(static_cast<size_t>(r.cached_tokens)), false));
  }
  const auto t1 = Clock::now();
  r.prefill_ms = Ms(t0, t1);
  // The StopChecker counts a token before it checks the budget, so a budget of 0 never reaches it.
  if (stop_config.max_tokens == 0) r.reason = StopReason::kMaxTokens;
  auto step_start = t1;
  while (r.reason == StopReason::kNone && !r.cancelled) {
    const float* lg = ctx.logits();
    const int32_t next = sampler.Sample({lg, static_cast<size_t>(ctx.n_vocab())});
    sampler.Accept(next);
    if (sampled != nullptr) sampled->push_back(next);
    std::string piece;
    r.reason = stop.Push(next, detok.Push(next), &piece);
    // The end token (EOS, an end-of-turn marker, a llama2.c model's BOS) has no text: not listed.
    if (options.top_logprobs >= 0 && r.reason != StopReason::kEos && r.reason != StopReason::kBos) {
      r.logprobs.push_back(LogprobOf({lg, static_cast<size_t>(ctx.n_vocab())}, next, options.top_logprobs));
      if (options.on_logprob) options.on_logprob(r.logprobs.back());
    }
    emit(piece);
    if (r.reason != StopReason::kNone || r.cancelled) break;
    NF_RETURN_IF_ERROR(ctx.Eval({&next, 1}, false));
    const auto now = Clock::now();
    r.step_ms.push_back(Ms(step_start, now));
    step_start = now;
  }
  if (!r.cancelled) {
    emit(stop.Flush());
    emit(detok.Finish());
  }
  if (r.cancelled) r.reason = StopReason::kNone;
  r.generated_tokens = stop.n_tokens();
  r.stop_string = stop.matched();
  r.decode_ms = Ms(t1, Clock::now());
  return r;
}

}  // namespace

TokenLogprob LogprobOf(std::span<const float> logits, int32_t id, int n_top) {
  // log p(i) = x_i - max - log(sum exp(x_j - max)), summed in double.
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double log_z = static_cast<double>(mx) + std::log(sum);
  TokenLogprob out;
  out.id = id;
  out.logprob = static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - log_z);
  const size_t k = std::min(static_cast<size_t>(std::max(n_top, 0)), logits.size());
  if (k == 0) return out;  // no alternatives: no ranking of the vocabulary
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  auto more_likely = [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + static_cast<ptrdiff_t>(k), order.end(), more_likely);
  for (size_t i = 0; i < k; ++i) {
    out.top.emplace_back(order[i], static_cast<float>(static_cast<double>(logits[static_cast<size_t>(order[i])]) - log_z));
  }
  return out;
}

Result<GenerateResult> Generate(InferenceContext& ctx, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                                const GenerateOptions& options, const TextSink& on_text) {
  if (prompt.empty()) return Status::InvalidArgument("the prompt is empty and the model adds no BOS token");
  if (ctx.pos() != 0) return Status::Internal("Generate: the context is at position " + std::to_string(ctx.pos()));
  return GenerateFrom(ctx, tokenizer, prompt, options, on_text, nullptr);
}

Result<GenerateResult> GenerateCached(InferenceContext& ctx, HeldTokens* held, bool reuse, const Tokenizer& tokenizer,
                                      std::span<const int32_t> prompt, const GenerateOptions& options,
                                      const TextSink& on_text) {
  if (prompt.empty()) return Status::InvalidArgument("the prompt is empty and the model adds no BOS token");
  std::vector<int32_t>& ids = held->ids;
  if (static_cast<int64_t>(ids.size()) != ctx.pos()) {
    return Status::Internal("GenerateCached: " + std::to_string(ids.size()) + " held tokens for a context at " +
                            "position " + std::to_string(ctx.pos()));
  }
  const size_t limit = std::min(ids.size(), prompt.size() - 1);
  size_t keep = 0;
  if (reuse && !ScoresPrompt(options)) {
    while (keep < limit && ids[keep] == prompt[keep]) ++keep;
    if (!ctx.CanRewind(static_cast<int64_t>(keep))) keep = 0;
  }
  if (keep > 0) {
    NF_RETURN_IF_ERROR(ctx.Rewind(static_cast<int64_t>(keep)));
  } else {
    ctx.Reset();
  }
  ids.resize(keep);
  std::vector<int32_t> sampled;
  auto r = GenerateFrom(ctx, tokenizer, prompt, options, on_text, &sampled);
  if (!r.ok()) {
    ctx.Reset();
    ids.clear();
    return r;
  }
  // The context holds the prompt, then every sampled token but the last (sampled, never evaluated).
  ids.assign(prompt.begin(), prompt.end());
  ids.insert(ids.end(), sampled.begin(), sampled.end());
  ids.resize(static_cast<size_t>(ctx.pos()));
  return r;
}

}  // namespace nflash
