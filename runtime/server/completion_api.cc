// Completion request parsing and response bodies (see completion_api.h).
#include "runtime/server/completion_api.h"

#include <cmath>
#include <limits>
#include <optional>

#include "runtime/core/json_fields.h"

namespace nflash::server {
namespace {

// Every error names the request as its source: "request: field 'top_p' ...".
constexpr const char* kSource = "request";

// JsonFields reports a malformed document as Corruption; to a client it is a bad request.
Status BadRequest(const Status& s) { return s.ok() ? s : Status::InvalidArgument(s.message()); }

// Reads `key` into `*out` when the request has it; leaves `*out` (the default) otherwise.
template <typename T>
Status Optional(const JsonFields& fields, std::string_view key, T* out) {
  if (!fields.Has(key)) return Status::Ok();
  return BadRequest(fields.Get(key, out));
}

// A range bound as people write it: 1, 0.5 (not 1.000000).
std::string FormatNumber(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// A number field in [lo, hi] (or (lo, hi] when `lo_open`); a float (the Sampler's type) when present.
Status OptionalNumber(const JsonFields& fields, std::string_view key, double lo, bool lo_open, double hi, float* out) {
  if (!fields.Has(key)) return Status::Ok();
  double v = 0;
  NF_RETURN_IF_ERROR(BadRequest(fields.Get(key, &v)));
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
  if (!ok) {
    const std::string range = std::isinf(hi) ? std::string(lo_open ? "> " : ">= ") + FormatNumber(lo)
                                             : std::string(lo_open ? "(" : "[") + FormatNumber(lo) + ", " +
                                                   FormatNumber(hi) + "]";
    return Status::InvalidArgument(std::string(kSource) + ": field '" + std::string(key) + "' is out of range: " +
                                   "expected a number " + (std::isinf(hi) ? "" : "in ") + range + ", found " +
                                   fields.value()[std::string(key)].dump());
  }
  *out = static_cast<float>(v);
  return Status::Ok();
}

// The request's field at `path` (e.g. "messages[2].content") has the wrong type.
Status WrongType(const std::string& path, const std::string& expected, const nlohmann::json& found) {
  return BadRequest(JsonWrongType(JsonLocation(kSource, path), expected, found));
}

// "stop": one string or an array of strings (OpenAI allows both; llama.cpp sends an array).
Status OptionalStop(const JsonFields& fields, std::vector<std::string>* out) {
  if (!fields.Has("stop")) return Status::Ok();
  const nlohmann::json& v = fields.value()["stop"];
  if (v.is_string()) {
    out->push_back(v.get<std::string>());
    return Status::Ok();
  }
  const auto wrong = [](const std::string& path, const nlohmann::json& found) {
    return WrongType(path, "a string or an array of strings", found);
  };
  if (!v.is_array()) return wrong("stop", v);
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) return wrong("stop[" + std::to_string(i) + "]", v[i]);
    out->push_back(v[i].get<std::string>());
  }
  return Status::Ok();
}

// "seed": an unsigned 64-bit integer, or -1 (llama.cpp's "random").
Status OptionalSeed(const JsonFields& fields, uint64_t random_seed, uint64_t* out) {
  *out = random_seed;
  if (!fields.Has("seed")) return Status::Ok();
  const nlohmann::json& v = fields.value()["seed"];
  if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() == -1) return Status::Ok();
  return BadRequest(fields.Get("seed", out));
}

// The request body as JSON (InvalidArgument when it is not).
Result<nlohmann::json> ParseBody(std::string_view body) {
  try {
    return nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string(kSource) + ": the body is not JSON (" + e.what() + ")");
  }
}

double PerSecond(int64_t n, double ms) { return ms > 0 ? static_cast<double>(n) * 1000.0 / ms : 0.0; }

// An array of token ids of the vocabulary (field `field`), for /detokenize and prompts given as ids.
Result<std::vector<int32_t>> TokenIds(const nlohmann::json& list, const std::string& field,
                                      const Tokenizer& tokenizer) {
  if (!list.is_array()) return WrongType(field, "an array of token ids", list);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < list.size(); ++i) {
    const bool id = list[i].is_number_integer() && list[i].get<int64_t>() >= 0 &&
                    list[i].get<int64_t>() < tokenizer.n_vocab();
    if (!id) {
      return WrongType(field + "[" + std::to_string(i) + "]",
                       "a token id in [0, " + std::to_string(tokenizer.n_vocab()) + ")", list[i]);
    }
    ids.push_back(static_cast<int32_t>(list[i].get<int64_t>()));
  }
  return ids;
}

// "messages": [{"role": ..., "content": ...}, ...], content a string, null (an assistant turn without text) or an
// array of parts of which only {"type": "text", "text": ...} are accepted (joined with newlines).
Result<std::vector<ChatMessage>> ParseMessages(const JsonFields& fields) {
  if (!fields.Has("messages")) {
    return Status::InvalidArgument(std::string(kSource) + ": missing field 'messages' (the conversation)");
  }
  const nlohmann::json& list = fields.value()["messages"];
  if (!list.is_array()) return WrongType("messages", "an array of messages", list);
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = "messages[" + std::to_string(i) + "]";
    const nlohmann::json& m = list[i];
    if (!m.is_object()) return WrongType(at, "an object with 'role' and 'content'", m);
    if (!m.contains("role")) return Status::InvalidArgument(std::string(kSource) + ": missing field '" + at + ".role'");
    if (!m["role"].is_string()) return WrongType(at + ".role", "a string", m["role"]);
    ChatMessage msg{m["role"].get<std::string>(), ""};
    const nlohmann::json content = m.contains("content") ? m["content"] : nlohmann::json();
    if (content.is_string()) {
      msg.content = content.get<std::string>();
    } else if (content.is_array()) {
      for (size_t k = 0; k < content.size(); ++k) {
        const nlohmann::json& part = content[k];
        const std::string part_at = at + ".content[" + std::to_string(k) + "]";
        const bool text_part = part.is_object() && part.value("type", "") == "text" && part.contains("text") &&
                               part["text"].is_string();
        if (!text_part) {
          return WrongType(part_at, "a text part {\"type\": \"text\", \"text\": ...} (nflash reads text only)", part);
        }
        msg.content += (k ? "\n" : "") + part["text"].get<std::string>();
      }
    } else if (!content.is_null()) {
      return WrongType(at + ".content", "a string or an array of text parts", content);
    }
    out.push_back(std::move(msg));
  }
  return out;
}

// The log-probability fields, into GenerateOptions::top_logprobs (-1: none): /completion's n_probs (llama.cpp: 0 is
// none), /v1/completions' logprobs (null or 0..kMaxTopLogprobs alternatives), /v1/chat/completions' logprobs (a bool)
// with top_logprobs (0..kMaxTopLogprobs, only with logprobs true, as OpenAI's).
Status ParseLogprobs(const JsonFields& fields, ApiStyle style, int* top) {
  const nlohmann::json& doc = fields.value();
  auto count = [&](const char* key, int* out) -> Status {
    const nlohmann::json& v = doc[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTopLogprobs) {
      return WrongType(key, "an integer from 0 to " + std::to_string(kMaxTopLogprobs), v);
    }
    *out = static_cast<int>(v.get<int64_t>());
    return Status::Ok();
  };
  const char* key = "logprobs";
  if (style == ApiStyle::kLlamaCpp) {
    key = "n_probs";
    if (fields.Has(key)) NF_RETURN_IF_ERROR(count(key, top));
    if (*top == 0) *top = -1;
  } else if (style == ApiStyle::kOpenAi) {
    if (fields.Has(key) && !doc[key].is_null()) NF_RETURN_IF_ERROR(count(key, top));
  } else {
    bool wanted = false;
    NF_RETURN_IF_ERROR(Optional(fields, key, &wanted));
    int n = 0;
    if (fields.Has("top_logprobs") && !doc["top_logprobs"].is_null()) {
      NF_RETURN_IF_ERROR(count("top_logprobs", &n));
      if (!wanted) {
        return Status::InvalidArgument(std::string(kSource) + ": field 'top_logprobs' needs 'logprobs': true");
      }
    }
    if (wanted) *top = n;
  }
  return Status::Ok();
}

}  // namespace

Result<CompletionRequest> ParseCompletionRequest(std::string_view body, ApiStyle style, const RequestLimits& limits,
                                                 uint64_t random_seed) {
  const Tokenizer& tokenizer = *limits.tokenizer;
  const int64_t n_ctx = limits.n_ctx;
  NF_ASSIGN_OR_RETURN(const nlohmann::json doc, ParseBody(body));
  auto fields_or = JsonFields::Of(doc, JsonLocation(kSource));
  if (!fields_or.ok()) return BadRequest(fields_or.status());
  const JsonFields& fields = *fields_or;

  CompletionRequest r;
  r.style = style;
  const bool chat = style == ApiStyle::kOpenAiChat;
  const bool openai = style == ApiStyle::kOpenAi || chat;
  // Chat: max_completion_tokens, OpenAI's newer name, when given.
  const char* const count_key = !openai                                  ? "n_predict"
                                : chat && fields.Has("max_completion_tokens") ? "max_completion_tokens"
                                                                         : "max_tokens";
  std::string prompt;
  std::vector<ChatMessage> messages;
  std::optional<std::vector<int32_t>> given_ids;  // a prompt given as token ids, used as they are
  if (chat) {
    NF_ASSIGN_OR_RETURN(messages, ParseMessages(fields));
  } else if (fields.Has("prompt") && fields.value()["prompt"].is_array()) {
    NF_ASSIGN_OR_RETURN(given_ids, TokenIds(fields.value()["prompt"], "prompt", tokenizer));
    if (given_ids->empty()) {
      return Status::InvalidArgument(std::string(kSource) + ": field 'prompt' is an empty array of token ids");
    }
  } else if (fields.Has("prompt") && !fields.value()["prompt"].is_string()) {
    return WrongType("prompt", "a string or an array of token ids", fields.value()["prompt"]);
  } else {
    NF_RETURN_IF_ERROR(BadRequest(fields.Get("prompt", &prompt)));
  }
  if (openai && fields.Has("model")) {
    std::string model;  // any name is accepted: the server has one model
    NF_RETURN_IF_ERROR(BadRequest(fields.Get("model", &model)));
  }
  int64_t max_tokens = -1;
  NF_RETURN_IF_ERROR(Optional(fields, count_key, &max_tokens));
  if (fields.Has(count_key) && max_tokens < 0) {
    return Status::InvalidArgument(std::string(kSource) + ": field '" + count_key + "' is out of range: expected 0 " +
                                   "or more, found " + std::to_string(max_tokens));
  }
  SamplerConfig& s = r.options.sampler;
  if (openai) {
    s.temperature = 1.0f;
    s.top_p = 1.0f;
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  NF_RETURN_IF_ERROR(OptionalNumber(fields, "temperature", 0, false, kInf, &s.temperature));
  NF_RETURN_IF_ERROR(Optional(fields, "top_k", &s.top_k));
  NF_RETURN_IF_ERROR(OptionalNumber(fields, "top_p", 0, true, 1, &s.top_p));
  NF_RETURN_IF_ERROR(OptionalNumber(fields, "min_p", 0, false, 1, &s.min_p));
  NF_RETURN_IF_ERROR(OptionalNumber(fields, "repeat_penalty", 0, true, kInf, &s.repeat_penalty));
  NF_RETURN_IF_ERROR(Optional(fields, "repeat_last_n", &s.repeat_last_n));
  if (s.repeat_last_n < 0) {
    return Status::InvalidArgument(std::string(kSource) + ": field 'repeat_last_n' is out of range: expected 0 or " +
                                   "more, found " + std::to_string(s.repeat_last_n));
  }
  NF_RETURN_IF_ERROR(OptionalSeed(fields, random_seed, &s.seed));
  NF_RETURN_IF_ERROR(Optional(fields, "stream", &r.stream));
  NF_RETURN_IF_ERROR(Optional(fields, "ignore_eos", &r.options.ignore_eos));
  NF_RETURN_IF_ERROR(Optional(fields, "cache_prompt", &r.cache_prompt));
  NF_RETURN_IF_ERROR(OptionalStop(fields, &r.options.stop_strings));
  NF_RETURN_IF_ERROR(ParseLogprobs(fields, style, &r.options.top_logprobs));
  if (style == ApiStyle::kOpenAi) {
    // echo: the prompt's text (and, with logprobs, its tokens' log-probabilities, which evaluate it whole) first.
    NF_RETURN_IF_ERROR(Optional(fields, "echo", &r.options.echo_prompt));
    r.options.prompt_logprobs = r.options.echo_prompt && r.options.top_logprobs >= 0;
    // The prompt's log-probabilities are known only once it is evaluated, after its echoed text has been sent.
    if (r.options.prompt_logprobs && r.stream) {
      return Status::InvalidArgument(std::string(kSource) + ": fields 'echo' and 'logprobs' with 'stream': true are " +
                                     "not supported together (ask without streaming, or without echo)");
    }
  }

  ChatOptions chat_options;
  if (chat && fields.Has("chat_template_kwargs") && !fields.value()["chat_template_kwargs"].is_null()) {
    // The template's arguments (vLLM's and llama.cpp's field); nflash's formats read enable_thinking, others are
    // ignored as a template that does not read them ignores them.
    const nlohmann::json& kw = fields.value()["chat_template_kwargs"];
    if (!kw.is_object()) return WrongType("chat_template_kwargs", "an object", kw);
    if (kw.contains("enable_thinking")) {
      if (!kw["enable_thinking"].is_boolean()) {
        return WrongType("chat_template_kwargs.enable_thinking", "true or false", kw["enable_thinking"]);
      }
      chat_options.enable_thinking = kw["enable_thinking"].get<bool>();
    }
  }
  if (chat) {
    if (limits.chat == nullptr) return Status::InvalidArgument(std::string(kSource) + ": " + limits.no_chat);
    r.split_reasoning = limits.chat->thinking != ChatThinking::kNone;
    r.reasoning_opened = limits.chat->thinking == ChatThinking::kForced;
    auto text = FormatChat(*limits.chat, messages, tokenizer.TokenText(tokenizer.bos_id()),
                           tokenizer.TokenText(tokenizer.eos_id()), chat_options);
    if (!text.ok()) return Status::InvalidArgument(std::string(kSource) + ": " + text.status().message());
    prompt = *std::move(text);
  }
  r.prompt_ids =
      given_ids ? *std::move(given_ids) : tokenizer.Encode(prompt, tokenizer.add_bos(), /*parse_special=*/chat);
  const int64_t n_prompt = static_cast<int64_t>(r.prompt_ids.size());
  if (n_prompt == 0) {
    return Status::InvalidArgument(std::string(kSource) + ": field 'prompt' is empty and the model adds no BOS token");
  }
  if (n_prompt >= n_ctx) {
    return Status::InvalidArgument(std::string(kSource) + ": field '" + (chat ? "messages" : "prompt") +
                                   "' is too long: expected at most " +
                                   std::to_string(n_ctx - 1) + " tokens (the context holds " + std::to_string(n_ctx) +
                                   "), found " + std::to_string(n_prompt));
  }
  const int64_t room = n_ctx - n_prompt;
  if (max_tokens > room) {
    return Status::InvalidArgument(std::string(kSource) + ": field '" + count_key + "' is too large for the " +
                                   "context: expected at most " + std::to_string(room) + " (the prompt takes " +
                                   std::to_string(n_prompt) + " of " + std::to_string(n_ctx) + " tokens), found " +
                                   std::to_string(max_tokens));
  }
  const int64_t fallback = chat ? room : openai ? kDefaultMaxTokensOpenAi : kDefaultPredictLlamaCpp;
  r.options.max_tokens = max_tokens >= 0 ? max_tokens : std::min(fallback, room);
  return r;
}

const char* StopReasonField(StopReason reason) {
  switch (reason) {
    case StopReason::kEos:
    case StopReason::kBos: return "eos";
    case StopReason::kStopString: return "stop";
    default: return "length";
  }
}

nlohmann::json LlamaCppSummary(const CompletionRequest& request, const GenerateResult& result, const std::string& model) {
  // The prompt tokens this request ran through the model (llama.cpp's prompt_n); cache_n were kept from the last one.
  const int64_t evaluated = result.prompt_tokens - result.cached_tokens;
  nlohmann::json j = {
      {"model", model},
      {"stop", true},
      {"tokens_predicted", result.generated_tokens},
      {"tokens_evaluated", result.prompt_tokens},
      {"stop_reason", StopReasonField(result.reason)},
      {"seed", request.options.sampler.seed},
      {"timings",
       {{"cache_n", result.cached_tokens},
        {"prompt_n", evaluated},
        {"prompt_ms", result.prefill_ms},
        {"prompt_per_second", PerSecond(evaluated, result.prefill_ms)},
        {"predicted_n", result.generated_tokens},
        {"predicted_ms", result.decode_ms},
        {"predicted_per_second", PerSecond(result.generated_tokens, result.decode_ms)}}},
  };
  if (result.reason == StopReason::kStopString) j["stopping_word"] = result.stop_string;
  return j;
}

namespace {

nlohmann::json OpenAiUsage(const GenerateResult& result) {
  return {{"prompt_tokens", result.prompt_tokens},
          {"completion_tokens", result.generated_tokens},
          {"total_tokens", result.prompt_tokens + result.generated_tokens},
          {"prompt_tokens_details", {{"cached_tokens", result.cached_tokens}}}};
}

}  // namespace

nlohmann::json OpenAiCompletion(const std::string& id, int64_t created, const std::string& model,
                                const std::string& text, const GenerateResult* result) {
  nlohmann::json choice = {{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  nlohmann::json j = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model}};
  if (result) {
    // OpenAI has no "eos": the model ending the text and a stop string are both "stop".
    choice["finish_reason"] = std::string(StopReasonField(result->reason)) == "length" ? "length" : "stop";
    j["usage"] = OpenAiUsage(*result);
  }
  j["choices"] = nlohmann::json::array({choice});
  return j;
}

nlohmann::json OpenAiChatCompletion(const std::string& id, int64_t created, const std::string& model,
                                    const std::string& text, const GenerateResult* result, bool stream, bool first) {
  nlohmann::json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  nlohmann::json j = {{"id", id},
                      {"object", stream ? "chat.completion.chunk" : "chat.completion"},
                      {"created", created},
                      {"model", model}};
  if (!stream) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["delta"] = nlohmann::json::object();
    if (first) choice["delta"]["role"] = "assistant";
    if (result == nullptr) choice["delta"]["content"] = text;
  }
  if (result) {
    choice["finish_reason"] = std::string(StopReasonField(result->reason)) == "length" ? "length" : "stop";
    j["usage"] = OpenAiUsage(*result);
  }
  j["choices"] = nlohmann::json::array({choice});
  return j;
}

LogprobsWriter::LogprobsWriter(const CompletionRequest& request, const Tokenizer& tokenizer, const GenerateResult* echo)
    : style_(request.style), tokenizer_(tokenizer), detok_(tokenizer) {
  Clear();
  // The legacy format's token texts are what each adds to the returned text: the prompt goes through the same
  // detokenizer first, listed when echoed.
  if (style_ != ApiStyle::kOpenAi) return;
  for (size_t i = 0; i < request.prompt_ids.size(); ++i) {
    if (!request.options.echo_prompt) {
      detok_.Push(request.prompt_ids[i]);
      continue;
    }
    const bool known = echo != nullptr && i > 0 && i - 1 < echo->prompt_logprobs.size();
    AddLegacy(request.prompt_ids[i], known ? &echo->prompt_logprobs[i - 1] : nullptr);
  }
}

void LogprobsWriter::Clear() {
  if (style_ == ApiStyle::kOpenAi) {
    out_ = {{"tokens", nlohmann::json::array()},
            {"token_logprobs", nlohmann::json::array()},
            {"top_logprobs", nlohmann::json::array()},
            {"text_offset", nlohmann::json::array()}};
  } else {
    out_ = nlohmann::json::array();
  }
}

void LogprobsWriter::AddLegacy(int32_t id, const TokenLogprob* t) {
  const std::string text = detok_.Push(id);
  out_["tokens"].push_back(text);
  out_["text_offset"].push_back(offset_);
  offset_ += text.size();
  if (t == nullptr) {
    out_["token_logprobs"].push_back(nullptr);
    out_["top_logprobs"].push_back(nullptr);
    return;
  }
  out_["token_logprobs"].push_back(t->logprob);
  nlohmann::json top = nlohmann::json::object();
  // Least likely first, so that of two alternatives with the same text the likelier is the one kept.
  for (auto it = t->top.rbegin(); it != t->top.rend(); ++it) top[tokenizer_.DecodeToken(it->first)] = it->second;
  out_["top_logprobs"].push_back(std::move(top));
}

void LogprobsWriter::Add(std::span<const TokenLogprob> tokens) {
  auto bytes = [](const std::string& text) {
    nlohmann::json b = nlohmann::json::array();
    for (unsigned char c : text) b.push_back(static_cast<int>(c));
    return b;
  };
  auto entry = [&](int32_t id, float logprob) {
    const std::string text = tokenizer_.DecodeToken(id);
    nlohmann::json e = {{"token", text}, {"logprob", logprob}, {"bytes", bytes(text)}};
    if (style_ == ApiStyle::kLlamaCpp) e["id"] = id;
    return e;
  };
  for (const TokenLogprob& t : tokens) {
    if (style_ == ApiStyle::kOpenAi) {
      AddLegacy(t.id, &t);
      continue;
    }
    nlohmann::json e = entry(t.id, t.logprob), top = nlohmann::json::array();
    for (const auto& [id, lp] : t.top) top.push_back(entry(id, lp));
    e["top_logprobs"] = std::move(top);
    out_.push_back(std::move(e));
  }
}

nlohmann::json LogprobsWriter::Take() {
  nlohmann::json out = std::move(out_);
  Clear();
  if (style_ == ApiStyle::kOpenAiChat) return {{"content", std::move(out)}};
  return out;
}

nlohmann::json LogprobsJson(const CompletionRequest& request, const GenerateResult& result, const Tokenizer& tokenizer) {
  LogprobsWriter writer(request, tokenizer, &result);
  writer.Add(result.logprobs);
  return writer.Take();
}

Result<nlohmann::json> TokenizeResponse(std::string_view body, const Tokenizer& tokenizer) {
  NF_ASSIGN_OR_RETURN(const nlohmann::json doc, ParseBody(body));
  auto fields_or = JsonFields::Of(doc, JsonLocation(kSource));
  if (!fields_or.ok()) return BadRequest(fields_or.status());
  const JsonFields& fields = *fields_or;
  std::string content;
  bool add_special = false, parse_special = false, with_pieces = false;
  NF_RETURN_IF_ERROR(BadRequest(fields.Get("content", &content)));
  NF_RETURN_IF_ERROR(Optional(fields, "add_special", &add_special));
  NF_RETURN_IF_ERROR(Optional(fields, "parse_special", &parse_special));
  NF_RETURN_IF_ERROR(Optional(fields, "with_pieces", &with_pieces));
  nlohmann::json tokens = nlohmann::json::array();
  for (int32_t id : tokenizer.Encode(content, add_special && tokenizer.add_bos(), parse_special)) {
    if (with_pieces) {
      tokens.push_back({{"id", id}, {"piece", tokenizer.DecodeToken(id)}});
    } else {
      tokens.push_back(id);
    }
  }
  return nlohmann::json{{"tokens", tokens}};
}

Result<nlohmann::json> DetokenizeResponse(std::string_view body, const Tokenizer& tokenizer) {
  NF_ASSIGN_OR_RETURN(const nlohmann::json doc, ParseBody(body));
  auto fields_or = JsonFields::Of(doc, JsonLocation(kSource));
  if (!fields_or.ok()) return BadRequest(fields_or.status());
  if (!fields_or->Has("tokens")) return Status::InvalidArgument(std::string(kSource) + ": missing field 'tokens'");
  NF_ASSIGN_OR_RETURN(const std::vector<int32_t> ids, TokenIds(doc["tokens"], "tokens", tokenizer));
  return nlohmann::json{{"content", tokenizer.Decode(ids)}};
}

nlohmann::json ErrorBody(int status, const std::string& message) {
  const char* type = status == 404 ? "not_found_error" : status >= 500 ? "server_error" : "invalid_request_error";
  return {{"error", {{"code", status}, {"message", message}, {"type", type}}}};
}

}  // namespace nflash::server
