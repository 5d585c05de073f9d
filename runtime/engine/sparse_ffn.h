// The sparse in-memory FFN: an FfnBackend that computes, for each decoded token, only the FFN neurons of an active set
// (exact "oracle" set, or the set an activation predictor guesses) and skips the rest. It is the numerical reference
// for the flash-offloaded runtime, which replaces where the rows come from, not how they are combined.
//
// Per token and layer, with A the set of computed neurons:
//   oracle:     gate = W_gate . x (all rows); A = {i : |act(gate_i)| > threshold}; up only for A
//   predictor:  A = Predict(x); gate and up only for A (GemvRows)
//   hidden_i  = ActivateNeuron(gate_i, up_i), set to 0 when |act(gate_i)| <= threshold (the runtime applies the
//               "active" test of runtime/engine/predictor.h to what it computed, so a predicted-but-inactive neuron
//               contributes nothing, exactly as in oracle mode)
//   out       = sum over i in A with hidden_i != 0 of hidden_i * down[:, i]  (AccumulateRows on a transposed copy)
// The transposed copy of ffn_down (n_ff rows of dim) is made at construction in ColumnType (runtime/core/quant.h), the
// type a deployment's bundles keep: F32/F16/BF16 exactly; Q8_0/Q4_0 dequantized and requantized per column to the same
// type (one extra rounding of each weight, |error| <= half a step of the new block's scale), exactly as the packer
// does, so the offloaded FFN computes the same function from the same bytes. The dense path instead quantizes the
// hidden vector to Q8_0, so the two differ by rounding.
// MoE: the same per (layer, expert) group, with that expert's rows, its own transposed down and its own threshold.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "runtime/core/kernels.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"

namespace nflash {

enum class SparseMode { kOracle, kPredictor };

// Batches of at least this many tokens prefill in batches (the offloaded runtime reads each layer's region whole;
// oracle mode computes every neuron by GEMM, SparseFfn::ForwardPrefill too; predictor mode each token's predicted
// neurons); shorter ones token by token through the decode path. For an MoE expert the batch is the tokens the
// router sent to it. Either way the function is the token path's, bit for bit; the offloaded runtime picks the rule
// for I/O cost (runtime/sparse/offload_ffn.h).
inline constexpr int64_t kDefaultBatchedPrefillMinTokens = 64;

struct SparseFfnOptions {
  SparseMode mode = SparseMode::kOracle;
  // The "active" threshold per layer (n_layers items) or per group (n_layers x n_experts, MoE); empty: 0 everywhere
  // (the ReLU/dReLU exact zeros), or in predictor mode the predictor file's thresholds.
  std::vector<float> activation_threshold;
  // Also run batched prefill (x.n() > 1) token by token through the sparse path (perplexity with only predicted
  // neurons, counted in the statistics); false: in oracle mode, batches of batched_prefill_min_tokens or more (an MoE
  // expert's tokens of a batch count alone) compute every neuron by GEMM with the down projection through the column
  // copy (ForwardPrefill), shorter ones go token by token; predictor mode runs every batch token by token.
  bool sparse_prefill = false;
  int64_t batched_prefill_min_tokens = kDefaultBatchedPrefillMinTokens;
  // Predictor mode: also compute every gate row to count the exact active set and the recall (costs a dense gate
  // GEMV per token: for measurements, not for speed).
  bool measure_recall = false;
};

// Counts per layer, summed over the tokens the sparse path ran (neuron-token pairs).
struct SparseFfnLayerStats {
  int64_t tokens = 0;
  int64_t computed = 0;        // neurons whose gate/up rows were computed (oracle: the active set; predictor: predicted)
  int64_t active = 0;          // computed neurons that passed the active test (the rows down actually used)
  int64_t true_active = -1;    // exact active set size (oracle; predictor with measure_recall), else -1
  int64_t true_positive = -1;  // predicted and truly active (predictor with measure_recall)
};

// Thread-safety: not thread-safe (per-context scratch and statistics); one per InferenceContext. The model, the
// predictor and the pool must outlive it. Results do not depend on the pool's thread count (the kernels' per-element
// order is fixed).
class SparseFfn : public FfnBackend {
 public:
  // `predictor` is required in predictor mode (and checked against the model's shapes), ignored in oracle mode.
  static Result<std::unique_ptr<SparseFfn>> Create(const Model& model, const Predictor* predictor,
                                                   const SparseFfnOptions& options, ThreadPool* pool);

  Result<bool> Forward(int64_t layer, int64_t expert, const Activation& x, float* out) override;

  const std::vector<SparseFfnLayerStats>& stats() const { return stats_; }
  void ResetStats();
  // Bytes of the transposed down projections this backend holds (in addition to the model).
  uint64_t extra_bytes() const;
  // Per group (layer x max(1, n_experts) + expert: the layer for a dense model).
  float activation_threshold(int64_t group) const { return thresholds_[static_cast<size_t>(group)]; }

 private:
  SparseFfn(const Model& model, const Predictor* predictor, const SparseFfnOptions& options, ThreadPool* pool);
  Status BuildTransposedDown();
  // expert: -1 for a dense FFN, else the MoE expert whose rows to use.
  // `counted`: whether it enters the statistics (decode tokens; prompt tokens only with sparse_prefill).
  void ForwardToken(int64_t layer, int64_t expert, const Activation& x, int64_t token, float* out, bool counted);
  // Batched prefill of a layer (or of an MoE expert's tokens) in oracle mode without sparse_prefill: gate and up of
  // every neuron by GEMM, then per token the neurons with |act(gate)| > threshold and h != 0 through AccumulateRows on
  // the column copy (bitwise the token path). Predictor mode always runs the token path.
  void ForwardPrefill(int64_t layer, int64_t expert, const Activation& x, float* out);

  const Model& model_;
  const Predictor* predictor_;
  SparseFfnOptions options_;
  ThreadPool* pool_;
  std::vector<float> thresholds_;
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, FreeDeleter> down_t_block_;  // every group's (n_ff, dim) columns in ColumnType, 2 MiB aligned
  size_t down_t_block_bytes_ = 0;
  std::vector<MatrixView> down_t_;
  std::vector<SparseFfnLayerStats> stats_;
  // Scratch (sized at construction: no allocation per token).
  PredictorScratch pred_scratch_;
  std::vector<int32_t> rows_, used_;
  std::vector<float> gate_all_, gate_, up_, hidden_;
  std::vector<float> prefill_gate_, prefill_up_;  // token tile x n_ff (ForwardPrefill)
  Activation token_act_;
};

}  // namespace nflash
