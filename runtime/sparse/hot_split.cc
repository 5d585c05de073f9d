// The cache split without a plan: all pinned or all LRU, by the deployment's profile (hot_split.h).
#include "runtime/sparse/hot_split.h"

#include <cstdio>
#include <filesystem>
#include <memory>

#include "planner/model_params.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/sparse/memory_budget.h"

namespace nflash::sparse {

namespace {

std::string Share(double v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.3f", v);
  return buf;
}

}  // namespace

HotSplitChoice DefaultHotSplit(const std::string& reason) {
  HotSplitChoice c;
  c.hot_fraction = kDefaultHotFraction;
  c.why = reason + ": the default hot fraction " + Share(kDefaultHotFraction);
  return c;
}

Result<HotSplitChoice> ChooseHotSplit(const profiler::ModelProfile& profile, const packer::Manifest& manifest,
                                      const std::vector<int64_t>& pinned_neurons, int64_t lru_slots,
                                      bool every_neuron) {
  if (pinned_neurons.size() != manifest.regions.size()) {
    return Status::InvalidArgument("pinned neurons given for " + std::to_string(pinned_neurons.size()) +
                                   " groups, the deployment has " + std::to_string(manifest.regions.size()));
  }
  double weight = 0, pinned = 0, lru_own = 0;
  int64_t neurons = 0;
  for (size_t g = 0; g < manifest.regions.size(); ++g) {
    neurons += manifest.regions[g].n_neurons;
  }
  const double x_lru = neurons > 0 ? static_cast<double>(lru_slots) / static_cast<double>(neurons) : 0.0;
  for (size_t g = 0; g < manifest.regions.size(); ++g) {
    const packer::RegionInfo& r = manifest.regions[g];
    const profiler::FfnProfile* fp = profile.Find(r.layer, r.expert);
    if (fp == nullptr || fp->n_neurons != r.n_neurons) {
      return Status::InvalidArgument("profile: no FFN of " + std::to_string(r.n_neurons) + " neurons for layer " +
                                     std::to_string(r.layer) + ", expert " + std::to_string(r.expert));
    }
    if (fp->popularity.size() < 2 || fp->lru_hit_rate.size() < 2) {
      return Status::InvalidArgument("profile: layer " + std::to_string(r.layer) + ", expert " +
                                     std::to_string(r.expert) + " lacks its popularity / LRU hit-rate curves");
    }
    if (r.n_neurons <= 0) continue;
    // Active neurons per token: the profile's share of the group's runs times the share of tokens that run it.
    const double active = (every_neuron ? 1.0 : fp->mean_active_fraction) * profile.RoutedShare(*fp) *
                          static_cast<double>(r.n_neurons);
    const double x_pinned =
        std::min(1.0, static_cast<double>(pinned_neurons[g]) / static_cast<double>(r.n_neurons));
    planner::Curve lru = planner::CurveFrom(fp->lru_hit_rate);
    // The replay counts each neuron's first touch as a miss; a cache that holds the whole group has none in a steady
    // decode (as ModelParamsFromDeployment).
    lru.y.back() = 1.0;
    weight += active;
    pinned += active * (every_neuron ? x_pinned : planner::PlanningPopularity(*fp).At(x_pinned));
    lru_own += active * (every_neuron ? std::min(1.0, x_lru) : lru.At(x_lru));
  }
  if (weight <= 0) return DefaultHotSplit("the profile counts no active neurons");
  HotSplitChoice c;
  c.served_pinned = pinned / weight;
  const bool shared = !every_neuron && profile.lru_hit_rate_shared.size() >= 2;
  if (shared) {
    planner::Curve pool = planner::CurveFrom(profile.lru_hit_rate_shared);
    pool.y.back() = 1.0;
    c.served_lru = pool.At(x_lru);
  } else {
    c.served_lru = lru_own / weight;
  }
  // Ties: pinned (the planner's rule; a pinned region needs no per-token bookkeeping).
  c.hot_fraction = c.served_pinned >= c.served_lru ? 1.0 : 0.0;
  c.why = std::string("cache all ") + (c.hot_fraction > 0 ? "pinned hot" : "one LRU pool") +
          ": by the profile, pinning serves " + Share(c.served_pinned) + " of the active neurons, one LRU pool of " +
          std::to_string(lru_slots) + " slots " + Share(c.served_lru) + (shared ? " (shared-pool curve)" : " (per-layer curves)");
  return c;
}

HotSplitChoice AutoHotSplit(const packer::Deployment& deployment, const std::vector<int64_t>& pinned_neurons,
                            int64_t lru_slots, bool every_neuron) {
  const std::string path = deployment.dir() + "/" + packer::kProfileFileName;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return DefaultHotSplit("no " + path + " to choose the cache split by");
  // Read once, hashed and parsed from memory, and never through the page cache: nothing of the deployment is kept
  // there (it would be memory outside the budget; docs/runtime.md "Memory budget").
  Result<std::unique_ptr<ReadableFile>> uncached = OpenUncachedPreadFile(path);
  if (!uncached.ok()) return DefaultHotSplit(uncached.status().ToString());
  std::vector<uint8_t> bytes(static_cast<size_t>((*uncached)->Size()));
  if (Status read = (*uncached)->ReadAt(0, bytes.size(), bytes.data()); !read.ok()) {
    return DefaultHotSplit(read.ToString());
  }
  const std::string hash = HashToHex(Xxh64(bytes.data(), bytes.size()));  // HashFile's value
  if (hash != deployment.manifest().profile_hash) {
    return DefaultHotSplit(path + " hashes to " + hash + ", manifest.json field 'profile_hash' is " +
                    deployment.manifest().profile_hash);
  }
  Result<profiler::ModelProfile> profile =
      profiler::LoadProfile(std::make_shared<const MemoryFile>(path, std::move(bytes)));
  if (!profile.ok()) return DefaultHotSplit(profile.status().ToString());
  Result<HotSplitChoice> c = ChooseHotSplit(*profile, deployment.manifest(), pinned_neurons, lru_slots, every_neuron);
  if (!c.ok()) return DefaultHotSplit(path + ": " + c.status().ToString());
  return *c;
}

}  // namespace nflash::sparse
