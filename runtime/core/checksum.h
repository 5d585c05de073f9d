// Content hashes: xxHash64 (libxxhash) of buffers and of whole files. Profiles, deployments and plans name the model
// (or deployment) they were made from by such a hash, and the packer checksums page runs with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/core/status.h"

namespace nflash {

uint64_t Xxh64(const void* data, size_t size, uint64_t seed = 0);
// 16 lowercase hex digits.
std::string HashToHex(uint64_t hash);
// xxHash64 of the whole file, streamed in large reads (about 10 GB/s on this machine's cores).
Result<uint64_t> HashFile(const std::string& path);

}  // namespace nflash
