// The HTTP routes, streaming and shutdown of `nflash serve` (see http_server.h).
#include "runtime/server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "runtime/core/log.h"
#include "runtime/engine/generate.h"
#include "runtime/server/completion_api.h"

namespace nflash::server {
namespace {

// Far above any prompt a context can hold (a 128K-token context is well under 1 MiB of text): a larger body is
// refused (413) before it is read into memory.
constexpr size_t kMaxBodyBytes = 8u << 20;

// The wire form of a JSON value. The Detokenizer emits complete UTF-8 only, but a stray invalid byte must become
// U+FFFD, never an exception in the middle of a stream.
std::string Dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

void SendJson(httplib::Response& res, int status, const nlohmann::json& j) {
  res.status = status;
  res.set_content(Dump(j), "application/json");
}

void SendError(httplib::Response& res, int status, const std::string& message) {
  SendJson(res, status, ErrorBody(status, message));
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void LogDone(const std::string& what, const GenerateResult& g) {
  NF_LOG(Info) << what << ": " << g.prompt_tokens << " prompt tokens (" << g.cached_tokens << " kept from the last "
               << "request) in " << g.prefill_ms << " ms, "
               << g.generated_tokens << " generated (" << StopReasonField(g.reason) << ") in " << g.decode_ms << " ms";
}

// One streamed completion's events (Server-Sent Events: `data: JSON`): each piece of text becomes an event in the
// route's format; with log-probabilities each event carries those of the tokens sampled since the previous one (the
// last event the rest: tokens that spelled a stop string), so that the events' lists joined are the non-streamed
// response's; a reasoning template's reply becomes deltas of reasoning_content, then of content (text that may be
// the start of a think tag waits for the next piece). Send and the event methods return false once a write fails
// (the client went away).
class EventStream {
 public:
  EventStream(httplib::DataSink& sink, const CompletionRequest& request, const Tokenizer& tokenizer, std::string id,
              int64_t created, std::string model_name)
      : sink_(sink),
        request_(request),
        id_(std::move(id)),
        created_(created),
        model_name_(std::move(model_name)),
        probs_(request, tokenizer, nullptr),
        reasoning_(request.reasoning_opened) {}

  bool Send(const std::string& data) {
    const std::string event = "data: " + data + "\n\n";
    return sink_.write(event.data(), event.size());
  }
  // The generation's options, collecting the sampled tokens' log-probabilities for the next event when asked for.
  GenerateOptions Options() {
    GenerateOptions options = request_.options;
    if (options.top_logprobs >= 0) options.on_logprob = [this](const TokenLogprob& t) { pending_.push_back(t); };
    return options;
  }
  // A chat stream opens with the assistant's role, as OpenAI's does.
  bool Open() {
    return request_.style != ApiStyle::kOpenAiChat ||
           Send(Dump(OpenAiChatCompletion(id_, created_, model_name_, "", nullptr, /*stream=*/true, /*first=*/true)));
  }
  bool Piece(std::string_view piece) {
    if (request_.split_reasoning) {
      const ReasoningSplit part = reasoning_.Push(piece);
      return part.reasoning.empty() && part.content.empty() ? true : ReasoningEvent(part);
    }
    const std::string text(piece);
    nlohmann::json event = request_.style == ApiStyle::kLlamaCpp ? nlohmann::json{{"content", text}, {"stop", false}}
                           : request_.style == ApiStyle::kOpenAi
                               ? OpenAiCompletion(id_, created_, model_name_, text, nullptr)
                               : OpenAiChatCompletion(id_, created_, model_name_, text, nullptr, true, false);
    Attach(&event);
    return Send(Dump(event));
  }
  // The held-back reasoning text, the summary, and OpenAI's [DONE].
  void Finish(const GenerateResult& g) {
    if (request_.style == ApiStyle::kLlamaCpp) {
      nlohmann::json last = LlamaCppSummary(request_, g, model_name_);
      last["content"] = "";
      Attach(&last);
      Send(Dump(last));
      return;
    }
    if (request_.split_reasoning) {
      const ReasoningSplit rest = reasoning_.Finish();
      if (!rest.reasoning.empty() || !rest.content.empty()) ReasoningEvent(rest);
    }
    nlohmann::json last = request_.style == ApiStyle::kOpenAi
                              ? OpenAiCompletion(id_, created_, model_name_, "", &g)
                              : OpenAiChatCompletion(id_, created_, model_name_, "", &g, /*stream=*/true,
                                                     /*first=*/false);
    Attach(&last);
    Send(Dump(last));
    Send("[DONE]");
  }

 private:
  // The event's log-probabilities: those of the tokens not sent yet.
  void Attach(nlohmann::json* event) {
    if (request_.options.top_logprobs < 0) return;
    probs_.Add(pending_);
    pending_.clear();
    if (request_.style == ApiStyle::kLlamaCpp) {
      (*event)["completion_probabilities"] = probs_.Take();
    } else {
      (*event)["choices"][0]["logprobs"] = probs_.Take();
    }
  }
  bool ReasoningEvent(const ReasoningSplit& part) {
    nlohmann::json event = OpenAiChatCompletion(id_, created_, model_name_, "", nullptr, true, false);
    nlohmann::json& delta = event["choices"][0]["delta"];
    delta = nlohmann::json::object();
    if (!part.reasoning.empty()) delta["reasoning_content"] = part.reasoning;
    if (!part.content.empty()) delta["content"] = part.content;
    Attach(&event);
    return Send(Dump(event));
  }

  httplib::DataSink& sink_;
  const CompletionRequest& request_;
  std::string id_;
  int64_t created_;
  std::string model_name_;
  LogprobsWriter probs_;
  std::vector<TokenLogprob> pending_;  // sampled since the last event
  ReasoningStream reasoning_;
};

}  // namespace

struct CompletionServer::Impl {
  explicit Impl(ServedModel m) : model(std::move(m)), seeds(std::random_device{}()), started(UnixSeconds()) {}

  uint64_t RandomSeed() {
    std::lock_guard<std::mutex> lock(seed_mu);
    return seeds();
  }
  void Routes();
  void Completion(const httplib::Request& req, httplib::Response& res, ApiStyle style);

  ServedModel model;
  httplib::Server http;
  // Held for a whole generation: the context holds one sequence.
  std::mutex generate_mu;
  HeldTokens held;  // what the context holds (the prompt cache); under generate_mu
  // Set by Stop: generations end at their next token and waiting requests are refused.
  std::atomic<bool> stopping{false};
  // Serve's hand-over with Stop (see Serve).
  std::mutex state_mu;
  std::condition_variable state_cv;
  bool stop_requested = false;
  bool listen_done = false;
  std::mutex seed_mu;
  std::mt19937_64 seeds;  // seeds for requests that give none
  std::atomic<uint64_t> next_id{0};
  int64_t started;
};

void CompletionServer::Impl::Routes() {
  http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    SendJson(res, 200, {{"status", "ok"}});
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::json m = {{"id", model.name}, {"object", "model"}, {"created", started}, {"owned_by", "nflash"}};
    SendJson(res, 200, {{"object", "list"}, {"data", nlohmann::json::array({m})}});
  });
  http.Get("/props", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::json props = {{"model", model.name},
                            {"engine", model.description},
                            {"n_ctx", model.context->n_ctx()},
                            {"chat_format", nullptr},
                            {"chat_template", model.tokenizer->chat_template()}};
    if (model.chat) props["chat_format"] = ChatFormatName(model.chat->format);
    SendJson(res, 200, props);
  });
  // Tokenizing needs no inference context: these answer at once, also while a completion runs.
  for (const char* path : {"/tokenize", "/detokenize"}) {
    const bool tokenize = std::string_view(path) == "/tokenize";
    http.Post(path, [this, tokenize](const httplib::Request& req, httplib::Response& res) {
      const Tokenizer& tok = *model.tokenizer;
      auto body = tokenize ? TokenizeResponse(req.body, tok) : DetokenizeResponse(req.body, tok);
      if (!body.ok()) return SendError(res, 400, body.status().message());
      SendJson(res, 200, *body);
    });
  }
  http.Post("/completion", [this](const httplib::Request& req, httplib::Response& res) {
    Completion(req, res, ApiStyle::kLlamaCpp);
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Completion(req, res, ApiStyle::kOpenAi);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    Completion(req, res, ApiStyle::kOpenAiChat);
  });
  // httplib's default sets SO_REUSEPORT, which lets a second server bind the same port and the kernel split the
  // connections between the two. SO_REUSEADDR alone still allows a restart while old connections are in TIME_WAIT,
  // and a taken port fails Bind with EADDRINUSE.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Every error httplib produces itself (404 unknown route, 413 body too large, 400 malformed HTTP) gets the same
  // JSON body as ours; responses that already carry one are left alone.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        std::string message;
        if (res.status == 404) {
          message = "unknown endpoint " + req.method + " " + req.path +
                    " (endpoints: GET /health, GET /v1/models, GET /props, POST /completion, POST /v1/completions, " +
                    "POST /v1/chat/completions, POST /tokenize, POST /detokenize)";
        } else if (res.status == 413) {
          message = "the request body is larger than " + std::to_string(kMaxBodyBytes) + " bytes";
        } else {
          message = "HTTP " + std::to_string(res.status) + " for " + req.method + " " + req.path;
        }
        SendError(res, res.status, message);
        return httplib::Server::HandlerResponse::Handled;
      }));
  // No handler throws by design; allocation failure or a library exception still answers 500 instead of ending the
  // connection without a response.
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    NF_LOG(Error) << "request failed: " << what;
    SendError(res, 500, "internal error: " + what);
  });
  http.set_payload_max_length(kMaxBodyBytes);
}

void CompletionServer::Impl::Completion(const httplib::Request& req, httplib::Response& res, ApiStyle style) {
  RequestLimits limits;
  limits.tokenizer = model.tokenizer;
  limits.n_ctx = model.context->n_ctx();
  limits.chat = model.chat ? &*model.chat : nullptr;
  limits.no_chat = model.no_chat;
  auto parsed = ParseCompletionRequest(req.body, style, limits, RandomSeed());
  if (!parsed.ok()) {
    NF_LOG(Info) << "POST " << req.path << ": 400: " << parsed.status().message();
    SendError(res, 400, parsed.status().message());
    return;
  }
  auto request = std::make_shared<const CompletionRequest>(std::move(parsed).value());
  const std::string id = (style == ApiStyle::kOpenAiChat ? "chatcmpl-" : "cmpl-") + std::to_string(++next_id);
  const int64_t created = UnixSeconds();
  const std::string what = "POST " + req.path + (request->stream ? " (stream)" : "");

  if (!request->stream) {
    std::string text;
    std::unique_lock<std::mutex> lock(generate_mu);
    if (stopping) return SendError(res, 503, "the server is shutting down");
    auto g = GenerateCached(*model.context, &held, request->cache_prompt, *model.tokenizer, request->prompt_ids,
                            request->options, [&](std::string_view piece) {
                              text += piece;
                              return !stopping;
                            });
    lock.unlock();
    if (!g.ok()) {
      NF_LOG(Error) << what << ": " << g.status().ToString();
      return SendError(res, 500, g.status().ToString());
    }
    if (g->cancelled) return SendError(res, 503, "the server is shutting down");
    LogDone(what, *g);
    nlohmann::json body;
    if (style == ApiStyle::kLlamaCpp) {
      body = LlamaCppSummary(*request, *g, model.name);
      body["content"] = text;
    } else if (style == ApiStyle::kOpenAiChat) {
      body = OpenAiChatCompletion(id, created, model.name, text, &*g, /*stream=*/false, /*first=*/false);
      if (request->split_reasoning) {
        const ReasoningSplit split = SplitReasoning(text, request->reasoning_opened);
        nlohmann::json& message = body["choices"][0]["message"];
        message["content"] = split.content;
        if (!split.reasoning.empty()) message["reasoning_content"] = split.reasoning;
      }
    } else {
      body = OpenAiCompletion(id, created, model.name, text, &*g);
    }
    if (request->options.top_logprobs >= 0) {
      nlohmann::json probs = LogprobsJson(*request, *g, *model.tokenizer);
      if (style == ApiStyle::kLlamaCpp) {
        body["completion_probabilities"] = std::move(probs);
      } else {
        body["choices"][0]["logprobs"] = std::move(probs);
      }
    }
    return SendJson(res, 200, body);
  }

  // Server-Sent Events (EventStream). httplib calls the provider once the headers are out; generation runs inside
  // it, so each event is written as its token is produced, and a failed write (the client went away) ends the
  // generation.
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [this, request, id, created, what](size_t, httplib::DataSink& sink) {
        EventStream events(sink, *request, *model.tokenizer, id, created, model.name);
        std::unique_lock<std::mutex> lock(generate_mu);
        if (stopping) {
          events.Send(Dump(ErrorBody(503, "the server is shutting down")));
          sink.done();
          return true;
        }
        if (!events.Open()) return false;
        auto g = GenerateCached(*model.context, &held, request->cache_prompt, *model.tokenizer, request->prompt_ids,
                                events.Options(),
                                [&](std::string_view piece) { return !stopping && events.Piece(piece); });
        // How the generation ended is logged before the next completion may start, so that the line precedes
        // anything the next request logs.
        if (g.ok() && g->cancelled) {
          NF_LOG(Info) << what << ": " << (stopping ? "server stopping" : "client disconnected") << " after "
                       << g->generated_tokens << " generated tokens; generation stopped";
          return false;  // closes the connection; the lock is released on return
        }
        if (g.ok()) LogDone(what, *g);
        lock.unlock();
        if (!g.ok()) {
          NF_LOG(Error) << what << ": " << g.status().ToString();
          events.Send(Dump(ErrorBody(500, g.status().ToString())));
        } else {
          events.Finish(*g);
        }
        sink.done();
        return true;
      });
}

CompletionServer::CompletionServer(ServedModel model) : impl_(std::make_unique<Impl>(std::move(model))) {
  impl_->Routes();
}

CompletionServer::~CompletionServer() = default;

Result<int> CompletionServer::Bind(const std::string& host, int port) {
  errno = 0;
  const int bound = port == 0 ? impl_->http.bind_to_any_port(host) : impl_->http.bind_to_port(host, port) ? port : -1;
  if (bound <= 0) {
    return Status::IOError("cannot listen on " + host + ":" + std::to_string(port) +
                           (errno ? std::string(": ") + std::strerror(errno) : std::string()));
  }
  return bound;
}

Status CompletionServer::Serve() {
  Impl& s = *impl_;
  bool listened = true;
  std::thread listener([&] {
    listened = s.http.listen_after_bind();
    std::lock_guard<std::mutex> lock(s.state_mu);
    s.listen_done = true;
    s.state_cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(s.state_mu);
  s.state_cv.wait(lock, [&] { return s.stop_requested || s.listen_done; });
  // httplib's stop() does nothing until listen_after_bind has marked the server running: a Stop that came earlier
  // waits for that moment (stop() is called once; a second call would find the socket already closed).
  while (!s.listen_done) {
    if (s.http.is_running()) {
      s.http.stop();
      break;
    }
    s.state_cv.wait_for(lock, std::chrono::milliseconds(1));
  }
  const bool stopped = s.stop_requested;
  lock.unlock();
  listener.join();  // after the requests in progress (httplib joins its workers)
  if (!listened && !stopped) return Status::IOError("accepting connections failed");
  return Status::Ok();
}

void CompletionServer::Stop() {
  impl_->stopping = true;
  std::lock_guard<std::mutex> lock(impl_->state_mu);
  impl_->stop_requested = true;
  impl_->state_cv.notify_all();
}

}  // namespace nflash::server
