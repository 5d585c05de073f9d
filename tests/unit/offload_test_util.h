// Shared by the offload test suites: a ReLU profile counted from a dense run, to pack test deployments from.
#pragma once

#include <string>
#include <utility>

#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"

namespace nflash::sparse {

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

}  // namespace nflash::sparse
