// `nflash serve` end to end: the real binary on stories260K (dense) and on a stories260K-relu deployment (offloaded,
// oracle active set), spoken to with a real HTTP client (httplib::Client). Greedy completions must equal what the
// independent `nflash run` prints, streamed text must equal the non-streamed one, the OpenAI route must agree, seeded
// sampling must reproduce `nflash run --seed`, bad requests must get 400 naming the field, a client that disconnects
// mid-stream must stop its generation, and SIGTERM/SIGINT must end the server with exit code 0.
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <thread>

#include "runtime/core/gguf.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/generate.h"
#include "runtime/engine/model.h"
#include "runtime/text/tokenizer.h"
#include "tests/integration/numpy_reference.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using Json = nlohmann::json;

std::string Nflash() { return testing::NflashBinary(); }
std::string Stories() { return testing::SharedPath("models/stories260K/stories260K.bin"); }
const char kPrompt[] = "Once upon a time";

using testing::ReadText;

// A running `nflash serve ARGS --port 0`: its port read from the `listening on` line, its log (stderr) in a file.
class ServerProcess {
 public:
  ServerProcess(const std::string& args, std::string log_path) : log_path_(std::move(log_path)) {
    int out[2];
    if (::pipe(out) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], 1);
      const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(log, 2);
      ::close(out[0]);
      const std::string cmd = "exec " + Nflash() + " serve --port 0 " + args;
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(out[1]);
    // The first stdout line, within 60 s (model loading; the sparse runtime reads its deployment first).
    std::string line;
    pollfd p{out[0], POLLIN, 0};
    while (line.find('\n') == std::string::npos && ::poll(&p, 1, 60000) > 0) {
      char buf[256];
      const ssize_t n = ::read(out[0], buf, sizeof(buf));
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    ::close(out[0]);
    std::smatch m;
    if (std::regex_search(line, m, std::regex("^listening on http://127\\.0\\.0\\.1:([0-9]+)\\n"))) {
      port_ = std::stoi(m[1].str());
    }
  }
  ~ServerProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }
  std::string Log() const { return ReadText(log_path_); }

  // Polls /health until it answers 200 (true) or 30 s pass.
  bool WaitHealthy() const {
    httplib::Client c("127.0.0.1", port_);
    for (int i = 0; i < 3000 && port_ > 0; ++i) {
      auto res = c.Get("/health");
      if (res && res->status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Sends `sig` and returns the exit code (-1: killed by a signal, or not stopped within 30 s).
  int StopWith(int sig) {
    ::kill(pid_, sig);
    for (int i = 0; i < 3000; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  std::string log_path_;
  pid_t pid_ = -1;
  int port_ = -1;
  bool reaped_ = false;
};

std::unique_ptr<httplib::Client> ClientFor(const ServerProcess& s) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", s.port());
  c->set_read_timeout(std::chrono::seconds(60));
  return c;
}

// POSTs `body` and returns {status, parsed JSON body} (a non-JSON body fails the test).
std::pair<int, Json> Post(httplib::Client& c, const std::string& path, const Json& body) {
  auto res = c.Post(path.c_str(), body.dump(), "application/json");
  if (!res) {
    ADD_FAILURE() << "no response to " << path << ": " << httplib::to_string(res.error());
    return {0, Json()};
  }
  Json j = Json::parse(res->body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << path << " answered " << res->status << " with a non-JSON body: " << res->body;
  return {res->status, j};
}

// The events of a Server-Sent Events body: each `data: ...` payload, in order.
std::vector<std::string> SseEvents(const std::string& body) {
  std::vector<std::string> events;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) == 0) events.push_back(line.substr(6));
  }
  return events;
}

// What `nflash run` prints (stdout only): the prompt echoed, the continuation, a newline.
std::string RunText(const std::string& model, const std::string& sampling, std::string prompt = kPrompt) {
  for (size_t at = 0; (at = prompt.find('\'', at)) != std::string::npos; at += 4) prompt.replace(at, 1, "'\\''");
  auto r = testing::RunCommand(Nflash() + " run -m " + model + " -p '" + prompt + "' " + sampling + " 2>/dev/null", false);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

class ServeDenseTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    auto r = testing::RunCommand(Nflash() + " -q convert " + Stories() + " -o " + Model() + " --type f32");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    server_ = new ServerProcess("-m " + Model() + " -t 2", dir_->File("serve.log"));
    ASSERT_GT(server_->port(), 0) << server_->Log();
    ASSERT_TRUE(server_->WaitHealthy()) << server_->Log();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete dir_;
  }
  static std::string Model() { return dir_->File("s.gguf"); }
  // A greedy /completion of `n` tokens after kPrompt.
  static Json Greedy(int n) {
    auto c = ClientFor(*server_);
    auto [status, j] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", n}, {"temperature", 0}});
    EXPECT_EQ(status, 200) << j.dump();
    return j;
  }
  static testing::TempDir* dir_;
  static ServerProcess* server_;
};
testing::TempDir* ServeDenseTest::dir_ = nullptr;
ServerProcess* ServeDenseTest::server_ = nullptr;

// A port already taken: the second server says so and exits (it must not run without a listening socket).
TEST_F(ServeDenseTest, TakenPortIsAClearError) {
  const std::string port = std::to_string(server_->port());
  auto r = testing::RunCommand("timeout 60 " + Nflash() + " serve -m " + Model() + " --port " + port);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot listen on 127.0.0.1:" + port), std::string::npos) << r.output;
}

TEST_F(ServeDenseTest, HealthAndModels) {
  auto c = ClientFor(*server_);
  auto res = c->Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(Json::parse(res->body), Json({{"status", "ok"}}));
  res = c->Get("/v1/models");
  ASSERT_TRUE(res);
  const Json models = Json::parse(res->body);
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "s.gguf");
}

TEST_F(ServeDenseTest, GreedyCompletionEqualsRun) {
  const Json j = Greedy(60);
  EXPECT_EQ(j["tokens_predicted"], 60);
  EXPECT_EQ(j["tokens_evaluated"], 5);  // BOS + 4 tokens, as `nflash run --json` counts them
  EXPECT_EQ(j["stop_reason"], "length");
  EXPECT_GT(j["timings"]["predicted_per_second"].get<double>(), 0);
  EXPECT_GT(j["timings"]["prompt_ms"].get<double>(), 0);
  // Rates are per second of the reported milliseconds.
  for (const char* part : {"prompt", "predicted"}) {
    const Json& tm = j["timings"];
    const double n = tm[std::string(part) + "_n"].get<double>(), ms = tm[std::string(part) + "_ms"].get<double>();
    EXPECT_NEAR(tm[std::string(part) + "_per_second"].get<double>(), n * 1000.0 / ms, 1e-6 * n * 1000.0 / ms) << part;
  }
  EXPECT_EQ(kPrompt + j["content"].get<std::string>() + "\n", RunText(Model(), "-n 60 --temp 0"));
  // Until the model ends the story by itself: the end is "eos", and the text still equals run's.
  const Json full = Greedy(400);
  EXPECT_EQ(full["stop_reason"], "eos") << full.dump();
  EXPECT_LT(full["tokens_predicted"].get<int>(), 400);
  EXPECT_EQ(kPrompt + full["content"].get<std::string>() + "\n", RunText(Model(), "-n 400 --temp 0"));
}

TEST_F(ServeDenseTest, StreamEqualsNonStream) {
  const Json plain = Greedy(60);
  auto c = ClientFor(*server_);
  auto res = c->Post("/completion", Json({{"prompt", kPrompt}, {"n_predict", 60}, {"temperature", 0}, {"stream", true}}).dump(),
                     "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const auto events = SseEvents(res->body);
  ASSERT_GE(events.size(), 2u) << res->body;
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const Json e = Json::parse(events[i]);
    EXPECT_EQ(e["stop"], false);
    EXPECT_FALSE(e["content"].get<std::string>().empty());
    text += e["content"].get<std::string>();
  }
  const Json last = Json::parse(events.back());
  EXPECT_EQ(last["stop"], true);
  EXPECT_EQ(last["tokens_predicted"], 60);
  EXPECT_EQ(last["stop_reason"], "length");
  EXPECT_TRUE(last.contains("timings"));
  EXPECT_EQ(text, plain["content"].get<std::string>());
}

TEST_F(ServeDenseTest, OpenAiCompletionsAgree) {
  const Json plain = Greedy(40);
  auto c = ClientFor(*server_);
  const Json req = {{"model", "anything"}, {"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0}};
  auto [status, j] = Post(*c, "/v1/completions", req);
  ASSERT_EQ(status, 200) << j.dump();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "s.gguf");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["text"], plain["content"]);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  // The same prompt as the request before: all of it but its last token kept in the KV cache.
  EXPECT_EQ(j["usage"], Json({{"prompt_tokens", 5},
                              {"completion_tokens", 40},
                              {"total_tokens", 45},
                              {"prompt_tokens_details", {{"cached_tokens", 4}}}}));

  Json stream_req = req;
  stream_req["stream"] = true;
  auto res = c->Post("/v1/completions", stream_req.dump(), "application/json");
  ASSERT_TRUE(res);
  const auto events = SseEvents(res->body);
  ASSERT_GE(events.size(), 3u) << res->body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) text += Json::parse(events[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, plain["content"].get<std::string>());
  EXPECT_EQ(Json::parse(events[events.size() - 2])["choices"][0]["finish_reason"], "length");

  // The model ending the text: OpenAI has no "eos", it is "stop".
  auto [s_end, j_end] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 400}, {"temperature", 0}});
  ASSERT_EQ(s_end, 200) << j_end.dump();
  EXPECT_LT(j_end["usage"]["completion_tokens"].get<int>(), 400) << "the greedy story ends by itself";
  EXPECT_EQ(j_end["choices"][0]["finish_reason"], "stop");
}

// What a request leaves out: OpenAI's route samples at temperature 1 and top-p 1 (its API's defaults) and stops after
// 16 tokens; llama.cpp's after 128, or what the context has left; ignore_eos generates past the model's end.
TEST_F(ServeDenseTest, EachRoutesDefaults) {
  auto c = ClientFor(*server_);
  int sensitive = 0;  // seeds whose text at temperature 0.8 differs from that at 1
  for (int seed = 1; seed <= 6; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    auto [s1, openai] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 60}, {"seed", seed}});
    auto [s2, llama] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 60}, {"seed", seed},
                                               {"temperature", 1.0}, {"top_p", 1.0}});
    auto [s3, cooler] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 60}, {"seed", seed},
                                                {"temperature", 0.8}, {"top_p", 1.0}});
    ASSERT_EQ(s1, 200) << openai.dump();
    ASSERT_EQ(s2, 200) << llama.dump();
    ASSERT_EQ(s3, 200) << cooler.dump();
    EXPECT_EQ(openai["choices"][0]["text"], llama["content"]);
    sensitive += cooler["content"] != llama["content"];
  }
  EXPECT_GT(sensitive, 0) << "the temperature never changed the text: the comparison shows nothing";

  auto [s4, short_openai] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"temperature", 0}});
  ASSERT_EQ(s4, 200) << short_openai.dump();
  EXPECT_EQ(short_openai["usage"]["completion_tokens"], 16);
  auto [s5, long_llama] = Post(*c, "/completion", {{"prompt", kPrompt}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(s5, 200) << long_llama.dump();
  EXPECT_EQ(long_llama["tokens_predicted"], 128);
  auto [s6, past_end] =
      Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 400}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(s6, 200) << past_end.dump();
  EXPECT_EQ(past_end["tokens_predicted"], 400) << "the greedy story ends before 400 tokens without ignore_eos";
  EXPECT_EQ(past_end["stop_reason"], "length");
  // A prompt that leaves less than 128 tokens of context: the default is what is left.
  std::string prompt = kPrompt;
  for (int i = 0; i < 150; ++i) prompt += " the dog";
  auto [s7, tight] = Post(*c, "/completion", {{"prompt", prompt}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(s7, 200) << tight.dump();
  const int evaluated = tight["tokens_evaluated"].get<int>();
  ASSERT_GT(evaluated, 512 - 128) << "the prompt must leave less than the default";
  EXPECT_EQ(tight["tokens_predicted"], 512 - evaluated);
}

TEST_F(ServeDenseTest, SeededSamplingIsReproducibleAndMatchesRun) {
  auto c = ClientFor(*server_);
  auto sample = [&](int seed) {
    auto [status, j] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 50}, {"temperature", 0.8}, {"seed", seed}});
    EXPECT_EQ(status, 200) << j.dump();
    EXPECT_EQ(j["seed"], seed);
    return j["content"].get<std::string>();
  };
  const std::string a = sample(42);
  EXPECT_EQ(a, sample(42)) << "same seed, same text";
  EXPECT_NE(a, sample(43)) << "another seed, another text";
  // The server's defaults are the Sampler's, which are `nflash run`'s (top-k 40, top-p 0.95, min-p 0.05).
  EXPECT_EQ(kPrompt + a + "\n", RunText(Model(), "-n 50 --temp 0.8 --seed 42"));
}

TEST_F(ServeDenseTest, StopStringsZeroTokensAndRandomSeeds) {
  const std::string greedy = Greedy(60)["content"].get<std::string>();
  const size_t lily = greedy.find("Lily");
  ASSERT_NE(lily, std::string::npos) << greedy;
  auto c = ClientFor(*server_);
  // A stop string as a plain string (OpenAI's form) and in an array (llama.cpp's): the text ends before it.
  auto [s1, j1] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 60}, {"temperature", 0}, {"stop", "Lily"}});
  ASSERT_EQ(s1, 200) << j1.dump();
  EXPECT_EQ(j1["content"], greedy.substr(0, lily));
  EXPECT_EQ(j1["stop_reason"], "stop");
  EXPECT_EQ(j1["stopping_word"], "Lily");
  auto [s2, j2] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 60}, {"temperature", 0},
                                              {"stop", {"zzz", "Lily"}}});
  ASSERT_EQ(s2, 200) << j2.dump();
  EXPECT_EQ(j2["choices"][0]["text"], greedy.substr(0, lily));
  EXPECT_EQ(j2["choices"][0]["finish_reason"], "stop");
  // n_predict 0: the prompt is evaluated, nothing generated.
  auto [s3, j3] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 0}});
  ASSERT_EQ(s3, 200) << j3.dump();
  EXPECT_EQ(j3["content"], "");
  EXPECT_EQ(j3["tokens_predicted"], 0);
  EXPECT_EQ(j3["tokens_evaluated"], 5);
  // No seed (or -1): a fresh one each time, reported so that the text can be had again.
  auto [s4, j4] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 30}, {"seed", -1}});
  ASSERT_EQ(s4, 200) << j4.dump();
  auto [s5, j5] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 30}, {"seed", j4["seed"]}});
  EXPECT_EQ(j5["content"], j4["content"]);
  auto [s6, j6] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 30}});
  EXPECT_NE(j6["seed"], j4["seed"]);
}

TEST_F(ServeDenseTest, BadRequestsGet400NamingTheField) {
  auto c = ClientFor(*server_);
  struct Case {
    const char* path;
    std::string body;
    std::vector<std::string> expected;  // substrings of error.message
  };
  const std::string p = std::string("\"prompt\": \"") + kPrompt + "\"";
  const std::vector<Case> cases = {
      {"/completion", "{not json", {"not JSON"}},
      {"/completion", "[1, 2]", {"expected a JSON object", "[1,2]"}},
      {"/completion", "{\"n_predict\": 5}", {"missing field 'prompt'"}},
      {"/completion", "{\"prompt\": 7}", {"'prompt'", "expected a string", "found 7"}},
      {"/completion", "{" + p + ", \"n_predict\": \"ten\"}", {"'n_predict'", "expected an integer", "\"ten\""}},
      {"/completion", "{" + p + ", \"n_predict\": -1}", {"'n_predict'", "0 or more", "-1"}},
      {"/completion", "{" + p + ", \"n_predict\": 100000}", {"'n_predict'", "too large for the context", "at most 507", "100000"}},
      {"/completion", "{\"prompt\": \"" + std::string(3000, 'a') + " b" + std::string(3000, 'c') + "\"}", {"'prompt'", "too long"}},
      {"/completion", "{" + p + ", \"temperature\": -0.5}", {"'temperature'", "out of range", "-0.5"}},
      {"/completion", "{" + p + ", \"top_p\": 0}", {"'top_p'", "(0, 1]"}},
      {"/completion", "{" + p + ", \"repeat_last_n\": -2}", {"'repeat_last_n'", "0 or more", "-2"}},
      {"/completion", "{" + p + ", \"stream\": \"yes\"}", {"'stream'", "true or false"}},
      {"/completion", "{" + p + ", \"cache_prompt\": 1}", {"'cache_prompt'", "true or false", "found 1"}},
      {"/completion", "{\"prompt\": []}", {"'prompt' is an empty array of token ids"}},
      {"/v1/completions", "{\"prompt\": [1, 512]}", {"'prompt[1]'", "a token id in [0, 512)", "found 512"}},
      {"/completion", "{" + p + ", \"stop\": [\"ok\", 3]}", {"'stop[1]'", "found 3"}},
      {"/completion", "{" + p + ", \"seed\": 1.5}", {"'seed'", "integer"}},
      {"/v1/completions", "{" + p + ", \"max_tokens\": 1e3}", {"'max_tokens'", "integer"}},
      {"/v1/completions", "{" + p + ", \"model\": 1}", {"'model'", "expected a string"}},
      {"/completion", "{" + p + ", \"min_p\": 1.5}", {"'min_p'", "[0, 1]", "1.5"}},
      {"/completion", "{" + p + ", \"repeat_penalty\": 0}", {"'repeat_penalty'", "> 0"}},
      // JSON has no infinity: a literal beyond double's range is refused by the parser (the range checks' finiteness
      // test is a second line behind it).
      {"/completion", "{" + p + ", \"temperature\": 1e400}", {"not JSON", "overflow"}},
      {"/completion", "{" + p + ", \"seed\": -2}", {"'seed'"}},
      {"/completion", "{" + p + ", \"n_probs\": 21}", {"'n_probs'", "an integer from 0 to 20", "found 21"}},
      {"/v1/completions", "{" + p + ", \"logprobs\": -1}", {"'logprobs'", "an integer from 0 to 20", "found -1"}},
      {"/v1/completions", "{" + p + ", \"logprobs\": 2, \"echo\": true, \"stream\": true}",
       {"'echo' and 'logprobs' with 'stream': true"}},
      {"/v1/completions", "{" + p + ", \"echo\": 1}", {"'echo'", "true or false", "found 1"}},
      {"/v1/chat/completions", "{\"messages\": [], \"top_logprobs\": 2}", {"'top_logprobs' needs 'logprobs': true"}},
      {"/v1/chat/completions", "{\"messages\": [], \"logprobs\": true, \"top_logprobs\": 30}",
       {"'top_logprobs'", "found 30"}},
  };
  for (const Case& k : cases) {
    auto res = c->Post(k.path, k.body, "application/json");
    ASSERT_TRUE(res) << k.body.substr(0, 80);
    EXPECT_EQ(res->status, 400) << k.body.substr(0, 80) << " -> " << res->body;
    const Json j = Json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.contains("error")) << res->body;
    const std::string msg = j["error"]["message"].get<std::string>();
    for (const std::string& e : k.expected) EXPECT_NE(msg.find(e), std::string::npos) << "'" << e << "' in: " << msg;
    EXPECT_EQ(j["error"]["type"], "invalid_request_error") << res->body;
    EXPECT_EQ(j["error"]["code"], 400) << res->body;
  }
  auto res = c->Get("/nowhere");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(Json::parse(res->body)["error"]["type"], "not_found_error") << res->body;
  EXPECT_NE(Json::parse(res->body)["error"]["message"].get<std::string>().find("unknown endpoint GET /nowhere"),
            std::string::npos);
  // Still serving after all that.
  EXPECT_EQ(Greedy(5)["tokens_predicted"], 5);
}

// Log-probabilities: each generated token's is the log-softmax of the model's logits at its position, against the
// NumPy reference's logits for the prompt and the generated tokens (an F64 forward pass, tests/reference); greedy, each
// token is its own most likely alternative, the alternatives are the reference's top 3 in order, and their texts
// spell the completion. /v1/completions reports the same tokens and values in OpenAI's legacy shape.
TEST_F(ServeDenseTest, LogprobsAreTheModelsLogSoftmax) {
  auto c = ClientFor(*server_);
  auto [status, j] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 12}, {"temperature", 0},
                                              {"n_probs", 3}, {"cache_prompt", false}});
  ASSERT_EQ(status, 200) << j.dump();
  const Json& probs = j["completion_probabilities"];
  ASSERT_EQ(probs.size(), 12u) << j.dump();
  auto [tstatus, tok] = Post(*c, "/tokenize", {{"content", kPrompt}, {"add_special", true}});
  ASSERT_EQ(tstatus, 200);
  std::vector<int32_t> ids = tok["tokens"].get<std::vector<int32_t>>();
  const size_t n_prompt = ids.size();
  std::string spelled;
  for (const Json& p : probs) {
    ids.push_back(p["id"].get<int32_t>());
    spelled += p["token"].get<std::string>();
    ASSERT_EQ(p["top_logprobs"].size(), 3u);
    EXPECT_EQ(p["top_logprobs"][0]["id"], p["id"]) << "greedy: the most likely token";
    EXPECT_EQ(p["top_logprobs"][0]["logprob"], p["logprob"]);
    EXPECT_GE(p["top_logprobs"][0]["logprob"].get<double>(), p["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_GE(p["top_logprobs"][1]["logprob"].get<double>(), p["top_logprobs"][2]["logprob"].get<double>());
    EXPECT_EQ(p["bytes"].size(), p["token"].get<std::string>().size());
  }
  EXPECT_EQ(spelled, j["content"].get<std::string>());

  const int64_t n_vocab = 512;
  const std::vector<float> ref = testing::NumpyReferenceLogits(Model(), ids, n_vocab, dir_->File("lp.npy"));
  ASSERT_EQ(ref.size(), ids.size() * n_vocab);
  for (size_t i = 0; i < probs.size(); ++i) {
    const float* row = ref.data() + (n_prompt - 1 + i) * n_vocab;
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < n_vocab; ++v) mx = std::max<double>(mx, row[v]);
    for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(row[v] - mx);
    auto ref_logprob = [&](int32_t id) { return row[id] - mx - std::log(sum); };
    EXPECT_NEAR(probs[i]["logprob"].get<double>(), ref_logprob(ids[n_prompt + i]), 1e-3) << "token " << i;
    std::vector<int32_t> order(n_vocab);
    for (int32_t v = 0; v < n_vocab; ++v) order[v] = v;
    std::partial_sort(order.begin(), order.begin() + 3, order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(probs[i]["top_logprobs"][k]["id"], order[k]) << "token " << i << " alternative " << k;
      EXPECT_NEAR(probs[i]["top_logprobs"][k]["logprob"].get<double>(), ref_logprob(order[k]), 1e-3);
    }
  }

  auto [ostatus, o] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 12}, {"temperature", 0},
                                                   {"logprobs", 2}});
  ASSERT_EQ(ostatus, 200) << o.dump();
  const Json& lp = o["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 12u) << o.dump();
  size_t offset = 0;
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(lp["tokens"][i], probs[i]["token"]);
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), probs[i]["logprob"].get<double>(), 1e-6);
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u);
    EXPECT_EQ(lp["text_offset"][i], offset);
    offset += lp["tokens"][i].get<std::string>().size();
  }
  EXPECT_EQ(offset, o["choices"][0]["text"].get<std::string>().size());
  // echo (lm-eval's loglikelihood request: the prompt's own log-probabilities, nothing generated): the text is the
  // prompt, its first token has none, each later one is the reference's log-softmax at the position before it; with
  // tokens generated after it, theirs are the values above.
  auto [es, echo] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 0}, {"echo", true},
                                                 {"logprobs", 1}});
  ASSERT_EQ(es, 200) << echo.dump();
  EXPECT_EQ(echo["choices"][0]["text"], kPrompt);
  const Json& el = echo["choices"][0]["logprobs"];
  ASSERT_EQ(el["tokens"].size(), n_prompt) << echo.dump();
  EXPECT_TRUE(el["token_logprobs"][0].is_null());
  EXPECT_TRUE(el["top_logprobs"][0].is_null());
  std::string echoed;
  for (size_t i = 0; i < n_prompt; ++i) {
    EXPECT_EQ(el["text_offset"][i], echoed.size());
    echoed += el["tokens"][i].get<std::string>();
    if (i == 0) continue;
    const float* row = ref.data() + (i - 1) * n_vocab;
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < n_vocab; ++v) mx = std::max<double>(mx, row[v]);
    for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(row[v] - mx);
    EXPECT_NEAR(el["token_logprobs"][i].get<double>(), row[ids[i]] - mx - std::log(sum), 1e-3) << "prompt token " << i;
    EXPECT_EQ(el["top_logprobs"][i].size(), 1u);
  }
  EXPECT_EQ(echoed, kPrompt);
  auto [es3, echo3] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 3}, {"temperature", 0},
                                                   {"echo", true}, {"logprobs", 1}});
  ASSERT_EQ(es3, 200) << echo3.dump();
  const Json& el3 = echo3["choices"][0]["logprobs"];
  ASSERT_EQ(el3["tokens"].size(), n_prompt + 3);
  std::string first3 = kPrompt;
  for (size_t i = 0; i < 3; ++i) first3 += probs[i]["token"].get<std::string>();
  EXPECT_EQ(echo3["choices"][0]["text"], first3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(el3["token_logprobs"][n_prompt + i].get<double>(), probs[i]["logprob"].get<double>(), 1e-4) << i;
  }
  // A story the model ends itself: the end token that ended it is not listed.
  auto [estatus, ended] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 400}, {"temperature", 0},
                                                   {"n_probs", 1}});
  ASSERT_EQ(estatus, 200);
  ASSERT_EQ(ended["stop_reason"], "eos") << ended.dump();
  EXPECT_EQ(ended["completion_probabilities"].size(), ended["tokens_predicted"].get<size_t>() - 1);
  std::string story;
  for (const Json& p : ended["completion_probabilities"]) story += p["token"].get<std::string>();
  EXPECT_EQ(story, ended["content"].get<std::string>());
  // Without the field there is none.
  auto [nstatus, none] = Post(*c, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 2}});
  ASSERT_EQ(nstatus, 200);
  EXPECT_TRUE(none["choices"][0]["logprobs"].is_null());
  auto [zstatus, zero] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 2}, {"n_probs", 0}});
  ASSERT_EQ(zstatus, 200);
  EXPECT_FALSE(zero.contains("completion_probabilities")) << "n_probs 0 is llama.cpp's none";
  EXPECT_FALSE(j.empty());
}

// The log-probabilities a stream's events carry, joined: llama.cpp's completion_probabilities arrays, OpenAI's legacy
// choices[0].logprobs lists (tokens, token_logprobs, top_logprobs, text_offset) or chat's logprobs.content arrays.
// `texts` (may be null) receives, per event, the text so far and the joined tokens' texts so far.
Json JoinedStreamLogprobs(const std::vector<std::string>& events, const std::string& route,
                          std::vector<std::pair<std::string, std::string>>* texts = nullptr) {
  const bool legacy = route == "/v1/completions", chat = route == "/v1/chat/completions";
  Json joined = legacy ? Json{{"tokens", Json::array()}, {"token_logprobs", Json::array()},
                              {"top_logprobs", Json::array()}, {"text_offset", Json::array()}}
                       : Json::array();
  std::string text, spelled;
  for (const std::string& data : events) {
    if (data == "[DONE]") continue;
    const Json e = Json::parse(data);
    Json part;
    if (route == "/completion") {
      text += e["content"].get<std::string>();
      part = e["completion_probabilities"];
    } else {
      const Json& choice = e["choices"][0];
      if (chat && choice["delta"].contains("content")) text += choice["delta"]["content"].get<std::string>();
      if (legacy) text += choice["text"].get<std::string>();
      if (chat && choice["delta"].contains("role")) {  // the opening event: no token yet
        EXPECT_TRUE(choice["logprobs"].is_null()) << data;
        continue;
      }
      part = chat ? choice["logprobs"]["content"] : choice["logprobs"];
    }
    EXPECT_FALSE(part.is_null()) << "an event without log-probabilities: " << data;
    if (legacy) {
      for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
        for (const Json& v : part[key]) joined[key].push_back(v);
      }
      for (const Json& t : part["tokens"]) spelled += t.get<std::string>();
    } else {
      for (const Json& v : part) {
        joined.push_back(v);
        spelled += v["token"].get<std::string>();
      }
    }
    if (texts) texts->emplace_back(text, spelled);
  }
  return joined;
}

// With log-probabilities a stream's events carry those of the tokens sampled since the previous event: joined, they
// are the non-streamed response's, value for value (the same evaluation: no cached prefix), with the tokens that spelled
// a stop string in the last event and the end token that ended a story in none; a token's log-probability never comes
// after its text.
TEST_F(ServeDenseTest, StreamedLogprobsJoinToTheNonStreamed) {
  auto c = ClientFor(*server_);
  struct Case {
    const char* route;
    Json request;
    const char* field;  // the non-streamed response's
  };
  const std::vector<Case> cases = {
      {"/completion", {{"n_predict", 30}, {"n_probs", 2}, {"stop", {" in the"}}}, "completion_probabilities"},
      {"/completion", {{"n_predict", 400}, {"n_probs", 1}}, "completion_probabilities"},  // the model ends it
      {"/v1/completions", {{"max_tokens", 30}, {"logprobs", 2}, {"stop", " in the"}}, "logprobs"},
      {"/v1/completions", {{"max_tokens", 400}, {"logprobs", 0}}, "logprobs"},
      // A first token with a leading space (" time"): its legacy text keeps it only if the prompt went through the
      // detokenizer first.
      {"/v1/completions", {{"max_tokens", 6}, {"logprobs", 1}, {"prompt", "Once upon a"}}, "logprobs"},
  };
  for (const Case& tc : cases) {
    Json req = tc.request;
    if (!req.contains("prompt")) req["prompt"] = kPrompt;
    req["temperature"] = 0;
    req["cache_prompt"] = false;
    auto [status, plain] = Post(*c, tc.route, req);
    ASSERT_EQ(status, 200) << plain.dump();
    const bool legacy = std::string(tc.route) == "/v1/completions";
    const Json& expected = legacy ? plain["choices"][0]["logprobs"] : plain[tc.field];
    const std::string text = legacy ? plain["choices"][0]["text"] : plain["content"];
    req["stream"] = true;
    auto res = c->Post(tc.route, req.dump(), "application/json");
    ASSERT_TRUE(res) << tc.route;
    const std::vector<std::string> events = SseEvents(res->body);
    std::vector<std::pair<std::string, std::string>> texts;
    const Json joined = JoinedStreamLogprobs(events, tc.route, &texts);
    SCOPED_TRACE(std::string(tc.route) + " " + tc.request.dump());
    EXPECT_EQ(joined, expected);
    ASSERT_FALSE(texts.empty());
    EXPECT_EQ(texts.back().first, text);
    for (const auto& [so_far, spelled] : texts) {
      EXPECT_EQ(spelled.compare(0, so_far.size(), so_far), 0) << "text '" << so_far << "' ahead of its tokens '"
                                                              << spelled << "'";
    }
    const Json last = Json::parse(events[events.size() - (legacy ? 2 : 1)]);
    const Json& last_part = legacy ? last["choices"][0]["logprobs"]["tokens"] : last["completion_probabilities"];
    if (req.contains("stop")) {
      EXPECT_EQ(legacy ? plain["choices"][0]["finish_reason"] : plain["stop_reason"], "stop") << plain.dump();
      EXPECT_GT(last_part.size(), 0u) << "the stop string's tokens come last: " << last.dump();
      EXPECT_GT(texts.back().second.size(), text.size()) << "their text is not in the stream's";
    } else {
      EXPECT_EQ(last_part.size(), 0u) << last.dump();
      EXPECT_EQ(texts.back().second, text);
    }
  }
}

// LogprobOf on logits worked by hand: log p(2) = 3 - ln(e + e^2 + e^3); ties ordered by id.
TEST(LogprobOf, LogSoftmaxAndOrderedAlternatives) {
  const float logits[] = {1.0f, 2.0f, 3.0f, 2.0f};
  const TokenLogprob t = LogprobOf(logits, 1, 3);
  const double z = std::log(std::exp(1.0) + 2 * std::exp(2.0) + std::exp(3.0));
  EXPECT_EQ(t.id, 1);
  EXPECT_NEAR(t.logprob, 2.0 - z, 1e-6);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 2);
  EXPECT_EQ(t.top[1].first, 1);
  EXPECT_EQ(t.top[2].first, 3);
  EXPECT_NEAR(t.top[0].second, 3.0 - z, 1e-6);
  EXPECT_EQ(LogprobOf(logits, 0, 9).top.size(), 4u);
  EXPECT_TRUE(LogprobOf(logits, 0, 0).top.empty());
}

// The prompt cache: a request whose prompt starts with what the last request left in the KV cache (its prompt and
// completion: a chat's next turn) evaluates only the rest, and its text is still what `nflash run` prints for the whole
// prompt; with "cache_prompt": false every token is evaluated again, to the same text.
TEST_F(ServeDenseTest, PromptCacheEvaluatesOnlyTheNewTokens) {
  auto c = ClientFor(*server_);
  const Json one = Greedy(30);
  const std::string turn = kPrompt + one["content"].get<std::string>() + " Then";
  for (const char* path : {"/completion", "/v1/completions"}) {
    const bool openai = std::string(path) == "/v1/completions";
    Greedy(30);  // the context holds kPrompt and its completion again
    const Json req = {{"prompt", turn}, {openai ? "max_tokens" : "n_predict", 40}, {"temperature", 0}};
    auto [status, cached] = Post(*c, path, req);
    ASSERT_EQ(status, 200) << cached.dump();
    Json plain_req = req;
    plain_req["cache_prompt"] = false;
    auto [plain_status, plain] = Post(*c, path, plain_req);
    ASSERT_EQ(plain_status, 200) << plain.dump();
    std::string text, plain_text;
    int64_t prompt_tokens = 0, cache_n = 0, plain_cache_n = 0;
    if (openai) {
      text = cached["choices"][0]["text"].get<std::string>();
      plain_text = plain["choices"][0]["text"].get<std::string>();
      prompt_tokens = cached["usage"]["prompt_tokens"].get<int64_t>();
      cache_n = cached["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
      plain_cache_n = plain["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
    } else {
      text = cached["content"].get<std::string>();
      plain_text = plain["content"].get<std::string>();
      prompt_tokens = cached["tokens_evaluated"].get<int64_t>();
      cache_n = cached["timings"]["cache_n"].get<int64_t>();
      plain_cache_n = plain["timings"]["cache_n"].get<int64_t>();
      EXPECT_EQ(cached["timings"]["prompt_n"].get<int64_t>(), prompt_tokens - cache_n) << cached.dump();
      EXPECT_EQ(plain["timings"]["prompt_n"].get<int64_t>(), prompt_tokens) << plain.dump();
    }
    // The held completion's 29 evaluated tokens are (up to a token where the text was cut) the turn's too.
    EXPECT_GT(cache_n, 20) << path << " " << cached.dump();
    EXPECT_LT(cache_n, prompt_tokens) << path;
    EXPECT_EQ(plain_cache_n, 0) << path << " " << plain.dump();
    EXPECT_EQ(text, plain_text) << path;
    EXPECT_EQ(turn + text + "\n", RunText(Model(), "-n 40 --temp 0", turn)) << path;
  }
  EXPECT_NE(server_->Log().find("prompt tokens ("), std::string::npos) << server_->Log();
}

TEST_F(ServeDenseTest, ConcurrentRequestsWaitTheirTurn) {
  const std::string expected = Greedy(200)["content"].get<std::string>();
  std::vector<std::future<Json>> replies;
  for (int i = 0; i < 3; ++i) replies.push_back(std::async(std::launch::async, [] { return Greedy(200); }));
  for (auto& r : replies) EXPECT_EQ(r.get()["content"].get<std::string>(), expected);
}

// A raw socket that reads the first event of a stream and closes: the server must log that it stopped early.
// ignore_eos: greedy decoding ends this story after 342 tokens (~50 ms), too close to a loaded client's reaction
// time; without the end token the server has 507 tokens (~75 ms) to notice the disconnect. A client slower than that
// (a loaded CI machine) closes after the whole stream sat in the socket buffers: the server then logs a completed
// stream, which says nothing about disconnects, and the attempt is repeated (at most 5 times).
TEST_F(ServeDenseTest, DisconnectMidStreamStopsGeneration) {
  const std::string body = Json({{"prompt", kPrompt}, {"n_predict", 507}, {"temperature", 0},
                                 {"ignore_eos", true}, {"stream", true}}).dump();
  const std::string req = "POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  const std::regex disconnected("client disconnected after ([0-9]+) generated tokens");
  std::smatch m;
  std::string log;
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
    std::string got;
    char buf[64];
    while (got.find("data: ") == std::string::npos) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      ASSERT_GT(n, 0);
      got.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    // The next request runs after the abandoned one has ended; by then the log says how it ended (the server logs a
    // cancelled stream before releasing the generation lock).
    Greedy(1);
    log = server_->Log();
    if (std::regex_search(log, m, disconnected)) break;
    // Not noticed: the only other acceptable outcome is a stream that ran to its end before the client closed.
    ASSERT_NE(log.find("(stream): 5 prompt tokens"), std::string::npos) << log;
  }
  ASSERT_TRUE(std::regex_search(log, m, disconnected)) << log;
  EXPECT_LT(std::stoi(m[1].str()), 507);
}

TEST(ServeCliTest, SignalsStopTheServerWithExitCode0) {
  testing::TempDir dir;
  for (int sig : {SIGTERM, SIGINT}) {
    ServerProcess s("-m " + Stories() + " -t 1", dir.File("serve.log"));
    ASSERT_GT(s.port(), 0) << s.Log();
    ASSERT_TRUE(s.WaitHealthy()) << s.Log();
    EXPECT_EQ(s.StopWith(sig), 0) << s.Log();
    EXPECT_NE(s.Log().find("server stopped"), std::string::npos) << s.Log();
  }
}

// --kv-type applies to the dense server too (not a -d-only flag): greedy text equals `run --kv-type f16`'s.
TEST(ServeCliTest, HalfKvCacheServerEqualsRun) {
  testing::TempDir dir;
  const std::string model = dir.File("s.gguf");
  auto r = testing::RunCommand(Nflash() + " -q convert " + Stories() + " -o " + model + " --type f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ServerProcess s("-m " + model + " -t 1 --kv-type f16", dir.File("serve.log"));
  ASSERT_GT(s.port(), 0) << s.Log();
  ASSERT_TRUE(s.WaitHealthy()) << s.Log();
  auto c = ClientFor(s);
  auto [status, j] = Post(*c, "/completion", {{"prompt", kPrompt}, {"n_predict", 60}, {"temperature", 0}});
  ASSERT_EQ(status, 200) << j.dump();
  EXPECT_EQ(kPrompt + j["content"].get<std::string>() + "\n", RunText(model, "-n 60 --temp 0 --kv-type f16"));
}

TEST(ServeCliTest, UsageErrors) {
  EXPECT_EQ(testing::RunCommand(Nflash() + " serve").exit_code, 2);
  auto r = testing::RunCommand(Nflash() + " serve -m " + Stories() + " --memory 3M");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--memory applies to -d"), std::string::npos) << r.output;
  // The other way: -m's model-loading options beside -d, which brings its own tokenizer and activation and reads its
  // weights itself (ignored without a word before session 50; `timeout`: a server that started would run on). Both
  // commands share the options.
  testing::TempDir dir;
  for (const char* command : {" serve --port 0 -d ", " chat -d "}) {
    for (const std::string& flag :
         {std::string("--no-mmap"), std::string("--activation relu"), "--tokenizer " + Stories()}) {
      r = testing::RunCommand("timeout 60 " + Nflash() + command + dir.path() + " " + flag + " </dev/null");
      EXPECT_EQ(r.exit_code, 2) << command << flag << ": " << r.output;
      EXPECT_NE(r.output.find(flag.substr(0, flag.find(' ')) + " excludes --deploy"), std::string::npos)
          << command << flag << ": " << r.output;
    }
  }
  EXPECT_EQ(testing::RunCommand(Nflash() + " serve -m " + Stories() + " --port 70000").exit_code, 2);
  r = testing::RunCommand(Nflash() + " serve -m " + Stories() + " --ctx -1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--ctx -1: expected 0 or more"), std::string::npos) << r.output;
  r = testing::RunCommand(Nflash() + " serve -m " + Stories() + " --chat-template gemma");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("chat template \"gemma\": expected one of chatml, llama2, llama3, mistral, phi3, zephyr"),
            std::string::npos)
      << r.output;
}

// /tokenize and /detokenize against the ids models/stories260K-relu/README.md publishes for "Once upon a time" (BOS 1,
// then 403 407 261 378: the same tokenizer), a prompt given as those ids, and /props.
TEST_F(ServeDenseTest, TokenizeDetokenizeAndProps) {
  auto c = ClientFor(*server_);
  auto [s1, plain] = Post(*c, "/tokenize", {{"content", kPrompt}});
  ASSERT_EQ(s1, 200) << plain.dump();
  EXPECT_EQ(plain, Json({{"tokens", {403, 407, 261, 378}}}));
  auto [s2, bos] = Post(*c, "/tokenize", {{"content", kPrompt}, {"add_special", true}});
  ASSERT_EQ(s2, 200) << bos.dump();
  EXPECT_EQ(bos["tokens"], Json({1, 403, 407, 261, 378}));
  auto [s3, pieces] = Post(*c, "/tokenize", {{"content", kPrompt}, {"with_pieces", true}});
  ASSERT_EQ(s3, 200) << pieces.dump();
  std::string joined;
  for (const Json& p : pieces["tokens"]) joined += p["piece"].get<std::string>();
  EXPECT_EQ(pieces["tokens"][0]["id"], 403);
  EXPECT_EQ(joined, std::string(" ") + kPrompt);  // SentencePiece's space prefix
  auto [s4, text] = Post(*c, "/detokenize", {{"tokens", {1, 403, 407, 261, 378}}});
  ASSERT_EQ(s4, 200) << text.dump();
  EXPECT_EQ(text, Json({{"content", kPrompt}}));
  const std::vector<std::pair<std::pair<std::string, Json>, std::string>> bad = {
      {{"/tokenize", {{"text", kPrompt}}}, "missing field 'content'"},
      {{"/tokenize", {{"content", 3}}}, "'content'"},
      {{"/tokenize", {{"content", kPrompt}, {"add_special", "yes"}}}, "'add_special'"},
      {{"/detokenize", {{"ids", {1}}}}, "missing field 'tokens'"},
      {{"/detokenize", {{"tokens", "1 2"}}}, "'tokens' has the wrong type: expected an array of token ids"},
      {{"/detokenize", {{"tokens", {1, 512}}}},
       "'tokens[1]' has the wrong type: expected a token id in [0, 512), found 512"},
  };
  for (const auto& [req, expected] : bad) {
    auto [s, j] = Post(*c, req.first, req.second);
    EXPECT_EQ(s, 400) << req.second.dump();
    EXPECT_NE(j["error"]["message"].get<std::string>().find(expected), std::string::npos) << j.dump();
  }
  // A prompt given as those ids, BOS included, is the text's prompt: the same greedy completion on both routes.
  const Json by_text = Greedy(30);
  for (const char* path : {"/completion", "/v1/completions"}) {
    const bool openai = std::string(path) == "/v1/completions";
    const Json req = {{"prompt", bos["tokens"]}, {openai ? "max_tokens" : "n_predict", 30}, {"temperature", 0}};
    auto [s, j] = Post(*c, path, req);
    ASSERT_EQ(s, 200) << j.dump();
    EXPECT_EQ(openai ? j["choices"][0]["text"] : j["content"], by_text["content"]) << path;
    EXPECT_EQ(openai ? j["usage"]["prompt_tokens"] : j["tokens_evaluated"], 5) << path;
  }
  auto res = c->Get("/props");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  const Json props = Json::parse(res->body);
  EXPECT_EQ(props["model"], "s.gguf");
  EXPECT_EQ(props["n_ctx"], 512);
  EXPECT_TRUE(props["chat_format"].is_null()) << props.dump();
  EXPECT_EQ(props["chat_template"], "");
  EXPECT_NE(props["engine"].get<std::string>().find("dense engine"), std::string::npos) << props.dump();
}

// Chat without a format: the model has no template and none was given, so a chat request says how to give one.
TEST_F(ServeDenseTest, ChatNeedsAFormat) {
  auto c = ClientFor(*server_);
  auto [status, j] = Post(*c, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}});
  EXPECT_EQ(status, 400) << j.dump();
  EXPECT_NE(j["error"]["message"].get<std::string>().find("the model has no chat template (tokenizer.chat_template): "
                                                          "start nflash serve with --chat-template NAME"),
            std::string::npos)
      << j.dump();
  EXPECT_NE(server_->Log().find("no chat template in the model"), std::string::npos) << server_->Log();
}

// Token 500 of stories260K, respelled "<|end|>" and typed control in the chat model (WriteChatModel).
constexpr int32_t kMarker = 500;

const char kPhi3Template[] =
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif "
    "message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor "
    "%}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}";

// stories260K (F32) carrying a chat template (Phi-3's), with token kMarker spelled `marker` ("<|end|>") as a control
// token, written to `model` ("" when written, else what failed).
std::string WriteChatModel(const testing::TempDir& dir, const std::string& model,
                           const std::string& chat_template = kPhi3Template, const std::string& marker = "<|end|>") {
  const std::string plain = dir.File("plain.gguf");
  auto conv = testing::RunCommand(Nflash() + " -q convert " + Stories() + " -o " + plain + " --type f32");
  if (conv.exit_code != 0) return conv.output;
  return testing::RewriteGguf(
      plain, model,
      [&](std::vector<std::pair<std::string, GgufValue>>* kv) {
        for (auto& [key, value] : *kv) {
          if (key == "tokenizer.ggml.tokens") {
            std::get<GgufArray>(value.v).items[kMarker] = GgufValue(marker);
          } else if (key == "tokenizer.ggml.token_type") {
            std::get<GgufArray>(value.v).items[kMarker] = GgufValue(int32_t{3});
          }
        }
        kv->emplace_back("tokenizer.chat_template", GgufValue(chat_template));
      },
      nullptr);
}

// What the dense engine generates in-process (greedy, at most `n` tokens, a fresh context of 512) after `text`
// encoded with its special tokens parsed.
std::string InProcessReply(const std::string& model, const std::string& text, int64_t n, GenerateResult* result) {
  auto m = Model::Load(model, {});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return "";
  auto tok = LoadTokenizer((*m)->gguf());
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  if (!tok.ok()) return "";
  ThreadPool pool(1);
  InferenceContext ctx(**m, &pool, 512);
  GenerateOptions o;
  o.sampler.temperature = 0;
  o.max_tokens = n;
  std::string reply;
  auto g = Generate(ctx, **tok, (*tok)->Encode(text, true, /*parse_special=*/true), o, [&](std::string_view p) {
    reply += p;
    return true;
  });
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  if (g.ok() && result != nullptr) *result = *g;
  return reply;
}

// POST /v1/chat/completions on a model that carries a Phi-3 chat template and spells token 500 "<|end|>" (a control
// token): the server recognises the format, writes the messages as Phi-3's template does (the text here by hand), with
// "<|end|>" parsed as the control token, and generates what the engine generates from those ids in-process; streamed
// deltas add up to the same text; the next turn keeps the first one's tokens in the KV cache; malformed messages get
// 400 naming the field. --chat-template overrides the model's.
TEST(ServeChatTest, MessagesInTheModelsFormat) {
  testing::TempDir dir;
  const std::string model = dir.File("chat.gguf");
  const std::string failed = WriteChatModel(dir, model);
  ASSERT_EQ(failed, "") << failed;

  const Json messages = {{{"role", "system"}, {"content", "You tell stories."}},
                         {{"role", "user"}, {"content", "Once upon a time"}}};
  const std::string prompt = "<|system|>\nYou tell stories.<|end|>\n<|user|>\nOnce upon a time<|end|>\n<|assistant|>\n";
  auto file = GgufFile::OpenPath(model);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto tok = LoadTokenizer(*file);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const std::vector<int32_t> ids = (*tok)->Encode(prompt, true, /*parse_special=*/true);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kMarker), 2);
  // What the engine generates from that text, in-process.
  GenerateResult g;
  const std::string expected = InProcessReply(model, prompt, 40, &g);
  ASSERT_FALSE(expected.empty());

  ServerProcess server("-m " + model + " -t 2", dir.File("serve.log"));
  ASSERT_TRUE(server.WaitHealthy()) << server.Log();
  EXPECT_NE(server.Log().find("chat messages in the phi3 format, recognised from the model's chat template"),
            std::string::npos)
      << server.Log();
  auto c = ClientFor(server);
  auto props = c->Get("/props");
  ASSERT_TRUE(props);
  EXPECT_EQ(Json::parse(props->body)["chat_format"], "phi3") << props->body;
  EXPECT_NE(Json::parse(props->body)["chat_template"].get<std::string>().find("<|assistant|>"), std::string::npos);
  // /tokenize parses the marker as the control token only when asked to.
  auto [ts, special] = Post(*c, "/tokenize", {{"content", "<|end|>"}, {"parse_special", true}});
  ASSERT_EQ(ts, 200) << special.dump();
  EXPECT_EQ(special["tokens"], Json({kMarker}));
  auto [ts2, spelled] = Post(*c, "/tokenize", {{"content", "<|end|>"}});
  ASSERT_EQ(ts2, 200) << spelled.dump();
  EXPECT_GT(spelled["tokens"].size(), 1u) << spelled.dump();
  const Json req = {{"messages", messages}, {"max_tokens", 40}, {"temperature", 0}};
  auto [status, j] = Post(*c, "/v1/chat/completions", req);
  ASSERT_EQ(status, 200) << j.dump();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u) << j.dump();
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], g.reason == StopReason::kMaxTokens ? "length" : "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], g.generated_tokens);

  // Streamed: the role first, then the text in deltas, then the finish reason and usage, then [DONE].
  Json sreq = req;
  sreq["stream"] = true;
  auto res = c->Post("/v1/chat/completions", sreq.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  const auto events = SseEvents(res->body);
  ASSERT_GE(events.size(), 4u) << res->body;
  EXPECT_EQ(events.back(), "[DONE]");
  const Json opening = Json::parse(events.front());
  EXPECT_EQ(opening["object"], "chat.completion.chunk");
  EXPECT_EQ(opening["choices"][0]["delta"], Json({{"role", "assistant"}, {"content", ""}}));
  std::string streamed;
  for (size_t i = 1; i + 2 < events.size(); ++i) {
    const Json e = Json::parse(events[i]);
    EXPECT_TRUE(e["choices"][0]["finish_reason"].is_null());
    streamed += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, expected);
  const Json closing = Json::parse(events[events.size() - 2]);
  EXPECT_EQ(closing["choices"][0]["delta"], Json::object());
  EXPECT_EQ(closing["choices"][0]["finish_reason"], j["choices"][0]["finish_reason"]);
  EXPECT_EQ(closing["usage"]["completion_tokens"], g.generated_tokens);

  // Without max_tokens the reply may fill the context (OpenAI's chat has no default limit): the model ends its turn.
  GenerateResult whole;
  const std::string unbounded = InProcessReply(model, prompt, 512 - static_cast<int64_t>(ids.size()), &whole);
  EXPECT_GT(whole.generated_tokens, 16);  // more than /v1/completions' default budget
  auto [unbounded_status, uj] = Post(*c, "/v1/chat/completions", {{"messages", messages}, {"temperature", 0}});
  ASSERT_EQ(unbounded_status, 200) << uj.dump();
  EXPECT_EQ(uj["usage"]["completion_tokens"], whole.generated_tokens);
  EXPECT_EQ(uj["choices"][0]["message"]["content"], unbounded);
  // With log-probabilities (chat's shape): one entry per token of the reply (an end token that ended it would not be
  // listed); greedy, each is its own most likely alternative; their texts spell the reply.
  Json lp_req = {{"messages", messages}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2},
                 {"cache_prompt", false}};
  auto [lp_status, lj] = Post(*c, "/v1/chat/completions", lp_req);
  ASSERT_EQ(lp_status, 200) << lj.dump();
  EXPECT_EQ(lj["choices"][0]["message"]["content"], unbounded);
  const Json& content = lj["choices"][0]["logprobs"]["content"];
  const bool ended = whole.reason == StopReason::kEos || whole.reason == StopReason::kBos;
  EXPECT_EQ(content.size(), static_cast<size_t>(whole.generated_tokens) - (ended ? 1 : 0));
  std::string reply_tokens;
  for (const Json& e : content) {
    reply_tokens += e["token"].get<std::string>();
    ASSERT_EQ(e["top_logprobs"].size(), 2u);
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);
    EXPECT_EQ(e["top_logprobs"][0]["logprob"], e["logprob"]);
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
  }
  EXPECT_EQ(reply_tokens, unbounded);
  // Streamed: the deltas' log-probabilities joined are the same list (the end-of-turn marker in none of them).
  lp_req["stream"] = true;
  auto lp_res = c->Post("/v1/chat/completions", lp_req.dump(), "application/json");
  ASSERT_TRUE(lp_res);
  std::vector<std::pair<std::string, std::string>> texts;
  EXPECT_EQ(JoinedStreamLogprobs(SseEvents(lp_res->body), "/v1/chat/completions", &texts), content);
  ASSERT_FALSE(texts.empty());
  EXPECT_EQ(texts.back(), std::make_pair(unbounded, unbounded));

  // The next turn: the conversation so far is in the KV cache.
  Json next = messages;
  next.push_back({{"role", "assistant"}, {"content", expected}});
  next.push_back({{"role", "user"}, {"content", "What happened next?"}});
  auto [next_status, nj] =
      Post(*c, "/v1/chat/completions", {{"messages", next}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(next_status, 200) << nj.dump();
  EXPECT_GE(nj["usage"]["prompt_tokens_details"]["cached_tokens"].get<size_t>(), ids.size() - 1) << nj.dump();

  struct Bad {
    Json body;
    std::vector<std::string> expected;
  };
  const Json user = {{"role", "user"}, {"content", "Hi"}};
  const std::vector<Bad> bad = {
      {{{"max_tokens", 4}}, {"missing field 'messages'"}},
      {{{"messages", "Hi"}}, {"'messages'", "an array of messages", "\"Hi\""}},
      {{{"messages", Json::array()}}, {"messages: expected at least one message, found none"}},
      {{{"messages", {7}}}, {"'messages[0]'", "an object with 'role' and 'content'", "found 7"}},
      {{{"messages", {{{"content", "Hi"}}}}}, {"missing field 'messages[0].role'"}},
      {{{"messages", {user, {{"role", "tool"}, {"content", "x"}}}}}, {"messages[1]: role \"tool\""}},
      {{{"messages", {user, {{"role", "system"}, {"content", "x"}}}}},
       {"messages[1]: a system message must be the first"}},
      {{{"messages", {{{"role", "user"}, {"content", 5}}}}},
       {"'messages[0].content'", "a string or an array of text parts"}},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", "x"}}}}}}}},
       {"'messages[0].content[0]'", "nflash reads text only"}},
      {{{"messages", {user}}, {"max_completion_tokens", 100000}},
       {"'max_completion_tokens'", "too large for the context"}},
  };
  for (const Bad& b : bad) {
    auto [bs, bj] = Post(*c, "/v1/chat/completions", b.body);
    EXPECT_EQ(bs, 400) << b.body.dump() << " -> " << bj.dump();
    const std::string msg = bj["error"]["message"].get<std::string>();
    for (const std::string& e : b.expected) EXPECT_NE(msg.find(e), std::string::npos) << "'" << e << "' in: " << msg;
  }
  // Text parts are joined with newlines; max_completion_tokens is a token budget as max_tokens is.
  const Json text_parts = {{{"type", "text"}, {"text", "You tell"}}, {{"type", "text"}, {"text", "stories."}}};
  const Json parts = {{{"role", "system"}, {"content", text_parts}},
                      {{"role", "user"}, {"content", "Once upon a time"}}};
  auto [ps, pj] =
      Post(*c, "/v1/chat/completions", {{"messages", parts}, {"max_completion_tokens", 3}, {"temperature", 0}});
  ASSERT_EQ(ps, 200) << pj.dump();
  EXPECT_EQ(pj["usage"]["completion_tokens"], 3);
  EXPECT_EQ(pj["usage"]["prompt_tokens"], (*tok)->Encode("<|system|>\nYou tell\nstories.<|end|>\n<|user|>\nOnce upon a "
                                                         "time<|end|>\n<|assistant|>\n", true, true).size());
  EXPECT_EQ(server.StopWith(SIGTERM), 0) << server.Log();

  // --chat-template over the model's: ChatML, whose markers this vocabulary spells out as text.
  ServerProcess chatml("-m " + model + " -t 2 --chat-template chatml", dir.File("chatml.log"));
  ASSERT_TRUE(chatml.WaitHealthy()) << chatml.Log();
  auto cc = ClientFor(chatml);
  auto [cs, cj] = Post(*cc, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1}, {"temperature", 0}});
  ASSERT_EQ(cs, 200) << cj.dump();
  EXPECT_EQ(cj["usage"]["prompt_tokens"], (*tok)->Encode("<|im_start|>system\nYou tell stories.<|im_end|>\n<|im_start|>"
                                                         "user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n",
                                                         true, true).size());
  EXPECT_NE(chatml.Log().find("chat messages in the chatml format (--chat-template)"), std::string::npos)
      << chatml.Log();
  EXPECT_EQ(chatml.StopWith(SIGTERM), 0) << chatml.Log();
}

// `nflash chat`: two lines of input are two user turns. Each reply equals what the engine generates in-process from the
// whole conversation written by hand in Phi-3's format (a fresh context each time: no cache), while the command keeps
// the first turn in its KV cache for the second. A model without a chat format is refused naming --chat-template; the
// offloaded runtime (a stories260K-relu deployment, oracle) converses exactly as the dense engine does.
// A reasoning template (Qwen3's markers): the server writes the generation prompt as the template does (an empty think
// block when chat_template_kwargs.enable_thinking is false, "<think>\n" always for a 2507-style thinking template; the
// prompts here by hand) and returns the reply split. stories260K never closes the think block: the forced template's
// reply is all reasoning_content (newlines at its ends stripped) with an empty content, a reply after an empty think
// block all content; streamed deltas add up to the same. A bad chat_template_kwargs gets 400 naming the field.
TEST(ServeChatTest, ReasoningTemplatesSplitTheReply) {
  auto strip_nl = [](std::string s) {
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s.substr(std::min(s.size(), s.find_first_not_of('\n')));
  };
  const std::string turns =
      "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1] "
      "+ '<|im_end|>\\n' }}{%- endfor %}";
  const std::string base = "<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n";
  const Json messages = {{{"role", "user"}, {"content", "Once upon a time"}}};
  for (const bool forced : {false, true}) {
    SCOPED_TRACE(forced ? "forced" : "switch");
    testing::TempDir dir;
    const std::string model = dir.File("qwen3-chat.gguf");
    const std::string tmpl =
        turns + (forced ? "{{- '<|im_start|>assistant\\n<think>\\n' }}"
                        : "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is "
                          "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}");
    const std::string failed = WriteChatModel(dir, model, tmpl, "<|im_end|>");
    ASSERT_EQ(failed, "") << failed;
    ServerProcess server("-m " + model + " -t 2", dir.File("serve.log"));
    ASSERT_TRUE(server.WaitHealthy()) << server.Log();
    EXPECT_NE(server.Log().find("chatml format, recognised from the model's chat template; a reasoning template"),
              std::string::npos)
        << server.Log();
    auto c = ClientFor(server);
    struct Turn {
      Json kwargs;
      std::string prompt;
    };
    std::vector<Turn> turns_to_check = {{nullptr, base + (forced ? "<think>\n" : "")}};
    if (!forced) turns_to_check.push_back({{{"enable_thinking", false}}, base + "<think>\n\n</think>\n\n"});
    for (const Turn& t : turns_to_check) {
      GenerateResult g;
      const std::string reply = InProcessReply(model, t.prompt, 30, &g);
      ASSERT_FALSE(reply.empty());
      Json req = {{"messages", messages}, {"max_tokens", 30}, {"temperature", 0}};
      if (!t.kwargs.is_null()) req["chat_template_kwargs"] = t.kwargs;
      auto [status, j] = Post(*c, "/v1/chat/completions", req);
      ASSERT_EQ(status, 200) << j.dump();
      auto file = GgufFile::OpenPath(model);
      ASSERT_TRUE(file.ok());
      auto tok = LoadTokenizer(*file);
      ASSERT_TRUE(tok.ok());
      EXPECT_EQ(j["usage"]["prompt_tokens"], (*tok)->Encode(t.prompt, true, /*parse_special=*/true).size()) << t.prompt;
      const Json& message = j["choices"][0]["message"];
      if (forced) {
        EXPECT_EQ(message["reasoning_content"], strip_nl(reply)) << j.dump();
        EXPECT_EQ(message["content"], "") << j.dump();
      } else {
        EXPECT_FALSE(message.contains("reasoning_content")) << j.dump();
        EXPECT_EQ(message["content"], reply) << j.dump();
      }
      req["stream"] = true;
      auto res = c->Post("/v1/chat/completions", req.dump(), "application/json");
      ASSERT_TRUE(res);
      std::string reasoning, content;
      for (const std::string& e : SseEvents(res->body)) {
        if (e == "[DONE]") continue;
        const Json delta = Json::parse(e)["choices"][0]["delta"];
        if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
        if (delta.contains("content")) content += delta["content"].get<std::string>();
      }
      EXPECT_EQ(reasoning, message.value("reasoning_content", ""));
      EXPECT_EQ(content, message["content"].get<std::string>());
    }
    // `nflash chat --no-think` writes the same prompt as enable_thinking false (its reply: that prompt's), and is
    // refused by a template that always thinks.
    testing::WriteText(dir.File("turn.txt"), "Once upon a time\n");
    auto chat = testing::RunCommand(Nflash() + " chat -m " + model + " -t 2 --temp 0 -n 30 --no-think < " +
                                        dir.File("turn.txt") + " 2> " + dir.File("chat.log"),
                                    false);
    if (forced) {
      EXPECT_EQ(chat.exit_code, 2) << chat.output;
      EXPECT_NE(ReadText(dir.File("chat.log")).find("--no-think: the model's chat template does not read "
                                                    "enable_thinking"),
                std::string::npos)
          << ReadText(dir.File("chat.log"));
    } else {
      EXPECT_EQ(chat.exit_code, 0) << ReadText(dir.File("chat.log"));
      EXPECT_EQ(chat.output, InProcessReply(model, base + "<think>\n\n</think>\n\n", 30, nullptr) + "\n");
    }
    for (const auto& [kwargs, field] : {std::pair<Json, std::string>{Json(3), "'chat_template_kwargs'"},
                                        {Json({{"enable_thinking", "no"}}), "'chat_template_kwargs.enable_thinking'"}}) {
      auto [status, j] = Post(*c, "/v1/chat/completions", {{"messages", messages}, {"chat_template_kwargs", kwargs}});
      EXPECT_EQ(status, 400) << j.dump();
      EXPECT_NE(j["error"]["message"].get<std::string>().find(field), std::string::npos) << j.dump();
    }
  }
}

TEST(ChatCliTest, TurnsFollowTheModelsFormat) {
  testing::TempDir dir;
  const std::string model = dir.File("chat.gguf");
  const std::string failed = WriteChatModel(dir, model);
  ASSERT_EQ(failed, "") << failed;
  testing::WriteText(dir.File("turns.txt"), "Once upon a time\nWhat happened next?\n");
  const std::string first = "<|system|>\nYou tell stories.<|end|>\n<|user|>\nOnce upon a time<|end|>\n<|assistant|>\n";
  const std::string reply1 = InProcessReply(model, first, 20, nullptr);
  const std::string second = first + reply1 + "<|end|>\n<|user|>\nWhat happened next?<|end|>\n<|assistant|>\n";
  const std::string reply2 = InProcessReply(model, second, 20, nullptr);
  ASSERT_FALSE(reply1.empty());
  ASSERT_FALSE(reply2.empty());
  auto r = testing::RunCommand(Nflash() + " chat -m " + model + " -t 2 --temp 0 -n 20 --system 'You tell stories.' < " +
                                   dir.File("turns.txt") + " 2> " + dir.File("chat.log"),
                               false);
  ASSERT_EQ(r.exit_code, 0) << r.output << ReadText(dir.File("chat.log"));
  EXPECT_EQ(r.output, reply1 + "\n" + reply2 + "\n");
  const std::string log = ReadText(dir.File("chat.log"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("turn 2: ([0-9]+) prompt tokens \\(([0-9]+) kept"))) << log;
  EXPECT_GT(std::stoi(m[2].str()), 20) << log;  // the first turn's prompt and reply
  EXPECT_LT(std::stoi(m[2].str()), std::stoi(m[1].str())) << log;

  // No chat format: refused before any input is read.
  r = testing::RunCommand(Nflash() + " chat -m " + Stories() + " < /dev/null");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("start nflash chat with --chat-template NAME"), std::string::npos) << r.output;

  // The offloaded runtime converses as the dense engine does (oracle: the FFN exact).
  const std::string relu = dir.File("r.gguf");
  const std::string made = testing::MakeReluDeployment(relu, dir.File("r.prof"), dir.File("deploy"));
  ASSERT_EQ(made, "") << made;
  const std::string common = " --chat-template chatml --temp 0 -n 30 -c 256 -t 2 < " + dir.File("turns.txt");
  auto dense = testing::RunCommand(Nflash() + " chat -m " + relu + common + " 2> " + dir.File("dense.log"), false);
  auto offloaded = testing::RunCommand(Nflash() + " chat -d " + dir.File("deploy") + " --active-set oracle --memory 3M" +
                                           common + " 2> " + dir.File("offloaded.log"),
                                       false);
  ASSERT_EQ(dense.exit_code, 0) << dense.output << ReadText(dir.File("dense.log"));
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.output << ReadText(dir.File("offloaded.log"));
  for (const char* log : {"dense.log", "offloaded.log"}) {
    EXPECT_NE(ReadText(dir.File(log)).find("turn 2: "), std::string::npos) << ReadText(dir.File(log));
  }
  EXPECT_GT(dense.output.size(), 20u) << dense.output;
  EXPECT_EQ(offloaded.output, dense.output);
}

// The offloaded runtime behind the same API: with the oracle active set a ReLU model's FFN is exact, so greedy text
// from a deployment equals the dense server's for the same model.
TEST(ServeOffloadTest, OracleDeploymentMatchesDenseServer) {
  testing::TempDir dir;
  const std::string model = dir.File("r.gguf");
  const std::string failed = testing::MakeReluDeployment(model, dir.File("r.prof"), dir.File("deploy"));
  ASSERT_EQ(failed, "") << failed;

  ServerProcess dense("-m " + model + " -t 2", dir.File("dense.log"));
  ServerProcess offloaded("-d " + dir.File("deploy") + " --active-set oracle -c 256 --memory 3M -t 2", dir.File("offload.log"));
  ASSERT_TRUE(dense.WaitHealthy()) << dense.Log();
  ASSERT_TRUE(offloaded.WaitHealthy()) << offloaded.Log();
  EXPECT_NE(offloaded.Log().find("offloaded sparse runtime (full, oracle)"), std::string::npos) << offloaded.Log();
  for (const char* prompt : {kPrompt, "The little dog"}) {
    const Json req = {{"prompt", prompt}, {"n_predict", 100}, {"temperature", 0}};
    auto dc = ClientFor(dense);
    auto oc = ClientFor(offloaded);
    auto [ds, dj] = Post(*dc, "/completion", req);
    auto [os, oj] = Post(*oc, "/completion", req);
    ASSERT_EQ(ds, 200) << dj.dump();
    ASSERT_EQ(os, 200) << oj.dump();
    EXPECT_GT(dj["tokens_predicted"].get<int>(), 20);
    EXPECT_EQ(oj["content"], dj["content"]) << prompt;
    EXPECT_EQ(oj["tokens_predicted"], dj["tokens_predicted"]);
    // Streamed from the deployment: the same text again (the second request keeps the prompt's KV but its last
    // token's).
    Json sreq = req;
    sreq["stream"] = true;
    auto res = oc->Post("/completion", sreq.dump(), "application/json");
    ASSERT_TRUE(res);
    std::string text;
    for (const std::string& e : SseEvents(res->body)) text += Json::parse(e)["content"].get<std::string>();
    EXPECT_EQ(text, dj["content"].get<std::string>());
    // A next turn keeps the first one's keys and values on both servers, and still agrees: its new part is more than
    // 64 tokens, so the deployment evaluates it as a batched prefill after the kept prefix.
    const std::string more =
        " Then the sun came out and the birds sang in the trees. The little girl went to the park with her mom and "
        "her dog. They played with a big red ball and ran on the green grass. When they were tired, they sat under a "
        "tree and ate some cake. The dog wanted some cake too, so the girl gave him a little piece.";
    const Json turn = {{"prompt", prompt + dj["content"].get<std::string>() + more}, {"n_predict", 16},
                       {"temperature", 0}};
    auto [dts, dtj] = Post(*dc, "/completion", turn);
    auto [ots, otj] = Post(*oc, "/completion", turn);
    ASSERT_EQ(dts, 200) << dtj.dump();
    ASSERT_EQ(ots, 200) << otj.dump();
    EXPECT_GT(otj["timings"]["cache_n"].get<int>(), 50) << otj.dump();
    EXPECT_GE(otj["timings"]["prompt_n"].get<int>(), 64) << otj.dump();
    EXPECT_EQ(otj["timings"]["cache_n"], dtj["timings"]["cache_n"]);
    EXPECT_EQ(otj["content"], dtj["content"]) << prompt;
    // The prompt's log-probabilities (echo; 80+ tokens, several pieces of 16 with their logits kept, within the
    // deployment's 3 MB) and the generated tokens': the dense server's.
    const Json scored = {{"prompt", prompt + more}, {"max_tokens", 4}, {"temperature", 0}, {"echo", true},
                         {"logprobs", 2}};
    auto [des, dej] = Post(*dc, "/v1/completions", scored);
    auto [oes, oej] = Post(*oc, "/v1/completions", scored);
    ASSERT_EQ(des, 200) << dej.dump();
    ASSERT_EQ(oes, 200) << oej.dump();
    const Json& dl = dej["choices"][0]["logprobs"];
    const Json& ol = oej["choices"][0]["logprobs"];
    ASSERT_GT(dl["tokens"].size(), 80u);
    ASSERT_EQ(ol["tokens"], dl["tokens"]);
    for (size_t i = 1; i < dl["tokens"].size(); ++i) {
      EXPECT_NEAR(ol["token_logprobs"][i].get<double>(), dl["token_logprobs"][i].get<double>(), 1e-3) << i;
    }
  }
  EXPECT_EQ(offloaded.StopWith(SIGTERM), 0) << offloaded.Log();
  EXPECT_EQ(dense.StopWith(SIGTERM), 0) << dense.Log();
}

}  // namespace
}  // namespace nflash
