// Sampler: greedy, top-k/top-p/min-p on hand-computed distributions, repetition penalty, seeded reproducibility, a
// chi-square check of the sampled distribution; StopChecker: special tokens, budget, stop strings across tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "runtime/text/sampler.h"

namespace nflash {
namespace {

Sampler Make(SamplerConfig c) {
  auto s = Sampler::Create(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

SamplerConfig Plain(float temperature, uint64_t seed = 1) {
  SamplerConfig c;
  c.temperature = temperature;
  c.top_k = 0;
  c.top_p = 1.0f;
  c.min_p = 0.0f;
  c.repeat_penalty = 1.0f;
  c.seed = seed;
  return c;
}

std::vector<TokenCandidate> Candidates(const std::vector<float>& logits) {
  std::vector<TokenCandidate> c;
  for (size_t i = 0; i < logits.size(); ++i) c.push_back({static_cast<int32_t>(i), logits[i], 0.0f});
  return c;
}

std::vector<int32_t> IdsOf(const std::vector<TokenCandidate>& c) {
  std::vector<int32_t> ids;
  for (const auto& t : c) ids.push_back(t.id);
  return ids;
}

TEST(Sampler, GreedyPicksArgmaxLowestIdOnTies) {
  Sampler s = Make(Plain(0.0f));
  EXPECT_EQ(s.Sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>{-5.0f, -3.0f, -4.0f}), 1);
}

TEST(Sampler, TopKOneEqualsGreedy) {
  SamplerConfig c = Plain(1.0f, 99);
  c.top_k = 1;
  Sampler topk = Make(c);
  Sampler greedy = Make(Plain(0.0f));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> logits(50);
    for (float& x : logits) x = nd(rng);
    EXPECT_EQ(topk.Sample(logits), greedy.Sample(logits));
  }
}

TEST(Sampler, SeedReproducibleAndSeedDependent) {
  const std::vector<float> logits(16, 0.0f);  // uniform over 16 tokens: every draw matters
  auto run = [&](uint64_t seed) {
    Sampler s = Make(Plain(1.0f, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(logits));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
  // Reset re-seeds.
  Sampler s = Make(Plain(1.0f, 42));
  const int32_t first = s.Sample(logits);
  for (int i = 0; i < 10; ++i) s.Sample(logits);
  s.Reset(42);
  EXPECT_EQ(s.Sample(logits), first);
}

// Pearson's chi-square statistic of observed counts against expected probabilities.
double ChiSquare(const std::vector<int>& counts, const std::vector<double>& p, int n) {
  double chi = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = p[i] * n;
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

TEST(Sampler, TemperatureOneMatchesSoftmax) {
  const std::vector<double> p = {0.5, 0.25, 0.15, 0.1};
  std::vector<float> logits;
  for (double x : p) logits.push_back(static_cast<float>(std::log(x)) + 3.0f);  // a shift must not matter
  const int n = 20000;
  Sampler s = Make(Plain(1.0f, 2024));
  std::vector<int> counts(p.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  // 3 degrees of freedom: P(chi2 > 16.27) = 0.001, so a correct sampler fails this once in a thousand seeds (and
  // this seed is fixed).
  constexpr double kCritical = 16.27;
  EXPECT_LT(ChiSquare(counts, p, n), kCritical);
  // The same counts are far from the temperature-2 distribution: the check can fail.
  std::vector<double> t2;
  double z = 0;
  for (double x : p) z += std::sqrt(x);
  for (double x : p) t2.push_back(std::sqrt(x) / z);
  EXPECT_GT(ChiSquare(counts, t2, n), kCritical);
}

TEST(Sampler, TemperatureHalfSquaresProbabilities) {
  const std::vector<double> base = {0.5, 0.3, 0.2};
  std::vector<float> logits;
  for (double x : base) logits.push_back(static_cast<float>(std::log(x)));
  std::vector<double> p;  // softmax(logit / 0.5) = p^2 / sum p^2
  double z = 0;
  for (double x : base) z += x * x;
  for (double x : base) p.push_back(x * x / z);
  const int n = 20000;
  Sampler s = Make(Plain(0.5f, 7));
  std::vector<int> counts(p.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  constexpr double kCritical = 13.82;  // 2 degrees of freedom, P = 0.001
  EXPECT_LT(ChiSquare(counts, p, n), kCritical);
  EXPECT_GT(ChiSquare(counts, base, n), kCritical);
}

TEST(Sampler, TopPKeepsSmallestPrefixReachingP) {
  // Probabilities 0.1, 0.4, 0.2, 0.3 (ids 0..3): sorted 0.4 (1), 0.3 (3), 0.2 (2), 0.1 (0).
  const std::vector<float> logits = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  auto c = Candidates(logits);
  Sampler::SortByLogit(&c);
  auto a = c;
  Sampler::TopP(0.35f, &a);  // 0.4 >= 0.35
  EXPECT_EQ(IdsOf(a), (std::vector<int32_t>{1}));
  auto b = c;
  Sampler::TopP(0.65f, &b);  // 0.4 < 0.65 <= 0.7
  EXPECT_EQ(IdsOf(b), (std::vector<int32_t>{1, 3}));
  auto d = c;
  Sampler::TopP(0.75f, &d);  // 0.7 < 0.75 <= 0.9
  EXPECT_EQ(IdsOf(d), (std::vector<int32_t>{1, 3, 2}));
  // Only the kept tokens are ever sampled.
  SamplerConfig cfg = Plain(1.0f, 5);
  cfg.top_p = 0.65f;
  Sampler s = Make(cfg);
  for (int i = 0; i < 500; ++i) {
    const int32_t t = s.Sample(logits);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

TEST(Sampler, MinPKeepsTokensAboveFractionOfMax) {
  // Probabilities 0.5, 0.25, 0.15, 0.1.
  const std::vector<float> logits = {std::log(0.5f), std::log(0.25f), std::log(0.15f), std::log(0.1f)};
  auto c = Candidates(logits);
  Sampler::SortByLogit(&c);
  auto a = c;
  Sampler::MinP(0.25f, &a);  // threshold 0.125: 0.15 stays, 0.1 goes
  EXPECT_EQ(IdsOf(a), (std::vector<int32_t>{0, 1, 2}));
  auto b = c;
  Sampler::MinP(0.4f, &b);  // threshold 0.2
  EXPECT_EQ(IdsOf(b), (std::vector<int32_t>{0, 1}));
  auto d = c;
  Sampler::MinP(1.0f, &d);
  EXPECT_EQ(IdsOf(d), (std::vector<int32_t>{0}));
}

// The boundaries are inclusive, on exact probabilities (four equal logits: 0.25 each, sums exact in binary):
// top-p keeps the smallest prefix whose mass reaches p (0.5: two tokens), min-p keeps every token at exactly the
// threshold, and a draw that lands exactly on a cumulative boundary takes the next token (token i owns
// [cum(i-1), cum(i)) of the unit interval).
TEST(Sampler, BoundariesAreInclusiveOnExactProbabilities) {
  auto c = Candidates({0.0f, 0.0f, 0.0f, 0.0f});
  Sampler::SortByLogit(&c);
  auto half = c;
  Sampler::TopP(0.5f, &half);
  EXPECT_EQ(IdsOf(half), (std::vector<int32_t>{0, 1}));
  auto all = c;
  Sampler::MinP(1.0f, &all);
  EXPECT_EQ(IdsOf(all), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(Sampler::Draw(c, 1.0f, 0.0), 0u);
  EXPECT_EQ(Sampler::Draw(c, 1.0f, 0.25), 1u);  // target 1.0 = cum[0]
  EXPECT_EQ(Sampler::Draw(c, 1.0f, 0.75), 3u);
}

// llama.cpp's chain order: top-p on the full distribution, then min-p. Probabilities 0.5, 0.2, 0.2, 0.1 with
// top_p 0.55 and min_p 0.3: top-p keeps {0, 1} (0.5 < 0.55 <= 0.7) and min-p keeps both (0.2 >= 0.3 * 0.5); min-p
// first would drop the 0.1 and leave top-p, on the renormalised 0.56, only token 0.
TEST(Sampler, TopPThenMinPAsLlamaCpp) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.2f), std::log(0.2f), std::log(0.1f)};
  SamplerConfig cfg = Plain(1.0f, 11);
  cfg.top_p = 0.55f;
  cfg.min_p = 0.3f;
  Sampler s = Make(cfg);
  std::set<int32_t> seen;
  for (int i = 0; i < 300; ++i) seen.insert(s.Sample(logits));
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1}));  // token 1 has probability 2/7 per draw: absent in 300 w.p. ~1e-44
}

TEST(Sampler, TopKKeepsKLargest) {
  auto c = Candidates({0.5f, 3.0f, -1.0f, 2.0f, 3.0f});
  Sampler::TopK(3, &c);
  EXPECT_EQ(IdsOf(c), (std::vector<int32_t>{1, 4, 3}));
}

TEST(Sampler, RepetitionPenaltyDividesPositiveMultipliesNegative) {
  auto c = Candidates({2.0f, -1.0f, 0.5f, 3.0f});
  const std::vector<int32_t> recent = {0, 1, 1};  // token 1 twice: penalised once
  Sampler::ApplyRepetitionPenalty(recent, 2.0f, &c);
  EXPECT_FLOAT_EQ(c[0].logit, 1.0f);
  EXPECT_FLOAT_EQ(c[1].logit, -2.0f);
  EXPECT_FLOAT_EQ(c[2].logit, 0.5f);
  EXPECT_FLOAT_EQ(c[3].logit, 3.0f);
  // Through Sample: token 0 (3.0) was just generated; 3 / 1.5 = 2 < 2.5, so greedy now picks token 1.
  SamplerConfig cfg = Plain(0.0f);
  cfg.repeat_penalty = 1.5f;
  cfg.repeat_last_n = 2;
  Sampler s = Make(cfg);
  const std::vector<float> logits = {3.0f, 2.5f};
  EXPECT_EQ(s.Sample(logits), 0);
  s.Accept(0);
  EXPECT_EQ(s.Sample(logits), 1);
  s.Accept(1);
  s.Accept(1);  // token 0 leaves the window of 2
  EXPECT_EQ(s.history(), (std::deque<int32_t>{1, 1}));
  EXPECT_EQ(s.Sample(logits), 0);
}

TEST(Sampler, RejectsBadConfig) {
  SamplerConfig c = Plain(-1.0f);
  EXPECT_EQ(Sampler::Create(c).status().code(), StatusCode::kInvalidArgument);
  c = Plain(1.0f);
  c.top_p = 0.0f;
  EXPECT_FALSE(Sampler::Create(c).ok());
  c = Plain(1.0f);
  c.min_p = 1.5f;
  EXPECT_FALSE(Sampler::Create(c).ok());
  c = Plain(1.0f);
  c.repeat_penalty = 0.0f;
  EXPECT_FALSE(Sampler::Create(c).ok());
  c = Plain(1.0f);
  c.repeat_last_n = -1;
  EXPECT_FALSE(Sampler::Create(c).ok());
}

// ----- StopChecker ------------------------------------------------------------------------------------------------

TEST(StopChecker, SpecialTokensAndBudget) {
  StopConfig c;
  c.end_ids = {2};
  c.bos_id = 1;
  c.max_tokens = 3;
  std::string emit;
  StopChecker eos(c);
  EXPECT_EQ(eos.Push(10, "a", &emit), StopReason::kNone);
  EXPECT_EQ(emit, "a");
  EXPECT_EQ(eos.Push(2, "", &emit), StopReason::kEos);
  StopConfig turns = c;  // end-of-turn markers end it as EOS does
  turns.end_ids = {2, 7, 9};
  StopChecker marker(turns);
  EXPECT_EQ(marker.Push(10, "a", &emit), StopReason::kNone);
  EXPECT_EQ(marker.Push(9, "", &emit), StopReason::kEos);
  StopChecker not_marker(turns);
  EXPECT_EQ(not_marker.Push(8, "x", &emit), StopReason::kNone);
  StopChecker bos(c);
  EXPECT_EQ(bos.Push(1, "", &emit), StopReason::kBos);
  StopChecker budget(c);
  EXPECT_EQ(budget.Push(10, "a", &emit), StopReason::kNone);
  EXPECT_EQ(budget.Push(11, "b", &emit), StopReason::kNone);
  EXPECT_EQ(budget.Push(12, "c", &emit), StopReason::kMaxTokens);
  EXPECT_EQ(emit, "c");
  EXPECT_EQ(budget.n_tokens(), 3);
  EXPECT_STREQ(StopReasonName(StopReason::kMaxTokens), "max_tokens");
}

TEST(StopChecker, StopStringAcrossTokenBoundaries) {
  StopConfig c;
  c.stop_strings = {"END"};
  StopChecker s(c);
  std::string emit, shown;
  EXPECT_EQ(s.Push(1, "abc E", &emit), StopReason::kNone);
  shown += emit;
  EXPECT_EQ(emit, "abc ");  // "E" may start "END": held back
  EXPECT_EQ(s.Push(2, "N", &emit), StopReason::kNone);
  EXPECT_EQ(emit, "");
  EXPECT_EQ(s.Push(3, "Dxyz", &emit), StopReason::kStopString);
  shown += emit;
  EXPECT_EQ(shown, "abc ");  // no part of the stop string, nothing after it
  EXPECT_EQ(s.matched(), "END");

  StopChecker t(c);
  EXPECT_EQ(t.Push(1, "E", &emit), StopReason::kNone);
  EXPECT_EQ(emit, "");
  EXPECT_EQ(t.Push(2, "Nx", &emit), StopReason::kNone);  // "ENx" is not "END": released
  EXPECT_EQ(emit, "ENx");
  EXPECT_EQ(t.Push(3, "EN", &emit), StopReason::kNone);
  EXPECT_EQ(emit, "");
  EXPECT_EQ(t.Flush(), "EN");  // generation ended otherwise: the held text is shown
}

TEST(StopChecker, EarliestOfSeveralStopStrings) {
  StopConfig c;
  c.stop_strings = {"ab", "bc", ""};  // the empty one is ignored
  StopChecker s(c);
  std::string emit;
  EXPECT_EQ(s.Push(1, "xb", &emit), StopReason::kNone);
  EXPECT_EQ(emit, "x");
  EXPECT_EQ(s.Push(2, "c", &emit), StopReason::kStopString);
  EXPECT_EQ(emit, "");
  EXPECT_EQ(s.matched(), "bc");
  StopChecker t(c);
  EXPECT_EQ(t.Push(1, "zabc", &emit), StopReason::kStopString);
  EXPECT_EQ(emit, "z");
  EXPECT_EQ(t.matched(), "ab");
}

}  // namespace
}  // namespace nflash
