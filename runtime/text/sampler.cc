// Sampling chain (penalty, top-k, top-p, min-p, temperature, seeded draw) and the stop-condition checker.
#include "runtime/text/sampler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace nflash {

Result<Sampler> Sampler::Create(const SamplerConfig& c) {
  if (!(c.temperature >= 0) || !std::isfinite(c.temperature)) {
    return Status::InvalidArgument("sampler temperature is " + std::to_string(c.temperature) +
                                   ", expected a finite value >= 0 (0 = greedy)");
  }
  if (!(c.top_p > 0 && c.top_p <= 1)) {
    return Status::InvalidArgument("sampler top_p is " + std::to_string(c.top_p) + ", expected a value in (0, 1]");
  }
  if (!(c.min_p >= 0 && c.min_p <= 1)) {
    return Status::InvalidArgument("sampler min_p is " + std::to_string(c.min_p) + ", expected a value in [0, 1]");
  }
  if (!(c.repeat_penalty > 0) || !std::isfinite(c.repeat_penalty)) {
    return Status::InvalidArgument("sampler repeat_penalty is " + std::to_string(c.repeat_penalty) +
                                   ", expected a finite value > 0 (1 = off)");
  }
  if (c.repeat_last_n < 0) {
    return Status::InvalidArgument("sampler repeat_last_n is " + std::to_string(c.repeat_last_n) +
                                   ", expected >= 0");
  }
  return Sampler(c);
}

Sampler::Sampler(const SamplerConfig& config) : config_(config), rng_(config.seed) {}

void Sampler::Reset(uint64_t seed) {
  config_.seed = seed;
  rng_.seed(seed);
  history_.clear();
}

void Sampler::Accept(int32_t token) {
  if (config_.repeat_last_n == 0) return;
  history_.push_back(token);
  while (history_.size() > static_cast<size_t>(config_.repeat_last_n)) history_.pop_front();
}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

void Sampler::ApplyRepetitionPenalty(std::span<const int32_t> recent, float penalty, std::vector<TokenCandidate>* c) {
  if (penalty == 1.0f || recent.empty()) return;
  std::vector<int32_t> seen(recent.begin(), recent.end());
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());  // each token is penalised once
  for (TokenCandidate& t : *c) {
    if (!std::binary_search(seen.begin(), seen.end(), t.id)) continue;
    // Dividing a negative logit would raise it: llama.cpp multiplies those instead, so both move down.
    if (t.logit <= 0) t.logit *= penalty;
    else t.logit /= penalty;
  }
}

namespace {

bool Before(const TokenCandidate& a, const TokenCandidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

}  // namespace

void Sampler::SortByLogit(std::vector<TokenCandidate>* c) { std::sort(c->begin(), c->end(), Before); }

void Sampler::Softmax(std::vector<TokenCandidate>* c) {
  if (c->empty()) return;
  const float max = (*c)[0].logit;
  double sum = 0;
  for (TokenCandidate& t : *c) {
    t.p = std::exp(t.logit - max);
    sum += t.p;
  }
  for (TokenCandidate& t : *c) t.p = static_cast<float>(t.p / sum);
}

void Sampler::TopK(int32_t k, std::vector<TokenCandidate>* c) {
  if (k <= 0 || static_cast<size_t>(k) >= c->size()) {
    SortByLogit(c);
    return;
  }
  std::partial_sort(c->begin(), c->begin() + k, c->end(), Before);
  c->resize(static_cast<size_t>(k));
}

void Sampler::TopP(float p, std::vector<TokenCandidate>* c) {
  if (p >= 1.0f || c->empty()) return;
  Softmax(c);
  double cum = 0;
  size_t keep = c->size();
  for (size_t i = 0; i < c->size(); ++i) {
    cum += (*c)[i].p;
    if (cum >= p) {
      keep = i + 1;
      break;
    }
  }
  c->resize(keep);
}

void Sampler::MinP(float min_p, std::vector<TokenCandidate>* c) {
  if (min_p <= 0.0f || c->empty()) return;
  Softmax(c);
  const float threshold = min_p * (*c)[0].p;
  size_t keep = 1;  // the most likely token always survives
  while (keep < c->size() && (*c)[keep].p >= threshold) ++keep;
  c->resize(keep);
}

size_t Sampler::Draw(const std::vector<TokenCandidate>& c, float temperature, double u) {
  if (c.size() <= 1) return 0;
  float max = c[0].logit;
  for (const TokenCandidate& t : c) max = std::max(max, t.logit);
  std::vector<double> cum(c.size());
  double sum = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    sum += std::exp(static_cast<double>(c[i].logit - max) / temperature);
    cum[i] = sum;
  }
  const double target = u * sum;
  const size_t i = static_cast<size_t>(std::upper_bound(cum.begin(), cum.end(), target) - cum.begin());
  return std::min(i, c.size() - 1);
}

int32_t Sampler::Sample(std::span<const float> logits) {
  candidates_.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) candidates_[i] = {static_cast<int32_t>(i), logits[i], 0.0f};
  if (candidates_.empty()) return -1;
  const std::vector<int32_t> recent(history_.begin(), history_.end());
  ApplyRepetitionPenalty(recent, config_.repeat_penalty, &candidates_);
  if (config_.temperature == 0.0f) {
    return std::min_element(candidates_.begin(), candidates_.end(), Before)->id;
  }
  TopK(config_.top_k, &candidates_);
  TopP(config_.top_p, &candidates_);
  MinP(config_.min_p, &candidates_);
  return candidates_[Draw(candidates_, config_.temperature, Uniform())].id;
}

// ---------------------------------------------------------------------------------------------------------------

const char* StopReasonName(StopReason reason) {
  switch (reason) {
    case StopReason::kNone: return "none";
    case StopReason::kEos: return "eos";
    case StopReason::kBos: return "bos";
    case StopReason::kMaxTokens: return "max_tokens";
    case StopReason::kStopString: return "stop_string";
  }
  return "unknown";
}

StopChecker::StopChecker(StopConfig config) : config_(std::move(config)) {
  // An empty stop string would match everywhere; it means nothing.
  auto& s = config_.stop_strings;
  s.erase(std::remove(s.begin(), s.end(), std::string()), s.end());
}

StopReason StopChecker::Push(int32_t token, std::string_view piece, std::string* emit) {
  emit->clear();
  ++n_tokens_;
  if (std::find(config_.end_ids.begin(), config_.end_ids.end(), token) != config_.end_ids.end()) {
    *emit = Flush();
    return StopReason::kEos;
  }
  if (config_.bos_id >= 0 && token == config_.bos_id) {
    *emit = Flush();
    return StopReason::kBos;
  }
  std::string buf = std::move(held_);
  held_.clear();
  buf.append(piece);
  // The earliest stop string occurrence wins; the held text never contains a whole one, so any match is new.
  size_t first = std::string::npos;
  for (const std::string& s : config_.stop_strings) {
    const size_t at = buf.find(s);
    if (at < first) {
      first = at;
      matched_ = s;
    }
  }
  if (first != std::string::npos) {
    *emit = buf.substr(0, first);
    return StopReason::kStopString;
  }
  // Hold back the longest suffix that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& s : config_.stop_strings) {
    for (size_t k = std::min(s.size() - 1, buf.size()); k > hold; --k) {
      if (buf.compare(buf.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  *emit = buf.substr(0, buf.size() - hold);
  held_ = buf.substr(buf.size() - hold);
  if (config_.max_tokens >= 0 && n_tokens_ >= config_.max_tokens) {
    *emit += Flush();
    return StopReason::kMaxTokens;
  }
  return StopReason::kNone;
}

std::string StopChecker::Flush() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace nflash
