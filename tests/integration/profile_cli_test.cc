// `nflash profile` and `nflash inspect PROFILE` end to end on stories260K-relu: the sparsity its README measured,
// the trace file agreeing with the profile's counts, hash checks and bad input.
#include <gtest/gtest.h>
#include <zstd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "profiler/profile.h"
#include "runtime/cli/model_loader.h"
#include "runtime/engine/context.h"
#include "runtime/core/checksum.h"
#include "tests/test_util.h"

namespace nflash::profiler {
namespace {

using testing::NflashBinary;
using testing::RunCommand;
using testing::SharedPath;
using testing::TempDir;

std::string ReluModel() { return SharedPath("models/stories260K-relu/stories260K-relu.bin"); }
std::string ProfileCmd(const std::string& text, const std::string& out, const std::string& extra = "") {
  return NflashBinary() + " profile -m " + ReluModel() + " --activation relu --tokenizer " +
         SharedPath("models/stories260K/tok512.bin") + " -f " + text + " -o " + out + " " + extra;
}

std::vector<uint8_t> Decompress(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> src((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<uint8_t> out;
  ZSTD_DCtx* d = ZSTD_createDCtx();
  ZSTD_inBuffer ib{src.data(), src.size(), 0};
  std::vector<uint8_t> buf(ZSTD_DStreamOutSize());
  while (ib.pos < ib.size) {
    ZSTD_outBuffer ob{buf.data(), buf.size(), 0};
    const size_t r = ZSTD_decompressStream(d, &ob, &ib);
    if (ZSTD_isError(r)) break;
    out.insert(out.end(), buf.begin(), buf.begin() + static_cast<ptrdiff_t>(ob.pos));
  }
  ZSTD_freeDCtx(d);
  return out;
}

// One run shared by the tests (profiling takes under a second; the suite stays small).
class ProfileCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto r = RunCommand(ProfileCmd(SharedPath("text/tinystories_calib.txt"), dir_->File("relu.prof"),
                                         "--tokens 2000 --traces " + dir_->File("relu.trace.zst")));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() { delete dir_; }
  static TempDir* dir_;
};
TempDir* ProfileCli::dir_ = nullptr;

TEST_F(ProfileCli, SparsityMatchesTheModelReadme) {
  auto p = LoadProfile(dir_->File("relu.prof"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->activation, "relu");
  EXPECT_EQ(p->tokens, 2000);
  ASSERT_EQ(p->ffns.size(), 5u);
  // README (whole held-out file): zero share per layer 0.926 0.889 0.881 0.833 0.791, i.e. active 0.136 overall.
  // 2000 calibration tokens are another sample of the same kind of text: within 0.03 per layer.
  const double readme_active[5] = {0.074, 0.111, 0.119, 0.167, 0.209};
  double mean = 0;
  for (int l = 0; l < 5; ++l) {
    const FfnProfile* f = p->Find(l);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->threshold, 0.0f);
    EXPECT_EQ(f->tokens, 2000);
    EXPECT_NEAR(f->mean_active_fraction, readme_active[l], 0.03) << "layer " << l;
    mean += f->mean_active_fraction / 5;
    // The mean from the counts: sum of per-neuron counts / (tokens * n_ff).
    uint64_t sum = 0;
    for (uint32_t c : f->count_bs1) sum += c;
    EXPECT_NEAR(static_cast<double>(sum) / (2000.0 * f->n_neurons), f->mean_active_fraction, 1e-9);
    // 8 windows (the last has 208 tokens): 4 pairs and 2 quadruples, each using all 256 positions.
    EXPECT_EQ(f->groups2, 4 * 256);
    EXPECT_EQ(f->groups4, 2 * 256);
    EXPECT_FLOAT_EQ(f->popularity[16], 1.0f);
    EXPECT_GT(f->lru_hit_rate[16], 0.9f);
  }
  EXPECT_NEAR(mean, 0.136, 0.015);
}

TEST_F(ProfileCli, TraceAgreesWithCounts) {
  auto p = LoadProfile(dir_->File("relu.prof"));
  ASSERT_TRUE(p.ok());
  const std::vector<uint8_t> t = Decompress(dir_->File("relu.trace.zst"));
  ASSERT_GE(t.size(), 12u);
  uint32_t head[3];
  std::memcpy(head, t.data(), 12);
  EXPECT_EQ(head[0], 0x5254464eu);  // "NFTR"
  EXPECT_EQ(head[1], 1u);
  ASSERT_EQ(head[2], 5u);
  size_t off = 12 + 5 * 4;
  const size_t words = (172 + 63) / 64;
  std::vector<std::vector<uint32_t>> counts(5, std::vector<uint32_t>(172, 0));
  size_t records = 0;
  while (off + 8 + words * 8 <= t.size()) {
    uint32_t ffn;
    std::memcpy(&ffn, &t[off], 4);
    ASSERT_LT(ffn, 5u);
    off += 8;
    for (size_t w = 0; w < words; ++w) {
      uint64_t bits;
      std::memcpy(&bits, &t[off + w * 8], 8);
      for (; bits; bits &= bits - 1) ++counts[ffn][w * 64 + std::countr_zero(bits)];
    }
    off += words * 8;
    ++records;
  }
  EXPECT_EQ(off, t.size());
  EXPECT_EQ(records, 2000u * 5);
  for (int l = 0; l < 5; ++l) EXPECT_EQ(counts[l], p->Find(l)->count_bs1) << "layer " << l;
}

// Decode mode records the model's own greedy continuation of text prompts, not the text. Checked against a decode
// written here with the engine alone (own argmax, own active test), record by record from the trace: window 0 decodes
// after text tokens [0, 8), window 1 after [8, 16); only decoded tokens are recorded.
TEST(ProfileDecode, RecordsTheModelsOwnGreedyDecode) {
  TempDir dir;
  const std::string text = SharedPath("text/tinystories_calib.txt");
  const auto r = RunCommand(ProfileCmd(text, dir.File("dec.prof"),
                                       "--tokens 40 --generate 24 --prompt-tokens 8 --ctx 32 --traces " +
                                           dir.File("dec.trace.zst")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto p = LoadProfile(dir.File("dec.prof"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->tokens, 40);
  EXPECT_EQ(p->decode_tokens, 24);
  EXPECT_EQ(p->decode_prompt_tokens, 8);
  EXPECT_EQ(p->decode_temperature, 0.0);
  EXPECT_NE(RunCommand(NflashBinary() + " inspect " + dir.File("dec.prof")).output.find("the model's own decode"),
            std::string::npos);

  // Expected: per (window, step), per layer, the active set of an independent greedy decode.
  cli::ModelSource src{ReluModel(), SharedPath("models/stories260K/tok512.bin"), "relu"};
  auto lm = cli::LoadModelForInference(src);
  ASSERT_TRUE(lm.ok()) << lm.status().ToString();
  std::ifstream in(text, std::ios::binary);
  std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = lm->tokenizer->Encode(std::string_view(body).substr(0, 4096), true);
  ASSERT_GE(ids.size(), 16u);
  const int64_t n_ff = lm->model->hparams().n_ff, n_vocab = lm->model->hparams().n_vocab;
  ThreadPool pool(1);
  InferenceContext ctx(*lm->model, &pool, 32);
  std::vector<std::vector<uint64_t>> expected;  // record order: token, then layer
  bool observing = false;
  ctx.SetFfnObserver([&](const FfnObservation& o) {
    if (!observing) return;
    std::vector<uint64_t> bits(static_cast<size_t>((n_ff + 63) / 64), 0);
    for (int64_t i = 0; i < n_ff; ++i) {
      if (o.gate_act[i] > 0) bits[static_cast<size_t>(i / 64)] |= uint64_t{1} << (i % 64);
    }
    expected.push_back(std::move(bits));
  });
  std::vector<int32_t> expected_tokens;  // trace token index of each expected record group
  for (int w = 0; w < 2; ++w) {
    ctx.Reset();
    observing = false;
    ASSERT_TRUE(ctx.Eval(std::span<const int32_t>(ids.data() + 8 * w, 8), false).ok());
    for (int step = 0; step < (w == 0 ? 24 : 16); ++step) {
      const float* lg = ctx.logits();
      const int32_t next = static_cast<int32_t>(std::max_element(lg, lg + n_vocab) - lg);
      observing = true;
      ASSERT_TRUE(ctx.Eval(std::span<const int32_t>(&next, 1), false).ok());
      observing = false;
      expected_tokens.push_back(24 * w + step);
    }
  }
  ASSERT_EQ(expected.size(), 40u * 5);

  const std::vector<uint8_t> t = Decompress(dir.File("dec.trace.zst"));
  size_t off = 12 + 5 * 4;
  const size_t words = (static_cast<size_t>(n_ff) + 63) / 64;
  size_t rec = 0;
  for (; off + 8 + words * 8 <= t.size(); off += 8 + words * 8, ++rec) {
    ASSERT_LT(rec, expected.size());
    uint32_t ffn, token;
    std::memcpy(&ffn, &t[off], 4);
    std::memcpy(&token, &t[off + 4], 4);
    EXPECT_EQ(ffn, rec % 5) << "record " << rec;
    EXPECT_EQ(token, static_cast<uint32_t>(expected_tokens[rec / 5])) << "record " << rec;
    std::vector<uint64_t> bits(words);
    std::memcpy(bits.data(), &t[off + 8], words * 8);
    EXPECT_EQ(bits, expected[rec]) << "record " << rec << " (token " << token << ", layer " << ffn << ")";
  }
  EXPECT_EQ(rec, expected.size());
  EXPECT_EQ(off, t.size());

  // Bad combinations are refused before any work.
  const auto too_long = RunCommand(ProfileCmd(text, dir.File("x.prof"), "--tokens 40 --generate 30 --ctx 32"));
  EXPECT_EQ(too_long.exit_code, 2);  // a usage error
  EXPECT_NE(too_long.output.find("must fit --ctx 32"), std::string::npos) << too_long.output;
  const auto no_tokens = RunCommand(ProfileCmd(text, dir.File("x.prof"), "--generate 8"));
  EXPECT_EQ(no_tokens.exit_code, 2);
  EXPECT_NE(no_tokens.output.find("--generate needs --tokens"), std::string::npos) << no_tokens.output;
}

TEST_F(ProfileCli, InspectPrintsSummaryAndPlots) {
  const auto r = RunCommand(NflashBinary() + " inspect " + dir_->File("relu.prof"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stories260K-relu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hit25%"), std::string::npos);
  // A profile is printed as text only: --json and --tensors used to print the same text; now usage errors that say so.
  for (const char* view : {" --json", " --tensors"}) {
    EXPECT_TRUE(testing::FailsAsUsageError(NflashBinary() + " inspect " + dir_->File("relu.prof") + view,
                                           std::string(view + 1) + " does not apply to " + dir_->File("relu.prof") +
                                               ", a profile: inspect prints it as text only, with --plot also its "
                                               "curves"));
  }
  if (std::system("command -v gnuplot > /dev/null") == 0) {
    const auto pl = RunCommand(NflashBinary() + " inspect " + dir_->File("relu.prof") + " --plot " +
                               dir_->File("curves.svg"));
    ASSERT_EQ(pl.exit_code, 0) << pl.output;
    std::ifstream svg(dir_->File("curves.svg"));
    std::string first;
    std::getline(svg, first);
    EXPECT_NE(first.find("<?xml"), std::string::npos) << first;
  }
}

// A profile whose figures are chosen by hand, so that every column of `nflash inspect`'s table has a value known in
// advance (worked out in the comments): the histogram's quantiles are bin upper edges, the 10% and 20% columns
// interpolate the 17-point curves, bs2 divides by groups and neurons.
ModelProfile HandMadeProfile() {
  ModelProfile p;
  p.model_hash = "00";
  p.model_name = "it's\thand-made\n";  // a quote and control characters, for the plot's quoting
  p.activation = "relu";
  p.n_layers = 2;
  p.n_ff = 8;
  p.dim = 4;
  p.tokens = 10;
  p.text_path = "none.txt";
  p.ctx = 16;
  p.report_sparsities = {0.5f, 0.9f};
  for (int layer = 0; layer < 2; ++layer) {
    FfnProfile f;
    f.layer = layer;
    f.n_neurons = 8;
    f.tokens = 10;
    f.count_bs1.assign(8, 1);
    f.count_bs2 = {5, 4, 3, 2, 1, 1, 0, 0};  // 16 of 5 groups x 8 neurons: bs2 = 0.4
    f.groups2 = 5;
    f.count_bs4.assign(8, 1);
    f.groups4 = 3;
    f.active_hist.assign(20, 0);
    f.popularity.resize(kCurvePoints);
    f.lru_hit_rate.resize(kCurvePoints);
    for (int i = 0; i < kCurvePoints; ++i) {
      f.popularity[i] = static_cast<float>(i * i) / 256.0f;  // (i/16)^2, exact in float
      f.lru_hit_rate[i] = static_cast<float>(i) / 32.0f;
    }
    if (layer == 0) {
      f.active_hist[1] = 3;  // tokens: 3, 7, 10 by bins 1, 4, 9
      f.active_hist[4] = 4;
      f.active_hist[9] = 3;
      f.mean_active_fraction = 0.1875;
      f.popularity_heldout.resize(kCurvePoints);
      for (int i = 0; i < kCurvePoints; ++i) f.popularity_heldout[i] = static_cast<float>(i) / 16.0f;
      f.up_given_gate = 0.875;
      f.down_given_gate = 0.625;
      f.report_thresholds = {0.125f, 0.5f};
    } else {
      f.active_hist[19] = 10;  // every token in the last bin
      f.mean_active_fraction = 0.96875;
      f.report_thresholds = {0.25f, 0.75f};
      f.threshold = 0.03125f;
    }
    p.ffns.push_back(std::move(f));
  }
  p.lru_hit_rate_shared.resize(kSharedCurvePoints);
  for (int i = 0; i < kSharedCurvePoints; ++i) p.lru_hit_rate_shared[i] = static_cast<float>(i) / 128.0f;
  return p;
}

// The output's lines as words, from the first line whose first word is `first` to the end (empty when none is).
std::vector<std::vector<std::string>> RowsFrom(const std::string& output, const std::string& first) {
  std::istringstream lines(output);
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    std::vector<std::string> words;
    for (std::string w; in >> w;) words.push_back(w);
    if (!rows.empty() || (!words.empty() && words[0] == first)) rows.push_back(std::move(words));
  }
  return rows;
}

// The words of the first output line whose first word is `first` (empty when none is).
std::vector<std::string> WordsOfLine(const std::string& output, const std::string& first) {
  std::vector<std::vector<std::string>> rows = RowsFrom(output, first);
  return rows.empty() ? std::vector<std::string>{} : rows.front();
}

TEST(ProfileInspect, TableShowsTheFiguresOfAKnownProfile) {
  TempDir dir;
  ASSERT_TRUE(SaveProfile(HandMadeProfile(), dir.File("hand.prof"), false).ok());
  const auto r = RunCommand(NflashBinary() + " inspect " + dir.File("hand.prof"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Layer 0: P50 at the bin where 5 of 10 tokens are reached (bin 4: upper edge 5/20), P90 at 9 of 10 (bin 9: 10/20);
  // top10% at 1.6 of 16 steps: 0.4 x 1/256 + 0.6 x 4/256 = 0.0109; top20% at 3.2: 0.8 x 9/256 + 0.2 x 16/256 =
  // 0.0406; top50% 64/256; ho50% 8/16; hit25% 4/32, hit50% 8/32; bs2 16 / (5 x 8).
  EXPECT_EQ(WordsOfLine(r.output, "0"),
            (std::vector<std::string>{"0", "-1", "10", "0.00000", "0.1875", "0.250", "0.500", "0.011", "0.041",
                                      "0.250", "0.500", "0.125", "0.250", "0.4000", "0.8750", "0.6250"}))
      << r.output;
  // Layer 1: every token in the last bin (P50 = P90 = 1), no held-out curve ("-"), gated ratios not measured (1).
  EXPECT_EQ(WordsOfLine(r.output, "1"),
            (std::vector<std::string>{"1", "-1", "10", "0.03125", "0.9688", "1.000", "1.000", "0.011", "0.041",
                                      "0.250", "-", "0.125", "0.250", "0.4000", "1.0000", "1.0000"}))
      << r.output;
  // The shared pool's curve at 10/25/50% of 64 steps: points 6, 16 and 32 of i/128.
  EXPECT_NE(r.output.find("10/25/50% of all neurons: 0.047 / 0.125 / 0.250"), std::string::npos) << r.output;
  // The threshold table: one row per FFN, a column per reported sparsity.
  std::vector<std::vector<std::string>> rows = RowsFrom(r.output, "thresholds");
  ASSERT_FALSE(rows.empty()) << r.output;
  rows.erase(rows.begin());  // the heading
  EXPECT_EQ(rows, (std::vector<std::vector<std::string>>{{"layer", "expert", "0.50", "0.90"},
                                                          {"0", "-1", "0.12500", "0.50000"},
                                                          {"1", "-1", "0.25000", "0.75000"}}))
      << r.output;
}

TEST(ProfileInspect, PlotWritesTheImageAtomicallyOrSaysWhy) {
  TempDir dir;
  ASSERT_TRUE(SaveProfile(HandMadeProfile(), dir.File("hand.prof"), false).ok());
  const std::string inspect = NflashBinary() + " inspect " + dir.File("hand.prof") + " --plot ";
  const auto bad = RunCommand(inspect + dir.File("curves.jpg"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--plot " + dir.File("curves.jpg") + ": the extension must be .png or .svg"),
            std::string::npos)
      << bad.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("curves.jpg")));
  if (std::system("command -v gnuplot > /dev/null") != 0) GTEST_SKIP() << "gnuplot is not installed";
  // The model name holds a quote, a tab and a line break, the output's name a quote: quoted for gnuplot's script.
  const std::string out = dir.File("it's curves.svg");
  const auto r = RunCommand(inspect + "\"" + out + "\"");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream svg(out);
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<?xml", 0), 0u) << text.substr(0, 200);
  EXPECT_NE(text.find("hand-made"), std::string::npos) << "the title names the model";
  EXPECT_NE(text.find("L0"), std::string::npos);
  EXPECT_NE(text.find("L1"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(out + ".tmp")) << "renamed, not copied";
}

TEST_F(ProfileCli, HashMismatchIsDetected) {
  auto p = LoadProfile(dir_->File("relu.prof"));
  ASSERT_TRUE(p.ok());
  auto relu_hash = HashFile(ReluModel());
  auto silu_hash = HashFile(SharedPath("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(relu_hash.ok() && silu_hash.ok());
  EXPECT_TRUE(CheckProfileForModel(*p, HashToHex(*relu_hash), ReluModel()).ok());
  EXPECT_FALSE(CheckProfileForModel(*p, HashToHex(*silu_hash), "stories260K.bin").ok());
}

// Refused before the model runs: no traces file is left behind for a command that failed (the profile's writer
// would refuse too, after the run and after the traces were written).
TEST_F(ProfileCli, RefusesToOverwriteWithoutForce) {
  const auto r = RunCommand(ProfileCmd(SharedPath("text/tinystories_calib.txt"), dir_->File("relu.prof"),
                                       "--tokens 10 --traces " + dir_->File("refused.trace.zst")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(dir_->File("relu.prof") + " exists; pass --force to overwrite"), std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir_->File("refused.trace.zst")));
  EXPECT_EQ(r.output.find("profiled"), std::string::npos) << r.output;
}

TEST(ProfileCliBadInput, EmptyNonUtf8AndUnwritable) {
  TempDir dir;
  testing::WriteText(dir.File("empty.txt"), "");
  auto r = RunCommand(ProfileCmd(dir.File("empty.txt"), dir.File("a.prof")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("empty"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("a.prof")));

  testing::WriteBytes(dir.File("latin1.txt"), {'O', 'n', 'c', 'e', ' ', 0xE9, 't', 'e', '\n'});
  r = RunCommand(ProfileCmd(dir.File("latin1.txt"), dir.File("b.prof")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("UTF-8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("offset 5"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("b.prof")));

  testing::WriteText(dir.File("ok.txt"), "Once upon a time there was a cat.\n");
  r = RunCommand(ProfileCmd(dir.File("ok.txt"), dir.File("no/such/dir/c.prof")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not writable"), std::string::npos) << r.output;

  r = RunCommand(NflashBinary() + " profile -m " + dir.File("missing.bin") + " -f " + dir.File("ok.txt") + " -o " +
                 dir.File("d.prof"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.File("d.prof")));

  // A tiny text still profiles (fewer tokens than one window).
  r = RunCommand(ProfileCmd(dir.File("ok.txt"), dir.File("e.prof")));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(LoadProfile(dir.File("e.prof")).ok());
}

// Flags out of range are usage errors named in the message, and nothing is written: batch sizes other than 1, 2, 4,
// a context beyond the model's, a decode-mode prompt longer than the text. (--ctx 0 and --target-sparsity 1 are
// refused by the flags' own validators first.)
TEST(ProfileCliBadInput, FlagsOutOfRangeAreNamed) {
  TempDir dir;
  testing::WriteText(dir.File("ok.txt"), "Once upon a time there was a cat.\n");
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--batch-sizes 1,3", "--batch-sizes: \"3\" is not supported"},
           {"--ctx 513", "--ctx 513 must be in [1, 512]"},
           {"--ctx 64 --prompt-tokens 32 --generate 8 --tokens 8", "fewer than --prompt-tokens 32"}}) {
    EXPECT_TRUE(testing::FailsAsUsageError(ProfileCmd(dir.File("ok.txt"), dir.File("a.prof"), flags), message));
    EXPECT_FALSE(std::filesystem::exists(dir.File("a.prof"))) << flags;
  }
}

// Flags that only shape a part of the run another flag (or the model) turns on used to be dropped without a word:
// the decode's --prompt-tokens, --temp and --seed without --generate (CLI11: "requires --generate"),
// --threshold-tokens without a threshold pass (a ReLU model, no --report-thresholds), --coact-tokens with --coact-k 0.
// Each is a usage error naming the flag and what it needs, nothing is written; with what they need they run, and a
// SiLU model's threshold pass (its default --target-sparsity) still takes --threshold-tokens.
TEST(ProfileCliBadInput, FlagsTheRunWouldIgnoreAreRefused) {
  TempDir dir;
  const std::string text = SharedPath("text/tinystories_calib.txt");
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--tokens 200 --prompt-tokens 4", "--prompt-tokens requires --generate"},
           {"--tokens 200 --temp 0.9", "--temp requires --generate"},
           {"--tokens 200 --seed 5", "--seed requires --generate"},
           {"--tokens 200 --threshold-tokens 100",
            "--threshold-tokens 100: no threshold is calibrated for this relu model (needs --report-thresholds)"},
           {"--tokens 200 --coact-k 0 --coact-tokens 64", "--coact-tokens 64 needs --coact-k > 0"}}) {
    EXPECT_TRUE(testing::FailsAsUsageError(ProfileCmd(text, dir.File("a.prof"), flags), message));
    EXPECT_FALSE(std::filesystem::exists(dir.File("a.prof"))) << flags;
  }
  for (const std::string flags : {"--tokens 200 --threshold-tokens 100 --report-thresholds 0.5 --coact-k 4 "
                                  "--coact-tokens 64",
                                  "--tokens 16 --generate 8 --prompt-tokens 4 --temp 0.9 --seed 5 --ctx 32"}) {
    const auto r = RunCommand(ProfileCmd(text, dir.File("ok.prof"), flags + " --force"));
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
  }
  const auto silu = RunCommand(NflashBinary() + " -q profile -m " + SharedPath("models/stories260K/stories260K.bin") +
                               " -f " + text + " --tokens 200 --threshold-tokens 100 -o " + dir.File("silu.prof"));
  EXPECT_EQ(silu.exit_code, 0) << silu.output;
}

}  // namespace
}  // namespace nflash::profiler
