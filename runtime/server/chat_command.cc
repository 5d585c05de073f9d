// `nflash chat`: a conversation in the terminal with the dense engine (-m) or the flash-offloaded runtime (-d). Each
// line of standard input is a user message; the assistant's reply is written to standard output as it is generated,
// then a newline. The conversation is written in the model's chat format (as POST /v1/chat/completions writes it) and
// stays in the KV cache between turns (GenerateCached), so each turn evaluates only its new messages. Ends at the end
// of the input, or with an error when the conversation no longer fits the context.
#include "runtime/server/chat_command.h"

#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/log.h"
#include "runtime/engine/generate.h"
#include "runtime/server/engine.h"
#include "runtime/text/chat_template.h"

namespace nflash::server {
namespace {

struct ChatFlags {
  EngineFlags engine;
  std::string system;
  int64_t max_tokens = 0;  // per reply; 0: until the model ends its turn or the context is full
  bool no_think = false;   // a template that reads enable_thinking: replies without thinking
  SamplerConfig sampler;
};

Status RunChat(const ChatFlags& f) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, OpenEngine(f.engine, "chat"));
  const ServedModel& m = engine->served;
  if (!m.chat) return Status::InvalidArgument(m.no_chat);
  ChatOptions chat_options;
  if (f.no_think) {
    if (m.chat->thinking != ChatThinking::kSwitch) {
      return Status::InvalidArgument("--no-think: the model's chat template does not read enable_thinking (Qwen3's "
                                     "hybrid templates do); this one " +
                                     std::string(m.chat->thinking == ChatThinking::kForced
                                                     ? "always opens the reply in <think>"
                                                     : "has no thinking to turn off"));
    }
    chat_options.enable_thinking = false;
  }
  InferenceContext& ctx = *m.context;
  const Tokenizer& tok = *m.tokenizer;
  NF_LOG(Info) << "chat with " << m.name << " (" << m.description << ", " << ChatFormatName(m.chat->format)
               << " format), context " << ctx.n_ctx() << " tokens; one message per line, end of input to finish";
  std::vector<ChatMessage> messages;
  if (!f.system.empty()) messages.push_back({"system", f.system});
  HeldTokens held;
  GenerateOptions options;
  options.sampler = f.sampler;
  const bool terminal = ::isatty(STDIN_FILENO) != 0;
  std::string line;
  for (int64_t turn = 1;; ++turn) {
    if (terminal) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    messages.push_back({"user", line});
    auto text =
        FormatChat(*m.chat, messages, tok.TokenText(tok.bos_id()), tok.TokenText(tok.eos_id()), chat_options);
    if (!text.ok()) return text.status();
    const std::vector<int32_t> prompt = tok.Encode(*text, tok.add_bos(), /*parse_special=*/true);
    const int64_t room = ctx.n_ctx() - static_cast<int64_t>(prompt.size());
    if (room <= 0) {
      return Status::ResourceExhausted("turn " + std::to_string(turn) + ": the conversation takes " +
                                       std::to_string(prompt.size()) + " tokens, more than the context holds (" +
                                       std::to_string(ctx.n_ctx()) + "); start again with a larger -c");
    }
    options.max_tokens = f.max_tokens > 0 ? std::min(f.max_tokens, room) : room;
    std::string reply;
    NF_ASSIGN_OR_RETURN(const GenerateResult g,
                        GenerateCached(ctx, &held, /*reuse=*/true, tok, prompt, options, [&](std::string_view piece) {
                          reply += piece;
                          std::fwrite(piece.data(), 1, piece.size(), stdout);
                          std::fflush(stdout);
                          return true;
                        }));
    std::fputs("\n", stdout);
    std::fflush(stdout);
    NF_LOG(Info) << "turn " << turn << ": " << g.prompt_tokens << " prompt tokens (" << g.cached_tokens
                 << " kept from the last turn) in " << g.prefill_ms << " ms, " << g.generated_tokens << " generated ("
                 << StopReasonName(g.reason) << ") in " << g.decode_ms << " ms";
    messages.push_back({"assistant", reply});
  }
  return Status::Ok();
}

}  // namespace

void RegisterChatCommand(CLI::App& app, cli::CommandAction* action) {
  auto f = std::make_shared<ChatFlags>();
  CLI::App* cmd = app.add_subcommand(
      "chat", "Converse in the terminal: each input line a user message, each reply streamed (docs/server.md)");
  const RuntimeOptionRange runtime_options =
      AddEngineOptions(cmd, &f->engine, "Context size the whole conversation shares (0: the model's)");
  cmd->add_option("--system", f->system, "System message that opens the conversation");
  cmd->add_option("-n,--max-tokens", f->max_tokens,
                  "Tokens per reply at most (0: until the model ends its turn or the context is full)")
      ->check(cli::kNonNegative)
      ->capture_default_str();
  cmd->add_flag("--no-think", f->no_think,
                "Reply without thinking (a template that reads enable_thinking, as Qwen3's hybrid models': each reply "
                "opens with an empty think block)");
  cli::AddSamplerOptions(cmd, &f->sampler);
  cmd->callback([f, action, cmd, runtime_options] {
    NoteRuntimeOnly(cmd, runtime_options, &f->engine);
    *action = [f] { return RunChat(*f); };
  });
}

}  // namespace nflash::server
