// Two-phase loading in the offloaded decode path (runtime/sparse/offload_two_phase.cc) on a small synthetic F32 model
// whose bundles (7680 B: gate 2560 | up 2560 | down 2560) fill one 8 KiB flash group each, with the up part straddling
// the gate page like llama-7b Q4_0's: logits bitwise equal to the in-memory SparseFfn with the same predictor for
// caches of 0 slots, a few slots and everything, both modes, two-phase on and off; bytes and requests per phase equal
// to counts made independently from the dense gate values of the predicted neurons; faults in each phase retried
// once, then reported with layer, neuron, phase and offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "converter/readers.h"
#include "converter/synth.h"
#include "packer/deployment.h"
#include "packer/pack.h"
#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/core/ffn_activation.h"
#include "runtime/core/file.h"
#include "runtime/core/kernels.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/sparse/sparse_runtime.h"
#include "tests/test_util.h"
#include "tests/unit/offload_test_util.h"

namespace nflash::sparse {
namespace {

// dim 640 in F32: every part is 2560 bytes, a bundle 7680 (> 2048, so one bundle per group), a group 8192: phase 1
// reads page 0 (gate and the first 1536 bytes of up), phase 2 page 1.
constexpr int64_t kDim = 640;
constexpr uint64_t kGroup = 8192;
constexpr uint64_t kPage = 4096;
constexpr size_t kDecode = 5;

// What a cold miss reads and a cold slot holds, counted here by hand: the bundle rounded up to the slot alignment.
uint64_t ColdBytes(uint64_t bundle, uint64_t align) { return (bundle + align - 1) / align * align; }

// Records the FFN input of every token and layer, then forwards to the in-memory sparse FFN: what the offloaded
// runtime sees too when their logits are bitwise equal.
class RecordingFfn : public FfnBackend {
 public:
  explicit RecordingFfn(FfnBackend* inner) : inner_(inner) {}
  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override {
    for (int64_t t = 0; t < x.n(); ++t) {
      inputs.push_back({layer, std::vector<float>(x.f32() + t * x.cols(), x.f32() + (t + 1) * x.cols())});
    }
    return inner_->Forward(layer, expert, x, out);
  }
  std::vector<std::pair<int64_t, std::vector<float>>> inputs;  // (layer, x) in call order

 private:
  FfnBackend* inner_;
};

// Prompt token by token (batched prefill is dense), then greedy decode; logits of every step.
Result<std::vector<std::vector<float>>> RunTokens(InferenceContext& ctx, int64_t n_vocab,
                                                  const std::vector<int32_t>& prompt) {
  std::vector<std::vector<float>> out;
  for (int32_t t : prompt) NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{t}, false));
  for (size_t i = 0; i < kDecode; ++i) {
    out.emplace_back(ctx.logits(), ctx.logits() + n_vocab);
    const int32_t next = static_cast<int32_t>(std::max_element(out.back().begin(), out.back().end()) -
                                              out.back().begin());
    NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{next}, false));
  }
  return out;
}

class OffloadTwoPhaseTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    pool_ = new ThreadPool(2);
    converter::SynthOptions so;
    so.shape = "custom";
    so.dim = kDim;
    so.ffn = 128;
    so.layers = 2;
    so.heads = 10;
    so.vocab = 260;
    so.context = 64;
    so.type = GgmlType::kF32;
    const std::string model_path = dir_->File("m.gguf");
    auto model = WriteSyntheticModel(so, model_path);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = model->release();
    const LlamaHparams& hp = model_->hparams();
    std::mt19937 rng(17);
    prompt_ = {1};
    while (prompt_.size() < 4) {
      prompt_.push_back(static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(hp.n_vocab - 3)));
    }

    // A predictor from a seed (random low-rank weights: it guesses about half the neurons, most of them with a zero
    // ReLU gate, which is what two-phase loading is for).
    ASSERT_TRUE(WriteRandomPredictor(model_path, hp, &rng, dir_->File("pred.gguf")).ok());
    auto predictor = Predictor::Load(dir_->File("pred.gguf"));
    ASSERT_TRUE(predictor.ok()) << predictor.status().ToString();
    predictor_ = predictor->release();

    // Profile from a dense run, pack with the predictor.
    profiler::ModelProfile prof = EmptyReluProfile(model_path, hp);
    {
      InferenceContext ctx(*model_, pool_, 0);
      ctx.SetFfnObserver(CountActivations(&prof, hp.n_ff));
      ASSERT_TRUE(ctx.Eval(prompt_, false).ok());
    }
    FinishCounts(&prof);
    packer::PackOptions po;
    po.hot_fraction = 0.3;
    po.progress = false;
    po.predictor_path = dir_->File("pred.gguf");
    auto packed = packer::PackDeployment(model_path, prof, "0000000000000000", DeployDir(), po, pool_);
    ASSERT_TRUE(packed.ok()) << packed.status().ToString();

    // The reference: the in-memory sparse FFN with the same predictor, every token through the sparse path.
    SparseFfnOptions sfo;
    sfo.mode = SparseMode::kPredictor;
    sfo.sparse_prefill = true;
    auto sparse = SparseFfn::Create(*model_, predictor_, sfo, pool_);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    recorded_ = new RecordingFfn(sparse->get());
    InferenceContext ctx(*model_, pool_, 0);
    ctx.SetFfnBackend(recorded_);
    auto ref = RunTokens(ctx, hp.n_vocab, prompt_);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    ref_ = new std::vector<std::vector<float>>(std::move(*ref));
    ctx.SetFfnBackend(nullptr);
    sparse_ = sparse->release();
  }
  static void TearDownTestSuite() {
    delete ref_;
    delete recorded_;
    delete sparse_;
    delete predictor_;
    delete model_;
    delete pool_;
    delete dir_;
  }
  static std::string DeployDir() { return dir_->File("deploy"); }

  // Per recorded (layer, token): the predicted set and, from the model's own gate rows (dense GEMV, not the code
  // under test), which of its neurons pass |relu(gate)| > threshold.
  struct Step {
    int64_t layer = 0;
    std::vector<int32_t> predicted;
    std::vector<uint8_t> gate_active;  // per predicted neuron
  };
  static std::vector<Step> IndependentSteps() {
    const LlamaHparams& hp = model_->hparams();
    std::vector<Step> steps;
    PredictorScratch scratch;
    predictor_->PrepareScratch(&scratch);
    std::vector<float> gate(static_cast<size_t>(hp.n_ff));
    for (const auto& [layer, xv] : recorded_->inputs) {
      Activation x(xv.data(), 1, hp.dim);
      Step s;
      s.layer = layer;
      predictor_->Predict(layer, x, 0, &scratch, &s.predicted, nullptr);
      Gemv(model_->layers()[static_cast<size_t>(layer)].gate, xv.data(), gate.data(), nullptr);
      for (int32_t n : s.predicted) {
        s.gate_active.push_back(std::max(gate[static_cast<size_t>(n)], 0.0f) > predictor_->activation_threshold(layer));
      }
      steps.push_back(std::move(s));
    }
    return steps;
  }

  // `slot_alignment`: cold slots are the bundle rounded up to it (kPage: whole groups; 512: what a disk with 512-byte
  // blocks allows, so the up+down part read in phase 2 ends before the group does).
  // `preload`: the cold region starts with the layers' first cold bundles (OffloadOptions::preload_cold); off, the
  // reads of every first use can be counted.
  static SparseRuntimeOptions Options(OffloadMode mode, bool two_phase, int64_t hot, int64_t cold, int64_t chunk,
                                      uint64_t slot_alignment = kPage, bool preload = false) {
    SparseRuntimeOptions o;
    o.preload_cold = preload;
    o.slot_alignment = slot_alignment;
    o.mode = mode;
    o.active_set = ActiveSetSource::kPredictor;
    o.batched_prefill = false;  // the reference runs the prompt through the predictor, token by token
    o.two_phase = two_phase;
    o.hot_slots = hot;
    o.cold_slots = cold;
    o.chunk_requests = chunk;
    // LRU hot region: clusters come and go, so cold neurons keep being read (two-phase applies to cold misses).
    o.hot_policy = HotPolicy::kLru;
    return o;
  }

  static void ExpectReferenceLogits(const std::vector<std::vector<float>>& got) {
    ASSERT_EQ(got.size(), ref_->size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(got[i].data(), (*ref_)[i].data(), got[i].size() * sizeof(float)))
          << "logits of decode step " << i << " differ from the in-memory sparse FFN";
    }
  }

  static testing::TempDir* dir_;
  static ThreadPool* pool_;
  static Model* model_;
  static Predictor* predictor_;
  static SparseFfn* sparse_;
  static RecordingFfn* recorded_;
  static std::vector<int32_t> prompt_;
  static std::vector<std::vector<float>>* ref_;
};
testing::TempDir* OffloadTwoPhaseTest::dir_ = nullptr;
ThreadPool* OffloadTwoPhaseTest::pool_ = nullptr;
Model* OffloadTwoPhaseTest::model_ = nullptr;
Predictor* OffloadTwoPhaseTest::predictor_ = nullptr;
SparseFfn* OffloadTwoPhaseTest::sparse_ = nullptr;
RecordingFfn* OffloadTwoPhaseTest::recorded_ = nullptr;
std::vector<int32_t> OffloadTwoPhaseTest::prompt_;
std::vector<std::vector<float>>* OffloadTwoPhaseTest::ref_ = nullptr;

TEST_F(OffloadTwoPhaseTest, LayoutAndSelection) {
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const packer::BundleLayout& lay = (*d)->layout();
  ASSERT_EQ(lay.slots_per_group, 1);
  ASSERT_EQ(lay.group_bytes, kGroup);
  ASSERT_EQ(lay.gate_bytes, static_cast<uint64_t>(kDim) * 4);
  ASSERT_GT(lay.up_offset + lay.up_bytes, kPage) << "up straddles the gate page, as in llama-7b Q4_0";
  auto on = SparseRuntime::Open(DeployDir(), Options(OffloadMode::kFull, true, 0, 0, 16), pool_);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_TRUE((*on)->ffn().two_phase());
  auto off = SparseRuntime::Open(DeployDir(), Options(OffloadMode::kFull, false, 0, 0, 16), pool_);
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->ffn().two_phase());
  // Oracle: a no-op (its active set needs every up+down part).
  SparseRuntimeOptions o = Options(OffloadMode::kFull, true, 0, 0, 16);
  o.active_set = ActiveSetSource::kOracle;
  auto oracle = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(oracle.ok());
  EXPECT_FALSE((*oracle)->ffn().two_phase());
}

// The synthetic model has its own output head, so token_embd stays on flash by default: one row read per token, the
// same logits as the in-memory sparse FFN, and the embedding's whole pages out of the resident memory.
TEST_F(OffloadTwoPhaseTest, EmbeddingRowsFromFlashGiveTheSameLogits) {
  ASSERT_TRUE(ref_);
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const GgufTensorInfo* emb = (*d)->resident().FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  ASSERT_NE((*d)->resident().FindTensor("output.weight"), nullptr);
  const uint64_t at = (*d)->resident().data_offset() + emb->offset;
  const uint64_t whole_pages = ((at + emb->n_bytes) / 4096 - (at + 4095) / 4096) * 4096;  // counted here by hand
  ASSERT_GT(whole_pages, 0u);
  uint64_t resident[2] = {0, 0};
  for (bool on_flash : {true, false}) {
    SCOPED_TRACE(on_flash ? "embedding on flash" : "embedding resident");
    SparseRuntimeOptions o = Options(OffloadMode::kFull, false, 1000, 100000, 16);
    o.embedding_on_flash = on_flash;
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_EQ((*rt)->embedding() != nullptr, on_flash);
    auto got = RunTokens((*rt)->context(), model_->hparams().n_vocab, prompt_);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ExpectReferenceLogits(*got);
    if (on_flash) {
      EXPECT_EQ((*rt)->embedding()->rows_read(), prompt_.size() + got->size()) << "one row per Eval";
    }
    resident[on_flash ? 0 : 1] = (*rt)->fixed().resident_weights;
  }
  EXPECT_EQ(resident[1], (*d)->manifest().resident_bytes);
  EXPECT_EQ(resident[1] - resident[0], whole_pages);
}

// Cold slots hold the bundle rounded up to the slot alignment, not its whole 4 KiB-aligned group: under one memory
// budget, 512-byte alignment caches more neurons (the tokens are the same: BitwiseEqualToInMemorySparseForEveryCacheSize).
TEST_F(OffloadTwoPhaseTest, SmallerSlotsCacheMoreNeuronsInTheSameBudget) {
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const uint64_t bundle = (*d)->layout().bundle_bytes;
  const uint64_t read512 = ColdBytes(bundle, 512);
  ASSERT_LT(read512, kGroup);
  SparseRuntimeOptions o = Options(OffloadMode::kFull, false, 0, 0, 16);
  auto probe = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(probe.ok()) << probe.status().ToString();
  o.memory_budget = (*probe)->fixed().Total() + 100 * kGroup;  // room for well under the 256 neurons
  int64_t slots[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const uint64_t align = i == 0 ? kPage : 512;
    SCOPED_TRACE("slot alignment " + std::to_string(align));
    o.slot_alignment = align;
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    EXPECT_EQ((*rt)->cold_slot_bytes(), i == 0 ? kGroup : read512);
    const CacheSplit& s = (*rt)->split();
    EXPECT_EQ(s.cold_bytes, static_cast<uint64_t>(s.cold_slots) * (*rt)->cold_slot_bytes());
    EXPECT_LE((*rt)->fixed().Total() + s.hot_bytes + s.cold_bytes, o.memory_budget);
    EXPECT_EQ((*rt)->ffn().cache().cold().SlotCount(), s.cold_slots);
    slots[i] = s.cold_slots;
  }
  EXPECT_GT(slots[1], slots[0]);
  // The same cold share of the budget holds kGroup / read512 times as many slots at 512 (rounded down).
  EXPECT_GE(slots[1], slots[0] * static_cast<int64_t>(kGroup) / static_cast<int64_t>(read512));
}

TEST_F(OffloadTwoPhaseTest, BitwiseEqualToInMemorySparseForEveryCacheSize) {
  ASSERT_TRUE(ref_);
  struct Config {
    OffloadMode mode;
    int64_t hot, cold, chunk;
  };
  const Config configs[] = {
      {OffloadMode::kFull, 0, 0, 16},           // no cache: every predicted neuron from flash, every token
      {OffloadMode::kFull, 1, 20, 1},           // a few slots, one request per chunk (many pipeline steps)
      {OffloadMode::kFull, 1000, 100000, 4},    // everything fits: later tokens hit gate-only slots
      // 90 slots for ~130 predicted neurons per token: slots change hands and are hit, so a gate page lands in slots
      // whose last bundle was whole, and is hit later (a hit must not take that bundle's up+down part for its own).
      {OffloadMode::kFull, 0, 90, 4},
      {OffloadMode::kLlmFlash, 0, 90, 16},
      {OffloadMode::kLlmFlash, 0, 0, 16},
      {OffloadMode::kLlmFlash, 1, 20, 16},
      {OffloadMode::kLlmFlash, 1000, 100000, 16},
  };
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const uint64_t bundle = (*d)->layout().bundle_bytes;
  for (const Config& c : configs) {
    for (auto [two_phase, align, preload] :
         {std::tuple{true, kPage, false}, std::tuple{false, kPage, false}, std::tuple{true, uint64_t{512}, false},
          std::tuple{false, uint64_t{512}, false}, std::tuple{true, kPage, true},
          std::tuple{true, uint64_t{512}, true}}) {
      SCOPED_TRACE(std::string(OffloadModeName(c.mode)) + " hot " + std::to_string(c.hot) + " cold " +
                   std::to_string(c.cold) + " chunk " + std::to_string(c.chunk) + " two-phase " +
                   (two_phase ? "on" : "off") + " slot alignment " + std::to_string(align) +
                   (preload ? " preloaded" : ""));
      auto rt = SparseRuntime::Open(DeployDir(), Options(c.mode, two_phase, c.hot, c.cold, c.chunk, align, preload),
                                    pool_);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      ASSERT_EQ((*rt)->ffn().two_phase(), two_phase);
      // Preloaded whole bundles and gate pages read later share the slots: the results must not change.
      EXPECT_EQ((*rt)->ffn().preloaded_bundles() > 0, preload && c.cold > 0);
      auto got = RunTokens((*rt)->context(), model_->hparams().n_vocab, prompt_);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ExpectReferenceLogits(*got);
      const OffloadGroupStats st = (*rt)->ffn().TotalStats();
      EXPECT_EQ(st.retries, 0);
      if (preload) continue;  // what is read then depends on what the preload holds
      if (two_phase) {
        EXPECT_GT(st.gate_requests, 0);
        EXPECT_GT(st.updown_requests, 0);
        EXPECT_GT(st.updown_skipped, 0) << "the random predictor guesses many neurons whose ReLU gate is 0";
        EXPECT_EQ(st.gate_bytes, static_cast<uint64_t>(st.gate_requests) * kPage);
        // Phase 2 reads from the page after the gate's to the bundle's end rounded up to the alignment.
        const uint64_t read = ColdBytes(bundle, align);
        ASSERT_LE(read, kGroup);
        EXPECT_EQ(st.updown_bytes, static_cast<uint64_t>(st.updown_requests) * (read - kPage));
      } else {
        EXPECT_EQ(st.gate_requests + st.updown_requests + st.updown_skipped, 0);
      }
    }
  }
}

TEST_F(OffloadTwoPhaseTest, BytesReadMatchAnIndependentCount) {
  ASSERT_TRUE(ref_);
  const std::vector<Step> steps = IndependentSteps();
  ASSERT_FALSE(steps.empty());
  // No cache (hot neurons take the cold path too): every predicted neuron reads its gate page, every one whose dense
  // gate passes also its up+down part, every token.
  int64_t predicted = 0, active = 0;
  // Everything cached: each (layer, neuron) reads its gate page once, and its up+down part once, the first time its
  // gate passes (possibly tokens later, as a hit on a gate-only slot).
  std::set<std::pair<int64_t, int32_t>> seen, completed;
  for (const Step& s : steps) {
    predicted += static_cast<int64_t>(s.predicted.size());
    for (size_t i = 0; i < s.predicted.size(); ++i) {
      active += s.gate_active[i];
      seen.insert({s.layer, s.predicted[i]});
      if (s.gate_active[i]) completed.insert({s.layer, s.predicted[i]});
    }
  }
  ASSERT_GT(active, 0);
  ASSERT_LT(active, predicted);
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const uint64_t bundle = (*d)->layout().bundle_bytes;
  for (auto [mode, align] : {std::pair{OffloadMode::kFull, kPage}, std::pair{OffloadMode::kLlmFlash, kPage},
                             std::pair{OffloadMode::kFull, uint64_t{512}}, std::pair{OffloadMode::kLlmFlash, uint64_t{512}}}) {
    SCOPED_TRACE(std::string(OffloadModeName(mode)) + " slot alignment " + std::to_string(align));
    // A cold read: the bundle rounded up to the alignment (the whole group at kPage).
    const uint64_t read = ColdBytes(bundle, align);
    ASSERT_EQ(read == kGroup, align == kPage) << "a bundle of " << bundle << " bytes leaves a tail to skip at 512";
    {
      auto rt = SparseRuntime::Open(DeployDir(), Options(mode, true, 0, 0, 16, align), pool_);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      ASSERT_TRUE(RunTokens((*rt)->context(), model_->hparams().n_vocab, prompt_).ok());
      const OffloadGroupStats st = (*rt)->ffn().TotalStats();
      EXPECT_EQ(st.active, predicted);
      EXPECT_EQ(st.gate_requests, predicted);
      EXPECT_EQ(st.updown_requests, active);
      EXPECT_EQ(st.updown_skipped, predicted - active);
      EXPECT_EQ(st.requests, predicted + active);
      EXPECT_EQ(st.bytes_read,
                static_cast<uint64_t>(predicted) * kPage + static_cast<uint64_t>(active) * (read - kPage));
      // Whole-bundle reads for comparison: one read per predicted neuron (without merges across the unread tails).
      SparseRuntimeOptions o = Options(mode, false, 0, 0, 16, align);
      o.scatter_reads = false;
      auto whole = SparseRuntime::Open(DeployDir(), o, pool_);
      ASSERT_TRUE(whole.ok());
      ASSERT_TRUE(RunTokens((*whole)->context(), model_->hparams().n_vocab, prompt_).ok());
      EXPECT_EQ((*whole)->ffn().TotalStats().bytes_read, static_cast<uint64_t>(predicted) * read);
      // Flash neighbours merged into scattered reads: the tail between two of them is read too (into a sink).
      auto merged = SparseRuntime::Open(DeployDir(), Options(mode, false, 0, 0, 16, align), pool_);
      ASSERT_TRUE(merged.ok());
      ASSERT_TRUE(RunTokens((*merged)->context(), model_->hparams().n_vocab, prompt_).ok());
      const OffloadGroupStats ms = (*merged)->ffn().TotalStats();
      EXPECT_GE(ms.bytes_read, static_cast<uint64_t>(predicted) * read);
      EXPECT_LE(ms.bytes_read, static_cast<uint64_t>(predicted) * kGroup);
      EXPECT_EQ(ms.bytes_read - static_cast<uint64_t>(predicted) * read,
                static_cast<uint64_t>(predicted - ms.requests) * (kGroup - read))
          << "each merge of two neighbours reads one tail";
    }
    {
      auto rt = SparseRuntime::Open(DeployDir(), Options(mode, true, 0, 100000, 16, align), pool_);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      ASSERT_TRUE(RunTokens((*rt)->context(), model_->hparams().n_vocab, prompt_).ok());
      const OffloadGroupStats st = (*rt)->ffn().TotalStats();
      EXPECT_EQ(st.gate_requests, static_cast<int64_t>(seen.size()));
      EXPECT_EQ(st.updown_requests, static_cast<int64_t>(completed.size()));
      EXPECT_EQ((*rt)->ffn().cache().cold().TotalCounters().evictions, 0u);
    }
  }
}

// The ffn.bin offset of `neuron`'s group in `layer`.
uint64_t GroupOffset(const std::string& deploy_dir, int64_t layer, int32_t neuron) {
  auto d = packer::Deployment::Open(deploy_dir);
  EXPECT_TRUE(d.ok());
  const packer::RegionInfo* r = (*d)->Region(layer, -1);
  return r->offset + (*d)->layout().SlotOffset(r->slot_of_neuron[static_cast<size_t>(neuron)]);
}

Result<std::unique_ptr<SparseRuntime>> OpenWithFaults(const std::string& dir, OffloadMode mode, ThreadPool* pool,
                                                      FaultInjectingFile** fi) {
  SparseRuntimeOptions o;
  o.mode = mode;
  o.active_set = ActiveSetSource::kPredictor;
  o.batched_prefill = false;
  o.two_phase = true;
  o.cold_slots = 50;
  o.wrap_flash = WrapWithFaults(fi);
  return SparseRuntime::Open(dir, o, pool);
}

TEST_F(OffloadTwoPhaseTest, FaultsInEachPhaseAreRetriedOnceThenReported) {
  const std::vector<Step> steps = IndependentSteps();
  ASSERT_FALSE(steps.empty());
  // The first token's layer 0: its first predicted neuron (phase 1 is read for it) and its first predicted neuron
  // whose gate passes (phase 2 is read for it).
  const Step& first = steps[0];
  ASSERT_EQ(first.layer, 0);
  ASSERT_FALSE(first.predicted.empty());
  const int32_t n1 = first.predicted[0];
  int32_t n2 = -1;
  for (size_t i = 0; i < first.predicted.size() && n2 < 0; ++i) {
    if (first.gate_active[i]) n2 = first.predicted[i];
  }
  ASSERT_GE(n2, 0);
  const uint64_t g1 = GroupOffset(DeployDir(), 0, n1), g2 = GroupOffset(DeployDir(), 0, n2);
  using F = FaultInjectingFile::Fault;
  struct Case {
    const char* what;
    FaultInjectingFile::Rule rule;
  };
  // Transient: each fault once, then the file is healthy; the run gives the reference logits.
  const Case transient[] = {
      {"phase 1 EIO", {F::kEio, g1, kPage, 1}},
      {"phase 1 short read", {F::kShortRead, g1, kPage, 1}},
      {"phase 1 flipped gate bit", {F::kBitFlip, g1, kPage, 1}},
      // A flipped up byte in the gate page passes phase 1 (only the gate is checked then) and fails phase 2: the
      // retry must re-read the gate page too.
      {"phase 1 flipped up bit", {F::kBitFlip, g2 + 3000, 1, 1}},
      {"phase 2 EIO", {F::kEio, g2 + kPage, kPage, 1}},
      {"phase 2 short read", {F::kShortRead, g2 + kPage, kPage, 1}},
      {"phase 2 flipped bit", {F::kBitFlip, g2 + kPage, kPage, 1}},
  };
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    for (const Case& c : transient) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + " " + c.what);
      FaultInjectingFile* fi = nullptr;
      auto rt = OpenWithFaults(DeployDir(), mode, pool_, &fi);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      ASSERT_TRUE((*rt)->ffn().two_phase());
      fi->AddRule(c.rule);
      auto got = RunTokens((*rt)->context(), model_->hparams().n_vocab, prompt_);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(fi->InjectedCount(), 1);
      // llmflash reads one request at a time: exactly the faulty one is retried. Full mode reads chunks, and a
      // failed batch may leave the rest of its chunk unread (each retried at most once).
      if (mode == OffloadMode::kLlmFlash) {
        EXPECT_EQ((*rt)->ffn().TotalStats().retries, 1);
      } else {
        EXPECT_GE((*rt)->ffn().TotalStats().retries, 1);
        EXPECT_LE((*rt)->ffn().TotalStats().retries, 16);
      }
      ExpectReferenceLogits(*got);
    }
  }
  // Persistent: the error names layer, neuron, phase and offset.
  struct Persistent {
    const char* what;
    FaultInjectingFile::Rule rule;
    StatusCode code;
    int32_t neuron;
    const char* phase;
    uint64_t offset;
  };
  const Persistent persistent[] = {
      {"phase 1 EIO", {F::kEio, g1, kPage, -1}, StatusCode::kIOError, n1, "phase 1 (gate page)", g1},
      {"phase 1 corrupt", {F::kBitFlip, g1, kPage, -1}, StatusCode::kCorruption, n1, "phase 1 (gate page)", g1},
      {"phase 2 EIO", {F::kEio, g2 + kPage, kPage, -1}, StatusCode::kIOError, n2, "phase 2 (up+down part)", g2 + kPage},
      {"phase 2 corrupt", {F::kBitFlip, g2 + kPage, kPage, -1}, StatusCode::kCorruption, n2, "phase 2 (up+down part)",
       g2 + kPage},
  };
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    for (const Persistent& c : persistent) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + " " + c.what);
      FaultInjectingFile* fi = nullptr;
      auto rt = OpenWithFaults(DeployDir(), mode, pool_, &fi);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      fi->AddRule(c.rule);
      Status s = (*rt)->context().Eval(std::vector<int32_t>{prompt_[0]}, false);
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), c.code) << s.ToString();
      const std::string want = "layer 0 neuron " + std::to_string(c.neuron) + " " + c.phase + ": ffn.bin offset " +
                               std::to_string(c.offset);
      EXPECT_NE(s.message().find(want), std::string::npos) << s.message() << "\nwanted: " << want;
      EXPECT_EQ((*rt)->ffn().TotalStats().retries, 1) << "retried once, then reported";
      // The failed token released or abandoned every slot it pinned (none stays pinned with unknown contents).
      const SlotRegion& cold = (*rt)->ffn().cache().cold();
      for (int32_t slot = 0; slot < cold.SlotCount(); ++slot) ASSERT_EQ(cold.PinCount(slot), 0) << "slot " << slot;
    }
  }
}

}  // namespace
}  // namespace nflash::sparse
