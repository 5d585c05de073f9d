// Activation predictors: per layer a PowerInfer-style low-rank MLP that guesses, from the FFN input, which FFN neurons
// will be active, so the sparse FFN computes only those rows. The file format (a GGUF side file) is specified here and
// in docs/predictor.md; the trainer (profiler/predictor_train.h) writes it with SavePredictor, the runtime reads it
// with Predictor::Load.
//
// "Active" (shared by profile, predictor and runtime): neuron i of layer l is active for a token iff
// |act(gate_i . x)| > activation_threshold[l], act from ActivateNeuron (runtime/core/ffn_activation.h). ReLU / dReLU:
// threshold 0 (the exact zeros). SiLU: a per-layer threshold (CATS): the value below which the fraction S (the target
// sparsity) of |silu(gate)| values fall, pooled over all neurons and calibration tokens of the layer.
//
// Predictor of layer l:  logits = fc2 . relu(fc1 . x) + fc2_bias;  neuron i predicted active iff logits[i] >
// logit_threshold[l].
//
// Mixture-of-experts models have one predictor per (layer, expert), a "group" g = layer x n_experts + expert (the
// deployment's region order), trained on the tokens routed to that expert; dense models have one per layer (g =
// layer). Everything indexed "per layer" below is then per group, in group order.
//
// File layout (GGUF v3, general.architecture = "nflash-predictor"):
//   tensors  blk.N.fc1.weight   (rank_N rows of dim)    F32 or F16
//            blk.N.fc2.weight   (n_ff rows of rank_N)   F32 or F16
//            blk.N.fc2.bias     (n_ff)                  F32; optional (absent: zero): an nflash extension to PowerInfer's
//                                                       bias-free fc2, it carries each neuron's prior firing rate
//            (MoE: blk.N.exp.E.fc1.weight, blk.N.exp.E.fc2.weight, blk.N.exp.E.fc2.bias for expert E of layer N)
//   metadata nflash.predictor.schema_version u32 (kPredictorSchemaVersion; other versions are rejected)
//            nflash.predictor.model_hash     string (HashToHex(HashFile(model file)))
//            nflash.predictor.model_name, .activation (silu|relu|drelu)  string
//            nflash.predictor.dim, .n_ff, .n_layers  u64
//            nflash.predictor.n_experts     u64; only for MoE models (absent: 0, a dense model)
//            nflash.predictor.target_recall  f32;  .train_tokens u64
//            per group arrays (n_layers x max(1, n_experts) items): .rank (u32), .logit_threshold, .activation_threshold (f32),
//            .recall, .precision, .predicted_fraction, .true_fraction (f32, validation split of the calibration text),
//            .eval_recall, .eval_precision, .eval_predicted_fraction, .eval_true_fraction (f32, held-out text;
//            -1 when not measured), .train_seconds (f32)
// Recall and precision are micro averages: true positives / all active (resp. all predicted) neuron-token pairs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/kernels.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/model.h"

namespace nflash {

inline constexpr uint32_t kPredictorSchemaVersion = 1;

// What the file records about one layer's predictor (besides its weights).
struct PredictorLayerInfo {
  int64_t rank = 0;
  float logit_threshold = 0.0f;
  float activation_threshold = 0.0f;
  // Measured on the validation split of the calibration text.
  float recall = -1, precision = -1, predicted_fraction = -1, true_fraction = -1;
  // Measured on held-out text (-1: not measured).
  float eval_recall = -1, eval_precision = -1, eval_predicted_fraction = -1, eval_true_fraction = -1;
  float train_seconds = 0;
};

// One layer's weights as floats (row-major) plus its record: what the trainer produces and SavePredictor writes.
struct PredictorLayerData {
  std::vector<float> fc1;       // (rank, dim)
  std::vector<float> fc2;       // (n_ff, rank)
  std::vector<float> fc2_bias;  // (n_ff); empty: zero
  PredictorLayerInfo info;
};

struct PredictorData {
  std::string model_hash;
  std::string model_name;
  std::string activation;  // silu / relu / drelu
  int64_t dim = 0, n_ff = 0;
  int64_t n_experts = 0;  // 0: dense (layers are the model's layers); MoE: layers are the groups, in group order
  float target_recall = 0;
  int64_t train_tokens = 0;
  std::vector<PredictorLayerData> layers;
};

// Writes `data` atomically (temporary name, rename); refuses an existing path unless `overwrite`. `weight_type`: F32
// or F16 for fc1/fc2 (the bias is always F32).
Status SavePredictor(const PredictorData& data, const std::string& path, bool overwrite,
                     GgmlType weight_type = GgmlType::kF32);

// Per-caller buffers of Predict (so a Predictor can be shared by threads, each with its own scratch).
struct PredictorScratch {
  std::vector<float> hidden;  // max rank
  std::vector<float> logits;  // n_ff
  std::vector<int32_t> live;  // ranks whose hidden value is non-zero (after the ReLU), ascending
  std::vector<float> live_h;  // their hidden values
  Activation x_act;  // the reused kernel input (its buffer keeps its capacity between tokens)
};

// Loaded predictors of every layer. Thread-safety: immutable after Load; Predict may run concurrently with distinct
// scratch objects.
class Predictor {
 public:
  // Reads and validates a predictor file (schema version, tensor shapes and types, array lengths); errors name the
  // file and the tensor or key.
  static Result<std::unique_ptr<Predictor>> Load(const std::string& path);
  // From in-memory data (the trainer's evaluation, tests); the weights are copied as F32.
  static Result<std::unique_ptr<Predictor>> FromData(const PredictorData& data);

  // Error unless the predictor fits `model`: dim, n_ff, layer count, activation; and, when `model_hash` is not empty,
  // the hash recorded in the file (the message names both hashes and `model_path`).
  Status CheckForModel(const Model& model, const std::string& model_hash, const std::string& model_path) const {
    return CheckForModel(model.hparams(), model_hash, model_path);
  }
  // The same from the model's hyper-parameters (a tool that reads the GGUF without loading the model: the packer).
  Status CheckForModel(const LlamaHparams& hp, const std::string& model_hash, const std::string& model_path) const;

  // Sizes `scratch` for this predictor (call once; Predict then allocates nothing).
  void PrepareScratch(PredictorScratch* scratch) const;
  // The predicted active neurons of group `group` (Group(layer, expert); the layer for a dense model) for token
  // `token` of `x` (x.cols() == dim), ascending, into `active` (cleared first; give it capacity n_ff to avoid
  // allocation). `pool` may be nullptr.
  void Predict(int64_t group, const Activation& x, int64_t token, PredictorScratch* scratch,
               std::vector<int32_t>* active, ThreadPool* pool) const;
  // Logits only (n_ff floats into scratch->logits), for measurements.
  void Logits(int64_t group, const float* x, PredictorScratch* scratch, ThreadPool* pool) const;
  // Predict in steps, for a caller that builds the hidden layer another way (the offloaded runtime's lookahead adds
  // precomputed fc1 projections to it): Hidden writes fc1 . x (before the ReLU, rank floats) into scratch->hidden;
  // LogitsFromHidden applies the ReLU and fc2 (+ bias) to scratch->hidden; ActiveFromLogits thresholds
  // scratch->logits into the ascending active list. The three in a row equal Predict.
  void Hidden(int64_t group, const float* x, PredictorScratch* scratch, ThreadPool* pool) const;
  void LogitsFromHidden(int64_t group, PredictorScratch* scratch, ThreadPool* pool) const;
  void ActiveFromLogits(int64_t group, const PredictorScratch& scratch, std::vector<int32_t>* active) const;
  // fc1 of `group` (rank rows of dim, F32 or F16).
  const MatrixView& fc1(int64_t group) const { return layers_[static_cast<size_t>(group)].fc1; }

  // Bytes of the predictor weights of all groups (what the runtime holds in memory).
  uint64_t PredictorBytes() const;
  uint64_t LayerBytes(int64_t group) const;
  int64_t n_layers() const { return n_layers_; }
  int64_t n_experts() const { return n_experts_; }
  int64_t n_groups() const { return static_cast<int64_t>(layers_.size()); }
  // The group of (layer, expert); expert < 0 (a dense model): the layer.
  int64_t Group(int64_t layer, int64_t expert) const { return expert < 0 ? layer : layer * n_experts_ + expert; }
  int64_t dim() const { return dim_; }
  int64_t n_ff() const { return n_ff_; }
  const std::string& model_hash() const { return model_hash_; }
  const std::string& activation() const { return activation_; }
  float target_recall() const { return target_recall_; }
  const PredictorLayerInfo& info(int64_t group) const { return layers_[static_cast<size_t>(group)].info; }
  float activation_threshold(int64_t group) const { return info(group).activation_threshold; }

 private:
  struct Layer {
    std::vector<uint8_t> fc1_bytes, fc2_bytes;
    // fc2 is held transposed (rank rows of n_ff, the file's element type): the logits are then a sum of the live
    // hidden units' rows, n_ff wide, instead of n_ff dot products `rank` long (each a horizontal sum), and the units
    // the ReLU zeroed cost nothing.
    MatrixView fc1, fc2t;
    std::vector<float> fc2_bias;  // n_ff (zeros when the file has none)
    PredictorLayerInfo info;
  };
  Predictor() = default;
  std::string path_;
  std::string model_hash_, model_name_, activation_;
  int64_t dim_ = 0, n_ff_ = 0;
  int64_t n_layers_ = 0, n_experts_ = 0;
  float target_recall_ = 0;
  std::vector<Layer> layers_;  // per group
};

}  // namespace nflash
