// Replays held-out activation traces through a deployment's layout: what a reader without a neuron cache would read
// from ffn.bin per token (bytes and requests), to compare neuron orders (hotness vs coactivation) and placements.
// Traces come from running the dense engine with an FfnObserver over held-out text (never calibration text).
#pragma once

#include <cstdint>
#include <string>

#include "packer/deployment.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"

namespace nflash::packer {

struct ReplayOptions {
  std::string model_path;  // the deployment's source model (checked against manifest.model_hash)
  std::string text_path;   // held-out text
  int64_t tokens = 4096;   // tokens replayed (from the start of the text)
  int64_t window = 256;    // the text runs in windows of this many tokens, each from an empty context
};

// Per-token means. "cold": the hot region is resident (prefetched once), only active cold neurons are read; "all":
// every active neuron is read from flash. A reader reads whole slot groups (4 KiB pages for small bundles) and merges
// runs of adjacent groups into one request.
struct ReplayStats {
  int64_t tokens = 0;
  double active = 0, active_cold = 0;               // active neurons per token (all regions)
  double bundle_bytes = 0, bundle_bytes_cold = 0;   // active x bundle_bytes: what is needed
  double read_bytes = 0, read_bytes_cold = 0;       // whole groups touched: what is read
  double requests = 0, requests_cold = 0;           // runs of adjacent groups
  double groups = 0, groups_cold = 0;               // groups touched (requests without merging)
};

Result<ReplayStats> ReplayHeldOut(const Deployment& deployment, const ReplayOptions& options, ThreadPool* pool);

}  // namespace nflash::packer
