// `nflash profile-hw` end to end: --quick writes a schema-1 JSON with positive numbers for every cell and leaves no
// temporary file behind; bad directories and an existing output fail with clear messages and the usage exit code.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/cpu_affinity.h"
#include "runtime/core/thread_placement.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using nflash::testing::NflashBinary;
using nflash::testing::RunCommand;
using nflash::testing::TempDir;

void ExpectPositive(const nlohmann::json& cell, const char* key) {
  ASSERT_TRUE(cell.contains(key)) << cell.dump();
  ASSERT_TRUE(cell[key].is_number()) << cell.dump();
  EXPECT_GT(cell[key].get<double>(), 0.0) << key << " in " << cell.dump();
}

TEST(ProfileHwTest, QuickWritesValidJsonAndRemovesItsTempFile) {
  TempDir out;
  TempDir work;  // the flash test file goes here; it must be empty afterwards
  const std::string json_path = out.File("hw.json");
  const auto r = RunCommand(NflashBinary() + " profile-hw --quick --threads-list 1 --dir " + work.path() + " -o " +
                            json_path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("random reads"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::is_empty(work.path()));

  std::ifstream in(json_path);
  const nlohmann::json p = nlohmann::json::parse(in);
  EXPECT_EQ(p["format"], "nflash.hw_profile");
  EXPECT_EQ(p["version"], 1);
  EXPECT_EQ(p["quick"], true);
  EXPECT_GE(p["machine"]["hardware_threads"].get<int>(), 1);
  EXPECT_FALSE(p["machine"]["isa"].get<std::string>().empty());
  EXPECT_GT(p["machine"]["ram_bytes"].get<double>(), 0);

  // 4 types x (gemv, gemm 8, gemm 128, gemv_rows, accumulate_rows, neuron_path) for the one thread count asked.
  const auto& compute = p["compute"]["results"];
  ASSERT_EQ(compute.size(), 24u);
  for (const auto& c : compute) {
    EXPECT_EQ(c["threads"], 1);
    ExpectPositive(c, "weight_gb_per_s");
    ExpectPositive(c, "gflop_per_s");
    ExpectPositive(c, "seconds_per_call");
  }
  ASSERT_EQ(p["compute"]["memory"].size(), 1u);
  ExpectPositive(p["compute"]["memory"][0], "read_gb_per_s");
  ExpectPositive(p["compute"]["memory"][0], "copy_gb_per_s");

  const auto& flash = p["flash"];
  EXPECT_EQ(flash["dir"], work.path());
  EXPECT_TRUE(flash["direct_io"].is_boolean());
  ASSERT_EQ(flash["random_read"].size(), 6u * 7u);  // 4..128 KiB x QD 1..64
  for (const auto& c : flash["random_read"]) {
    for (const char* key : {"mb_per_s", "iops", "latency_mean_us", "latency_p50_us", "latency_p99_us"}) {
      ExpectPositive(c, key);
    }
    EXPECT_LE(c["latency_p50_us"].get<double>(), c["latency_p99_us"].get<double>());
    // Throughput and IOPS are two views of one measurement: MB/s = IOPS x block size.
    EXPECT_NEAR(c["mb_per_s"].get<double>(), c["iops"].get<double>() * c["block_bytes"].get<double>() / 1e6,
                c["mb_per_s"].get<double>() * 1e-6);
  }
  ASSERT_EQ(flash["sequential_read"].size(), 4u);
  for (const auto& c : flash["sequential_read"]) ExpectPositive(c, "mb_per_s");
  ExpectPositive(flash["sequential_write"], "mb_per_s");
  ExpectPositive(p, "duration_seconds");
}

// The compute cells run where the decode would run the same number of threads: each pool's recorded plan is the
// shared rule's (PlanThreadCpus, its own tests in thread_placement_test) for the policy asked, and the threads were seen
// only on the CPUs planned (pinned) or allowed (not pinned).
TEST(ProfileHwTest, ComputeThreadsRunWhereTheDecodeRulePlacesThem) {
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  ASSERT_FALSE(allowed.empty());
  const std::vector<uint64_t> capacity = CpuCapacities(allowed);
  const int most = std::min<int>(2, static_cast<int>(allowed.size()));
  for (const char* policy : {"on", "off"}) {
    SCOPED_TRACE(policy);
    TempDir out;
    TempDir work;
    const std::string json_path = out.File("hw.json");
    std::string list = "1";
    if (most == 2) list += ",2";
    const auto r = RunCommand(NflashBinary() + " profile-hw --quick --threads-list " + list + " --pin-threads " +
                              policy + " --dir " + work.path() + " -o " + json_path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(std::string("thread placement (--pin-threads ") + policy + ")"), std::string::npos)
        << r.output;
    std::ifstream in(json_path);
    const nlohmann::json placement = nlohmann::json::parse(in)["compute"]["placement"];
    EXPECT_EQ(placement["policy"], policy);
    EXPECT_EQ(placement["allowed_cpus"].get<std::vector<int>>(), allowed);
    ASSERT_EQ(placement["pools"].size(), static_cast<size_t>(most));
    for (const nlohmann::json& pool : placement["pools"]) {
      const int threads = pool["threads"].get<int>();
      const auto want = PlanThreadCpus(*ParsePinThreads(policy), threads, allowed, {}, capacity);
      std::vector<int> allowed_here = allowed;
      if (want) {
        ASSERT_TRUE(pool["cpus"].is_array()) << pool.dump();
        std::vector<int> planned = {want->caller};
        planned.insert(planned.end(), want->workers.begin(), want->workers.end());
        EXPECT_EQ(pool["cpus"].get<std::vector<int>>(), planned);
        allowed_here = planned;
      } else {
        EXPECT_TRUE(pool["cpus"].is_null()) << pool.dump();
      }
      const auto seen = pool["observed_cpus"].get<std::vector<int>>();
      EXPECT_FALSE(seen.empty()) << pool.dump();
      for (int cpu : seen) {
        EXPECT_NE(std::find(allowed_here.begin(), allowed_here.end(), cpu), allowed_here.end())
            << "CPU " << cpu << " in " << pool.dump();
      }
    }
  }
}

TEST(ProfileHwTest, BadPinThreadsIsAUsageError) {
  TempDir out;
  const auto r = RunCommand(NflashBinary() + " profile-hw --quick --pin-threads always -o " + out.File("hw.json"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--pin-threads always: expected auto, on or off"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out.File("hw.json")));
}

TEST(ProfileHwTest, BadDirIsAUsageError) {
  TempDir out;
  auto r = RunCommand(NflashBinary() + " profile-hw --quick --dir /nonexistent/nflash-dir -o " + out.File("hw.json"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--dir /nonexistent/nflash-dir does not exist"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out.File("hw.json")));

  nflash::testing::WriteText(out.File("file"), "x");
  r = RunCommand(NflashBinary() + " profile-hw --quick --dir " + out.File("file") + " -o " + out.File("hw.json"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is not a directory"), std::string::npos) << r.output;

  r = RunCommand(NflashBinary() + " profile-hw --quick --threads-list 1,0 --dir " + out.path() + " -o " +
                 out.File("hw.json"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--threads-list: thread count 0 is not in [1, 1024]"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out.File("hw.json")));
}

TEST(ProfileHwTest, RefusesToOverwriteWithoutForce) {
  TempDir out;
  nflash::testing::WriteText(out.File("hw.json"), "keep");
  const auto r = RunCommand(NflashBinary() + " profile-hw --quick --dir " + out.path() + " -o " + out.File("hw.json"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--force"), std::string::npos) << r.output;
  std::ifstream in(out.File("hw.json"));
  std::string content;
  in >> content;
  EXPECT_EQ(content, "keep");
}

}  // namespace
}  // namespace nflash
