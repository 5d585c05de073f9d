// Chat formats (see chat_template.h).
#include "runtime/text/chat_template.h"

#include <algorithm>
#include <array>
#include <vector>

namespace nflash {
namespace {

struct FormatName {
  ChatFormat format;
  const char* name;
};
constexpr std::array<FormatName, 6> kFormats = {{{ChatFormat::kChatMl, "chatml"},
                                                 {ChatFormat::kLlama2, "llama2"},
                                                 {ChatFormat::kLlama3, "llama3"},
                                                 {ChatFormat::kMistral, "mistral"},
                                                 {ChatFormat::kPhi3, "phi3"},
                                                 {ChatFormat::kZephyr, "zephyr"}}};

bool Has(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

// Python's str.lstrip / rstrip / strip of the characters `chars`; Strip's default, ASCII whitespace, is also Jinja's
// trim.
constexpr std::string_view kAsciiSpace = " \t\n\r\f\v";
std::string_view LStrip(std::string_view s, std::string_view chars) {
  return s.substr(std::min(s.size(), s.find_first_not_of(chars)));
}
std::string_view RStrip(std::string_view s, std::string_view chars) {
  const size_t last = s.find_last_not_of(chars);
  return last == std::string_view::npos ? std::string_view() : s.substr(0, last + 1);
}
std::string_view Strip(std::string_view s, std::string_view chars = kAsciiSpace) {
  return RStrip(LStrip(s, chars), chars);
}

// The text of a literal system turn in a ChatML template (the system message it writes when the conversation has none,
// e.g. Qwen2's `'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'`), its newline written as a newline or
// as Jinja's "\n" escape; "" when no system turn is a literal (one that writes the given message is an expression).
std::string LiteralSystemTurn(std::string_view jinja) {
  for (std::string_view head : {"<|im_start|>system\n", "<|im_start|>system\\n"}) {
    for (size_t at = jinja.find(head); at != std::string_view::npos; at = jinja.find(head, at + 1)) {
      const std::string_view rest = jinja.substr(at + head.size());
      const size_t end = rest.find("<|im_end|>");
      if (end == std::string_view::npos) continue;
      const std::string_view text = rest.substr(0, end);
      if (text.find_first_of("'\"{}+\\") == std::string_view::npos) return std::string(text);
    }
  }
  return "";
}

// The date a Llama 3.1 template writes when it is given none (`set date_string = "26 Jul 2024"`); Llama 3.2's asks for
// today's (strftime_now) where the renderer has it, and falls back to such a literal.
std::string DateString(std::string_view jinja) {
  constexpr std::string_view kSet = "date_string = \"";
  const size_t at = jinja.find(kSet);
  if (at != std::string_view::npos) {
    const size_t end = jinja.find('"', at + kSet.size());
    if (end != std::string_view::npos) return std::string(jinja.substr(at + kSet.size(), end - at - kSet.size()));
  }
  return "26 Jul 2024";
}

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";

// Qwen3's templates on an assistant message: content.split('</think>')[-1].lstrip('\n') and, as its reasoning,
// content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n'); a message without "</think>" is all
// content.
ReasoningSplit HistorySplit(std::string_view content) {
  const size_t first = content.find(kThinkClose);
  if (first == std::string_view::npos) return {"", std::string(content)};
  std::string_view before = RStrip(content.substr(0, first), "\n");
  const size_t open = before.rfind(kThinkOpen);
  if (open != std::string_view::npos) before = before.substr(open + kThinkOpen.size());
  const size_t last = content.rfind(kThinkClose);
  return {std::string(LStrip(before, "\n")), std::string(LStrip(content.substr(last + kThinkClose.size()), "\n"))};
}

Status BadMessage(size_t i, const std::string& what) {
  return Status::InvalidArgument("messages[" + std::to_string(i) + "]: " + what);
}

}  // namespace

const char* ChatFormatName(ChatFormat format) {
  for (const FormatName& f : kFormats) {
    if (f.format == format) return f.name;
  }
  return "?";
}

std::string ChatFormatNames() {
  std::string names;
  for (const FormatName& f : kFormats) names += std::string(names.empty() ? "" : ", ") + f.name;
  return names;
}

Result<ChatFormat> ParseChatFormat(std::string_view name) {
  for (const FormatName& f : kFormats) {
    if (name == f.name) return f.format;
  }
  return Status::InvalidArgument("chat template \"" + std::string(name) + "\": expected one of " + ChatFormatNames());
}

std::optional<ChatTemplate> DetectChatTemplate(std::string_view jinja) {
  ChatTemplate t;
  if (Has(jinja, "<|im_start|>")) {
    t.format = ChatFormat::kChatMl;
    t.default_system = LiteralSystemTurn(jinja);
    if (Has(jinja, kThinkClose)) {
      const bool forced = Has(jinja, "<|im_start|>assistant\\n<think>") || Has(jinja, "<|im_start|>assistant\n<think>");
      t.thinking = Has(jinja, "enable_thinking") ? ChatThinking::kSwitch
                   : forced                      ? ChatThinking::kForced
                                                 : ChatThinking::kHistory;
    }
  } else if (Has(jinja, "<|start_header_id|>")) {
    t.format = ChatFormat::kLlama3;
    // Llama 3.1 and later open every conversation with a system turn that states the knowledge cutoff and a date.
    if (Has(jinja, "Cutting Knowledge Date: December 2023")) {
      t.system_preamble = "Cutting Knowledge Date: December 2023\nToday Date: " + DateString(jinja) + "\n\n";
    }
  } else if (Has(jinja, "<|assistant|>")) {
    t.format = Has(jinja, "<|end|>") ? ChatFormat::kPhi3 : ChatFormat::kZephyr;
  } else if (Has(jinja, "[INST]")) {
    t.format = Has(jinja, "<<SYS>>") ? ChatFormat::kLlama2 : ChatFormat::kMistral;
  } else {
    return std::nullopt;
  }
  return t;
}

Result<std::string> FormatChat(const ChatTemplate& chat, std::span<const ChatMessage> given, std::string_view bos,
                               std::string_view eos, const ChatOptions& options) {
  const ChatFormat format = chat.format;
  if (given.empty()) return Status::InvalidArgument("messages: expected at least one message, found none");
  for (size_t i = 0; i < given.size(); ++i) {
    const std::string& role = given[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return BadMessage(i, "role \"" + role + "\": expected system, user or assistant");
    }
    if (role == "system" && i > 0) return BadMessage(i, "a system message must be the first message");
  }
  std::vector<ChatMessage> with_default;
  std::span<const ChatMessage> messages = given;
  if (!chat.default_system.empty() && given.front().role != "system") {
    with_default.push_back({"system", chat.default_system});
    with_default.insert(with_default.end(), given.begin(), given.end());
    messages = with_default;
  }
  const bool has_system = messages.front().role == "system";
  const std::string system = has_system ? messages.front().content : "";
  const std::span<const ChatMessage> turns = messages.subspan(has_system ? 1 : 0);
  if (format == ChatFormat::kLlama2 || format == ChatFormat::kMistral) {
    if (turns.empty()) {
      return Status::InvalidArgument(std::string("messages: the ") + ChatFormatName(format) + " chat format needs a " +
                                     "user message after the system message");
    }
    for (size_t i = 0; i < turns.size(); ++i) {
      if ((turns[i].role == "user") != (i % 2 == 0)) {
        return BadMessage(i + (has_system ? 1 : 0), std::string("the ") + ChatFormatName(format) +
                                                         " chat format needs user and assistant messages to " +
                                                         "alternate, starting with user; found " + turns[i].role);
      }
    }
  }
  std::string out;
  switch (format) {
    case ChatFormat::kChatMl: {
      // Reasoning templates: the last user message (Qwen3's last_query_index: the last message when there is none).
      size_t last_query = messages.size() - 1;
      for (size_t i = messages.size(); i-- > 0;) {
        if (messages[i].role == "user") {
          last_query = i;
          break;
        }
      }
      for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (chat.thinking == ChatThinking::kNone || m.role != "assistant") {
          out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
          continue;
        }
        const ReasoningSplit r = HistorySplit(m.content);
        if (i > last_query && (i + 1 == messages.size() || !r.reasoning.empty())) {
          out += "<|im_start|>assistant\n<think>\n" + std::string(Strip(r.reasoning, "\n")) + "\n</think>\n\n" +
                 std::string(LStrip(r.content, "\n")) + "<|im_end|>\n";
        } else {
          out += "<|im_start|>assistant\n" + r.content + "<|im_end|>\n";
        }
      }
      out += "<|im_start|>assistant\n";
      if (chat.thinking == ChatThinking::kSwitch && !options.enable_thinking) out += "<think>\n\n</think>\n\n";
      if (chat.thinking == ChatThinking::kForced) out += "<think>\n";
      break;
    }
    case ChatFormat::kLlama3:
      if (!chat.system_preamble.empty()) {
        out += "<|start_header_id|>system<|end_header_id|>\n\n" + chat.system_preamble + std::string(Strip(system)) +
               "<|eot_id|>";
      }
      for (const ChatMessage& m : chat.system_preamble.empty() ? messages : turns) {
        out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + std::string(Strip(m.content)) + "<|eot_id|>";
      }
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatFormat::kPhi3:
      for (const ChatMessage& m : messages) out += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
      out += "<|assistant|>\n";
      break;
    case ChatFormat::kZephyr:
      for (const ChatMessage& m : messages) out += "<|" + m.role + "|>\n" + m.content + std::string(eos) + "\n";
      out += "<|assistant|>\n";
      break;
    case ChatFormat::kLlama2:
      // Every user turn begins with BOS, the first one's from the tokenizer; the system prompt opens the first.
      for (size_t i = 0; i < turns.size(); ++i) {
        if (turns[i].role == "assistant") {
          out += " " + std::string(Strip(turns[i].content)) + " " + std::string(eos);
          continue;
        }
        const std::string content =
            i == 0 && has_system ? "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + turns[i].content : turns[i].content;
        out += (i == 0 ? std::string() : std::string(bos)) + "[INST] " + std::string(Strip(content)) + " [/INST]";
      }
      break;
    case ChatFormat::kMistral:
      for (size_t i = 0; i < turns.size(); ++i) {
        if (turns[i].role == "assistant") {
          out += turns[i].content + std::string(eos);
          continue;
        }
        const std::string content = i == 0 && has_system ? system + "\n\n" + turns[i].content : turns[i].content;
        out += "[INST] " + content + " [/INST]";
      }
      break;
  }
  return out;
}

ReasoningSplit SplitReasoning(std::string_view reply, bool opened) {
  std::string_view s = reply;
  if (!opened) {
    const std::string_view t = s.substr(std::min(s.size(), s.find_first_not_of(" \t\n\r\f\v")));
    if (t.substr(0, kThinkOpen.size()) != kThinkOpen) return {"", std::string(reply)};
    s = t.substr(kThinkOpen.size());
  }
  const size_t close = s.find(kThinkClose);
  if (close == std::string_view::npos) return {std::string(Strip(s, "\n")), ""};
  return {std::string(Strip(s.substr(0, close), "\n")),
          std::string(LStrip(s.substr(close + kThinkClose.size()), "\n"))};
}

ReasoningSplit ReasoningStream::Push(std::string_view piece) {
  ReasoningSplit out;
  held_ += piece;
  if (state_ == State::kStart) {
    const size_t first = held_.find_first_not_of(" \t\n\r\f\v");
    if (first == std::string::npos) return out;  // whitespace only: undecided
    const std::string_view t = std::string_view(held_).substr(first);
    if (t.size() < kThinkOpen.size() && kThinkOpen.substr(0, t.size()) == t) return out;  // "<thi": undecided
    if (t.substr(0, kThinkOpen.size()) != kThinkOpen) {
      state_ = State::kContent;
      out.content = std::move(held_);
      held_.clear();
      return out;
    }
    held_ = std::string(t.substr(kThinkOpen.size()));
    state_ = State::kThinking;
  }
  if (state_ == State::kThinking) {
    const size_t close = held_.find(kThinkClose);
    if (close != std::string::npos) {
      out.reasoning = RStrip(std::string_view(held_).substr(0, close), "\n");
      held_.erase(0, close + kThinkClose.size());
      state_ = State::kAfter;
    } else {
      // Hold the longest end that may begin "</think>", and the newlines before it (stripped if it is one).
      size_t keep = std::min(held_.size(), kThinkClose.size() - 1);
      while (keep > 0 && kThinkClose.substr(0, keep) != std::string_view(held_).substr(held_.size() - keep)) --keep;
      size_t cut = held_.size() - keep;
      while (cut > 0 && held_[cut - 1] == '\n') --cut;
      out.reasoning = held_.substr(0, cut);
      held_.erase(0, cut);
    }
    if (!started_) out.reasoning = std::string(LStrip(out.reasoning, "\n"));
    started_ = started_ || !out.reasoning.empty();
  }
  if (state_ == State::kAfter) {
    const size_t first = held_.find_first_not_of('\n');
    if (first == std::string::npos) {
      held_.clear();
      return out;
    }
    held_.erase(0, first);
    state_ = State::kContent;
  }
  if (state_ == State::kContent) {
    out.content += held_;
    held_.clear();
  }
  return out;
}

ReasoningSplit ReasoningStream::Finish() {
  ReasoningSplit out;
  if (state_ == State::kStart) out.content = std::move(held_);  // whitespace, or a beginning of "<think>": content
  if (state_ == State::kThinking) {
    out.reasoning = RStrip(held_, "\n");
    if (!started_) out.reasoning = std::string(LStrip(out.reasoning, "\n"));
  }
  held_.clear();
  return out;
}

}  // namespace nflash
