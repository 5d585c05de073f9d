// Content hashes: xxHash64 (libxxhash) of buffers and of whole files, and XXH3-64 of buffers. Profiles, deployments
// and plans name the model (or deployment) they were made from by an xxHash64 file hash; deployments checksum every
// neuron bundle part with XXH3-64 (older ones with xxHash64: packer/deployment.h BundleHash).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/core/status.h"

namespace nflash {

uint64_t Xxh64(const void* data, size_t size, uint64_t seed = 0);
// XXH3_64bits (seed 0, default secret) of a buffer: the same value as libxxhash's XXH3_64bits on every machine, computed
// with the widest vector unit the CPU has (AVX-512 / AVX2 / SSE2, chosen at run time by libxxhash's dispatcher, since
// release builds are portable x86-64). On 8 KiB buffers on this machine's EPYC (AVX-512): 4x Xxh64 in cache,
// 1.5x from DRAM where it runs near one core's read bandwidth (runtime/bench/kernel_bench.cc Checksum/*). Thread-safe (the
// dispatcher's one-time CPU detection stores the same pointers from any thread that gets there first).
uint64_t Xxh3(const void* data, size_t size);
// 16 lowercase hex digits.
std::string HashToHex(uint64_t hash);
// xxHash64 of the whole file, streamed in large reads (about 10 GB/s on this machine's cores).
Result<uint64_t> HashFile(const std::string& path);

}  // namespace nflash
