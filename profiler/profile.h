// The model profile written by `nflash profile`: what calibration text did to every FFN neuron of a model, for the
// packer (hot/cold split, ordering), the planner (popularity and cache hit-rate curves) and the predictor trainer.
// Stored as a GGUF container (schema below, documented in docs/profile-format.md): metadata keys "nflash.profile.*" and one
// tensor per array, so `nflash inspect` and any GGUF reader can open it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/status.h"

namespace nflash::profiler {

inline constexpr int kProfileSchemaVersion = 1;
// Points of the popularity and hit-rate curves: x = i / (kCurvePoints - 1) of the layer's neurons, i = 0..16.
inline constexpr int kCurvePoints = 17;

// Points of ModelProfile::lru_hit_rate_shared: x = i / (kSharedCurvePoints - 1) of all FFN neurons of the model.
inline constexpr int kSharedCurvePoints = 65;

// One FFN neuron set: a dense layer's FFN, or one expert of an MoE layer.
struct FfnProfile {
  int64_t layer = 0;
  int64_t expert = -1;  // -1: dense FFN
  int64_t n_neurons = 0;
  // The "active" test this profile used: |act(gate)| > threshold (0 for ReLU / dReLU: the exact zeros).
  float threshold = 0.0f;
  int64_t tokens = 0;  // tokens that ran this FFN (MoE: tokens routed to this expert)
  // Per neuron: tokens on which it was active (batch size 1).
  std::vector<uint32_t> count_bs1;
  // Per neuron: groups of 2 (4) consecutive tokens in which it was active for at least one token (the union a
  // batched decode of 2 (4) sequences would load); groups2/groups4 is the number of groups.
  std::vector<uint32_t> count_bs2, count_bs4;
  int64_t groups2 = 0, groups4 = 0;
  // Distribution over tokens of the active fraction: bin b counts tokens with fraction in [b/20, (b+1)/20).
  std::vector<uint32_t> active_hist;  // 20 bins
  double mean_active_fraction = 0.0;
  // popularity[i]: share of all activations covered by the i/16 most active neurons (popularity[0] = 0, [16] = 1).
  std::vector<float> popularity;
  // popularity_heldout[i]: the same share on tokens the ranking did not see (neurons ranked on one half of the
  // tokens, counted on the other, both ways averaged; HeldOutPopularityCurve): what pinning the i/16 hottest serves
  // on new tokens. Optional (empty in profiles written before it, and for an FFN with fewer than 2 tokens).
  std::vector<float> popularity_heldout;
  // lru_hit_rate[i]: hit rate of an LRU neuron cache holding i/16 of the neurons, replaying the token trace.
  std::vector<float> lru_hit_rate;
  // Gated FFNs: P(|up| contribution non-negligible | gate active) and P(|hidden| * ||down col|| non-negligible |
  // gate active); 1.0 when not measured.
  double up_given_gate = 1.0, down_given_gate = 1.0;
  // Co-activation: per neuron, its top `coact_k` partners by joint activation count (-1 / 0 padding).
  int64_t coact_k = 0;
  std::vector<int32_t> coact_partner;  // n_neurons * coact_k
  std::vector<uint32_t> coact_count;   // n_neurons * coact_k
  // Thresholds on |act(gate)| that give ModelProfile::report_sparsities (same order; empty when none were asked).
  std::vector<float> report_thresholds;
};

struct ModelProfile {
  int schema_version = kProfileSchemaVersion;
  std::string model_hash;   // HashToHex(HashFile(model)) of the GGUF it was made from
  std::string model_name;
  std::string activation;   // silu / relu / drelu
  int64_t n_layers = 0, n_ff = 0, n_experts = 0, dim = 0;
  int64_t tokens = 0;       // calibration tokens run
  std::string text_path;    // calibration text (for the record)
  int64_t ctx = 0;          // window length (tokens) the text was run in
  // What produced the recorded tokens: 0 = the text itself (teacher-forced windows); > 0 = the model's own decode,
  // `decode_tokens` generated tokens per window after a prompt of `decode_prompt_tokens` text tokens (only the
  // generated tokens are recorded: the workload the sparse decode runtime sees). Optional keys; absent = text.
  int64_t decode_tokens = 0;
  int64_t decode_prompt_tokens = 0;
  double decode_temperature = 0.0;  // 0: greedy
  double target_sparsity = 0.0;  // silu: the sparsity the thresholds were calibrated for (0 for relu / drelu)
  std::vector<float> report_sparsities;  // sparsities of FfnProfile::report_thresholds
  std::vector<FfnProfile> ffns;  // layer-major, experts in order
  // lru_hit_rate_shared[i]: hit rate of one LRU cache shared by every FFN (a key per FFN and neuron) holding
  // i / (kSharedCurvePoints - 1) of all FFN neurons, replaying the tokens in decode order (each token's FFNs layer by
  // layer, experts ascending): the runtime's shared cold pool. Unlike the per-FFN curves it sees which FFNs a stretch of
  // tokens uses (MoE routing follows the sequence). Optional (empty in profiles written before it).
  std::vector<float> lru_hit_rate_shared;
  // The FFN of (layer, expert), or nullptr.
  const FfnProfile* Find(int64_t layer, int64_t expert = -1) const;
  // The share of the calibration tokens that ran `f`: an expert's tokens over the profile's; 1 for a dense FFN (or
  // a profile of no tokens).
  double RoutedShare(const FfnProfile& f) const {
    return f.expert >= 0 && tokens > 0 ? static_cast<double>(f.tokens) / static_cast<double>(tokens) : 1.0;
  }
};

// Writes atomically (temporary name, rename); refuses to overwrite unless `overwrite`.
Status SaveProfile(const ModelProfile& profile, const std::string& path, bool overwrite);
// Reads and validates (schema version, array sizes); errors name the file and the field.
Result<ModelProfile> LoadProfile(const std::string& path);
// The same from a file already open (messages name file->Path()), e.g. one read into memory without the page cache.
Result<ModelProfile> LoadProfile(std::shared_ptr<const ReadableFile> file);
// Error (naming both hashes) unless the profile was made from the model whose hash is `model_hash`.
Status CheckProfileForModel(const ModelProfile& profile, const std::string& model_hash, const std::string& model_path);

}  // namespace nflash::profiler
