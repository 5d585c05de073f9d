// `nflash profile-hw` end to end: --quick writes a schema-1 JSON with positive numbers for every cell and leaves no
// temporary file behind; bad directories and an existing output fail with clear messages and the usage exit code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/cpu_affinity.h"
#include "runtime/core/thread_placement.h"
#include "runtime/core/thread_pool.h"
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
  // Each cell's rates follow from the matrix's shape and type whatever the timing: weight bytes per call = dim x dim x
  // the type's bytes per weight (ggml's blocks: Q8_0 34 bytes, Q4_0 18 bytes per 32 weights) x the row fraction;
  // flops = 2 x dim x dim x the row fraction x tokens. Sparse kernels touch 10% of the rows (round(0.1 x dim)), the
  // neuron path three rows per neuron (gate, up, down).
  const int64_t dim = p["compute"]["matrix_rows"].get<int64_t>();
  EXPECT_EQ(dim, 1024) << "quick mode's matrix";
  EXPECT_EQ(p["compute"]["matrix_cols"].get<int64_t>(), dim);
  const double rows10 = static_cast<double>(std::llround(0.1 * static_cast<double>(dim))) / static_cast<double>(dim);
  const std::map<std::string, double> bytes_per_weight = {
      {"f32", 4.0}, {"f16", 2.0}, {"q8_0", 34.0 / 32.0}, {"q4_0", 18.0 / 32.0}};
  const std::vector<std::tuple<std::string, int64_t, double>> kernels = {
      {"gemv", 1, 1.0},       {"gemm", 8, 1.0},           {"gemm", 128, 1.0},
      {"gemv_rows", 1, rows10}, {"accumulate_rows", 1, rows10}, {"neuron_path", 1, 3 * rows10}};
  std::multiset<std::tuple<std::string, std::string, int64_t>> seen, expected;
  for (const auto& [type, bpw] : bytes_per_weight) {
    for (const auto& [kernel, tokens, fraction] : kernels) expected.insert({type, kernel, tokens});
  }
  for (const auto& c : compute) {
    EXPECT_EQ(c["threads"], 1);
    ExpectPositive(c, "weight_gb_per_s");
    ExpectPositive(c, "gflop_per_s");
    ExpectPositive(c, "seconds_per_call");
    const std::string type = c["type"].get<std::string>(), kernel = c["kernel"].get<std::string>();
    const int64_t tokens = c["tokens"].get<int64_t>();
    seen.insert({type, kernel, tokens});
    const auto k = std::find_if(kernels.begin(), kernels.end(),
                                [&](const auto& e) { return std::get<0>(e) == kernel && std::get<1>(e) == tokens; });
    ASSERT_NE(k, kernels.end()) << c.dump();
    ASSERT_TRUE(bytes_per_weight.count(type)) << c.dump();
    const double fraction = std::get<2>(*k), secs = c["seconds_per_call"].get<double>();
    const double weights = static_cast<double>(dim) * static_cast<double>(dim);
    EXPECT_NEAR(c["row_fraction"].get<double>(), fraction, 1e-12) << c.dump();
    EXPECT_NEAR(c["weight_gb_per_s"].get<double>() * secs * 1e9, weights * bytes_per_weight.at(type) * fraction,
                weights * 1e-9)
        << c.dump();
    EXPECT_NEAR(c["gflop_per_s"].get<double>() * secs * 1e9, 2 * weights * fraction * static_cast<double>(tokens),
                weights * 1e-9)
        << c.dump();
    // The report's row: threads, kernel, type, tokens, rows, then the two rates (2 decimals each).
    char rates[64];
    std::snprintf(rates, sizeof rates, " %.2f %.2f", c["weight_gb_per_s"].get<double>(), c["gflop_per_s"].get<double>());
    bool printed = false;
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) {
      std::istringstream words(line);
      std::string t, kn, ty, tok, rows, w, g;
      words >> t >> kn >> ty >> tok >> rows >> w >> g;
      if (t == "1" && kn == kernel && ty == type && tok == std::to_string(tokens)) {
        printed = (" " + w + " " + g) == rates;
        break;
      }
    }
    EXPECT_TRUE(printed) << "no report row with" << rates << " for " << c.dump() << "\n" << r.output;
  }
  EXPECT_EQ(seen, expected);
  ASSERT_EQ(p["compute"]["memory"].size(), 1u);
  ExpectPositive(p["compute"]["memory"][0], "read_gb_per_s");
  ExpectPositive(p["compute"]["memory"][0], "copy_gb_per_s");

  const auto& flash = p["flash"];
  EXPECT_EQ(flash["dir"], work.path());
  EXPECT_TRUE(flash["direct_io"].is_boolean());
  ASSERT_EQ(flash["random_read"].size(), 6u * 7u);  // 4..128 KiB x QD 1..64
  ExpectPositive(p, "duration_seconds");
  const double duration = p["duration_seconds"].get<double>();
  EXPECT_EQ(flash["file_bytes"].get<uint64_t>(), uint64_t{256} << 20) << "quick mode's test file";
  // Every cell's time (requests / IOPS) is part of the whole run's.
  double cells_seconds = 0;
  auto check_reads = [&](const nlohmann::json& c) {
    for (const char* key : {"mb_per_s", "iops", "latency_mean_us", "latency_p50_us", "latency_p99_us"}) {
      ExpectPositive(c, key);
    }
    const double mean = c["latency_mean_us"].get<double>(), p50 = c["latency_p50_us"].get<double>(),
                 p99 = c["latency_p99_us"].get<double>();
    EXPECT_LE(p50, p99);
    // Half the reads take at least P50 and 1% at least P99, so the mean is at least half the one and 1% of the other.
    EXPECT_GE(mean, p50 / 2) << c.dump();
    EXPECT_GE(mean, p99 / 100) << c.dump();
    // Throughput and IOPS are two views of one measurement: MB/s = IOPS x block size.
    EXPECT_NEAR(c["mb_per_s"].get<double>(), c["iops"].get<double>() * c["block_bytes"].get<double>() / 1e6,
                c["mb_per_s"].get<double>() * 1e-6);
    cells_seconds += c["requests"].get<double>() / c["iops"].get<double>();
  };
  std::set<std::pair<size_t, unsigned>> random_cells;
  for (const auto& c : flash["random_read"]) {
    check_reads(c);
    random_cells.insert({c["block_bytes"].get<size_t>(), c["queue_depth"].get<unsigned>()});
  }
  EXPECT_EQ(random_cells.size(), 6u * 7u) << "each size at each queue depth once";
  EXPECT_EQ(random_cells.begin()->first, 4096u);
  EXPECT_EQ(random_cells.rbegin()->first, 131072u);
  ASSERT_EQ(flash["sync_pread"].size(), 2u);  // 4 and 64 KiB at queue depth 1
  for (const auto& c : flash["sync_pread"]) check_reads(c);
  EXPECT_LE(cells_seconds, duration);
  ASSERT_EQ(flash["sequential_read"].size(), 4u);
  for (const auto& c : flash["sequential_read"]) ExpectPositive(c, "mb_per_s");
  // The test file was written whole; the write rate implies a time within the run's.
  const auto& write = flash["sequential_write"];
  ExpectPositive(write, "mb_per_s");
  EXPECT_EQ(write["bytes"].get<uint64_t>(), flash["file_bytes"].get<uint64_t>());
  EXPECT_LE(write["bytes"].get<double>() / (write["mb_per_s"].get<double>() * 1e6), duration) << write.dump();
  // The report's random-read table: one row per size, a "MB/s (IOPS) [p50/p99]" cell per queue depth in order.
  for (size_t size : {size_t{4096}, size_t{131072}}) {
    std::string row;
    for (const auto& c : flash["random_read"]) {
      if (c["block_bytes"].get<size_t>() != size) continue;
      char cell[96];
      std::snprintf(cell, sizeof cell, " %6.0f (%5.0fk) [%.0f/%.0f]", c["mb_per_s"].get<double>(),
                    c["iops"].get<double>() / 1e3, c["latency_p50_us"].get<double>(),
                    c["latency_p99_us"].get<double>());
      row += cell;
    }
    char head[32];
    std::snprintf(head, sizeof head, "%6zuK ", size / 1024);
    EXPECT_NE(r.output.find(head + row + "\n"), std::string::npos) << head << row << "\n" << r.output;
  }
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
    std::string list = " --threads-list 1";
    if (most == 2) list += ",2";
    // Without --threads-list, every count from 1 to the hardware threads: the same two pools where there are at most
    // two (the development and CI machines).
    if (std::string(policy) == "off" && ThreadPool::HardwareThreads() == most) list.clear();
    const auto r = RunCommand(NflashBinary() + " profile-hw --quick" + list + " --pin-threads " + policy + " --dir " +
                              work.path() + " -o " + json_path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(std::string("thread placement (--pin-threads ") + policy + ")"), std::string::npos)
        << r.output;
    std::ifstream in(json_path);
    const nlohmann::json placement = nlohmann::json::parse(in)["compute"]["placement"];
    EXPECT_EQ(placement["policy"], policy);
    EXPECT_EQ(placement["allowed_cpus"].get<std::vector<int>>(), allowed);
    ASSERT_EQ(placement["pools"].size(), static_cast<size_t>(most));
    int expected_threads = 0;
    for (const nlohmann::json& pool : placement["pools"]) {
      const int threads = pool["threads"].get<int>();
      EXPECT_EQ(threads, ++expected_threads) << "pools of 1, 2, ... threads";
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
