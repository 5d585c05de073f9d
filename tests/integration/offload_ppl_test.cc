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

// The I/O floor of `bytes` read per token in `requests` under FakeHwProfileJson at queue depth 32 (the runtime's
// default; priced at the depth-8 figure, 100 MB/s at 4 KiB): at or above 4 KiB per request the throughput is the
// 4 KiB one; below it, the 4 KiB IOPS.
double ExpectedIoMs(double bytes, double requests) {
  if (bytes == 0) return 0.0;  // a warm cache that held every neuron the tokens used
  // The test profile: 100 MB/s from 4 KiB requests up; below, the same IOPS (throughput in proportion to the size).
  // The floor takes the mean request in whole bytes.
  const double mean_request = std::round(bytes / requests);
  if (mean_request >= 4096) return bytes / 100e6 * 1e3;
  return bytes / (100e6 * mean_request / 4096) * 1e3;
}

// The same for every byte and request of `row`.
double ExpectedIoMs(const nlohmann::json& row) {
  // (contains() first: operator[] of a const json on a missing key is undefined behaviour, not null; bench rows have
  // reads_per_token, offload's JSON requests_per_token.)
  const double requests = row.contains("requests_per_token") ? row.at("requests_per_token").get<double>()
                                                             : row.at("reads_per_token").get<double>();
  return ExpectedIoMs(row.at("mb_read_per_token").get<double>() * 1e6, requests);
}

// The I/O floor of what `nflash offload --json` says its tokens needed: its reads less the share of the lookahead's
// bytes and requests that belongs to bundles read ahead and never used (prefetched - prefetch_used of prefetched).
double ExpectedNeededIoMs(const nlohmann::json& run) {
  const double prefetched = run.at("prefetched_per_token").get<double>();
  const double unused =
      prefetched > 0 ? (prefetched - run.at("prefetch_used_per_token").get<double>()) / prefetched : 0.0;
  const double bytes =
      (run.at("mb_read_per_token").get<double>() - unused * run.at("prefetch_mb_per_token").get<double>()) * 1e6;
  const double requests =
      run.at("requests_per_token").get<double>() - unused * run.at("prefetch_requests_per_token").get<double>();
  return ExpectedIoMs(bytes, requests);
}

// The predictor's weights as predictor.gguf stores them: both layers' matrices and the output bias of every layer.
double PredictorWeightBytes(const std::string& path) {
  auto g = GgufFile::OpenPath(path);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  if (!g.ok()) return 0;
  double n = 0;
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const GgufTensorInfo& t : g->tensors()) {
    if (ends_with(t.name, "fc1.weight") || ends_with(t.name, "fc2.weight") || ends_with(t.name, "fc2.bias")) {
      n += static_cast<double>(t.n_bytes);
    }
  }
  EXPECT_GT(n, 0.0) << path;
  return n;
}

// The compute floor's parts (ms per token) of a `nflash offload --json` run of `deploy` under FakeHwProfileJson, whose
// kernels all stream 4 GB/s per thread: the dense matrices; the active-set source (the predictor's weights, or the
// oracle's gate rows of every layer: n_layers x n_ff x a gate row); the FFN rows the run had to compute (a gate row per
// predicted neuron, none with the oracle, which has every gate value; an up row and a down column per neuron with
// h != 0). The bundle's part sizes come from manifest.json, the neuron counts from the run's report.
struct FloorPartsMs {
  double dense = 0, predictor = 0, ffn = 0;
};
FloorPartsMs ExpectedComputeMs(const std::string& deploy, const nlohmann::json& run, int threads) {
  const auto m = nlohmann::json::parse(testing::ReadText(deploy + "/manifest.json"));
  const nlohmann::json& b = m.at("bundle");
  const double gate = b.at("gate_bytes").get<double>();
  const double up_down = b.at("up_bytes").get<double>() + b.at("down_bytes").get<double>();
  const bool oracle = run.at("active_set") == "oracle";
  const double ms_per_byte = 1.0 / (4e9 * threads) * 1e3;
  FloorPartsMs f;
  f.dense = static_cast<double>(DenseBytes(deploy + "/resident.gguf")) * ms_per_byte;
  f.predictor = (oracle ? m.at("n_layers").get<double>() * m.at("n_ff").get<double>() * gate
                        : PredictorWeightBytes(deploy + "/predictor.gguf")) *
                ms_per_byte;
  f.ffn = ((oracle ? 0.0 : run.at("active_neurons_per_token").get<double>() * gate) +
           run.at("used_neurons_per_token").get<double>() * up_down) *
          ms_per_byte;
  return f;
}

// Checks a run's floors against ExpectedComputeMs and ExpectedNeededIoMs.
void ExpectFloors(const std::string& deploy, const nlohmann::json& run, int threads) {
  SCOPED_TRACE(deploy + ", " + std::to_string(threads) + " thread(s)");
  ASSERT_TRUE(run.contains("floor_parts_ms")) << run.dump();
  const FloorPartsMs want = ExpectedComputeMs(deploy, run, threads);
  const nlohmann::json& got = run.at("floor_parts_ms");
  EXPECT_GT(want.dense, 0.0);
  EXPECT_GT(want.predictor, 0.0);
  EXPECT_GT(want.ffn, 0.0);
  EXPECT_NEAR(got.at("dense").get<double>(), want.dense, 1e-9 * want.dense);
  EXPECT_NEAR(got.at("predictor").get<double>(), want.predictor, 1e-9 * want.predictor);
  EXPECT_NEAR(got.at("ffn").get<double>(), want.ffn, 1e-9 * want.ffn);
  const double compute = want.dense + want.predictor + want.ffn;
  EXPECT_NEAR(run.at("floor_compute_ms").get<double>(), compute, 1e-9 * compute);
  const double io = ExpectedNeededIoMs(run);
  EXPECT_NEAR(run.at("floor_io_ms").get<double>(), io, 1e-6 * io);
  // The ratio is measured time over the larger floor. The test's hardware profile is not this machine's (its flash
  // figures may be slower than the real disk), so only its sign is checked, not that it is >= 1.
  EXPECT_NEAR(run.at("floor_ratio").get<double>(), run.at("token_ms_mean").get<double>() / std::max(compute, io),
              1e-9 * run.at("floor_ratio").get<double>());
  EXPECT_GT(run.at("floor_ratio").get<double>(), 0.0);
}

TEST_F(OffloadPplTest, OffloadReportsFloors) {
  auto run = [](const std::string& deploy, const std::string& args) {
    auto r = RunCommand(Nflash() + " -q offload -d " + tmp_->File(deploy) + " " + args + " --hw " +
                            tmp_->File("hw.json") + " --json",
                        /*capture_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    auto j = nlohmann::json::parse(r.output, nullptr, false);
    EXPECT_TRUE(j.is_object()) << r.output;
    return j;
  };
  // The oracle without lookahead: every byte read was needed, so the I/O floor is that of the bytes and requests
  // reported, and the compute floor has no gate rows of the FFN (the oracle's are its predictor part).
  const nlohmann::json j = run("deploy", "--active-set oracle --hot-slots 1 --cold-slots 64 -n 24 -t 1 --lookahead 0");
  ASSERT_TRUE(j.is_object());
  for (const char* k : {"floor_compute_ms", "floor_io_ms", "floor_ratio", "token_ms_mean"}) {
    ASSERT_TRUE(j.contains(k) && j[k].is_number()) << k << "\n" << j.dump();
    EXPECT_TRUE(std::isfinite(j[k].get<double>())) << k;
  }
  EXPECT_GT(j["mb_read_per_token"].get<double>(), 0.0);
  EXPECT_EQ(j["prefetched_per_token"].get<double>(), 0.0);
  EXPECT_NEAR(j["floor_io_ms"].get<double>(), ExpectedIoMs(j), 1e-6 * ExpectedIoMs(j));
  ExpectFloors(tmp_->File("deploy"), j, 1);

  // With lookahead (n_ff / 8, given: auto depends on the machine's cores), bundles read ahead and not used are left
  // out of the floor: it is below that of all bytes read.
  const nlohmann::json jl =
      run("deploy", "--active-set oracle --hot-slots 1 --cold-slots 64 -n 24 -t 1 --lookahead 21");
  ASSERT_TRUE(jl.is_object());
  ASSERT_GT(jl["prefetched_per_token"].get<double>(), jl["prefetch_used_per_token"].get<double>()) << jl.dump();
  ASSERT_GT(jl["prefetch_used_per_token"].get<double>(), 0.0) << jl.dump();
  EXPECT_LT(jl["floor_io_ms"].get<double>(), ExpectedIoMs(jl)) << jl.dump();
  ExpectFloors(tmp_->File("deploy"), jl, 1);

  // A predictor on two threads (the profile's 2-thread figures: 8 GB/s): gate rows of every predicted neuron, up and
  // down of those whose gate passed, the predictor's weights.
  const nlohmann::json jp = run("deploy_pred", "--hot-slots 1 --cold-slots 64 -n 24 -t 2 --lookahead 21");
  ASSERT_TRUE(jp.is_object());
  ASSERT_EQ(jp["active_set"], "predictor");
  ASSERT_EQ(jp["compute_threads"], 2);
  // Predicted neurons whose gate turned out inactive: the gate term and the up/down term count different sets.
  ASSERT_GT(jp["active_neurons_per_token"].get<double>(), jp["used_neurons_per_token"].get<double>()) << jp.dump();
  ExpectFloors(tmp_->File("deploy_pred"), jp, 2);

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
  // The deployment's oracle: the compute floor holds the dense matrices, every layer's gate rows and, for the neurons
  // with h != 0, between one up row and down column a token and every neuron's (the bench rows report no neuron
  // counts; offload's parts are checked exactly in OffloadReportsFloors).
  const auto m = nlohmann::json::parse(testing::ReadText(tmp_->File("deploy/manifest.json")));
  const double ms_per_byte = 1.0 / 4e9 * 1e3;  // 1 thread
  const double neurons = m["n_layers"].get<double>() * m["n_ff"].get<double>();
  const double up_down = m["bundle"]["up_bytes"].get<double>() + m["bundle"]["down_bytes"].get<double>();
  const double fixed_ms = (static_cast<double>(DenseBytes(tmp_->File("deploy/resident.gguf"))) +
                           neurons * m["bundle"]["gate_bytes"].get<double>()) *
                          ms_per_byte;
  for (const nlohmann::json& row : {bundles, llmflash}) {
    EXPECT_GE(row["floor_compute_ms"].get<double>(), fixed_ms + up_down * ms_per_byte) << row.dump();
    EXPECT_LE(row["floor_compute_ms"].get<double>(), fixed_ms + neurons * up_down * ms_per_byte) << row.dump();
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
