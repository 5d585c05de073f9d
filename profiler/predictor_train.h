// Training activation predictors in C++: collect (FFN input, active mask) pairs from the dense engine, fit each layer's
// low-rank MLP (runtime/engine/predictor.h) with mini-batch Adam on a weighted binary cross-entropy, pick the logit
// threshold that reaches the recall target on a validation split, and pick the rank per layer.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"

namespace nflash::profiler {

// What the dense engine showed of each FFN over a token stream: the normalised FFN inputs and |act(gate)|, per group
// (the layer for a dense model; layer x n_experts + expert for a mixture of experts, whose experts see only the tokens
// routed to them).
struct ActivationSamples {
  int64_t dim = 0, n_ff = 0, n_tokens = 0;  // n_tokens: tokens run through the model
  int64_t n_experts = 0;
  std::vector<int64_t> group_tokens;         // per group: tokens it saw (n_tokens for a dense model)
  std::vector<std::vector<float>> x;         // per group: group_tokens x dim
  std::vector<std::vector<float>> gate_abs;  // per group: group_tokens x n_ff, |act(gate)|
};

// Runs `tokens` through the dense engine in windows of `window` tokens (each from an empty context; batched prefill)
// and records every FFN's input and |act(gate)| (MoE: each expert's, for the tokens the router sent it).
Result<ActivationSamples> CollectSamples(const Model& model, std::span<const int32_t> tokens, int64_t window,
                                         ThreadPool* pool);

// A mixture of experts: gives `group` (an expert the calibration tokens rarely or never routed to) the FFN inputs its
// layer's other experts saw, up to `max_rows` of them taken in turn from each (every token's input appears once per
// expert it was routed to, so each token about equally often), with the expert's own |act(gate)| on them computed by
// the engine's kernels: a predictor can then be fitted to the expert's gate over the layer's input distribution. The
// group's own samples are replaced. Returns the rows it now holds (0 when the layer's other experts saw none).
int64_t BorrowLayerInputs(const Model& model, ActivationSamples* samples, int64_t group, int64_t max_rows,
                          ThreadPool* pool);

// Per group, the CATS threshold for `sparsity` in [0, 1): the `sparsity` quantile (nearest rank, QuantileThreshold of
// profiler/activation_stats.h, as the profile) of the pooled |act(gate)| values of the layer, so that fraction of
// neuron-token pairs is at or below it. sparsity 0 gives threshold 0.
std::vector<float> SparsityThresholds(const ActivationSamples& samples, double sparsity);

// Active masks (group_tokens x n_ff bytes, 1 = active: |act(gate)| > threshold) of one group.
std::vector<uint8_t> ActiveMask(const ActivationSamples& samples, int64_t group, float threshold);

struct TrainOptions {
  float target_recall = 0.98f;
  std::vector<int64_t> ranks = {16, 32, 64, 128, 256};  // candidates, tried in increasing order
  float max_predicted_ratio = 1.5f;  // accept a rank when predicted-active <= this x true-active
  int epochs = 6;            // enough for the loss to flatten on the models tried (see docs/predictor.md)
  int64_t batch = 256;       // tokens per Adam step: large enough for the GEMMs to be efficient
  float learning_rate = 2e-3f;
  float pos_weight = 2.0f;   // BCE weight of active neurons (> 1 trades precision for recall)
  uint64_t seed = 1;
};

// Recall / precision (micro: neuron-token pairs) of a predictor layer with its logit threshold.
struct PredictionQuality {
  double recall = 0, precision = 0, predicted_fraction = 0, true_fraction = 0;
};

// The logits of one layer's predictor for n tokens (n x n_ff), batched with GEMMs.
void PredictorLogits(const PredictorLayerData& layer, int64_t dim, int64_t n_ff, const float* x, int64_t n,
                     std::vector<float>* logits, ThreadPool* pool);

PredictionQuality Evaluate(const PredictorLayerData& layer, int64_t dim, int64_t n_ff, const float* x,
                           const uint8_t* mask, int64_t n, ThreadPool* pool);

// Sets L->info.logit_threshold from n_val validation tokens (xv: n_val x dim, mv: their masks): the largest value that
// keeps micro recall >= target_recall; then fills L->info.recall, precision, predicted and true fractions from them.
void SetThresholdForRecall(PredictorLayerData* L, const float* xv, const uint8_t* mv, int64_t n_val, int64_t dim,
                           int64_t n_ff, float target_recall, ThreadPool* pool);

// Trains one layer at one rank on the first n_train tokens, then sets info.logit_threshold from the n_val tokens
// that follow (the smallest threshold step that keeps micro recall >= target) and fills info.recall etc. from them.
Result<PredictorLayerData> TrainLayer(const float* x, const uint8_t* mask, int64_t n_train, int64_t n_val, int64_t dim,
                                      int64_t n_ff, int64_t rank, const TrainOptions& options, ThreadPool* pool);

// Trains the candidate ranks in increasing order and returns the first that meets the recall target with
// predicted-active <= max_predicted_ratio x true-active; when none does, the one with the smallest predicted
// fraction, with *fallback set.
Result<PredictorLayerData> TrainLayerChooseRank(const float* x, const uint8_t* mask, int64_t n_train, int64_t n_val,
                                                int64_t dim, int64_t n_ff, const TrainOptions& options,
                                                ThreadPool* pool, bool* fallback);

}  // namespace nflash::profiler
