// The HTTP front end of `nflash serve` (docs/server.md): GET /health, GET /v1/models, POST /completion (llama.cpp's
// server style), POST /v1/completions and POST /v1/chat/completions (OpenAI's), with Server-Sent Events when a
// request asks to stream, over
// cpp-httplib. It generates with whatever inference context it is given: the dense engine or the flash-offloaded
// sparse runtime (serve_command.cc builds either).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "runtime/core/status.h"
#include "runtime/engine/context.h"
#include "runtime/text/chat_template.h"
#include "runtime/text/tokenizer.h"

namespace nflash::server {

// What the server generates with. The context and tokenizer must outlive the server.
struct ServedModel {
  std::string name;                    // the id GET /v1/models lists and every response carries
  std::string description;             // the engine, as GET /props shows it
  InferenceContext* context = nullptr;  // the one sequence all requests share, one at a time
  const Tokenizer* tokenizer = nullptr;
  // The format POST /v1/chat/completions writes messages in (the model's template recognised, or --chat-template);
  // without one, chat requests are refused with `no_chat`.
  std::optional<ChatTemplate> chat;
  std::string no_chat;
};

// Concurrency: httplib accepts connections on its own worker threads (8 at least), so /health and /v1/models answer
// at once, and bad requests are rejected at once, while a completion runs. There is one inference context, so
// completions run one at a time under a mutex, each keeping what the KV cache holds of its prompt from the one before
// (GenerateCached; `cache_prompt`): a second concurrent completion waits for the first to finish (no error, no queue
// limit beyond httplib's). A streaming client that disconnects stops its generation at the next token (its write
// fails); a non-streaming one is noticed only when the response is written.
// Thread-safety: Bind and Serve from one thread, in that order; Stop from any thread, at any time (also before Serve
// or while requests run: running generations end at their next token, waiting ones are refused with 503).
class CompletionServer {
 public:
  explicit CompletionServer(ServedModel model);
  ~CompletionServer();  // not copyable or movable: the routes hold the address of the state (impl_)

  // Binds host:port (port 0: a free port, chosen by the kernel) and returns the port bound. IOError when it cannot.
  Result<int> Bind(const std::string& host, int port);
  // Serves until Stop (Ok), or fails (IOError) when accepting connections fails. Returns after the requests in
  // progress have ended.
  Status Serve();
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nflash::server
