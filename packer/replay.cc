// ReplayHeldOut (packer/replay.h): the dense engine's active sets on held-out text, mapped to ffn.bin reads.
#include "packer/replay.h"

#include <algorithm>

#include "runtime/cli/model_loader.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/engine/context.h"

namespace nflash::packer {

Result<ReplayStats> ReplayHeldOut(const Deployment& d, const ReplayOptions& options, ThreadPool* pool) {
  const Manifest& m = d.manifest();
  NF_ASSIGN_OR_RETURN(uint64_t model_hash, HashFile(options.model_path));
  if (HashToHex(model_hash) != m.model_hash) {
    return Status::InvalidArgument(options.model_path + " has xxHash64 " + HashToHex(model_hash) + " but " + d.dir() +
                                   " was packed from a model with " + m.model_hash);
  }
  cli::ModelSource src;
  src.path = options.model_path;
  NF_ASSIGN_OR_RETURN(cli::LoadedModel lm, cli::LoadModelForInference(src));
  NF_ASSIGN_OR_RETURN(auto text_bytes, ReadWholeFile(options.text_path));
  const std::string text(text_bytes.begin(), text_bytes.end());
  std::vector<int32_t> ids = lm.tokenizer->Encode(text, true);
  if (static_cast<int64_t>(ids.size()) > options.tokens) ids.resize(static_cast<size_t>(options.tokens));
  if (ids.empty()) return Status::InvalidArgument(options.text_path + ": no tokens");

  const BundleLayout& l = d.layout();
  ReplayStats st;
  std::vector<uint8_t> touched, touched_cold;
  const float threshold = 0.0f;  // ReLU-family: an active neuron has a non-zero output (act > 0)
  auto account = [&](const RegionInfo& r, const float* act) {
    const auto n_groups = static_cast<size_t>((r.n_neurons + l.slots_per_group - 1) / l.slots_per_group);
    touched.assign(n_groups, 0);
    touched_cold.assign(n_groups, 0);
    for (int64_t k = 0; k < r.n_neurons; ++k) {
      if (!(std::abs(act[k]) > threshold)) continue;
      const int32_t slot = r.slot_of_neuron[static_cast<size_t>(k)];
      const auto g = static_cast<size_t>(slot / l.slots_per_group);
      st.active += 1;
      touched[g] = 1;
      if (slot >= r.hot_count) {
        st.active_cold += 1;
        touched_cold[g] = 1;
      }
    }
    auto runs = [&](const std::vector<uint8_t>& t, double* groups, double* requests) {
      for (size_t g = 0; g < t.size(); ++g) {
        if (!t[g]) continue;
        *groups += 1;
        if (g == 0 || !t[g - 1]) *requests += 1;
      }
    };
    runs(touched, &st.groups, &st.requests);
    runs(touched_cold, &st.groups_cold, &st.requests_cold);
  };
  InferenceContext ctx(*lm.model, pool, options.window);
  ctx.SetFfnObserver([&](const FfnObservation& o) {
    const RegionInfo* r = d.Region(o.layer, o.expert);
    if (!r) return;
    for (int64_t t = 0; t < o.n_tokens; ++t) account(*r, o.gate_act + t * r->n_neurons);
  });
  for (size_t start = 0; start < ids.size(); start += static_cast<size_t>(options.window)) {
    const size_t len = std::min(ids.size() - start, static_cast<size_t>(options.window));
    ctx.Reset();
    NF_RETURN_IF_ERROR(ctx.Eval(std::span<const int32_t>(ids.data() + start, len), false));
  }
  st.tokens = static_cast<int64_t>(ids.size());
  const double n = static_cast<double>(st.tokens);
  for (double* v : {&st.active, &st.active_cold, &st.groups, &st.groups_cold, &st.requests, &st.requests_cold}) *v /= n;
  st.bundle_bytes = st.active * static_cast<double>(l.bundle_bytes);
  st.bundle_bytes_cold = st.active_cold * static_cast<double>(l.bundle_bytes);
  st.read_bytes = st.groups * static_cast<double>(l.group_bytes);
  st.read_bytes_cold = st.groups_cold * static_cast<double>(l.group_bytes);
  return st;
}

}  // namespace nflash::packer
