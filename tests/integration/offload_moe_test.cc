// MoE through the flash-offloaded runtime (issue 6): a synthetic 4-expert top-2 model (F32, Q8_0 and Q4_0) goes
// through synth -> profile -> pack -> offload. With the oracle active set and small caches, greedy decode gives the same
// text as `nflash run --sparse oracle` and, for F32, as `nflash run` (dense); through the library, logits bitwise equal
// to the in-memory sparse FFN (F32: the dense engine's tokens too), and per (layer, expert) group exactly the tokens the
// router sent there: every decode step touches (and reads for) only the top-k experts the router picked.
//
// Quantized against dense: both sparse paths requantize each down column in the model's type (ColumnType in
// runtime/core/quant.h) while the dense path quantizes the hidden vector, so logits differ by rounding, and a random
// model's flat logits turn that into a different greedy token after ~20 steps; the offloaded FFN must equal the sparse
// one bit for bit instead.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <random>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/sparse/event_trace.h"
#include "runtime/sparse/sparse_runtime.h"
#include "tests/test_util.h"
#include "tests/unit/offload_test_util.h"

namespace nflash::sparse {
namespace {

constexpr int64_t kExperts = 4, kTopK = 2, kLayers = 2;
// Generated tokens: enough steps that every expert is both selected and skipped many times.
constexpr int kGenerate = 40;
const char* kPromptText = "Once upon a time";
// Tokens of a fixed prompt for the library runs (BOS then byte tokens of "Hi there": ids < the 512 vocab).
const std::vector<int32_t> kPrompt = {1, 75, 108, 35, 119, 107, 104, 117, 104};

std::string Nflash() { return testing::NflashBinary(); }

// Small caches: most active neurons miss, so reads happen on nearly every step of every routed expert.
SparseRuntimeOptions SmallCaches(OffloadMode mode) {
  SparseRuntimeOptions o;
  o.mode = mode;
  o.active_set = ActiveSetSource::kOracle;
  o.hot_slots = 2;
  o.cold_slots = 48;
  o.lookahead_slots = 16;  // MoE has it off by default; on here, so that its reads are checked too
  return o;
}

// The runtimes each library test compares with the in-memory sparse FFN: full mode with the next-layer lookahead
// (SmallCaches), full mode with the MoE default (no lookahead: the layer's other routed experts' misses read at its
// first expert, OffloadOptions::sibling_readahead), full mode with each expert reading its own misses, and llmflash.
struct Variant {
  const char* name;
  OffloadMode mode;
  int64_t lookahead_slots;
  bool siblings;
};
const Variant kVariants[] = {{"full, next-layer lookahead", OffloadMode::kFull, 16, true},
                             {"full, sibling read-ahead", OffloadMode::kFull, -1, true},
                             {"full, each expert its own reads", OffloadMode::kFull, -1, false},
                             {"llmflash", OffloadMode::kLlmFlash, 16, true}};
SparseRuntimeOptions Options(const Variant& v) {
  SparseRuntimeOptions o = SmallCaches(v.mode);
  o.lookahead_slots = v.lookahead_slots;
  o.sibling_readahead = v.siblings;
  return o;
}
// Sibling read-ahead reads exactly the misses of experts the router picked, each bundle for the expert that uses it.
bool SiblingsRead(const Variant& v) { return v.mode == OffloadMode::kFull && v.lookahead_slots < 0 && v.siblings; }

class OffloadMoeTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    for (const std::string type : {"f32", "q8_0", "q4_0"}) {
      const std::string model = ModelPath(type), prof = dir_->File(type + ".prof");
      auto r = testing::RunCommand(Nflash() + " -q synth --shape custom --dim 128 --ffn 384 --heads 4 --layers " +
                                   std::to_string(kLayers) + " --experts " + std::to_string(kExperts) + " --top-k " +
                                   std::to_string(kTopK) + " --vocab 512 --type " + type + " --threads 1 -o " + model);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      // Calibration text only (the held-out file is for evaluation).
      r = testing::RunCommand(Nflash() + " -q profile -m " + model + " -f " +
                              testing::SharedPath("text/tinystories_calib.txt") + " --tokens 2000 -t 1 -o " + prof);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = testing::RunCommand(Nflash() + " -q pack -m " + model + " -p " + prof + " -o " + Deploy(type));
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string ModelPath(const std::string& type) { return dir_->File(type + ".gguf"); }
  static std::string Deploy(const std::string& type) { return dir_->File(type + "-deploy"); }

  // A command's --json output (stdout only); an object without fields when it has none with a text field.
  static nlohmann::json JsonOf(const std::string& command) {
    auto r = testing::RunCommand(command, /*capture_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << command << "\n" << r.output;
    auto j = nlohmann::json::parse(r.output, nullptr, false);
    if (j.is_discarded() || !j.contains("text")) {
      ADD_FAILURE() << command << ": no JSON with a text field:\n" << r.output;
      return nlohmann::json::object();
    }
    return j;
  }
  // A top-4-of-8 MoE (three siblings per routed expert), f32: dir_/NAME.gguf, profiled on `tokens` calibration
  // tokens, packed into dir_/NAME-deploy; `synth_flags` are added to synth's. "" when made, else what failed.
  static std::string MakeTop4Deployment(const std::string& name, const std::string& synth_flags, int tokens) {
    const std::string model = dir_->File(name + ".gguf"), prof = dir_->File(name + ".prof");
    for (const std::string& c :
         {Nflash() + " -q synth --shape custom --dim 128 --ffn 384 --heads 4 --layers " + std::to_string(kLayers) +
              " --experts 8 --top-k 4 --vocab 512 --type f32 --threads 1" + synth_flags + " -o " + model,
          Nflash() + " -q profile -m " + model + " -f " + testing::SharedPath("text/tinystories_calib.txt") +
              " --tokens " + std::to_string(tokens) + " -t 1 -o " + prof,
          Nflash() + " -q pack -m " + model + " -p " + prof + " -o " + dir_->File(name + "-deploy")}) {
      auto r = testing::RunCommand(c);
      if (r.exit_code != 0) return c + "\n" + r.output;
    }
    return "";
  }
  // The "text" field of a command's --json output.
  static std::string JsonText(const std::string& command) { return JsonOf(command).value("text", std::string()); }

  static testing::TempDir* dir_;
};
testing::TempDir* OffloadMoeTest::dir_ = nullptr;

TEST_P(OffloadMoeTest, CliOffloadTextEqualsDenseAndSparseRun) {
  const std::string type = GetParam();
  const std::string common = " -p \"" + std::string(kPromptText) + "\" -n " + std::to_string(kGenerate) + " -t 1 --json";
  const std::string dense = JsonText(Nflash() + " -q run -m " + ModelPath(type) + " --temp 0" + common);
  const std::string sparse = JsonText(Nflash() + " -q run -m " + ModelPath(type) + " --temp 0 --sparse oracle" + common);
  ASSERT_GT(dense.size(), std::string(kPromptText).size());
  if (type == "f32") {
    EXPECT_EQ(sparse, dense);
  }
  for (const char* mode : {"full", "llmflash"}) {
    const std::string offload = JsonText(Nflash() + " -q offload -d " + Deploy(type) +
                                         " --active-set oracle --hot-slots 2 --cold-slots 48 --mode " + mode + common);
    EXPECT_EQ(offload, sparse) << "mode " << mode;
    if (type == "f32") {
      EXPECT_EQ(offload, dense) << "mode " << mode;
    }
  }
}

// Per layer: the experts the router sent the token to (one decode step).
using Routing = std::vector<std::set<int64_t>>;

// Records which (layer, expert) FFNs the context asks for, with how many tokens, and delegates to `inner`: the
// router's choices as the context acts on them, independent of the backend under test.
class RoutingRecorder : public FfnBackend {
 public:
  RoutingRecorder(FfnBackend* inner, int64_t n_layers) : inner_(inner), step_(static_cast<size_t>(n_layers)) {}
  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override {
    routed_[{layer, expert}] += x.n();
    step_[static_cast<size_t>(layer)].insert(expert);
    return inner_->Forward(layer, expert, x, out);
  }
  // The experts of the calls since the last TakeStep.
  Routing TakeStep() {
    Routing r = step_;
    for (auto& s : step_) s.clear();
    return r;
  }
  const std::map<std::pair<int64_t, int64_t>, int64_t>& routed() const { return routed_; }

 private:
  FfnBackend* inner_;
  Routing step_;
  std::map<std::pair<int64_t, int64_t>, int64_t> routed_;  // (layer, expert) -> tokens, prompt included
};

// Greedy decode after kPrompt; per step the logits it chose from, and the token.
struct Run {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<Routing> routing;  // per step (with a recorder)
  std::map<std::pair<int64_t, int64_t>, int64_t> routed;  // SparseReference: (layer, expert) -> tokens, prompt included
};

Result<Run> Greedy(InferenceContext& ctx, int64_t n_vocab, RoutingRecorder* recorder) {
  Run r;
  NF_RETURN_IF_ERROR(ctx.Eval(kPrompt, false));
  for (int i = 0; i < kGenerate; ++i) {
    const float* l = ctx.logits();
    r.logits.emplace_back(l, l + n_vocab);
    r.tokens.push_back(static_cast<int32_t>(std::max_element(l, l + n_vocab) - l));
    if (recorder) recorder->TakeStep();
    NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{r.tokens.back()}, false));
    if (recorder) r.routing.push_back(recorder->TakeStep());
  }
  return r;
}

// The numerical reference of the offloaded runs: greedy decode through the in-memory sparse FFN (prefill too) with the
// same active-set source (`predictor`, or the oracle when nullptr), recording the router's choices on the way.
Result<Run> SparseReference(const nflash::Model& model, const Predictor* predictor, ThreadPool* pool) {
  SparseFfnOptions so;
  so.mode = predictor != nullptr ? SparseMode::kPredictor : SparseMode::kOracle;
  so.sparse_prefill = true;
  NF_ASSIGN_OR_RETURN(std::unique_ptr<SparseFfn> sparse, SparseFfn::Create(model, predictor, so, pool));
  RoutingRecorder recorder(sparse.get(), model.hparams().n_layers);
  InferenceContext ctx(model, pool, 0);
  ctx.SetFfnBackend(&recorder);
  NF_ASSIGN_OR_RETURN(Run r, Greedy(ctx, model.hparams().n_vocab, &recorder));
  r.routed = recorder.routed();
  return r;
}

// The I/O streams of the layers' experts' reads ahead in a decode's trace: how many, and their requests. A stream of
// one expert's set alone (labelled "reads ahead", as a dense model's guess is) fails the test.
struct Streams {
  int64_t count = 0, requests = 0;
};
Streams ExpertReadAheadStreams(const EventTrace& trace) {
  Streams s;
  for (const TraceSpan& span : trace.Spans()) {
    if (span.lane != TraceLane::kIo) continue;
    EXPECT_STRNE(span.name, "reads ahead") << "an expert's set read as a stream of its own";
    if (std::string_view(span.name) == "experts' reads ahead") {
      ++s.count;
      s.requests += span.count;
    }
  }
  return s;
}

TEST_P(OffloadMoeTest, ReadsOnlyForRoutedExpertsAndLogitsEqualSparseFfn) {
  const std::string type = GetParam();
  ThreadPool pool(2);
  auto model = nflash::Model::Load(ModelPath(type), LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ASSERT_EQ(hp.n_experts, kExperts);
  ASSERT_EQ(hp.n_experts_used, kTopK);

  // The in-memory sparse FFN (oracle), the numerical reference of the offloaded one, with the router's choices.
  auto ref = SparseReference(**model, nullptr, &pool);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  const int64_t n_tokens = static_cast<int64_t>(kPrompt.size()) + kGenerate;
  int64_t routed_total = 0;
  for (const auto& [key, n] : ref->routed) routed_total += n;
  ASSERT_EQ(routed_total, kTopK * n_tokens * hp.n_layers);
  int64_t skipped = 0;  // (step, layer, expert) triples the router did not pick
  for (const Routing& r : ref->routing) {
    for (const auto& s : r) {
      ASSERT_EQ(static_cast<int64_t>(s.size()), kTopK);
      skipped += kExperts - static_cast<int64_t>(s.size());
    }
  }
  ASSERT_GT(skipped, 0);

  // F32: the dense engine gives the same tokens (Q8_0 differs by rounding: see the top of this file).
  if (type == "f32") {
    InferenceContext dense(**model, &pool, 0);
    auto d = Greedy(dense, hp.n_vocab, nullptr);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->tokens, ref->tokens);
  }

  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    auto rt = SparseRuntime::Open(Deploy(type), Options(v), &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    OffloadFfn& ffn = (*rt)->ffn();
    ASSERT_EQ(static_cast<int64_t>(ffn.stats().size()), hp.n_layers * kExperts);
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    std::vector<OffloadGroupStats> before = ffn.stats();
    int64_t reads = 0, lookahead_used = 0, read_ahead = 0;
    for (int i = 0; i < kGenerate; ++i) {
      const float* l = ctx.logits();
      const int32_t next = static_cast<int32_t>(std::max_element(l, l + hp.n_vocab) - l);
      ASSERT_EQ(next, ref->tokens[static_cast<size_t>(i)]) << "step " << i;
      ASSERT_TRUE(std::equal(l, l + hp.n_vocab, ref->logits[static_cast<size_t>(i)].begin()))
          << "logits differ from the in-memory sparse FFN at step " << i;
      ASSERT_TRUE(ctx.Eval(std::vector<int32_t>{next}, false).ok());
      // This step: one token in exactly the router's experts of every layer, and reads only there.
      const std::vector<OffloadGroupStats>& now = ffn.stats();
      for (int64_t layer = 0; layer < hp.n_layers; ++layer) {
        for (int64_t e = 0; e < kExperts; ++e) {
          const size_t g = static_cast<size_t>(layer * kExperts + e);
          const bool selected = ref->routing[static_cast<size_t>(i)][static_cast<size_t>(layer)].count(e) > 0;
          const std::string at = "step " + std::to_string(i) + " layer " + std::to_string(layer) + " expert " +
                                 std::to_string(e);
          EXPECT_EQ(now[g].tokens - before[g].tokens, selected ? 1 : 0) << at;
          if (!selected) {
            // Demand reads only where the router sent the token; the full mode's lookahead may have read ahead in an
            // expert the next layer's router would have picked from the previous layer's input (counted apart).
            EXPECT_EQ(now[g].requests - before[g].requests, now[g].prefetch_requests - before[g].prefetch_requests)
                << at;
            EXPECT_EQ(now[g].bytes_read - before[g].bytes_read, now[g].prefetch_bytes - before[g].prefetch_bytes)
                << at;
            EXPECT_EQ(now[g].active, before[g].active) << at;
          }
          if (SiblingsRead(v)) {
            EXPECT_EQ(now[g].prefetch_used - before[g].prefetch_used, now[g].prefetched - before[g].prefetched)
                << at << ": a sibling's bundle read ahead and not used";
            if (!selected) {
              EXPECT_EQ(now[g].bytes_read, before[g].bytes_read) << at;
            }
          }
          lookahead_used += now[g].prefetch_used - before[g].prefetch_used;
          read_ahead += now[g].prefetched - before[g].prefetched;
          reads += now[g].requests - before[g].requests;
        }
      }
      before = now;
    }
    EXPECT_GT(reads, kGenerate) << "the small caches should make most steps read";
    if (v.mode == OffloadMode::kFull && v.siblings) {
      EXPECT_GT(lookahead_used, 0) << "nothing read ahead was used";
    } else {
      EXPECT_EQ(read_ahead, 0);
    }
    // Over the whole run (prompt included): every group saw exactly the tokens routed to it, and a group no token was
    // routed to read nothing.
    int64_t total = 0;
    for (int64_t layer = 0; layer < hp.n_layers; ++layer) {
      for (int64_t e = 0; e < kExperts; ++e) {
        const OffloadGroupStats& s = ffn.stats()[static_cast<size_t>(layer * kExperts + e)];
        auto it = ref->routed.find({layer, e});
        EXPECT_EQ(s.tokens, it == ref->routed.end() ? 0 : it->second) << "layer " << layer << " expert " << e;
        if (s.tokens == 0) {
          EXPECT_EQ(s.bytes_read, 0u) << "layer " << layer << " expert " << e;
        }
        total += s.tokens;
      }
    }
    EXPECT_EQ(total, kTopK * n_tokens * hp.n_layers);
  }
}

// Batched prefill of MoE experts (issue 6, "Prefill: dense GEMM; the FFN of each layer read sequentially"): an expert
// the router sent at least batched_prefill_min_tokens of a chunk's tokens is computed by GEMM over its whole region,
// read sequentially (the layer's next such expert prefetched); the others run token by token. Every prompt position's
// logits, and the greedy steps after it, equal the in-memory sparse FFN under the same rule bit for bit (F32: the dense
// engine's within float tolerance, an independent reference); the passes and bytes read are exactly those of the
// regions of the experts with enough tokens, counted from the router's choices; the runtime's context scratch does not
// grow with the prompt (chunks of max_batch tokens, counted at Open).
TEST_P(OffloadMoeTest, BatchedExpertPrefillEqualsInMemoryAndReadsWholeRegions) {
  const std::string type = GetParam();
  constexpr int64_t kMinTokens = 6, kMaxBatch = 24, kPromptTokens = 48, kDecode = 8;
  ThreadPool pool(2);
  auto model = nflash::Model::Load(ModelPath(type), LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  std::mt19937 rng(7);
  std::vector<int32_t> prompt{1};
  while (static_cast<int64_t>(prompt.size()) < kPromptTokens) {
    prompt.push_back(static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(hp.n_vocab - 3)));
  }
  // Logits of every prompt position, then of kDecode greedy steps; `chunk_routing`: per chunk of the prompt, the
  // tokens each (layer, expert) got.
  using Routed = std::map<std::pair<int64_t, int64_t>, int64_t>;
  auto run = [&](InferenceContext& ctx, RoutingRecorder* recorder, std::vector<Routed>* chunk_routing) {
    std::vector<std::vector<float>> out;
    ctx.SetMaxBatch(kMaxBatch);
    EXPECT_TRUE(ctx.Eval(prompt, true).ok());
    for (int64_t t = 0; t < kPromptTokens; ++t) out.emplace_back(ctx.logits(t), ctx.logits(t) + hp.n_vocab);
    if (chunk_routing != nullptr) {
      // Two chunks of 24: replay them separately through the recorder for their routing (same context state).
      InferenceContext replay(**model, &pool, 0);
      replay.SetFfnBackend(recorder);
      replay.SetMaxBatch(kMaxBatch);
      for (int64_t c = 0; c < kPromptTokens / kMaxBatch; ++c) {
        Routed before = recorder->routed();
        EXPECT_TRUE(replay.Eval(std::span<const int32_t>(prompt.data() + c * kMaxBatch, kMaxBatch), false).ok());
        Routed now = recorder->routed();
        for (auto& [k, n] : now) n -= before.count(k) ? before.at(k) : 0;
        chunk_routing->push_back(now);
      }
    }
    for (int d = 0; d < kDecode; ++d) {
      const std::vector<float>& l = out.back();
      const int32_t next = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      EXPECT_TRUE(ctx.Eval(std::vector<int32_t>{next}, false).ok());
      out.emplace_back(ctx.logits(), ctx.logits() + hp.n_vocab);
    }
    return out;
  };

  // The in-memory sparse FFN (oracle) under the same batched-prefill rule.
  SparseFfnOptions so;
  so.mode = SparseMode::kOracle;
  so.batched_prefill_min_tokens = kMinTokens;
  auto sparse = SparseFfn::Create(**model, nullptr, so, &pool);
  ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
  RoutingRecorder recorder(sparse->get(), hp.n_layers);
  InferenceContext ref_ctx(**model, &pool, 0);
  ref_ctx.SetFfnBackend(sparse->get());
  std::vector<Routed> chunk_routing;
  const std::vector<std::vector<float>> ref = run(ref_ctx, &recorder, &chunk_routing);
  ASSERT_EQ(chunk_routing.size(), 2u);
  if (type == "f32") {
    InferenceContext dense(**model, &pool, 0);
    const std::vector<std::vector<float>> d = run(dense, nullptr, nullptr);
    for (int64_t t = 0; t < kPromptTokens; ++t) {
      float worst = 0, scale = 0;
      for (int64_t i = 0; i < hp.n_vocab; ++i) {
        worst = std::max(worst, std::fabs(d[t][i] - ref[t][i]));
        scale = std::max(scale, std::fabs(d[t][i]));
      }
      ASSERT_LE(worst, 1e-4f * std::max(1.0f, scale)) << "prompt position " << t;
    }
  }

  // Every prompt position's logits, and every greedy step's after it, bitwise the in-memory run's.
  auto expect_reference = [&](const std::vector<std::vector<float>>& got) {
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(got[i].data(), ref[i].data(), sizeof(float) * got[i].size()))
          << (static_cast<int64_t>(i) < kPromptTokens ? "prompt position " : "decode step ")
          << (static_cast<int64_t>(i) < kPromptTokens ? i : i - kPromptTokens);
    }
  };
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    SCOPED_TRACE(OffloadModeName(mode));
    SparseRuntimeOptions o = SmallCaches(mode);
    o.batched_prefill = true;
    o.batched_prefill_min_tokens = kMinTokens;
    o.max_batch = kMaxBatch;
    auto rt = SparseRuntime::Open(Deploy(type), o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_TRUE((*rt)->ffn().batched_prefill());
    InferenceContext& ctx = (*rt)->context();
    // Expected passes and bytes: every (chunk, layer, expert) with at least kMinTokens tokens reads its whole region.
    int64_t passes = 0;
    uint64_t bytes = 0;
    for (const Routed& r : chunk_routing) {
      for (const auto& [key, n] : r) {
        if (n < kMinTokens) continue;
        ++passes;
        bytes += (*rt)->deployment().Region(key.first, key.second)->size;
      }
    }
    ASSERT_GT(passes, 0) << "the prompt should give some expert " << kMinTokens << " tokens of a chunk";
    const uint64_t state_before = ctx.state_bytes();
    ASSERT_NO_FATAL_FAILURE(expect_reference(run(ctx, nullptr, nullptr)));
    const OffloadPrefillStats& ps = (*rt)->ffn().prefill_stats();
    EXPECT_EQ(ps.layers, passes);
    // Besides, regions read ahead for a pass that did not come (a wrong guess for the next layer), counted apart.
    EXPECT_EQ(ps.bytes_read, bytes + ps.dropped_bytes);
    if (mode == OffloadMode::kLlmFlash) {
      EXPECT_EQ(ps.prefetch_hits, 0);  // no read ahead without the I/O thread
      EXPECT_EQ(ps.prefetch_dropped, 0);
    } else {
      // Expected from the router's choices: within a layer each batched expert after the first was read ahead by the
      // one before; after a layer's last one the next layer's region of the same expert as its first is read ahead,
      // used iff that layer's first batched expert is that one, else dropped (at the next batched pass, or at decode).
      // Token-by-token experts in between wait for a read-ahead instead of dropping it.
      int64_t hits = 0, dropped = 0;
      std::pair<int64_t, int64_t> guess{-1, -1};
      for (const Routed& r : chunk_routing) {
        std::map<int64_t, std::vector<int64_t>> batched;  // layer -> its batched experts, ascending
        for (const auto& [key, n] : r) {
          if (n >= kMinTokens) batched[key.first].push_back(key.second);
        }
        for (const auto& [layer, experts] : batched) {
          if (guess.first >= 0) {
            ++(guess == std::make_pair(layer, experts.front()) ? hits : dropped);
            guess = {-1, -1};
          }
          hits += static_cast<int64_t>(experts.size()) - 1;
          if (layer + 1 < hp.n_layers) guess = {layer + 1, experts.front()};
        }
      }
      if (guess.first >= 0) ++dropped;
      EXPECT_EQ(ps.prefetch_hits, hits);
      EXPECT_EQ(ps.prefetch_dropped, dropped);
      EXPECT_GT(ps.prefetch_hits, 0) << "no expert region was read ahead";
    }
    // Nothing grew but the logits of every prompt position, which the caller asked for (the runtime reserved one
    // token's).
    EXPECT_EQ(ctx.state_bytes(),
              state_before + static_cast<uint64_t>((kPromptTokens - 1) * hp.n_vocab) * sizeof(float));
  }

  // The buffers in lent cold slots (as under a memory budget) with a cold region only 2 slots larger than they need:
  // an expert with too few tokens runs on the token path inside the batch, and its misses take the slots back
  // instead of failing ("no cold slot and no staging left": found by a run of flag combinations,
  // /work/notes/run49/config_matrix2.py). Still bitwise the in-memory run; decode ends with nothing lent. F32 only:
  // its buffers take more slots than an expert has neurons, so the region has no staging beside it; the quantized
  // models' buffers are smaller than an expert's region, and the staging they leave holds any expert's misses.
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    if (type != "f32") break;
    SCOPED_TRACE(std::string(OffloadModeName(mode)) + ", buffers in lent cold slots");
    SparseRuntimeOptions o = SmallCaches(mode);
    o.batched_prefill = true;
    o.prefill_in_cache = true;
    o.batched_prefill_min_tokens = kMinTokens;
    o.max_batch = kMaxBatch;
    o.lookahead_slots = -1;
    auto probe = SparseRuntime::Open(Deploy(type), o, &pool);
    ASSERT_TRUE(probe.ok()) << probe.status().ToString();
    const uint64_t stride = (*probe)->ffn().cache().cold().slot_stride();
    ASSERT_GT(stride, 0u);
    const auto lent = static_cast<int64_t>((OffloadFfn::PrefillBufferBytes((*probe)->deployment()) + stride - 1) / stride);
    ASSERT_GT(lent, hp.n_ff) << "the case needs no staging beside the cold region";
    o.cold_slots = lent + 2;
    auto rt = SparseRuntime::Open(Deploy(type), o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_TRUE((*rt)->ffn().prefill_in_cache());
    ASSERT_EQ((*rt)->ffn().cache().cold().SlotCount(), lent + 2);
    ASSERT_NO_FATAL_FAILURE(expect_reference(run((*rt)->context(), nullptr, nullptr)));
    EXPECT_GT((*rt)->ffn().prefill_stats().layers, 0);
    EXPECT_EQ((*rt)->ffn().cache().cold().lent_count(), 0);
  }
}

// MoE predictors (issue 6: "only selected experts' neurons are predicted"): train-predictor fits one predictor per
// (layer, expert) on the tokens the router sent there (file: blk.L.exp.E.*), pack ships it, and the offloaded runtime
// in predictor mode equals the in-memory sparse FFN with the same predictor bit for bit, predicting and reading only in
// the experts the router picked. Recall is checked on held-out text the trainer never saw.
// On the F32 model (one weight type is enough: the predictor sees the same FFN inputs).
TEST_F(OffloadMoeTest, PerExpertPredictorsPredictOnlyRoutedExpertsAndOffloadEqualsInMemory) {
  const std::string type = "f32";
  const std::string pred = dir_->File("moe.pred.gguf"), deploy = dir_->File("moe-pred-deploy");
  auto r = testing::RunCommand(Nflash() + " -q train-predictor -m " + ModelPath(type) + " -f " +
                               testing::SharedPath("text/tinystories_calib.txt") + " --tokens 3000 --method lowrank " +
                               "--ranks 16,32 --recall 0.98 --eval-text " +
                               testing::SharedPath("text/tinystories_cased_197K.txt") + " --eval-tokens 1000 -t 2 -o " +
                               pred);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = testing::RunCommand(Nflash() + " -q pack -m " + ModelPath(type) + " -p " + dir_->File(type + ".prof") +
                          " --predictor " + pred + " -o " + deploy);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  auto predictor = Predictor::Load(pred);
  ASSERT_TRUE(predictor.ok()) << predictor.status().ToString();
  ASSERT_EQ((*predictor)->n_experts(), kExperts);
  ASSERT_EQ((*predictor)->n_layers(), kLayers);
  ASSERT_EQ((*predictor)->n_groups(), kLayers * kExperts);
  int64_t measured = 0;
  for (int64_t g = 0; g < kLayers * kExperts; ++g) {
    const PredictorLayerInfo& info = (*predictor)->info(g);
    EXPECT_GE(info.recall, 0.98f) << "group " << g;  // the threshold was set on this validation split
    if (info.eval_recall >= 0) {  // an expert the held-out text reached
      ++measured;
      EXPECT_GE(info.eval_recall, 0.9f) << "group " << g;
      EXPECT_LT(info.eval_predicted_fraction, 3 * info.eval_true_fraction + 0.05f) << "group " << g;
    }
  }
  EXPECT_GT(measured, kLayers * kExperts / 2);

  ThreadPool pool(2);
  auto model = nflash::Model::Load(ModelPath(type), LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  auto ref = SparseReference(**model, predictor->get(), &pool);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    SparseRuntimeOptions o = Options(v);
    o.active_set = ActiveSetSource::kPredictor;
    o.batched_prefill = false;  // the reference ran the prompt through the predictor too
    auto rt = SparseRuntime::Open(deploy, o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_NE((*rt)->predictor(), nullptr);
    OffloadFfn& ffn = (*rt)->ffn();
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    if (SiblingsRead(v)) {
      // The prompt runs token by token, but its experts' inputs are different tokens: nothing is read for a sibling
      // there (a set predicted from another token's input would be read for nothing).
      EXPECT_EQ(ffn.TotalStats().prefetched, 0);
    }
    std::vector<OffloadGroupStats> before = ffn.stats();
    int64_t read_ahead = 0;
    EventTrace trace;  // the decode's I/O streams
    ffn.SetEventTrace(&trace);
    const int64_t prefetch_requests0 = ffn.TotalStats().prefetch_requests;
    for (int i = 0; i < kGenerate; ++i) {
      const float* l = ctx.logits();
      ASSERT_TRUE(std::equal(l, l + hp.n_vocab, ref->logits[static_cast<size_t>(i)].begin()))
          << "logits differ from the in-memory sparse FFN with the same predictor at step " << i;
      ASSERT_TRUE(ctx.Eval(std::vector<int32_t>{ref->tokens[static_cast<size_t>(i)]}, false).ok());
      const std::vector<OffloadGroupStats>& now = ffn.stats();
      for (int64_t layer = 0; layer < hp.n_layers; ++layer) {
        for (int64_t e = 0; e < kExperts; ++e) {
          const size_t g = static_cast<size_t>(layer * kExperts + e);
          const bool selected = ref->routing[static_cast<size_t>(i)][static_cast<size_t>(layer)].count(e) > 0;
          // Predicted (active counts the predictor's set) and read only where the router sent the token.
          EXPECT_EQ(now[g].active > before[g].active || now[g].tokens > before[g].tokens, selected)
              << "step " << i << " layer " << layer << " expert " << e;
          if (!selected) {  // demand reads only there (the lookahead's are counted apart)
            EXPECT_EQ(now[g].bytes_read - before[g].bytes_read, now[g].prefetch_bytes - before[g].prefetch_bytes);
          }
          if (SiblingsRead(v)) {  // the predicted set, read for the expert that uses it, all of it used
            EXPECT_EQ(now[g].prefetch_used - before[g].prefetch_used, now[g].prefetched - before[g].prefetched);
            if (!selected) {
              EXPECT_EQ(now[g].bytes_read, before[g].bytes_read);
            }
          }
          read_ahead += now[g].prefetched - before[g].prefetched;
        }
      }
      before = now;
    }
    EXPECT_GT(ffn.TotalStats().bytes_read, 0u);
    if (v.mode == OffloadMode::kFull && v.siblings) {
      EXPECT_GT(read_ahead, 0);
    } else {
      EXPECT_EQ(read_ahead, 0) << "no read-ahead asked for";
    }
    // No read was retried: each set waited for its own chunks (a bundle used before it arrived fails its checksum).
    EXPECT_EQ(ffn.TotalStats().retries, 0);
    // A layer's reads ahead (its siblings' sets, or the next layer's guessed experts' sets) go to the I/O thread as
    // one stream, never a stream per expert (the I/O thread reads one to its end before it starts the next).
    const int64_t prefetch_requests = ffn.TotalStats().prefetch_requests - prefetch_requests0;
    rt->reset();  // joins the I/O thread: every stream's span is in
    const Streams streams = ExpertReadAheadStreams(trace);
    EXPECT_EQ(streams.requests, prefetch_requests);
    // Siblings: at most one stream per layer and step; next-layer guesses: only layer 1 is guessed (from layer 0),
    // for its 2 likeliest experts, in one stream per step.
    EXPECT_LE(streams.count, kGenerate * (v.lookahead_slots > 0 ? kLayers - 1 : kLayers))
        << "more than one stream of reads ahead per layer and step";
  }
  // A token that fails at a layer's first routed expert, after its sibling's set was predicted and read ahead: the
  // runtime stays usable (issue 6: no silent wrong output). Layer 0's first routed expert in the first decode step
  // has a bit flipped in its region for good; the step fails naming it. Every pinned slot is released; with the faults
  // cleared the same runtime runs the prompt and the decode again bitwise equal to the in-memory sparse FFN (no set
  // predicted for the failed token's sibling is taken by a later step).
  {
    SCOPED_TRACE("a failed token, then the same runtime again");
    FaultInjectingFile* fi = nullptr;
    SparseRuntimeOptions o = Options(kVariants[1]);  // sibling read-ahead
    o.active_set = ActiveSetSource::kPredictor;
    o.batched_prefill = false;
    o.wrap_flash = WrapWithFaults(&fi);
    auto rt = SparseRuntime::Open(deploy, o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_NE(fi, nullptr);
    OffloadFfn& ffn = (*rt)->ffn();
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    const std::set<int64_t>& routed = ref->routing.at(0).at(0);
    ASSERT_EQ(routed.size(), 2u);
    const int64_t first = *routed.begin(), sibling = *std::next(routed.begin());
    const packer::RegionInfo* region = (*rt)->deployment().Region(0, first);
    ASSERT_NE(region, nullptr);
    fi->AddRule({FaultInjectingFile::Fault::kBitFlip, region->offset, region->size, -1});
    const OffloadGroupStats own = ffn.stats()[static_cast<size_t>(first)];
    const OffloadGroupStats sib = ffn.stats()[static_cast<size_t>(sibling)];
    const Status s = ctx.Eval(std::vector<int32_t>{ref->tokens[0]}, false);
    ASSERT_FALSE(s.ok()) << "the fault was not reached";
    EXPECT_NE(s.message().find("layer 0 expert " + std::to_string(first) + " neuron "), std::string::npos)
        << s.message();
    ASSERT_GT(ffn.stats()[static_cast<size_t>(first)].requests, own.requests) << "the first expert read nothing";
    ASSERT_GT(ffn.stats()[static_cast<size_t>(sibling)].prefetched, sib.prefetched)
        << "nothing was read ahead for the sibling before the failure";
    for (const SlotRegion* r : {&ffn.cache().cold(), &ffn.cache().hot()}) {
      for (int32_t slot = 0; slot < r->SlotCount(); ++slot) ASSERT_EQ(r->PinCount(slot), 0) << "slot " << slot;
    }
    fi->ClearFaults();
    ctx.Reset();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    for (int i = 0; i < kGenerate; ++i) {
      const float* l = ctx.logits();
      ASSERT_TRUE(std::equal(l, l + hp.n_vocab, ref->logits[static_cast<size_t>(i)].begin()))
          << "logits differ from the in-memory sparse FFN after the failed token, step " << i;
      ASSERT_TRUE(ctx.Eval(std::vector<int32_t>{ref->tokens[static_cast<size_t>(i)]}, false).ok());
    }
  }
  // The CLI agrees: offload in predictor mode prints the in-memory predictor run's text.
  const std::string common = " -p \"" + std::string(kPromptText) + "\" -n 24 -t 1 --json";
  const std::string in_memory = JsonText(Nflash() + " -q run -m " + ModelPath(type) +
                                         " --temp 0 --sparse predictor --predictor " + pred + common);
  ASSERT_GT(in_memory.size(), std::string(kPromptText).size());
  // The default (the sibling read-ahead, named in the JSON and reading ahead), and without it.
  for (const char* flag : {"", " --no-sibling-readahead"}) {
    SCOPED_TRACE(*flag ? flag : "default");
    const nlohmann::json j = JsonOf(Nflash() + " -q offload -d " + deploy +
                                    " --active-set predictor --hot-slots 2 --cold-slots 48 --token-prefill" + flag +
                                    common);
    EXPECT_EQ(j.value("text", std::string()), in_memory);
    const bool on = *flag == '\0';
    ASSERT_TRUE(j.contains("sibling_readahead") && j.contains("prefetched_per_token")) << j.dump();
    EXPECT_EQ(j["sibling_readahead"].get<bool>(), on);
    EXPECT_EQ(j["prefetched_per_token"].get<double>() > 0, on);
  }
}

// Faults in a sibling's read-ahead (issue 6: "retried once, then a clear error naming layer/neuron/offset"): in the
// first decode step some layer's second routed expert has its misses read at the layer's first (found by a run
// without faults; runs are deterministic); bits flipped in that expert's region once are retried and the step's
// logits still equal the in-memory sparse FFN's; flipped for good, the step fails with an error naming that layer,
// expert, a neuron and its ffn.bin offset.
TEST_F(OffloadMoeTest, FaultsInASiblingsReadAheadAreRetriedOnceThenReported) {
  ThreadPool pool(2);
  auto model = nflash::Model::Load(ModelPath("f32"), LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto ref = SparseReference(**model, nullptr, &pool);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  int64_t group = -1;
  {
    auto probe = SparseRuntime::Open(Deploy("f32"), Options(kVariants[1]), &pool);
    ASSERT_TRUE(probe.ok()) << probe.status().ToString();
    ASSERT_TRUE((*probe)->context().Eval(kPrompt, false).ok());
    const std::vector<OffloadGroupStats> before = (*probe)->ffn().stats();
    ASSERT_TRUE((*probe)->context().Eval(std::vector<int32_t>{ref->tokens[0]}, false).ok());
    for (size_t g = 0; g < before.size() && group < 0; ++g) {
      if ((*probe)->ffn().stats()[g].prefetched > before[g].prefetched) group = static_cast<int64_t>(g);
    }
  }
  ASSERT_GE(group, 0) << "the first decode step read nothing ahead";
  const int64_t layer = group / kExperts, second = group % kExperts;
  const std::set<int64_t>& routed = ref->routing.at(0).at(static_cast<size_t>(layer));
  ASSERT_EQ(routed.size(), 2u);
  ASSERT_EQ(*std::next(routed.begin()), second) << "read ahead for the layer's second routed expert";
  for (int count : {1, -1}) {
    SCOPED_TRACE(count == 1 ? "flipped once" : "flipped for good");
    FaultInjectingFile* fi = nullptr;
    SparseRuntimeOptions o = Options(kVariants[1]);  // sibling read-ahead
    o.wrap_flash = WrapWithFaults(&fi);
    auto rt = SparseRuntime::Open(Deploy("f32"), o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_NE(fi, nullptr);
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    OffloadFfn& ffn = (*rt)->ffn();
    const OffloadGroupStats before = ffn.stats()[static_cast<size_t>(group)];
    const packer::RegionInfo* region = (*rt)->deployment().Region(layer, second);
    ASSERT_NE(region, nullptr);
    fi->AddRule({FaultInjectingFile::Fault::kBitFlip, region->offset, region->size, count});
    const Status s = ctx.Eval(std::vector<int32_t>{ref->tokens[0]}, false);
    const OffloadGroupStats& now = ffn.stats()[static_cast<size_t>(group)];
    ASSERT_GT(now.prefetched, before.prefetched) << "the step read nothing ahead for the second expert";
    EXPECT_GE(fi->InjectedCount(), 1);
    if (count == 1) {
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(now.retries - before.retries, 1);
      const float* l = ctx.logits();
      EXPECT_TRUE(std::equal(l, l + (*model)->hparams().n_vocab, ref->logits.at(1).begin()))
          << "logits after a retried read differ from the in-memory sparse FFN";
    } else {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find("layer " + std::to_string(layer) + " expert " + std::to_string(second) + " neuron "),
                std::string::npos)
          << s.message();
      EXPECT_NE(s.message().find("ffn.bin offset"), std::string::npos) << s.message();
      EXPECT_EQ(now.retries - before.retries, 1) << "retried once, then reported";
    }
  }
}

// A wider routing (8 experts, top 4: three siblings per layer) in oracle mode: the siblings' sets of a layer are read
// as one I/O stream (the I/O thread reads a submission to its end before the next, so a stream per sibling would keep
// one expert's reads in flight at a time), each set waits for its own chunks (no read retried in a fault-free run:
// a bundle used before it arrived fails its checksum and is read again), and the logits equal the in-memory sparse
// FFN's at every step.
TEST_F(OffloadMoeTest, WiderRoutingReadsALayersSiblingsInOneStream) {
  const std::string model_path = dir_->File("top4.gguf"), deploy = dir_->File("top4-deploy");
  const std::string failed = MakeTop4Deployment("top4", "", 2000);
  ASSERT_EQ(failed, "") << failed;

  ThreadPool pool(2);
  auto model = nflash::Model::Load(model_path, LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ASSERT_EQ(hp.n_experts_used, 4);
  auto ref = SparseReference(**model, nullptr, &pool);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  auto rt = SparseRuntime::Open(deploy, Options(kVariants[1]), &pool);  // sibling read-ahead
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  OffloadFfn& ffn = (*rt)->ffn();
  ASSERT_TRUE(ffn.sibling_readahead());
  InferenceContext& ctx = (*rt)->context();
  ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
  EventTrace trace;
  ffn.SetEventTrace(&trace);
  const OffloadGroupStats before = ffn.TotalStats();
  for (int i = 0; i < kGenerate; ++i) {
    const float* l = ctx.logits();
    ASSERT_TRUE(std::equal(l, l + hp.n_vocab, ref->logits[static_cast<size_t>(i)].begin()))
        << "logits differ from the in-memory sparse FFN at step " << i;
    ASSERT_TRUE(ctx.Eval(std::vector<int32_t>{ref->tokens[static_cast<size_t>(i)]}, false).ok());
  }
  const OffloadGroupStats after = ffn.TotalStats();
  EXPECT_GT(after.prefetched - before.prefetched, 0) << "nothing was read ahead for a sibling";
  EXPECT_EQ(after.prefetch_used - before.prefetch_used, after.prefetched - before.prefetched);
  EXPECT_EQ(after.retries, 0) << "a sibling's bundle was used before it arrived";
  const int64_t prefetch_requests = after.prefetch_requests - before.prefetch_requests;
  rt->reset();  // joins the I/O thread: every stream's span is in
  const Streams streams = ExpertReadAheadStreams(trace);
  EXPECT_EQ(streams.requests, prefetch_requests);
  EXPECT_GT(streams.count, 0);
  EXPECT_LE(streams.count, kGenerate * kLayers) << "more than one stream of siblings' reads per layer and step";
}

// One cold pool shared by every expert holds the misses of whichever expert runs, with no staging beside it when it
// has n_ff slots or more. The siblings' reads ahead take up to half of it each: an expert whose own set was cut at
// half the pool then needs slots that a later sibling's set holds. Those sets give way (settled: their bundles stay
// cached, first in line for eviction). Before, the expert found neither slot nor staging: an internal error
// (SYNTHETIC qwen3-30b-a3b, 8 layers, 1200M, --hot-fraction 1). Here: nearly every neuron active (sparsity 0.02),
// a pool of 400 slots for 384-neuron experts, and half the experts pinned whole in the hot region, so that the
// first routed expert often pins no cold slot and leaves the whole pool to its siblings' sets.
TEST_F(OffloadMoeTest, SiblingsSetsGiveWayToAnExpertsMisses) {
  const std::string model_path = dir_->File("dense-ish.gguf"), deploy = dir_->File("dense-ish-deploy");
  const std::string failed = MakeTop4Deployment("dense-ish", " --sparsity 0.02", 500);
  ASSERT_EQ(failed, "") << failed;

  ThreadPool pool(2);
  auto model = nflash::Model::Load(model_path, LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  auto ref = SparseReference(**model, nullptr, &pool);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  // The siblings' sets, and the next layer's guessed experts' sets (--lookahead 16: the same overflow, found by a
  // run of flag combinations, /work/notes/run48/config_matrix.py).
  for (const Variant* v : {&kVariants[1], &kVariants[0]}) {
    SCOPED_TRACE(v->name);
    SparseRuntimeOptions o = Options(*v);
    o.hot_policy = HotPolicy::kPinned;
    o.hot_slots = 0;
    o.hot_slots_per_group.assign(static_cast<size_t>(hp.n_layers * hp.n_experts), 0);
    for (size_t g = 0; g < o.hot_slots_per_group.size(); g += 2) o.hot_slots_per_group[g] = 1 << 20;  // capped
    o.cold_slots = 400;
    auto rt = SparseRuntime::Open(deploy, o, &pool);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    OffloadFfn& ffn = (*rt)->ffn();
    ASSERT_EQ(ffn.sibling_readahead(), SiblingsRead(*v));
    ASSERT_EQ(ffn.cache().cold().SlotCount(), 400) << "no staging: the pool holds an expert's misses";
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    const OffloadGroupStats before = ffn.TotalStats();
    for (int i = 0; i < kGenerate; ++i) {
      const float* l = ctx.logits();
      ASSERT_TRUE(std::equal(l, l + hp.n_vocab, ref->logits[static_cast<size_t>(i)].begin()))
          << "logits differ from the in-memory sparse FFN at step " << i;
      const Status st = ctx.Eval(std::vector<int32_t>{ref->tokens[static_cast<size_t>(i)]}, false);
      ASSERT_TRUE(st.ok()) << "step " << i << ": " << st.ToString();
    }
    const OffloadGroupStats after = ffn.TotalStats();
    EXPECT_GT(after.prefetched - before.prefetched, 0) << "nothing was read ahead";
    if (SiblingsRead(*v)) {  // (a guess's sets are also left unused when it guessed wrong)
      EXPECT_LT(after.prefetch_used - before.prefetch_used, after.prefetched - before.prefetched)
          << "no sibling's set gave way: the case this test is for did not happen";
    }
    EXPECT_EQ(after.retries, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, OffloadMoeTest, ::testing::Values("f32", "q8_0", "q4_0"));

}  // namespace
}  // namespace nflash::sparse
