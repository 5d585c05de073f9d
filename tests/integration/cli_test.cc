// The `nflash` binary end to end: help and usage errors, convert and inspect of stories260K, exit codes 0/1/2.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace nflash {
namespace {

using nflash::testing::CommandResult;
using nflash::testing::NflashBinary;
using nflash::testing::RunCommand;
using nflash::testing::SharedPath;
using nflash::testing::TempDir;

CommandResult Nflash(const std::string& args) { return RunCommand(NflashBinary() + " " + args); }

std::string Stories() { return SharedPath("models/stories260K/stories260K.bin"); }

TEST(Cli, HelpAndUsageErrors) {
  CommandResult help = Nflash("--help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("convert"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("inspect"), std::string::npos) << help.output;

  CommandResult convert_help = Nflash("convert --help");
  EXPECT_EQ(convert_help.exit_code, 0) << convert_help.output;
  EXPECT_NE(convert_help.output.find("--type"), std::string::npos);
  EXPECT_NE(convert_help.output.find("f32"), std::string::npos) << "default type shown";

  CommandResult unknown = Nflash("--no-such-flag");
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  CommandResult no_output = Nflash("convert " + Stories());
  EXPECT_EQ(no_output.exit_code, 2) << no_output.output;
  TempDir dir;
  CommandResult bad_type = Nflash("convert " + Stories() + " -o " + dir.File("x.gguf") + " --type q5_k");
  EXPECT_EQ(bad_type.exit_code, 2) << bad_type.output;
  EXPECT_NE(bad_type.output.find("q5_k"), std::string::npos) << bad_type.output;
}

TEST(Cli, ConvertThenInspect) {
  TempDir dir;
  const std::string out = dir.File("s-q8.gguf");
  CommandResult c = Nflash("convert " + Stories() + " -o " + out + " --type q8_0");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_TRUE(std::filesystem::exists(out));
  EXPECT_NE(c.output.find("47 tensors"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("5 tensors as f16"), std::string::npos) << c.output;

  CommandResult text = Nflash("inspect " + out);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("architecture: llama"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("tensors: 47"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("stories260K"), std::string::npos);
  EXPECT_EQ(text.output.find("SYNTHETIC"), std::string::npos);
  EXPECT_NE(text.output.find("[string x512: \"<unk>\", \"<s>\", \"</s>\""), std::string::npos) << text.output;

  CommandResult table = Nflash("inspect --tensors " + out);
  ASSERT_EQ(table.exit_code, 0);
  EXPECT_NE(table.output.find("blk.4.ffn_down.weight"), std::string::npos);

  CommandResult js = Nflash("-q inspect --json --tensors " + out);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  auto j = nlohmann::json::parse(js.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << js.output.substr(0, 500);
  EXPECT_EQ(j["architecture"], "llama");
  EXPECT_EQ(j["tensor_count"], 47);
  EXPECT_EQ(j["tensors"].size(), 47u);
  EXPECT_EQ(j["metadata"]["general.file_type"], 7);
  EXPECT_EQ(j["metadata"]["tokenizer.ggml.tokens"]["length"], 512);
  EXPECT_EQ(j["bytes_by_type"]["f16"]["count"], 5);

  CommandResult l2c = Nflash("inspect " + Stories());
  ASSERT_EQ(l2c.exit_code, 0) << l2c.output;
  EXPECT_NE(l2c.output.find("llama2.c checkpoint v0"), std::string::npos) << l2c.output;
  EXPECT_NE(l2c.output.find("size check: ok"), std::string::npos) << l2c.output;
}

// A damaged header claiming 2^24 layers: inspect and convert report the size mismatch at once (the layout would be
// 150 million arrays; building it took minutes and gigabytes before).
TEST(Cli, HeaderClaimingMillionsOfLayersFailsFast) {
  TempDir dir;
  const std::string bad = dir.File("layers.bin");
  std::filesystem::copy_file(Stories(), bad);
  {
    std::FILE* f = std::fopen(bad.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    const int32_t layers = 1 << 24;
    ASSERT_EQ(std::fseek(f, 8, SEEK_SET), 0);  // v0 header: dim, hidden_dim, n_layers, ...
    ASSERT_EQ(std::fwrite(&layers, 4, 1, f), 1u);
    std::fclose(f);
  }
  CommandResult text = Nflash("inspect --tensors " + bad);
  EXPECT_EQ(text.exit_code, 1) << text.output;
  EXPECT_NE(text.output.find("n_layers 16777216"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("size check: MISMATCH"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("arrays: not listed"), std::string::npos) << text.output;

  CommandResult js = Nflash("-q inspect --json --tensors " + bad);
  EXPECT_EQ(js.exit_code, 1) << js.output;
  const auto brace = js.output.find('{');
  ASSERT_NE(brace, std::string::npos) << js.output;
  auto j = nlohmann::json::parse(js.output.substr(0, js.output.rfind('}') + 1).substr(brace), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << js.output;
  EXPECT_EQ(j["size_ok"], false);
  EXPECT_FALSE(j.contains("tensors"));
  EXPECT_TRUE(j.contains("tensors_omitted"));

  CommandResult convert = Nflash("convert " + bad + " --tokenizer " + SharedPath("models/stories260K/tok512.bin") +
                                 " -o " + dir.File("out.gguf"));
  EXPECT_EQ(convert.exit_code, 1) << convert.output;
  EXPECT_NE(convert.output.find("n_layers 16777216"), std::string::npos) << convert.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("out.gguf")));
}

TEST(Cli, ExitCodesForMissingInputAndExistingOutput) {
  TempDir dir;
  const std::string missing = dir.File("missing-model.bin");
  CommandResult m = Nflash("convert " + missing + " -o " + dir.File("a.gguf"));
  EXPECT_EQ(m.exit_code, 1) << m.output;
  EXPECT_NE(m.output.find(missing), std::string::npos) << m.output;

  const std::string out = dir.File("b.gguf");
  ASSERT_EQ(Nflash("-q convert " + Stories() + " -o " + out).exit_code, 0);
  CommandResult again = Nflash("convert " + Stories() + " -o " + out);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("--force"), std::string::npos) << again.output;
  CommandResult forced = Nflash("-q convert " + Stories() + " -o " + out + " --force --type f16");
  EXPECT_EQ(forced.exit_code, 0) << forced.output;

  CommandResult corrupt = Nflash("inspect " + SharedPath("models/stories260K/tok512.bin"));
  EXPECT_EQ(corrupt.exit_code, 1) << corrupt.output;
}

TEST(Cli, ReluModelNeedsTokenizerAndActivation) {
  TempDir dir;
  const std::string relu = SharedPath("models/stories260K-relu/stories260K-relu.bin");
  const std::string out = dir.File("relu.gguf");
  CommandResult no_tok = Nflash("convert " + relu + " -o " + out);
  EXPECT_EQ(no_tok.exit_code, 2) << no_tok.output;
  EXPECT_NE(no_tok.output.find("missing tokenizer: pass --tokenizer"), std::string::npos) << no_tok.output;
  EXPECT_FALSE(std::filesystem::exists(out));

  CommandResult ok = Nflash("-q convert " + relu + " -o " + out + " --tokenizer " +
                            SharedPath("models/stories260K/tok512.bin") + " --activation relu");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  CommandResult inspect = Nflash("inspect " + out);
  EXPECT_NE(inspect.output.find("nflash.ffn_activation"), std::string::npos);
  EXPECT_NE(inspect.output.find("\"relu\""), std::string::npos) << inspect.output;

  // GGUF input: --activation overrides what the file says.
  const std::string silu = dir.File("silu.gguf");
  ASSERT_EQ(Nflash("-q convert " + out + " -o " + silu + " --activation silu").exit_code, 0);
  EXPECT_NE(Nflash("inspect " + silu).output.find("\"silu\""), std::string::npos);
  CommandResult bad = Nflash("convert " + out + " -o " + dir.File("x.gguf") + " --activation gelu");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
}

}  // namespace
}  // namespace nflash
