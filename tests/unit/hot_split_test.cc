// The cache split without a plan: all pinned or all one LRU pool, by the profile's curves (runtime/sparse/hot_split.h).
// Every expected share below is worked out by hand from curves made for it (linear interpolation between the points
// x = i / 16, or i / 64 for the shared-pool curve).
#include "runtime/sparse/hot_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace nflash::sparse {
namespace {

// y_i = f(i / (points - 1)).
template <typename F>
std::vector<float> Points(int points, F f) {
  std::vector<float> y;
  for (int i = 0; i < points; ++i) y.push_back(static_cast<float>(f(static_cast<double>(i) / (points - 1))));
  return y;
}

profiler::FfnProfile Ffn(int64_t layer, int64_t expert, int64_t n, double active, int64_t tokens) {
  profiler::FfnProfile f;
  f.layer = layer;
  f.expert = expert;
  f.n_neurons = n;
  f.mean_active_fraction = active;
  f.tokens = tokens;
  // Pinning the hottest x serves min(1, 2x); an LRU of x hits x^2 (0 at the start, 1 at the end: what the replay
  // measures of a cache that holds the whole layer is overwritten with 1 anyway).
  f.popularity = Points(profiler::kCurvePoints, [](double x) { return std::min(1.0, 2 * x); });
  f.lru_hit_rate = Points(profiler::kCurvePoints, [](double x) { return x * x; });
  return f;
}

packer::Manifest ManifestOf(const profiler::ModelProfile& p) {
  packer::Manifest m;
  for (const profiler::FfnProfile& f : p.ffns) {
    packer::RegionInfo r;
    r.layer = f.layer;
    r.expert = f.expert;
    r.n_neurons = f.n_neurons;
    m.regions.push_back(r);
  }
  return m;
}

profiler::ModelProfile TwoLayers() {
  profiler::ModelProfile p;
  p.n_layers = 2;
  p.n_ff = 160;
  p.tokens = 100;
  p.ffns = {Ffn(0, -1, 160, 0.1, 100), Ffn(1, -1, 160, 0.3, 100)};
  return p;
}

TEST(HotSplitTest, PinsWhenThePopularityCurveServesMore) {
  const profiler::ModelProfile p = TwoLayers();
  // Pinned: layer 0 holds 40 of 160 (x 0.25: serves 0.5), layer 1 holds 20 (x 0.125: 0.25); weights 16 and 48
  // active neurons per token: (16 * 0.5 + 48 * 0.25) / 64 = 0.3125. LRU of 160 slots of 320 neurons (x 0.5): each
  // layer's own curve (no shared one) 0.25.
  auto c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 160, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_pinned, 0.3125, 1e-6);
  EXPECT_NEAR(c->served_lru, 0.25, 1e-6);
  EXPECT_EQ(c->hot_fraction, 1.0);
  EXPECT_NE(c->why.find("pinned"), std::string::npos) << c->why;
  EXPECT_NE(c->why.find("per-layer curves"), std::string::npos) << c->why;
}

TEST(HotSplitTest, TiesGoToPinning) {
  profiler::ModelProfile p = TwoLayers();
  // An LRU curve of 0.625 x: at x 0.5 it serves 0.3125, what pinning serves in the case above (the planner's rule:
  // ties to the hot region, which needs no bookkeeping per hit).
  for (auto& f : p.ffns) f.lru_hit_rate = Points(profiler::kCurvePoints, [](double x) { return 0.625 * x; });
  auto c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 160, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->served_pinned, c->served_lru);
  EXPECT_EQ(c->hot_fraction, 1.0);
}

TEST(HotSplitTest, OneLruPoolWhenItsCurveServesMore) {
  profiler::ModelProfile p = TwoLayers();
  // LRU curves that beat pinning: hit rate sqrt(x) per layer; at x = 0.5 the interpolation between the points
  // 8/16 (exact: sqrt(0.5)) gives 0.70711.
  for (auto& f : p.ffns) f.lru_hit_rate = Points(profiler::kCurvePoints, [](double x) { return std::sqrt(x); });
  auto c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 160, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_lru, std::sqrt(0.5), 1e-6);
  EXPECT_EQ(c->hot_fraction, 0.0);
  // The shared pool's own curve, when the profile has one, decides instead: 0.2 flat (1 at the very end) at x 0.5.
  p.lru_hit_rate_shared = Points(profiler::kSharedCurvePoints, [](double x) { return x < 1 ? 0.2 : 0.9; });
  c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 160, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_lru, 0.2, 1e-6);
  EXPECT_EQ(c->hot_fraction, 1.0);
  EXPECT_NE(c->why.find("shared-pool curve"), std::string::npos) << c->why;
  // A pool of every neuron misses nothing in a steady decode (the replay's last point, 0.9, is its warm-up).
  c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 320, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_lru, 1.0, 1e-6);
}

TEST(HotSplitTest, HeldOutPopularityAndRoutingWeighTheChoice) {
  profiler::ModelProfile p;
  p.n_layers = 1;
  p.n_ff = 64;
  p.n_experts = 2;
  p.tokens = 100;
  // Expert 0 runs on 75 of 100 tokens, expert 1 on 25: 0.2 * 64 * 0.75 = 9.6 and 0.2 * 64 * 0.25 = 3.2 active
  // neurons per token.
  p.ffns = {Ffn(0, 0, 64, 0.2, 75), Ffn(0, 1, 64, 0.2, 25)};
  // Expert 1's held-out curve (what pinning serves on unseen tokens) is flat 0.1: it replaces the in-sample one.
  p.ffns[1].popularity_heldout = Points(profiler::kCurvePoints, [](double x) { return x > 0 ? 0.1 : 0.0; });
  // Both pin 16 of 64 (x 0.25): expert 0 serves 0.5, expert 1 0.1: (9.6 * 0.5 + 3.2 * 0.1) / 12.8 = 0.4.
  auto c = ChooseHotSplit(p, ManifestOf(p), {16, 16}, 32, false);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_pinned, 0.4, 1e-6);
  EXPECT_NEAR(c->served_lru, 0.0625, 1e-6);  // x 0.25 on x^2
}

TEST(HotSplitTest, EveryNeuronComputedServesTheShareHeld) {
  // A SiLU model without a predictor computes every neuron: the thresholded curves do not apply.
  const profiler::ModelProfile p = TwoLayers();
  auto c = ChooseHotSplit(p, ManifestOf(p), {40, 20}, 200, true);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->served_pinned, (0.25 + 0.125) / 2, 1e-6);  // equal weights: every neuron of both layers
  EXPECT_NEAR(c->served_lru, 200.0 / 320, 1e-6);
  EXPECT_EQ(c->hot_fraction, 0.0);
}

TEST(HotSplitTest, ProfilesThatDoNotFitTheDeploymentAreErrors) {
  profiler::ModelProfile p = TwoLayers();
  packer::Manifest m = ManifestOf(p);
  auto c = ChooseHotSplit(p, m, {40}, 160, false);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("1 groups, the deployment has 2"), std::string::npos) << c.status().message();
  m.regions[1].n_neurons = 100;
  c = ChooseHotSplit(p, m, {40, 20}, 160, false);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("100 neurons for layer 1"), std::string::npos) << c.status().message();
  m = ManifestOf(p);
  p.ffns[0].lru_hit_rate.clear();
  c = ChooseHotSplit(p, m, {40, 20}, 160, false);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("layer 0, expert -1 lacks its popularity / LRU hit-rate curves"),
            std::string::npos)
      << c.status().message();
}

}  // namespace
}  // namespace nflash::sparse
