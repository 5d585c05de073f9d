// Synthetic Llama/Mistral/Mixtral/Qwen3/Qwen3-MoE-shaped models whose ReLU/dReLU FFN is activation-sparse through the weights
// (docs/synthetic.md explains the construction and its maths). The model is described as a converter::SourceModel
// whose tensor loaders regenerate every weight deterministically from (seed, tensor, row), so it is written by the
// same GGUF writer as converted models and never held in memory as a whole.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "converter/model_ir.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash::converter {

struct SynthOptions {
  // "llama-7b", "llama-13b", "mistral-7b", "mixtral-8x7b", "qwen3-8b", "qwen3-30b-a3b" or "custom". Fields below
  // left at 0 (or empty) take the shape's value; for "custom" dim, ffn, heads and vocab are required.
  std::string shape = "llama-7b";
  // custom: the GGUF architecture, "llama" (the default; Mixtral's experts with --experts), "qwen3" (per-head q/k
  // norms, NEOX RoPE, dense) or "qwen3moe" (qwen3's attention, experts required).
  std::string arch;
  int64_t layers = 0;    // cuts (or for custom, sets) the depth
  int64_t dim = 0;
  int64_t ffn = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;  // custom default: heads
  int64_t head_dim = 0;  // custom: the head size (llama.attention.key_length) when not dim / heads
  int64_t experts = 0;   // custom: 0 = dense FFN
  int64_t top_k = 0;     // custom MoE default: 2
  int64_t vocab = 0;
  int64_t context = 0;   // custom default: 4096
  GgmlType type = GgmlType::kF32;  // the file's weight type; calibration runs on weights round-tripped through it
  uint64_t seed = 1;
  FfnActivation activation = FfnActivation::kRelu;
  double sparsity = 0.9;  // fraction of FFN neurons inactive per token (relu/drelu only)
  double hot_skew = 0.8;  // power-law exponent of neuron popularity over rank (0 = every neuron equally popular)
  // Predictable gates (docs/synthetic.md): gate (and up) weights = rank-`gate_rank` product U V plus `gate_noise`
  // relative i.i.d. noise, per-value variance unchanged, so pre-activations live near a gate_rank-dimensional
  // subspace of the input as in trained LLMs. 0 = off: every weight i.i.d. (the files made before the flag existed).
  int64_t gate_rank = 0;
  // Relative std of the full-rank part. 0.1 leaves 1% of the pre-activation variance unpredictable from the subspace:
  // a perfect predictor of the low-rank part then reaches recall >= 0.996 at 1.5x the true active set for neurons of
  // popularity >= 0.03 (Monte Carlo, docs/synthetic.md); 0.3 already caps it at ~0.87-0.94.
  double gate_noise = 0.1;
  // Calibration simulation: `calib_sequences` random token sequences of `calib_tokens` tokens each; the last one is
  // held out and only measured (the numbers in SynthReport).
  int calib_sequences = 6;
  int calib_tokens = 32;
  int threads = 0;  // 0: all hardware threads
};

// What the calibration simulation measured on its held-out sequence, per layer.
struct SynthLayerReport {
  double active_fraction = 0;      // mean fraction of active FFN neurons per token (per routed expert for MoE)
  double consecutive_jaccard = 0;  // mean |A_t & A_t+1| / |A_t | A_t+1| of consecutive tokens' active sets
  // The Jaccard overlap two tokens would have if they drew their active sets independently with the measured
  // per-neuron rates: the part of the overlap explained by popularity alone.
  double independent_jaccard = 0;
  double residual_rms = 0;         // rms of the residual stream entering the FFN
};
struct SynthReport {
  ModelConfig config;
  std::vector<SynthLayerReport> layers;
  double calibration_seconds = 0;
};

// Resolves the shape and flags into a config (InvalidArgument for impossible combinations, naming the flag).
Result<ModelConfig> SynthConfig(const SynthOptions& options);

// Neuron popularity targets: p(u) = min(kSynthMaxPopularity, A * u^-hot_skew) at u = (rank + 0.5) / n, with A chosen
// so the mean is 1 - sparsity. Index = rank (hottest first). InvalidArgument when the mean cannot be reached.
inline constexpr double kSynthMaxPopularity = 0.98;  // "capped below 1": even the hottest neuron sometimes rests
Result<std::vector<double>> PopularityTargets(int64_t n, double sparsity, double hot_skew);

// Calibrates the FFN offsets layer by layer (simulating the model in f32 on the weights as the file will hold them)
// and returns the model, whose loaders regenerate the weights. `report` (may be null) receives the measurements.
// The returned model's loaders share a thread pool and the calibrated offsets; they stay valid after this returns.
Result<SourceModel> BuildSyntheticModel(const SynthOptions& options, SynthReport* report);

}  // namespace nflash::converter
