// Next-token sampling (greedy, temperature, top-k, top-p, min-p, repetition penalty; seeded) and stop conditions.
//
// Order of application, as llama.cpp's default chain:
//   1. repetition penalty over the last `repeat_last_n` accepted tokens (a positive logit is divided by the penalty,
//      a negative one multiplied, once per distinct token);
//   2. greedy when temperature == 0: the argmax (lowest id on ties) of the penalised logits, nothing else applies;
//   3. top-k (keep the k largest logits; ties broken by lower id);
//   4. top-p (keep the smallest prefix of the sorted candidates whose softmax mass reaches p);
//   5. min-p (keep candidates whose probability is at least min_p times the largest);
//   6. temperature (logits / T), softmax over the survivors, one draw from the seeded generator.
// Steps 4 and 5 use the probabilities at temperature 1 (before step 6), as llama.cpp does.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/status.h"

namespace nflash {

struct SamplerConfig {
  float temperature = 0.8f;    // 0: greedy
  int32_t top_k = 40;          // <= 0: disabled
  float top_p = 0.95f;         // >= 1: disabled
  float min_p = 0.05f;         // <= 0: disabled
  float repeat_penalty = 1.0f; // 1: disabled
  int32_t repeat_last_n = 64;  // how many recent tokens the penalty looks at
  uint64_t seed = 0;
};

// A candidate token while sampling: its id, logit and (after Softmax) probability.
struct TokenCandidate {
  int32_t id = 0;
  float logit = 0;
  float p = 0;
};

// Thread-safety: not thread-safe (holds the generator and the token history); one per sequence.
class Sampler {
 public:
  // InvalidArgument for a negative/NaN temperature, top_p outside (0, 1], min_p outside [0, 1], a non-positive
  // repeat_penalty, or a negative repeat_last_n.
  static Result<Sampler> Create(const SamplerConfig& config);

  // Picks the next token from `logits` (n_vocab values). Does not record it: call Accept (the caller may also
  // accept prompt tokens so the penalty sees them).
  int32_t Sample(std::span<const float> logits);
  // Adds a token to the penalty history.
  void Accept(int32_t token);
  // Clears the history and re-seeds the generator with `seed`.
  void Reset(uint64_t seed);
  const SamplerConfig& config() const { return config_; }
  // The last tokens the penalty considers, oldest first.
  const std::deque<int32_t>& history() const { return history_; }

  // The steps, exposed for tests and custom chains. All keep `c` sorted by logit descending (ties: lower id first)
  // except ApplyRepetitionPenalty, which works on any order.
  static void ApplyRepetitionPenalty(std::span<const int32_t> recent, float penalty, std::vector<TokenCandidate>* c);
  static void SortByLogit(std::vector<TokenCandidate>* c);
  static void Softmax(std::vector<TokenCandidate>* c);  // fills p; `c` must be sorted (the first logit is the max)
  static void TopK(int32_t k, std::vector<TokenCandidate>* c);
  static void TopP(float p, std::vector<TokenCandidate>* c);
  static void MinP(float min_p, std::vector<TokenCandidate>* c);
  // Draws an index into `c` with probability proportional to exp(logit / temperature), from a uniform u in [0, 1).
  static size_t Draw(const std::vector<TokenCandidate>& c, float temperature, double u);

 private:
  explicit Sampler(const SamplerConfig& config);
  // A uniform double in [0, 1) from the 53 high bits of one draw (defined bit for bit, unlike
  // std::uniform_real_distribution, so a seed gives the same tokens with every standard library).
  double Uniform();

  SamplerConfig config_;
  std::mt19937_64 rng_;
  std::deque<int32_t> history_;
  std::vector<TokenCandidate> candidates_;  // reused between calls
};

enum class StopReason : uint8_t {
  kNone = 0,
  kEos,         // the end-of-sequence token, or an end-of-turn marker, was generated
  kBos,         // BOS was generated (llama2.c models end a story this way)
  kMaxTokens,   // the token budget is used up
  kStopString,  // the text produced contains a stop string
};
const char* StopReasonName(StopReason reason);

struct StopConfig {
  // Tokens that end generation (StopReason::kEos): EOS and the end-of-turn markers, Tokenizer::end_of_generation_ids.
  std::vector<int32_t> end_ids;
  int32_t bos_id = -1;      // -1: not checked
  int64_t max_tokens = -1;  // generated tokens; < 0: unlimited
  std::vector<std::string> stop_strings;
};

// Decides when generation ends, and which text may be shown: text that could be the start of a stop string is held
// back until it is known not to be one, so a stop string split across tokens is never shown (not even in part).
// Feed it each generated token with the text the Detokenizer produced for it.
// Thread-safety: not thread-safe; one per sequence.
class StopChecker {
 public:
  explicit StopChecker(StopConfig config);
  // Returns why generation stops after `token` (kNone: go on). `*emit` receives the text that may be shown now:
  // for kEos/kBos the held-back text (the stop token itself has no text); for kStopString the text before the stop
  // string; for kMaxTokens the piece and the held-back text.
  StopReason Push(int32_t token, std::string_view piece, std::string* emit);
  // Text still held back (call when generation ends for another reason, e.g. the context is full).
  std::string Flush();
  int64_t n_tokens() const { return n_tokens_; }
  // The stop string that matched, if any.
  const std::string& matched() const { return matched_; }

 private:
  StopConfig config_;
  std::string held_;  // a suffix of the output that is a prefix of some stop string
  int64_t n_tokens_ = 0;
  std::string matched_;
};

}  // namespace nflash
