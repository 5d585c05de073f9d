// `nflash offload` end to end on stories260K-relu: convert, profile, pack, then greedy generation from the deployment
// with the FFN on flash must print the README's golden continuation in both modes and any memory budget that fits;
// a budget below the fixed part exits with 2 and names the minimum.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "tests/test_util.h"

namespace nflash {
namespace {

std::string Nflash() { return testing::NflashBinary(); }

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class OffloadCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    const std::string failed = testing::MakeReluDeployment(dir_->File("m.gguf"), dir_->File("p.prof"), Deploy());
    ASSERT_EQ(failed, "") << failed;
    // The README's decoded golden sample (prompt + 100 greedy tokens).
    const std::string readme = ReadText(testing::SharedPath("models/stories260K-relu/README.md"));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(readme, m, std::regex("Decoded \\(prompt \\+ continuation\\):\\n```\\n([^`]*)```")));
    golden_ = new std::string(m[1].str());
  }
  static void TearDownTestSuite() {
    delete golden_;
    delete dir_;
  }
  static std::string Deploy() { return dir_->File("deploy"); }
  static testing::TempDir* dir_;
  static std::string* golden_;
};
testing::TempDir* OffloadCliTest::dir_ = nullptr;
std::string* OffloadCliTest::golden_ = nullptr;

TEST_F(OffloadCliTest, GoldenTextInBothModesAndBudgets) {
  ASSERT_TRUE(golden_);
  const std::string golden = golden_->substr(0, golden_->find_last_not_of('\n') + 1);
  for (const std::string& args : {std::string("--mode full --memory 3M"), std::string("--mode llmflash --memory 3M"),
                                  std::string("--mode full --hot-slots 0 --cold-slots 0"),
                                  std::string("--mode full --memory 64M")}) {
    auto r = testing::RunCommand(Nflash() + " -q offload -d " + Deploy() + " --active-set oracle -n 100 --json " + args);
    ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("\"text\": \"([^\"\\\\]*(\\\\.[^\"\\\\]*)*)\""))) << r.output;
    // JSON escapes: \n and \" are the only ones this text has.
    std::string text = std::regex_replace(std::regex_replace(m[1].str(), std::regex("\\\\n"), "\n"),
                                          std::regex("\\\\\""), "\"");
    EXPECT_EQ(text, golden) << args;
    EXPECT_NE(r.output.find("\"retries\": 0"), std::string::npos) << r.output;
    if (args.find("--memory 3M") != std::string::npos) {
      std::smatch a;
      ASSERT_TRUE(std::regex_search(r.output, a, std::regex("\"accounted_bytes\": ([0-9]+)")));
      EXPECT_LE(std::stoull(a[1].str()), 3ull << 20) << "the accounting must stay within --memory";
    }
  }
}

TEST_F(OffloadCliTest, BudgetBelowTheFixedPartIsAUsageError) {
  auto r = testing::RunCommand(Nflash() + " offload -d " + Deploy() + " --active-set oracle --memory 1M");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("memory budget 1.00 MiB is below the fixed part"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the minimum is"), std::string::npos) << r.output;
  r = testing::RunCommand(Nflash() + " offload -d " + Deploy() + " --memory 1.5Gigs");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown unit"), std::string::npos) << r.output;
  r = testing::RunCommand(Nflash() + " offload -d " + Deploy() + " --mode dense");
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

}  // namespace
}  // namespace nflash
