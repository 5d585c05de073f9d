// Chat prompts: the messages of a conversation written as the text an instruct model was trained on, in the formats of
// the model families nflash runs (docs/server.md, "Chat"). A model says which format it wants with its Jinja template
// (GGUF tokenizer.chat_template, from HF tokenizer_config.json); nflash does not run Jinja: it recognises the template
// by the markers it writes, as llama.cpp does for the templates it has built in, and writes that format itself.
// tests/reference/chat_templates.py renders the published templates with jinja2 as transformers does, and
// ChatTemplate tests compare.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "runtime/core/status.h"

namespace nflash {

enum class ChatFormat {
  kChatMl,   // <|im_start|>role\n...<|im_end|>\n: Qwen2, OpenHermes, ...
  kLlama2,   // [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] ... </s><s>[INST] ...: Llama 2 chat
  kLlama3,   // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>: Llama 3 instruct
  kMistral,  // [INST] ... [/INST]...</s>: Mistral / Mixtral instruct v0.1
  kPhi3,     // <|role|>\n...<|end|>\n: Phi-3
  kZephyr,   // <|role|>\n...</s>\n: Zephyr, TinyLlama chat
};

const char* ChatFormatName(ChatFormat format);
// Every format's name, comma-separated (for messages and --help).
std::string ChatFormatNames();
// A name as ChatFormatName spells it; InvalidArgument listing the names otherwise.
Result<ChatFormat> ParseChatFormat(std::string_view name);
// A chat format, and what its template adds: the system message it writes when a conversation has none (Qwen2's
// ChatML template writes "You are a helpful assistant."), and text it writes first in a system turn it always writes
// (Llama 3.1's knowledge cutoff and date). Empty: none.
// Reasoning ChatML templates (Qwen3's, which write a model's thinking between <think> and </think>): kHistory writes
// an earlier assistant message without its thinking (Qwen3's rule: an assistant message after the last user message
// keeps it, as <think>\n...\n</think>\n\n, when it has some or is the last message); kSwitch also lets the request
// turn thinking off (enable_thinking false: the reply opens with an empty <think>\n\n</think>\n\n, as Qwen3's
// hybrid models were trained); kForced opens every reply with <think>\n (Qwen3's 2507 thinking models).
enum class ChatThinking { kNone, kHistory, kSwitch, kForced };

struct ChatTemplate {
  ChatFormat format = ChatFormat::kChatMl;
  std::string default_system;
  std::string system_preamble;
  ChatThinking thinking = ChatThinking::kNone;
};

// What a request may change in how its conversation is written (the template arguments of transformers'
// apply_chat_template that nflash's formats read).
struct ChatOptions {
  bool enable_thinking = true;  // ChatThinking::kSwitch only: false opens the reply with an empty think block
};

// The format a Jinja chat template writes, recognised by its markers, with its default system message when it writes
// one as a literal (a ChatML system turn of fixed text) and Llama 3.1's system preamble when it writes one (the cutoff,
// and the date the template fixes: a llama3 template that asks for today's date gets its fallback); nullopt when the
// format is none of these. A ChatML template that writes "</think>" is a reasoning template (ChatThinking): kSwitch when
// it reads enable_thinking, kForced when its generation prompt writes <think>, else kHistory.
std::optional<ChatTemplate> DetectChatTemplate(std::string_view jinja);

struct ChatMessage {
  std::string role;  // "system" (first message only), "user" or "assistant"
  std::string content;
};

// The prompt for the assistant's next message: `messages` in the template's format (after its default system
// message when the first message is not a system message), then the assistant's header. `bos` and `eos`
// are the tokenizer's BOS and EOS texts (e.g. "<s>", "</s>"), which some formats write between turns; the text does not
// begin with BOS (the tokenizer adds it, as for any prompt), and is meant to be encoded with its special tokens parsed.
// Formats without a system role (mistral) put a system message before the first user message, separated by a blank
// line. InvalidArgument, naming the message: no messages, an unknown role, a system message after the first, or (llama2,
// mistral, whose templates require it) no user message, or user and assistant messages that do not alternate from a
// user message.
Result<std::string> FormatChat(const ChatTemplate& chat, std::span<const ChatMessage> messages, std::string_view bos,
                               std::string_view eos, const ChatOptions& options = {});

// A reasoning model's reply split as OpenAI-style servers return it (reasoning_content and content): the thinking is
// the text up to the first "</think>" (less a "<think>" opening it and the newlines around it), the content what
// follows (less leading newlines). A reply that opens with "<think>" (after whitespace), or any reply of a template
// whose prompt opened the think block (`opened`: ChatThinking::kForced), is thinking until "</think>": without one
// it is all thinking. Any other reply is all content.
struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};
ReasoningSplit SplitReasoning(std::string_view reply, bool opened);

// SplitReasoning a piece at a time, for a stream: Push returns the new reasoning and content text the pieces so far
// make certain (text that may be the start of "<think>" or "</think>" is held back until the next piece decides it);
// Finish returns what is held. The pieces' outputs joined equal SplitReasoning of the pieces joined, however the text
// is cut (newlines that the split may strip are held until the text after them decides).
class ReasoningStream {
 public:
  explicit ReasoningStream(bool opened) : state_(opened ? State::kThinking : State::kStart) {}
  ReasoningSplit Push(std::string_view piece);
  ReasoningSplit Finish();

 private:
  enum class State { kStart, kThinking, kAfter, kContent };
  State state_;
  std::string held_;      // text not yet certain
  bool started_ = false;  // some reasoning text was returned (later newlines are kept)
};

}  // namespace nflash
