// Activation predictors and the sparse in-memory FFN: training on a separable synthetic problem, the predictor file
// round trip and its rejection for another model, and the oracle sparse FFN against the dense engine on
// stories260K-relu (exact zeros: same logits to fp tolerance, same greedy tokens as the README's golden sample).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>

#include "converter/readers.h"
#include "converter/synth.h"
#include "profiler/predictor_lowrank.h"
#include "profiler/predictor_train.h"
#include "runtime/core/float16.h"
#include "runtime/core/gguf.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "tests/test_util.h"
#include "tests/unit/offload_test_util.h"
#include "tests/unit/small_model.h"

namespace nflash {
namespace {

// A problem a rank-8 predictor can solve: neuron j is active iff (U V x)_j > c_j with V (8 x dim) and U (n_ff x 8).
struct Separable {
  int64_t dim = 32, n_ff = 64, n = 0;
  std::vector<float> x;
  std::vector<uint8_t> mask;
};

Separable MakeSeparable(int64_t n, uint64_t seed) {
  Separable s;
  s.n = n;
  std::mt19937_64 rng(12345);  // the same U, V, c for every call: train and test data share the problem
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(8 * s.dim), u(s.n_ff * 8), c(s.n_ff);
  for (float& a : v) a = nd(rng);
  for (float& a : u) a = nd(rng);
  for (float& a : c) a = 2.0f + nd(rng);  // positive offsets: a minority of neurons is active per token
  std::mt19937_64 data(seed);
  s.x.resize(n * s.dim);
  s.mask.resize(n * s.n_ff);
  for (int64_t t = 0; t < n; ++t) {
    float* xt = s.x.data() + t * s.dim;
    for (int64_t i = 0; i < s.dim; ++i) xt[i] = nd(data);
    float z[8];
    for (int k = 0; k < 8; ++k) {
      z[k] = 0;
      for (int64_t i = 0; i < s.dim; ++i) z[k] += v[k * s.dim + i] * xt[i];
    }
    for (int64_t j = 0; j < s.n_ff; ++j) {
      float y = 0;
      for (int k = 0; k < 8; ++k) y += u[j * 8 + k] * z[k];
      s.mask[t * s.n_ff + j] = y > c[j] ? 1 : 0;
    }
  }
  return s;
}

TEST(PredictorTrainTest, LearnsSeparableProblem) {
  ThreadPool pool(2);
  const Separable train = MakeSeparable(6000, 1);
  profiler::TrainOptions o;
  o.target_recall = 0.98f;
  o.epochs = 20;
  auto L = profiler::TrainLayer(train.x.data(), train.mask.data(), 5000, 1000, train.dim, train.n_ff, 32, o, &pool);
  ASSERT_TRUE(L.ok()) << L.status().ToString();
  // Independent fresh data: recall near the target and a precision the threshold choice does not force.
  const Separable test = MakeSeparable(2000, 99);
  const auto q = profiler::Evaluate(*L, test.dim, test.n_ff, test.x.data(), test.mask.data(), test.n, &pool);
  EXPECT_GT(q.true_fraction, 0.05);
  EXPECT_LT(q.true_fraction, 0.5);
  EXPECT_GE(q.recall, 0.95);
  EXPECT_GE(q.precision, 0.7);
  EXPECT_LE(q.predicted_fraction, 1.5 * q.true_fraction);
}

TEST(LowRankTest, SymmetricEigenDiagonalizes) {
  // A = V^T diag(lambda) V with a known orthonormal V (a product of Givens rotations) and known eigenvalues.
  constexpr int64_t k = 7;
  const std::vector<double> lambda = {9, -4, 6.5, 0.25, 3, 3.5, -1};
  std::vector<double> v(k * k, 0.0);
  for (int64_t i = 0; i < k; ++i) v[i * k + i] = 1.0;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> angle(0.0, 6.28);
  for (int rot = 0; rot < 40; ++rot) {
    const int64_t p = static_cast<int64_t>(rng() % k), q = (p + 1 + static_cast<int64_t>(rng() % (k - 1))) % k;
    const double a = angle(rng), c = std::cos(a), s = std::sin(a);
    for (int64_t j = 0; j < k; ++j) {
      const double vp = v[p * k + j], vq = v[q * k + j];
      v[p * k + j] = c * vp - s * vq;
      v[q * k + j] = s * vp + c * vq;
    }
  }
  std::vector<double> a(k * k, 0.0);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t e = 0; e < k; ++e) a[i * k + j] += v[e * k + i] * lambda[e] * v[e * k + j];
    }
  }
  std::vector<double> values, vectors;
  profiler::SymmetricEigen(a, k, &values, &vectors);
  std::vector<double> sorted = lambda;
  std::sort(sorted.rbegin(), sorted.rend());
  for (int64_t i = 0; i < k; ++i) {
    EXPECT_NEAR(values[i], sorted[i], 1e-9);
    // Each returned vector is, up to sign, the row of V with that eigenvalue.
    const int64_t e = std::find(lambda.begin(), lambda.end(), sorted[i]) - lambda.begin();
    double dot = 0;
    for (int64_t j = 0; j < k; ++j) dot += vectors[i * k + j] * v[e * k + j];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-9) << i;
  }
}

TEST(LowRankTest, PrincipalDirectionsRecoverAKnownSubspace) {
  // g = c B + 0.001 noise, with B (4 x m) orthonormal rows of known scales: the top 4 directions are B's rows (up
  // to sign) with variances scale^2 (c ~ N(0, scale^2) per token), in decreasing order.
  constexpr int64_t n = 3000, m = 96, k = 4;
  const double scale[k] = {5, 3, 2, 1};
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> b(k * m, 0.0);
  for (int64_t i = 0; i < k; ++i) {  // disjoint supports with equal weights: orthonormal by construction
    for (int64_t j = i; j < m; j += k) b[i * m + j] = 1.0 / std::sqrt(static_cast<double>(m / k));
  }
  std::vector<float> g(n * m);
  for (int64_t t = 0; t < n; ++t) {
    double c[k];
    for (int64_t i = 0; i < k; ++i) c[i] = scale[i] * nd(rng);
    for (int64_t j = 0; j < m; ++j) {
      double v = 0.001 * nd(rng);
      for (int64_t i = 0; i < k; ++i) v += c[i] * b[i * m + j];
      g[t * m + j] = static_cast<float>(v);
    }
  }
  ThreadPool pool(2);
  std::vector<double> var;
  const std::vector<float> q = profiler::PrincipalDirections(g.data(), n, m, k, 4, 4, 1, &var, &pool);
  ASSERT_EQ(q.size(), static_cast<size_t>(k * m));
  for (int64_t i = 0; i < k; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < m; ++j) dot += q[i * m + j] * b[i * m + j];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-3) << "direction " << i;
    EXPECT_NEAR(var[i] / (scale[i] * scale[i]), 1.0, 0.1) << "variance " << i;  // sample variance of 3000 draws
  }
}

// A small synthetic model with predictable gates (gate_rank R): the dense engine records inputs and active masks;
// the low-rank fit must find them from the gate weights alone.
TEST(LowRankTest, FitsAPredictableSyntheticModel) {
  testing::TempDir dir;
  for (double noise : {0.0, 0.1}) {
    converter::SynthOptions o;
    o.shape = "custom";
    o.dim = 256;
    o.ffn = 1024;
    o.layers = 2;
    o.heads = 4;
    o.vocab = 300;
    o.context = 128;
    o.type = GgmlType::kF32;
    o.gate_rank = 8;
    o.gate_noise = noise;
    o.threads = 1;
    auto src = converter::BuildSyntheticModel(o, nullptr);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    converter::WriteOptions w;
    w.path = dir.File(noise == 0.0 ? "lowrank0.gguf" : "lowrank1.gguf");
    w.type = GgmlType::kF32;
    w.progress = false;
    const Status written = converter::WriteModelGguf(*src, w);
    ASSERT_TRUE(written.ok()) << written.ToString();
    auto model = Model::Load(w.path, LoadOptions());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    ThreadPool pool(2);
    std::mt19937_64 rng(5);
    std::vector<int32_t> tokens(1536);
    for (int32_t& t : tokens) t = 3 + static_cast<int32_t>(rng() % 297);
    auto samples = profiler::CollectSamples(**model, tokens, 128, &pool);
    ASSERT_TRUE(samples.ok()) << samples.status().ToString();
    profiler::LowRankOptions lo;
    lo.ranks = {16};
    lo.target_recall = 0.99f;
    for (int64_t l = 0; l < 2; ++l) {
      const std::vector<uint8_t> mask = profiler::ActiveMask(*samples, l, 0.0f);
      bool fallback = true;
      auto L = profiler::FitLowRankLayer((*model)->layers()[l].gate, samples->x[l].data(), mask.data(), 1024, 512,
                                         0.0f, lo, &pool, &fallback);
      ASSERT_TRUE(L.ok()) << L.status().ToString();
      EXPECT_EQ(L->info.rank, 32);
      EXPECT_FALSE(fallback);
      // The last 512 tokens (validation: never used for the fit) from the engine's own masks.
      const auto q = profiler::Evaluate(*L, 256, 1024, samples->x[l].data() + 1024 * 256, mask.data() + 1024 * 1024,
                                        512, &pool);
      EXPECT_GT(q.true_fraction, 0.05) << l;
      EXPECT_GE(q.recall, 0.99) << l;
      // Exactly low rank (8 directions + the bias channel's 1/rms): the score is the pre-activation itself up to
      // float rounding, so nearly nothing extra is predicted. With 10% noise the MLP reached ~1.6x on 7B shapes;
      // the closed form must stay within the 1.5x acceptance.
      EXPECT_LE(q.predicted_fraction, (noise == 0.0 ? 1.02 : 1.5) * q.true_fraction) << l << " noise " << noise;
    }
  }
}

// A layer whose logits are small integers in exact float arithmetic: fc1 the identity, fc2 picks one hidden unit per
// neuron (times 1 or 2), integer biases, integer inputs with negative parts (which the ReLU drops). The training
// side's logits and quality counts must follow the runtime's rule exactly: relu, bias, active iff logit > threshold.
TEST(PredictorTrainTest, LogitsAndQualityFollowTheRuntimesRule) {
  constexpr int64_t kDim = 8, kFf = 16, kN = 40;
  PredictorData d;
  d.model_name = "exact";
  d.activation = "relu";
  d.dim = kDim;
  d.n_ff = kFf;
  PredictorLayerData L;
  L.info.rank = kDim;
  L.info.logit_threshold = 1.0f;
  L.fc1.assign(kDim * kDim, 0.0f);
  for (int64_t k = 0; k < kDim; ++k) L.fc1[k * kDim + k] = 1.0f;
  L.fc2.assign(kFf * kDim, 0.0f);
  L.fc2_bias.resize(kFf);
  for (int64_t j = 0; j < kFf; ++j) {
    L.fc2[j * kDim + j % kDim] = j < kDim ? 1.0f : 2.0f;
    L.fc2_bias[j] = -static_cast<float>(j % 3);
  }
  d.layers.push_back(L);
  std::mt19937 rng(4);
  std::vector<float> x(kN * kDim);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 7) - 3);
  auto want = [&](int64_t t, int64_t j) {  // by hand
    return std::max(x[t * kDim + j % kDim], 0.0f) * (j < kDim ? 1.0f : 2.0f) - static_cast<float>(j % 3);
  };
  std::vector<uint8_t> mask(kN * kFf);
  int64_t predicted = 0, tp = 0, truth = 0, ties = 0;
  for (int64_t t = 0; t < kN; ++t) {
    for (int64_t j = 0; j < kFf; ++j) {
      mask[t * kFf + j] = (t + j) % 3 == 0;
      const bool p = want(t, j) > 1.0f;
      predicted += p;
      truth += mask[t * kFf + j];
      tp += p && mask[t * kFf + j];
      ties += want(t, j) == 1.0f;
    }
  }
  ASSERT_GT(ties, 0) << "no logit on the threshold: the rule's strictness is not tested";
  ThreadPool pool(2);
  std::vector<float> lg;
  profiler::PredictorLogits(L, kDim, kFf, x.data(), kN, &lg, &pool);
  auto runtime = Predictor::FromData(d);
  ASSERT_TRUE(runtime.ok()) << runtime.status().ToString();
  PredictorScratch scratch;
  (*runtime)->PrepareScratch(&scratch);
  std::vector<int32_t> active;
  int64_t runtime_predicted = 0;
  for (int64_t t = 0; t < kN; ++t) {
    (*runtime)->Logits(0, x.data() + t * kDim, &scratch, nullptr);
    for (int64_t j = 0; j < kFf; ++j) {
      ASSERT_EQ(lg[t * kFf + j], want(t, j)) << "token " << t << " neuron " << j;
      ASSERT_EQ(scratch.logits[j], want(t, j)) << "runtime, token " << t << " neuron " << j;
    }
    Activation a(x.data() + t * kDim, 1, kDim);
    (*runtime)->Predict(0, a, 0, &scratch, &active, nullptr);
    runtime_predicted += static_cast<int64_t>(active.size());
  }
  EXPECT_EQ(runtime_predicted, predicted);
  const auto q = profiler::Evaluate(L, kDim, kFf, x.data(), mask.data(), kN, &pool);
  const double pairs = static_cast<double>(kN * kFf);
  EXPECT_DOUBLE_EQ(q.predicted_fraction, static_cast<double>(predicted) / pairs);
  EXPECT_DOUBLE_EQ(q.true_fraction, static_cast<double>(truth) / pairs);
  EXPECT_DOUBLE_EQ(q.recall, static_cast<double>(tp) / static_cast<double>(truth));
  EXPECT_DOUBLE_EQ(q.precision, static_cast<double>(tp) / static_cast<double>(predicted));
  // No active neuron: nothing can be missed (recall 1), and the calibrated threshold predicts nothing.
  const std::vector<uint8_t> none(kN * kFf, 0);
  EXPECT_DOUBLE_EQ(profiler::Evaluate(L, kDim, kFf, x.data(), none.data(), kN, &pool).recall, 1.0);
  PredictorLayerData quiet = L;
  profiler::SetThresholdForRecall(&quiet, x.data(), none.data(), kN, kDim, kFf, 0.99f, &pool);
  EXPECT_EQ(quiet.info.logit_threshold, INFINITY);
  EXPECT_EQ(quiet.info.predicted_fraction, 0.0f);
}

// With zero inputs the predictor is its bias: training starts from each neuron's prior (the logit of its firing rate
// on the training tokens) and descends the weighted cross-entropy to its minimum, where sigmoid(b) =
// w p / (w p + 1 - p) for positive weight w (derived by setting the derivative -w p (1 - s) + (1 - p) s to 0).
TEST(PredictorTrainTest, AConstantPredictorLearnsTheWeightedPrior) {
  constexpr int64_t kDim = 8, kFf = 8, kTrain = 200, kVal = 40;
  std::vector<float> x((kTrain + kVal) * kDim, 0.0f);
  std::vector<uint8_t> mask((kTrain + kVal) * kFf);
  std::vector<double> rate(kFf);
  for (int64_t j = 0; j < kFf; ++j) {
    const int64_t on = 1 + j;  // neuron j fires on (1 + j) of every 10 tokens
    rate[j] = static_cast<double>(on) / 10.0;
    for (int64_t t = 0; t < kTrain + kVal; ++t) mask[t * kFf + j] = t % 10 < on;
  }
  ThreadPool pool(2);
  profiler::TrainOptions o;
  o.batch = kTrain;  // one full-batch step per epoch: the exact gradient
  o.pos_weight = 3.0f;
  o.learning_rate = 0.05f;
  o.epochs = 0;
  auto prior = profiler::TrainLayer(x.data(), mask.data(), kTrain, kVal, kDim, kFf, 4, o, &pool);
  ASSERT_TRUE(prior.ok()) << prior.status().ToString();
  o.epochs = 600;
  auto trained = profiler::TrainLayer(x.data(), mask.data(), kTrain, kVal, kDim, kFf, 4, o, &pool);
  ASSERT_TRUE(trained.ok()) << trained.status().ToString();
  for (int64_t j = 0; j < kFf; ++j) {
    const double p = rate[j], w = o.pos_weight;
    EXPECT_NEAR(prior->fc2_bias[j], std::log(p / (1 - p)), 1e-5) << "neuron " << j;
    EXPECT_NEAR(trained->fc2_bias[j], std::log(w * p / (1 - p)), 0.02) << "neuron " << j;
  }
}

// Ranks are tried smallest first: the first that reaches the recall target within max_predicted_ratio x the true
// active count is taken; when none does, the one predicting the fewest neurons, marked as a fallback. Each candidate
// is trained here on its own (training is deterministic for a seed and rank) and the rule applied by hand.
TEST(PredictorTrainTest, ChoosesTheSmallestRankThatQualifies) {
  ThreadPool pool(2);
  const Separable s = MakeSeparable(2500, 3);
  profiler::TrainOptions o;
  o.epochs = 3;
  o.ranks = {16, 2, 8};
  int several = 0, fallbacks = 0;  // cases where more than one rank qualifies; cases where none does
  for (float target : {0.95f, 0.8f}) {
    o.target_recall = target;
    std::map<int64_t, PredictorLayerData> each;
    for (int64_t r : {2, 8, 16}) {
      auto L = profiler::TrainLayer(s.x.data(), s.mask.data(), 2000, 500, s.dim, s.n_ff, r, o, &pool);
      ASSERT_TRUE(L.ok()) << L.status().ToString();
      each[r] = *L;
    }
    for (float ratio : {4.0f, 1.5f, 1.2f, 0.5f}) {
      SCOPED_TRACE("recall " + std::to_string(target) + ", max_predicted_ratio " + std::to_string(ratio));
      o.max_predicted_ratio = ratio;
      int64_t want = 0;
      int qualified = 0;
      for (const auto& [r, L] : each) {
        if (L.info.recall >= target && L.info.predicted_fraction <= ratio * L.info.true_fraction) {
          ++qualified;
          if (want == 0) want = r;
        }
      }
      several += qualified > 1;
      const bool want_fallback = want == 0;
      fallbacks += want_fallback;
      if (want_fallback) {
        for (const auto& [r, L] : each) {
          if (want == 0 || L.info.predicted_fraction < each[want].info.predicted_fraction) want = r;
        }
      }
      bool fallback = !want_fallback;
      auto got =
          profiler::TrainLayerChooseRank(s.x.data(), s.mask.data(), 2000, 500, s.dim, s.n_ff, o, &pool, &fallback);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(got->info.rank, want);
      EXPECT_EQ(fallback, want_fallback);
      EXPECT_EQ(got->fc1, each[want].fc1);
    }
  }
  EXPECT_GT(several, 0) << "no case where the order of the ranks matters";
  EXPECT_GT(fallbacks, 0) << "no case without a qualifying rank";
}

// SiLU never gives exact zeros: the low-rank fit moves its boundary to the gate value whose silu is the threshold.
TEST(LowRankTest, ActivationBoundaryIsWhereSiluCrossesTheThreshold) {
  for (float t : {0.05f, 0.3f, 1.0f, 4.0f}) {
    const double b = profiler::ActivationBoundary(FfnActivation::kSilu, t);
    EXPECT_GT(b, 0.0) << t;
    EXPECT_NEAR(b / (1.0 + std::exp(-b)), t, 1e-5) << t;
  }
  EXPECT_EQ(profiler::ActivationBoundary(FfnActivation::kRelu, 0.3f), 0.0f);
  EXPECT_EQ(profiler::ActivationBoundary(FfnActivation::kSilu, 0.0f), 0.0f);
}

// With as many directions as neurons the subspace is everything and the fit is exact: a neuron's score is positive
// exactly where its gate exceeds the boundary (away from float ties). Ranks above the training tokens are cut to
// them; a ratio no rank can meet gives the fallback.
TEST(LowRankTest, AFullRankFitSeparatesAtTheBoundary) {
  constexpr int64_t kDim = 16, kFf = 12, kTrain = 300, kVal = 200;
  constexpr float kBoundary = 0.3f;
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(kFf * kDim), x((kTrain + kVal) * kDim);
  for (float& v : w) v = nd(rng);
  for (float& v : x) v = nd(rng);
  const MatrixView gate = DenseMatrix(GgmlType::kF32, w.data(), kFf, kDim);
  std::vector<float> g((kTrain + kVal) * kFf);
  Gemm(gate, x.data(), kTrain + kVal, g.data(), nullptr);
  std::vector<uint8_t> mask(g.size());
  for (size_t i = 0; i < g.size(); ++i) mask[i] = g[i] > kBoundary;
  ThreadPool pool(2);
  profiler::LowRankOptions o;
  o.ranks = {kFf};
  o.target_recall = 0.99f;
  bool fallback = true;
  auto L = profiler::FitLowRankLayer(gate, x.data(), mask.data(), kTrain, kVal, kBoundary, o, &pool, &fallback);
  ASSERT_TRUE(L.ok()) << L.status().ToString();
  std::vector<float> lg;
  profiler::PredictorLogits(*L, kDim, kFf, x.data() + kTrain * kDim, kVal, &lg, &pool);
  int64_t checked = 0;
  for (int64_t i = 0; i < kVal * kFf; ++i) {
    const float margin = g[kTrain * kFf + i] - kBoundary;
    if (std::fabs(margin) < 1e-3f) continue;
    ASSERT_EQ(lg[i] > 0.0f, margin > 0.0f) << "pair " << i << ": gate margin " << margin << ", score " << lg[i];
    ++checked;
  }
  EXPECT_GT(checked, kVal * kFf * 9 / 10);
  // Eight training tokens: at most eight directions (file rank 16).
  auto few = profiler::FitLowRankLayer(gate, x.data(), mask.data(), 8, kVal, kBoundary, o, &pool, &fallback);
  ASSERT_TRUE(few.ok()) << few.status().ToString();
  EXPECT_EQ(few->info.rank, 2 * 8);
  // No rank meets 0.5x the true count at 99% recall: the fallback predicts the fewest. With every direction iterated
  // (oversample past n_ff) a rank's layer does not depend on the other candidates, so each is fitted alone to compare.
  o.oversample = 100;
  o.max_predicted_ratio = 0.5f;
  std::map<int64_t, PredictorLayerData> alone;
  for (int64_t r : {2, 4}) {
    o.ranks = {r};
    auto one = profiler::FitLowRankLayer(gate, x.data(), mask.data(), kTrain, kVal, kBoundary, o, &pool, &fallback);
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    alone[r] = *one;
  }
  const int64_t fewest = alone[2].info.predicted_fraction <= alone[4].info.predicted_fraction ? 2 : 4;
  o.ranks = {4, 2};
  fallback = false;
  auto none = profiler::FitLowRankLayer(gate, x.data(), mask.data(), kTrain, kVal, kBoundary, o, &pool, &fallback);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(fallback);
  EXPECT_EQ(none->info.rank, 2 * fewest);
  EXPECT_EQ(none->info.predicted_fraction, alone[fewest].info.predicted_fraction);
  EXPECT_EQ(none->fc2_bias, alone[fewest].fc2_bias);
}

// Samples from the SiLU stories260K: the gate magnitudes (SiLU is negative below 0: the magnitude, not the value),
// a window beyond the context cut to it (the same samples as the default), and sparsity 0 meaning threshold 0.
TEST(PredictorTrainTest, SamplesAreMagnitudesInContextSizedWindows) {
  testing::TempDir dir;
  auto src = converter::ReadLlama2c(testing::SharedPath("models/stories260K/stories260K.bin"),
                                    testing::SharedPath("models/stories260K/tok512.bin"), FfnActivation::kSilu);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  converter::WriteOptions wo;
  wo.path = dir.File("silu.gguf");
  wo.progress = false;
  ASSERT_TRUE(converter::WriteModelGguf(*src, wo).ok());
  auto model = Model::Load(wo.path, LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ASSERT_EQ(hp.activation, FfnActivation::kSilu);
  std::mt19937 rng(2);
  std::vector<int32_t> tokens(static_cast<size_t>(hp.context_length + 40));
  for (int32_t& t : tokens) t = 3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(hp.n_vocab - 3));
  ThreadPool pool(2);
  auto a = profiler::CollectSamples(**model, tokens, 0, &pool);
  auto b = profiler::CollectSamples(**model, tokens, 100 * hp.context_length, &pool);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->x, b->x) << "a window beyond the context is the context";
  const std::vector<float>& g = a->gate_abs[0];
  ASSERT_EQ(g.size(), tokens.size() * static_cast<size_t>(hp.n_ff));
  EXPECT_GE(*std::min_element(g.begin(), g.end()), 0.0f);
  EXPECT_GT(*std::max_element(g.begin(), g.end()), 0.0f);
  for (float t : profiler::SparsityThresholds(*a, 0.0)) EXPECT_EQ(t, 0.0f);
}

// The small synthetic model (tests/unit/small_model.h) with 4 experts, F32, written to `dir` and loaded.
void LoadSmallMoe(const testing::TempDir& dir, std::unique_ptr<Model>* out) {
  ASSERT_EQ(testing::WriteSmallModel(dir.File("moe.gguf"), GgmlType::kF32, /*experts=*/4), "");
  auto model = Model::Load(dir.File("moe.gguf"), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_EQ((*model)->hparams().n_experts, 4);
  *out = std::move(model).value();
}

// An expert the calibration tokens never reached gets its layer's other FFN inputs, taken in turn from each other
// expert, and its own |relu(gate . x)| on them, summed here in double from the F32 file's rows; the other experts'
// samples stay as they were.
TEST(PredictorTrainTest, AnUnroutedExpertBorrowsItsLayersInputs) {
  testing::TempDir dir;
  std::unique_ptr<Model> model;
  ASSERT_NO_FATAL_FAILURE(LoadSmallMoe(dir, &model));
  const LlamaHparams& hp = model->hparams();
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(40);
  for (int32_t& t : tokens) t = 3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(hp.n_vocab - 3));
  ThreadPool pool(2);
  auto s = profiler::CollectSamples(*model, tokens, 0, &pool);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const int64_t layer = 1, expert = 2, g = layer * 4 + expert, dim = hp.dim, n_ff = hp.n_ff;
  const profiler::ActivationSamples before = *s;
  // The rows expected: row 0 of experts 0, 1, 3, then row 1 of each, ..., skipping an expert whose rows ran out.
  std::vector<float> want;
  for (int64_t i = 0; static_cast<int64_t>(want.size()) < 30 * dim; ++i) {
    bool any = false;
    for (int64_t e : {0, 1, 3}) {
      const size_t o = static_cast<size_t>(layer * 4 + e);
      if (i >= before.group_tokens[o] || static_cast<int64_t>(want.size()) >= 30 * dim) continue;
      want.insert(want.end(), before.x[o].begin() + i * dim, before.x[o].begin() + (i + 1) * dim);
      any = true;
    }
    ASSERT_TRUE(any) << "40 tokens x 2 experts each fill 30 rows";
  }
  EXPECT_EQ(profiler::BorrowLayerInputs(*model, &*s, g, 30, &pool), 30);
  EXPECT_EQ(s->group_tokens[g], 30);
  EXPECT_EQ(s->x[g], want);
  const LayerWeights& W = model->layers()[layer];
  const float* gate = static_cast<const float*>(W.Expert(W.gate, W.expert_stride_gate, expert).data);
  ASSERT_EQ(s->gate_abs[g].size(), static_cast<size_t>(30 * n_ff));
  int64_t active = 0;
  for (int64_t t = 0; t < 30; ++t) {
    for (int64_t j = 0; j < n_ff; ++j) {
      double d = 0;
      for (int64_t k = 0; k < dim; ++k) d += double(gate[j * dim + k]) * want[t * dim + k];
      EXPECT_NEAR(s->gate_abs[g][t * n_ff + j], std::max(d, 0.0), 1e-4) << "token " << t << " neuron " << j;
      active += d > 0;
    }
  }
  EXPECT_GT(active, 0);
  EXPECT_LT(active, 30 * n_ff);
  for (int64_t o = 0; o < static_cast<int64_t>(before.x.size()); ++o) {
    if (o == g) continue;
    EXPECT_EQ(s->x[o], before.x[o]) << "group " << o;
    EXPECT_EQ(s->gate_abs[o], before.gate_abs[o]) << "group " << o;
  }
}

PredictorData RandomData(int64_t dim, int64_t n_ff, int64_t layers, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  PredictorData d;
  d.model_hash = "0123456789abcdef";
  d.model_name = "test";
  d.activation = "relu";
  d.dim = dim;
  d.n_ff = n_ff;
  d.target_recall = 0.98f;
  d.train_tokens = 100;
  for (int64_t l = 0; l < layers; ++l) {
    PredictorLayerData L;
    L.info.rank = 8 * (l + 1);
    L.info.logit_threshold = 0.1f * static_cast<float>(l);
    L.info.activation_threshold = 0.0f;
    L.info.recall = 0.97f;
    L.fc1.resize(L.info.rank * dim);
    L.fc2.resize(n_ff * L.info.rank);
    L.fc2_bias.resize(n_ff);
    for (float& v : L.fc1) v = nd(rng);
    for (float& v : L.fc2) v = nd(rng);
    for (float& v : L.fc2_bias) v = nd(rng);
    d.layers.push_back(L);
  }
  return d;
}

TEST(PredictorFileTest, RoundTrip) {
  testing::TempDir dir;
  const PredictorData d = RandomData(64, 96, 3, 7);
  ASSERT_TRUE(SavePredictor(d, dir.File("p.gguf"), false).ok());
  EXPECT_FALSE(SavePredictor(d, dir.File("p.gguf"), false).ok());  // refuses to overwrite
  auto p = Predictor::Load(dir.File("p.gguf"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->n_layers(), 3);
  EXPECT_EQ((*p)->model_hash(), d.model_hash);
  EXPECT_EQ((*p)->info(2).rank, 24);
  EXPECT_FLOAT_EQ((*p)->info(1).logit_threshold, 0.1f);
  EXPECT_FLOAT_EQ((*p)->info(0).recall, 0.97f);
  // Logits against a direct float computation from the data.
  PredictorScratch scratch;
  (*p)->PrepareScratch(&scratch);
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i));
  for (int64_t l = 0; l < 3; ++l) {
    const PredictorLayerData& L = d.layers[l];
    (*p)->Logits(l, x.data(), &scratch, nullptr);
    std::vector<float> h(L.info.rank);
    for (int64_t k = 0; k < L.info.rank; ++k) {
      double s = 0;
      for (int64_t i = 0; i < 64; ++i) s += L.fc1[k * 64 + i] * x[i];
      h[k] = std::max(0.0f, static_cast<float>(s));
    }
    std::vector<int32_t> expect_active;
    for (int64_t j = 0; j < 96; ++j) {
      double s = L.fc2_bias[j];
      for (int64_t k = 0; k < L.info.rank; ++k) s += L.fc2[j * L.info.rank + k] * h[k];
      EXPECT_NEAR(scratch.logits[j], s, 1e-3 * (1 + std::fabs(s))) << "layer " << l << " neuron " << j;
      if (s > L.info.logit_threshold + 1e-3) expect_active.push_back(static_cast<int32_t>(j));
    }
    Activation a(x.data(), 1, 64);
    std::vector<int32_t> active;
    (*p)->Predict(l, a, 0, &scratch, &active, nullptr);
    for (int32_t j : expect_active) EXPECT_TRUE(std::binary_search(active.begin(), active.end(), j));
  }
  EXPECT_EQ((*p)->PredictorBytes(), (64 * 8 + 96 * 8 + 64 * 16 + 96 * 16 + 64 * 24 + 96 * 24 + 3 * 96) * 4u);
  // F16 weights: same predictions within half precision.
  ASSERT_TRUE(SavePredictor(d, dir.File("p16.gguf"), false, GgmlType::kF16).ok());
  auto p16 = Predictor::Load(dir.File("p16.gguf"));
  ASSERT_TRUE(p16.ok()) << p16.status().ToString();
  EXPECT_LT((*p16)->PredictorBytes(), (*p)->PredictorBytes());
}

// Layers wider than one work chunk (the logits are split over threads by neuron): F32 and F16 files give the direct
// sums of their (rounded) weights, and the same bits with and without a thread pool.
TEST(PredictorFileTest, WideLayerLogitsMatchDirectSumsOnAnyThreadCount) {
  testing::TempDir dir;
  constexpr int64_t kDim = 64, kFf = 8200;
  const PredictorData d = RandomData(kDim, kFf, 3, 11);
  ThreadPool pool(2);
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16}) {
    const std::string path = dir.File("wide-" + std::string(GgmlTypeName(type)) + ".gguf");
    ASSERT_TRUE(SavePredictor(d, path, false, type).ok());
    auto p = Predictor::Load(path);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    auto stored = [&](float v) { return type == GgmlType::kF16 ? Fp16ToFp32(Fp32ToFp16(v)) : v; };
    PredictorScratch serial, threaded;
    (*p)->PrepareScratch(&serial);
    (*p)->PrepareScratch(&threaded);
    std::vector<float> x(kDim);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.7f * static_cast<float>(i));
    for (int64_t l = 0; l < 3; ++l) {
      const PredictorLayerData& L = d.layers[static_cast<size_t>(l)];
      (*p)->Logits(l, x.data(), &serial, nullptr);
      (*p)->Logits(l, x.data(), &threaded, &pool);
      ASSERT_EQ(0, std::memcmp(serial.logits.data(), threaded.logits.data(), kFf * sizeof(float))) << "layer " << l;
      std::vector<double> h(static_cast<size_t>(L.info.rank));
      int live = 0;
      for (int64_t k = 0; k < L.info.rank; ++k) {
        double s = 0;
        for (int64_t i = 0; i < kDim; ++i) s += static_cast<double>(stored(L.fc1[k * kDim + i])) * x[i];
        h[k] = std::max(0.0, s);
        live += h[k] > 0;
      }
      EXPECT_GT(live, 0);
      EXPECT_LT(live, L.info.rank);  // some hidden units are zero: the skipped rows must not matter
      const double tol = type == GgmlType::kF16 ? 2e-3 : 1e-4;
      for (int64_t j = 0; j < kFf; ++j) {
        double s = L.fc2_bias[j];
        for (int64_t k = 0; k < L.info.rank; ++k) s += static_cast<double>(stored(L.fc2[j * L.info.rank + k])) * h[k];
        ASSERT_NEAR(serial.logits[j], s, tol * (1 + std::fabs(s))) << GgmlTypeName(type) << " layer " << l
                                                                     << " neuron " << j;
      }
      // Predict: exactly the neurons whose logit passes the threshold, ascending (8200 = 128 x 64 + 8: a partial last
      // word of the mask).
      std::vector<int32_t> expect_active, active;
      for (int64_t j = 0; j < kFf; ++j) {
        if (serial.logits[j] > L.info.logit_threshold) expect_active.push_back(static_cast<int32_t>(j));
      }
      ASSERT_FALSE(expect_active.empty());
      Activation a(x.data(), 1, kDim);
      (*p)->Predict(l, a, 0, &serial, &active, &pool);
      EXPECT_EQ(active, expect_active) << GgmlTypeName(type) << " layer " << l;
    }
  }
}

// A mixture-of-experts predictor: one per (layer, expert), group g = layer x n_experts + expert, stored as
// blk.L.exp.E.*; each group's logits are its own weights' (checked against the data directly).
TEST(PredictorFileTest, ExpertGroupsRoundTripUnderTheirOwnNames) {
  testing::TempDir dir;
  PredictorData d = RandomData(32, 48, 6, 11);  // 3 layers x 2 experts
  d.n_experts = 2;
  ASSERT_TRUE(SavePredictor(d, dir.File("moe.gguf"), false).ok());
  auto f = GgufFile::OpenPath(dir.File("moe.gguf"));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_NE(f->FindTensor("blk.2.exp.1.fc2.weight"), nullptr);
  EXPECT_EQ(f->FindTensor("blk.5.fc1.weight"), nullptr);
  auto p = Predictor::Load(dir.File("moe.gguf"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->n_layers(), 3);
  EXPECT_EQ((*p)->n_experts(), 2);
  EXPECT_EQ((*p)->n_groups(), 6);
  EXPECT_EQ((*p)->Group(2, 1), 5);
  EXPECT_EQ((*p)->info((*p)->Group(1, 0)).rank, 24);  // group 2: rank 8 x 3
  PredictorScratch scratch;
  (*p)->PrepareScratch(&scratch);
  std::vector<float> x(32);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(static_cast<float>(i));
  for (int64_t g = 0; g < 6; ++g) {
    const PredictorLayerData& L = d.layers[static_cast<size_t>(g)];
    (*p)->Logits(g, x.data(), &scratch, nullptr);
    for (int64_t j = 0; j < 48; ++j) {
      double h_dot = L.fc2_bias[j];
      for (int64_t k = 0; k < L.info.rank; ++k) {
        double s = 0;
        for (int64_t i = 0; i < 32; ++i) s += L.fc1[k * 32 + i] * x[i];
        h_dot += L.fc2[j * L.info.rank + k] * std::max(0.0, s);
      }
      EXPECT_NEAR(scratch.logits[j], h_dot, 1e-3 * (1 + std::fabs(h_dot))) << "group " << g << " neuron " << j;
    }
  }
  // Groups that do not divide into layers of n_experts are refused.
  d.layers.pop_back();
  EXPECT_FALSE(SavePredictor(d, dir.File("bad.gguf"), false).ok());
  EXPECT_FALSE(Predictor::FromData(d).ok());
}

TEST(PredictorFileTest, RejectsCorruptAndForeignFiles) {
  testing::TempDir dir;
  PredictorData d = RandomData(64, 96, 2, 3);
  d.layers[1].fc2.pop_back();  // size no longer matches the rank
  EXPECT_FALSE(SavePredictor(d, dir.File("bad.gguf"), false).ok());
  testing::WriteText(dir.File("junk.gguf"), "not a gguf file at all");
  EXPECT_FALSE(Predictor::Load(dir.File("junk.gguf")).ok());
  EXPECT_FALSE(Predictor::Load(dir.File("missing.gguf")).ok());
}

// A valid predictor file with one field changed (testing::RewriteGguf): each is refused with its own message, naming
// the field or tensor (a looser expectation would pass on whichever later check fails instead).
TEST(PredictorFileTest, EachCorruptFieldIsNamed) {
  testing::TempDir dir;
  const std::string good = dir.File("good.gguf");
  ASSERT_TRUE(SavePredictor(RandomData(64, 96, 2, 5), good, false).ok());
  ASSERT_TRUE(Predictor::Load(good).ok());
  using testing::EditGgufKey;
  using testing::SetGgufKey;
  auto edit_array = [](const std::string& key, std::function<void(GgufArray&)> edit) {
    return EditGgufKey(key, [edit](GgufValue& v) { edit(std::get<GgufArray>(v.v)); });
  };
  struct Case {
    const char* what;
    testing::GgufKvEdit kv;
    std::function<void(testing::GgufTensorCopy*)> tensor;
    const char* message;
  };
  const std::string k = "nflash.predictor.";
  const std::vector<Case> cases = {
      {"no schema version", SetGgufKey(k + "schema_version", std::nullopt), nullptr, "not an nflash predictor file"},
      {"future schema", SetGgufKey(k + "schema_version", GgufValue(uint32_t{99})), nullptr,
       "predictor schema version 99"},
      {"dim 0", SetGgufKey(k + "dim", GgufValue(uint32_t{0})), nullptr, "implausible predictor shape dim 0"},
      {"0 experts", SetGgufKey(k + "n_experts", GgufValue(uint32_t{0})), nullptr, "n_experts is 0, expected 1..1024"},
      {"one rank for two layers", edit_array(k + "rank", [](GgufArray& a) { a.items.pop_back(); }), nullptr,
       "rank has 1 items, expected 2"},
      {"text ranks", edit_array(k + "rank", [](GgufArray& a) { a = GgufArray{GgufType::kString, {"8", "16"}}; }),
       nullptr, "rank holds a non-numeric item"},
      {"rank 0",
       edit_array(k + "rank",
                  [](GgufArray& a) {
                    std::visit(
                        [](auto& x) {
                          if constexpr (std::is_arithmetic_v<std::decay_t<decltype(x)>>) x = 0;
                        },
                        a.items[1].v);
                  }),
       nullptr, "blk.1.fc1.weight: rank 0"},
      {"missing fc2", nullptr,
       [](testing::GgufTensorCopy* t) {
         if (t->name == "blk.1.fc2.weight") t->name = "blk.1.fc3.weight";
       },
       "missing tensor blk.1.fc2.weight"},
      {"quantized fc1", nullptr, testing::RetypeGgufTensor("blk.0.fc1.weight", GgmlType::kQ8_0),
       "tensor blk.0.fc1.weight has type q8_0, expected F32 or F16"},
      {"f16 bias", nullptr, testing::RetypeGgufTensor("blk.0.fc2.bias", GgmlType::kF16),
       "tensor blk.0.fc2.bias must be F32 with 96 elements"},
  };
  for (const Case& c : cases) {
    const std::string bad = dir.File("bad.gguf");
    ASSERT_EQ(testing::RewriteGguf(good, bad, c.kv, c.tensor), "") << c.what;
    auto p = Predictor::Load(bad);
    ASSERT_FALSE(p.ok()) << c.what;
    EXPECT_NE(p.status().message().find(c.message), std::string::npos) << c.what << ": " << p.status().message();
  }
  const Status s = SavePredictor(RandomData(64, 96, 2, 5), dir.File("q8.gguf"), false, GgmlType::kQ8_0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("predictor weights must be F32 or F16, not q8_0"), std::string::npos) << s.message();
}

// stories260K-relu converted to an F32 GGUF (shared by the tests below).
std::string ConvertRelu(const testing::TempDir& dir) {
  const std::string path = dir.File("relu.gguf");
  const Status s = sparse::WriteStoriesReluF32(path);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return path;
}

TEST(PredictorFileTest, RejectsPredictorOfAnotherModel) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertRelu(dir), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  // Right shape: accepted without a hash, rejected with a different hash.
  auto ok = Predictor::FromData(RandomData(hp.dim, hp.n_ff, hp.n_layers, 1));
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE((*ok)->CheckForModel(**model, "", "relu.gguf").ok());
  Status s = (*ok)->CheckForModel(**model, "fedcba9876543210", "relu.gguf");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("hash"), std::string::npos) << s.message();
  // Wrong dims or layer count: rejected, also by SparseFfn::Create.
  auto wrong = Predictor::FromData(RandomData(hp.dim, hp.n_ff + 32, hp.n_layers, 1));
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE((*wrong)->CheckForModel(**model, "", "relu.gguf").ok());
  ThreadPool pool(1);
  SparseFfnOptions o;
  o.mode = SparseMode::kPredictor;
  EXPECT_FALSE(SparseFfn::Create(**model, wrong->get(), o, &pool).ok());
  auto fewer = Predictor::FromData(RandomData(hp.dim, hp.n_ff, hp.n_layers - 1, 1));
  EXPECT_FALSE((*fewer)->CheckForModel(**model, "", "relu.gguf").ok());
}

TEST(SparseFfnTest, OracleEqualsDenseOnReluModel) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertRelu(dir), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const int64_t n_vocab = (*model)->hparams().n_vocab;
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    InferenceContext dense(**model, &pool, 128), sparse(**model, &pool, 128);
    auto ffn = SparseFfn::Create(**model, nullptr, SparseFfnOptions(), &pool);
    ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
    sparse.SetFfnBackend(ffn->get());
    // The README's golden prompt [1, 403, 407, 261, 378] and its first 64 greedy continuation ids.
    const std::vector<int32_t> golden = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
                                         335, 311, 267, 422, 419, 269, 344, 444, 427, 421, 414, 276, 265, 263, 304, 341,
                                         426, 385, 328, 432, 358, 263, 377, 267, 265, 282, 295, 433, 335, 311, 357, 343,
                                         426, 338, 394, 261, 370, 268, 414, 444, 269, 391, 266, 267, 337, 335, 312, 426};
    std::vector<int32_t> prompt = {1, 403, 407, 261, 378};
    std::vector<int32_t> got_dense, got_sparse;
    double max_diff = 0;
    for (int32_t t : prompt) {
      ASSERT_TRUE(dense.Eval({&t, 1}, false).ok());
      ASSERT_TRUE(sparse.Eval({&t, 1}, false).ok());
    }
    for (int i = 0; i < 64; ++i) {
      const float* a = dense.logits();
      const float* b = sparse.logits();
      for (int64_t v = 0; v < n_vocab; ++v) max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[v] - b[v])));
      int32_t na = static_cast<int32_t>(std::max_element(a, a + n_vocab) - a);
      int32_t nb = static_cast<int32_t>(std::max_element(b, b + n_vocab) - b);
      got_dense.push_back(na);
      got_sparse.push_back(nb);
      ASSERT_TRUE(dense.Eval({&na, 1}, false).ok());
      ASSERT_TRUE(sparse.Eval({&nb, 1}, false).ok());
    }
    EXPECT_EQ(got_sparse, golden);
    EXPECT_EQ(got_dense, golden);
    EXPECT_LT(max_diff, 1e-3) << "oracle sparse FFN logits differ from dense by " << max_diff;
    // ReLU: the exact active set is a minority (the README measures 86.4% zeros) and recall is 1 by definition.
    double active = 0;
    for (const SparseFfnLayerStats& s : (*ffn)->stats()) {
      EXPECT_EQ(s.tokens, 5 + 64);
      EXPECT_EQ(s.true_positive, s.true_active);
      active += static_cast<double>(s.active) / static_cast<double>(s.tokens * (*model)->hparams().n_ff);
    }
    active /= static_cast<double>((*ffn)->stats().size());
    EXPECT_GT(active, 0.05);
    EXPECT_LT(active, 0.3);
  }
}

// Quantized weights: the transposed down is requantized by column in the model's type (ColumnType, as the packer
// does), so oracle and dense agree to that second rounding, not bit for bit. A small synthetic ReLU model (sparse
// through its weights) in Q8_0 and Q4_0. The bound is independent of the sparse code: the second rounding, of the down
// columns only, must move the logits less than quantizing the whole model did (dense quantized against dense F32 of
// the same weights); Q8_0 also within 5% of the largest logit.
TEST(SparseFfnTest, OracleCloseToDenseOnQuantizedModel) {
  testing::TempDir dir;
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    converter::SynthOptions o;
    o.shape = "custom";
    o.dim = 128;
    o.ffn = 256;
    o.layers = 2;
    o.heads = 4;
    o.vocab = 300;
    o.context = 64;
    o.type = type;
    o.threads = 1;
    auto src = converter::BuildSyntheticModel(o, nullptr);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    converter::WriteOptions w;
    w.path = dir.File(std::string("synth-") + std::string(GgmlTypeName(type)) + ".gguf");
    w.type = type;
    w.progress = false;
    w.q4_0_scale_search = false;
    ASSERT_TRUE(converter::WriteModelGguf(*src, w).ok());
    auto model = Model::Load(w.path, LoadOptions());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    converter::WriteOptions wf = w;
    wf.path = dir.File(std::string("synth-f32-") + std::string(GgmlTypeName(type)) + ".gguf");
    wf.type = GgmlType::kF32;
    ASSERT_TRUE(converter::WriteModelGguf(*src, wf).ok());
    auto model_f32 = Model::Load(wf.path, LoadOptions());
    ASSERT_TRUE(model_f32.ok()) << model_f32.status().ToString();
    ThreadPool pool(2);
    InferenceContext dense(**model, &pool, 64), sparse(**model, &pool, 64), exact(**model_f32, &pool, 64);
    auto ffn = SparseFfn::Create(**model, nullptr, SparseFfnOptions(), &pool);
    ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
    sparse.SetFfnBackend(ffn->get());
    double max_diff = 0, max_abs = 0, quant_diff = 0;
    for (int32_t t = 3; t < 40; ++t) {
      const int32_t tok = (t * 37) % 300;
      ASSERT_TRUE(dense.Eval({&tok, 1}, false).ok());
      ASSERT_TRUE(sparse.Eval({&tok, 1}, false).ok());
      ASSERT_TRUE(exact.Eval({&tok, 1}, false).ok());
      for (int64_t v = 0; v < 300; ++v) {
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(dense.logits()[v] - sparse.logits()[v])));
        quant_diff = std::max(quant_diff, static_cast<double>(std::fabs(dense.logits()[v] - exact.logits()[v])));
        max_abs = std::max(max_abs, static_cast<double>(std::fabs(dense.logits()[v])));
      }
    }
    EXPECT_GT(max_abs, 0.1);
    EXPECT_GT(max_diff, 0.0) << GgmlTypeName(type);  // requantized: not the dense function
    EXPECT_LT(max_diff, quant_diff) << GgmlTypeName(type) << ": max |logit| " << max_abs;
    if (type == GgmlType::kQ8_0) {
      EXPECT_LT(max_diff, 0.05 * max_abs);
    }
    const SparseFfnLayerStats& s = (*ffn)->stats()[0];
    EXPECT_LT(static_cast<double>(s.active) / static_cast<double>(s.tokens * 256), 0.3);  // synth: ~10% active
  }
}

// The sparse FFN's statistics describe decode: a prompt (token by token below batched_prefill_min_tokens, by GEMM
// above) is not counted unless sparse_prefill asks for every batch (perplexity).
TEST(SparseFfnTest, StatisticsCountDecodeTokensOnly) {
  testing::TempDir dir;
  converter::SynthOptions o;
  o.shape = "custom";
  o.dim = 64;
  o.ffn = 128;
  o.layers = 2;
  o.heads = 4;
  o.vocab = 300;
  o.context = 128;
  o.type = GgmlType::kF32;
  auto model = sparse::WriteSyntheticModel(o, dir.File("synth.gguf"));
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ThreadPool pool(2);
  for (const int prompt_len : {5, 70}) {
    for (const bool sparse_prefill : {false, true}) {
      SCOPED_TRACE("prompt " + std::to_string(prompt_len) + (sparse_prefill ? " sparse_prefill" : ""));
      SparseFfnOptions so;
      so.sparse_prefill = sparse_prefill;
      auto ffn = SparseFfn::Create(**model, nullptr, so, &pool);
      ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
      InferenceContext ctx(**model, &pool, 0);
      ctx.SetFfnBackend(ffn->get());
      std::vector<int32_t> prompt;
      for (int i = 0; i < prompt_len; ++i) prompt.push_back((i * 13 + 1) % 300);
      ASSERT_TRUE(ctx.Eval(prompt, false).ok());
      for (int32_t t : {3, 5, 7}) ASSERT_TRUE(ctx.Eval({&t, 1}, false).ok());
      for (const SparseFfnLayerStats& st : (*ffn)->stats()) {
        EXPECT_EQ(st.tokens, sparse_prefill ? prompt_len + 3 : 3);
        EXPECT_GT(st.computed, 0);
      }
    }
  }
}

// Passes every call on to another FFN backend and keeps each single-token FFN input, in call order.
class RecordingFfn : public FfnBackend {
 public:
  struct Input {
    int64_t layer;
    std::vector<float> x;
  };
  explicit RecordingFfn(FfnBackend* inner) : inner_(inner) {}
  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override {
    if (x.n() == 1) inputs.push_back({layer, std::vector<float>(x.f32(), x.f32() + x.cols())});
    return inner_->Forward(layer, expert, x, out);
  }
  std::vector<Input> inputs;

 private:
  FfnBackend* inner_;
};

// Gate pre-activations of layer `layer` of an F32 model for input `x`, summed in double by the test (independent of
// the kernels).
std::vector<double> DirectGates(const Model& m, int64_t layer, const std::vector<float>& x) {
  const MatrixView& g = m.layers()[static_cast<size_t>(layer)].gate;
  EXPECT_EQ(g.type, GgmlType::kF32);
  std::vector<double> out(static_cast<size_t>(g.rows));
  for (int64_t i = 0; i < g.rows; ++i) {
    const float* row = reinterpret_cast<const float*>(static_cast<const uint8_t*>(g.data) + g.row_bytes * i);
    double acc = 0;
    for (int64_t k = 0; k < g.cols; ++k) acc += static_cast<double>(row[k]) * x[static_cast<size_t>(k)];
    out[static_cast<size_t>(i)] = acc;
  }
  return out;
}

// Counts of the neurons whose activated gate relu(g) passes `thr` (every activation here gates with relu), as an
// interval: gates within kGateSlack of the threshold may fall either way in float sums.
constexpr double kGateSlack = 1e-4;
struct CountRange {
  int64_t lo = 0, hi = 0;
  void Add(double g, double thr) {
    const double ga = std::max(g, 0.0);
    lo += ga > thr + kGateSlack;
    hi += ga > thr - kGateSlack && (thr > 0 || g > -kGateSlack);
  }
};

// What the sparse FFN counts in oracle mode, against the gates the test computes itself from the recorded FFN inputs:
// computed = true active = true positives = the neurons whose activated gate exceeds the layer's threshold (some
// thresholds above 0 here), and "active" the same set: a neuron that passes the gate test counts even when its
// product is zero (dReLU with up <= 0, in the synthetic dReLU model).
TEST(SparseFfnTest, OracleStatisticsCountTheGatesAboveTheThreshold) {
  testing::TempDir dir;
  const std::string drelu_path = dir.File("drelu.gguf");
  ASSERT_EQ(testing::WriteSmallModel(drelu_path, GgmlType::kF32, 0, FfnActivation::kDRelu), "");
  for (const bool drelu : {false, true}) {
    SCOPED_TRACE(drelu ? "synthetic drelu" : "stories260K-relu");
    auto model = Model::Load(drelu ? drelu_path : ConvertRelu(dir), LoadOptions());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    const LlamaHparams& hp = (*model)->hparams();
    ThreadPool pool(2);
    SparseFfnOptions o;
    for (int64_t l = 0; l < hp.n_layers; ++l) o.activation_threshold.push_back(l % 2 ? 0.02f : 0.0f);
    auto ffn = SparseFfn::Create(**model, nullptr, o, &pool);
    ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
    RecordingFfn rec(ffn->get());
    InferenceContext ctx(**model, &pool, 32);
    ctx.SetFfnBackend(&rec);
    for (int32_t t = 1; t <= 12; ++t) {
      const int32_t tok = (t * 37) % static_cast<int32_t>(hp.n_vocab);
      ASSERT_TRUE(ctx.Eval({&tok, 1}, false).ok());
    }
    ASSERT_EQ(static_cast<int64_t>(rec.inputs.size()), 12 * hp.n_layers);
    std::vector<CountRange> want(static_cast<size_t>(hp.n_layers)), at_zero(static_cast<size_t>(hp.n_layers));
    for (const RecordingFfn::Input& in : rec.inputs) {
      const double thr = o.activation_threshold[static_cast<size_t>(in.layer)];
      for (double g : DirectGates(**model, in.layer, in.x)) {
        want[static_cast<size_t>(in.layer)].Add(g, thr);
        at_zero[static_cast<size_t>(in.layer)].Add(g, 0.0);
      }
    }
    for (int64_t l = 0; l < hp.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const SparseFfnLayerStats& st = (*ffn)->stats()[static_cast<size_t>(l)];
      const CountRange& w = want[static_cast<size_t>(l)];
      EXPECT_EQ(st.tokens, 12);
      EXPECT_GT(w.lo, 0);
      EXPECT_LT(w.hi, 12 * hp.n_ff) << "some gates are not active";
      if (l % 2) {
        EXPECT_LT(w.hi, at_zero[static_cast<size_t>(l)].lo) << "the threshold must matter";
      }
      EXPECT_GE(st.computed, w.lo);
      EXPECT_LE(st.computed, w.hi);
      EXPECT_EQ(st.true_active, st.computed);
      EXPECT_EQ(st.true_positive, st.computed);
      EXPECT_EQ(st.active, st.computed);
    }
  }
}

// Predictor mode with measure_recall: the sparse FFN computes the predicted neurons, and counts the truly active ones
// (activated gate above the threshold) and those of them it predicted; "active" is the predicted ones that pass the
// gate test. The test predicts with the same predictor on the recorded inputs and computes the gates itself. A random
// predictor misses many active neurons (recall well below 1), and thresholds above 0 (given as options, replacing the
// predictor's) drop predicted neurons with a small positive gate.
TEST(SparseFfnTest, PredictorStatisticsCountTruePositivesAndTheThreshold) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertRelu(dir), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  auto pred = Predictor::FromData(RandomData(hp.dim, hp.n_ff, hp.n_layers, 3));
  ASSERT_TRUE(pred.ok()) << pred.status().ToString();
  ThreadPool pool(2);
  SparseFfnOptions o;
  o.mode = SparseMode::kPredictor;
  o.measure_recall = true;
  for (int64_t l = 0; l < hp.n_layers; ++l) o.activation_threshold.push_back(0.01f * static_cast<float>(l));
  auto ffn = SparseFfn::Create(**model, pred->get(), o, &pool);
  ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
  RecordingFfn rec(ffn->get());
  InferenceContext ctx(**model, &pool, 32);
  ctx.SetFfnBackend(&rec);
  for (int32_t t = 1; t <= 10; ++t) {
    const int32_t tok = (t * 41) % static_cast<int32_t>(hp.n_vocab);
    ASSERT_TRUE(ctx.Eval({&tok, 1}, false).ok());
  }
  ASSERT_EQ(static_cast<int64_t>(rec.inputs.size()), 10 * hp.n_layers);
  const size_t nl = static_cast<size_t>(hp.n_layers);
  std::vector<int64_t> predicted(nl, 0);
  std::vector<CountRange> truth(nl), hit(nl), positive_below(nl);
  PredictorScratch scratch;
  (*pred)->PrepareScratch(&scratch);
  std::vector<int32_t> rows;
  for (const RecordingFfn::Input& in : rec.inputs) {
    const size_t l = static_cast<size_t>(in.layer);
    const double thr = o.activation_threshold[l];
    (*pred)->Predict(in.layer, Activation(in.x.data(), 1, hp.dim), 0, &scratch, &rows, nullptr);
    predicted[l] += static_cast<int64_t>(rows.size());
    const std::vector<double> g = DirectGates(**model, in.layer, in.x);
    for (double v : g) truth[l].Add(v, thr);
    for (int32_t i : rows) {
      hit[l].Add(g[static_cast<size_t>(i)], thr);
      positive_below[l].Add(g[static_cast<size_t>(i)], 0.0);
    }
  }
  for (size_t l = 0; l < nl; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const SparseFfnLayerStats& st = (*ffn)->stats()[l];
    EXPECT_EQ(st.computed, predicted[l]);
    EXPECT_GE(st.true_active, truth[l].lo);
    EXPECT_LE(st.true_active, truth[l].hi);
    EXPECT_GE(st.true_positive, hit[l].lo);
    EXPECT_LE(st.true_positive, hit[l].hi);
    EXPECT_LT(hit[l].hi, truth[l].lo) << "the random predictor misses active neurons";
    EXPECT_GE(st.active, hit[l].lo);
    EXPECT_LE(st.active, hit[l].hi);
    if (l > 0) {
      EXPECT_LT(hit[l].hi, positive_below[l].lo) << "predicted neurons with a positive gate under the threshold";
    }
  }
}

// Oracle prefill of a batch (by GEMM, from batched_prefill_min_tokens tokens) computes what the token path computes,
// bit for bit, also with thresholds above 0 and over more tokens than one GEMM tile (32): 70 random inputs through
// each layer at once against one at a time; and a batch of exactly batched_prefill_min_tokens (the first batched size;
// which path ran is not observable here, only that the results agree).
TEST(SparseFfnTest, BatchedOraclePrefillEqualsTheTokenPathBitwise) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertRelu(dir), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const LlamaHparams& hp = (*model)->hparams();
  ThreadPool pool(2);
  SparseFfnOptions o;
  for (int64_t l = 0; l < hp.n_layers; ++l) o.activation_threshold.push_back(l % 2 ? 0.05f : 0.0f);
  auto ffn = SparseFfn::Create(**model, nullptr, o, &pool);
  ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int64_t n : {int64_t{70}, o.batched_prefill_min_tokens}) {
    std::vector<float> x(static_cast<size_t>(n * hp.dim));
    for (float& v : x) v = nd(rng);
    for (int64_t l = 0; l < hp.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l) + ", " + std::to_string(n) + " tokens");
      std::vector<float> batch(x.size(), -1.0f), single(x.size(), -2.0f);
      ASSERT_TRUE((*ffn)->Forward(l, -1, Activation(x.data(), n, hp.dim), batch.data()).ok());
      for (int64_t t = 0; t < n; ++t) {
        ASSERT_TRUE(
            (*ffn)->Forward(l, -1, Activation(x.data() + t * hp.dim, 1, hp.dim), single.data() + t * hp.dim).ok());
      }
      EXPECT_EQ(batch, single);
    }
  }
  // The token path counted its n tokens per layer; the batches counted nothing.
  for (const SparseFfnLayerStats& st : (*ffn)->stats()) EXPECT_EQ(st.tokens, 70 + o.batched_prefill_min_tokens);
}

// MoE: thresholds given per layer apply to every expert of that layer: a layer whose threshold no gate reaches adds
// nothing from any expert, and the other layer's experts all compute something.
TEST(SparseFfnTest, PerLayerThresholdsApplyToEveryExpertOfTheLayer) {
  testing::TempDir dir;
  std::unique_ptr<Model> model;
  ASSERT_NO_FATAL_FAILURE(LoadSmallMoe(dir, &model));
  const LlamaHparams& hp = model->hparams();
  ThreadPool pool(1);
  SparseFfnOptions o;
  o.activation_threshold = {0.0f, 1e9f};
  auto ffn = SparseFfn::Create(*model, nullptr, o, &pool);
  ASSERT_TRUE(ffn.ok()) << ffn.status().ToString();
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(hp.dim)), out(static_cast<size_t>(hp.dim));
  for (float& v : x) v = nd(rng);
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = 0; e < hp.n_experts; ++e) {
      SCOPED_TRACE("layer " + std::to_string(l) + " expert " + std::to_string(e));
      ASSERT_TRUE((*ffn)->Forward(l, e, Activation(x.data(), 1, hp.dim), out.data()).ok());
      double norm = 0;
      for (float v : out) norm += std::fabs(v);
      if (l == 0) {
        EXPECT_GT(norm, 0.0);
      } else {
        EXPECT_EQ(norm, 0.0);
      }
    }
  }
}

// Create refuses what it cannot run, naming it: predictor mode without a predictor, a threshold list that is neither
// per layer nor per group, a negative or NaN threshold.
TEST(SparseFfnTest, CreateRefusesBadOptions) {
  testing::TempDir dir;
  auto model = Model::Load(ConvertRelu(dir), LoadOptions());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const int64_t nl = (*model)->hparams().n_layers;
  ThreadPool pool(1);
  SparseFfnOptions o;
  o.mode = SparseMode::kPredictor;
  auto r = SparseFfn::Create(**model, nullptr, o, &pool);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("needs a predictor"), std::string::npos) << r.status().ToString();
  o.mode = SparseMode::kOracle;
  o.activation_threshold.assign(static_cast<size_t>(nl - 1), 0.0f);
  r = SparseFfn::Create(**model, nullptr, o, &pool);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(std::to_string(nl - 1) + " activation thresholds for a model of " +
                                      std::to_string(nl) + " layers"),
            std::string::npos)
      << r.status().ToString();
  for (const float bad : {-0.5f, std::nanf("")}) {
    o.activation_threshold.assign(static_cast<size_t>(nl), 0.0f);
    o.activation_threshold[1] = bad;
    r = SparseFfn::Create(**model, nullptr, o, &pool);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("thresholds must be >= 0"), std::string::npos) << r.status().ToString();
  }
  o.activation_threshold.assign(static_cast<size_t>(nl), 0.0f);
  EXPECT_TRUE(SparseFfn::Create(**model, nullptr, o, &pool).ok());
}

}  // namespace
}  // namespace nflash
