// The `nflash` binary end to end: help and usage errors, convert and inspect of stories260K, exit codes 0/1/2.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "runtime/core/status.h"
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

// -v prints debug messages, -q only errors (`nflash --help`: "Print debug messages", "Print only errors (no progress
// bars)"); an error reaches stderr as "nflash: error: <code name>: <message>" whatever the level.
TEST(Cli, VerboseAndQuietSetWhatIsPrinted) {
  TempDir dir;
  const std::string synth = "synth --shape custom --dim 64 --ffn 64 --heads 4 --vocab 300 --layers 1 --activation silu";
  CommandResult normal = Nflash(synth + " -o " + dir.File("a.gguf"));
  ASSERT_EQ(normal.exit_code, 0) << normal.output;
  EXPECT_NE(normal.output.find("nflash: warning: --activation silu"), std::string::npos) << normal.output;
  EXPECT_EQ(normal.output.find("nflash: debug: "), std::string::npos) << normal.output;
  CommandResult verbose = Nflash("-v " + synth + " -o " + dir.File("b.gguf"));
  ASSERT_EQ(verbose.exit_code, 0) << verbose.output;
  EXPECT_NE(verbose.output.find("nflash: warning: --activation silu"), std::string::npos) << verbose.output;
  EXPECT_NE(verbose.output.find("nflash: debug: wrote " + dir.File("b.gguf")), std::string::npos) << verbose.output;
  CommandResult quiet = Nflash("-q " + synth + " -o " + dir.File("c.gguf"));
  ASSERT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("nflash: "), std::string::npos) << "no info, warning or debug line: " << quiet.output;
  EXPECT_EQ(quiet.output.find("writing "), std::string::npos) << "no progress bar: " << quiet.output;
  EXPECT_NE(normal.output.find("writing " + dir.File("a.gguf") + " ["), std::string::npos) << normal.output;
  EXPECT_TRUE(std::filesystem::exists(dir.File("c.gguf")));
  CommandResult error = Nflash("-q " + synth + " -o " + dir.File("c.gguf"));
  EXPECT_EQ(error.exit_code, 2) << error.output;
  EXPECT_EQ(error.output, "nflash: error: " + std::string(StatusCodeName(StatusCode::kInvalidArgument)) + ": " +
                              dir.File("c.gguf") + " exists; pass --force to overwrite\n");
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

// Inspect's figures against what the test derives itself: each tensor's bytes from its dims and type (f32 4, f16 2,
// q8_0 34 per 32 values), their sums overall and by type, the tensors laid out in order at aligned offsets inside the
// file's data section; the hyper-parameters as stories260K's README gives them; and for the llama2.c original, its
// header and the size the README's array list implies.
TEST(Cli, InspectFiguresMatchTheFilesLayout) {
  TempDir dir;
  const std::string out = dir.File("s-q8.gguf");
  ASSERT_EQ(Nflash("-q convert " + Stories() + " -o " + out + " --type q8_0").exit_code, 0);
  CommandResult js = Nflash("-q inspect --json --tensors " + out);
  ASSERT_EQ(js.exit_code, 0) << js.output;
  const auto j = nlohmann::json::parse(js.output);
  EXPECT_EQ(j["file_bytes"].get<uint64_t>(), std::filesystem::file_size(out));
  const uint64_t align = j["alignment"].get<uint64_t>(), data = j["data_offset"].get<uint64_t>();
  EXPECT_EQ(align, 32u);  // GGUF's default; convert writes no general.alignment
  EXPECT_EQ(data % align, 0u);
  uint64_t total = 0, end = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_type;  // count, bytes
  for (const auto& t : j["tensors"]) {
    const std::string type = t["type"];
    uint64_t n = 1;
    for (const auto& d : t["dims"]) n *= d.get<uint64_t>();
    const uint64_t want = type == "f32" ? 4 * n : type == "f16" ? 2 * n : type == "q8_0" ? n / 32 * 34 : 0;
    ASSERT_NE(want, 0u) << t.dump();
    EXPECT_EQ(t["bytes"].get<uint64_t>(), want) << t.dump();
    const uint64_t off = t["offset"].get<uint64_t>();
    EXPECT_EQ(off % align, 0u) << t.dump();
    EXPECT_GE(off, end) << t.dump();
    end = off + want;
    total += want;
    by_type[type].first += 1;
    by_type[type].second += want;
  }
  EXPECT_LE(data + end, j["file_bytes"].get<uint64_t>());
  EXPECT_LT(j["file_bytes"].get<uint64_t>() - (data + end), align) << "the last tensor ends the file (but padding)";
  EXPECT_EQ(j["tensor_bytes"].get<uint64_t>(), total);
  ASSERT_EQ(j["bytes_by_type"].size(), by_type.size());
  for (const auto& [type, e] : by_type) {
    EXPECT_EQ(j["bytes_by_type"][type]["count"].get<uint64_t>(), e.first) << type;
    EXPECT_EQ(j["bytes_by_type"][type]["bytes"].get<uint64_t>(), e.second) << type;
  }
  const auto& hp = j["hyper_parameters"];
  EXPECT_EQ(hp["embedding_length"], 64);
  EXPECT_EQ(hp["feed_forward_length"], 172);
  EXPECT_EQ(hp["block_count"], 5);
  EXPECT_EQ(hp["attention.head_count"], 8);
  EXPECT_EQ(hp["attention.head_count_kv"], 4);
  EXPECT_EQ(hp["context_length"], 512);
  EXPECT_FALSE(j["synthetic"].get<bool>());
  CommandResult text = Nflash("inspect " + out);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("tensors: 47, " + std::to_string(total) + " bytes"), std::string::npos) << text.output;

  // The llama2.c original: a 7-int header, then fp32 arrays (README): embedding, rms_att, wq, wk, wv, wo, rms_ffn,
  // w1, w2, w3, rms_final, freq_cis_real and _imag; the classifier is shared.
  const uint64_t dim = 64, hidden = 172, layers = 5, kv_dim = 64 * 4 / 8, vocab = 512, seq = 512, head = 64 / 8;
  const uint64_t floats = vocab * dim + layers * (dim + 2 * dim * dim + 2 * kv_dim * dim + dim + 3 * hidden * dim) +
                          dim + seq * head;
  CommandResult l2c = Nflash("-q inspect --json --tensors " + Stories());
  ASSERT_EQ(l2c.exit_code, 0) << l2c.output;
  const auto k = nlohmann::json::parse(l2c.output);
  EXPECT_EQ(k["header_bytes"].get<uint64_t>(), 28u);
  EXPECT_EQ(k["expected_file_bytes"].get<uint64_t>(), 28 + 4 * floats);
  EXPECT_EQ(k["file_bytes"].get<uint64_t>(), std::filesystem::file_size(Stories()));
  EXPECT_TRUE(k["size_ok"].get<bool>());
  EXPECT_EQ(k["header"]["hidden_dim"], 172);
  EXPECT_EQ(k["header"]["n_kv_heads"], 4);
  EXPECT_TRUE(k["header"]["shared_classifier"].get<bool>());
  uint64_t listed = 0;
  for (const auto& t : k["tensors"]) {
    uint64_t n = 1;
    for (const auto& d : t["dims"]) n *= d.get<uint64_t>();
    EXPECT_EQ(t["bytes"].get<uint64_t>(), 4 * n) << t.dump();
    listed += t["bytes"].get<uint64_t>();
  }
  EXPECT_EQ(28 + listed, 28 + 4 * floats);
  // A truncated copy: the size check fails (exit 1), and with 5 layers the layout is still listed.
  const std::string cut = dir.File("cut.bin");
  std::filesystem::copy_file(Stories(), cut);
  std::filesystem::resize_file(cut, std::filesystem::file_size(Stories()) - 4);
  CommandResult c = RunCommand(NflashBinary() + " -q inspect --json --tensors " + cut, /*capture_stderr=*/false);
  EXPECT_EQ(c.exit_code, 1) << c.output;
  const auto m = nlohmann::json::parse(c.output);
  EXPECT_FALSE(m["size_ok"].get<bool>());
  EXPECT_EQ(m["file_bytes"].get<uint64_t>(), 28 + 4 * floats - 4);
  EXPECT_EQ(m["tensors"].size(), k["tensors"].size());
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
  EXPECT_NE(m.output.find("input " + missing + " does not exist"), std::string::npos) << m.output;

  const std::string out = dir.File("b.gguf");
  ASSERT_EQ(Nflash("-q convert " + Stories() + " -o " + out).exit_code, 0);
  CommandResult again = Nflash("convert " + Stories() + " -o " + out);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("--force"), std::string::npos) << again.output;
  // Refused before the input is opened (the GGUF writer would refuse too, after reading and quantizing it): a missing
  // input is not what it reports.
  CommandResult before_input = Nflash("convert " + missing + " -o " + out);
  EXPECT_EQ(before_input.exit_code, 2) << before_input.output;
  EXPECT_NE(before_input.output.find(out + " exists; pass --force to overwrite"), std::string::npos)
      << before_input.output;
  CommandResult forced = Nflash("-q convert " + Stories() + " -o " + out + " --force --type f16");
  EXPECT_EQ(forced.exit_code, 0) << forced.output;

  CommandResult corrupt = Nflash("inspect " + SharedPath("models/stories260K/tok512.bin"));
  EXPECT_EQ(corrupt.exit_code, 1) << corrupt.output;

  // A GGUF carries its own tokenizer: --tokenizer is for llama2.c checkpoints.
  CommandResult tok = Nflash("convert " + out + " --tokenizer " + SharedPath("models/stories260K/tok512.bin") +
                             " -o " + dir.File("c.gguf"));
  EXPECT_EQ(tok.exit_code, 2) << tok.output;
  EXPECT_NE(tok.output.find("--tokenizer applies to llama2.c checkpoints only"), std::string::npos) << tok.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("c.gguf")));
  // synth's own refusals.
  CommandResult act = Nflash("synth --shape custom --dim 64 --ffn 64 --heads 4 --vocab 300 --activation gelu -o " +
                             dir.File("s.gguf"));
  EXPECT_EQ(act.exit_code, 2) << act.output;
  EXPECT_NE(act.output.find("--activation gelu is not relu, drelu or silu"), std::string::npos) << act.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("s.gguf")));
  // An existing output is refused before the model is made: nothing of the build (its SiLU warning) comes first.
  CommandResult synth_exists = Nflash("synth --shape custom --dim 64 --ffn 64 --heads 4 --vocab 300 --activation silu -o " +
                                      out);
  EXPECT_EQ(synth_exists.exit_code, 2) << synth_exists.output;
  EXPECT_NE(synth_exists.output.find(out + " exists; pass --force to overwrite"), std::string::npos)
      << synth_exists.output;
  EXPECT_EQ(synth_exists.output.find("SiLU is never exactly zero"), std::string::npos) << synth_exists.output;
}

// --q4-reference chooses how Q4_0 blocks are rounded: with another --type (the default f32 included) it would change
// nothing, so it is a usage error naming the type (it used to be ignored), and nothing is written.
TEST(Cli, Q4ReferenceNeedsTypeQ4_0) {
  TempDir dir;
  for (const std::string type : {" --type q8_0", ""}) {
    EXPECT_TRUE(testing::FailsAsUsageError(NflashBinary() + " convert " + Stories() + " -o " + dir.File("r.gguf") +
                                               type + " --q4-reference",
                                           "--q4-reference applies to --type q4_0 only"))
        << type;
    EXPECT_FALSE(std::filesystem::exists(dir.File("r.gguf"))) << type;
  }
  CommandResult q4 = Nflash("-q convert " + Stories() + " -o " + dir.File("r.gguf") + " --type q4_0 --q4-reference");
  EXPECT_EQ(q4.exit_code, 0) << q4.output;
  EXPECT_TRUE(std::filesystem::exists(dir.File("r.gguf")));
}

// synth flags that only shape something another flag turns on used to be dropped without a word: --gate-noise without
// --gate-rank (the weights are then i.i.d.) and --top-k without --experts (a dense FFN). Each is a usage error naming
// what it needs, nothing is written; with the flag it needs, each runs.
TEST(Cli, SynthFlagsNeedWhatTheyShape) {
  TempDir dir;
  const std::string synth =
      NflashBinary() + " -q synth --shape custom --dim 64 --ffn 64 --heads 4 --vocab 300 --layers 1";
  EXPECT_TRUE(testing::FailsAsUsageError(synth + " --gate-noise 0.5 -o " + dir.File("n.gguf"),
                                         "--gate-noise 0.5 applies to predictable gates only: it needs --gate-rank"));
  EXPECT_TRUE(testing::FailsAsUsageError(synth + " --gate-rank 0 --gate-noise 0.5 -o " + dir.File("n.gguf"),
                                         "it needs --gate-rank R > 0"));
  EXPECT_TRUE(testing::FailsAsUsageError(synth + " --top-k 3 -o " + dir.File("n.gguf"),
                                         "--top-k 3: experts used per token need --experts N > 0"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("n.gguf")));
  CommandResult rank = RunCommand(synth + " --gate-rank 8 --gate-noise 0.5 -o " + dir.File("rank.gguf"));
  EXPECT_EQ(rank.exit_code, 0) << rank.output;
  CommandResult moe = RunCommand(synth + " --experts 4 --top-k 3 -o " + dir.File("moe.gguf"));
  EXPECT_EQ(moe.exit_code, 0) << moe.output;
}

// --plot draws a profile's curves: for a model (GGUF, llama2.c) it used to print the summary and draw nothing; now a
// usage error naming the input's kind and what inspect prints for it, and no image. The model's own views still run.
TEST(Cli, InspectPlotIsForProfiles) {
  TempDir dir;
  const std::string gguf = dir.File("s.gguf");
  ASSERT_EQ(Nflash("-q convert " + Stories() + " -o " + gguf).exit_code, 0);
  EXPECT_TRUE(testing::FailsAsUsageError(NflashBinary() + " inspect " + gguf + " --plot " + dir.File("c.png"),
                                         "--plot does not apply to " + gguf + ", a GGUF model: inspect prints it as "
                                         "text or --json, with or without --tensors (--plot is for profiles)"));
  EXPECT_TRUE(testing::FailsAsUsageError(NflashBinary() + " inspect --json " + Stories() + " --plot " +
                                             dir.File("c.png"),
                                         "--plot does not apply to " + Stories() + ", a llama2.c checkpoint"));
  EXPECT_FALSE(std::filesystem::exists(dir.File("c.png")));
  CommandResult views = Nflash("-q inspect --json --tensors " + gguf);
  EXPECT_EQ(views.exit_code, 0) << views.output;
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
