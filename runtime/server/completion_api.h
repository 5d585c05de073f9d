// The request and response bodies of `nflash serve`'s completion endpoints (docs/server.md): POST /completion in
// llama.cpp's server style and POST /v1/completions in OpenAI's. Parsing checks every field against the served model
// (its tokenizer and context size) before any work starts, so a bad request costs no inference and gets an error that
// names the field, what was expected and what was found.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/status.h"
#include "runtime/engine/generate.h"
#include "runtime/text/chat_template.h"
#include "runtime/text/tokenizer.h"

namespace nflash::server {

enum class ApiStyle {
  kLlamaCpp,    // POST /completion: n_predict, content, tokens_predicted, stop_reason, timings
  kOpenAi,      // POST /v1/completions: max_tokens, choices[0].text, finish_reason, usage
  kOpenAiChat,  // POST /v1/chat/completions: messages, max_tokens, choices[0].message / delta, finish_reason, usage
};

// Defaults where a request leaves a field out. /completion follows llama.cpp's server (the Sampler's defaults, as many
// tokens as the context holds would be unbounded, so a fixed number instead); /v1/completions follows OpenAI's
// (max_tokens 16, temperature 1, top_p 1) and the Sampler's for the rest.
inline constexpr int64_t kDefaultPredictLlamaCpp = 128;
inline constexpr int64_t kDefaultMaxTokensOpenAi = 16;
// The most alternatives a request may ask for with each token's log-probability (OpenAI allows 5 legacy, 20 chat).
inline constexpr int kMaxTopLogprobs = 20;

// A checked request. Thread-safety: a value type.
struct CompletionRequest {
  ApiStyle style = ApiStyle::kLlamaCpp;
  std::vector<int32_t> prompt_ids;  // BOS included when the model wants it
  GenerateOptions options;          // sampler (seed resolved), max_tokens, stop strings
  bool stream = false;
  // Keep the longest prefix of the prompt the context still holds from the previous request (llama.cpp's field;
  // GenerateCached): false evaluates the whole prompt.
  bool cache_prompt = true;
  // Chat with a reasoning template (ChatThinking): the reply is returned split into reasoning_content and content
  // (SplitReasoning; `reasoning_opened`: the prompt opened the think block, ChatThinking::kForced).
  bool split_reasoning = false;
  bool reasoning_opened = false;
};

// The served model as requests are checked against it.
struct RequestLimits {
  const Tokenizer* tokenizer = nullptr;
  int64_t n_ctx = 0;                 // tokens the context holds
  const ChatTemplate* chat = nullptr;  // the format chat messages are written in; nullptr: no chat
  std::string no_chat;                 // why there is no chat format (the error a chat request gets)
};

// Parses `body` for `style` against `limits`. `random_seed` is used when the request gives no seed (or -1).
// InvalidArgument with a message naming the field: body not JSON or not an object, a field of the wrong type or out
// of range, n_predict/max_tokens larger than the room the prompt leaves in the context, a prompt that does not fit,
// a chat message that is malformed or that the chat format refuses (or a chat request when the model has no format).
// A prompt may be given as an array of token ids instead of text (llama.cpp's and OpenAI's APIs allow it), used as
// it is: BOS only when the array has it. A chat's messages are written in limits.chat's format and encoded with their
// special tokens parsed; its max_tokens (or max_completion_tokens) defaults to the room left in the context: the
// model ends its turn itself.
Result<CompletionRequest> ParseCompletionRequest(std::string_view body, ApiStyle style, const RequestLimits& limits,
                                                 uint64_t random_seed);

// The API's name of why generation stopped: "eos" (end of sequence; a llama2.c model's BOS too), "stop" (a stop
// string), "length" (the token budget or the context is used up).
const char* StopReasonField(StopReason reason);

// llama.cpp style: the summary of a finished generation (tokens_predicted, tokens_evaluated, stop_reason, timings,
// seed, stop = true); the non-streamed response adds "content", the last streamed event an empty one.
nlohmann::json LlamaCppSummary(const CompletionRequest& request, const GenerateResult& result, const std::string& model);

// OpenAI style: the response object ("text_completion") with one choice holding `text`; `finish_reason` null and no
// usage for a streamed chunk before the last (`result` == nullptr).
nlohmann::json OpenAiCompletion(const std::string& id, int64_t created, const std::string& model,
                                const std::string& text, const GenerateResult* result);

// OpenAI chat style: the response object ("chat.completion", choices[0].message) with `text`, or with `result` ==
// nullptr a streamed chunk ("chat.completion.chunk") whose delta carries `text` (and the role when `first`); the last
// chunk (`result` given, `stream`) has an empty delta, the finish_reason and the usage.
nlohmann::json OpenAiChatCompletion(const std::string& id, int64_t created, const std::string& model,
                                    const std::string& text, const GenerateResult* result, bool stream, bool first);

// The log-probabilities of a finished generation (GenerateResult::logprobs) in the request's shape: llama.cpp's
// completion_probabilities ([{id, token, logprob, bytes, top_logprobs: [{id, token, logprob, bytes}]}]) and chat's
// ({content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}), each token's text its
// Tokenizer::DecodeToken; OpenAI's legacy choices[0].logprobs ({tokens, token_logprobs, top_logprobs: [{token:
// logprob}], text_offset}), each token's text what it adds to the returned text (a character split over tokens comes
// with its last one) and text_offset its byte offset there; with echo (/v1/completions' field, parsed into
// options.echo_prompt and, with logprobs, options.prompt_logprobs) the prompt's tokens come first, the first with
// null log-probability and alternatives.
nlohmann::json LogprobsJson(const CompletionRequest& request, const GenerateResult& result, const Tokenizer& tokenizer);

// LogprobsJson a piece at a time, for a stream: each Take() gives the tokens Add()ed since the previous one in the
// request's shape, so that the pieces' lists joined are the whole generation's (the legacy format's token texts and
// text offsets continue from piece to piece). `echo` (may be null): the legacy format with echo lists the prompt's
// tokens first, with echo->prompt_logprobs. Not thread-safe; `tokenizer` must outlive it.
class LogprobsWriter {
 public:
  LogprobsWriter(const CompletionRequest& request, const Tokenizer& tokenizer, const GenerateResult* echo);
  void Add(std::span<const TokenLogprob> tokens);
  nlohmann::json Take();

 private:
  void Clear();
  void AddLegacy(int32_t id, const TokenLogprob* t);  // t null: a prompt token with no log-probability

  ApiStyle style_;
  const Tokenizer& tokenizer_;
  Detokenizer detok_;  // the legacy format's: prompt and generated tokens in order
  size_t offset_ = 0;  // the legacy format's byte offset of the next token's text
  nlohmann::json out_;
};

// POST /tokenize (llama.cpp's): {"content": text, "add_special": false, "parse_special": false, "with_pieces": false}
// -> {"tokens": [id, ...]} (BOS first with add_special when the model adds one; control-token texts become those tokens
// with parse_special; with_pieces: [{"id", "piece"}], the piece being the token's text). InvalidArgument naming the
// field.
Result<nlohmann::json> TokenizeResponse(std::string_view body, const Tokenizer& tokenizer);
// POST /detokenize (llama.cpp's): {"tokens": [id, ...]} -> {"content": text} (control tokens give no text).
// InvalidArgument naming the field, or the token id outside the vocabulary.
Result<nlohmann::json> DetokenizeResponse(std::string_view body, const Tokenizer& tokenizer);

// {"error": {"message": ..., "type": ..., "code": status}}: the body of every error response (OpenAI's shape, which
// llama.cpp's server uses too).
nlohmann::json ErrorBody(int status, const std::string& message);

}  // namespace nflash::server
