// Chat formats (runtime/text/chat_template.h) against the published Jinja templates as transformers renders them
// (tests/reference/chat_templates.py, jinja2): each template's format is recognised, and nflash's text for every
// conversation equals the template's, less the leading BOS the tokenizer adds. Then what the templates do not show:
// the refusals, mistral's system message, a template nflash does not know, and the names.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "runtime/text/chat_template.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

std::vector<ChatMessage> Messages(const nlohmann::json& list) {
  std::vector<ChatMessage> out;
  for (const auto& m : list) out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return out;
}

TEST(ChatTemplate, PublishedTemplatesRenderAsTransformersRendersThem) {
  const testing::CommandResult r = testing::RunCommand(
      std::string(NFLASH_PYTHON) + " " + NFLASH_SOURCE_DIR + "/tests/reference/chat_templates.py", false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json doc = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << r.output;
  const nlohmann::json& cases = doc["cases"];
  // 9 templates x 4 conversations; Qwen3's 2 reasoning templates x 3 enable_thinking settings x 6 conversations.
  ASSERT_EQ(cases.size(), 72u);
  int compared = 0, defaults = 0, preambles = 0, reasoning = 0;
  for (const auto& c : cases) {
    const std::string format = c["format"].get<std::string>();
    const std::optional<ChatTemplate> t = DetectChatTemplate(c["template"].get<std::string>());
    ASSERT_TRUE(t.has_value()) << format;
    EXPECT_EQ(ChatFormatName(t->format), format);
    if (!t->default_system.empty()) {  // Qwen2's, and Qwen2.5's second system turn (its first writes the given one)
      EXPECT_TRUE(t->default_system == "You are a helpful assistant." ||
                  t->default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
          << t->default_system;
      ++defaults;
    }
    if (!t->system_preamble.empty()) {  // Llama 3.1's
      EXPECT_EQ(t->system_preamble, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
      ++preambles;
    }
    const nlohmann::json& kwargs = c["kwargs"];
    if (t->thinking != ChatThinking::kNone) {  // Qwen3's: the hybrid reads enable_thinking, 2507's always thinks
      const bool hybrid = c["template"].get<std::string>().find("enable_thinking") != std::string::npos;
      EXPECT_EQ(t->thinking, hybrid ? ChatThinking::kSwitch : ChatThinking::kForced);
      ++reasoning;
    }
    if (!c.contains("rendered")) continue;  // the template refuses the conversation (mistral: a system message)
    std::string expected = c["rendered"].get<std::string>();
    const std::string bos = c["bos"].get<std::string>();
    if (!bos.empty() && expected.rfind(bos, 0) == 0) expected.erase(0, bos.size());
    ChatOptions options;
    options.enable_thinking = kwargs.value("enable_thinking", true);
    auto text = FormatChat(*t, Messages(c["messages"]), bos, c["eos"].get<std::string>(), options);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    EXPECT_EQ(*text, expected) << format << " " << kwargs.dump() << " " << c["messages"].dump();
    ++compared;
  }
  EXPECT_EQ(compared, 71);
  EXPECT_EQ(defaults, 8);   // Qwen2's and Qwen2.5's templates, four cases each
  EXPECT_EQ(preambles, 4);  // Llama 3.1's
  EXPECT_EQ(reasoning, 36);
}

TEST(ChatTemplate, WhatTheTemplatesDoNotShow) {
  const ChatTemplate mistral{ChatFormat::kMistral, "", ""}, llama2{ChatFormat::kLlama2, "", ""},
      chatml{ChatFormat::kChatMl, "", ""};
  // Mistral's template refuses a system message; nflash puts it before the first user message.
  const std::vector<ChatMessage> with_system = {{"system", "Be brief."}, {"user", "Hi"}};
  auto text = FormatChat(mistral, with_system, "<s>", "</s>");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, "[INST] Be brief.\n\nHi [/INST]");
  // Refusals name the message.
  struct Refused {
    ChatTemplate chat;
    std::vector<ChatMessage> messages;
    std::string expected;
  };
  const std::vector<Refused> refused = {
      {chatml, {}, "messages: expected at least one message, found none"},
      {chatml, {{"user", "a"}, {"tool", "b"}}, "messages[1]: role \"tool\": expected system, user or assistant"},
      {chatml, {{"user", "a"}, {"system", "b"}}, "messages[1]: a system message must be the first message"},
      {llama2, {{"system", "a"}}, "the llama2 chat format needs a user message after the system message"},
      {mistral, {{"user", "a"}, {"user", "b"}}, "messages[1]: the mistral chat format needs user and assistant "
                                                "messages to alternate, starting with user; found user"},
      {llama2, {{"system", "s"}, {"assistant", "a"}}, "messages[1]: the llama2 chat format needs user and assistant"},
  };
  for (const Refused& c : refused) {
    auto r = FormatChat(c.chat, c.messages, "<s>", "</s>");
    ASSERT_FALSE(r.ok()) << c.expected;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.expected), std::string::npos) << r.status().ToString();
  }
  // ChatML keeps a conversation as given: no alternation needed, a system message only when given.
  text = FormatChat(chatml, {{{"user", "a"}, {"user", "b"}}}, "<s>", "</s>");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "<|im_start|>user\na<|im_end|>\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n");
  // A template of no known format; a default system message that is not a literal is not taken.
  EXPECT_FALSE(DetectChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").has_value());
  auto t = DetectChatTemplate("{{ '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->default_system, "");
  // A Llama 3.1 template without a date of its own gets the one Llama 3.1 fixes; one that fixes another keeps it.
  t = DetectChatTemplate("<|start_header_id|>{{ 'Cutting Knowledge Date: December 2023' }}");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->system_preamble, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
  t = DetectChatTemplate("<|start_header_id|>{% set date_string = \"01 Jan 2025\" %}Cutting Knowledge Date: December 2023");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->system_preamble, "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n");
  // Names round-trip; an unknown one lists them.
  for (ChatFormat f : {ChatFormat::kChatMl, ChatFormat::kLlama2, ChatFormat::kLlama3, ChatFormat::kMistral,
                       ChatFormat::kPhi3, ChatFormat::kZephyr}) {
    auto parsed = ParseChatFormat(ChatFormatName(f));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, f);
  }
  auto bad = ParseChatFormat("gemma");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("chat template \"gemma\": expected one of chatml, llama2, llama3, mistral, "
                                        "phi3, zephyr"),
            std::string::npos)
      << bad.status().ToString();
}

// A reasoning reply split into reasoning_content and content, cases worked by hand from the rule in chat_template.h;
// then the stream: the text cut into pieces every way (one cut anywhere, two cuts anywhere, one character at a time)
// gives, joined, the same split.
TEST(ChatTemplate, ReasoningSplitsAtTheFirstCloseTagInWholeAndInPieces) {
  struct Case {
    const char* reply;
    bool opened;
    const char* reasoning;
    const char* content;
  };
  const std::vector<Case> cases = {
      {"<think>\nabc\n</think>\n\nHello", false, "abc", "Hello"},
      {"  <think>a</think>b", false, "a", "b"},
      {"Hello <think>x</think>", false, "", "Hello <think>x</think>"},
      {"abc\n\n</think>\n\nHi\n", true, "abc", "Hi\n"},
      {"abc", true, "abc", ""},
      {"<think>\nabc\n</thi", false, "abc\n</thi", ""},
      {"<thin", false, "", "<thin"},
      {"\n\n", true, "", ""},
      {"a\n\nb</think></think>c", true, "a\n\nb", "</think>c"},
      {"\n<think>\n\n\nx\n\ny\n\n\n</think>\n\n\nz\n\nw", false, "x\n\ny", "z\n\nw"},
      {"", false, "", ""},
      {"  \n", false, "", "  \n"},
      {"</think>", true, "", ""},
      {"x </th", true, "x </th", ""},
  };
  for (const Case& c : cases) {
    const std::string reply = c.reply;
    const ReasoningSplit whole = SplitReasoning(reply, c.opened);
    EXPECT_EQ(whole.reasoning, c.reasoning) << reply;
    EXPECT_EQ(whole.content, c.content) << reply;
    auto streamed = [&](const std::vector<size_t>& cuts) {
      ReasoningStream stream(c.opened);
      ReasoningSplit joined;
      size_t at = 0;
      for (size_t i = 0; i <= cuts.size(); ++i) {
        const size_t end = i < cuts.size() ? cuts[i] : reply.size();
        const ReasoningSplit part = stream.Push(std::string_view(reply).substr(at, end - at));
        joined.reasoning += part.reasoning;
        joined.content += part.content;
        at = end;
      }
      const ReasoningSplit rest = stream.Finish();
      joined.reasoning += rest.reasoning;
      joined.content += rest.content;
      return joined;
    };
    std::vector<size_t> each;
    for (size_t i = 1; i < reply.size(); ++i) each.push_back(i);
    std::vector<std::vector<size_t>> cutlists = {{}, each};
    for (size_t i = 0; i <= reply.size(); ++i) {
      for (size_t j = i; j <= reply.size(); ++j) cutlists.push_back({i, j});
    }
    for (const std::vector<size_t>& cuts : cutlists) {
      const ReasoningSplit s = streamed(cuts);
      std::string where;
      for (size_t k : cuts) where += std::to_string(k) + " ";
      EXPECT_EQ(s.reasoning, whole.reasoning) << "'" << reply << "' cut at " << where;
      EXPECT_EQ(s.content, whole.content) << "'" << reply << "' cut at " << where;
    }
  }
}

}  // namespace
}  // namespace nflash
