// Shared by the offload test suites: small synthetic test models, and a ReLU profile counted from a dense run, to
// pack test deployments from.
#pragma once

#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "converter/readers.h"
#include "converter/synth.h"
#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"
#include "tests/test_util.h"

namespace nflash::sparse {

// A SparseRuntimeOptions::wrap_flash that puts a FaultInjectingFile around the flash file and stores it in *fi (which
// must outlive the runtime's opening), for the test to add fault rules to; `first`, when given, is in place before
// the runtime's first read (the reads made while opening).
inline std::function<std::shared_ptr<const ReadableFile>(std::shared_ptr<const ReadableFile>)> WrapWithFaults(
    FaultInjectingFile** fi, std::optional<FaultInjectingFile::Rule> first = std::nullopt) {
  return [fi, first](std::shared_ptr<const ReadableFile> base) -> std::shared_ptr<const ReadableFile> {
    auto f = std::make_shared<FaultInjectingFile>(std::move(base));
    if (first) f->AddRule(*first);
    *fi = f.get();
    return f;
  };
}

// stories260K-relu (../shared, with its tokenizer and the ReLU activation) written to `path` as an F32 GGUF.
inline Status WriteStoriesReluF32(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto src,
                      converter::ReadLlama2c(testing::SharedPath("models/stories260K-relu/stories260K-relu.bin"),
                                             testing::SharedPath("models/stories260K/tok512.bin"), FfnActivation::kRelu));
  converter::WriteOptions wo;
  wo.path = path;
  wo.type = GgmlType::kF32;
  wo.progress = false;
  return converter::WriteModelGguf(src, wo);
}

// A synthetic model of the shape in `so` (shape "custom", dim, ffn, layers, heads, vocab, context, type), calibrated on
// 2 short sequences on one thread (fast; the tests need its shape, not its statistics), written to `path` in
// so.type and loaded from there.
inline Result<std::unique_ptr<Model>> WriteSyntheticModel(converter::SynthOptions so, const std::string& path) {
  so.calib_sequences = 2;
  so.calib_tokens = 8;
  so.threads = 1;
  NF_ASSIGN_OR_RETURN(auto synth, converter::BuildSyntheticModel(so, nullptr));
  converter::WriteOptions wo;
  wo.path = path;
  wo.type = so.type;
  wo.progress = false;
  wo.threads = 1;
  NF_RETURN_IF_ERROR(converter::WriteModelGguf(synth, wo));
  return Model::Load(path, LoadOptions{});
}

// A rank-8 predictor of N(0, 0.3) weights drawn from `rng` (what it predicts does not matter to these tests, only that
// the runtimes compared use the same one; such weights guess about half the neurons), recorded for the model file
// `model_path` of hyper-parameters `hp`, saved to `out_path`.
inline Status WriteRandomPredictor(const std::string& model_path, const LlamaHparams& hp, std::mt19937* rng,
                                   const std::string& out_path) {
  PredictorData pd;
  NF_ASSIGN_OR_RETURN(uint64_t hash, HashFile(model_path));
  pd.model_hash = HashToHex(hash);
  pd.model_name = hp.name;
  pd.activation = "relu";
  pd.dim = hp.dim;
  pd.n_ff = hp.n_ff;
  constexpr int64_t kRank = 8;
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    PredictorLayerData ld;
    ld.fc1.resize(static_cast<size_t>(kRank * hp.dim));
    ld.fc2.resize(static_cast<size_t>(hp.n_ff * kRank));
    for (float& w : ld.fc1) w = normal(*rng);
    for (float& w : ld.fc2) w = normal(*rng);
    ld.info.rank = kRank;
    pd.layers.push_back(std::move(ld));
  }
  return SavePredictor(pd, out_path, false);
}

// A profile of `model_path` (hash, shape, zero counts) for CountActivations to fill.
inline profiler::ModelProfile EmptyReluProfile(const std::string& model_path, const LlamaHparams& hp) {
  profiler::ModelProfile prof;
  prof.model_hash = HashToHex(HashFile(model_path).value());
  prof.model_name = hp.name;
  prof.activation = "relu";
  prof.n_layers = hp.n_layers;
  prof.n_ff = hp.n_ff;
  prof.dim = hp.dim;
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    profiler::FfnProfile f;
    f.layer = l;
    f.n_neurons = hp.n_ff;
    f.count_bs1.assign(static_cast<size_t>(hp.n_ff), 0);
    prof.ffns.push_back(std::move(f));
  }
  return prof;
}

// An observer counting, per layer and neuron, the tokens on which the ReLU gate fired (into `prof`, which must
// outlive the context it observes).
inline FfnObserver CountActivations(profiler::ModelProfile* prof, int64_t n_ff) {
  return [prof, n_ff](const FfnObservation& o) {
    auto& f = prof->ffns[static_cast<size_t>(o.layer)];
    for (int64_t t = 0; t < o.n_tokens; ++t) {
      for (int64_t i = 0; i < n_ff; ++i) f.count_bs1[static_cast<size_t>(i)] += o.gate_act[t * n_ff + i] > 0.0f;
      f.tokens += 1;
    }
  };
}

// After CountActivations: the profile's token count and each FFN's mean active fraction, as the profiler derives it
// (the mean over tokens of the active share).
inline void FinishCounts(profiler::ModelProfile* prof) {
  prof->tokens = prof->ffns.at(0).tokens;
  for (profiler::FfnProfile& f : prof->ffns) {
    const double active = std::accumulate(f.count_bs1.begin(), f.count_bs1.end(), 0.0);
    f.mean_active_fraction = f.tokens > 0 ? active / static_cast<double>(f.tokens * f.n_neurons) : 0.0;
  }
}

}  // namespace nflash::sparse
