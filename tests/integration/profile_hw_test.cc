// `nflash profile-hw` end to end: --quick writes a schema-1 JSON with positive numbers for every cell and leaves no
// temporary file behind; bad directories and an existing output fail with clear messages and the usage exit code.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

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
