// Batched prefill of the flash-offloaded FFN (runtime/sparse/offload_prefill.cc): the whole prompt through whole-region
// reads and GEMMs gives, logit for logit at every prompt position, the token-by-token offloaded run (bitwise, oracle)
// and the in-memory engine (the in-memory sparse FFN bitwise; the dense engine within float tolerance), on
// stories260K-relu (F32) and a small synthetic Q8_0 model; predictor deployments prefill densely; budgets without
// room for the two layer buffers borrow cold-cache slots for them, and a cold region too small for that falls back
// to token by token; the hot region is warmed by prefill.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "converter/readers.h"
#include "converter/synth.h"
#include "packer/pack.h"
#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/sparse/sparse_runtime.h"
#include "tests/test_util.h"
#include "tests/unit/offload_test_util.h"

namespace nflash::sparse {
namespace {

// 70 tokens: one full kPrefillTokenTile (64) and a partial one. Ids from a seed (any id below the vocabulary is valid
// input).
std::vector<int32_t> Prompt(int64_t n_vocab, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p{1};
  while (p.size() < n) p.push_back(static_cast<int32_t>(3 + rng() % static_cast<uint32_t>(n_vocab - 3)));
  return p;
}

// Logits of every prompt position, then of `decode` greedy tokens after it.
Result<std::vector<std::vector<float>>> Logits(InferenceContext& ctx, int64_t n_vocab,
                                               const std::vector<int32_t>& prompt, int decode) {
  std::vector<std::vector<float>> out;
  NF_RETURN_IF_ERROR(ctx.Eval(prompt, true));
  for (size_t i = 0; i < prompt.size(); ++i) {
    const float* l = ctx.logits(static_cast<int64_t>(i));
    out.emplace_back(l, l + n_vocab);
  }
  for (int d = 0; d < decode; ++d) {
    const std::vector<float>& l = out.back();
    const int32_t next = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{next}, false));
    out.emplace_back(ctx.logits(), ctx.logits() + n_vocab);
  }
  return out;
}

void ExpectBitwise(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float))) << "logits of position " << i;
  }
}

void ExpectClose(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, float tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    float worst = 0;
    for (size_t j = 0; j < a[i].size(); ++j) worst = std::max(worst, std::fabs(a[i][j] - b[i][j]));
    ASSERT_LE(worst, tol) << "logits of position " << i;
  }
}

// A deployment of `model_path` packed with a profile counted from a dense run over `prompt`.
void PackFrom(const std::string& model_path, const std::vector<int32_t>& prompt, const std::string& out_dir,
              const std::string& predictor_path, ThreadPool* pool) {
  auto model = Model::Load(model_path, LoadOptions{});
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  profiler::ModelProfile prof = EmptyReluProfile(model_path, hp);
  InferenceContext ctx(**model, pool, 0);
  ctx.SetFfnObserver(CountActivations(&prof, hp.n_ff));
  ASSERT_TRUE(ctx.Eval(prompt, false).ok());
  FinishCounts(&prof);
  packer::PackOptions po;
  po.hot_fraction = 0.3;
  po.progress = false;
  po.predictor_path = predictor_path;
  auto packed = packer::PackDeployment(model_path, prof, "0000000000000000", out_dir, po, pool);
  ASSERT_TRUE(packed.ok()) << packed.status().ToString();
}

class OffloadPrefillTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    pool_ = new ThreadPool(2);
  }
  static void TearDownTestSuite() {
    delete pool_;
    delete dir_;
  }

  // Offloaded logits for `prompt` (+ decode) with batched prefill on or off.
  static std::vector<std::vector<float>> Offloaded(const std::string& deploy, SparseRuntimeOptions o, bool batched,
                                                   const std::vector<int32_t>& prompt, int decode,
                                                   OffloadPrefillStats* stats = nullptr,
                                                   std::vector<PrefillLayerTiming>* layers = nullptr) {
    o.batched_prefill = batched;
    auto rt = SparseRuntime::Open(deploy, o, pool_);
    EXPECT_TRUE(rt.ok()) << rt.status().ToString();
    if (!rt.ok()) return {};
    EXPECT_EQ((*rt)->ffn().batched_prefill(), batched);
    auto l = Logits((*rt)->context(), (*rt)->model().hparams().n_vocab, prompt, decode);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (stats) *stats = (*rt)->ffn().prefill_stats();
    if (layers) *layers = (*rt)->ffn().prefill_layers();
    return l.ok() ? *l : std::vector<std::vector<float>>{};
  }

  static testing::TempDir* dir_;
  static ThreadPool* pool_;
};
testing::TempDir* OffloadPrefillTest::dir_ = nullptr;
ThreadPool* OffloadPrefillTest::pool_ = nullptr;

TEST_F(OffloadPrefillTest, Stories260KReluF32) {
  const std::string model_path = dir_->File("s.gguf");
  const Status written = WriteStoriesReluF32(model_path);
  ASSERT_TRUE(written.ok()) << written.ToString();
  auto model = Model::Load(model_path, LoadOptions{});
  ASSERT_TRUE(model.ok());
  const int64_t n_vocab = (*model)->hparams().n_vocab;
  const std::vector<int32_t> prompt = Prompt(n_vocab, 70, 11);
  PackFrom(model_path, prompt, dir_->File("s-deploy"), "", pool_);

  // References: the in-memory oracle sparse FFN run token by token (bitwise target) and the dense engine.
  SparseFfnOptions so;
  so.sparse_prefill = true;
  auto sparse = SparseFfn::Create(**model, nullptr, so, pool_);
  ASSERT_TRUE(sparse.ok());
  InferenceContext sctx(**model, pool_, 0);
  sctx.SetFfnBackend(sparse->get());
  auto ref = Logits(sctx, n_vocab, prompt, 5);
  ASSERT_TRUE(ref.ok());
  InferenceContext dctx(**model, pool_, 0);
  auto dense = Logits(dctx, n_vocab, prompt, 5);
  ASSERT_TRUE(dense.ok());

  for (OffloadMode mode : {OffloadMode::kFull, OffloadMode::kLlmFlash}) {
    for (int64_t hot : {0, 4}) {
      SCOPED_TRACE(std::string(OffloadModeName(mode)) + " hot " + std::to_string(hot));
      SparseRuntimeOptions o;
      o.mode = mode;
      o.active_set = ActiveSetSource::kOracle;
      o.hot_slots = hot;
      o.hot_policy = HotPolicy::kLru;  // warmed from prefill (a pinned region is loaded at start instead)
      o.cold_slots = 40;
      OffloadPrefillStats st;
      std::vector<PrefillLayerTiming> per_layer;
      auto batched = Offloaded(dir_->File("s-deploy"), o, true, prompt, 5, &st, &per_layer);
      auto token = Offloaded(dir_->File("s-deploy"), o, false, prompt, 5);
      ExpectBitwise(batched, token);
      ExpectBitwise(batched, *ref);
      // Against the dense engine: different summation order of the down projection only.
      ExpectClose(batched, *dense, 1e-3f);
      const int64_t n_layers = (*model)->hparams().n_layers;
      EXPECT_EQ(st.layers, n_layers);
      EXPECT_EQ(st.tokens, n_layers * static_cast<int64_t>(prompt.size()));
      EXPECT_EQ(st.retries, 0);
      // Every layer's region read once (sequentially), the next one prefetched in full mode.
      auto d = packer::Deployment::Open(dir_->File("s-deploy"));
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(st.bytes_read, (*d)->manifest().flash_bytes);
      EXPECT_EQ(st.prefetch_hits, mode == OffloadMode::kFull ? n_layers - 1 : 0);
      // Fig. 8's per-layer breakdown: one entry per layer, in order, each layer's whole region read and computed;
      // a blocking read is waited for in full, and what the compute thread waited adds up to the stats' total.
      ASSERT_EQ(static_cast<int64_t>(per_layer.size()), n_layers);
      uint64_t bytes = 0, wait = 0;
      for (int64_t l = 0; l < n_layers; ++l) {
        const PrefillLayerTiming& t = per_layer[static_cast<size_t>(l)];
        EXPECT_EQ(t.layer, l);
        EXPECT_EQ(t.bytes, (*d)->Region(l, -1)->size);
        EXPECT_GT(t.read_ns, 0u);
        EXPECT_GT(t.compute_ns, 0u);
        if (mode == OffloadMode::kLlmFlash) {
          EXPECT_GE(t.wait_ns, t.read_ns);
        }
        bytes += t.bytes;
        wait += t.wait_ns;
      }
      EXPECT_EQ(bytes, st.bytes_read);
      EXPECT_EQ(wait, st.io_wait_ns);
      if (hot > 0) {
        EXPECT_GT(st.warmed_clusters, 0) << "the hot region is warmed from what prefill read";
      } else {
        EXPECT_EQ(st.warmed_clusters, 0);
      }
    }
  }

  // Without a budget the buffers are memory of their own, counted in the fixed part. Under a budget (here one with
  // room for the fixed part but not for the buffers) prefill borrows cold-cache slots for them (the cold region
  // holds them here), with the same logits; decode takes the slots back.
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.batched_prefill = true;
  auto probe = SparseRuntime::Open(dir_->File("s-deploy"), o, pool_);
  ASSERT_TRUE(probe.ok());
  auto d = packer::Deployment::Open(dir_->File("s-deploy"));
  ASSERT_TRUE(d.ok());
  const uint64_t buffers = OffloadFfn::PrefillBufferBytes(**d);
  ASSERT_GT(buffers, 0u);
  EXPECT_EQ((*probe)->ffn().prefill_bytes(), buffers);
  const uint64_t fixed_without = (*probe)->fixed().Total() - buffers;
  o.memory_budget = fixed_without + buffers / 2;
  auto small = SparseRuntime::Open(dir_->File("s-deploy"), o, pool_);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_TRUE((*small)->ffn().batched_prefill());
  EXPECT_TRUE((*small)->ffn().prefill_in_cache());
  EXPECT_EQ((*small)->ffn().prefill_bytes(), 0u);
  // Buffers not allocated are not counted (the fixed part may be smaller still: with a budget, the miss staging
  // reserve becomes cold slots).
  EXPECT_LE((*small)->fixed().Total(), fixed_without);
  EXPECT_LE((*small)->fixed().Total() + (*small)->split().hot_bytes + (*small)->split().cold_bytes, o.memory_budget);
  auto ref3 = std::vector<std::vector<float>>(ref->begin(), ref->begin() + static_cast<long>(prompt.size()) + 3);
  // The prompt and 3 decode tokens through `r` give the reference's logits bitwise.
  auto expect_reference = [&](SparseRuntime& r) {
    auto l = Logits(r.context(), n_vocab, prompt, 3);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    ExpectBitwise(*l, ref3);
  };
  expect_reference(**small);
  EXPECT_EQ((*small)->ffn().prefill_stats().layers, (*small)->model().hparams().n_layers) << "one batched prompt";
  EXPECT_GT((*small)->ffn().prefill_stats().warmed_bundles, 0) << "the last prompt tokens' neurons warm the cold region";
  EXPECT_EQ((*small)->ffn().cache().cold().lent_count(), 0) << "decode took the lent slots back";
  // A second prompt after decode lends them again and still matches (the cache held decode's bundles meanwhile).
  (*small)->context().Reset();
  expect_reference(**small);
  // Cold slots fewer than the buffers need: token by token.
  SparseRuntimeOptions tiny = o;
  tiny.memory_budget = 0;
  tiny.prefill_in_cache = true;
  tiny.cold_overflow = false;
  tiny.cold_slots_per_group.assign(static_cast<size_t>((*small)->model().hparams().n_layers), 1);
  auto few = SparseRuntime::Open(dir_->File("s-deploy"), tiny, pool_);
  ASSERT_TRUE(few.ok()) << few.status().ToString();
  EXPECT_FALSE((*few)->ffn().batched_prefill());
  expect_reference(**few);
  // A budget with room for the buffers beside the rest lends them too: the memory is cache while decoding.
  o.memory_budget = fixed_without + buffers + (size_t{1} << 20);
  auto roomy = SparseRuntime::Open(dir_->File("s-deploy"), o, pool_);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  EXPECT_TRUE((*roomy)->ffn().batched_prefill());
  EXPECT_TRUE((*roomy)->ffn().prefill_in_cache());
  EXPECT_EQ((*roomy)->ffn().prefill_bytes(), 0u);
  EXPECT_LE((*roomy)->fixed().Total(), fixed_without);
  EXPECT_GE((*roomy)->split().cold_bytes, (*small)->split().cold_bytes + buffers / 2);
  EXPECT_LE((*roomy)->fixed().Total() + (*roomy)->split().hot_bytes + (*roomy)->split().cold_bytes, o.memory_budget);
  // A prompt shorter than batched_prefill_min_tokens goes through the decode path: no batched layer, same logits.
  o.batched_prefill_min_tokens = static_cast<int64_t>(prompt.size()) + 1;
  auto shorter = SparseRuntime::Open(dir_->File("s-deploy"), o, pool_);
  ASSERT_TRUE(shorter.ok()) << shorter.status().ToString();
  EXPECT_TRUE((*shorter)->ffn().batched_prefill());
  expect_reference(**shorter);
  EXPECT_EQ((*shorter)->ffn().prefill_stats().layers, 0);
  EXPECT_EQ((*shorter)->ffn().prefill_stats().bytes_read, 0u);

  // A prompt longer than the context's maximum batch runs in chunks: prefill_layers keeps every chunk's passes, in
  // order and numbered, the logits stay the reference's, and the next prompt (after decode) starts the record over.
  SparseRuntimeOptions chunked;
  chunked.active_set = ActiveSetSource::kOracle;
  chunked.batched_prefill = true;
  chunked.batched_prefill_min_tokens = 8;
  chunked.max_batch = static_cast<int64_t>(prompt.size()) / 2;
  auto rc = SparseRuntime::Open(dir_->File("s-deploy"), chunked, pool_);
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  const int64_t n_layers = (*rc)->model().hparams().n_layers;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("prompt " + std::to_string(round));
    (*rc)->context().Reset();
    expect_reference(**rc);
    EXPECT_EQ((*rc)->ffn().prefill_stats().layers, (round + 1) * 2 * n_layers);
    const std::vector<PrefillLayerTiming>& rows = (*rc)->ffn().prefill_layers();
    ASSERT_EQ(static_cast<int64_t>(rows.size()), 2 * n_layers);
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(rows[i].chunk, static_cast<int64_t>(i) / n_layers) << "row " << i;
      EXPECT_EQ(rows[i].layer, static_cast<int64_t>(i) % n_layers) << "row " << i;
    }
  }
}

// Decode starts warm, by a rule the test replays from the dense engine's activations: for each layer, the cold region
// gets the neurons (h != 0) of the last prompt tokens, newest token first and within a token in index order, up to the
// layer's share of the cold slots (in proportion to its active neurons per token in manifest.json, what rounding
// leaves to the first layers), leaving out the neurons of the hot prefix when there is a hot region; they are
// acquired oldest first, so the last token's are the most recently used; the hot region gets each layer's most popular
// clusters, an equal share of its slots per layer (the first layers take the remainder); none of it counts as a
// token's lookups.
TEST_F(OffloadPrefillTest, PrefillWarmsTheCachesWithTheLastTokensNeurons) {
  const std::string model_path = dir_->File("w.gguf");
  const Status written = WriteStoriesReluF32(model_path);
  ASSERT_TRUE(written.ok()) << written.ToString();
  auto model = Model::Load(model_path, LoadOptions{});
  ASSERT_TRUE(model.ok());
  const LlamaHparams& hp = (*model)->hparams();
  const std::vector<int32_t> prompt = Prompt(hp.n_vocab, 70, 11);
  const std::string deploy = dir_->File("w-deploy");
  PackFrom(model_path, prompt, deploy, "", pool_);
  auto d = packer::Deployment::Open(deploy);
  ASSERT_TRUE(d.ok());

  // The dense engine's neurons with h != 0, per layer and prompt token. A gate within 1e-4 of 0 could fall either way
  // in the sparse path (its residual stream differs from the dense one in rounding): its layer is not checked.
  const size_t n_tok = prompt.size();
  const int64_t n_ff = hp.n_ff, n_layers = hp.n_layers;
  std::vector<std::vector<std::vector<int32_t>>> used(static_cast<size_t>(n_layers),
                                                      std::vector<std::vector<int32_t>>(n_tok));
  std::vector<bool> ambiguous(static_cast<size_t>(n_layers), false);
  InferenceContext dctx(**model, pool_, 0);
  dctx.SetFfnObserver([&](const FfnObservation& o) {
    for (int64_t r = 0; r < o.n_tokens; ++r) {
      const int64_t t = o.first_token + r;
      for (int64_t i = 0; i < n_ff; ++i) {
        const float g = o.gate_act[r * n_ff + i];
        if (g > 0.0f && g < 1e-4f && t + kWarmTokens >= static_cast<int64_t>(n_tok)) ambiguous[o.layer] = true;
        if (o.hidden[r * n_ff + i] != 0.0f) used[o.layer][t].push_back(static_cast<int32_t>(i));
      }
    }
  });
  ASSERT_TRUE(dctx.Eval(prompt, false).ok());

  // The layers' activity, read from the deployment's manifest; the shares must differ from equal ones.
  const nlohmann::json manifest = nlohmann::json::parse(testing::ReadText(deploy + "/manifest.json"));
  std::vector<double> active;
  for (const auto& r : manifest["regions"]) active.push_back(r["active_per_token"].get<double>());
  const double active_sum = std::accumulate(active.begin(), active.end(), 0.0);
  ASSERT_NE(static_cast<int64_t>(std::floor(40 * active[0] / active_sum)), 40 / n_layers)
      << "the test needs uneven layers";
  // Shares of a pool of 40 (with and without a hot region), and a pool in which each layer's share holds all its
  // neurons (the last 8 tokens' all fit).
  const int64_t every = static_cast<int64_t>(
      std::ceil(static_cast<double>(n_ff) * active_sum / *std::min_element(active.begin(), active.end())));
  for (auto [hot_slots, cold_slots] : {std::pair<int64_t, int64_t>{0, 40}, {7, 40}, {0, every}}) {
    SCOPED_TRACE("hot slots " + std::to_string(hot_slots) + ", cold slots " + std::to_string(cold_slots));
    SparseRuntimeOptions o;
    o.mode = OffloadMode::kLlmFlash;
    o.active_set = ActiveSetSource::kOracle;
    o.batched_prefill = true;
    o.hot_slots = hot_slots;
    o.hot_policy = HotPolicy::kLru;
    o.cluster_groups = 2;  // clusters of 10 neurons (two pages of 5 bundles): several per layer's hot prefix
    o.cold_slots = cold_slots;  // one pool, shared out over the layers by their activity
    o.preload_cold = false;     // what the prefill puts in, alone
    auto rt = SparseRuntime::Open(deploy, o, pool_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    ASSERT_TRUE((*rt)->context().Eval(prompt, false).ok());
    const SlotRegion& cold = (*rt)->ffn().cache().cold();
    const SlotRegion& hot = (*rt)->ffn().cache().hot();
    ASSERT_EQ(cold.SlotCount(), cold_slots);
    ASSERT_TRUE(cold.config().slots_per_group.empty());
    // The layers' shares: rounded down, then what is left a slot each to the first layers.
    std::vector<int64_t> rooms;
    for (double a : active) {
      rooms.push_back(static_cast<int64_t>(std::floor(static_cast<double>(cold_slots) * a / active_sum)));
    }
    for (int64_t& r : rooms) r += std::accumulate(rooms.begin(), rooms.end(), int64_t{0}) < cold_slots ? 1 : 0;
    uint64_t warmed = 0;
    std::vector<std::vector<int32_t>> expected(static_cast<size_t>(n_layers));
    int checked = 0;
    for (int64_t l = 0; l < n_layers; ++l) {
      const packer::RegionInfo& region = *(*d)->Region(l, -1);
      const int64_t room = rooms[static_cast<size_t>(l)];
      std::vector<int32_t>& e = expected[static_cast<size_t>(l)];
      std::vector<bool> taken(static_cast<size_t>(n_ff), false);
      for (size_t back = 1; back <= kWarmTokens && static_cast<int64_t>(e.size()) < room; ++back) {
        for (int32_t n : used[static_cast<size_t>(l)][n_tok - back]) {
          if (static_cast<int64_t>(e.size()) == room) break;
          const bool hot_path = hot_slots > 0 && region.slot_of_neuron[n] < region.hot_count;
          if (!taken[n] && !hot_path) e.push_back(n);
          taken[n] = true;
        }
      }
      if (room < n_ff) {
        ASSERT_EQ(static_cast<int64_t>(e.size()), room) << "layer " << l << ": too few neurons to fill its share";
      } else {
        // Every neuron of the last 8 tokens, the oldest one's included (more than the newest 7 tokens had).
        std::vector<bool> newer(static_cast<size_t>(n_ff), false);
        int64_t in_newest_7 = 0;
        for (size_t back = 1; back < kWarmTokens; ++back) {
          for (int32_t n : used[static_cast<size_t>(l)][n_tok - back]) {
            if (!newer[n]) ++in_newest_7;
            newer[n] = true;
          }
        }
        EXPECT_GT(static_cast<int64_t>(e.size()), in_newest_7) << "layer " << l;
      }
      warmed += e.size();
      // Warming is not a token's lookups.
      EXPECT_EQ(cold.counters(l).hits + cold.counters(l).misses, 0u) << "layer " << l;
      // The hot region: clusters 0 .. share - 1 of each layer, the first layers one more of the remainder.
      const int64_t per_cluster = (*rt)->ffn().cache().hot_cluster_neurons();
      const int64_t n_clusters = hot_slots > 0 ? (region.hot_count + per_cluster - 1) / per_cluster : 0;
      const int64_t share = hot_slots / n_layers + (l < hot_slots % n_layers ? 1 : 0);
      for (int64_t c = 0; c < n_clusters; ++c) {
        EXPECT_EQ(hot.Find(l, c) >= 0, c < share) << "layer " << l << " cluster " << c;
      }
      if (ambiguous[static_cast<size_t>(l)]) continue;
      ++checked;
      for (int32_t n = 0; n < n_ff; ++n) {
        const bool want = std::find(e.begin(), e.end(), n) != e.end();
        EXPECT_EQ(cold.Find(l, n) >= 0, want) << "layer " << l << " neuron " << n;
      }
    }
    EXPECT_GE(checked, 3) << "too many layers with a gate near 0 to check";
    ASSERT_EQ(hot.SlotCount(), hot_slots);
    // Acquired layer by layer, each layer's list oldest first: the least recently used is layer 0's last.
    if (!ambiguous[0] && cold_slots < n_ff) {
      const int32_t victim = cold.NextVictim(0);
      ASSERT_GE(victim, 0);
      EXPECT_EQ(cold.GroupOf(victim), 0);
      EXPECT_EQ(cold.UnitOf(victim), expected[0].back());
    }
    EXPECT_EQ((*rt)->ffn().prefill_stats().warmed_bundles, warmed);
    EXPECT_EQ((*rt)->ffn().prefill_stats().warmed_clusters, static_cast<uint64_t>(hot_slots));
  }
}

TEST_F(OffloadPrefillTest, SyntheticQ8_0AndPredictorDeployment) {
  converter::SynthOptions so;
  so.shape = "custom";
  so.dim = 64;
  so.ffn = 96;  // 96 = 4 groups of 20 bundles + 16: strided views with a partial last group
  so.layers = 3;
  so.heads = 4;
  so.vocab = 260;
  so.context = 128;
  so.type = GgmlType::kQ8_0;
  const std::string model_path = dir_->File("q8.gguf");
  auto model = WriteSyntheticModel(so, model_path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  const std::vector<int32_t> prompt = Prompt(hp.n_vocab, 70, 5);

  // A predictor from a seed (only that both runtimes use the same one matters).
  std::mt19937 rng(3);
  ASSERT_TRUE(WriteRandomPredictor(model_path, hp, &rng, dir_->File("q8-pred.gguf")).ok());
  PackFrom(model_path, prompt, dir_->File("q8-deploy"), "", pool_);
  PackFrom(model_path, prompt, dir_->File("q8-deploy-pred"), dir_->File("q8-pred.gguf"), pool_);

  // Oracle: bitwise the in-memory sparse FFN (which requantizes the down columns as the packer does).
  SparseFfnOptions sfo;
  sfo.sparse_prefill = true;
  auto sparse = SparseFfn::Create(**model, nullptr, sfo, pool_);
  ASSERT_TRUE(sparse.ok());
  InferenceContext sctx(**model, pool_, 0);
  sctx.SetFfnBackend(sparse->get());
  auto ref = Logits(sctx, hp.n_vocab, prompt, 4);
  ASSERT_TRUE(ref.ok());
  SparseRuntimeOptions o;
  o.active_set = ActiveSetSource::kOracle;
  o.hot_slots = 2;
  o.cold_slots = 30;
  auto batched = Offloaded(dir_->File("q8-deploy"), o, true, prompt, 4);
  ExpectBitwise(batched, *ref);
  ExpectBitwise(batched, Offloaded(dir_->File("q8-deploy"), o, false, prompt, 4));

  // Predictor deployment: the offloaded batched prefill (OffloadFfn::ForwardBatch: whole regions read, each token's
  // predicted neurons computed from the layer buffer) equals the in-memory predictor run and the offloaded
  // token-by-token prefill bitwise.
  auto predictor = Predictor::Load(dir_->File("q8-pred.gguf"));
  ASSERT_TRUE(predictor.ok()) << predictor.status().ToString();
  SparseFfnOptions pfo;
  pfo.mode = SparseMode::kPredictor;
  ASSERT_GE(static_cast<int64_t>(prompt.size()), pfo.batched_prefill_min_tokens);
  auto psparse = SparseFfn::Create(**model, predictor->get(), pfo, pool_);
  ASSERT_TRUE(psparse.ok());
  InferenceContext pctx(**model, pool_, 0);
  pctx.SetFfnBackend(psparse->get());
  auto pref = Logits(pctx, hp.n_vocab, prompt, 0);
  ASSERT_TRUE(pref.ok());
  SparseRuntimeOptions po;
  po.active_set = ActiveSetSource::kPredictor;
  po.cold_slots = 30;
  OffloadPrefillStats pstats;
  auto pbatched = Offloaded(dir_->File("q8-deploy-pred"), po, true, prompt, 4, &pstats);
  EXPECT_EQ(pstats.layers, hp.n_layers) << "the prompt did not go through the batched path";
  ExpectBitwise(pbatched, Offloaded(dir_->File("q8-deploy-pred"), po, false, prompt, 4));
  ExpectBitwise(std::vector<std::vector<float>>(pbatched.begin(), pbatched.begin() + prompt.size()), *pref);
  // Not the dense function: computing every neuron (what this path did before) gives other logits, so the test can
  // tell which one ran.
  InferenceContext dctx(**model, pool_, 0);
  auto dense = Logits(dctx, hp.n_vocab, prompt, 0);
  ASSERT_TRUE(dense.ok());
  bool differ = false;
  for (size_t i = 0; i < dense->size() && !differ; ++i) differ = (*dense)[i] != pbatched[i];
  EXPECT_TRUE(differ);
}

}  // namespace
}  // namespace nflash::sparse
