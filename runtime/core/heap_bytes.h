// Estimates of the heap a container holds, in glibc malloc's chunks (for the memory budget's accounting of parsed
// metadata and the tokenizer; checked against the allocator's own count in tests).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

namespace nflash {

// The chunk glibc's malloc hands out for a request of n bytes: n plus its 8-byte header, rounded up to 16, at least
// 32; 0 for no request.
inline uint64_t HeapChunk(uint64_t n) { return n == 0 ? 0 : std::max<uint64_t>(32, (n + 8 + 15) & ~uint64_t{15}); }

// The heap a string's buffer takes when it is not stored inline (libstdc++ keeps 15 characters inline).
inline uint64_t StringHeapBytes(const std::string& s) { return s.capacity() > 15 ? HeapChunk(s.capacity() + 1) : 0; }

// A vector's buffer (not what its elements hold).
template <typename Vector>
uint64_t VectorHeapBytes(const Vector& v) {
  return HeapChunk(v.capacity() * sizeof(typename Vector::value_type));
}

// An unordered_map's or unordered_set's nodes and bucket array (libstdc++: a node holds the next pointer, the value
// and, for keys whose hash is not cheap, e.g. strings, the cached hash; one bucket lives inside the container itself).
// Not what the values hold.
template <typename Hashed>
uint64_t HashNodesHeapBytes(const Hashed& h, bool cached_hash) {
  const uint64_t node = sizeof(void*) + sizeof(typename Hashed::value_type) + (cached_hash ? sizeof(size_t) : 0);
  return h.size() * HeapChunk(node) + (h.bucket_count() > 1 ? HeapChunk(h.bucket_count() * sizeof(void*)) : 0);
}

}  // namespace nflash
