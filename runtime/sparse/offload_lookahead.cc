// OffloadFfn's cross-layer lookahead (see "Lookahead" in offload_ffn.h): layer l+1's probable cold misses are read
// into their cache slots while layer l computes.
#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>

#include "runtime/core/ffn_activation.h"
#include "runtime/core/file.h"
#include "runtime/core/kernels.h"
#include "runtime/core/log.h"
#include "runtime/core/stats.h"
#include "runtime/sparse/offload_ffn.h"

namespace nflash::sparse {

namespace {
// Default cap per layer, as a share of n_ff: above a layer's cold misses at 7B with 10% active neurons and half the
// FFN cached (~5% of n_ff), so a good guess is not cut short.
constexpr int64_t kLookaheadShare = 8;
// The oracle's guess costs a gate GEMV over every cold candidate of the next layer: at 7B one row is 2.3 KB, ~0.13 us
// on this project's machine, while one 8 KiB read hidden behind compute saves ~9 us of I/O (874 MB/s at queue depth
// 32), ~70 rows' worth. A layer whose cap is below candidates / kRowsPerGuessedBundle is not worth guessing for: its
// cold partition is (nearly) empty, as a plan's pinned regions are (SYNTHETIC 7B plan at 1392M: 110 ms per token went
// into choosing 351 bundles over 15 layers without cold room).
constexpr int64_t kRowsPerGuessedBundle = 64;
}  // namespace

int64_t OffloadFfn::LookaheadSlots(const packer::Deployment& d, const OffloadOptions& options) {
  const packer::Manifest& m = d.manifest();
  const bool two_phase =
      options.two_phase && TwoPhaseUnusable(d, options.predictor == nullptr, options.dio_alignment).empty();
  if (options.mode != OffloadMode::kFull || two_phase || m.n_layers < 2) return 0;
  // MoE: only when asked for. Measured (SYNTHETIC mixtral-8x7b shape, Q4_0, predictor, 2 vCPUs, ~71k-IOPS disk):
  // +6-20% on 2 layers at 1.6G, but -2% on 4 layers at 1.9G, where the reads already keep the disk busy and half of
  // what is read ahead (a wrong expert, or a wrong neuron) goes unused (docs/results.md, fifteenth run).
  if (options.lookahead_slots < 0 && m.n_experts > 0) return 0;
  if (options.lookahead_slots < 0) return std::max<int64_t>(1, m.n_ff / kLookaheadShare);
  return std::min<int64_t>(options.lookahead_slots, m.n_ff);
}

Status OffloadFfn::InitLookahead() {
  la_slots_ = LookaheadSlots(deploy_, options_);
  la_on_ = !options_.lookahead_adaptive;
  const LlamaHparams& hp = model_.hparams();
  // Siblings use the lookahead's sets when next-layer guesses do not (LookaheadSlots' conditions but the guess).
  la_siblings_ = options_.sibling_readahead && la_slots_ == 0 && hp.n_experts > 1 && hp.n_experts_used > 1 &&
                 options_.mode == OffloadMode::kFull && !options_.two_phase && options_.lookahead_replay.empty() &&
                 cache_->cold().SlotCount() > 0;
  if ((la_slots_ == 0 && !la_siblings_) || cache_->cold().SlotCount() == 0) {
    la_slots_ = 0;
    la_siblings_ = false;
    if (!options_.lookahead_replay.empty()) {
      return Status::InvalidArgument("--lookahead-replay " + options_.lookahead_replay +
                                     ": the run has no lookahead (full mode, whole-bundle reads, cold slots and "
                                     "--lookahead other than 0 are needed)");
    }
    return Status::Ok();
  }
  if (!options_.lookahead_replay.empty()) NF_RETURN_IF_ERROR(LoadLookaheadReplay(options_.lookahead_replay));
  const size_t dim = static_cast<size_t>(hp.dim);
  const size_t n = static_cast<size_t>(la_siblings_ ? hp.n_ff : la_slots_);
  if (la_siblings_) {
    sib_group_.assign(static_cast<size_t>(hp.n_experts_used), -1);
    sib_active_.resize(static_cast<size_t>(hp.n_experts_used));
    for (auto& a : sib_active_) a.reserve(static_cast<size_t>(hp.n_ff));
  }
  // Two layers' sets (the one being used, the one being read), k guessed experts each for MoE.
  la_per_layer_ = hp.n_experts > 0 ? std::max<int64_t>(1, hp.n_experts_used) : 1;
  const size_t sets = static_cast<size_t>(2 * la_per_layer_);
  la_group_.assign(sets, -1);
  la_first_chunk_.assign(sets, 0);
  la_neurons_.resize(sets);
  la_slot_.resize(sets);
  la_index_of_neuron_.resize(sets);
  la_requests_.resize(sets);
  la_builder_.resize(sets);
  la_chunk_ends_.resize(sets);
  la_item_.resize(sets);
  if (hp.n_experts > 0) {
    la_router_.resize(static_cast<size_t>(hp.n_experts));
    la_experts_.reserve(static_cast<size_t>(hp.n_experts));
  }
  for (size_t b = 0; b < sets; ++b) {
    la_neurons_[b].reserve(n);
    la_slot_[b].reserve(n);
    la_item_[b].reserve(n);
    la_index_of_neuron_[b].assign(static_cast<size_t>(hp.n_ff), -1);
    la_requests_[b].reserve(n);
    la_chunk_ends_[b].reserve(n);
  }
  la_items_.reserve(n);
  la_taken_.assign(static_cast<size_t>(hp.n_ff), 0);
  la_rows_.reserve(static_cast<size_t>(hp.n_ff));
  la_score_.resize(static_cast<size_t>(hp.n_ff));
  la_pick_.reserve(static_cast<size_t>(hp.n_ff));
  la_x_.resize(dim);
  la_rms_ratio_.assign(static_cast<size_t>(hp.n_layers), 0.0f);
  la_hit_rows_.reserve(static_cast<size_t>(hp.n_ff));
  // The guess's input: layer l's FFN input rescaled to layer l+1's (next-layer), or layer l's attention input
  // rescaled to its FFN input (same-layer). rmsnorm(h) * w1 = (rmsnorm(h) * w) * (w1 / w); a zero weight loses that
  // coordinate (it stays 0).
  const auto& layers = model_.layers();
  const bool next_layer = options_.lookahead_source == LookaheadSource::kNextLayer;
  const int64_t n_scales = next_layer ? hp.n_layers - 1 : hp.n_layers;
  la_scale_.assign(static_cast<size_t>(n_scales) * dim, 0.0f);
  for (int64_t l = 0; l < n_scales; ++l) {
    const LayerWeights& lw = layers[static_cast<size_t>(l)];
    const float* w = next_layer ? lw.ffn_norm : lw.attn_norm;
    const float* w1 = next_layer ? layers[static_cast<size_t>(l + 1)].ffn_norm : lw.ffn_norm;
    for (size_t i = 0; i < dim; ++i) la_scale_[static_cast<size_t>(l) * dim + i] = w[i] != 0.0f ? w1[i] / w[i] : 0.0f;
  }
  return Status::Ok();
}

Status OffloadFfn::LoadLookaheadReplay(const std::string& path) {
  const LlamaHparams& hp = model_.hparams();
  if (hp.n_experts > 0) {
    return Status::InvalidArgument("--lookahead-replay " + path + ": dense models only (this one has " +
                                   std::to_string(hp.n_experts) + " experts)");
  }
  NF_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, ReadWholeFile(path));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  replay_group_.clear();
  replay_set_.clear();
  size_t at = 0;
  for (int64_t line_no = 1; at < text.size(); ++line_no) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    auto bad = [&](const std::string& what) {
      return Status::InvalidArgument(path + " line " + std::to_string(line_no) + ": " + what);
    };
    std::vector<int64_t> values;
    size_t p = 0;
    while (p < line.size()) {
      while (p < line.size() && line[p] == ' ') ++p;
      if (p == line.size()) break;
      size_t q = p;
      while (q < line.size() && line[q] != ' ') ++q;
      const std::string_view word = line.substr(p, q - p);
      if (!IsDecimal(word) || word.size() > 9) return bad("expected non-negative integers, found \"" + std::string(word) + "\"");
      values.push_back(std::stoll(std::string(word)));
      p = q;
    }
    if (values.empty()) return bad("empty line (expected: the group, then its active neurons)");
    if (values[0] >= n_groups_) {
      return bad("group " + std::to_string(values[0]) + ", expected below " + std::to_string(n_groups_));
    }
    std::vector<int32_t> set;
    for (size_t i = 1; i < values.size(); ++i) {
      if (values[i] >= hp.n_ff) {
        return bad("neuron " + std::to_string(values[i]) + ", expected below n_ff = " + std::to_string(hp.n_ff));
      }
      set.push_back(static_cast<int32_t>(values[i]));
    }
    replay_group_.push_back(values[0]);
    replay_set_.push_back(std::move(set));
  }
  if (replay_group_.empty()) return Status::InvalidArgument("--lookahead-replay " + path + ": no steps in the file");
  replay_step_ = -1;
  replay_on_ = true;
  NF_LOG(Info) << "lookahead replays " << replay_group_.size() << " steps of " << path
               << " (a perfect guess at the guess's own cost; results unchanged)";
  return Status::Ok();
}

void OffloadFfn::ReplayStep(int64_t group) {
  if (!replay_on_) return;
  ++replay_step_;
  const size_t s = static_cast<size_t>(replay_step_);
  if (s < replay_group_.size() && replay_group_[s] == group) return;
  replay_on_ = false;
  NF_LOG(Warning) << "--lookahead-replay " << options_.lookahead_replay << ": step " << replay_step_
                  << (s < replay_group_.size() ? " is group " + std::to_string(replay_group_[s]) + " in the file, "
                                               : " is past the file's end, ")
                  << "group " << group << " in this run: replay off, the guesses are the run's own from here";
}

void OffloadFfn::WatchTokenStart() {
  la_token_t0_ = SteadyNowNs();
  la_token_wait0_ = io_wait_ns();
}

void OffloadFfn::WatchTokenEnd() {
  if (la_token_t0_ == 0) return;  // the token started before a reset
  ++la_tokens_;
  la_window_ns_ += SteadyNowNs() - la_token_t0_;
  la_window_wait_ns_ += io_wait_ns() - la_token_wait0_;
  la_token_t0_ = 0;
  if (++la_window_tokens_ < kDefaultLookaheadWindowTokens) return;
  const double share =
      la_window_ns_ > 0 ? static_cast<double>(la_window_wait_ns_) / static_cast<double>(la_window_ns_) : 0.0;
  // The first window after the start or a batched prefill is not judged: its tokens fill a cold cache (SYNTHETIC 7B:
  // 62-68% of the first 8 tokens' time went into waiting for reads, on a disk where the later ones waited ~24%).
  if (la_window_judged_ && share >= options_.lookahead_wait_share) {
    la_on_ = true;
    la_started_token_ = la_tokens_;
    NF_LOG(Info) << "lookahead on after " << la_started_token_ << " tokens: waiting for reads took "
                 << static_cast<int>(share * 100.0 + 0.5) << "% of the last " << la_window_tokens_
                 << " tokens' time (threshold " << static_cast<int>(options_.lookahead_wait_share * 100.0 + 0.5)
                 << "%)";
  }
  la_window_judged_ = true;
  la_window_tokens_ = 0;
  la_window_ns_ = 0;
  la_window_wait_ns_ = 0;
}

size_t OffloadFfn::SubmitReads(std::span<const ReadRequest> requests, std::span<const size_t> chunk_ends,
                               const char* label) {
  return io_open_ ? io_->Append(requests, chunk_ends, label) : io_->Start(requests, chunk_ends, label);
}

const char* LookaheadSourceName(LookaheadSource source) {
  return source == LookaheadSource::kSameLayer ? "same-layer" : "next-layer";
}

const char* LookaheadInputName(LookaheadInput input) {
  switch (input) {
    case LookaheadInput::kHits: return "hits";
    case LookaheadInput::kFfnInput: return "ffn-input";
    case LookaheadInput::kProjected: return "projected";
  }
  return "?";
}

Result<LookaheadInput> ParseLookaheadInput(const std::string& name) {
  if (name == "hits") return LookaheadInput::kHits;
  if (name == "ffn-input") return LookaheadInput::kFfnInput;
  if (name == "projected") return LookaheadInput::kProjected;
  return Status::InvalidArgument("lookahead input \"" + name + "\": expected projected, hits or ffn-input");
}

Result<LookaheadSource> ParseLookaheadSource(const std::string& name) {
  if (name == "next-layer") return LookaheadSource::kNextLayer;
  if (name == "same-layer") return LookaheadSource::kSameLayer;
  return Status::InvalidArgument("lookahead source \"" + name + "\": expected next-layer or same-layer");
}

void OffloadFfn::BeforeAttention(int64_t layer, const float* xn, int64_t n) {
  if (event_trace_ != nullptr && n == 1) attention_begin_ns_ = SteadyNowNs();
  if (layer == 0) {
    if (n > 1) {
      prefill_batch_begins_ = true;
      if (!in_batch_) new_prompt_ = true;  // consecutive batches (a long prompt's chunks) are one prompt
    }
    in_batch_ = n > 1;
  }
  if (options_.lookahead_source != LookaheadSource::kSameLayer || n != 1 || la_slots_ == 0 || !la_on_) return;
  IssueGuess(layer, layer, xn, SteadyNowNs());
}

void OffloadFfn::BeforeFfn(int64_t layer, const float* x, int64_t n) {
  (void)layer;
  residual_ = n == 1 ? x : nullptr;  // a batch prefills (no lookahead)
}

bool OffloadFfn::GuessAfterHits(int64_t layer, const float* residual) const {
  const LlamaHparams& hp = model_.hparams();
  return options_.lookahead_input != LookaheadInput::kFfnInput && residual != nullptr && hp.n_experts == 0 &&
         la_slots_ > 0 && layer + 1 < hp.n_layers;
}

void OffloadFfn::NoteLayerRmsRatio(int64_t layer, const float* residual, const float* out) {
  if (options_.lookahead_table == nullptr || residual == nullptr || la_slots_ == 0 || layer + 1 >= model_.hparams().n_layers) {
    return;
  }
  const LlamaHparams& hp = model_.hparams();
  double rr = 0.0, vv = 0.0;
  for (int64_t i = 0; i < hp.dim; ++i) {
    const double r = residual[i], v = r + out[i];
    rr += r * r;
    vv += v * v;
  }
  const double n = static_cast<double>(hp.dim), eps = hp.norm_eps;
  la_rms_ratio_[static_cast<size_t>(layer)] = static_cast<float>(std::sqrt((vv / n + eps) / (rr / n + eps)));
}

bool OffloadFfn::PredictProjected(int64_t layer, const float* residual) {
  const float ratio = la_rms_ratio_[static_cast<size_t>(layer)];
  if (ratio <= 0.0f || options_.predictor == nullptr) return false;
  const LlamaHparams& hp = model_.hparams();
  const Predictor& pred = *options_.predictor;
  const int64_t next = layer + 1;
  const float* w = model_.layers()[static_cast<size_t>(next)].ffn_norm;
  double rr = 0.0;
  for (int64_t i = 0; i < hp.dim; ++i) {
    la_x_[static_cast<size_t>(i)] = residual[i] * w[i];
    rr += static_cast<double>(residual[i]) * residual[i];
  }
  pred.Hidden(next, la_x_.data(), &pred_scratch_, pool_);
  la_hit_rows_.clear();
  used_hidden_.clear();
  for (int32_t k : ready_items_) {
    if (!used_flag_[k]) continue;
    la_hit_rows_.push_back(active_[static_cast<size_t>(k)]);
    used_hidden_.push_back(hidden_[k]);
  }
  float* h = pred_scratch_.hidden.data();
  // rank columns: too narrow to split over threads
  AccumulateRows(options_.lookahead_table->layer(layer), la_hit_rows_, used_hidden_.data(), h, nullptr);
  const double rms = std::sqrt(rr / static_cast<double>(hp.dim) + hp.norm_eps) * ratio;
  const float inv = static_cast<float>(1.0 / rms);
  const int64_t rank = pred.info(next).rank;
  for (int64_t r = 0; r < rank; ++r) h[r] *= inv;
  pred.LogitsFromHidden(next, &pred_scratch_, pool_);
  pred.ActiveFromLogits(next, pred_scratch_, &la_rows_);
  return true;
}

void OffloadFfn::IssueLookaheadAfterHits(int64_t layer, const float* residual) {
  const uint64_t t0 = SteadyNowNs();
  const LlamaHparams& hp = model_.hparams();
  // kProjected: the predictor's pass is done here, through the table; otherwise (or before the layer has its rms
  // ratio) GuessGroup runs it on the input built below.
  const bool predicted = options_.lookahead_input == LookaheadInput::kProjected &&
                         options_.lookahead_table != nullptr && PredictProjected(layer, residual);
  if (!predicted) {
    const packer::BundleLayout& lay = deploy_.layout();
    const size_t dim = static_cast<size_t>(hp.dim);
    // residual + sum over the used hits of h * down column (any order: a guess, not a result).
    la_resid_.assign(residual, residual + dim);
    used_down_.clear();
    used_hidden_.clear();
    for (int32_t k : ready_items_) {
      if (!used_flag_[k]) continue;
      used_down_.push_back(down_ptr_[k]);
      used_hidden_.push_back(hidden_[k]);
    }
    if (!used_down_.empty()) {
      AccumulateRowPtrs(PartShape(lay, lay.down_type, lay.down_bytes), used_down_, used_hidden_.data(),
                        la_resid_.data(), pool_);
    }
    // The next layer's FFN normalisation of it.
    RmsNorm(la_resid_.data(), model_.layers()[static_cast<size_t>(layer + 1)].ffn_norm, hp.dim, hp.norm_eps,
            la_x_.data());
    la_act_.Set(la_x_.data(), 1, hp.dim);
  }
  const int b = static_cast<int>((layer + 1) % 2);  // dense: one set per layer
  if (la_group_[static_cast<size_t>(b)] >= 0) DropLookahead(layer);  // a stale one (not expected)
  GuessGroup(layer + 1, b, t0, predicted);
}

void OffloadFfn::IssueLookahead(int64_t layer, const Activation& x) {
  const int64_t next = layer + 1;
  const LlamaHparams& hp = model_.hparams();
  if (la_slots_ == 0 || next >= hp.n_layers) return;
  IssueGuess(next, layer, x.f32(), SteadyNowNs());
}

void OffloadFfn::IssueGuess(int64_t next, int64_t current, const float* input, uint64_t t0) {
  const LlamaHparams& hp = model_.hparams();
  const size_t dim = static_cast<size_t>(hp.dim);
  const float* scale = la_scale_.data() + static_cast<size_t>(current) * dim;
  for (size_t i = 0; i < dim; ++i) la_x_[i] = input[i] * scale[i];
  la_act_.Set(la_x_.data(), 1, hp.dim);
  const int first = static_cast<int>((next % 2) * la_per_layer_);
  for (int64_t j = 0; j < la_per_layer_; ++j) {
    // A stale one (not expected: each layer settles its own).
    if (la_group_[static_cast<size_t>(first + j)] >= 0) DropLookahead(current);
  }
  if (hp.n_experts == 0) {
    GuessGroup(next, first, t0);
    return;
  }
  // MoE: the experts next's router would pick for this input (the context's rule, TopExperts).
  const LayerWeights& lw = model_.layers()[static_cast<size_t>(next)];
  Gemv(lw.router, la_act_, la_router_.data(), nullptr);
  la_experts_.resize(static_cast<size_t>(hp.n_experts));
  TopExperts(la_router_.data(), la_per_layer_, la_experts_);
  for (int64_t j = 0; j < la_per_layer_; ++j) {
    GuessGroup(next * n_experts_ + la_experts_[static_cast<size_t>(j)], first + static_cast<int>(j), t0);
  }
  SubmitDeferredSets(next);
}

void OffloadFfn::GuessGroup(int64_t g, int b, uint64_t t0, bool predicted, bool exact) {
  const LlamaHparams& hp = model_.hparams();
  const int64_t next = GroupLayer(g), expert = GroupExpert(g);
  SlotRegion& cold = cache_->cold();
  // At most half of the next layer's cold partition (or of the shared pool): the rest stays for its other misses and
  // for the bundles it will hit, which a wrong guess would otherwise evict.
  const RegionConfig& cc = cold.config();
  const int64_t partition = cc.slots_per_group.empty() ? cc.shared_slots : cc.slots_per_group[static_cast<size_t>(g)];
  const int64_t limit = std::min(exact ? hp.n_ff : la_slots_, partition / 2);
  if (limit <= 0) return;
  const packer::RegionInfo& region = *deploy_.Region(next, expert);
  const packer::BundleLayout& lay = deploy_.layout();

  // Candidates: neurons the next layer would have to read if active (Resolve's cold path, not cached now).
  auto cold_candidate = [&](int32_t n) { return !HotPath(g, region, region.slot_of_neuron[n]) && cold.Find(g, n) < 0; };
  la_pick_.clear();
  const float thr = thresholds_[static_cast<size_t>(g)];
  if (oracle_) {
    la_rows_.clear();
    for (int32_t n = 0; n < hp.n_ff; ++n) {
      if (cold_candidate(n)) la_rows_.push_back(n);
    }
    if (!exact && static_cast<int64_t>(la_rows_.size()) > limit * kRowsPerGuessedBundle) return;
    GemvRows(oracle_gate_[static_cast<size_t>(g)], la_rows_, la_act_, la_score_.data(), pool_);
    for (size_t j = 0; j < la_rows_.size(); ++j) {
      float ga = 0.0f;
      ActivateNeuron(hp.activation, la_score_[j], 0.0f, &ga);
      la_score_[j] = std::fabs(ga);
      if (la_score_[j] > thr) la_pick_.push_back(static_cast<int32_t>(j));
    }
    if (static_cast<int64_t>(la_pick_.size()) > limit) {
      // The most confident guesses: the largest activations are the least likely to fall below the threshold.
      std::nth_element(la_pick_.begin(), la_pick_.begin() + limit, la_pick_.end(),
                       [&](int32_t a, int32_t c) { return la_score_[a] > la_score_[c]; });
      la_pick_.resize(static_cast<size_t>(limit));
    }
    for (int32_t& j : la_pick_) j = la_rows_[static_cast<size_t>(j)];
  } else {
    if (!predicted) options_.predictor->Predict(g, la_act_, 0, &pred_scratch_, &la_rows_, pool_);
    for (int32_t n : la_rows_) {
      if (cold_candidate(n)) la_pick_.push_back(n);
    }
    // The likeliest share of them (largest logits; ties to the smaller index), at most `limit`.
    const auto keep = std::min<size_t>(
        static_cast<size_t>(limit),
        exact ? la_pick_.size()
              : static_cast<size_t>(std::ceil(options_.lookahead_keep * static_cast<double>(la_pick_.size()))));
    if (keep < la_pick_.size()) {
      const float* logit = pred_scratch_.logits.data();
      std::nth_element(la_pick_.begin(), la_pick_.begin() + static_cast<std::ptrdiff_t>(keep), la_pick_.end(),
                       [&](int32_t a, int32_t c) { return logit[a] != logit[c] ? logit[a] > logit[c] : a < c; });
      la_pick_.resize(keep);
    }
  }
  // Replay: the guess above was made (its time counts), but the next step's actual set is read instead.
  const size_t next_step = static_cast<size_t>(replay_step_ + 1);
  if (!exact && replay_on_ && next_step < replay_group_.size() && replay_group_[next_step] == g) {
    la_pick_.clear();
    for (int32_t n : replay_set_[next_step]) {
      if (static_cast<int64_t>(la_pick_.size()) == limit) break;
      if (cold_candidate(n)) la_pick_.push_back(n);
    }
  }
  // File order; each bundle gets a cold slot now (pinned until the next layer settles it); neighbours on flash merge
  // into one request (scattered into their slots unless the slots are neighbours too).
  std::sort(la_pick_.begin(), la_pick_.end(),
            [&](int32_t a, int32_t c) { return region.slot_of_neuron[a] < region.slot_of_neuron[c]; });
  std::vector<int32_t>& neurons = la_neurons_[b];
  std::vector<ReadRequest>& reqs = la_requests_[b];
  std::vector<size_t>& ends = la_chunk_ends_[b];
  neurons.clear();
  la_slot_[b].clear();
  la_item_[b].clear();
  io::RequestBuilder& builder = la_builder_[b];
  builder.Reset(options_.max_request_bytes, options_.scatter_reads, gap_sink_, gap_bytes_);
  ends.clear();
  const size_t size = static_cast<size_t>(cold_read_);
  for (int32_t n : la_pick_) {
    if (!cold.CanPlace(g)) break;  // every slot pinned: the rest is read on demand
    // Never from the overflow pool: it must keep room for the misses of the layer being computed.
    const SlotRegion::Lookup l = cold.Acquire(g, n, /*use_overflow=*/false);
    if (l.slot < 0) break;
    cold_complete_[static_cast<size_t>(l.slot)] = 0;
    la_index_of_neuron_[b][static_cast<size_t>(n)] = static_cast<int32_t>(neurons.size());
    neurons.push_back(n);
    la_slot_[b].push_back(l.slot);
    la_item_[b].push_back(-1);
    const uint64_t offset = region.offset + lay.SlotOffset(region.slot_of_neuron[n]);
    builder.Add(offset, size, cold.SlotData(l.slot));
  }
  reqs = builder.Finish();
  OffloadGroupStats& st = stats_[static_cast<size_t>(g)];
  st.lookahead_ns += SteadyNowNs() - t0;
  if (neurons.empty()) return;
  CutChunks(reqs.size(), &ends);
  st.prefetched += static_cast<int64_t>(neurons.size());
  st.requests += static_cast<int64_t>(reqs.size());
  st.scattered_requests += CountScattered(reqs);
  st.prefetch_requests += static_cast<int64_t>(reqs.size());
  for (const ReadRequest& r : reqs) {
    st.bytes_read += r.size;
    st.prefetch_bytes += r.size;
  }
  la_group_[b] = g;
  if (hp.n_experts > 0) {
    deferred_sets_.push_back(b);  // the caller submits it with the layer's other experts' sets (SubmitDeferredSets)
    return;
  }
  la_first_chunk_[b] = SubmitReads(reqs, ends, "reads ahead");
  io_open_ = true;
}

void OffloadFfn::SubmitDeferredSets(int64_t layer) {
  // The buffers of the sets' layer parity: the I/O thread may still read the other parity's stream (an MoE guess's
  // sets for the layer now running, which its unrouted experts leave unsettled until the next layer starts); this
  // parity's sets, two layers back, have all been settled (consumed, or dropped by DropLookahead / IssueGuess).
  std::vector<ReadRequest>& requests = deferred_requests_[static_cast<size_t>(layer % 2)];
  std::vector<size_t>& chunk_ends = deferred_chunk_ends_[static_cast<size_t>(layer % 2)];
  requests.clear();
  chunk_ends.clear();
  for (int b : deferred_sets_) {
    const size_t base = requests.size();
    requests.insert(requests.end(), la_requests_[b].begin(), la_requests_[b].end());
    for (size_t end : la_chunk_ends_[b]) chunk_ends.push_back(base + end);
  }
  if (!requests.empty()) {
    // One stream: the I/O thread reads a submission's requests to the end before it starts the next one's, so a
    // submission per expert would keep only one expert's handful of reads in flight at a time (SYNTHETIC
    // qwen3-30b-a3b, 8 layers, top 8 at 1200M: ~6 reads per expert; 38.2 -> 42.7 tok/s, docs/runtime.md "MoE").
    size_t first = SubmitReads(requests, chunk_ends, "experts' reads ahead");
    for (int b : deferred_sets_) {
      la_first_chunk_[b] = first;
      first += la_chunk_ends_[b].size();
    }
    io_open_ = true;
  }
  deferred_sets_.clear();
}

void OffloadFfn::IssueSiblings(int64_t layer, int64_t expert, const Activation& x) {
  const uint64_t t0 = SteadyNowNs();
  const LlamaHparams& hp = model_.hparams();
  la_act_.Set(x.f32(), 1, hp.dim);  // sib_group_ was cleared at this expert's start (ForwardToken)
  const int first = static_cast<int>((layer % 2) * la_per_layer_);
  size_t j = 0;
  for (int64_t e : moe_routed_) {
    if (e == expert) continue;
    if (j == sib_group_.size()) break;
    const int64_t g = layer * n_experts_ + e;
    const int b = first + static_cast<int>(j);
    if (la_group_[static_cast<size_t>(b)] >= 0) continue;  // not expected: each sibling settles its set
    if (!oracle_) {
      // The sibling's own step would make the same call on the same input: its result is kept for it.
      options_.predictor->Predict(g, la_act_, 0, &pred_scratch_, &sib_active_[j], pool_);
      sib_group_[j] = g;
      la_rows_.assign(sib_active_[j].begin(), sib_active_[j].end());
    }
    GuessGroup(g, b, t0, /*predicted=*/!oracle_, /*exact=*/true);
    ++j;
  }
  SubmitDeferredSets(layer);
}

bool OffloadFfn::TakeSiblingSet(int64_t group) {
  for (size_t j = 0; j < sib_group_.size(); ++j) {
    if (sib_group_[j] != group) continue;
    sib_group_[j] = -1;
    active_.swap(sib_active_[j]);
    return true;
  }
  return false;
}

Status OffloadFfn::SettleLookahead(int b) {
  const int64_t group = la_group_[b];
  if (group < 0) return Status::Ok();
  const int64_t layer = GroupLayer(group), expert = GroupExpert(group);
  const packer::RegionInfo& region = *deploy_.Region(layer, expert);
  const packer::BundleLayout& lay = deploy_.layout();
  SlotRegion& cold = cache_->cold();
  const size_t size = static_cast<size_t>(cold_read_);
  const std::vector<int32_t>& neurons = la_neurons_[b];
  OffloadGroupStats& st = stats_[static_cast<size_t>(group)];
  Status first_error;
  size_t i = 0;  // bundles are in request order: those of chunk c end where its last request does
  for (size_t c = 0; c < la_chunk_ends_[b].size(); ++c) {
    const Status read = io_->WaitChunk(la_first_chunk_[b] + c);
    const uint64_t t0 = SteadyNowNs();
    const ReadRequest& last = la_requests_[b][la_chunk_ends_[b][c] - 1];
    const uint64_t chunk_end = last.offset + last.size;
    for (; i < neurons.size(); ++i) {
      const int32_t n = neurons[i];
      const uint64_t offset = region.offset + lay.SlotOffset(region.slot_of_neuron[n]);
      if (offset >= chunk_end) break;
      const int32_t slot = la_slot_[b][i];
      la_slot_[b][i] = -1;
      la_index_of_neuron_[b][static_cast<size_t>(n)] = -1;
      uint8_t* data = cold.SlotData(slot);
      if (la_item_[b][i] < 0) {
        // Not used by this token: a good bundle stays cached, but first in line for eviction (a wrong guess must
        // not push out bundles that were used); a bad one is dropped (never retried: nothing needs it now).
        if (read.ok() &&
            deploy_.VerifyBundle(layer, expert, n, std::span<const uint8_t>(data, lay.bundle_bytes)).ok()) {
          cold_complete_[static_cast<size_t>(slot)] = 1;
          cold.ReleaseAsLru(slot);
        } else {
          cold.Abandon(slot);
        }
        continue;
      }
      ++st.prefetch_used;  // the item holds the pin now (released with the token's)
      if (!first_error.ok()) continue;  // the token fails; its pins are dropped with it
      // Checked like any other arrival: verified, a bad one read again once, then an error naming it.
      const Unit unit{offset, size, data, slot, false, n, -1, Phase::kWhole, la_item_[b][i]};
      first_error = CheckArrival(layer, expert, region, unit, read);
    }
    st.lookahead_verify_ns += SteadyNowNs() - t0;
  }
  la_group_[b] = -1;
  if (la_current_ == b) la_current_ = -1;
  return first_error;
}

Status OffloadFfn::ConsumeLookahead() {
  if (la_current_ < 0) return Status::Ok();
  return SettleLookahead(la_current_);
}

void OffloadFfn::DropLookahead(int64_t keep_layer) {
  for (size_t b = 0; b < la_group_.size(); ++b) {
    if (la_group_[b] < 0) continue;
    if (GroupLayer(la_group_[b]) == keep_layer) continue;
    // No item holds these (a stale set), so SettleLookahead only releases or drops them: it cannot fail.
    (void)SettleLookahead(static_cast<int>(b));
  }
  if (LookaheadIdle()) io_open_ = false;
}

void OffloadFfn::ForgetLookahead() {
  for (size_t b = 0; b < la_group_.size(); ++b) {
    if (la_group_[b] >= 0) {
      for (size_t i = 0; i < la_neurons_[b].size(); ++i) {
        la_index_of_neuron_[b][static_cast<size_t>(la_neurons_[b][i])] = -1;
        // Items own the pins they took (AbandonPending drops them); the rest are dropped here.
        if (la_slot_[b][i] >= 0 && la_item_[b][i] < 0) cache_->cold().Abandon(la_slot_[b][i]);
        la_slot_[b][i] = -1;
      }
    }
    la_group_[b] = -1;
  }
  std::fill(sib_group_.begin(), sib_group_.end(), -1);
  la_current_ = -1;
  io_open_ = false;
}

}  // namespace nflash::sparse
