// `nflash plan` end to end: stories260K-relu converted, profiled and packed; a hardware profile written by the test
// (fixed numbers, so results do not depend on the machine); plans at several memory limits, infeasible limits
// explained, outputs never overwritten silently.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "planner/calibration.h"
#include "planner/plan.h"
#include "tests/integration/fake_hw_profile.h"
#include "tests/test_util.h"

namespace nflash::planner {
namespace {

using nflash::testing::RunCommand;
using nflash::testing::SharedPath;
using nflash::testing::TempDir;

std::string Nflash() { return nflash::testing::NflashBinary(); }

class PlanCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    const std::string model = tmp_->File("relu.gguf");
    auto c = RunCommand(Nflash() + " convert " + SharedPath("models/stories260K-relu/stories260K-relu.bin") +
                        " --tokenizer " + SharedPath("models/stories260K/tok512.bin") +
                        " --activation relu --type f32 -o " + model);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    auto p = RunCommand(Nflash() + " -q profile -m " + model + " -f " + SharedPath("text/tinystories_calib.txt") +
                        " --tokens 3000 -t 2 -o " + model + ".prof");
    ASSERT_EQ(p.exit_code, 0) << p.output;
    auto k = RunCommand(Nflash() + " -q pack -m " + model + " -p " + model + ".prof -o " + tmp_->File("deploy"));
    ASSERT_EQ(k.exit_code, 0) << k.output;
    nflash::testing::WriteText(tmp_->File("hw.json"), nflash::testing::FakeHwProfileJson());
  }
  static void TearDownTestSuite() {
    delete tmp_;
    tmp_ = nullptr;
  }
  static nflash::testing::CommandResult Plan(const std::string& args, const std::string& out) {
    return RunCommand(Nflash() + " plan --hw " + tmp_->File("hw.json") + " --deploy " + tmp_->File("deploy") + " " +
                      args + " -o " + tmp_->File(out));
  }
  static TempDir* tmp_;
};
TempDir* PlanCliTest::tmp_ = nullptr;

TEST_F(PlanCliTest, MoreMemoryNeverPlansSlowerAndEveryPlanFits) {
  double last_speed = 0;
  for (const char* mem : {"2800K", "3M", "4M", "8M"}) {
    const std::string out = std::string("plan_") + mem + ".json";
    auto r = Plan(std::string("--memory ") + mem + " --explain", out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("layer_us"), std::string::npos) << r.output;  // the --explain table
    auto plan = LoadPlan(tmp_->File(out));
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_LE(plan->predicted.memory_bytes, plan->memory_limit_bytes) << mem;
    ASSERT_EQ(plan->regions.size(), 5u);
    for (const RegionPlan& rp : plan->regions) EXPECT_LE(rp.hot_neurons + rp.cold_slots, 172) << mem;
    EXPECT_TRUE(CheckPlanForDeployment(*plan, tmp_->File("deploy")).ok());
    EXPECT_GE(plan->predicted.tokens_per_s, last_speed * (1 - 1e-9)) << mem;
    last_speed = plan->predicted.tokens_per_s;
    // The runtime takes it: the plan's memory, filled by the solver to within a slot, holds what a runtime with the
    // plan's threads counts (its fixed part is measured with as many threads as the plan may choose).
    auto run = RunCommand(Nflash() + " -q offload -d " + tmp_->File("deploy") + " --plan " + tmp_->File(out) + " -n 2");
    EXPECT_EQ(run.exit_code, 0) << mem << ": " << run.output;
  }
  // 8 MiB holds the whole FFN (0.68 MiB of flash image): nothing left to read.
  auto all = LoadPlan(tmp_->File("plan_8M.json"));
  ASSERT_TRUE(all.ok());
  EXPECT_NEAR(all->predicted.served_fraction, 1.0, 1e-9);
  EXPECT_NEAR(all->predicted.io_s, 0.0, 1e-12);
}

TEST_F(PlanCliTest, InfeasibleLimitsNameTheConflictAndTheNearestFeasibleLimit) {
  auto below_fixed = Plan("--memory 1M", "x.json");
  EXPECT_EQ(below_fixed.exit_code, 2) << below_fixed.output;
  EXPECT_NE(below_fixed.output.find("fixed_part"), std::string::npos) << below_fixed.output;
  EXPECT_NE(below_fixed.output.find("KV cache"), std::string::npos) << below_fixed.output;
  // Its KV cache (stories260K's whole 512-token context) is most of that limit: the message says so and how to shrink it.
  EXPECT_NE(below_fixed.output.find("sized for a context of 512 tokens (the model's): --ctx N"), std::string::npos)
      << below_fixed.output;
  // With a small context the cache is not the problem, and no such hint is given.
  auto small_ctx = Plan("--memory 1M --ctx 64 --kv-type f16", "x.json");
  EXPECT_EQ(small_ctx.exit_code, 2) << small_ctx.output;
  EXPECT_NE(small_ctx.output.find("fixed_part"), std::string::npos) << small_ctx.output;
  EXPECT_EQ(small_ctx.output.find("sized for a context"), std::string::npos) << small_ctx.output;

  auto too_fast = Plan("--memory 2800K --min-speed 1000000", "x.json");
  EXPECT_EQ(too_fast.exit_code, 2) << too_fast.output;
  EXPECT_NE(too_fast.output.find("min_speed"), std::string::npos) << too_fast.output;
  EXPECT_NE(too_fast.output.find("within"), std::string::npos) << too_fast.output;  // the best speed that fits
  EXPECT_FALSE(std::ifstream(tmp_->File("x.json")).good());                          // nothing written

  // --objective memory: the smallest plan reaching a speed the 4M plan reaches, no larger than that plan.
  auto fast = LoadPlan(tmp_->File("plan_4M.json"));
  if (fast.ok()) {
    const double target = fast->predicted.tokens_per_s * 0.9;
    auto small = Plan("--memory 8M --objective memory --min-speed " + std::to_string(target), "small.json");
    ASSERT_EQ(small.exit_code, 0) << small.output;
    auto s = LoadPlan(tmp_->File("small.json"));
    ASSERT_TRUE(s.ok());
    EXPECT_LE(s->predicted.memory_bytes, fast->predicted.memory_bytes);
    EXPECT_GE(s->predicted.tokens_per_s, target * (1 - 1e-3));
  }
}

TEST_F(PlanCliTest, BadInputsAreUsageErrors) {
  auto exists = Plan("--memory 3M", "hw.json");  // the output exists
  EXPECT_EQ(exists.exit_code, 2) << exists.output;
  nflash::testing::WriteText(tmp_->File("bad_hw.json"), "{\"format\": \"nflash.hw_profile\", \"version\": 7}");
  auto bad = RunCommand(Nflash() + " plan --hw " + tmp_->File("bad_hw.json") + " --deploy " + tmp_->File("deploy") +
                        " --memory 3M -o " + tmp_->File("y.json"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("version"), std::string::npos) << bad.output;
  auto size = Plan("--memory 3Q", "y.json");
  EXPECT_EQ(size.exit_code, 2) << size.output;
  auto memory = Plan("--memory 3M --objective memory", "y.json");
  EXPECT_EQ(memory.exit_code, 2) << memory.output;
  EXPECT_NE(memory.output.find("--objective memory needs --min-speed"), std::string::npos) << memory.output;
  const std::string missing = tmp_->File("no-such.prof");
  auto profile = Plan("--memory 3M --profile " + missing, "y.json");
  EXPECT_EQ(profile.exit_code, 1) << profile.output;
  EXPECT_NE(profile.output.find("no profile: " + missing + " does not exist"), std::string::npos) << profile.output;
  EXPECT_FALSE(std::filesystem::exists(tmp_->File("y.json")));
}

TEST_F(PlanCliTest, TheRuntimeFollowsThePlanAndRefusesOneForAnotherDeployment) {
  auto r = Plan("--memory 3M --ctx 128", "run_plan.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string plan = tmp_->File("run_plan.json");
  auto run = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + plan + " -n 24 --json",
                        /*capture_stderr=*/false);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto j = nlohmann::json::parse(run.output.substr(run.output.find('{')), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << run.output;
  auto p = LoadPlan(plan);
  ASSERT_TRUE(p.ok());
  // The runtime took the plan's budget and cache sizes and stayed within them.
  EXPECT_EQ(j.value("memory_budget", uint64_t{0}), p->memory_limit_bytes) << j.dump();
  EXPECT_LE(j.value("accounted_bytes", uint64_t{1} << 62), p->memory_limit_bytes) << j.dump();
  int64_t planned_cold = 0;
  for (const RegionPlan& rp : p->regions) planned_cold += rp.cold_slots;
  EXPECT_GE(j.value("cold_slots", int64_t{-1}), planned_cold) << j.dump();
  EXPECT_EQ(j.value("generated", 0), 24) << j.dump();
  EXPECT_EQ(j.value("compute_threads", -1), p->compute_threads) << j.dump();
  EXPECT_EQ(j.value("queue_depth", -1), p->queue_depth) << j.dump();
  EXPECT_EQ(j.value("chunk_requests", -1), p->cluster_neurons) << j.dump();
  EXPECT_EQ(j.value("cold_pool", std::string()), p->shared_cold_pool ? "shared" : "per-layer") << j.dump();
  // The same sizes as one shared pool (what the planner writes when the profile's shared curve serves more): the
  // runtime runs one pool of at least their sum (plus the staging it frees) within the plan's memory.
  planner::Plan shared = *p;
  shared.shared_cold_pool = !p->shared_cold_pool;
  const std::string shared_path = tmp_->File(shared.shared_cold_pool ? "shared_plan.json" : "partitioned_plan.json");
  ASSERT_TRUE(SavePlan(shared, shared_path, false).ok());
  auto srun = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + shared_path + " -n 8 --json",
                         /*capture_stderr=*/false);
  ASSERT_EQ(srun.exit_code, 0) << srun.output;
  auto sj = nlohmann::json::parse(srun.output.substr(srun.output.find('{')), nullptr, false);
  ASSERT_FALSE(sj.is_discarded()) << srun.output;
  EXPECT_EQ(sj.value("cold_pool", std::string()), shared.shared_cold_pool ? "shared" : "per-layer") << sj.dump();
  EXPECT_GE(sj.value("cold_slots", int64_t{-1}), planned_cold) << sj.dump();
  EXPECT_LE(sj.value("accounted_bytes", uint64_t{1} << 62), p->memory_limit_bytes) << sj.dump();
  // Threads, queue depth and chunk size given on the command line replace the plan's (the memory stays the plan's).
  const int threads = p->compute_threads == 1 ? 2 : 1;
  const int depth = p->queue_depth == 8 ? 4 : 8;
  auto flags = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + plan + " -n 4 --json -t " +
                              std::to_string(threads) + " --queue-depth " + std::to_string(depth) +
                              " --chunk-requests 3",
                          /*capture_stderr=*/false);
  ASSERT_EQ(flags.exit_code, 0) << flags.output;
  auto jf = nlohmann::json::parse(flags.output.substr(flags.output.find('{')), nullptr, false);
  ASSERT_FALSE(jf.is_discarded()) << flags.output;
  EXPECT_EQ(jf.value("compute_threads", -1), threads) << jf.dump();
  EXPECT_EQ(jf.value("queue_depth", -1), depth) << jf.dump();
  EXPECT_EQ(jf.value("chunk_requests", -1), 3) << jf.dump();
  EXPECT_EQ(jf.value("memory_budget", uint64_t{0}), p->memory_limit_bytes) << jf.dump();
  // The lookahead: a plan without a calibration leaves it to the runtime's rule (n_ff / 8 = 172 / 8 bundles here);
  // a plan's 0 (what `plan --calibrate` writes when the runs without it were faster) or count is followed, and
  // --lookahead on the command line replaces it.
  EXPECT_EQ(p->lookahead, -1);
  EXPECT_EQ(j.value("lookahead_slots", int64_t{-1}), 172 / 8) << j.dump();
  for (const int64_t planned : {int64_t{0}, int64_t{7}}) {
    planner::Plan with = *p;
    with.lookahead = planned;
    const std::string with_path = tmp_->File("lookahead_plan_" + std::to_string(planned) + ".json");
    ASSERT_TRUE(SavePlan(with, with_path, false).ok());
    for (const int64_t given : {int64_t{-2}, int64_t{-1}, int64_t{5}}) {  // -2: no flag
      SCOPED_TRACE("plan " + std::to_string(planned) + ", --lookahead " + std::to_string(given));
      auto lrun = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + with_path +
                                 " -n 4 --json" + (given == -2 ? "" : " --lookahead " + std::to_string(given)),
                             /*capture_stderr=*/false);
      ASSERT_EQ(lrun.exit_code, 0) << lrun.output;
      auto lj = nlohmann::json::parse(lrun.output.substr(lrun.output.find('{')), nullptr, false);
      ASSERT_FALSE(lj.is_discarded()) << lrun.output;
      const int64_t want = given == -2 ? planned : given == -1 ? 172 / 8 : given;
      EXPECT_EQ(lj.value("lookahead_slots", int64_t{-100}), want) << lj.dump();
    }
  }

  // The same model packed in the other order (popularity; the default is co-activation chains) is another
  // deployment: refused, exit 2.
  auto k = RunCommand(Nflash() + " -q pack -m " + tmp_->File("relu.gguf") + " -p " + tmp_->File("relu.gguf.prof") +
                      " --order hotness -o " + tmp_->File("deploy2"));
  ASSERT_EQ(k.exit_code, 0) << k.output;
  auto other = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy2") + " --plan " + plan + " -n 4");
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("another deployment"), std::string::npos) << other.output;
  // --plan with --memory: conflicting settings.
  auto both = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + plan + " --memory 3M -n 4");
  EXPECT_EQ(both.exit_code, 2) << both.output;
  // --plan with --hot-fraction: the plan sizes the regions, so the fraction would be ignored (it ran so before
  // session 50); refused by name.
  auto fraction = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + plan +
                             " --hot-fraction 0.3 -n 4");
  EXPECT_EQ(fraction.exit_code, 2) << fraction.output;
  EXPECT_NE(fraction.output.find("drop --memory, --hot-slots, --cold-slots, --hot-fraction and --ctx"),
            std::string::npos)
      << fraction.output;
}

// --kv-type f16: the plan counts half the KV cache in its fixed part (the cache of 512 positions here is the largest
// fixed item after the weights), the runtime follows it, and a conflicting --kv-type is refused.
TEST_F(PlanCliTest, AHalfKvCachePlanCountsHalfTheCacheAndTheRuntimeFollows) {
  auto f32 = Plan("--memory 3M --ctx 512", "kv32.json");
  ASSERT_EQ(f32.exit_code, 0) << f32.output;
  auto f16 = Plan("--memory 3M --ctx 512 --kv-type f16", "kv16.json");
  ASSERT_EQ(f16.exit_code, 0) << f16.output;
  auto p32 = LoadPlan(tmp_->File("kv32.json"));
  auto p16 = LoadPlan(tmp_->File("kv16.json"));
  ASSERT_TRUE(p32.ok() && p16.ok());
  EXPECT_EQ(p32->kv_type, "f32");
  EXPECT_EQ(p16->kv_type, "f16");
  // stories260K: 5 layers x 512 positions x kv_dim 32 x (K and V): 655360 bytes as F32, half of it as F16 (the
  // attention scratch grows by two widened key/value blocks per thread: 2 x 64 x head_dim 8 floats).
  const uint64_t widened = 2 * 64 * 8 * 4 * static_cast<uint64_t>(p16->compute_threads);
  EXPECT_GE(p32->fixed_bytes - p16->fixed_bytes, 327680u - 2 * widened) << p32->fixed_bytes << " " << p16->fixed_bytes;
  EXPECT_LE(p32->fixed_bytes - p16->fixed_bytes, 327680u);
  auto run = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + tmp_->File("kv16.json") +
                            " -n 8 --json",
                        /*capture_stderr=*/false);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto j = nlohmann::json::parse(run.output.substr(run.output.find('{')), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << run.output;
  EXPECT_EQ(j.value("kv_type", std::string()), "f16") << j.dump();
  EXPECT_EQ(j.value("kv_cache_bytes", uint64_t{0}), 327680u) << j.dump();
  EXPECT_LE(j.value("accounted_bytes", uint64_t{1} << 62), p16->memory_limit_bytes) << j.dump();
  auto conflict = RunCommand(Nflash() + " offload -d " + tmp_->File("deploy") + " --plan " + tmp_->File("kv16.json") +
                             " --kv-type f32 -n 4");
  EXPECT_EQ(conflict.exit_code, 2) << conflict.output;
  EXPECT_NE(conflict.output.find("sized its KV cache as f16"), std::string::npos) << conflict.output;
  // A plan file with another type is refused by name.
  std::ifstream in(tmp_->File("kv16.json"));
  std::stringstream text;
  text << in.rdbuf();
  std::string bad = text.str();
  bad.replace(bad.find("\"f16\""), 5, "\"q8\"");
  auto parsed = ParsePlan(bad, "bad.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("settings.kv_type"), std::string::npos) << parsed.status().message();
}

// --calibrate runs the plan 3 times (and 3 times without lookahead, alternating), keeps the faster lookahead setting,
// fits the cost model to that setting's median run and records the fit; --calibration reuses both.
TEST_F(PlanCliTest, CalibrateFitsAMeasuredRunAndIsReusable) {
  auto raw = Plan("--memory 3M --ctx 128", "cal_raw.json");
  ASSERT_EQ(raw.exit_code, 0) << raw.output;
  auto r = Plan("--memory 3M --ctx 128 --calibrate --calibrate-tokens 8 --calibrate-warmup 4 --calibrate-runs 3",
                "cal.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("calibration: measured"), std::string::npos) << r.output;
  // The same output again without --force: refused before the calibration runs the model (SavePlan would refuse
  // too, after them).
  auto again_no_force = Plan("--memory 3M --ctx 128 --calibrate", "cal.json");
  EXPECT_EQ(again_no_force.exit_code, 2) << again_no_force.output;
  EXPECT_NE(again_no_force.output.find(tmp_->File("cal.json") + " exists; pass --force to overwrite"), std::string::npos)
      << again_no_force.output;
  EXPECT_EQ(again_no_force.output.find("calibrat"), std::string::npos) << again_no_force.output;
  // The calibration's settings without --calibrate would be ignored (a plan made without the runs they ask for; so
  // before session 50): a usage error naming the flag they need, and no plan written.
  for (const char* setting : {"--calibrate-tokens 8", "--calibrate-warmup 4", "--calibrate-runs 3"}) {
    auto alone = Plan(std::string("--memory 3M --ctx 128 ") + setting, "cal_alone.json");
    EXPECT_EQ(alone.exit_code, 2) << setting << ": " << alone.output;
    EXPECT_NE(alone.output.find("requires --calibrate"), std::string::npos) << setting << ": " << alone.output;
    EXPECT_FALSE(std::filesystem::exists(tmp_->File("cal_alone.json"))) << setting;
  }
  // The runs as logged ("calibration run N: T ms/token, ..." and, since the plan reads ahead (172 / 8 bundles per
  // layer), "calibration run N without lookahead: T ms/token, ..." after each): the plan keeps the kind with the lower
  // median and the fit uses that kind's median run.
  std::vector<double> on_ms, off_ms;
  for (size_t at = r.output.find("calibration run "); at != std::string::npos;
       at = r.output.find("calibration run ", at + 1)) {
    const size_t colon = r.output.find(": ", at);
    ASSERT_NE(colon, std::string::npos);
    const bool off = r.output.compare(colon - 18, 18, " without lookahead") == 0;
    // What the run itself reported (its JSON's lookahead_slots): none in the runs without, n_ff / 8 in the others.
    const std::string line = r.output.substr(colon, r.output.find('\n', colon) - colon);
    EXPECT_NE(line.find(off ? ", no lookahead" : ", reading ahead up to 21 bundles per layer"), std::string::npos)
        << line;
    (off ? off_ms : on_ms).push_back(std::stod(r.output.substr(colon + 2)));
  }
  ASSERT_EQ(on_ms.size(), 3u) << r.output;
  ASSERT_EQ(off_ms.size(), 3u) << r.output;
  std::sort(on_ms.begin(), on_ms.end());
  std::sort(off_ms.begin(), off_ms.end());
  const bool off_faster = off_ms[1] < on_ms[1];
  const double chosen_ms = off_faster ? off_ms[1] : on_ms[1];
  auto plain = LoadPlan(tmp_->File("cal_raw.json"));
  auto cal = LoadPlan(tmp_->File("cal.json"));
  ASSERT_TRUE(plain.ok() && cal.ok());
  EXPECT_FALSE(plain->calibration.present());
  EXPECT_EQ(plain->lookahead, -1);
  const Calibration& c = cal->calibration;
  ASSERT_TRUE(c.present());
  EXPECT_EQ(c.tokens, 8);
  EXPECT_EQ(c.runs, 3);
  EXPECT_NEAR(c.measured_token_s * 1e3, chosen_ms, 1e-5 + chosen_ms * 1e-6) << "not the chosen kind's median run";
  EXPECT_NEAR(c.lookahead_on_token_s * 1e3, on_ms[1], 1e-5 + on_ms[1] * 1e-6);
  EXPECT_NEAR(c.lookahead_off_token_s * 1e3, off_ms[1], 1e-5 + off_ms[1] * 1e-6);
  EXPECT_EQ(cal->lookahead, off_faster ? 0 : -1) << r.output;
  EXPECT_NE(r.output.find(off_faster ? "the plan keeps it off" : "the plan keeps it to the runtime's rule"),
            std::string::npos)
      << r.output;
  std::printf("calibration lookahead (stories260K-relu, this machine): median %.3f ms/token with, %.3f without\n",
              on_ms[1], off_ms[1]);
  EXPECT_EQ(c.memory_bytes, 3u << 20);
  EXPECT_GT(c.compute_scale, 0);
  EXPECT_GT(c.io_scale, 0);
  EXPECT_GT(c.measured_token_s, c.measured_io_wait_s);
  std::printf("calibration (fake hw.json): compute x%.3f, I/O x%.3f\n", c.compute_scale, c.io_scale);
  // The fit starts from the uncalibrated plan: the same prediction a plan without --calibrate makes.
  EXPECT_NEAR(c.uncalibrated_token_s, plain->predicted.token_s, plain->predicted.token_s * 1e-9);

  // Reused at another memory limit: the same factors, nothing measured again.
  auto reuse = Plan("--memory 4M --ctx 128 --calibration " + tmp_->File("cal.json"), "cal_reuse.json");
  ASSERT_EQ(reuse.exit_code, 0) << reuse.output;
  EXPECT_EQ(reuse.output.find("calibrating"), std::string::npos) << reuse.output;
  auto again = LoadPlan(tmp_->File("cal_reuse.json"));
  ASSERT_TRUE(again.ok());
  EXPECT_DOUBLE_EQ(again->calibration.compute_scale, c.compute_scale);
  EXPECT_DOUBLE_EQ(again->calibration.io_scale, c.io_scale);
  EXPECT_EQ(again->lookahead, cal->lookahead) << "the lookahead measured with the factors comes with them";

  // A calibration measured against another hardware profile (one byte differs, so its hash does) is refused.
  nflash::testing::WriteText(tmp_->File("hw2.json"), nflash::testing::FakeHwProfileJson() + "\n");
  auto other = RunCommand(Nflash() + " plan --hw " + tmp_->File("hw2.json") + " --deploy " + tmp_->File("deploy") +
                          " --memory 4M --ctx 128 --calibration " + tmp_->File("cal.json") + " -o " +
                          tmp_->File("cal_other.json"));
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("was measured for deployment"), std::string::npos) << other.output;
  // A plan without a calibration cannot lend one; both flags at once are a usage error.
  auto none = Plan("--memory 3M --ctx 128 --calibration " + tmp_->File("cal_raw.json"), "cal_none.json");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("no 'calibration'"), std::string::npos) << none.output;
  auto both = Plan("--memory 3M --calibrate --calibration " + tmp_->File("cal.json"), "cal_both.json");
  EXPECT_EQ(both.exit_code, 2) << both.output;
}

}  // namespace
}  // namespace nflash::planner
