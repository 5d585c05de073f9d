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
struct ChatTemplate {
  ChatFormat format = ChatFormat::kChatMl;
  std::string default_system;
  std::string system_preamble;
};

// The format a Jinja chat template writes, recognised by its markers, with its default system message when it writes
// one as a literal (a ChatML system turn of fixed text) and Llama 3.1's system preamble when it writes one (the cutoff,
// and the date the template fixes: a llama3 template that asks for today's date gets its fallback); nullopt when the
// format is none of these.
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
                               std::string_view eos);

}  // namespace nflash
