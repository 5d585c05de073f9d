// The offloaded sparse runtime end to end on stories260K-relu (F32): perplexity through a deployment equals the
// in-memory sparse FFN's to the last digit (oracle and predictor active sets, small and empty caches, both modes), and
// `nflash offload --hw` / `nflash bench --hw` report speed floors that agree with figures the test computes itself
// from its own hardware profile and the resident image.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>

#include "runtime/core/gguf.h"
#include "tests/integration/fake_hw_profile.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using testing::RunCommand;
using testing::SharedPath;
using testing::TempDir;

std::string Nflash() { return testing::NflashBinary(); }

class OffloadPplTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    const std::string model = Model();
    auto c = RunCommand(Nflash() + " -q convert " + SharedPath("models/stories260K-relu/stories260K-relu.bin") +
                        " --tokenizer " + SharedPath("models/stories260K/tok512.bin") +
                        " --activation relu --type f32 -o " + model);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    auto p = RunCommand(Nflash() + " -q profile -m " + model + " -f " + SharedPath("text/tinystories_calib.txt") +
                        " --tokens 3000 -t 2 -o " + model + ".prof");
    ASSERT_EQ(p.exit_code, 0) << p.output;
    // A small predictor (calibration text only): its quality does not matter, only that both engines use it alike.
    auto t = RunCommand(Nflash() + " -q train-predictor -m " + model + " -f " + SharedPath("text/tinystories_calib.txt") +
                        " --tokens 2000 --ranks 16 --max-rank 16 -t 2 -o " + Pred());
    ASSERT_EQ(t.exit_code, 0) << t.output;
    auto k = RunCommand(Nflash() + " -q pack -m " + model + " -p " + model + ".prof -o " + tmp_->File("deploy"));
    ASSERT_EQ(k.exit_code, 0) << k.output;
    auto kp = RunCommand(Nflash() + " -q pack -m " + model + " -p " + model + ".prof -o " + tmp_->File("deploy_pred") +
                         " --predictor " + Pred());
    ASSERT_EQ(kp.exit_code, 0) << kp.output;
    testing::WriteText(tmp_->File("hw.json"), testing::FakeHwProfileJson());
  }
  static void TearDownTestSuite() {
    delete tmp_;
    tmp_ = nullptr;
  }
  static std::string Model() { return tmp_->File("relu.gguf"); }
  static std::string Pred() { return tmp_->File("relu.pred.gguf"); }
  // `nflash perplexity ARGS` over the first 10 windows of 256 tokens of the held-out text, as JSON.
  static nlohmann::json Perplexity(const std::string& args) {
    auto r = RunCommand(Nflash() + " -q perplexity " + args + " -f " + SharedPath("text/tinystories_cased_197K.txt") +
                            " --ctx 256 --max-windows 10 -t 2 --json",
                        /*capture_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
    auto j = nlohmann::json::parse(r.output, nullptr, false);
    EXPECT_TRUE(j.is_object()) << r.output;
    if (!j.is_object()) return nlohmann::json::object();
    EXPECT_EQ(j.value("windows", 0), 10) << args;
    EXPECT_EQ(j.value("predictions", 0), 2560) << args;
    return j;
  }
  static TempDir* tmp_;
};
TempDir* OffloadPplTest::tmp_ = nullptr;

TEST_F(OffloadPplTest, OracleOffloadedEqualsInMemorySparse) {
  const nlohmann::json in_memory = Perplexity("-m " + Model() + " --sparse oracle");
  ASSERT_TRUE(in_memory.contains("perplexity"));
  const double want = in_memory["perplexity"].get<double>();
  EXPECT_GT(want, 1.0);
  EXPECT_LT(want, 20.0);  // stories260K-relu's README: ~5 on held-out stories
  // A small cache (most active bundles read from flash), and a budget that caches most of the FFN. No caches at all
  // gives the same figure too but takes ~1 min here (every bundle a blocking read): not in this suite.
  for (const std::string& engine : {std::string("--mode full --hot-slots 1 --cold-slots 64"),
                                    std::string("--mode llmflash --memory 3M")}) {
    const nlohmann::json off = Perplexity("--deploy " + tmp_->File("deploy") + " --active-set oracle " + engine);
    ASSERT_TRUE(off.contains("offload")) << off.dump();
    // Bitwise: the same double, hence the same printed value to every digit.
    EXPECT_EQ(off["perplexity"].get<double>(), want) << engine;
    EXPECT_EQ(off["offload"]["active_set"], "oracle");
    EXPECT_GT(off["offload"]["mb_read_per_token"].get<double>(), 0.0) << engine << ": nothing read from flash";
  }
}

// --kv-type f16: the offloaded run equals the in-memory one with the same cache type; perplexity moves by less than
// 0.1% against the F32 cache (measured over the whole held-out file: 5.7738 both ways; stories260K 6.3035 / 6.3036).
TEST_F(OffloadPplTest, HalfKvCacheOffloadedEqualsInMemoryAndBarelyMovesPerplexity) {
  const nlohmann::json f32 = Perplexity("-m " + Model() + " --sparse oracle");
  const nlohmann::json f16 = Perplexity("-m " + Model() + " --sparse oracle --kv-type f16");
  ASSERT_TRUE(f32.contains("perplexity") && f16.contains("perplexity"));
  const double a = f32["perplexity"].get<double>(), b = f16["perplexity"].get<double>();
  EXPECT_LT(std::fabs(a - b), 1e-3 * a) << a << " " << b;
  const nlohmann::json off = Perplexity("--deploy " + tmp_->File("deploy") +
                                        " --active-set oracle --mode full --hot-slots 1 --cold-slots 64 --kv-type f16");
  ASSERT_TRUE(off.contains("offload")) << off.dump();
  EXPECT_EQ(off["perplexity"].get<double>(), b);
}

TEST_F(OffloadPplTest, PredictorOffloadedEqualsInMemorySparse) {
  const nlohmann::json in_memory = Perplexity("-m " + Model() + " --sparse predictor --predictor " + Pred());
  ASSERT_TRUE(in_memory.contains("perplexity"));
  const nlohmann::json off =
      Perplexity("--deploy " + tmp_->File("deploy_pred") + " --active-set predictor --hot-slots 1 --cold-slots 128");
  ASSERT_TRUE(off.contains("offload"));
  EXPECT_EQ(off["perplexity"].get<double>(), in_memory["perplexity"].get<double>());
  EXPECT_EQ(off["offload"]["active_set"], "predictor");
  // 128 cold slots: the small predictor's sets mostly fit (64 slots read 0.2 MB/token and take ~25 s here), yet
  // misses still go to flash.
  EXPECT_GT(off["offload"]["mb_read_per_token"].get<double>(), 0.0);
}

TEST_F(OffloadPplTest, PerplexityUsage) {
  const std::string text = " -f " + SharedPath("text/tinystories_cased_197K.txt") + " --max-windows 1";
  EXPECT_EQ(RunCommand(Nflash() + " perplexity" + text).exit_code, 2);  // neither -m nor --deploy
  EXPECT_EQ(RunCommand(Nflash() + " perplexity -m " + Model() + " --deploy " + tmp_->File("deploy") + text).exit_code, 2);
  EXPECT_EQ(RunCommand(Nflash() + " perplexity --deploy " + tmp_->File("deploy") + " --sparse oracle" + text).exit_code,
            2);
}

// Dense bytes per token as the test counts them: every 2-D tensor of resident.gguf except the deployment's tables
// (stories260K has no output.weight: its embedding table is the output head, a full GEMV per token).
uint64_t DenseBytes(const std::string& resident) {
  auto g = GgufFile::OpenPath(resident);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  if (!g.ok()) return 0;
  EXPECT_EQ(g->FindTensor("output.weight"), nullptr);
  EXPECT_NE(g->FindTensor("token_embd.weight"), nullptr);
  uint64_t n = 0;
  for (const GgufTensorInfo& t : g->tensors()) {
    if (t.dims.size() == 2 && t.name.rfind("nflash.", 0) != 0) n += t.n_bytes;
  }
  return n;
}

// The I/O floor of `row` under FakeHwProfileJson at queue depth 32 (the runtime's default; priced at the depth-8 figure,
// 100 MB/s at 4 KiB): at or above 4 KiB per request the throughput is the 4 KiB one; below it, the 4 KiB IOPS.
double ExpectedIoMs(const nlohmann::json& row) {
  const double bytes = row["mb_read_per_token"].get<double>() * 1e6;
  // (contains() first: operator[] of a const json on a missing key is undefined behaviour, not null; bench rows have
  // reads_per_token, offload's JSON requests_per_token.)
  const double requests = row.contains("requests_per_token") ? row.at("requests_per_token").get<double>()
                                                             : row.at("reads_per_token").get<double>();
  if (bytes == 0) return 0.0;  // a warm cache that held every neuron the tokens used
  // The test profile: 100 MB/s from 4 KiB requests up; below, the same IOPS (throughput in proportion to the size).
  // The floor takes the mean request in whole bytes.
  const double mean_request = std::round(bytes / requests);
  if (mean_request >= 4096) return bytes / 100e6 * 1e3;
  return bytes / (100e6 * mean_request / 4096) * 1e3;
}

TEST_F(OffloadPplTest, OffloadReportsFloors) {
  // Without lookahead: every byte read was needed, so the I/O floor is that of the bytes and requests reported.
  auto r = RunCommand(Nflash() + " -q offload -d " + tmp_->File("deploy") + " --active-set oracle --hot-slots 1 " +
                          "--cold-slots 64 -n 24 -t 1 --lookahead 0 --hw " + tmp_->File("hw.json") + " --json",
                      /*capture_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.output;
  for (const char* k : {"floor_compute_ms", "floor_io_ms", "floor_ratio", "token_ms_mean"}) {
    ASSERT_TRUE(j.contains(k) && j[k].is_number()) << k << "\n" << r.output;
    EXPECT_TRUE(std::isfinite(j[k].get<double>())) << k;
  }
  // The compute floor holds at least the dense GEMV part: dense bytes at 4 GB/s (1 thread).
  const double dense_ms = static_cast<double>(DenseBytes(tmp_->File("deploy/resident.gguf"))) / 4e9 * 1e3;
  EXPECT_GT(dense_ms, 0.0);
  EXPECT_GE(j["floor_compute_ms"].get<double>(), dense_ms * (1 - 1e-12));
  EXPECT_GT(j["mb_read_per_token"].get<double>(), 0.0);
  EXPECT_NEAR(j["floor_io_ms"].get<double>(), ExpectedIoMs(j), 1e-6 * ExpectedIoMs(j));
  // The ratio is measured time over the larger floor. The test's hardware profile is not this machine's (its flash
  // figures may be slower than the real disk), so only its sign is checked, not that it is >= 1.
  const double floor = std::max(j["floor_compute_ms"].get<double>(), j["floor_io_ms"].get<double>());
  EXPECT_NEAR(j["floor_ratio"].get<double>(), j["token_ms_mean"].get<double>() / floor, 1e-9);
  EXPECT_GT(j["floor_ratio"].get<double>(), 0.0);

  // With lookahead (n_ff / 8, given: auto depends on the machine's cores), bundles read ahead and not used are left
  // out of the floor: it is at most that of all bytes read.
  auto la = RunCommand(Nflash() + " -q offload -d " + tmp_->File("deploy") + " --active-set oracle --hot-slots 1 " +
                           "--cold-slots 64 -n 24 -t 1 --lookahead 21 --hw " + tmp_->File("hw.json") + " --json",
                       /*capture_stderr=*/false);
  ASSERT_EQ(la.exit_code, 0) << la.output;
  auto jl = nlohmann::json::parse(la.output, nullptr, false);
  ASSERT_TRUE(jl.is_object()) << la.output;
  ASSERT_GT(jl["prefetched_per_token"].get<double>(), jl["prefetch_used_per_token"].get<double>()) << la.output;
  EXPECT_LT(jl["floor_io_ms"].get<double>(), ExpectedIoMs(jl)) << la.output;

  // Text mode prints the same figures.
  auto text = RunCommand(Nflash() + " -q offload -d " + tmp_->File("deploy") + " --active-set oracle -n 4 -t 1 --hw " +
                         tmp_->File("hw.json"));
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("floors ("), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("x the floor"), std::string::npos) << text.output;
}

TEST_F(OffloadPplTest, BenchBundlesModeAndFloors) {
  auto r = RunCommand(Nflash() + " -q bench -m " + Model() + " --deploy " + tmp_->File("deploy") +
                          " --modes bundles,llmflash --memory 3M --tests tg8 -r 1 --warmup 0 -t 1 --hw " +
                          tmp_->File("hw.json") + " --output json",
                      /*capture_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rows = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_TRUE(rows.is_array() && rows.size() == 2u) << r.output;
  const nlohmann::json& bundles = rows[0];
  const nlohmann::json& llmflash = rows[1];
  ASSERT_EQ(bundles["status"], "ok") << bundles.dump();
  ASSERT_EQ(llmflash["status"], "ok") << llmflash.dump();
  EXPECT_EQ(bundles["mode"], "bundles");
  // No cache: not a single hit, and at least the traffic of llmflash with its cache.
  EXPECT_EQ(bundles["hit_rate"].get<double>(), 0.0);
  EXPECT_GT(llmflash["hit_rate"].get<double>(), 0.0);
  EXPECT_GE(bundles["mb_read_per_token"].get<double>(), llmflash["mb_read_per_token"].get<double>());
  for (const nlohmann::json& row : {bundles, llmflash}) {
    EXPECT_GT(row["floor_compute_ms"].get<double>(), 0.0) << row.dump();
    EXPECT_NEAR(row["floor_io_ms"].get<double>(), ExpectedIoMs(row), 1e-6 * ExpectedIoMs(row)) << row.dump();
    EXPECT_GT(row["floor_ratio"].get<double>(), 0.0) << row.dump();
  }
  // The csv gets the floor columns.
  auto csv = RunCommand(Nflash() + " -q bench -m " + Model() + " --deploy " + tmp_->File("deploy") +
                            " --modes bundles --tests tg4 -r 1 --warmup 0 -t 1 --hw " + tmp_->File("hw.json") +
                            " --output csv",
                        /*capture_stderr=*/false);
  ASSERT_EQ(csv.exit_code, 0) << csv.output;
  EXPECT_NE(csv.output.find(",floor_compute_ms,floor_io_ms,floor_ratio\n"), std::string::npos) << csv.output;
  EXPECT_NE(csv.output.find(",bundles,"), std::string::npos) << csv.output;
}

}  // namespace
}  // namespace nflash
