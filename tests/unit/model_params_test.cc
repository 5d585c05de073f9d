// The planner's inputs from the pipeline's files: ModelParamsFromDeployment against a packed synthetic deployment and
// a hand-made profile (every figure computed here from the manifest, the layout and the profile), LoadHardwareParams
// against a hand-written hw.json.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "packer/deployment.h"
#include "packer/pack.h"
#include "planner/floors.h"
#include "planner/model_params.h"
#include "runtime/core/checksum.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/predictor.h"
#include "tests/test_util.h"
#include "tests/unit/small_model.h"

namespace nflash::planner {
namespace {

// A packed deployment of a small synthetic model (dim 64, n_ff 96, 2 layers; MoE of 4 experts, 2 per token, when
// `experts` > 0) and a hand-made profile with known curves and fractions. The profile file only needs a hash the
// manifest records: ModelParamsFromDeployment takes the profile's contents as an object.
struct PlannerInputs {
  nflash::testing::TempDir tmp;
  std::string model, profile_path, dir;
  profiler::ModelProfile profile;
  std::unique_ptr<packer::Deployment> deployment;
};

// `fractions`: a predictor shipped with the deployment, per layer {validation, held-out} predicted fraction (-1: not
// measured); empty: none.
std::unique_ptr<PlannerInputs> PackForPlanner(FfnActivation activation, int64_t experts,
                                              const std::vector<std::pair<float, float>>& fractions) {
  auto in = std::make_unique<PlannerInputs>();
  in->model = in->tmp.File("m.gguf");
  const std::string written = nflash::testing::WriteSmallModel(in->model, GgmlType::kF32, experts, activation);
  EXPECT_EQ(written, "");
  if (!written.empty()) return nullptr;
  const std::string model_hash = HashToHex(*HashFile(in->model));

  profiler::ModelProfile& p = in->profile;
  p.model_hash = model_hash;
  p.model_name = "test";
  p.activation = std::string(FfnActivationName(activation));
  p.n_layers = 2;
  p.n_ff = 96;
  p.dim = 64;
  p.n_experts = experts;
  p.tokens = 1000;
  for (int i = 0; i < profiler::kSharedCurvePoints; ++i) p.lru_hit_rate_shared.push_back(0.7f * i / 64);
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = experts > 0 ? 0 : -1; e < std::max<int64_t>(0, experts); ++e) {
      profiler::FfnProfile f;
      f.layer = l;
      f.expert = e;
      f.n_neurons = 96;
      f.tokens = experts > 0 ? 100 * (e + 1) : 1000;  // routed tokens: 100, 200, 300, 400 of 1000
      f.count_bs1.assign(96, 0);
      for (int n = 0; n < 96; ++n) f.count_bs1[static_cast<size_t>(n)] = static_cast<uint32_t>((n * 37) % 101);
      f.mean_active_fraction = 0.1 + 0.05 * static_cast<double>(l);
      for (int i = 0; i < profiler::kCurvePoints; ++i) {
        const float x = static_cast<float>(i) / 16;
        f.popularity.push_back(std::sqrt(x));
        f.lru_hit_rate.push_back(0.8f * x);
        // Layer 1 has a held-out curve, with a point above 1 (rounding in the profile's averaging).
        if (l == 1) f.popularity_heldout.push_back(i == 15 ? 1.05f : x);
      }
      p.ffns.push_back(std::move(f));
    }
  }
  in->profile_path = in->tmp.File("profile.stand-in");
  nflash::testing::WriteText(in->profile_path, "the profile's bytes (only hashed)\n");
  packer::PackOptions po;
  po.progress = false;
  po.order = packer::NeuronOrder::kHotness;
  if (!fractions.empty()) {
    PredictorData pd;
    pd.model_hash = model_hash;
    pd.model_name = "test";
    pd.activation = p.activation;
    pd.dim = 64;
    pd.n_ff = 96;
    for (auto [validation, heldout] : fractions) {
      PredictorLayerData ld;
      ld.info.rank = 8;
      ld.info.predicted_fraction = validation;
      ld.info.eval_predicted_fraction = heldout;
      ld.fc1.assign(8 * 64, 0.01f);
      ld.fc2.assign(96 * 8, 0.01f);
      pd.layers.push_back(std::move(ld));
    }
    po.predictor_path = in->tmp.File("p.gguf");
    EXPECT_TRUE(SavePredictor(pd, po.predictor_path, false).ok());
  }
  in->dir = in->tmp.File("d");
  ThreadPool pool(1);
  auto packed = packer::PackDeployment(in->model, p, HashToHex(*HashFile(in->profile_path)), in->dir, po, &pool);
  EXPECT_TRUE(packed.ok()) << packed.status().ToString();
  auto d = packer::Deployment::Open(in->dir);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  if (!d.ok()) return nullptr;
  in->deployment = std::move(*d);
  return in;
}

// x = i / 16 and the given y values as doubles.
void ExpectCurve(const Curve& c, const std::vector<double>& y, const std::string& what) {
  ASSERT_EQ(c.x.size(), y.size()) << what;
  ASSERT_EQ(c.y.size(), y.size()) << what;
  for (size_t i = 0; i < y.size(); ++i) {
    EXPECT_DOUBLE_EQ(c.x[i], static_cast<double>(i) / static_cast<double>(y.size() - 1)) << what << " x[" << i << "]";
    EXPECT_NEAR(c.y[i], y[i], 1e-6) << what << " y[" << i << "]";
  }
}

const NeuronSizes kSizes{.cold_slot = 5000, .hot_slot = 6000, .read = 7000};

// With a predictor: each layer is planned at the share its predictor selects (held-out figure first, then the
// validation split's), computing whole bundles; the curves are the profile's, with the held-out popularity where
// there is one, clamped to [0, 1], and an LRU end point of 1; every figure of the manifest and the resident image.
TEST(ModelParamsTest, APredictorsDeploymentIsPlannedAtItsPredictedShare) {
  auto in = PackForPlanner(FfnActivation::kRelu, 0, {{0.3f, 0.2f}, {0.25f, -1.0f}});
  ASSERT_NE(in, nullptr);
  auto m = ModelParamsFromDeployment(*in->deployment, in->profile, in->profile_path, 123456, kSizes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const packer::Manifest& man = in->deployment->manifest();
  const DenseWeights dense = ResidentDenseWeights(in->deployment->resident());
  EXPECT_EQ(m->name, man.model_name);
  EXPECT_EQ(m->n_layers, 2);
  EXPECT_EQ(m->fixed_bytes, 123456u);
  EXPECT_EQ(m->overflow_pool_slots, 96);
  EXPECT_TRUE(m->predictor);
  EXPECT_GT(man.predictor_bytes, 0u);
  EXPECT_EQ(m->predictor_bytes, man.predictor_bytes);
  EXPECT_EQ(m->ffn_bytes, man.flash_bytes);
  EXPECT_EQ(m->dense_bytes_per_token, dense.bytes);
  EXPECT_EQ(m->dense_matmul_params, dense.params);
  EXPECT_EQ(m->matmul_params, dense.params + 2u * 3 * 64 * 96);
  ASSERT_EQ(m->ffns.size(), 2u);
  EXPECT_DOUBLE_EQ(m->ffns[0].active_fraction, 0.2f);  // held-out
  EXPECT_DOUBLE_EQ(m->ffns[1].active_fraction, 0.25f); // validation split (no held-out figure)
  std::vector<double> sqrt_x, lru, heldout;
  for (int i = 0; i < 17; ++i) {
    sqrt_x.push_back(std::sqrt(static_cast<float>(i) / 16));
    lru.push_back(i == 16 ? 1.0 : 0.8f * static_cast<float>(i) / 16);
    heldout.push_back(i == 15 ? 1.0 : static_cast<float>(i) / 16);
  }
  for (const FfnParams& f : m->ffns) {
    const std::string what = "layer " + std::to_string(f.layer);
    EXPECT_EQ(f.expert, -1);
    EXPECT_EQ(f.n_neurons, 96);
    EXPECT_DOUBLE_EQ(f.route_fraction, 1.0);
    EXPECT_EQ(f.bundle_bytes, man.layout.bundle_bytes);
    EXPECT_EQ(f.compute_bytes, man.layout.bundle_bytes) << "a predicted neuron computes its gate row too";
    EXPECT_EQ(f.read_bytes, 7000u);
    EXPECT_EQ(f.slot_bytes, 5000u);
    EXPECT_EQ(f.hot_slot_bytes, 6000u);
    ExpectCurve(f.popularity, f.layer == 1 ? heldout : sqrt_x, what + " popularity");
    ExpectCurve(f.lru_hit, lru, what + " LRU");
  }
  std::vector<double> shared;
  for (int i = 0; i < 65; ++i) shared.push_back(i == 64 ? 1.0 : 0.7f * static_cast<float>(i) / 64);
  ExpectCurve(m->shared_lru, shared, "shared LRU");
}

// Without a predictor the runtime's oracle computes every neuron that is not exactly zero: ReLU at the profile's
// share, up and down only (its dense GEMV over the gate rows is counted with the predictor's bytes); SiLU computes
// every neuron, so a region holding x of them serves exactly x and the profile's curves (of thresholded activity),
// the shared one too, do not apply.
TEST(ModelParamsTest, TheOraclesDeploymentIsPlannedAtTheExactShare) {
  auto relu = PackForPlanner(FfnActivation::kRelu, 0, {});
  ASSERT_NE(relu, nullptr);
  auto m = ModelParamsFromDeployment(*relu->deployment, relu->profile, relu->profile_path, 1, kSizes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const packer::BundleLayout& layout = relu->deployment->layout();
  EXPECT_FALSE(m->predictor);
  EXPECT_EQ(m->predictor_bytes, 2u * 96 * layout.gate_bytes);
  ASSERT_EQ(m->ffns.size(), 2u);
  EXPECT_DOUBLE_EQ(m->ffns[0].active_fraction, 0.1);
  EXPECT_DOUBLE_EQ(m->ffns[1].active_fraction, 0.15);
  EXPECT_EQ(m->ffns[0].compute_bytes, layout.up_bytes + layout.down_bytes);
  EXPECT_EQ(m->shared_lru.y.size(), 65u);

  auto silu = PackForPlanner(FfnActivation::kSilu, 0, {});
  ASSERT_NE(silu, nullptr);
  auto s = ModelParamsFromDeployment(*silu->deployment, silu->profile, silu->profile_path, 1, kSizes);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  for (const FfnParams& f : s->ffns) {
    EXPECT_DOUBLE_EQ(f.active_fraction, 1.0);
    ExpectCurve(f.popularity, {0.0, 1.0}, "SiLU popularity");
    ExpectCurve(f.lru_hit, {0.0, 1.0}, "SiLU LRU");
  }
  EXPECT_TRUE(s->shared_lru.x.empty());
}

// MoE: each expert is a region run by the share of tokens routed to it, so per token its products cost that share
// of a dense FFN's, and the oracle's gate rows are read only for routed tokens.
TEST(ModelParamsTest, ExpertsCostTheirRouteShare) {
  auto in = PackForPlanner(FfnActivation::kRelu, 4, {});
  ASSERT_NE(in, nullptr);
  auto m = ModelParamsFromDeployment(*in->deployment, in->profile, in->profile_path, 1, kSizes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const DenseWeights dense = ResidentDenseWeights(in->deployment->resident());
  ASSERT_EQ(m->ffns.size(), 8u);
  uint64_t gate_bytes = 0;
  for (const FfnParams& f : m->ffns) {
    EXPECT_DOUBLE_EQ(f.route_fraction, 0.1 * static_cast<double>(f.expert + 1)) << f.layer << "/" << f.expert;
    // 2 experts per token: one wait for first reads per layer, shared by the two (sibling read-ahead).
    EXPECT_DOUBLE_EQ(f.first_read_share, 0.5);
    EXPECT_DOUBLE_EQ(f.Runs(), 0.05 * static_cast<double>(f.expert + 1));
    gate_bytes += static_cast<uint64_t>(96.0 * static_cast<double>(in->deployment->layout().gate_bytes) *
                                        f.route_fraction);
  }
  EXPECT_EQ(m->predictor_bytes, gate_bytes);
  // 8 regions of 3 x 64 x 96 weights, each at 2 of 4 experts per token.
  EXPECT_EQ(m->matmul_params, dense.params + 8u * 3 * 64 * 96 / 2);
}

// hw.json for one weight type: the kernels of that type only, per thread count until the first count that lacks
// one (a gap ends the list), the per-neuron path where measured (else 2/3 rows + 1/3 columns by time), the best GEMM
// of at least 128 tokens, the best memory and sequential figures, the median submission cost; other versions refused.
TEST(HardwareParamsTest, ReadsTheFiguresOfTheModelsType) {
  nlohmann::json j;
  j["format"] = "nflash.hw_profile";
  j["version"] = 1;
  j["machine"] = {{"hardware_threads", 4}};
  nlohmann::json results = nlohmann::json::array();
  auto add = [&](const char* type, int t, const char* kernel, double gbs, int tokens = 1, double gflops = 0) {
    results.push_back({{"threads", t}, {"kernel", kernel}, {"type", type}, {"tokens", tokens}, {"weight_gb_per_s", gbs},
                       {"gflop_per_s", gflops}});
  };
  add("q4_0", 1, "gemv", 2);
  add("q4_0", 1, "gemv_rows", 3);
  add("q4_0", 1, "accumulate_rows", 6);
  add("q4_0", 1, "neuron_path", 2.5);
  add("q4_0", 2, "gemv", 4);
  add("q4_0", 2, "gemv_rows", 6);
  add("q4_0", 2, "accumulate_rows", 12);
  add("q4_0", 3, "gemv", 5);  // no rows at 3 threads: the list ends at 2
  add("q4_0", 4, "gemv", 8);
  add("q4_0", 4, "gemv_rows", 8);
  add("q4_0", 4, "accumulate_rows", 8);
  add("f32", 1, "gemv", 100);  // another type
  add("f32", 2, "gemm", 1, 128, 400);
  add("q4_0", 2, "gemm", 1, 16, 99);  // too few tokens for prefill
  add("q4_0", 1, "gemm", 1, 128, 30);
  add("q4_0", 2, "gemm", 1, 512, 25);
  j["compute"] = {{"results", results},
                  {"memory", {{{"threads", 1}, {"read_gb_per_s", 5.0}}, {{"threads", 2}, {"read_gb_per_s", 9.0}},
                              {{"threads", 4}, {"read_gb_per_s", 8.0}}}}};
  nlohmann::json random = nlohmann::json::array();
  for (auto [qd, submit] : {std::pair{1, 5.0}, {8, 1.0}, {64, 3.0}}) {
    random.push_back({{"block_bytes", 4096}, {"queue_depth", qd}, {"mb_per_s", 10.0 * qd}, {"latency_mean_us", 100.0},
                      {"submit_cpu_us_per_request", submit}});
  }
  random.push_back({{"block_bytes", 65536}, {"queue_depth", 1}, {"mb_per_s", 50.0}, {"latency_mean_us", 900.0}});
  j["flash"] = {{"random_read", random},
                {"sequential_read", {{{"mb_per_s", 800.0}}, {{"mb_per_s", 1200.0}}, {{"mb_per_s", 1000.0}}}}};
  nflash::testing::TempDir tmp;
  const std::string path = tmp.File("hw.json");
  nflash::testing::WriteText(path, j.dump(1));
  auto hw = LoadHardwareParams(path, "q4_0");
  ASSERT_TRUE(hw.ok()) << hw.status().ToString();
  EXPECT_EQ(hw->cores, 4);
  EXPECT_EQ(hw->dense_gemv_gbs, (std::vector<double>{2, 4}));
  ASSERT_EQ(hw->sparse_ffn_gbs.size(), 2u);
  EXPECT_DOUBLE_EQ(hw->sparse_ffn_gbs[0], 2.5);
  EXPECT_DOUBLE_EQ(hw->sparse_ffn_gbs[1], 1.0 / (2.0 / 3.0 / 6 + 1.0 / 3.0 / 12));  // 7.2
  EXPECT_DOUBLE_EQ(hw->gemm_gflops, 30);
  EXPECT_DOUBLE_EQ(hw->mem_bw_gbs, 9);
  ASSERT_EQ(hw->random_reads.size(), 4u);
  EXPECT_EQ(hw->random_reads[3].request_bytes, 65536u);
  EXPECT_DOUBLE_EQ(hw->random_reads[3].mean_latency_us, 900);
  EXPECT_DOUBLE_EQ(hw->submit_us_per_request, 3);
  EXPECT_DOUBLE_EQ(hw->seq_read_mbs, 1200);

  j["version"] = 2;
  nflash::testing::WriteText(path, j.dump(1));
  auto v2 = LoadHardwareParams(path, "q4_0");
  ASSERT_FALSE(v2.ok());
  EXPECT_NE(v2.status().message().find("field 'version': expected 1, found 2"), std::string::npos)
      << v2.status().ToString();
}

}  // namespace
}  // namespace nflash::planner
