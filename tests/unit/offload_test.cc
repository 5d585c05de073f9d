// The flash-offloaded runtime on stories260K-relu packed into a deployment: oracle decode equals the published greedy
// sample (README, checked independently of nflash) and, logit for logit, the in-memory sparse FFN, for every cache
// size and both modes; cache counters; memory-budget refusal; fault injection (EIO, flipped bits) retried once, then
// reported with layer, neuron and offset.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "converter/readers.h"
#include "packer/deployment.h"
#include "packer/pack.h"
#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/sparse/sparse_runtime.h"
#include "tests/test_util.h"
#include "tests/unit/offload_test_util.h"

namespace nflash::sparse {
namespace {

namespace fs = std::filesystem;

// models/stories260K-relu/README.md: prompt "Once upon a time" with BOS, and the first 40 of its 100 greedy tokens.
const std::vector<int32_t> kPrompt = {1, 403, 407, 261, 378};
const std::vector<int32_t> kGolden = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
                                      267, 337, 335, 311, 267, 422, 419, 269, 344, 444, 427, 421, 414, 276,
                                      265, 263, 304, 341, 426, 385, 328, 432, 358, 263, 377, 267};

struct GreedyRun {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // per generated token
};

Result<GreedyRun> Greedy(InferenceContext& ctx, int64_t n_vocab, size_t n) {
  GreedyRun r;
  NF_RETURN_IF_ERROR(ctx.Eval(kPrompt, false));
  for (size_t i = 0; i < n; ++i) {
    const float* l = ctx.logits();
    r.logits.emplace_back(l, l + n_vocab);
    const int32_t next = static_cast<int32_t>(std::max_element(l, l + n_vocab) - l);
    r.tokens.push_back(next);
    NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{next}, false));
  }
  return r;
}

// Whether every logit of `run` equals (bitwise) that of the same token of `ref`, the in-memory sparse FFN's run.
::testing::AssertionResult SameLogits(const GreedyRun& run, const GreedyRun& ref) {
  for (size_t i = 0; i < run.logits.size(); ++i) {
    if (i >= ref.logits.size() || run.logits[i].size() != ref.logits[i].size() ||
        std::memcmp(run.logits[i].data(), ref.logits[i].data(), run.logits[i].size() * sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "logits of token " << i << " differ from the in-memory sparse FFN";
    }
  }
  return ::testing::AssertionSuccess();
}

// One line of an active-set trace (OffloadFfn::SetActiveTrace): a group and its active neurons, ascending.
struct TracedStep {
  int64_t group = -1;
  std::vector<int64_t> active;
};

// Greedy for `n` tokens with every decode-path active set traced to `path`, the logits checked against `ref` (the
// in-memory sparse FFN's run); the trace read back, one step per layer and token.
Result<std::vector<TracedStep>> TracedGreedy(SparseRuntime& rt, int64_t n_vocab, size_t n, const GreedyRun& ref,
                                             const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto trace, AtomicFileWriter::Create(path, true));
  rt.ffn().SetActiveTrace(trace.get());
  auto run = Greedy(rt.context(), n_vocab, n);
  rt.ffn().SetActiveTrace(nullptr);
  NF_RETURN_IF_ERROR(run.status());
  if (!SameLogits(*run, ref)) return Status::Internal("the traced run's logits differ from the in-memory sparse FFN's");
  NF_RETURN_IF_ERROR(trace->Commit());
  std::vector<TracedStep> steps;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    TracedStep s;
    ls >> s.group;
    for (int64_t a; ls >> a;) s.active.push_back(a);
    steps.push_back(std::move(s));
  }
  return steps;
}

// A flash file whose every read takes `delay` longer: the compute thread reaches each chunk's wait before its reads
// land.
class SlowFile final : public ReadableFile {
 public:
  SlowFile(std::shared_ptr<const ReadableFile> base, std::chrono::microseconds delay)
      : base_(std::move(base)), delay_(delay) {}
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override {
    std::this_thread::sleep_for(delay_);
    return base_->ReadAt(offset, size, dst);
  }
  uint64_t Size() const override { return base_->Size(); }
  const std::string& Path() const override { return base_->Path(); }

 private:
  std::shared_ptr<const ReadableFile> base_;
  std::chrono::microseconds delay_;
};

class OffloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    pool_ = new ThreadPool(2);
    // The model as an F32 GGUF.
    const std::string model_path = dir_->File("model.gguf");
    const Status written = WriteStoriesReluF32(model_path);
    ASSERT_TRUE(written.ok()) << written.ToString();
    auto model = Model::Load(model_path, LoadOptions{});
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const LlamaHparams& hp = (*model)->hparams();

    // A profile from real activations: how often each neuron fires over the golden continuation.
    profiler::ModelProfile prof = EmptyReluProfile(model_path, hp);
    InferenceContext ctx(**model, pool_, 0);
    ctx.SetFfnObserver(CountActivations(&prof, hp.n_ff));
    auto dense = Greedy(ctx, hp.n_vocab, kGolden.size());
    ASSERT_TRUE(dense.ok()) << dense.status().ToString();
    dense_ = new GreedyRun(std::move(*dense));
    FinishCounts(&prof);

    packer::PackOptions po;
    po.hot_fraction = 0.3;  // a real hot region (the flat popularity of this model would give a tiny one)
    po.progress = false;
    auto packed = packer::PackDeployment(model_path, prof, "0000000000000000", dir_->File("deploy"), po, pool_);
    ASSERT_TRUE(packed.ok()) << packed.status().ToString();

    // A predictor (random low-rank weights from a seed: what it predicts does not matter here, only that both
    // runtimes use the same one) shipped in a second deployment.
    std::mt19937 rng(7);
    ASSERT_TRUE(WriteRandomPredictor(model_path, hp, &rng, dir_->File("pred.gguf")).ok());
    po.predictor_path = dir_->File("pred.gguf");
    packed = packer::PackDeployment(model_path, prof, "0000000000000000", dir_->File("deploy-pred"), po, pool_);
    ASSERT_TRUE(packed.ok()) << packed.status().ToString();
    auto predictor = Predictor::Load(dir_->File("pred.gguf"));
    ASSERT_TRUE(predictor.ok()) << predictor.status().ToString();
    SparseFfnOptions po2;
    po2.mode = SparseMode::kPredictor;
    po2.sparse_prefill = true;
    auto psparse = SparseFfn::Create(**model, predictor->get(), po2, pool_);
    ASSERT_TRUE(psparse.ok()) << psparse.status().ToString();
    InferenceContext pctx(**model, pool_, 0);
    pctx.SetFfnBackend(psparse->get());
    auto prun = Greedy(pctx, hp.n_vocab, 20);
    ASSERT_TRUE(prun.ok()) << prun.status().ToString();
    predicted_ = new GreedyRun(std::move(*prun));

    // The in-memory sparse FFN (oracle, prefill too) is the reference the offloaded runtime must equal exactly.
    SparseFfnOptions so;
    so.mode = SparseMode::kOracle;
    so.sparse_prefill = true;
    auto sparse = SparseFfn::Create(**model, nullptr, so, pool_);
    ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
    InferenceContext sctx(**model, pool_, 0);
    sctx.SetFfnBackend(sparse->get());
    auto sparse_run = Greedy(sctx, hp.n_vocab, kGolden.size());
    ASSERT_TRUE(sparse_run.ok()) << sparse_run.status().ToString();
    sparse_ = new GreedyRun(std::move(*sparse_run));
    n_vocab_ = hp.n_vocab;
  }
  static void TearDownTestSuite() {
    delete predicted_;
    delete sparse_;
    delete dense_;
    delete pool_;
    delete dir_;
  }
  static std::string DeployDir() { return dir_->File("deploy"); }

  static Result<std::unique_ptr<SparseRuntime>> Open(const SparseRuntimeOptions& o) {
    return SparseRuntime::Open(DeployDir(), o, pool_);
  }

  static testing::TempDir* dir_;
  static ThreadPool* pool_;
  static GreedyRun* dense_;
  static GreedyRun* sparse_;
  static GreedyRun* predicted_;
  static int64_t n_vocab_;
};
testing::TempDir* OffloadTest::dir_ = nullptr;
ThreadPool* OffloadTest::pool_ = nullptr;
GreedyRun* OffloadTest::dense_ = nullptr;
GreedyRun* OffloadTest::sparse_ = nullptr;
GreedyRun* OffloadTest::predicted_ = nullptr;
int64_t OffloadTest::n_vocab_ = 0;

TEST_F(OffloadTest, ReferencesMatchThePublishedSample) {
  ASSERT_TRUE(dense_ && sparse_);
  EXPECT_EQ(dense_->tokens, kGolden);
  EXPECT_EQ(sparse_->tokens, kGolden);
}

TEST_F(OffloadTest, OracleEqualsInMemorySparseForEveryCacheSize) {
  ASSERT_TRUE(sparse_);
  struct Config {
    OffloadMode mode;
    int64_t hot, cold, chunk;
    HotPolicy policy = HotPolicy::kLru;
    bool scatter = true;
  };
  const Config configs[] = {
      {OffloadMode::kFull, 0, 0, 16},        // no cache: every neuron read into staging, every token
      {OffloadMode::kFull, 1, 30, 1},        // tiny cache, one request per chunk (many pipeline steps)
      {OffloadMode::kFull, 1, 30, 1, HotPolicy::kLru, false},  // the same, flash neighbours not scattered
      {OffloadMode::kFull, 1000, 100000, 64},  // everything fits
      {OffloadMode::kLlmFlash, 0, 40, 16},
      {OffloadMode::kLlmFlash, 1000, 100000, 16},
      // Pinned hot region: a few clusters per layer, the rest through a small cold LRU; and everything pinned.
      {OffloadMode::kFull, 7, 30, 4, HotPolicy::kPinned},
      {OffloadMode::kLlmFlash, 7, 30, 16, HotPolicy::kPinned},
      {OffloadMode::kFull, 1000, 0, 16, HotPolicy::kPinned},
  };
  for (const Config& c : configs) {
    SCOPED_TRACE(std::string(OffloadModeName(c.mode)) + " hot " + std::to_string(c.hot) + " cold " +
                 std::to_string(c.cold) + " chunk " + std::to_string(c.chunk) + " " + HotPolicyName(c.policy) +
                 (c.scatter ? "" : " no scatter"));
    SparseRuntimeOptions o;
    o.mode = c.mode;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_slots = c.hot;
    o.cold_slots = c.cold;
    o.chunk_requests = c.chunk;
    o.hot_policy = c.policy;
    o.scatter_reads = c.scatter;
    auto rt = Open(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto run = Greedy((*rt)->context(), n_vocab_, kGolden.size());
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    EXPECT_EQ(run->tokens, kGolden);
    ASSERT_TRUE(SameLogits(*run, *sparse_));
    const OffloadGroupStats st = (*rt)->ffn().TotalStats();
    const CacheCounters hot = (*rt)->ffn().cache().hot().TotalCounters();
    const CacheCounters cold = (*rt)->ffn().cache().cold().TotalCounters();
    EXPECT_GT(st.active, 0);
    EXPECT_EQ(st.retries, 0);
    // Misses of a small cache include flash neighbours whose slots are apart: read as scattered requests (only by
    // the pipelined mode, and only when allowed).
    if (c.mode == OffloadMode::kFull && c.cold == 30 && c.policy == HotPolicy::kLru) {
      if (c.scatter) {
        EXPECT_GT(st.scattered_requests, 0);
      } else {
        EXPECT_EQ(st.scattered_requests, 0);
      }
    } else if (c.mode == OffloadMode::kLlmFlash) {
      EXPECT_EQ(st.scattered_requests, 0);
    }
    if (c.hot == 0 && c.cold == 0) {
      EXPECT_EQ(cold.hits + hot.hits, 0u);
      EXPECT_EQ(cold.bypasses, cold.misses);
      // No cache: every active neuron is read, each once per token; flash neighbours share a (scattered) request.
      EXPECT_EQ(st.bytes_read, static_cast<uint64_t>(st.active) * ColdReadBytes((*rt)->deployment().layout()));
      EXPECT_LT(st.requests, st.active);
      EXPECT_GT(st.scattered_requests, 0);
    }
    if (c.cold >= 100000) {
      // Everything fits: each neuron (or hot cluster) is read at most once over the whole run.
      EXPECT_LE(cold.misses, static_cast<uint64_t>(5 * 172));
      EXPECT_GT(cold.hits, cold.misses);
      EXPECT_EQ(cold.evictions + hot.evictions, 0u);
    }
    if (c.policy == HotPolicy::kPinned) {
      // Loaded before the first token and never replaced: decode only ever hits the hot region.
      EXPECT_EQ(hot.misses, 0u);
      EXPECT_EQ(hot.evictions, 0u);
      EXPECT_GT(hot.hits, 0u);
      const int64_t clusters = OffloadFfn::HotClusterCount((*rt)->deployment(), 0, HotPolicy::kPinned);
      EXPECT_EQ((*rt)->ffn().cache().hot().SlotCount(), std::min(c.hot, clusters));
      if (c.hot >= clusters) {
        EXPECT_EQ(st.requests, 0) << "the whole FFN is pinned: no read during decode";
        EXPECT_EQ(cold.hits + cold.misses, 0u);
      } else {
        EXPECT_GT(st.requests, 0);
      }
    }
  }
}

TEST_F(OffloadTest, PredictorModeEqualsInMemorySparseWithTheSamePredictor) {
  ASSERT_TRUE(predicted_);
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    SCOPED_TRACE(OffloadModeName(mode));
    SparseRuntimeOptions o;
    o.mode = mode;
    o.active_set = ActiveSetSource::kAuto;  // the deployment has a predictor: it is used
    // The reference ran the prompt token by token through the predictor too (batched prefill is dense: tested in
    // offload_prefill_test.cc).
    o.batched_prefill = false;
    o.hot_slots = 1;
    o.cold_slots = 60;
    auto rt = SparseRuntime::Open(dir_->File("deploy-pred"), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_NE((*rt)->predictor(), nullptr);
    auto run = Greedy((*rt)->context(), n_vocab_, predicted_->tokens.size());
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    EXPECT_EQ(run->tokens, predicted_->tokens);
    for (size_t i = 0; i < run->logits.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(run->logits[i].data(), predicted_->logits[i].data(), n_vocab_ * sizeof(float)))
          << "logits of token " << i << " differ from the in-memory sparse FFN with the same predictor";
    }
    EXPECT_GT((*rt)->ffn().TotalStats().active, 0);
  }
  // No predictor in the first deployment: asking for one is an error.
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kPredictor;
  auto rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("no predictor.gguf"), std::string::npos) << rt.status().message();
}

// Lookahead (offload_ffn.h, "Lookahead") changes what is read and when, never the result: bitwise the in-memory
// sparse FFN with it off, on (default cap) and on with a cap of 3 bundles, for the oracle and the predictor, with
// batched and token-by-token prefill, a shared cold pool and per-layer partitions; every pin is released.
TEST_F(OffloadTest, LookaheadChangesReadsNotResults) {
  ASSERT_TRUE(sparse_ && predicted_);
  struct Config {
    bool predictor;
    int64_t lookahead;
    bool per_layer;
    bool batched_prefill;
    bool shared_from_per_layer = false;  // per-layer sizes given, run as one shared pool (--cold-pool shared)
    int64_t per_layer_slots = 40;
    int64_t hot = 1;
    bool prefill_in_cache = false;  // batched prefill in lent cold slots (the lookahead's pins dropped first)
    int64_t chunk = 16;             // requests per chunk
    bool slow = false;              // every read 200 us late: the layer settles its guesses while reads are in flight
  };
  const Config configs[] = {
      {false, 0, false, true}, {false, -1, false, true}, {false, 3, false, false},
      {false, -1, true, true}, {true, -1, false, false}, {true, 0, false, false},
      {false, -1, true, true, true},
      // Partitions smaller than a layer's misses: guesses must still reach the layer that uses them (they once were
      // released when the partition filled and evicted by the layer's own misses before use).
      {false, -1, true, true, false, 12},
      // The same without a hot region: every neuron goes through the cold path, so the cache's lookups can be counted.
      {false, -1, true, true, false, 12, 0},
      {false, -1, true, true, false, 40, 1, true},
      {false, 3, false, true, false, 40, 0, true},
      // Partitions that hold whole layers: nothing is evicted, so every bundle is read once, by its first miss or
      // guess, and stays cached (a guess of a cached bundle, or an unused guess dropped instead of kept, reads more).
      {false, -1, true, false, false, 172, 0},
      // One request per chunk, slow reads: the guesses of a chunk are checked only after its wait.
      {false, -1, true, false, false, 40, 0, false, 1, true},
  };
  for (const Config& c : configs) {
    SCOPED_TRACE(std::string(c.predictor ? "predictor" : "oracle") + " lookahead " + std::to_string(c.lookahead) +
                 (c.per_layer ? " per-layer cold slots" : " shared cold pool") +
                 (c.batched_prefill ? "" : " token prefill") + (c.shared_from_per_layer ? " (shared)" : "") +
                 (c.prefill_in_cache ? " prefill in cache" : "") + " partition " + std::to_string(c.per_layer_slots) +
                 " hot " + std::to_string(c.hot) + " chunk " + std::to_string(c.chunk) + (c.slow ? " slow" : ""));
    SparseRuntimeOptions o;
    o.active_set = c.predictor ? ActiveSetSource::kAuto : ActiveSetSource::kOracle;
    o.lookahead_slots = c.lookahead;
    o.preload_cold = false;  // the reads counted below start from an empty cold region
    o.chunk_requests = c.chunk;
    if (c.slow) {
      o.wrap_flash = [](std::shared_ptr<const ReadableFile> base) -> std::shared_ptr<const ReadableFile> {
        return std::make_shared<SlowFile>(std::move(base), std::chrono::microseconds(200));
      };
    }
    o.hot_slots = c.hot;
    o.batched_prefill = c.batched_prefill;
    o.batched_prefill_min_tokens = 2;  // the prompt is short
    o.shared_cold_pool = c.shared_from_per_layer;
    o.prefill_in_cache = c.prefill_in_cache;
    if (c.per_layer) {
      o.cold_slots_per_group.assign(5, c.per_layer_slots);
    } else {
      o.cold_slots = 150;
    }
    auto rt = SparseRuntime::Open(c.predictor ? dir_->File("deploy-pred") : DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const GreedyRun& ref = c.predictor ? *predicted_ : *sparse_;
    auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(20, ref.tokens.size()));
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, ref));
    EXPECT_EQ((*rt)->ffn().prefill_in_cache(), c.prefill_in_cache);
    EXPECT_EQ((*rt)->ffn().cache().cold().lent_count(), 0);
    const OffloadGroupStats st = (*rt)->ffn().TotalStats();
    const int64_t cap = c.lookahead < 0 ? (*rt)->model().hparams().n_ff / 8 : c.lookahead;
    EXPECT_EQ((*rt)->ffn().lookahead_slots(), cap);
    if (c.lookahead == 0) {
      EXPECT_EQ(st.prefetched, 0);
    } else {
      EXPECT_GT(st.prefetched, 0);
      EXPECT_GT(st.prefetch_used, 0) << "the next layer's input is close enough to guess some of its neurons";
      EXPECT_LE(st.prefetch_used, st.prefetched);
      // Most guesses are used (52-80% here); a guess released before its layer runs is never used.
      EXPECT_GE(2.5 * static_cast<double>(st.prefetch_used), static_cast<double>(st.prefetched));
      EXPECT_LE(st.prefetch_used, st.missed) << "a neuron read ahead and used is a miss served early";
      EXPECT_LE(st.prefetch_bytes, st.bytes_read);
      // At most `cap` bundles per layer and token (4 layers read ahead of per token: layers 1..4), and at most half
      // of the layer's partition (or of the shared pool): the rest stays for its other misses and its hits.
      EXPECT_LE(st.prefetched, cap * st.tokens);
      const int64_t pool = !c.per_layer ? 150 : c.shared_from_per_layer ? 5 * c.per_layer_slots : c.per_layer_slots;
      for (size_t g = 0; g < 5; ++g) {
        const OffloadGroupStats& sg = (*rt)->ffn().stats()[g];
        EXPECT_LE(sg.prefetched, std::min(cap, pool / 2) * sg.tokens) << "layer " << g;
      }
    }
    EXPECT_EQ(st.retries, 0);
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    // Per-layer partitions come with the overflow pool: n_ff (172) minus the smallest partition (a shared pool made
    // from them has no staging to turn into one).
    const bool partitions = c.per_layer && !c.shared_from_per_layer;
    EXPECT_EQ(cold.SlotCount(),
              partitions ? 5 * c.per_layer_slots + (172 - c.per_layer_slots) : c.per_layer ? 5 * c.per_layer_slots : 150);
    std::printf("lookahead %lld, cold slots %lld: %lld read ahead, %lld used, %lld missed\n",
                static_cast<long long>(c.lookahead), static_cast<long long>(cold.SlotCount()),
                static_cast<long long>(st.prefetched), static_cast<long long>(st.prefetch_used),
                static_cast<long long>(st.missed));
    EXPECT_EQ(cold.config().slots_per_group.empty(), !c.per_layer || c.shared_from_per_layer);
    if (c.hot == 0) {
      // One cold lookup per active neuron not read ahead, plus one per bundle read ahead (when it was issued): an
      // item that took a read-ahead bundle must not be looked up again (it once was, after an early settle).
      const CacheCounters cc = cold.TotalCounters();
      EXPECT_EQ(static_cast<int64_t>(cc.hits + cc.misses), st.active - st.prefetch_used + st.prefetched);
    }
    if (c.per_layer_slots >= 172 && c.hot == 0) {
      // Nothing leaves the cache: each bundle read (by a miss or a guess) was a miss when read, and is still held.
      const CacheCounters cc = cold.TotalCounters();
      EXPECT_EQ(cc.evictions, 0u);
      EXPECT_EQ(st.bytes_read, cc.misses * ColdReadBytes((*rt)->deployment().layout()));
      uint64_t held = 0;
      for (int64_t g = 0; g < 5; ++g) {
        for (int32_t n = 0; n < 172; ++n) held += cold.Find(g, n) >= 0;
      }
      EXPECT_EQ(held, cc.misses);
    }
    for (int32_t s = 0; s < cold.SlotCount(); ++s) ASSERT_EQ(cold.PinCount(s), 0) << "slot " << s << " still pinned";
  }
}

// With a predictor the lookahead reads the lookahead_keep share of its candidates with the largest logits: fewer
// bundles than with all of them, and a larger share of those used (the likeliest guesses are kept, not any), while
// the results stay those of the in-memory sparse FFN with the same predictor.
TEST_F(OffloadTest, LookaheadKeepsTheLikeliestGuesses) {
  ASSERT_TRUE(predicted_);
  OffloadGroupStats all, some;
  for (double keep : {1.0, 0.3}) {
    SCOPED_TRACE("keep " + std::to_string(keep));
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kAuto;
    o.batched_prefill = false;
    o.hot_slots = 1;
    o.cold_slots = 150;
    o.lookahead_slots = 172;  // n_ff: the cap (then half the pool, 75) binds less often than the share
    o.lookahead_keep = keep;
    auto rt = SparseRuntime::Open(dir_->File("deploy-pred"), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(20, predicted_->tokens.size()));
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *predicted_));
    (keep == 1.0 ? all : some) = (*rt)->ffn().TotalStats();
  }
  ASSERT_GT(some.prefetched, 0);
  EXPECT_LT(some.prefetched, all.prefetched);
  EXPECT_GT(static_cast<double>(some.prefetch_used) / static_cast<double>(some.prefetched),
            static_cast<double>(all.prefetch_used) / static_cast<double>(all.prefetched));
  std::printf("lookahead keep 1: %lld of %lld used; keep 0.3: %lld of %lld\n",
              static_cast<long long>(all.prefetch_used), static_cast<long long>(all.prefetched),
              static_cast<long long>(some.prefetch_used), static_cast<long long>(some.prefetched));
}

// The same-layer lookahead guesses each layer from its attention input, before the attention: the first layer gets
// guesses too (the next-layer source never reads ahead into it), layers without cold room get none, most guesses
// are used, and the results stay bitwise those of the in-memory sparse FFN (predictor and oracle).
TEST_F(OffloadTest, SameLayerLookaheadChangesReadsNotResults) {
  ASSERT_TRUE(predicted_ && sparse_);
  for (bool predictor : {true, false}) {
    SCOPED_TRACE(predictor ? "predictor" : "oracle");
    SparseRuntimeOptions o;
    o.active_set = predictor ? ActiveSetSource::kAuto : ActiveSetSource::kOracle;
    o.batched_prefill = false;
    o.lookahead_slots = -1;
    o.lookahead_source = LookaheadSource::kSameLayer;
    o.hot_slots = 1;
    o.cold_slots_per_group = {40, 40, 0, 40, 40};
    auto rt = SparseRuntime::Open(predictor ? dir_->File("deploy-pred") : DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const GreedyRun& ref = predictor ? *predicted_ : *sparse_;
    auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(16, ref.tokens.size()));
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, ref));
    const std::vector<OffloadGroupStats>& st = (*rt)->ffn().stats();
    ASSERT_EQ(st.size(), 5u);
    EXPECT_GT(st[0].prefetched, 0) << "the first layer is guessed from its own attention input";
    EXPECT_EQ(st[2].prefetched, 0) << "no cold slots";
    const OffloadGroupStats t = (*rt)->ffn().TotalStats();
    EXPECT_GT(t.prefetch_used, 0);
    EXPECT_LE(t.prefetch_used, t.prefetched);
    EXPECT_LE(t.prefetch_used, t.missed);
    EXPECT_EQ(t.retries, 0);
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    for (int32_t s = 0; s < cold.SlotCount(); ++s) ASSERT_EQ(cold.PinCount(s), 0) << "slot " << s << " still pinned";
    std::printf("same-layer lookahead (%s): %lld read ahead, %lld used, %lld missed\n", predictor ? "predictor" : "oracle",
                static_cast<long long>(t.prefetched), static_cast<long long>(t.prefetch_used),
                static_cast<long long>(t.missed));
  }
  EXPECT_TRUE(ParseLookaheadSource("same-layer").ok());
  EXPECT_FALSE(ParseLookaheadSource("previous").ok());
}

// The next-layer guess from the hits (LookaheadInput::kHits: the residual plus the layer's cache hits' share of its
// output, normalised as the next layer's FFN input) against the one from the layer's FFN input alone: the results stay
// bitwise those of the in-memory sparse FFN, and the guess closer to the next layer's input is right more often. The
// same guess through the deployment's lookahead table (kProjected; the predictor deployment has one, the oracle needs
// none and guesses as kHits) reads as well as kHits' within a few bundles (the rms it divides by is last token's).
TEST_F(OffloadTest, LookaheadFromTheHitsGuessesBetterNotDifferently) {
  ASSERT_TRUE(predicted_ && sparse_);
  for (bool predictor : {true, false}) {
    SCOPED_TRACE(predictor ? "predictor" : "oracle");
    OffloadGroupStats by_input[3];
    for (LookaheadInput input : {LookaheadInput::kHits, LookaheadInput::kFfnInput, LookaheadInput::kProjected}) {
      SparseRuntimeOptions o;
      o.active_set = predictor ? ActiveSetSource::kAuto : ActiveSetSource::kOracle;
      o.batched_prefill = false;
      o.hot_slots = 1;
      o.cold_slots = 150;
      o.lookahead_slots = 172;
      o.lookahead_input = input;
      auto rt = SparseRuntime::Open(predictor ? dir_->File("deploy-pred") : DeployDir(), o, pool_);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      const GreedyRun& ref = predictor ? *predicted_ : *sparse_;
      auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(20, ref.tokens.size()));
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      ASSERT_TRUE(SameLogits(*run, ref));
      by_input[static_cast<int>(input)] = (*rt)->ffn().TotalStats();
      const bool projected = input == LookaheadInput::kProjected && predictor;
      EXPECT_EQ((*rt)->lookahead_input(), projected ? LookaheadInput::kProjected
                                                     : (input == LookaheadInput::kProjected ? LookaheadInput::kHits : input));
      EXPECT_EQ((*rt)->fixed().lookahead, projected ? (*rt)->ffn().options().lookahead_table->bytes() : 0u);
      const SlotRegion& cold = (*rt)->ffn().cache().cold();
      for (int32_t s = 0; s < cold.SlotCount(); ++s) ASSERT_EQ(cold.PinCount(s), 0) << "slot " << s << " still pinned";
    }
    static_assert(static_cast<int>(LookaheadInput::kHits) == 0 && static_cast<int>(LookaheadInput::kFfnInput) == 1 &&
                  static_cast<int>(LookaheadInput::kProjected) == 2);
    const OffloadGroupStats& hits = by_input[0];
    const OffloadGroupStats& input = by_input[1];
    const OffloadGroupStats& projected = by_input[2];
    std::printf("lookahead (%s) through the table: %lld of %lld used\n", predictor ? "predictor" : "oracle",
                static_cast<long long>(projected.prefetch_used), static_cast<long long>(projected.prefetched));
    if (predictor) {
      ASSERT_GT(projected.prefetched, 0);
      EXPECT_GE(projected.prefetch_used, input.prefetch_used);
      EXPECT_NEAR(static_cast<double>(projected.prefetch_used), static_cast<double>(hits.prefetch_used),
                  0.05 * static_cast<double>(hits.prefetch_used));
    } else {
      EXPECT_EQ(projected.prefetched, hits.prefetched) << "the oracle guesses as kHits";
      EXPECT_EQ(projected.prefetch_used, hits.prefetch_used);
    }
    std::printf("lookahead (%s) from the hits: %lld of %lld used; from the FFN input: %lld of %lld\n",
                predictor ? "predictor" : "oracle", static_cast<long long>(hits.prefetch_used),
                static_cast<long long>(hits.prefetched), static_cast<long long>(input.prefetch_used),
                static_cast<long long>(input.prefetched));
    ASSERT_GT(hits.prefetched, 0);
    ASSERT_GT(input.prefetched, 0);
    EXPECT_GE(hits.prefetch_used, input.prefetch_used);
    if (!predictor) {
      // Exact active sets: the closer input is right more often. (This model's predictor predicts ~3x the true set,
      // so its own errors, which both guesses share, dominate: 2716 of 3053 against 2711 of 3043.)
      EXPECT_GT(static_cast<double>(hits.prefetch_used) / static_cast<double>(hits.prefetched),
                static_cast<double>(input.prefetch_used) / static_cast<double>(input.prefetched));
    }
  }
  EXPECT_EQ(ParseLookaheadInput("hits").value(), LookaheadInput::kHits);
  EXPECT_EQ(ParseLookaheadInput("ffn-input").value(), LookaheadInput::kFfnInput);
  EXPECT_EQ(ParseLookaheadInput("projected").value(), LookaheadInput::kProjected);
  EXPECT_FALSE(ParseLookaheadInput("attention").ok());
}

// --lookahead -1 (auto) reads ahead from the start when a core is left beyond the compute threads or the threads are
// pinned, else adaptively; a given value is kept, never adaptive.
TEST(AutoLookaheadTest, FromTheStartOnlyWithACoreToSpareOrPinnedThreads) {
  const int cores = ThreadPool::HardwareThreads();
  auto is = [](LookaheadChoice c, int64_t slots, bool adaptive) { return c.slots == slots && c.adaptive == adaptive; };
  EXPECT_TRUE(is(AutoLookahead(0, 1, false), 0, false));
  EXPECT_TRUE(is(AutoLookahead(7, cores, false), 7, false));
  EXPECT_TRUE(is(AutoLookahead(-1, cores, false), -1, true));
  EXPECT_TRUE(is(AutoLookahead(-1, cores, true), -1, false)) << "pinned: from the start";
  EXPECT_TRUE(is(AutoLookahead(0, cores, true), 0, false)) << "a given value is kept";
  EXPECT_TRUE(is(AutoLookahead(-1, 0, false), -1, true)) << "0 threads means every core";
  EXPECT_TRUE(is(AutoLookahead(-1, cores + 2, false), -1, true));
  if (cores > 1) {
    EXPECT_TRUE(is(AutoLookahead(-1, cores - 1, false), -1, false));
  }
}

// An adaptive lookahead reads nothing ahead until a window of tokens waited for reads for its share of the time: with
// a share of 0 it turns on after the first judged window (then reads ahead, with the results unchanged); with a share above
// 1 it never does. The token it started at is reported.
TEST_F(OffloadTest, AdaptiveLookaheadTurnsOnWhenReadsKeepComputeWaiting) {
  ASSERT_TRUE(predicted_);
  for (double share : {0.0, 1.5}) {
    SCOPED_TRACE("wait share " + std::to_string(share));
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kAuto;
    o.batched_prefill = false;  // token by token: the same logits as the in-memory sparse run from the first token
    o.hot_slots = 1;
    o.cold_slots = 60;  // small: misses every token, so there is something to read ahead
    o.lookahead_slots = -1;
    o.lookahead_adaptive = true;
    o.lookahead_wait_share = share;
    auto rt = SparseRuntime::Open(dir_->File("deploy-pred"), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const OffloadFfn& ffn = (*rt)->ffn();
    ASSERT_GT(ffn.lookahead_slots(), 0);
    EXPECT_FALSE(ffn.lookahead_on()) << "adaptive: off at the start";
    const size_t steps = std::min<size_t>(20, predicted_->tokens.size());
    auto run = Greedy((*rt)->context(), n_vocab_, steps);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *predicted_));
    const OffloadGroupStats st = ffn.TotalStats();
    EXPECT_GT(st.missed, 0);
    if (share > 1.0) {
      EXPECT_FALSE(ffn.lookahead_on());
      EXPECT_EQ(ffn.lookahead_started_token(), -1);
      EXPECT_EQ(st.prefetched, 0);
      continue;
    }
    ASSERT_TRUE(ffn.lookahead_on());
    // The first token (of the prompt, which runs token by token) opens the first window, which warms the cache and
    // is not judged; the token that closes the second turns the lookahead on.
    EXPECT_EQ(ffn.lookahead_started_token(), 2 * kDefaultLookaheadWindowTokens);
    EXPECT_GT(st.prefetched, 0);
    // Only that token and the later ones read ahead: at most `cap` bundles for each of layers 1..4 of each of them.
    const int64_t later = static_cast<int64_t>(kPrompt.size() + steps) - 2 * kDefaultLookaheadWindowTokens;
    EXPECT_LE(st.prefetched, ffn.lookahead_slots() * 4 * later);
  }
}

// A layer without cold room to read ahead into (a plan's pinned regions) gets no guesses, and the oracle does not pay
// for a gate GEMV it cannot use: layer 2's partition is empty, layer 3's holds 1 slot (cap 0); layers 1 and 4 read
// ahead as usual. Results stay those of the in-memory sparse FFN.
TEST_F(OffloadTest, LookaheadSkipsLayersWithoutColdRoom) {
  ASSERT_TRUE(sparse_);
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.lookahead_slots = -1;
  o.hot_slots = 1;
  o.cold_slots_per_group = {40, 40, 0, 1, 40};
  auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(12, sparse_->tokens.size()));
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  ASSERT_TRUE(SameLogits(*run, *sparse_));
  const std::vector<OffloadGroupStats>& st = (*rt)->ffn().stats();
  ASSERT_EQ(st.size(), 5u);
  EXPECT_EQ(st[0].prefetched, 0) << "nothing reads ahead into the first layer";
  EXPECT_EQ(st[2].prefetched, 0) << "no cold slots";
  EXPECT_EQ(st[3].prefetched, 0) << "one cold slot: a cap of 0";
  // No time spent choosing for them (before, the oracle's gate GEMV over their candidates ran and chose nothing).
  EXPECT_EQ(st[2].lookahead_ns, 0u);
  EXPECT_EQ(st[3].lookahead_ns, 0u);
  EXPECT_GT(st[1].prefetched + st[4].prefetched, 0);
}

// Per-layer partitions (a plan's) come with the cold overflow pool in place of the miss staging: it caches for the
// layers that used it last, here layer 2 (no partition) and layer 3 (one slot), whose neurons then hit across
// tokens; without it they go through staging and never hit. Results are those of the in-memory sparse FFN both ways.
TEST_F(OffloadTest, OverflowPoolCachesForLayersBeyondTheirPartitions) {
  ASSERT_TRUE(sparse_);
  for (bool overflow : {true, false}) {
    SCOPED_TRACE(overflow ? "overflow pool" : "staging");
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_slots = 1;
    o.cold_slots_per_group = {40, 40, 0, 1, 40};
    o.cold_overflow = overflow;
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto run = Greedy((*rt)->context(), n_vocab_, std::min<size_t>(12, sparse_->tokens.size()));
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *sparse_));
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    EXPECT_EQ(cold.SlotCount(), 121 + (overflow ? 172 : 0)) << "the pool: n_ff minus the smallest partition (0)";
    EXPECT_EQ((*rt)->ffn().scratch_bytes() < 172 * (*rt)->cold_slot_bytes(), overflow)
        << "the pool replaces the staging";
    const uint64_t hits2 = cold.counters(2).hits, hits3 = cold.counters(3).hits;
    EXPECT_EQ(cold.counters(2).bypasses, overflow ? 0u : cold.counters(2).misses);
    if (overflow) {
      EXPECT_GT(hits2, 0u);
      EXPECT_GT(hits3, 1u);
    } else {
      EXPECT_EQ(hits2, 0u);
    }
    for (int32_t s = 0; s < cold.SlotCount(); ++s) ASSERT_EQ(cold.PinCount(s), 0) << "slot " << s << " still pinned";
  }
}

// A layer's misses never evict a unit the same token hits: with partitions larger than any active set, each step
// misses exactly its active units not held at its start, and the LRU order after it is: the units it did not use (in
// their order, the oldest evicted first, one per miss), then its misses, then its hits (both ascending: the runtime
// acquires misses first and releases in acquisition order). A reference replays the traced active sets that way and
// must agree with the cache's counters exactly. (Pinning hits and misses in ascending neuron order, as the runtime did
// before, let a miss evict a unit hit later in the same step, which was then read again.)
TEST_F(OffloadTest, MissesNeverEvictTheSameTokensHits) {
  ASSERT_TRUE(sparse_);
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.hot_slots = 0;
  constexpr int64_t kPartition = 60;  // stories260K-relu: n_ff 172, about 24 active per layer
  o.cold_slots_per_group.assign(5, kPartition);
  o.cold_overflow = false;
  o.cold_protected_fraction = 0.0;
  o.lookahead_slots = 0;
  auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  auto traced = TracedGreedy(**rt, n_vocab_, std::min<size_t>(24, sparse_->tokens.size()), *sparse_,
                             dir_->File("misses-trace.txt"));
  ASSERT_TRUE(traced.ok()) << traced.status().ToString();

  // The cold region starts preloaded (OffloadOptions::preload_cold): with no hot region, each partition holds the
  // region's first kPartition neurons in layout order, the first of them the most recently used.
  std::map<int64_t, std::vector<int64_t>> lru;  // per group, least recently used first
  const packer::Manifest& manifest = (*rt)->deployment().manifest();
  for (int64_t g = 0; g < 5; ++g) {
    const packer::RegionInfo& region = manifest.regions[static_cast<size_t>(g)];
    for (int64_t s = kPartition - 1; s >= 0; --s) lru[g].push_back(region.neuron_of_slot[static_cast<size_t>(s)]);
  }
  EXPECT_EQ((*rt)->ffn().preloaded_bundles(), 5 * kPartition);
  std::map<int64_t, CacheCounters> expect;
  int steps = 0, steps_with_held_active_at_head = 0;
  for (const auto& [g, active] : *traced) {
    ASSERT_LT(static_cast<int64_t>(active.size()), kPartition) << "the reference assumes no bypass";
    std::vector<int64_t>& list = lru[g];
    const std::set<int64_t> a(active.begin(), active.end());
    const std::set<int64_t> held(list.begin(), list.end());
    std::vector<int64_t> misses, hits, kept;
    for (int64_t u : active) (held.count(u) ? hits : misses).push_back(u);
    const int64_t free_slots = kPartition - static_cast<int64_t>(list.size());
    int64_t evict = std::max<int64_t>(0, static_cast<int64_t>(misses.size()) - free_slots);
    // Whether the old order would have had the chance to go wrong: a held active unit among the first victims.
    for (size_t i = 0; i < list.size() && i < static_cast<size_t>(evict); ++i) {
      if (a.count(list[i])) {
        ++steps_with_held_active_at_head;
        break;
      }
    }
    expect[g].hits += hits.size();
    expect[g].misses += misses.size();
    expect[g].evictions += static_cast<uint64_t>(evict);
    for (int64_t u : list) {
      if (a.count(u)) continue;
      if (evict > 0) {
        --evict;
        continue;
      }
      kept.push_back(u);
    }
    kept.insert(kept.end(), misses.begin(), misses.end());
    kept.insert(kept.end(), hits.begin(), hits.end());
    list = std::move(kept);
    ++steps;
  }
  ASSERT_GT(steps, 100);
  EXPECT_GT(steps_with_held_active_at_head, 0) << "the trace never put a unit about to be hit first in line";
  const SlotRegion& cold = (*rt)->ffn().cache().cold();
  for (const auto& [g, want] : expect) {
    EXPECT_EQ(cold.counters(g).hits, want.hits) << "group " << g;
    EXPECT_EQ(cold.counters(g).misses, want.misses) << "group " << g;
    EXPECT_EQ(cold.counters(g).evictions, want.evictions) << "group " << g;
    EXPECT_GT(want.evictions, 0u) << "group " << g;
    const OffloadGroupStats& st = (*rt)->ffn().stats()[static_cast<size_t>(g)];
    EXPECT_EQ(st.missed, static_cast<int64_t>(want.misses)) << "group " << g;
    EXPECT_EQ(st.active, static_cast<int64_t>(want.hits + want.misses)) << "group " << g;
  }
}

// The preload of one shared pool: without weights each layer gets an equal share (the first layers one more while a
// remainder lasts); with a plan's per-layer cold slots run as one pool, a share in proportion to them (rounded down).
// Each share is the layer's first cold neurons in layout order (no hot region here: from slot 0).
// One shared cold pool is shared out (what the preload fills per layer) in proportion to a plan's per-region sizes;
// without a plan, to the deployment's active neurons per token (read here from manifest.json); for a deployment packed
// before that figure existed, equally.
TEST_F(OffloadTest, SharedPoolPreloadIsSharedOutByThePlansSizes) {
  const std::vector<int64_t> plan_weights = {10, 20, 30, 40, 50};
  const nlohmann::json manifest = nlohmann::json::parse(nflash::testing::ReadText(DeployDir() + "/manifest.json"));
  std::vector<double> active;
  for (const auto& r : manifest["regions"]) active.push_back(r["active_per_token"].get<double>());
  ASSERT_EQ(active.size(), 5u);
  ASSERT_NE(*std::min_element(active.begin(), active.end()), *std::max_element(active.begin(), active.end()))
      << "the test needs layers of different activity";
  // The same deployment without the figure, and with it for all regions but the first (a hand-edited manifest: the
  // figures that are there do not say how to share with the one that is not).
  const std::string old_dir = dir_->File("deploy-no-active"), partial_dir = dir_->File("deploy-partial-active");
  for (const std::string& dir : {old_dir, partial_dir}) {
    if (fs::exists(dir)) continue;
    fs::copy(DeployDir(), dir, fs::copy_options::recursive);
    nlohmann::json old = manifest;
    for (auto& r : old["regions"]) {
      if (dir == old_dir || &r == &old["regions"][0]) r.erase("active_per_token");
    }
    nflash::testing::WriteText(dir + "/manifest.json", old.dump(1) + "\n");
  }
  enum class Source { kPlan, kManifest, kEqual, kPartial };
  for (Source source : {Source::kPlan, Source::kManifest, Source::kEqual, Source::kPartial}) {
    SCOPED_TRACE(source == Source::kPlan       ? "plan"
                 : source == Source::kManifest ? "manifest"
                 : source == Source::kEqual    ? "equal shares"
                                               : "equal shares (a region without the figure)");
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_slots = 0;
    if (source == Source::kPlan) {
      o.cold_slots_per_group = plan_weights;
      o.shared_cold_pool = true;
    } else {
      o.cold_slots = 151;
    }
    auto rt = SparseRuntime::Open(source == Source::kEqual     ? old_dir
                                  : source == Source::kPartial ? partial_dir
                                                               : DeployDir(),
                                  o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    const int64_t pool = cold.SlotCount();
    ASSERT_GE(pool, 150);  // the weights' sum, or 151 and the staging a shared pool takes in
    const double active_sum = std::accumulate(active.begin(), active.end(), 0.0);
    // Rounded down, then what is left a slot each to the first layers.
    std::vector<int64_t> shares;
    for (size_t i = 0; i < 5; ++i) {
      const double by_activity = std::floor(static_cast<double>(pool) * active[i] / active_sum);
      shares.push_back(source == Source::kPlan       ? pool * plan_weights[i] / 150
                       : source == Source::kManifest ? static_cast<int64_t>(by_activity)
                                                     : pool / 5);
    }
    for (int64_t& s : shares) s += std::accumulate(shares.begin(), shares.end(), int64_t{0}) < pool ? 1 : 0;
    ASSERT_EQ(std::accumulate(shares.begin(), shares.end(), int64_t{0}), pool);
    int64_t total = 0;
    for (int64_t g = 0; g < 5; ++g) {
      const auto i = static_cast<size_t>(g);
      const int64_t share = shares[i];
      ASSERT_LT(share, 172) << "a share below the layer's neurons, so that the next one is not held";
      EXPECT_EQ((*rt)->ffn().ColdShare(g), share) << "layer " << g;
      const packer::RegionInfo& region = (*rt)->deployment().manifest().regions[i];
      for (int64_t s = 0; s <= share; ++s) {
        EXPECT_EQ(cold.Find(g, region.neuron_of_slot[static_cast<size_t>(s)]) >= 0, s < share)
            << "layer " << g << " slot " << s << " share " << share;
      }
      total += share;
    }
    EXPECT_EQ((*rt)->ffn().preloaded_bundles(), total);
  }
}

// Pinned hot clusters without a plan: hot_slots is split evenly over the layers, one more for the first layers while
// a remainder lasts, and never more than a layer has (its clusters); a plan's per-layer counts are clamped the same
// way. Counted here by dealing the clusters out one at a time, layer after layer.
TEST_F(OffloadTest, PinnedClustersAreDealtEvenlyOverTheLayers) {
  ASSERT_TRUE(sparse_);
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  constexpr int64_t kClusterGroups = 2;
  const int64_t per_cluster = kClusterGroups * (*d)->layout().slots_per_group;
  std::vector<int64_t> cap;
  for (const auto& r : (*d)->manifest().regions) cap.push_back((r.n_neurons + per_cluster - 1) / per_cluster);
  const int64_t n_groups = static_cast<int64_t>(cap.size());
  ASSERT_GE(n_groups, 3);
  const int64_t all = std::accumulate(cap.begin(), cap.end(), int64_t{0});
  ASSERT_GT(cap[0], 3) << "the test needs layers of several clusters";
  auto dealt = [&](int64_t n) {
    std::vector<int64_t> got(cap.size(), 0);
    for (bool progress = true; n > 0 && progress;) {
      progress = false;
      for (size_t g = 0; g < cap.size() && n > 0; ++g) {
        if (got[g] == cap[g]) continue;
        ++got[g];
        --n;
        progress = true;
      }
    }
    return got;
  };
  for (int64_t hot : {int64_t{1}, n_groups + 2, 2 * n_groups - 1, all - 1, all + 5}) {
    SCOPED_TRACE("hot_slots " + std::to_string(hot));
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_policy = HotPolicy::kPinned;
    o.cluster_groups = kClusterGroups;
    o.hot_slots = hot;
    o.cold_slots = 30;
    auto rt = Open(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    EXPECT_EQ((*rt)->ffn().cache().hot().config().slots_per_group, dealt(hot));
    auto run = Greedy((*rt)->context(), n_vocab_, 8);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *sparse_));
  }
  // A plan's counts: taken as given, at most a layer's clusters, never below 0.
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.hot_policy = HotPolicy::kPinned;
  o.cluster_groups = kClusterGroups;
  o.hot_slots_per_group.assign(static_cast<size_t>(n_groups), 1);
  o.hot_slots_per_group[0] = 0;
  o.hot_slots_per_group[1] = cap[1] + 7;
  o.hot_slots_per_group[2] = -3;
  o.cold_slots = 30;
  std::vector<int64_t> expected(static_cast<size_t>(n_groups), 1);
  expected[0] = 0;
  expected[1] = cap[1];
  expected[2] = 0;
  auto rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_EQ((*rt)->ffn().cache().hot().config().slots_per_group, expected);
}

// Reads made while opening (the oracle's gate rows; the pinned hot region) are checked like decode's: a fault is
// retried once (the run is then the in-memory one, and no retry shows in the decode statistics), a persistent one
// fails the opening with a message naming what was being loaded.
TEST_F(OffloadTest, FaultsWhileOpeningAreRetriedOnceThenReported) {
  ASSERT_TRUE(sparse_ && predicted_);
  enum class First { kGateRows, kPinned, kColdPreload };
  for (First first : {First::kGateRows, First::kPinned, First::kColdPreload}) {
    const bool pinned = first == First::kPinned;
    const char* what = first == First::kGateRows ? "oracle gate rows"
                       : pinned                  ? "loading the pinned hot region"
                                                 : "preloading the cold region";
    for (auto fault : {FaultInjectingFile::Fault::kBitFlip, FaultInjectingFile::Fault::kEio}) {
      for (int count : {1, -1}) {
        SCOPED_TRACE(std::string(what) + " fault " + std::to_string(static_cast<int>(fault)) +
                     (count < 0 ? " persistent" : " once"));
        FaultInjectingFile* fi = nullptr;
        SparseRuntimeOptions o;
        // The pinned region with the predictor (no gate rows to read first); the gate rows with the oracle; the cold
        // preload with the predictor and an LRU hot region (nothing else read at Open).
        o.active_set = first == First::kGateRows ? ActiveSetSource::kOracle : ActiveSetSource::kPredictor;
        o.hot_policy = pinned ? HotPolicy::kPinned : HotPolicy::kLru;
        o.batched_prefill = false;
        o.hot_slots = pinned ? 1000 : 1;
        o.cold_slots = 60;
        o.wrap_flash = WrapWithFaults(&fi, FaultInjectingFile::Rule{fault, 0, UINT64_MAX, count});  // from the first read on
        auto rt = SparseRuntime::Open(first != First::kGateRows ? dir_->File("deploy-pred") : DeployDir(), o, pool_);
        if (count < 0) {
          ASSERT_FALSE(rt.ok());
          const std::string msg = rt.status().message();
          EXPECT_EQ(rt.status().code(),
                    fault == FaultInjectingFile::Fault::kEio ? StatusCode::kIOError : StatusCode::kCorruption)
              << msg;
          EXPECT_NE(msg.find(what), std::string::npos) << msg;
          EXPECT_NE(msg.find(pinned ? "hot cluster 0" : "layer 0"), std::string::npos) << msg;
          if (first == First::kColdPreload) {
            EXPECT_NE(msg.find("neuron "), std::string::npos) << msg;
          }
          continue;
        }
        ASSERT_TRUE(rt.ok()) << rt.status().ToString();
        ASSERT_NE(fi, nullptr);
        EXPECT_EQ(fi->InjectedCount(), 1);
        EXPECT_EQ((*rt)->ffn().TotalStats().retries, 0) << "load-time retries are not decode statistics";
        if (first == First::kColdPreload) {
          EXPECT_GT((*rt)->ffn().preloaded_bundles(), 0);
        }
        const GreedyRun& ref = first != First::kGateRows ? *predicted_ : *sparse_;
        auto run = Greedy((*rt)->context(), n_vocab_, 8);
        ASSERT_TRUE(run.ok()) << run.status().ToString();
        ASSERT_TRUE(SameLogits(*run, ref));
        EXPECT_EQ((*rt)->ffn().TotalStats().retries, 0);
      }
    }
  }
}

// Without a cache every active neuron is read each step, and full mode reads flash neighbours together: the requests
// of a step are its active bundles in file order, one per run of bundles that follow each other on flash (offset +
// read size = the next offset; pieces and the request size cap are far from binding at this size). llmflash reads
// each bundle alone. Counted from the traced active sets and the layout.
TEST_F(OffloadTest, WithoutACacheARequestIsARunOfFlashNeighbours) {
  ASSERT_TRUE(sparse_);
  auto d = packer::Deployment::Open(DeployDir());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const packer::BundleLayout& lay = (*d)->layout();
  const uint64_t read = ColdReadBytes(lay);
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    SCOPED_TRACE(OffloadModeName(mode));
    SparseRuntimeOptions o;
    o.mode = mode;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_slots = 0;
    o.cold_slots = 0;
    o.batched_prefill = false;  // every token through the decode path
    auto rt = Open(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto traced = TracedGreedy(**rt, n_vocab_, 12, *sparse_,
                               dir_->File(std::string("runs-trace-") + OffloadModeName(mode) + ".txt"));
    ASSERT_TRUE(traced.ok()) << traced.status().ToString();

    int64_t active = 0, runs = 0, steps = 0, merged_steps = 0;
    for (const TracedStep& step : *traced) {
      const packer::RegionInfo* region = (*d)->Region(step.group, -1);
      ASSERT_NE(region, nullptr);
      std::vector<uint64_t> offsets;
      for (int64_t n : step.active) {
        offsets.push_back(region->offset + lay.SlotOffset(region->slot_of_neuron[static_cast<size_t>(n)]));
      }
      std::sort(offsets.begin(), offsets.end());
      int64_t step_runs = offsets.empty() ? 0 : 1;
      for (size_t i = 1; i < offsets.size(); ++i) step_runs += offsets[i - 1] + read != offsets[i];
      active += static_cast<int64_t>(offsets.size());
      runs += step_runs;
      ++steps;
      merged_steps += step_runs < static_cast<int64_t>(offsets.size());
    }
    ASSERT_EQ(steps, 5 * static_cast<int64_t>(kPrompt.size() + 12)) << "one line per layer and token";
    ASSERT_GT(merged_steps, 0) << "no step with flash neighbours: the test shows nothing";
    const OffloadGroupStats st = (*rt)->ffn().TotalStats();
    EXPECT_EQ(st.active, active);
    EXPECT_EQ(st.requests, mode == OffloadMode::kFull ? runs : active);
  }
}

// Under a memory budget, what the budget has left beyond the partitions (a plan rounds its sizes down) also goes to
// the overflow pool: the process accounts for the whole budget less than a slot.
TEST_F(OffloadTest, OverflowPoolTakesWhatTheBudgetLeaves) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.batched_prefill = false;
  o.hot_slots = 1;
  o.cold_slots_per_group = {10, 10, 10, 10, 10};
  auto free_rt = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(free_rt.ok()) << free_rt.status().ToString();
  SparseRuntime& a = **free_rt;
  EXPECT_EQ(a.ffn().cache().cold().SlotCount(), 50 + (172 - 10)) << "no budget: the pool is the staging";
  const uint64_t slot = a.cold_slot_bytes();
  const uint64_t accounted = a.fixed().Total() + a.split().hot_bytes + a.split().cold_bytes;
  // The budget check counts a whole layer of staging (172 slots) before the pool replaces it (162): 10 slots more.
  o.memory_budget = accounted + 15 * slot + 100;
  auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  SparseRuntime& b = **rt;
  EXPECT_EQ(b.ffn().cache().cold().SlotCount(), 50 + (172 - 10) + 15);
  const uint64_t total = b.fixed().Total() + b.split().hot_bytes + b.split().cold_bytes;
  EXPECT_LE(total, o.memory_budget);
  EXPECT_LT(o.memory_budget - total, slot);
  EXPECT_EQ(b.split().unused_bytes, o.memory_budget - total);
}

// stories260K-relu ties its embeddings to the output head (llama2.c shared classifier): token_embd stays resident.
TEST_F(OffloadTest, TiedEmbeddingsStayResident) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  ASSERT_TRUE(o.embedding_on_flash);
  auto rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_EQ((*rt)->deployment().resident().FindTensor("output.weight"), nullptr);
  EXPECT_EQ((*rt)->embedding(), nullptr);
  EXPECT_EQ((*rt)->deployment().embedding_range().size, 0u);
  EXPECT_EQ((*rt)->fixed().resident_weights, (*rt)->deployment().manifest().resident_bytes);
}

TEST_F(OffloadTest, MemoryBudgetRefusesBelowTheFixedPart) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.memory_budget = 4096;
  auto rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("memory budget 4.00 KiB is below the fixed part"), std::string::npos)
      << rt.status().message();
  EXPECT_NE(rt.status().message().find("the minimum is"), std::string::npos);
  // A budget just above the minimum runs (with small caches) and gives the same tokens.
  const size_t at = rt.status().message().find("(", rt.status().message().find("the minimum is"));
  const uint64_t minimum = std::stoull(rt.status().message().substr(at + 1));
  o.memory_budget = minimum + 64 * 4096;
  rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_LE((*rt)->fixed().Total() + (*rt)->split().hot_bytes + (*rt)->split().cold_bytes, o.memory_budget);
  EXPECT_GT((*rt)->split().hot_slots + (*rt)->split().cold_slots, 0);
  auto run = Greedy((*rt)->context(), n_vocab_, 10);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  EXPECT_EQ(run->tokens, std::vector<int32_t>(kGolden.begin(), kGolden.begin() + 10));
  EXPECT_NE((*rt)->Accounting().find("cold region"), std::string::npos);
}

// Without per-group sizes the budget's cache split is chosen by the deployment's profile (hot_split.h), but only by
// the profile it was packed from: this fixture packs with a placeholder hash, so the runtime says why it cannot
// trust profile.gguf and splits by the fixed default, exactly as --hot-fraction 0.5 does.
TEST_F(OffloadTest, AutoSplitFallsBackWithoutTheProfileThePackUsed) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.memory_budget = 8u << 20;
  ASSERT_EQ(o.hot_fraction, kAutoHotFraction) << "auto is the default";
  auto rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const HotSplitChoice& c = (*rt)->hot_split();
  EXPECT_EQ(c.hot_fraction, kDefaultHotFraction);
  EXPECT_EQ(c.served_pinned, -1.0);
  EXPECT_NE(c.why.find("no " + DeployDir() + "/profile.gguf"), std::string::npos) << c.why;
  // A profile.gguf that is not the one packed from (the manifest names a placeholder hash): not used either.
  const std::string copy = dir_->File("deploy-other-profile");
  std::filesystem::copy(DeployDir(), copy);
  {
    std::ofstream(copy + "/profile.gguf") << "not the profile";
  }
  auto other = SparseRuntime::Open(copy, o, pool_);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ((*other)->hot_split().hot_fraction, kDefaultHotFraction);
  EXPECT_NE((*other)->hot_split().why.find("manifest.json field 'profile_hash' is 0000000000000000"),
            std::string::npos)
      << (*other)->hot_split().why;
  o.hot_fraction = kDefaultHotFraction;
  auto fixed = Open(o);
  ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
  EXPECT_EQ((*fixed)->hot_split().why, "--hot-fraction given");
  EXPECT_EQ((*fixed)->split().hot_slots, (*rt)->split().hot_slots);
  EXPECT_EQ((*fixed)->split().cold_slots, (*rt)->split().cold_slots);
  EXPECT_GT((*rt)->split().hot_slots, 0);
  // Sizes given (no budget to split): nothing chosen.
  o.memory_budget = 0;
  o.hot_slots = 2;
  o.cold_slots = 30;
  auto sized = Open(o);
  ASSERT_TRUE(sized.ok()) << sized.status().ToString();
  EXPECT_EQ((*sized)->hot_split().hot_fraction, -1.0);
}

// The cache sizes and slot shapes Open is given are checked against the deployment and the budget, each refusal
// naming what it got: a slot alignment that is not a power of two up to 4 KiB, per-layer slot lists of another length
// than the deployment's layers, explicit cache sizes that with the fixed part exceed the budget (and the same sizes
// within a budget that holds them open).
// The fixed part counts resident.gguf's parsed metadata and the runtime's tokenizer, whose estimates are checked
// against the allocator in gguf_tests and text_tests: recomputed here from the file, opened and built again.
TEST_F(OffloadTest, FixedPartCountsTheMetadataAndTheTokenizer) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  auto rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  ASSERT_NE((*rt)->tokenizer(), nullptr);
  EXPECT_EQ((*rt)->tokenizer()->n_vocab(), n_vocab_);
  auto resident = GgufFile::OpenPathUncached(DeployDir() + "/" + packer::kResidentFileName);
  ASSERT_TRUE(resident.ok()) << resident.status().ToString();
  auto tok = LoadTokenizer(*resident);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_GT((*tok)->HeapBytes(), static_cast<uint64_t>(n_vocab_) * 8);
  EXPECT_EQ((*rt)->fixed().vocabulary, resident->MetadataHeapBytes() + (*tok)->HeapBytes());
  EXPECT_NE((*rt)->Accounting().find("metadata, tokenizer"), std::string::npos) << (*rt)->Accounting();
}

TEST_F(OffloadTest, OpenRefusesCacheShapesItCannotHonour) {
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.slot_alignment = 3072;
  auto rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("slot alignment 3072"), std::string::npos) << rt.status().ToString();
  o.slot_alignment = 8192;
  rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("slot alignment 8192"), std::string::npos) << rt.status().ToString();
  o.slot_alignment = 0;
  for (const bool cold : {true, false}) {
    SparseRuntimeOptions p = o;
    (cold ? p.cold_slots_per_group : p.hot_slots_per_group).assign(2, 1);
    if (!cold) p.cold_slots_per_group.assign(5, 1);
    rt = Open(p);
    ASSERT_FALSE(rt.ok()) << (cold ? "cold" : "hot");
    EXPECT_NE(rt.status().message().find(std::string(cold ? "cold" : "hot") + " slots given for 2 layers/experts"),
              std::string::npos)
        << rt.status().ToString();
    EXPECT_NE(rt.status().message().find("has 5"), std::string::npos) << rt.status().ToString();
  }
  // 4000 cold slots per layer under an 8 MiB budget: the refusal names the bytes needed; that budget exactly opens,
  // one byte less does not.
  o.cold_slots_per_group.assign(5, 4000);
  o.memory_budget = uint64_t{8} << 20;
  rt = Open(o);
  ASSERT_FALSE(rt.ok());
  const std::string msg = rt.status().message();
  EXPECT_NE(msg.find("over the memory budget 8.00 MiB (8388608 B)"), std::string::npos) << msg;
  const size_t at = msg.find(" B), over the memory budget");
  ASSERT_NE(at, std::string::npos) << msg;
  const uint64_t need = std::stoull(msg.substr(msg.rfind('(', at) + 1));
  EXPECT_GT(need, uint64_t{20000} * 768) << msg;  // at least the 20000 bundles of 3 x 64 floats
  o.memory_budget = need - 1;
  rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("(" + std::to_string(need) + " B), over the memory budget"), std::string::npos)
      << rt.status().ToString();
  EXPECT_EQ(rt.status().message().find("the plan was made for"), std::string::npos) << "no plan, no hint";
  // Sizes from a plan made when the fixed part was counted smaller (an older nflash): the refusal says so.
  o.plan_fixed_bytes = 1000;
  rt = Open(o);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("the plan was made for a fixed part of 1000 B (1000 B): make it again"),
            std::string::npos)
      << rt.status().ToString();
  o.plan_fixed_bytes = 0;
  o.memory_budget = need;
  rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_GE((*rt)->split().cold_slots, 20000);
}

// An F16 KV cache (SparseRuntimeOptions::kv_type): the offloaded run equals, bit for bit, the in-memory sparse FFN
// over a context with the same cache type, and the fixed part counts half the KV bytes.
TEST_F(OffloadTest, HalfKvCacheEqualsInMemorySparseWithTheSameCache) {
  auto model = Model::Load(dir_->File("model.gguf"), LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  SparseFfnOptions so;
  so.mode = SparseMode::kOracle;
  so.sparse_prefill = true;
  auto sparse = SparseFfn::Create(**model, nullptr, so, pool_);
  ASSERT_TRUE(sparse.ok()) << sparse.status().ToString();
  InferenceContext ref_ctx(**model, pool_, 0, KvType::kF16);
  ref_ctx.SetFfnBackend(sparse->get());
  auto ref = Greedy(ref_ctx, n_vocab_, 20);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_FALSE(SameLogits(*ref, *sparse_)) << "the F16 cache gave the F32 cache's logits";

  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.hot_slots = 1;
  o.cold_slots = 60;
  auto f32 = Open(o);
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  o.kv_type = KvType::kF16;
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    SCOPED_TRACE(OffloadModeName(mode));
    o.mode = mode;
    auto rt = Open(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    EXPECT_EQ((*rt)->context().kv_type(), KvType::kF16);
    EXPECT_EQ((*f32)->fixed().kv_cache, 2 * (*rt)->fixed().kv_cache);
    auto run = Greedy((*rt)->context(), n_vocab_, 20);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *ref));
  }
}

// Opens the runtime with the flash file wrapped in a FaultInjectingFile; `*fi` receives it (rules are added after
// Open, which reads the oracle gate rows, so that they hit decode reads).
Result<std::unique_ptr<SparseRuntime>> OpenWithFaults(const std::string& dir, OffloadMode mode, ThreadPool* pool,
                                                      FaultInjectingFile** fi) {
  SparseRuntimeOptions o;
  o.mode = mode;
  o.active_set = ActiveSetSource::kOracle;
  o.cold_slots = 50;
  o.hot_slots = 1;
  o.wrap_flash = WrapWithFaults(fi);
  return SparseRuntime::Open(dir, o, pool);
}

// Streaming the next weights through the caches while a layer waits for its reads changes when memory is read, not
// what is computed; it streams only while waiting, at most warm_next_bytes per layer and token, and at most the
// weights computed next (the next layer's attention matrices, the output matrix after the last layer).
TEST_F(OffloadTest, WarmingTheNextWeightsChangesTimingNotResults) {
  ASSERT_TRUE(sparse_);
  for (uint64_t cap : {uint64_t{0}, uint64_t{4096}, uint64_t{1} << 30}) {
    SCOPED_TRACE("warm_next_bytes " + std::to_string(cap));
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.cold_slots = 50;
    o.hot_slots = 1;
    o.warm_next_bytes = static_cast<int64_t>(cap);
    o.wrap_flash = [](std::shared_ptr<const ReadableFile> base) -> std::shared_ptr<const ReadableFile> {
      return std::make_shared<SlowFile>(std::move(base), std::chrono::microseconds(300));
    };
    auto rt = Open(o);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    EXPECT_EQ((*rt)->ffn().warm_next_cap(), cap);
    auto run = Greedy((*rt)->context(), n_vocab_, 12);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *sparse_));
    const Model& m = (*rt)->model();
    auto bytes = [](const MatrixView& w) { return static_cast<uint64_t>(w.rows) * w.row_bytes; };
    const size_t n_layers = m.layers().size();
    uint64_t warmed = 0;
    for (size_t l = 0; l < n_layers; ++l) {
      uint64_t next = bytes(m.output());  // what layer l's wait may stream
      if (l + 1 < n_layers) {
        const LayerWeights& w = m.layers()[l + 1];
        next = bytes(w.wq) + bytes(w.wk) + bytes(w.wv) + bytes(w.wo);
      }
      const OffloadGroupStats& st = (*rt)->ffn().stats()[l];
      warmed += st.warm_next_bytes;
      EXPECT_LE(st.warm_next_bytes, std::min(cap, next) * static_cast<uint64_t>(st.tokens)) << "layer " << l;
    }
    if (cap == 0) {
      EXPECT_EQ(warmed, 0u);
    } else {
      EXPECT_GT(warmed, 0u) << "every read takes 300 us: the layers wait, and stream meanwhile";
    }
  }
  // The default: half the last-level cache.
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.cold_slots = 50;
  o.hot_slots = 1;
  auto rt = Open(o);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_EQ((*rt)->ffn().warm_next_cap(), LastLevelCacheBytes() / 2);
}

TEST_F(OffloadTest, TransientFaultsAreRetriedOnce) {
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    for (auto fault : {FaultInjectingFile::Fault::kBitFlip, FaultInjectingFile::Fault::kEio,
                       FaultInjectingFile::Fault::kShortRead}) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + " fault " + std::to_string(static_cast<int>(fault)));
      FaultInjectingFile* fi = nullptr;
      auto rt = OpenWithFaults(DeployDir(), mode, pool_, &fi);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      ASSERT_NE(fi, nullptr);
      fi->AddRule({fault, 0, UINT64_MAX, 1});  // the next read goes wrong, then the file is healthy
      auto run = Greedy((*rt)->context(), n_vocab_, 10);
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      EXPECT_EQ(run->tokens, std::vector<int32_t>(kGolden.begin(), kGolden.begin() + 10));
      EXPECT_EQ(fi->InjectedCount(), 1);
      // llmflash reads one unit at a time: exactly the faulty one is retried. Full mode reads batches, and a batch
      // stops at its first failed read: the units after it in that batch are read again too (at most once each).
      if (mode == OffloadMode::kLlmFlash) {
        EXPECT_EQ((*rt)->ffn().TotalStats().retries, 1);
      } else {
        EXPECT_GE((*rt)->ffn().TotalStats().retries, 1);
        EXPECT_LE((*rt)->ffn().TotalStats().retries, 16) << "at most the units of one chunk";
      }
      for (size_t i = 0; i < run->logits.size(); ++i) {
        ASSERT_EQ(0, std::memcmp(run->logits[i].data(), sparse_->logits[i].data(), n_vocab_ * sizeof(float)));
      }
    }
  }
}

TEST_F(OffloadTest, PersistentFaultsAreReportedWithLayerNeuronAndOffset) {
  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    for (auto fault : {FaultInjectingFile::Fault::kBitFlip, FaultInjectingFile::Fault::kEio}) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + " fault " + std::to_string(static_cast<int>(fault)));
      FaultInjectingFile* fi = nullptr;
      auto rt = OpenWithFaults(DeployDir(), mode, pool_, &fi);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      fi->AddRule({fault, 0, UINT64_MAX, -1});
      Status s = (*rt)->context().Eval(kPrompt, false);
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), fault == FaultInjectingFile::Fault::kEio ? StatusCode::kIOError : StatusCode::kCorruption)
          << s.ToString();
      EXPECT_NE(s.message().find("layer 0"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("ffn.bin offset"), std::string::npos) << s.message();
      EXPECT_TRUE(s.message().find(" neuron ") != std::string::npos ||
                  s.message().find("hot cluster") != std::string::npos) << s.message();
      EXPECT_EQ((*rt)->ffn().TotalStats().retries, 1) << "retried once, then reported";
      if (fault == FaultInjectingFile::Fault::kEio) {
        // Both failures are named: the retry's, and the first read's (not the checksum of the bytes it left).
        const size_t first = s.message().find("(first: ");
        ASSERT_NE(first, std::string::npos) << s.message();
        EXPECT_NE(s.message().find("(injected)", first), std::string::npos) << s.message();
      }
    }
  }
}

// Weights are read with O_DIRECT, never through the page cache (issue 6): with a deployment's files dropped from the
// page cache, opening it and decoding in either mode (which reads from ffn.bin) leaves none of their pages cached:
// ffn.bin, resident.gguf, and with the predictor's deployment predictor.gguf and lookahead.gguf.
TEST_F(OffloadTest, WeightsBypassThePageCache) {
  ASSERT_TRUE(sparse_ && predicted_);
  for (bool predictor : {false, true}) {
    for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + (predictor ? " predictor" : " oracle"));
      const std::string dir = predictor ? dir_->File("deploy-pred") : DeployDir();
      std::vector<std::string> files = {dir + "/ffn.bin", dir + "/resident.gguf"};
      if (predictor) {
        files.push_back(dir + "/predictor.gguf");
        files.push_back(dir + "/lookahead.gguf");
      }
      ASSERT_FALSE(OnMemoryFilesystem(dir)) << "TMPDIR is tmpfs: its files live in the page cache";
      for (const std::string& f : files) ASSERT_EQ(testing::DropFromPageCache(f), "");
      // A tool's view of the deployment (metadata and index tables only) too.
      auto tool_view = packer::Deployment::Open(dir);
      ASSERT_TRUE(tool_view.ok()) << tool_view.status().ToString();
      SparseRuntimeOptions o;
      o.mode = mode;
      o.active_set = predictor ? ActiveSetSource::kPredictor : ActiveSetSource::kOracle;
      o.cold_slots = 50;
      o.hot_slots = 1;
      auto rt = SparseRuntime::Open(dir, o, pool_);
      ASSERT_TRUE(rt.ok()) << rt.status().ToString();
      auto run = Greedy((*rt)->context(), n_vocab_, 10);
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      ASSERT_TRUE(SameLogits(*run, predictor ? *predicted_ : *sparse_));
      EXPECT_GT((*rt)->ffn().TotalStats().bytes_read, 0u);
      for (const std::string& f : files) {
        EXPECT_EQ(testing::CachedPages(f), 0) << "pages of " << f << " went through the page cache";
      }
    }
  }
}

// A token that fails leaves no bad bundle in the cache: the slots its failed and pending reads were going into (cold
// slots, hot clusters, bundles read ahead) are dropped, not released with whatever they hold, so once the flash is
// healthy again the same runtime (a server keeps serving after one request's I/O error) gives the reference bitwise:
// in both modes, with flipped bits and with read errors that persist through the retry, failing in the prompt (its
// first token reads layer 1's hot cluster) or in the decode (reads ahead pending).
TEST_F(OffloadTest, AFailedTokenLeavesNoBadBundleInTheCache) {
  struct Config {
    OffloadMode mode;
    FaultInjectingFile::Fault fault;
    HotPolicy hot;  // kLru with 5 slots: hot clusters are read on demand and stay cached, a failed one too unless
                    // it is dropped (pinned clusters are read once, at load)
    bool in_prompt;
  };
  std::vector<Config> configs;
  for (bool in_prompt : {true, false}) {
    for (HotPolicy hot : {HotPolicy::kPinned, HotPolicy::kLru}) {
      for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
        for (auto fault : {FaultInjectingFile::Fault::kBitFlip, FaultInjectingFile::Fault::kEio}) {
          configs.push_back({mode, fault, hot, in_prompt});
        }
      }
    }
  }
  for (const Config& c : configs) {
    SCOPED_TRACE(std::string(OffloadModeName(c.mode)) + " fault " + std::to_string(static_cast<int>(c.fault)) +
                 " hot " + HotPolicyName(c.hot) + (c.in_prompt ? " in the prompt" : " in the decode"));
    FaultInjectingFile* fi = nullptr;
    SparseRuntimeOptions o;
    o.mode = c.mode;
    o.active_set = ActiveSetSource::kOracle;
    o.cold_slots = 50;
    o.hot_policy = c.hot;
    o.hot_slots = c.hot == HotPolicy::kLru ? 5 : 1;
    o.batched_prefill = false;  // the prompt through the token path too (a batched prefill reads its own buffers)
    o.wrap_flash = WrapWithFaults(&fi);
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    InferenceContext& ctx = (*rt)->context();
    const packer::RegionInfo* layer1 = (*rt)->deployment().Region(1, -1);
    ASSERT_NE(layer1, nullptr);
    const FaultInjectingFile::Rule rule{c.fault, layer1->offset, layer1->size, -1};
    Status s;
    if (c.in_prompt) {
      fi->AddRule(rule);
      s = ctx.Eval(kPrompt, false);
    } else {
      ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
      fi->AddRule(rule);
      // Decode until a token needs a read from layer 1 (the first one does here: the prompt left misses).
      for (int i = 0; i < 10 && s.ok(); ++i) s = ctx.Eval(std::vector<int32_t>{kGolden[static_cast<size_t>(i)]}, false);
    }
    ASSERT_FALSE(s.ok()) << "a read from layer 1 failed twice";
    fi->ClearFaults();
    ctx.Reset();
    auto run = Greedy(ctx, n_vocab_, 10);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    ASSERT_TRUE(SameLogits(*run, *sparse_));
    for (const SlotRegion* r : {&(*rt)->ffn().cache().cold(), &(*rt)->ffn().cache().hot()}) {
      for (int32_t slot = 0; slot < r->SlotCount(); ++slot) ASSERT_EQ(r->PinCount(slot), 0) << "slot " << slot;
    }
  }
}

// Batched prefill in lent cold slots, with a bit flipped in layer 1's region: the prefetch of that region (I/O thread)
// delivers it, the checksums find it; a transient fault is read again and the run is exact; one that persists through
// the retry is reported for layer 1 with its neuron and offset. Either way the runtime stays usable: the next prompt
// (the slots still lent after the failure) and its decode give the reference bitwise, and every slot comes back.
TEST_F(OffloadTest, LentBatchedPrefillFaultsAreRetriedOrReported) {
  for (int count : {1, 2}) {
    SCOPED_TRACE(count == 1 ? "transient" : "persists through the retry");
    FaultInjectingFile* fi = nullptr;
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.cold_slots = 150;
    o.hot_slots = 1;
    o.prefill_in_cache = true;
    o.batched_prefill_min_tokens = 2;
    o.wrap_flash = WrapWithFaults(&fi);
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_TRUE((*rt)->ffn().prefill_in_cache());
    const packer::RegionInfo* layer1 = (*rt)->deployment().Region(1, -1);
    ASSERT_NE(layer1, nullptr);
    fi->AddRule({FaultInjectingFile::Fault::kBitFlip, layer1->offset, layer1->size, count});
    InferenceContext& ctx = (*rt)->context();
    if (count == 1) {
      auto run = Greedy(ctx, n_vocab_, 10);
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      ASSERT_TRUE(SameLogits(*run, *sparse_));
      EXPECT_EQ((*rt)->ffn().prefill_stats().retries, 1);
    } else {
      Status s = ctx.Eval(kPrompt, false);
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find("prefill: layer 1 neuron "), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("ffn.bin offset"), std::string::npos) << s.message();
      EXPECT_GT((*rt)->ffn().cache().cold().lent_count(), 0) << "the failed prompt still holds its lent slots";
      EXPECT_EQ(fi->InjectedCount(), 2);
      ctx.Reset();
      auto run = Greedy(ctx, n_vocab_, 10);
      ASSERT_TRUE(run.ok()) << run.status().ToString();
      ASSERT_TRUE(SameLogits(*run, *sparse_));
    }
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    EXPECT_EQ(cold.lent_count(), 0);
    for (int32_t s = 0; s < cold.SlotCount(); ++s) ASSERT_EQ(cold.PinCount(s), 0) << "slot " << s << " still pinned";
  }
}

// Faults in layer 1's bundles after the prompt, with lookahead on: they hit reads issued ahead (during layer 0) as
// well as layer 1's own. A transient one leaves the result exact; a persistent one is reported for layer 1 after
// one retry, and nothing stays pinned.
TEST_F(OffloadTest, LookaheadReadFaultsAreRetriedOrReported) {
  for (int count : {1, -1}) {
    SCOPED_TRACE(count == 1 ? "transient" : "persistent");
    FaultInjectingFile* fi = nullptr;
    auto rt = OpenWithFaults(DeployDir(), OffloadMode::kFull, pool_, &fi);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_GT((*rt)->ffn().lookahead_slots(), 0);
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    const packer::RegionInfo* layer1 = (*rt)->deployment().Region(1, -1);
    ASSERT_NE(layer1, nullptr);
    fi->AddRule({FaultInjectingFile::Fault::kBitFlip, layer1->offset, layer1->size, count});
    Status s;
    std::vector<int32_t> tokens;
    for (size_t i = 0; i < 10 && s.ok(); ++i) {
      const float* l = ctx.logits();
      if (count == 1) {
        ASSERT_EQ(0, std::memcmp(l, sparse_->logits[i].data(), n_vocab_ * sizeof(float))) << "token " << i;
      }
      const int32_t next = static_cast<int32_t>(std::max_element(l, l + n_vocab_) - l);
      tokens.push_back(next);
      s = ctx.Eval(std::vector<int32_t>{next}, false);
    }
    EXPECT_GE(fi->InjectedCount(), 1);
    if (count == 1) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_LE((*rt)->ffn().TotalStats().retries, 16);
    } else {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find("layer 1 "), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("ffn.bin offset"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("after one retry"), std::string::npos) << s.message();
    }
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    for (int32_t slot = 0; slot < cold.SlotCount(); ++slot) ASSERT_EQ(cold.PinCount(slot), 0) << "slot " << slot;
  }
}

// Bundles read ahead are checked before use (SettleLookahead, like every other arrival). Replaying a traced run's
// active sets with room for every miss of a layer reads all of layer 1's misses ahead (during layer 0), each one
// used, so after the prompt every read into layer 1's region is a read ahead. A bit flipped there once is caught and
// read again (the logits stay the reference's); flipped in every read of that region, it is reported after one retry.
TEST_F(OffloadTest, BundlesReadAheadAreVerifiedBeforeUse) {
  ASSERT_TRUE(sparse_);
  auto options = [this]() {
    SparseRuntimeOptions o;
    o.active_set = ActiveSetSource::kOracle;
    o.hot_slots = 0;
    o.cold_slots = 150;
    o.batched_prefill = false;  // every step goes through the token path, as the trace and its replay count them
    o.lookahead_slots = 172;    // n_ff: room for every miss of a layer
    return o;
  };
  const std::string trace_path = dir_->File("read-ahead-trace.txt");
  {
    auto rt = SparseRuntime::Open(DeployDir(), options(), pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto trace = AtomicFileWriter::Create(trace_path, true);
    ASSERT_TRUE(trace.ok()) << trace.status().ToString();
    (*rt)->ffn().SetActiveTrace(trace->get());
    auto run = Greedy((*rt)->context(), n_vocab_, 10);
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    (*rt)->ffn().SetActiveTrace(nullptr);
    ASSERT_TRUE((*trace)->Commit().ok());
  }
  for (int count : {1, -1}) {
    SCOPED_TRACE(count == 1 ? "transient" : "persistent");
    FaultInjectingFile* fi = nullptr;
    SparseRuntimeOptions o = options();
    o.lookahead_replay = trace_path;
    o.wrap_flash = WrapWithFaults(&fi);
    auto rt = SparseRuntime::Open(DeployDir(), o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    InferenceContext& ctx = (*rt)->context();
    ASSERT_TRUE(ctx.Eval(kPrompt, false).ok());
    const OffloadGroupStats before = (*rt)->ffn().stats()[1];
    const packer::RegionInfo* layer1 = (*rt)->deployment().Region(1, -1);
    ASSERT_NE(layer1, nullptr);
    fi->AddRule({FaultInjectingFile::Fault::kBitFlip, layer1->offset, layer1->size, count});
    const float* l = ctx.logits();
    const int32_t next = static_cast<int32_t>(std::max_element(l, l + n_vocab_) - l);
    const Status s = ctx.Eval(std::vector<int32_t>{next}, false);
    const OffloadGroupStats& after = (*rt)->ffn().stats()[1];
    EXPECT_GT(after.prefetched, before.prefetched) << "layer 1 had bundles read ahead";
    EXPECT_EQ(after.prefetch_used - before.prefetch_used, after.prefetched - before.prefetched)
        << "replayed: every bundle read ahead is used";
    EXPECT_GE(fi->InjectedCount(), 1);
    if (count == 1) {
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(after.retries - before.retries, 1);
      ASSERT_EQ(0, std::memcmp(ctx.logits(), sparse_->logits[1].data(), n_vocab_ * sizeof(float)));
    } else {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find("layer 1 neuron "), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("after one retry"), std::string::npos) << s.message();
    }
  }
}

}  // namespace
}  // namespace nflash::sparse
