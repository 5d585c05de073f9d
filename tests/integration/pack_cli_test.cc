// `nflash pack` / `verify` / `inspect DEPLOY_DIR` end to end on the real stories260K-relu model (converted to F32 and
// Q8_0 GGUF, profiled on calibration text): bundles equal the source bit for bit, verify catches a flipped byte,
// usage errors exit 2, a profile of another model is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "packer/deployment.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "tests/test_util.h"

namespace nflash::packer {
namespace {

using nflash::testing::RunCommand;
using nflash::testing::SharedPath;
using nflash::testing::TempDir;

std::string Nflash() { return nflash::testing::NflashBinary(); }

class PackCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    const std::string src = SharedPath("models/stories260K-relu/stories260K-relu.bin");
    const std::string tok = SharedPath("models/stories260K/tok512.bin");
    for (const char* type : {"f32", "q8_0"}) {
      const std::string model = tmp_->File(std::string(type) + ".gguf");
      auto c = RunCommand(Nflash() + " convert " + src + " --tokenizer " + tok + " --activation relu --type " + type +
                          " -o " + model);
      ASSERT_EQ(c.exit_code, 0) << c.output;
      // 3000 calibration tokens: enough for a stable popularity order on 5 layers x 172 neurons, ~1 s.
      auto p = RunCommand(Nflash() + " -q profile -m " + model + " -f " +
                          SharedPath("text/tinystories_calib.txt") + " --tokens 3000 -t 2 -o " + model + ".prof");
      ASSERT_EQ(p.exit_code, 0) << p.output;
    }
  }
  static void TearDownTestSuite() {
    delete tmp_;
    tmp_ = nullptr;
  }
  static std::string Model(const std::string& type) { return tmp_->File(type + ".gguf"); }
  static std::string Dir(const std::string& name) { return tmp_->File(name); }
  static TempDir* tmp_;
};
TempDir* PackCliTest::tmp_ = nullptr;

// Every bundle of `dir` against the source GGUF: gate/up rows and the down column (raw elements: F32 or F16 here,
// since n_ff 172 keeps down out of Q8_0) bit for bit.
void ExpectExactBundles(const std::string& dir, const std::string& model_path) {
  auto d = Deployment::Open(dir);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto model = GgufFile::OpenPath(model_path);
  ASSERT_TRUE(model.ok());
  auto flash = ReadWholeFile((*d)->flash_path());
  ASSERT_TRUE(flash.ok());
  const BundleLayout& l = (*d)->layout();
  int64_t checked = 0;
  for (const RegionInfo& r : (*d)->manifest().regions) {
    const std::string b = "blk." + std::to_string(r.layer) + ".";
    const GgufTensorInfo* g = model->FindTensor(b + "ffn_gate.weight");
    const GgufTensorInfo* u = model->FindTensor(b + "ffn_up.weight");
    const GgufTensorInfo* dn = model->FindTensor(b + "ffn_down.weight");
    ASSERT_TRUE(g && u && dn);
    ASSERT_TRUE(dn->type == GgmlType::kF32 || dn->type == GgmlType::kF16);
    ASSERT_EQ(l.down_type, dn->type);
    std::vector<uint8_t> s1, s2, s3;
    const uint8_t* gate = model->TensorData(*g, &s1)->data();
    const uint8_t* up = model->TensorData(*u, &s2)->data();
    const uint8_t* down = model->TensorData(*dn, &s3)->data();
    const size_t grow = g->n_bytes / 172, urow = u->n_bytes / 172, drow = dn->n_bytes / 64;
    const size_t es = dn->type == GgmlType::kF32 ? 4 : 2;
    for (int64_t n = 0; n < r.n_neurons; ++n) {
      const uint8_t* bundle = flash->data() + (*d)->BundleRange(r.layer, -1, n).offset;
      ASSERT_EQ(0, std::memcmp(bundle + l.gate_offset, gate + n * grow, grow)) << r.layer << "/" << n;
      ASSERT_EQ(0, std::memcmp(bundle + l.up_offset, up + n * urow, urow)) << r.layer << "/" << n;
      for (int row = 0; row < 64; ++row) {
        ASSERT_EQ(0, std::memcmp(bundle + l.down_offset + row * es, down + row * drow + n * es, es))
            << r.layer << "/" << n << " row " << row;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 5 * 172);
}

TEST_F(PackCliTest, PackVerifyInspectBothTypesAndOrders) {
  for (const std::string type : {"f32", "q8_0"}) {
    for (const std::string order : {"hotness", "coactivation"}) {
      const std::string dir = Dir(type + "_" + order);
      auto p = RunCommand(Nflash() + " -q pack -m " + Model(type) + " -p " + Model(type) + ".prof -o " + dir +
                          " --order " + order + " -t 2");
      ASSERT_EQ(p.exit_code, 0) << p.output;
      EXPECT_FALSE(std::filesystem::exists(dir + ".tmp-" + std::to_string(::getpid())));
      ExpectExactBundles(dir, Model(type));
      auto v = RunCommand(Nflash() + " verify " + dir);
      EXPECT_EQ(v.exit_code, 0) << v.output;
      EXPECT_NE(v.output.find("OK (5 regions, 860 bundles"), std::string::npos) << v.output;
      auto i = RunCommand(Nflash() + " inspect " + dir);
      EXPECT_EQ(i.exit_code, 0) << i.output;
      EXPECT_NE(i.output.find("order            " + order), std::string::npos) << i.output;
      EXPECT_NE(i.output.find("dim 64, n_ff 172, layers 5"), std::string::npos) << i.output;
    }
  }
  // A deployment is printed as text only: --json, --tensors and --plot used to print the same text (and draw
  // nothing); now usage errors naming the flag and the input's kind.
  const std::string dir = Dir("f32_hotness");
  for (const std::string& view : std::vector<std::string>{"--json", "--tensors", "--plot " + Dir("d.png")}) {
    EXPECT_TRUE(testing::FailsAsUsageError(Nflash() + " inspect " + dir + " " + view,
                                           view.substr(0, view.find(' ')) + " does not apply to " + dir +
                                               ", a deployment directory: inspect prints it as text only"));
  }
  EXPECT_FALSE(std::filesystem::exists(Dir("d.png")));
}

TEST_F(PackCliTest, ReplayReportsReadsPerToken) {
  const std::string dir = Dir("replay");
  ASSERT_EQ(RunCommand(Nflash() + " -q pack -m " + Model("f32") + " -p " + Model("f32") + ".prof -o " + dir).exit_code, 0);
  auto r = RunCommand(Nflash() + " verify " + dir + " -m " + Model("f32") + " --replay-text " +
                      SharedPath("text/tinystories_cased_197K.txt") + " --tokens 512 -t 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("replay of 512 held-out tokens"), std::string::npos) << r.output;
  // Another model than the one packed is refused.
  auto wrong = RunCommand(Nflash() + " verify " + dir + " -m " + Model("q8_0") + " --replay-text " +
                          SharedPath("text/tinystories_cased_197K.txt"));
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("was packed from a model with"), std::string::npos) << wrong.output;
  // A replay needs the source model.
  auto no_model = RunCommand(Nflash() + " verify " + dir + " --replay-text " +
                             SharedPath("text/tinystories_cased_197K.txt"));
  EXPECT_NE(no_model.exit_code, 0);
  EXPECT_NE(no_model.output.find("--replay-text needs --model"), std::string::npos) << no_model.output;
  // The replay's settings without a replay used to be dropped (verify checked and said OK): CLI11 refuses each by
  // name ("requires --replay-text").
  for (const std::string& flag : std::vector<std::string>{"-m " + Model("f32"), "--tokens 5", "-t 2"}) {
    EXPECT_TRUE(testing::FailsAsUsageError(Nflash() + " verify " + dir + " " + flag, "requires --replay-text"));
  }
}

// --order coactivation asked for by name on a profile without co-activation data (profiled with --coact-k 0) packs in
// hotness order, as --help says; it used to do so without a word, now with a warning. The default order (not given)
// stays silent, and a profile with the data gives no warning.
TEST_F(PackCliTest, CoactivationOrderWithoutTheDataIsWarnedAbout) {
  const std::string prof = tmp_->File("nocoact.prof");
  auto p = RunCommand(Nflash() + " -q profile -m " + Model("f32") + " -f " + SharedPath("text/tinystories_calib.txt") +
                      " --tokens 1000 --coact-k 0 -t 2 -o " + prof);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  const std::string kWarning = "warning: --order coactivation: " + prof + " has no co-activation data (profiled with "
                               "--coact-k 0); the hotness order is used";
  auto asked = RunCommand(Nflash() + " pack -m " + Model("f32") + " -p " + prof + " -o " + Dir("nocoact_asked") +
                          " --order coactivation");
  ASSERT_EQ(asked.exit_code, 0) << asked.output;
  EXPECT_NE(asked.output.find(kWarning), std::string::npos) << asked.output;
  auto i = RunCommand(Nflash() + " inspect " + Dir("nocoact_asked"));
  EXPECT_NE(i.output.find("order            hotness"), std::string::npos) << i.output;
  auto by_default = RunCommand(Nflash() + " pack -m " + Model("f32") + " -p " + prof + " -o " + Dir("nocoact_default"));
  ASSERT_EQ(by_default.exit_code, 0) << by_default.output;
  EXPECT_EQ(by_default.output.find("warning"), std::string::npos) << by_default.output;
  auto with_data = RunCommand(Nflash() + " pack -m " + Model("f32") + " -p " + Model("f32") + ".prof -o " +
                              Dir("coact_asked") + " --order coactivation");
  ASSERT_EQ(with_data.exit_code, 0) << with_data.output;
  EXPECT_EQ(with_data.output.find("warning"), std::string::npos) << with_data.output;
}

TEST_F(PackCliTest, CorruptionAndUsageErrors) {
  const std::string dir = Dir("corrupt");
  ASSERT_EQ(RunCommand(Nflash() + " -q pack -m " + Model("q8_0") + " -p " + Model("q8_0") + ".prof -o " + dir).exit_code, 0);
  // Existing output without --force: usage error.
  auto again = RunCommand(Nflash() + " -q pack -m " + Model("q8_0") + " -p " + Model("q8_0") + ".prof -o " + dir);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("--force"), std::string::npos) << again.output;
  auto order = RunCommand(Nflash() + " -q pack -m " + Model("q8_0") + " -p " + Model("q8_0") + ".prof -o " +
                          Dir("x") + " --order random");
  EXPECT_EQ(order.exit_code, 2) << order.output;
  auto fraction = RunCommand(Nflash() + " -q pack -m " + Model("q8_0") + " -p " + Model("q8_0") + ".prof -o " +
                             Dir("x") + " --hot-fraction 1.5");
  EXPECT_EQ(fraction.exit_code, 2) << fraction.output;
  EXPECT_NE(fraction.output.find("--hot-fraction 1.5"), std::string::npos) << fraction.output;
  EXPECT_NE(fraction.output.find("must be in [0, 1]"), std::string::npos) << fraction.output;
  EXPECT_FALSE(std::filesystem::exists(Dir("x")));
  // The F32 model's profile does not belong to the Q8_0 model.
  auto mismatch = RunCommand(Nflash() + " -q pack -m " + Model("q8_0") + " -p " + Model("f32") + ".prof -o " + Dir("y"));
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(Dir("y")));
  // A flipped byte in layer 3's region.
  auto d = Deployment::Open(dir);
  ASSERT_TRUE(d.ok());
  const uint64_t at = (*d)->GateRange(3, -1, 100).offset + 7;
  {
    std::fstream f(dir + "/ffn.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    const char x = 0x5a;
    f.write(&x, 1);
  }
  auto v = RunCommand(Nflash() + " verify " + dir);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_NE(v.output.find("layer 3 neuron 100"), std::string::npos) << v.output;
  EXPECT_NE(v.output.find("gate part"), std::string::npos) << v.output;
  // Truncated: inspect refuses to open it.
  std::filesystem::resize_file(dir + "/ffn.bin", 4096);
  auto i = RunCommand(Nflash() + " inspect " + dir);
  EXPECT_EQ(i.exit_code, 1) << i.output;
  EXPECT_NE(i.output.find("truncated"), std::string::npos) << i.output;
}

TEST_F(PackCliTest, PredictorIsShippedVerbatimAndHashed) {
  const std::string pred = Dir("pred.gguf");
  auto t = RunCommand(Nflash() + " -q train-predictor -m " + Model("f32") + " -f " +
                      SharedPath("text/tinystories_calib.txt") + " --tokens 2000 --ranks 16 --max-rank 16 -o " + pred);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const std::string dir = Dir("with_pred");
  auto p = RunCommand(Nflash() + " -q pack -m " + Model("f32") + " -p " + Model("f32") + ".prof -o " + dir +
                      " --predictor " + pred);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(*ReadWholeFile(pred), *ReadWholeFile(dir + "/predictor.gguf"));
  EXPECT_EQ(RunCommand(Nflash() + " verify " + dir).exit_code, 0);
  // The dense model's deployment gets the lookahead table too (the offloaded runs below guess through it), and inspect
  // lists it.
  auto inspect = RunCommand(Nflash() + " inspect " + dir);
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find(", lookahead.gguf "), std::string::npos) << inspect.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/lookahead.gguf"));
  // The in-memory sparse run with this predictor and the offloaded run print the same text, for a prompt prefilled
  // token by token (default: the prompt is short) and in a batch (--prefill-batch-min 2: the offloaded run reads
  // whole layer regions and computes each token's predicted neurons from them, the same function bit for bit).
  std::string texts[2];
  for (int batched = 0; batched < 2; ++batched) {
    const std::string common = std::string(" -p \"Once upon a time, there was a little\" -n 40 -t 1 --json") +
                               (batched ? " --prefill-batch-min 2 --batch 6" : "");
    auto text = [](const testing::CommandResult& r) -> std::string {
      auto j = nlohmann::json::parse(r.output, nullptr, false);
      return j.is_discarded() || !j.contains("text") ? "(no JSON text) " + r.output : j["text"].get<std::string>();
    };
    auto run = RunCommand(Nflash() + " -q run -m " + Model("f32") + " --temp 0 --sparse predictor --predictor " + pred +
                              common,
                          /*capture_stderr=*/false);
    auto off = RunCommand(Nflash() + " -q offload -d " + dir + " --cold-slots 40" + common, /*capture_stderr=*/false);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    ASSERT_EQ(off.exit_code, 0) << off.output;
    texts[batched] = text(run);
    EXPECT_EQ(text(off), texts[batched]) << (batched ? "batched prefill" : "token-by-token prefill");
    auto j = nlohmann::json::parse(off.output, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << off.output;
    EXPECT_EQ(j["prefill_layers"].empty(), batched == 0) << "which prefill the offloaded run took";
    // The prompt's summary covers every chunk's rows (--batch 6: the prompt runs in two chunks).
    const nlohmann::json& pf = j["prefill"];
    EXPECT_EQ(pf["passes"].get<size_t>(), j["prefill_layers"].size());
    EXPECT_EQ(pf["chunks"].get<int>(), batched ? 2 : 0);
    double mb = 0;
    for (const auto& row : j["prefill_layers"]) {
      mb += row["mb"].get<double>();
      EXPECT_LT(row["chunk"].get<int>(), 2);
    }
    EXPECT_NEAR(pf["mb_read"].get<double>(), mb, 1e-9 * std::max(1.0, mb));
  }
  EXPECT_EQ(texts[0], texts[1]);
  // The guess through the table (projected) or from the hits at random per token: the same text, every measured
  // token in one group or the other, both groups drawn.
  {
    auto ab = RunCommand(Nflash() + " -q offload -d " + dir +
                             " --memory 2M -p \"Once upon a time, there was a little\" -n 40 -t 1 --json "
                             "--warmup 4 --lookahead 64 --lookahead-input-ab 7",
                         /*capture_stderr=*/false);
    ASSERT_EQ(ab.exit_code, 0) << ab.output;
    auto j = nlohmann::json::parse(ab.output, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << ab.output;
    EXPECT_EQ(j["text"].get<std::string>(), texts[0]);
    EXPECT_EQ(j["lookahead_input"].get<std::string>(), "projected");
    const auto on = j["lookahead_input_ab"]["token_on"].get<std::vector<int>>();
    EXPECT_EQ(on.size(), j["token_latencies_ms"].size());
    const int n_on = j["lookahead_input_ab"]["on_tokens"].get<int>();
    EXPECT_EQ(n_on, std::count(on.begin(), on.end(), 1));
    EXPECT_GT(n_on, 0);
    EXPECT_GT(j["lookahead_input_ab"]["off_tokens"].get<int>(), 0);
    EXPECT_GT(j["prefetched_per_token"].get<double>(), 0.0) << "the lookahead read ahead";
    // Without the table (--lookahead-input hits) the switch has nothing to switch: refused.
    auto hits = RunCommand(Nflash() + " -q offload -d " + dir + " --cold-slots 40 -n 4 --lookahead-input hits "
                                                               "--lookahead-input-ab 7");
    EXPECT_EQ(hits.exit_code, 2) << hits.output;
    EXPECT_NE(hits.output.find("guesses from hits, expected projected"), std::string::npos) << hits.output;
  }
  // A modified predictor is caught by verify's hash check.
  {
    std::fstream f(dir + "/predictor.gguf", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    const char x = 0x11;
    f.write(&x, 1);
  }
  auto v = RunCommand(Nflash() + " verify " + dir);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_NE(v.output.find("predictor.gguf: xxHash64"), std::string::npos) << v.output;
}

}  // namespace
}  // namespace nflash::packer
