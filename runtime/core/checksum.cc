#include "runtime/core/checksum.h"

#include <xxhash.h>
#if defined(__x86_64__)
// Declares XXH3_64bits_dispatch. Debian's libxxhash is built with xxh_x86dispatch.c and exports it; a libxxhash built
// from upstream's Makefile without DISPATCH=1 does not (the link then fails on this symbol). The replace macros are
// turned off so that every call below says which entry point it uses.
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#endif

#include <cstdio>
#include <memory>
#include <vector>

#include "runtime/core/file.h"

namespace nflash {

uint64_t Xxh64(const void* data, size_t size, uint64_t seed) { return XXH64(data, size, seed); }

uint64_t Xxh3(const void* data, size_t size) {
#if defined(__x86_64__)
  // The plain XXH3_64bits of Debian's libxxhash 0.8.1 measured 3.7 GiB/s here on 8 KiB (below XXH64's 17 GiB/s); the
  // dispatch entry picks the AVX2 or AVX-512 loop once (cpuid) and calls it through a pointer (69 GiB/s on 8 KiB in
  // cache). Same result either way (tests/unit/packer_test.cc ChecksumTest).
  return XXH3_64bits_dispatch(data, size);
#else
  return XXH3_64bits(data, size);
#endif
}

std::string HashToHex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

Result<uint64_t> HashFile(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenPreadFile(path));
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  if (!state) return Status::Internal("XXH64_createState failed");
  XXH64_reset(state.get(), 0);
  constexpr size_t kChunk = 8u << 20;
  std::vector<uint8_t> buf(kChunk);
  const uint64_t size = file->Size();
  for (uint64_t off = 0; off < size; off += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, size - off));
    NF_RETURN_IF_ERROR(file->ReadAt(off, n, buf.data()));
    XXH64_update(state.get(), buf.data(), n);
  }
  return static_cast<uint64_t>(XXH64_digest(state.get()));
}

}  // namespace nflash
