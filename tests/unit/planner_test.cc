// Planner: the cost model on hand-computed cases, the Z3 solution on cases whose optimum is known, and infeasible
// limits explained by the unsat core.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>

#include "runtime/core/checksum.h"
#include "tests/test_util.h"

#include "planner/calibration.h"
#include "planner/cost_model.h"
#include "planner/model_params.h"
#include "planner/plan.h"
#include "planner/z3_planner.h"

namespace nflash::planner {
namespace {

Curve Linear() { return Curve{{0.0, 1.0}, {0.0, 1.0}}; }
Curve Zero() { return Curve{{0.0, 1.0}, {0.0, 0.0}}; }

// One region of 1000 neurons, 10% active, 1000-byte bundles read as 4096 bytes; 1 GB/s sparse compute; 100 MB/s random
// reads of 4 KiB at every queue depth; attention 1 MB per token at 1 GB/s.
HardwareParams Hw() {
  HardwareParams hw;
  hw.cores = 2;
  hw.mem_bw_gbs = 10;
  hw.dense_gemv_gbs = {1.0, 2.0};
  hw.sparse_ffn_gbs = {1.0, 2.0};
  for (int qd : {1, 64}) hw.random_reads.push_back({4096, qd, 100.0, 40.0});
  hw.seq_read_mbs = 1000;
  return hw;
}

ModelParams OneRegion(Curve popularity, Curve lru) {
  ModelParams m;
  m.n_layers = 1;
  m.fixed_bytes = 1 << 20;
  m.dense_bytes_per_token = 1000000;
  FfnParams f;
  f.n_neurons = 1000;
  f.active_fraction = 0.1;
  f.bundle_bytes = 1000;
  f.read_bytes = 4096;
  f.slot_bytes = 4096;
  f.popularity = std::move(popularity);
  f.lru_hit = std::move(lru);
  m.ffns.push_back(f);
  return m;
}

// One compute thread, queue depth 64, clusters of 32, and the given split of OneRegion's neurons.
PlanSettings OneRegionSettings(int64_t hot, int64_t cold) {
  PlanSettings s;
  s.compute_threads = 1;
  s.queue_depth = 64;
  s.cluster_neurons = 32;
  s.hot_neurons = {hot};
  s.cold_slots = {cold};
  return s;
}

// Solves `m` with no limit but `memory_bytes` and expects a plan (a fatal failure otherwise).
void SolveWithin(const HardwareParams& hw, const ModelParams& m, uint64_t memory_bytes, SolveResult* out) {
  UserLimits limits;
  limits.memory_bytes = memory_bytes;
  auto r = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->feasible) << r->message;
  *out = std::move(r).value();
}

TEST(CurveTest, InterpolatesAndFindsTheConcaveHull) {
  const Curve c{{0.0, 0.5, 1.0}, {0.0, 0.8, 1.0}};
  EXPECT_DOUBLE_EQ(c.At(0.25), 0.4);
  EXPECT_DOUBLE_EQ(c.At(0.75), 0.9);
  EXPECT_DOUBLE_EQ(c.At(2.0), 1.0);
  const auto segs = c.ConcaveSegments();
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_DOUBLE_EQ(segs[0].first, 1.6);
  EXPECT_DOUBLE_EQ(segs[1].first, 0.4);
  EXPECT_DOUBLE_EQ(segs[1].second, 0.6);
  // A convex kink is bridged by the hull: (0,0) (0.5,0.2) (1,1) -> one segment y = x.
  const auto hull = Curve{{0.0, 0.5, 1.0}, {0.0, 0.2, 1.0}}.ConcaveSegments();
  ASSERT_EQ(hull.size(), 1u);
  EXPECT_DOUBLE_EQ(hull[0].first, 1.0);
}

TEST(HardwareTest, ReadThroughputInterpolatesInLogSize) {
  HardwareParams hw;
  hw.random_reads = {{4096, 1, 50, 80}, {16384, 1, 150, 100}, {4096, 32, 400, 300}};
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 1), 50);
  EXPECT_DOUBLE_EQ(hw.ReadMbps(8192, 1), 100);   // halfway in log2 size
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 16), 50);   // largest measured depth <= 16 is 1
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 64), 400);
  EXPECT_DOUBLE_EQ(hw.ReadMbps(2048, 1), 25);    // below the smallest size: same IOPS
}

// Points on one line are one segment (a collinear middle point is not a hull vertex), and a cut to fewer segments
// keeps the first, the last and evenly spread ones between: slopes 5, 4, 3, 2, 1 cut to three are 5, 3, 1.
TEST(CurveTest, CollinearPointsAreOneSegmentAndACutSpreadsOverTheCurve) {
  const auto line = Curve{{0.0, 0.5, 1.0}, {0.0, 0.5, 1.0}}.ConcaveSegments();
  ASSERT_EQ(line.size(), 1u);
  EXPECT_DOUBLE_EQ(line[0].first, 1.0);
  EXPECT_DOUBLE_EQ(line[0].second, 0.0);
  const Curve c{{0, 1, 2, 3, 4, 5}, {0, 5, 9, 12, 14, 15}};
  ASSERT_EQ(c.ConcaveSegments().size(), 5u);
  const auto cut = c.ConcaveSegments(3);
  ASSERT_EQ(cut.size(), 3u);
  EXPECT_DOUBLE_EQ(cut[0].first, 5.0);
  EXPECT_DOUBLE_EQ(cut[1].first, 3.0);  // through (2, 9): intercept 9 - 3 * 2 = 3
  EXPECT_DOUBLE_EQ(cut[1].second, 3.0);
  EXPECT_DOUBLE_EQ(cut[2].first, 1.0);  // through (4, 14): intercept 10
  EXPECT_DOUBLE_EQ(cut[2].second, 10.0);
}

// The queue depth used is the largest measured one <= the plan's (that one itself when measured), or the smallest
// measured when the plan's is below every measurement; sizes between two measured ones interpolate in log2 of the
// size, here a quarter of the way (8 KiB between 4 and 64 KiB); latency below the smallest size stays that size's.
TEST(HardwareTest, ReadFiguresPickTheQueueDepthAndInterpolateInLogSize) {
  HardwareParams hw;
  hw.random_reads = {{4096, 4, 100, 40}, {65536, 4, 500, 200}, {4096, 16, 300, 60}};
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 16), 300);
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 8), 100);
  EXPECT_DOUBLE_EQ(hw.ReadMbps(4096, 1), 100) << "below every measured depth: the smallest (4), not the largest";
  EXPECT_DOUBLE_EQ(hw.ReadMbps(8192, 4), 100 + 0.25 * 400);
  EXPECT_DOUBLE_EQ(hw.ReadLatencyUs(8192, 4), 40 + 0.25 * 160);
  EXPECT_DOUBLE_EQ(hw.ReadLatencyUs(1024, 4), 40) << "a smaller read is no faster than the smallest measured";
}

TEST(CostModelTest, HandComputedBreakdown) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  PlanSettings s = OneRegionSettings(500, 0);
  const Prediction p = Evaluate(hw, m, s);
  // attention 1e6 B / 1e9 B/s = 1000 us; compute 100 neurons * 1000 B / 1e9 = 100 us; served P(0.5) = 0.5 so 50
  // misses * 4096 B / 1e8 B/s = 2048 us; pipeline 100/32 * 5 us + 0.5 * (40 us latency + 32 * 4096 / 1e8 s)
  // = 15.625 + 20 + 655.36 us.
  EXPECT_NEAR(p.attention_s, 1000e-6, 1e-12);
  EXPECT_NEAR(p.ffn_compute_s, 100e-6, 1e-12);
  EXPECT_NEAR(p.io_s, 2048e-6, 1e-12);
  EXPECT_NEAR(p.pipeline_s, 690.985e-6, 1e-12);
  EXPECT_NEAR(p.token_s, (1000 + 2048 + 690.985) * 1e-6, 1e-12);
  EXPECT_NEAR(p.read_mb_per_token, 50 * 4096 / 1e6, 1e-12);
  EXPECT_EQ(p.memory_bytes, (1u << 20) + 500u * 4096u);
  EXPECT_NEAR(p.io_exposed_s, (2048 - 100) * 1e-6, 1e-12) << "the reads the compute does not cover";
  // Two threads share the cores with the I/O thread: each miss also costs submit time on the compute threads.
  s.compute_threads = 2;
  const Prediction p2 = Evaluate(hw, m, s);
  EXPECT_NEAR(p2.ffn_compute_s, (50.0 + 50 * 2.0 / 2) * 1e-6, 1e-12);
  EXPECT_NEAR(p2.attention_s, 500e-6, 1e-12);
}

// Inputs the breakdown above leaves at their defaults: the predictor (read per token at the GEMV rate, in the token
// time), an expert's route share (its active neurons, so its compute and reads, scale with it), and a model without
// FFN regions (everything served).
TEST(CostModelTest, PredictorAndRouteShareCount) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Linear(), Zero());
  m.predictor_bytes = 500000;
  const PlanSettings s = OneRegionSettings(500, 0);
  const Prediction p = Evaluate(hw, m, s);
  EXPECT_NEAR(p.predictor_s, 500e-6, 1e-12);  // 0.5 MB at 1 GB/s
  EXPECT_NEAR(p.token_s, (1000 + 500 + 2048 + 690.985) * 1e-6, 1e-12);
  m.ffns[0].route_fraction = 0.25;  // 25 active neurons a token, half of them missed
  m.ffns[0].expert = 0;
  const Prediction q = Evaluate(hw, m, s);
  EXPECT_NEAR(q.ffn_compute_s, 25e-6, 1e-12);
  EXPECT_NEAR(q.reads_per_token, 12.5, 1e-12);
  EXPECT_NEAR(q.io_s, 12.5 * 4096 / 1e8, 1e-12);
  // The expert runs for a quarter of the tokens: its first cluster's reads are waited for that often,
  // 25/32 * 5 us + 0.25 * 0.5 * (40 + 1310.72) us.
  EXPECT_NEAR(q.pipeline_s, (25.0 / 32 * 5 + 0.25 * 0.5 * 1350.72) * 1e-6, 1e-12);
  // With 4 experts a token read ahead at the layer's first (first_read_share 1/4), a quarter of those waits.
  m.ffns[0].first_read_share = 0.25;
  const Prediction r = Evaluate(hw, m, s);
  EXPECT_NEAR(r.pipeline_s, (25.0 / 32 * 5 + 0.25 * 0.25 * 0.5 * 1350.72) * 1e-6, 1e-12);
  EXPECT_NEAR(r.io_s, q.io_s, 1e-15);  // the reads themselves are the same
  m.ffns.clear();
  EXPECT_EQ(Evaluate(hw, m, PlanSettings{}).served_fraction, 1.0);
}

// A region's cold share is capped at the neurons the hot region leaves: 500 hot and 1000 slots serve P(0.5) + H(0.5)
// = 0.5 + 0.25, not H(1). And the sum bound is capped by the envelope at h + c: P(0.25) + H(0.25) = 0.6 + 0.5 is more
// than the max(P, H)(0.5) = P(0.5) = 0.6 + 0.4 / 3 of one region holding half the neurons either way.
TEST(CostModelTest, ColdShareAndTheSumBoundAreCapped) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Curve{{0.0, 0.5, 1.0}, {0.0, 0.25, 1.0}});
  EXPECT_NEAR(Evaluate(hw, m, OneRegionSettings(500, 1000)).served_fraction, 0.75, 1e-12);
  const ModelParams concave =
      OneRegion(Curve{{0.0, 0.25, 1.0}, {0.0, 0.6, 1.0}}, Curve{{0.0, 0.25, 1.0}, {0.0, 0.5, 1.0}});
  EXPECT_NEAR(Evaluate(hw, concave, OneRegionSettings(250, 250)).served_fraction, 0.6 + 0.4 / 3, 1e-12);
}

TEST(CostModelTest, QueueDepthIsNotCappedByTheClusterAndOracleComputesOnlyUpAndDown) {
  HardwareParams hw = Hw();
  hw.random_reads = {{4096, 1, 100.0, 40.0}, {4096, 16, 400.0, 80.0}};
  ModelParams m = OneRegion(Linear(), Zero());
  m.ffns[0].compute_bytes = 600;  // up + down only
  PlanSettings s;
  s.queue_depth = 64;
  s.cluster_neurons = 8;  // the runtime streams a layer's reads at the queue depth: the depth-16 row applies
  s.hot_neurons = {500};
  s.cold_slots = {0};
  const Prediction p = Evaluate(hw, m, s);
  // 50 misses * 4096 B / 4e8 B/s = 512 us; compute 100 * 600 B / 1e9 B/s.
  EXPECT_NEAR(p.io_s, 512e-6, 1e-12);
  EXPECT_NEAR(p.ffn_compute_s, 60e-6, 1e-12);
  s.queue_depth = 8;  // largest measured depth <= 8 is 1: 50 * 4096 B / 1e8 B/s
  EXPECT_NEAR(Evaluate(hw, m, s).io_s, 2048e-6, 1e-12);
}

// Without a spare core the plan's queue holds a layer's expected misses (a power of two, at most 256); with one, or
// when the solver's depth holds them already, the depth stays.
TEST(CostModelTest, BurstQueueDepthHoldsALayersMissesWithoutASpareCore) {
  HardwareParams hw = Hw();  // 2 cores
  ModelParams m = OneRegion(Linear(), Zero());
  PlanSettings s;
  s.compute_threads = 2;
  s.io_threads = 1;
  s.queue_depth = 16;
  s.cluster_neurons = 32;
  s.hot_neurons = {0};
  s.cold_slots = {0};
  Prediction p = Evaluate(hw, m, s);
  ASSERT_NEAR(p.reads_per_token, 100.0, 1e-9);  // 10% of 1000 neurons, none served
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), 128);
  s.queue_depth = 256;
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), 256);
  s.queue_depth = 16;
  hw.cores = 3;  // the I/O thread has its own core
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), 16);
  hw.cores = 2;
  s.hot_neurons = {900};  // P(0.9) = 0.9 served: 10 misses fit a depth of 16
  p = Evaluate(hw, m, s);
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), 16);
  m.ffns[0].n_neurons = 100000;  // 10000 misses: capped
  s.hot_neurons = {0};
  p = Evaluate(hw, m, s);
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), kMaxBurstQueueDepth);
  s.queue_depth = 24;  // doubling passes 256 (24 -> 384): the cap still holds
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), kMaxBurstQueueDepth);
  // Two experts of one layer are read in one burst: 60 + 60 misses need 128, where either alone fits 64.
  m = OneRegion(Linear(), Zero());
  m.ffns[0].n_neurons = 600;
  m.ffns.push_back(m.ffns[0]);
  m.ffns[1].expert = 1;
  s.queue_depth = 16;
  s.hot_neurons = {0, 0};
  s.cold_slots = {0, 0};
  p = Evaluate(hw, m, s);
  ASSERT_NEAR(p.reads_per_token, 120.0, 1e-9);
  EXPECT_EQ(BurstQueueDepth(hw, m, s, p), 128);
}

TEST(CostModelTest, ServedFractionTakesTheTighterBound) {
  const HardwareParams hw = Hw();
  // P(h + c) = 0.6 at 0.6; P(0.2) + H(0.4) = 0.2 + 0.1: the sum bound is tighter.
  const ModelParams m = OneRegion(Linear(), Curve{{0.0, 0.4, 1.0}, {0.0, 0.1, 1.0}});
  PlanSettings s;
  s.hot_neurons = {200};
  s.cold_slots = {400};
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 0.3, 1e-12);
}

// An LRU curve above the popularity curve (activations that recur in time): all cold serves H(c), pinning less.
TEST(CostModelTest, AnLruAbovePopularityIsCredited) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Curve{{0.0, 0.4, 1.0}, {0.0, 0.8, 1.0}});
  PlanSettings s;
  s.hot_neurons = {0};
  s.cold_slots = {400};
  // max(P, H)(0.4) = 0.8; P(0) + H(0.4) = 0.8 (the cap at P(0.4) = 0.4 would say 0.4).
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 0.8, 1e-12);
  s.hot_neurons = {200};
  s.cold_slots = {200};
  // max(P, H)(0.4) = 0.8; P(0.2) + H(0.2) = 0.2 + 0.4 = 0.6: the sum is tighter.
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 0.6, 1e-12);
  s.hot_neurons = {400};
  s.cold_slots = {0};
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 0.4, 1e-12) << "pinned neurons serve their popularity only";
  // The solver, given room for 400 neurons, puts them in the LRU region.
  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, m.fixed_bytes + 400u * 4096u, &r));
  EXPECT_EQ(r.settings.hot_neurons[0], 0);
  EXPECT_NEAR(r.prediction.served_fraction, 0.8, 0.01);
}

// The runtime's overflow pool (the staging in the fixed part, shared by the regions) is credited to each region in
// an even share of its slots; a region cannot hold more than its neurons. Memory is unchanged: the pool is part of
// the fixed bytes.
TEST(CostModelTest, TheOverflowPoolAddsAnEvenShareToEachColdPartition) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Linear(), Curve{{0.0, 0.5, 1.0}, {0.0, 0.9, 1.0}});
  m.ffns.push_back(m.ffns[0]);
  PlanSettings s;
  s.hot_neurons = {0, 100};
  s.cold_slots = {200, 100};
  const Prediction without = Evaluate(hw, m, s);
  // H(0.2) = 0.36 and min(max(P, H)(0.2), P(0.1) + H(0.1)) = min(0.36, 0.1 + 0.18) = 0.28.
  EXPECT_NEAR(without.served_fraction, (0.36 + 0.28) / 2, 1e-12);
  m.overflow_pool_slots = 400;  // 200 a region
  const Prediction with = Evaluate(hw, m, s);
  // H(0.4) = 0.72; min(max(P, H)(0.4), P(0.1) + H(0.3)) = min(0.72, 0.1 + 0.54) = 0.64.
  EXPECT_NEAR(with.served_fraction, (0.72 + 0.64) / 2, 1e-12);
  EXPECT_EQ(with.memory_bytes, without.memory_bytes);
  EXPECT_LT(with.reads_per_token, without.reads_per_token);
  m.overflow_pool_slots = 4000;  // more than the regions' neurons: region 2 holds its 900 non-hot ones at most
  // H(1) = 1; min(max(P, H)(1), P(0.1) + H(0.9)) = min(1, 0.1 + 0.98) = 1.
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 1.0, 1e-12);
}

// A measured LRU curve is S-shaped: below a token's working set the cache thrashes (H near 0), above it recurrence
// lifts it over the popularity curve. The linear relaxation sees H's concave hull (0.7/0.3 per unit from 0), so it
// would pin most of the room and add a small cold partition the real curve credits with nothing.
TEST(PlannerTest, EachRegionIsAllHotOrAllLruWhicheverTheCurvesServeMore) {
  const HardwareParams hw = Hw();
  const Curve pop{{0.0, 0.2, 0.5, 1.0}, {0.0, 0.5, 0.8, 1.0}};
  const Curve lru{{0.0, 0.2, 0.3, 0.5, 1.0}, {0.0, 0.0, 0.7, 0.95, 1.0}};
  const ModelParams m = OneRegion(pop, lru);
  PlanSettings mix;
  mix.hot_neurons = {370};
  mix.cold_slots = {130};
  // By hand: P(0.37) + H(0.13) = 0.5 + 0.3 * 0.17 / 0.3 + 0 = 0.67 < max(P, H)(0.5) = 0.95.
  EXPECT_NEAR(Evaluate(hw, m, mix).served_fraction, 0.67, 1e-9);
  const PlanSettings pure = PureRegionSplits(m, mix);
  EXPECT_EQ(pure.hot_neurons[0], 0);
  EXPECT_EQ(pure.cold_slots[0], 500);
  EXPECT_NEAR(Evaluate(hw, m, pure).served_fraction, 0.95, 1e-9);
  // At 200 neurons pinning serves 0.5 and the LRU nothing: all hot. Equal curves: hot (no LRU bookkeeping).
  mix.hot_neurons = {50};
  mix.cold_slots = {150};
  EXPECT_EQ(PureRegionSplits(m, mix).hot_neurons[0], 200);
  EXPECT_EQ(PureRegionSplits(OneRegion(pop, pop), mix).cold_slots[0], 0);
  // Hot neurons twice a cold slot's size: 800 hot + 100 cold buy 1700 cold slots, capped at the region's 1000.
  ModelParams big = m;
  big.ffns[0].hot_slot_bytes = 8192;
  mix.hot_neurons = {800};
  mix.cold_slots = {100};  // x = 0.9: H(0.9) = 0.99 > P(0.9) = 0.96
  const PlanSettings capped = PureRegionSplits(big, mix);
  EXPECT_EQ(capped.hot_neurons[0], 0);
  EXPECT_EQ(capped.cold_slots[0], 1000);

  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, m.fixed_bytes + 500u * 4096u, &r));
  EXPECT_EQ(r.settings.hot_neurons[0], 0);
  EXPECT_EQ(r.settings.cold_slots[0], 500);
  EXPECT_NEAR(r.prediction.served_fraction, 0.95, 1e-9);
}

// One shared cold pool: every region served at the shared curve of (its slots + the overflow pool) / all neurons,
// hot neurons none, memory its slots.
TEST(CostModelTest, ASharedPoolServesItsCurveInEveryRegion) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Zero(), Zero());
  m.ffns.push_back(m.ffns[0]);
  m.ffns[1].active_fraction = 0.3;
  m.shared_lru = Curve{{0.0, 0.5, 1.0}, {0.0, 0.8, 1.0}};
  PlanSettings s;
  s.shared_cold_pool = true;
  s.hot_neurons = {0, 0};
  s.cold_slots = {300, 100};
  m.overflow_pool_slots = 100;
  // x = (400 + 100) / 2000 = 0.25: 0.4 in both regions.
  const Prediction p = Evaluate(hw, m, s);
  ASSERT_EQ(p.layer_served.size(), 2u);
  EXPECT_NEAR(p.layer_served[0], 0.4, 1e-12);
  EXPECT_NEAR(p.layer_served[1], 0.4, 1e-12);
  EXPECT_NEAR(p.served_fraction, 0.4, 1e-12);
  EXPECT_EQ(p.memory_bytes, m.fixed_bytes + 400u * 4096u);
  // Partitions of the same sizes serve their own (zero) curves.
  s.shared_cold_pool = false;
  EXPECT_NEAR(Evaluate(hw, m, s).served_fraction, 0.0, 1e-12);
  // SharedPoolSettings: the memory beyond the fixed part in slots, split 1:3 by active neurons (0.1 : 0.3 of 1000).
  PlanSettings knobs;
  knobs.compute_threads = 2;
  knobs.queue_depth = 64;
  const PlanSettings pool = SharedPoolSettings(m, knobs, m.fixed_bytes + 800u * 4096u + 100u);
  EXPECT_TRUE(pool.shared_cold_pool);
  EXPECT_EQ(pool.compute_threads, 2);
  EXPECT_EQ(pool.hot_neurons, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(pool.cold_slots, (std::vector<int64_t>{200, 600}));
  // Never more than every neuron.
  const PlanSettings all = SharedPoolSettings(m, knobs, m.fixed_bytes + 5000u * 4096u);
  EXPECT_EQ(all.cold_slots[0] + all.cold_slots[1], 2000);
  EXPECT_LE(all.cold_slots[0], 1000);
  EXPECT_LE(all.cold_slots[1], 1000);
}

// The planner takes one shared pool when the profile's shared curve serves more than the regions' own curves can
// (MoE routing that follows the sequence), and keeps per-region plans when it serves less; either plan fits.
TEST(PlannerTest, ASharedPoolIsChosenOnlyWhenItServesMore) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Linear(), Linear());
  m.ffns.push_back(m.ffns[0]);
  const uint64_t limit = m.fixed_bytes + 1000u * 4096u;
  m.shared_lru = Curve{{0.0, 0.5, 1.0}, {0.0, 0.9, 1.0}};  // 0.9 at half of all neurons; the regions' own: 0.5
  SolveResult shared;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &shared));
  EXPECT_TRUE(shared.settings.shared_cold_pool);
  EXPECT_NEAR(shared.prediction.served_fraction, 0.9, 1e-9);
  EXPECT_LE(shared.prediction.memory_bytes, limit);
  EXPECT_EQ(shared.settings.cold_slots[0] + shared.settings.cold_slots[1], 1000);
  m.shared_lru = Curve{{0.0, 1.0}, {0.0, 0.3}};  // worse than pinning
  SolveResult per_region;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &per_region));
  EXPECT_FALSE(per_region.settings.shared_cold_pool);
  EXPECT_NEAR(per_region.prediction.served_fraction, 0.5, 1e-3);  // the solver rounds its neurons down
  // The memory objective: the smallest shared pool reaching the speed, when it is smaller than per-region plans'.
  m.shared_lru = Curve{{0.0, 0.5, 1.0}, {0.0, 0.9, 1.0}};
  UserLimits limits;
  limits.memory_bytes = limit;
  limits.objective = UserLimits::Objective::kMemory;
  limits.min_tokens_per_s = shared.prediction.tokens_per_s * 0.99;
  auto r = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->feasible) << r->message;
  EXPECT_TRUE(r->settings.shared_cold_pool);
  EXPECT_LT(r->prediction.memory_bytes, shared.prediction.memory_bytes);
  EXPECT_GE(r->prediction.tokens_per_s, limits.min_tokens_per_s);
}

// A region is planned with the profile's held-out popularity when the profile has it, else the in-sample curve.
TEST(CurveTest, PlanningPopularityPrefersTheHeldOutCurve) {
  profiler::FfnProfile fp;
  for (int i = 0; i < profiler::kCurvePoints; ++i) {
    fp.popularity.push_back(std::sqrt(i / 16.0f));
    fp.popularity_heldout.push_back(i / 16.0f);
  }
  const Curve held = PlanningPopularity(fp);
  ASSERT_EQ(held.y.size(), static_cast<size_t>(profiler::kCurvePoints));
  EXPECT_NEAR(held.At(0.5), 0.5, 1e-6);
  EXPECT_NEAR(held.x[4], 0.25, 1e-12);
  fp.popularity_heldout.clear();  // a profile written before the held-out curve
  EXPECT_NEAR(PlanningPopularity(fp).At(0.25), 0.5, 1e-6);
}

TEST(CurveTest, UpperEnvelopeAddsTheCrossing) {
  const Curve a{{0.0, 1.0}, {0.0, 1.0}}, b{{0.0, 0.5, 1.0}, {0.2, 0.4, 0.6}};
  const Curve e = UpperEnvelope(a, b);
  // b above a until they cross at x = 0.4 (0.2 + 0.4x = x), then a.
  EXPECT_DOUBLE_EQ(e.At(0.0), 0.2);
  EXPECT_NEAR(e.At(0.4), 0.4, 1e-12);
  EXPECT_NEAR(e.At(0.2), 0.28, 1e-12);
  EXPECT_NEAR(e.At(0.7), 0.7, 1e-12);
  EXPECT_DOUBLE_EQ(e.At(1.0), 1.0);
}

TEST(CostModelTest, PrefillIsGemmAgainstStreamingWithTheFirstLayerExposed) {
  HardwareParams hw = Hw();
  hw.gemm_gflops = 100;
  ModelParams m = OneRegion(Linear(), Linear());
  m.n_layers = 2;
  m.ffns.push_back(m.ffns[0]);
  m.matmul_params = 5000000;  // 2 * 5e6 * 100 tokens = 1e9 flops = 10 ms at 100 GFLOP/s
  m.dense_matmul_params = 2000000;
  m.ffn_bytes = 8192000;      // both regions, read whole whatever the caches hold
  PlanSettings s;
  s.compute_threads = 1;
  s.io_threads = 1;
  s.queue_depth = 64;
  s.cluster_neurons = 32;
  s.hot_neurons = {1000, 500};
  s.cold_slots = {0, 0};
  // Oracle: a GEMM over every neuron. 8.192 MB at 1000 MB/s = 8.192 ms; half of it (the first of two layers) exposed.
  PrefillPrediction p = EvaluatePrefill(hw, m, s, 100);
  EXPECT_NEAR(p.compute_s, 10e-3, 1e-12);
  EXPECT_NEAR(p.io_s, 8.192e-3, 1e-12);
  EXPECT_NEAR(p.total_s, 10e-3 + 4.096e-3, 1e-12);
  EXPECT_NEAR(p.tokens_per_s, 100 / (14.096e-3), 1e-6);
  // Predictor: the non-FFN products by GEMM (2 * 2e6 * 100 / 1e11 = 4 ms) and per token each FFN's predicted neurons at
  // the sparse rate (100 active x 1000 bytes / 1 GB/s = 0.1 ms per region, 2 regions, 100 tokens: 20 ms).
  m.predictor = true;
  p = EvaluatePrefill(hw, m, s, 100);
  EXPECT_NEAR(p.compute_s, 4e-3 + 20e-3, 1e-12);
  EXPECT_NEAR(p.total_s, 24e-3 + 4.096e-3, 1e-12);
  m.predictor_bytes = 100000;  // read per token at the GEMV rate: 0.1 ms x 100 tokens
  EXPECT_NEAR(EvaluatePrefill(hw, m, s, 100).compute_s, 4e-3 + 20e-3 + 10e-3, 1e-12);
  m.predictor_bytes = 0;
  // 600 tokens: two chunks of the runtime's 512-token default, each reading every region.
  EXPECT_NEAR(EvaluatePrefill(hw, m, s, 600).io_s, 2 * 8.192e-3, 1e-12);
}

TEST(PlannerTest, WholeModelFitsServesEverythingFromMemory) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, 64u << 20, &r));
  EXPECT_EQ(r.settings.hot_neurons[0] + r.settings.cold_slots[0], 1000);
  EXPECT_EQ(r.settings.compute_threads, 2);
  EXPECT_NEAR(r.prediction.io_s, 0.0, 1e-12);
  // 2 threads: attention 500 us + compute 50 us + cluster sync (100 / 128 clusters * 5 us / 2).
  EXPECT_NEAR(r.prediction.token_s, (500 + 50 + 100.0 / 128 * 5 / 2) * 1e-6, 1e-9);
  EXPECT_NEAR(r.solver_token_s, r.prediction.token_s, 1e-9);
}

TEST(PlannerTest, MemoryLimitedPlanUsesAllTheMemoryItHas) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  const uint64_t limit = (1u << 20) + 600u * 4096u;  // room for 600 of 1000 neurons
  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &r));
  EXPECT_EQ(r.settings.hot_neurons[0] + r.settings.cold_slots[0], 600);
  EXPECT_LE(r.prediction.memory_bytes, limit);
  EXPECT_NEAR(r.prediction.served_fraction, 0.6, 1e-9);
  // The solver's own token time for the plan it chose is the cost model's (linear curves: the relaxation is exact),
  // misses and the submission work they put on the compute threads included (2 threads + the I/O thread > 2 cores),
  // with reads fast enough (10 GB/s) that the compute, not the I/O, bounds the layer.
  HardwareParams fast = hw;
  for (IoPoint& p : fast.random_reads) p.mb_per_s = 10000;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(fast, m, limit, &r));
  ASSERT_EQ(r.settings.compute_threads + r.settings.io_threads, 3);
  ASSERT_NEAR(r.prediction.reads_per_token, 40, 1e-9);
  ASSERT_GT(r.prediction.ffn_compute_s, r.prediction.io_s);
  EXPECT_NEAR(r.solver_token_s, r.prediction.token_s, 1e-9);
}

// The least memory for a speed rounds neurons up (never below the speed it was solved for), but never past the memory
// limit: with a limit half a neuron above 600 and the speed that 600.5 neurons give, the memory optimum is ~600.5
// neurons, whose rounding up (601) would not fit; the plan keeps 600 and stays within the limit. With room, 601.
TEST(PlannerTest, LeastMemoryPlanRoundsUpOnlyWithinTheLimit) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  const uint64_t limit = (1u << 20) + 600u * 4096u + 2048u;  // 600.5 neurons
  SolveResult fastest;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &fastest));
  UserLimits limits;
  limits.memory_bytes = limit;
  limits.objective = UserLimits::Objective::kMemory;
  limits.min_tokens_per_s = (1.0 - 1e-7) / fastest.solver_token_s;  // what 600.5 neurons reach, a hair less
  auto r = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->feasible) << r->message;
  EXPECT_LE(r->prediction.memory_bytes, limit);
  EXPECT_EQ(r->settings.hot_neurons[0] + r->settings.cold_slots[0], 600);
  // With room to spare the same speed gets 601 neurons: the plan reaches it (600 would fall short).
  limits.memory_bytes = (1u << 20) + 700u * 4096u;
  auto roomy = SolvePlan(hw, m, limits);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  ASSERT_TRUE(roomy->feasible) << roomy->message;
  EXPECT_EQ(roomy->settings.hot_neurons[0] + roomy->settings.cold_slots[0], 601);
  EXPECT_GE(1.0 / roomy->prediction.token_s, limits.min_tokens_per_s);
}

// Hot neurons take whole flash groups, cold slots the bundle rounded to the direct-I/O alignment (e.g. 8192 against
// 7168 bytes): Evaluate and the solver count each at its own size, so a plan never asks the runtime for more memory
// than the limit.
TEST(PlannerTest, HotAndColdNeuronsAreCountedAtTheirOwnSizes) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Linear(), Zero());
  m.ffns[0].hot_slot_bytes = 8192;
  m.ffns[0].slot_bytes = 7168;
  const PlanSettings s = OneRegionSettings(96, 200);
  EXPECT_EQ(Evaluate(hw, m, s).memory_bytes, (1u << 20) + 96u * 8192u + 200u * 7168u);
  // Made pure, the region keeps its 2220032 bytes: 271 hot neurons (popularity wins here) ...
  const PlanSettings hot = PureRegionSplits(m, s);
  EXPECT_EQ(hot.hot_neurons[0], 271);
  EXPECT_EQ(hot.cold_slots[0], 0);
  // ... or 309 cold slots where the LRU curve serves more.
  ModelParams lru = OneRegion(Zero(), Linear());
  lru.ffns[0].hot_slot_bytes = 8192;
  lru.ffns[0].slot_bytes = 7168;
  const PlanSettings cold = PureRegionSplits(lru, s);
  EXPECT_EQ(cold.hot_neurons[0], 0);
  EXPECT_EQ(cold.cold_slots[0], 309);
  const uint64_t limit = (1u << 20) + 400u * 7168u;
  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &r));
  EXPECT_LE(r.prediction.memory_bytes, limit);
  EXPECT_EQ(r.prediction.memory_bytes, (1u << 20) + static_cast<uint64_t>(r.settings.hot_neurons[0]) * 8192u +
                                           static_cast<uint64_t>(r.settings.cold_slots[0]) * 7168u);
}

TEST(PlannerTest, MemoryBelowTheFixedPartIsExplained) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  UserLimits limits;
  limits.memory_bytes = 1000;
  auto r = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->feasible);
  EXPECT_EQ(r->conflict, std::vector<std::string>{"fixed_part"});
  EXPECT_NE(r->message.find("fixed part"), std::string::npos) << r->message;
}

TEST(PlannerTest, UnreachableSpeedNamesMemoryAndSpeedAndTheMemoryThatWouldDo) {
  const HardwareParams hw = Hw();
  const ModelParams m = OneRegion(Linear(), Zero());
  UserLimits limits;
  limits.memory_bytes = (1u << 20) + 100u * 4096u;
  // With everything in memory a token takes 550 + ~2 us; ask for 1 / 1000 us: needs most neurons in memory.
  limits.min_tokens_per_s = 1000;
  auto r = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->feasible);
  EXPECT_EQ(r->conflict, (std::vector<std::string>{"memory_limit", "min_speed"}));
  EXPECT_GT(r->min_feasible_memory, limits.memory_bytes);
  EXPECT_GT(r->max_feasible_speed, 0.0);
  EXPECT_LT(r->max_feasible_speed, 1000.0);
  // The memory the message proposes does reach the speed.
  limits.memory_bytes = r->min_feasible_memory + 4096;
  auto r2 = SolvePlan(hw, m, limits);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->feasible) << r2->message;
}

// The solver against an exhaustive search with the direct evaluation (no Z3): two regions of different sparsity and
// curves, every hot/cold split on a 10-neuron grid, every knob. The solver may only be better (it is continuous) or
// lose what rounding to whole neurons costs.
TEST(PlannerTest, NoGridPointBeatsTheSolver) {
  HardwareParams hw = Hw();
  hw.random_reads = {{4096, 1, 40.0, 100.0}, {4096, 8, 150.0, 200.0}, {4096, 64, 160.0, 1600.0}};
  ModelParams m = OneRegion(Curve{{0.0, 0.2, 0.5, 1.0}, {0.0, 0.6, 0.9, 1.0}}, Curve{{0.0, 0.5, 1.0}, {0.0, 0.7, 1.0}});
  for (auto& f : m.ffns) f.n_neurons = 100;
  FfnParams second = m.ffns[0];
  second.layer = 1;
  second.active_fraction = 0.3;
  second.popularity = Linear();
  second.lru_hit = Curve{{0.0, 1.0}, {0.0, 0.5}};
  m.ffns.push_back(second);
  const uint64_t limit = m.fixed_bytes + 90u * 4096u;
  SolveResult r;
  ASSERT_NO_FATAL_FAILURE(SolveWithin(hw, m, limit, &r));
  EXPECT_LE(r.prediction.memory_bytes, limit);

  double best = 1e30;
  PlanSettings s;
  s.hot_neurons = {0, 0};
  s.cold_slots = {0, 0};
  for (int t = 1; t <= 2; ++t) {
    for (int qd : kQueueDepthChoices) {
      for (int k : kClusterChoices) {
        s.compute_threads = t;
        s.queue_depth = qd;
        s.cluster_neurons = k;
        for (int h0 = 0; h0 <= 100; h0 += 10) {
          for (int c0 = 0; h0 + c0 <= 100; c0 += 10) {
            for (int h1 = 0; h1 <= 100; h1 += 10) {
              for (int c1 = 0; h1 + c1 <= 100; c1 += 10) {
                if (h0 + c0 + h1 + c1 > 90) continue;
                s.hot_neurons = {h0, h1};
                s.cold_slots = {c0, c1};
                best = std::min(best, Evaluate(hw, m, s).token_s);
              }
            }
          }
        }
      }
    }
  }
  EXPECT_LE(r.prediction.token_s, best * 1.01) << "grid best " << best;
  // And the search is not vacuous: memory matters in this case.
  s = r.settings;
  s.hot_neurons = {0, 0};
  s.cold_slots = {0, 0};
  EXPECT_GT(Evaluate(hw, m, s).token_s, r.prediction.token_s * 1.2);
}

TEST(PlannerTest, ThirtyTwoLayersSolveQuickly) {
  const HardwareParams hw = Hw();
  ModelParams m;
  // Curves as dense as the profiler's (33 points; a power-law popularity x^0.2 as the synthetic 7B's, an LRU curve
  // below it): the hull has a segment per point, which is what makes real solves slow.
  Curve pop, lru;
  for (int i = 0; i <= 32; ++i) {
    const double x = i / 32.0;
    pop.x.push_back(x);
    pop.y.push_back(std::pow(x, 0.2));
    lru.x.push_back(x);
    lru.y.push_back(0.8 * std::pow(x, 0.5));
  }
  const ModelParams one = OneRegion(pop, lru);
  m.fixed_bytes = one.fixed_bytes;
  m.dense_bytes_per_token = one.dense_bytes_per_token;
  for (int l = 0; l < 32; ++l) {
    FfnParams f = one.ffns[0];
    f.layer = l;
    f.active_fraction = 0.05 + 0.005 * l;
    m.ffns.push_back(f);
  }
  UserLimits limits;
  limits.memory_bytes = (1u << 20) + 32u * 300u * 4096u;
  const auto start = std::chrono::steady_clock::now();
  auto r = SolvePlan(hw, m, limits);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->feasible) << r->message;
  EXPECT_LE(r->prediction.memory_bytes, limits.memory_bytes);
  // The solver's optimum (hull curves, unrounded) is at least as fast as the rounded plan's evaluation.
  EXPECT_LE(r->solver_token_s, r->prediction.token_s * (1 + 1e-6));
  RecordProperty("solve_seconds", std::to_string(secs));
  std::printf("32-layer solve: %.2f s\n", secs);
}

// Two experts of one layer merged, worked by hand: A (100 neurons, routed 0.5, 20% active: 10 active neurons per
// token) covers 60% of its activations with its hottest 10%, B (100, 0.5, 10%: 5) is flat. Per neuron: A's first
// segment 6/10 = 0.6, B's 5/100 = 0.05, A's rest 4/90 = 0.044; the layer's curve takes them in that order over 200
// neurons and 15 active: (0.05, 0.4), (0.55, 11/15), (1, 1). 60 hot neurons are A's 10 and B's 50.
TEST(PlannerTest, ExpertsMergeIntoTheirLayerByActivationsPerNeuron) {
  ModelParams m = OneRegion(Curve{{0.0, 0.1, 1.0}, {0.0, 0.6, 1.0}}, Linear());
  m.ffns[0].expert = 0;
  m.ffns[0].route_fraction = 0.5;
  m.ffns[0].active_fraction = 0.2;
  m.ffns[0].n_neurons = 100;
  FfnParams b = m.ffns[0];
  b.expert = 1;
  b.active_fraction = 0.1;
  b.popularity = Linear();
  b.lru_hit = Curve{{0.0, 0.5, 1.0}, {0.0, 0.9, 1.0}};
  m.ffns.push_back(b);
  ExpertLayers layers;
  ASSERT_TRUE(GroupExpertsByLayer(m, &layers));
  ASSERT_EQ(layers.model.ffns.size(), 1u);
  const FfnParams& l = layers.model.ffns[0];
  EXPECT_EQ(l.n_neurons, 200);
  EXPECT_DOUBLE_EQ(l.route_fraction, 1.0);
  EXPECT_NEAR(l.active_fraction, 15.0 / 200.0, 1e-12);
  EXPECT_DOUBLE_EQ(l.Runs(), 1.0);  // 0.5 + 0.5: the layer runs one expert per token
  const std::vector<double> px = {0.0, 0.05, 0.55, 1.0}, py = {0.0, 0.4, 11.0 / 15.0, 1.0};
  ASSERT_EQ(l.popularity.x.size(), px.size());
  for (size_t i = 0; i < px.size(); ++i) {
    EXPECT_NEAR(l.popularity.x[i], px[i], 1e-12) << i;
    EXPECT_NEAR(l.popularity.y[i], py[i], 1e-12) << i;
  }
  // LRU: A's linear 10/100 = 0.1 per neuron; B's first half 0.9 * 5 / 50 = 0.09, its rest 0.5 / 50 = 0.01.
  const std::vector<double> lx = {0.0, 0.5, 0.75, 1.0}, ly = {0.0, 10.0 / 15.0, 14.5 / 15.0, 1.0};
  ASSERT_EQ(l.lru_hit.x.size(), lx.size());
  for (size_t i = 0; i < lx.size(); ++i) {
    EXPECT_NEAR(l.lru_hit.x[i], lx[i], 1e-12) << i;
    EXPECT_NEAR(l.lru_hit.y[i], ly[i], 1e-12) << i;
  }
  PlanSettings per_layer = OneRegionSettings(60, 120);
  const PlanSettings s = SpreadOverExperts(m, layers, per_layer);
  EXPECT_EQ(s.hot_neurons, (std::vector<int64_t>{10, 50}));
  // Cold: A's 100 first, then 20 of B's; each expert then holds at most its neurons (A: 10 hot + 90 cold).
  EXPECT_EQ(s.cold_slots, (std::vector<int64_t>{90, 20}));
  EXPECT_EQ(s.queue_depth, per_layer.queue_depth);
  // A layer's runs per token are its experts' route fractions summed; a curve that starts above 0 (activations its
  // hottest neurons cover at once) keeps that mass.
  ModelParams uneven = m;
  uneven.ffns[1].route_fraction = 0.25;
  uneven.ffns[1].popularity = Curve{{0.0, 1.0}, {0.5, 1.0}};
  ASSERT_TRUE(GroupExpertsByLayer(uneven, &layers));
  EXPECT_DOUBLE_EQ(layers.model.ffns[0].Runs(), 0.75);
  // B's 2.5 active: 1.25 at x = 0, 1.25 over its 100 neurons; A's 10 as before: the layer's 12.5 start at 1.25.
  EXPECT_NEAR(layers.model.ffns[0].popularity.At(0.0), 1.25 / 12.5, 1e-12);
  EXPECT_NEAR(layers.model.ffns[0].popularity.At(1.0), 1.0, 1e-12);
  ASSERT_TRUE(GroupExpertsByLayer(m, &layers));
  // Experts of different sizes in one layer, or a dense model, are not grouped.
  ModelParams mixed = m;
  mixed.ffns[1].read_bytes = 8192;
  EXPECT_FALSE(GroupExpertsByLayer(mixed, &layers));
  EXPECT_FALSE(GroupExpertsByLayer(OneRegion(Linear(), Linear()), &layers));
}

// 4 layers of 64 experts (256 regions, above kMaxSolverRegions) solve as 4 layers: within the memory, in seconds, the
// solver's figure no slower than the per-expert evaluation, and the neurons held on the experts the router favours
// (route fractions 1/8 for experts 0-7, 1/1000 for the rest; the same curves): 2400 fit, the favoured have 3200.
TEST(PlannerTest, ManyExpertsSolveAsTheirLayers) {
  const HardwareParams hw = Hw();
  Curve pop;
  for (int i = 0; i <= 32; ++i) {
    pop.x.push_back(i / 32.0);
    pop.y.push_back(std::pow(i / 32.0, 0.3));
  }
  const ModelParams one = OneRegion(pop, Zero());
  ModelParams m;
  m.n_layers = 4;
  m.fixed_bytes = one.fixed_bytes;
  m.dense_bytes_per_token = one.dense_bytes_per_token;
  for (int l = 0; l < 4; ++l) {
    for (int e = 0; e < 64; ++e) {
      FfnParams f = one.ffns[0];
      f.layer = l;
      f.expert = e;
      f.n_neurons = 100;
      f.route_fraction = e < 8 ? 0.125 : 0.001;
      m.ffns.push_back(f);
    }
  }
  ASSERT_GT(m.ffns.size(), kMaxSolverRegions);
  UserLimits limits;
  limits.memory_bytes = (1u << 20) + 4u * 600u * 4096u;  // 600 neurons a layer: the favoured experts' 800 do not fit
  const auto start = std::chrono::steady_clock::now();
  auto r = SolvePlan(hw, m, limits);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->feasible) << r->message;
  EXPECT_EQ(r->solver_regions, 4);
  std::printf("256-region solve: %.2f s\n", secs);
  EXPECT_LT(secs, 60);
  EXPECT_LE(r->prediction.memory_bytes, limits.memory_bytes);
  EXPECT_GT(r->prediction.memory_bytes, limits.memory_bytes - 4u * 8u * 4096u) << "memory left unused";
  EXPECT_LE(r->solver_token_s, r->prediction.token_s * (1 + 1e-6));
  ASSERT_EQ(r->settings.hot_neurons.size(), m.ffns.size());
  // The layers are alike, so the solver may share the 2400 neurons out unevenly between them (equal optima); within
  // each, the favoured experts fill first.
  int64_t favoured = 0, rest = 0;
  for (int l = 0; l < 4; ++l) {
    int64_t layer_favoured = 0, layer_rest = 0;
    for (int e = 0; e < 64; ++e) {
      const size_t i = static_cast<size_t>(l * 64 + e);
      (e < 8 ? layer_favoured : layer_rest) += r->settings.hot_neurons[i] + r->settings.cold_slots[i];
    }
    if (layer_rest > 0) {
      EXPECT_EQ(layer_favoured, 800) << "layer " << l << ": the others before the favoured";
    }
    favoured += layer_favoured;
    rest += layer_rest;
  }
  EXPECT_GE(favoured, 2400 - 4 * 8);  // whole neurons per expert: at most one lost to rounding in each
  EXPECT_EQ(rest, 0);
}

TEST(CalibrationTest, ScalesTheFiguresAndReproducesTheMeasuredRun) {
  const HardwareParams hw = Hw();
  Calibration k;
  k.compute_scale = 2;
  k.io_scale = 4;
  const HardwareParams c = Calibrated(hw, k);
  EXPECT_DOUBLE_EQ(c.dense_gemv_gbs[1], 1.0);    // 2.0 / 2
  EXPECT_DOUBLE_EQ(c.sparse_ffn_gbs[0], 0.5);    // 1.0 / 2
  EXPECT_DOUBLE_EQ(c.random_reads[0].mb_per_s, 25.0);         // 100 / 4
  EXPECT_DOUBLE_EQ(c.random_reads[0].mean_latency_us, 160.0);  // 40 * 4
  EXPECT_DOUBLE_EQ(c.submit_us_per_request, 4.0);              // 2 * 2
  EXPECT_DOUBLE_EQ(c.seq_read_mbs, hw.seq_read_mbs);           // prefill figures untouched

  // A plan that reads: half the active neurons from flash.
  const ModelParams m = OneRegion(Linear(), Zero());
  PlanSettings s = OneRegionSettings(500, 0);
  s.queue_depth = 1;
  s.cluster_neurons = 8;
  const Prediction raw = Evaluate(hw, m, s);
  ASSERT_GT(raw.io_s, 0);
  // "Measured": 3x the predicted time, a third of it waiting for reads.
  const double t = 3 * raw.token_s, w = t / 3;
  auto fit = FitCalibration(hw, m, s, t, w, 16);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  const double compute_side = raw.attention_s + raw.predictor_s + raw.ffn_compute_s + raw.pipeline_s;
  EXPECT_NEAR(fit->compute_scale, (t - w) / compute_side, 1e-12);
  EXPECT_GT(fit->io_scale, 1.0);
  EXPECT_NEAR(Evaluate(Calibrated(hw, *fit), m, s).token_s, t, t * 1e-6) << "the fit reproduces the measured run";
  EXPECT_DOUBLE_EQ(fit->uncalibrated_token_s, raw.token_s);

  // Everything in memory: no reads, so the disk factor stays 1.
  s.hot_neurons = {1000};
  const Prediction mem = Evaluate(hw, m, s);
  ASSERT_EQ(mem.io_s, 0);
  auto fit_mem = FitCalibration(hw, m, s, 2 * mem.token_s, 0, 8);
  ASSERT_TRUE(fit_mem.ok());
  EXPECT_DOUBLE_EQ(fit_mem->io_scale, 1.0);
  EXPECT_NEAR(Evaluate(Calibrated(hw, *fit_mem), m, s).token_s, 2 * mem.token_s, mem.token_s * 1e-9);

  // A run that cannot be fitted.
  EXPECT_FALSE(FitCalibration(hw, m, s, 0.1, 0.2, 8).ok());  // wait longer than the token
  EXPECT_FALSE(FitCalibration(hw, m, s, 1e3, 0, 8).ok());    // 1000 s per token: not this plan
}

// Which runs a calibration fits to: each kind's median run (the lower middle of an even count, the whole run: its wait
// and token count with its time), the kind with the lower median kept, a tie keeping the runtime's rule.
TEST(CalibrationTest, TheFasterKindsMedianRunIsKept) {
  auto run = [](double t, double w, int n) { return CalibrationRun{t, w, n}; };
  // Not compared: the median of the plan's runs (given out of order).
  auto one = ChooseCalibrationRun({run(0.05, 0.01, 16), run(0.03, 0.003, 17), run(0.04, 0.004, 18)}, {});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_DOUBLE_EQ(one->fit.token_s, 0.04);
  EXPECT_DOUBLE_EQ(one->fit.io_wait_s, 0.004);
  EXPECT_EQ(one->fit.tokens, 18);
  EXPECT_EQ(one->lookahead, -1);
  EXPECT_DOUBLE_EQ(one->with_s, 0.04);
  EXPECT_DOUBLE_EQ(one->without_s, 0);
  // Four runs: the lower middle (0.02, not 0.03 or their mean).
  auto even = ChooseCalibrationRun({run(0.04, 0, 8), run(0.01, 0, 8), run(0.03, 0, 8), run(0.02, 0, 8)}, {});
  ASSERT_TRUE(even.ok());
  EXPECT_DOUBLE_EQ(even->fit.token_s, 0.02);
  // Compared, the runs without lookahead faster by their median (0.039 < 0.04) although their fastest and slowest
  // runs are not: that kind's median run is the fit.
  auto off = ChooseCalibrationRun({run(0.05, 0.01, 16), run(0.03, 0.003, 16), run(0.04, 0.004, 16)},
                                  {run(0.039, 0.007, 15), run(0.1, 0.02, 16), run(0.031, 0.001, 16)});
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->lookahead, 0);
  EXPECT_DOUBLE_EQ(off->fit.token_s, 0.039);
  EXPECT_DOUBLE_EQ(off->fit.io_wait_s, 0.007);
  EXPECT_EQ(off->fit.tokens, 15);
  EXPECT_DOUBLE_EQ(off->with_s, 0.04);
  EXPECT_DOUBLE_EQ(off->without_s, 0.039);
  // Compared, the rule faster (and a tie): the plan's median run, the rule kept.
  for (const double without : {0.041, 0.04}) {
    auto on = ChooseCalibrationRun({run(0.05, 0.01, 16), run(0.03, 0.003, 16), run(0.04, 0.004, 16)},
                                   {run(without, 0.002, 16)});
    ASSERT_TRUE(on.ok());
    EXPECT_EQ(on->lookahead, -1) << without;
    EXPECT_DOUBLE_EQ(on->fit.token_s, 0.04) << without;
    EXPECT_DOUBLE_EQ(on->fit.io_wait_s, 0.004) << without;
    EXPECT_DOUBLE_EQ(on->without_s, without);
  }
  EXPECT_FALSE(ChooseCalibrationRun({}, {run(0.03, 0, 8)}).ok());

  // The same choice read back from a recorded calibration (`--calibration other.json`).
  Calibration c;
  c.tokens = 16;
  EXPECT_EQ(ChosenLookahead(c), -1) << "not compared";
  c.lookahead_on_token_s = 0.04;
  c.lookahead_off_token_s = 0.039;
  EXPECT_EQ(ChosenLookahead(c), 0);
  c.lookahead_off_token_s = 0.04;
  EXPECT_EQ(ChosenLookahead(c), -1) << "a tie keeps the rule";
  c.lookahead_off_token_s = 0.05;
  EXPECT_EQ(ChosenLookahead(c), -1);
  c.lookahead_on_token_s = 0.01;
  c.lookahead_off_token_s = 0;
  EXPECT_EQ(ChosenLookahead(c), -1) << "half a comparison is none";
}

// The fit's edges: the predictor's time is compute to be scaled, a wait as long as the token is refused by the first
// check (not by the factor's bound it would lead to), a compute factor below 1e-3 is refused, and a run no disk factor
// in [1e-3, 1e3] reproduces gets the nearest bound.
TEST(CalibrationTest, ScalesThePredictorRefusesTheEdgesAndClampsTheDiskFactor) {
  const HardwareParams hw = Hw();
  ModelParams m = OneRegion(Linear(), Zero());
  m.predictor_bytes = 400000;  // 0.2 ms at 2 GB/s: a predictor that costs time
  PlanSettings s = OneRegionSettings(500, 0);
  s.queue_depth = 1;
  s.cluster_neurons = 8;
  const Prediction raw = Evaluate(hw, m, s);
  ASSERT_GT(raw.predictor_s, 0);
  ASSERT_GT(raw.io_s, 0);
  const double compute_side = raw.attention_s + raw.predictor_s + raw.ffn_compute_s + raw.pipeline_s;
  const double t = 2 * raw.token_s, w = raw.token_s / 2;
  auto fit = FitCalibration(hw, m, s, t, w, 8);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  EXPECT_NEAR(fit->compute_scale, (t - w) / compute_side, 1e-12);

  auto equal = FitCalibration(hw, m, s, t, t, 8);
  ASSERT_FALSE(equal.ok());
  EXPECT_NE(equal.status().message().find("expected 0 <= wait < time"), std::string::npos) << equal.status().ToString();
  auto tiny = FitCalibration(hw, m, s, compute_side * 1e-4, 0, 8);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("compute factor"), std::string::npos) << tiny.status().ToString();

  // A disk of 10 kB/s (20 s of reads per token) and a run 100x faster than the compute side predicts, without
  // waiting: even a disk 1000x faster, with the fitted compute factor, predicts more than the run took.
  HardwareParams crawl = hw;
  for (IoPoint& q : crawl.random_reads) q.mb_per_s = 0.01;
  const Prediction crawl_raw = Evaluate(crawl, m, s);
  const double crawl_t =
      (crawl_raw.attention_s + crawl_raw.predictor_s + crawl_raw.ffn_compute_s + crawl_raw.pipeline_s) / 100;
  auto fast = FitCalibration(crawl, m, s, crawl_t, 0, 8);
  ASSERT_TRUE(fast.ok()) << fast.status().ToString();
  ASSERT_GT(Evaluate(Calibrated(crawl, {.compute_scale = fast->compute_scale, .io_scale = 1e-3}), m, s).token_s, crawl_t);
  EXPECT_DOUBLE_EQ(fast->io_scale, 1e-3);
  // A wait of 1e5 times the predicted reads: even a disk 1000x slower predicts less.
  const double long_wait = 1e5 * raw.io_s;
  auto slow = FitCalibration(hw, m, s, compute_side + long_wait, long_wait, 8);
  ASSERT_TRUE(slow.ok()) << slow.status().ToString();
  ASSERT_LT(Evaluate(Calibrated(hw, {.compute_scale = slow->compute_scale, .io_scale = 1e3}), m, s).token_s,
            compute_side + long_wait);
  EXPECT_DOUBLE_EQ(slow->io_scale, 1e3);
}

TEST(PlanFileTest, RoundTripsAndRejectsBadFilesAndOtherDeployments) {
  nflash::testing::TempDir dir;
  const std::string deploy = dir.path();
  {
    std::ofstream(deploy + "/manifest.json") << "{\"a\": 1}\n";
  }
  Plan p;
  p.deployment_hash = HashToHex(HashFile(deploy + "/manifest.json").value());
  p.hardware_hash = "0123456789abcdef";
  p.model_name = "m";
  p.memory_limit_bytes = 3ull << 30;  // above 2^32: 64-bit fields survive
  p.objective = "speed";
  p.compute_threads = 2;
  p.queue_depth = 16;
  p.cluster_neurons = 64;
  p.regions = {{0, -1, 10, 20}, {1, 3, 5, 0}};
  p.shared_cold_pool = true;
  p.predicted.token_s = 0.25;
  p.predicted.memory_bytes = 123;
  p.calibration.compute_scale = 1.5;
  p.calibration.io_scale = 2.5;
  p.calibration.tokens = 16;
  p.calibration.memory_bytes = 5ull << 30;
  const std::string path = deploy + "/plan.json";
  ASSERT_TRUE(SavePlan(p, path, false).ok());
  EXPECT_FALSE(SavePlan(p, path, false).ok());  // no silent overwrite
  auto q = LoadPlan(path);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->memory_limit_bytes, 3ull << 30);
  EXPECT_EQ(q->queue_depth, 16);
  ASSERT_EQ(q->regions.size(), 2u);
  EXPECT_EQ(q->regions[1].expert, 3);
  EXPECT_EQ(q->regions[1].hot_neurons, 5);
  EXPECT_TRUE(q->shared_cold_pool);
  EXPECT_DOUBLE_EQ(q->predicted.token_s, 0.25);
  ASSERT_TRUE(q->calibration.present());
  EXPECT_DOUBLE_EQ(q->calibration.io_scale, 2.5);
  EXPECT_EQ(q->calibration.memory_bytes, 5ull << 30);
  EXPECT_TRUE(CheckPlanForDeployment(*q, deploy).ok());

  {
    std::ofstream(deploy + "/manifest.json") << "{\"a\": 2}\n";
  }
  const Status other = CheckPlanForDeployment(*q, deploy);
  EXPECT_FALSE(other.ok());
  EXPECT_NE(other.message().find("another deployment"), std::string::npos) << other.message();

  std::string text = PlanToJson(p);
  auto bad_version = ParsePlan(std::string(text).replace(text.find("\"schema_version\": 1"), 19,
                                                         "\"schema_version\": 9"), "x.json");
  ASSERT_FALSE(bad_version.ok());
  EXPECT_NE(bad_version.status().message().find("expected 1, found 9"), std::string::npos);
  auto bad_type = ParsePlan(std::string(text).replace(text.find("\"queue_depth\": 16"), 17, "\"queue_depth\": \"x\""),
                            "x.json");
  ASSERT_FALSE(bad_type.ok());
  EXPECT_NE(bad_type.status().message().find("settings.queue_depth"), std::string::npos)
      << bad_type.status().message();
  auto not_json = ParsePlan("not json", "x.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_NE(not_json.status().message().find("x.json: not valid JSON"), std::string::npos);
  // Values out of range, one at a time, each named.
  const std::vector<std::pair<std::pair<std::string, std::string>, std::string>> ranges = {
      {{"\"queue_depth\": 16", "\"queue_depth\": 0"}, "'settings' needs compute_threads >= 1"},
      {{"\"compute_threads\": 2", "\"compute_threads\": 0"}, "'settings' needs compute_threads >= 1"},
      {{"\"hot_neurons\": 5", "\"hot_neurons\": -5"}, "hot_neurons and cold_slots must be >= 0"},
      {{"\"io_scale\": 2.5", "\"io_scale\": 0.0"}, "compute_scale and io_scale must be > 0"},
  };
  for (const auto& [edit, want] : ranges) {
    const size_t where = text.find(edit.first);
    ASSERT_NE(where, std::string::npos) << edit.first << " in " << text;
    auto bad = ParsePlan(std::string(text).replace(where, edit.first.size(), edit.second), "x.json");
    ASSERT_FALSE(bad.ok()) << edit.second;
    EXPECT_NE(bad.status().message().find(want), std::string::npos) << edit.second << ": " << bad.status().ToString();
  }
  // Plans written before shared pools: per-region partitions.
  const size_t at = text.find(",\n    \"shared_cold_pool\": true");
  ASSERT_NE(at, std::string::npos) << text;
  auto older = ParsePlan(std::string(text).erase(at, std::string(",\n    \"shared_cold_pool\": true").size()), "x.json");
  ASSERT_TRUE(older.ok()) << older.status().ToString();
  EXPECT_FALSE(older->shared_cold_pool);
}

// The lookahead `plan --calibrate` chose and the two medians it chose from: kept through the file; plans without them
// leave the lookahead to the runtime (-1) and have compared nothing; out-of-range or half-present values are named.
TEST(PlanFileTest, LookaheadChoiceRoundTripsAndOlderPlansLeaveItToTheRuntime) {
  Plan p;
  p.objective = "speed";
  p.lookahead = 0;
  p.calibration.tokens = 16;
  p.calibration.lookahead_on_token_s = 0.0435;
  p.calibration.lookahead_off_token_s = 0.0408;
  const std::string text = PlanToJson(p);
  auto q = ParsePlan(text, "x.json");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->lookahead, 0);
  EXPECT_TRUE(q->calibration.lookahead_compared());
  EXPECT_DOUBLE_EQ(q->calibration.lookahead_on_token_s, 0.0435);
  EXPECT_DOUBLE_EQ(q->calibration.lookahead_off_token_s, 0.0408);
  p.lookahead = 1376;  // a bundle count is a valid setting too
  auto counted = ParsePlan(PlanToJson(p), "x.json");
  ASSERT_TRUE(counted.ok()) << counted.status().ToString();
  EXPECT_EQ(counted->lookahead, 1376);

  // Without the fields (plans made before them).
  auto erase = [](std::string t, const std::string& field) {
    const size_t at = t.find(field);
    EXPECT_NE(at, std::string::npos) << field << " in " << t;
    return at == std::string::npos ? t : t.erase(at, field.size());
  };
  std::string older = erase(text, "\"lookahead\": 0,");
  older = erase(older, "\"lookahead_off_token_s\": 0.0408,");
  older = erase(older, "\"lookahead_on_token_s\": 0.0435,");
  auto old = ParsePlan(older, "x.json");
  ASSERT_TRUE(old.ok()) << old.status().ToString() << "\n" << older;
  EXPECT_EQ(old->lookahead, -1);
  EXPECT_FALSE(old->calibration.lookahead_compared());
  EXPECT_EQ(PlanToJson(*old).find("lookahead_on_token_s"), std::string::npos) << "not compared: not written";

  // Errors, each naming what is wrong.
  auto below = ParsePlan(std::string(text).replace(text.find("\"lookahead\": 0"), 14, "\"lookahead\": -2"), "x.json");
  ASSERT_FALSE(below.ok());
  EXPECT_NE(below.status().message().find("x.json: field 'settings.lookahead': expected -1 (the runtime's rule), 0 "
                                          "(off) or a bundle count, found -2"),
            std::string::npos)
      << below.status().message();
  auto half = ParsePlan(erase(text, "\"lookahead_off_token_s\": 0.0408,"), "x.json");
  ASSERT_FALSE(half.ok());
  EXPECT_NE(half.status().message().find("lookahead_off_token_s"), std::string::npos) << half.status().message();
  const size_t on_at = text.find("\"lookahead_on_token_s\": 0.0435");
  ASSERT_NE(on_at, std::string::npos);
  auto zero = ParsePlan(std::string(text).replace(on_at, 30, "\"lookahead_on_token_s\": 0.0"), "x.json");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("lookahead_on_token_s and lookahead_off_token_s must be > 0"),
            std::string::npos)
      << zero.status().message();
}

}  // namespace
}  // namespace nflash::planner
