// Full integrity check of a deployment directory (`nflash verify`): manifest, sizes, resident/predictor hashes, every
// bundle's checksums and the zero padding of ffn.bin.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/core/status.h"

namespace nflash::packer {

struct VerifyReport {
  int64_t regions = 0, bundles = 0;
  uint64_t flash_bytes = 0;
  double seconds = 0.0;
};

// Opens `dir` (Deployment::Open with the resident hash check) and reads ffn.bin once, region by region. The first
// problem is returned as Corruption naming the file, layer (expert), neuron, slot and byte offset.
Result<VerifyReport> VerifyDeployment(const std::string& dir, bool progress);

}  // namespace nflash::packer
