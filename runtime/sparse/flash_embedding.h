// Token embedding rows read from flash on demand: a dense model's token_embd.weight (70 MiB for a 7B model in Q4_0)
// is used one row per token, so under a memory budget it serves better as neuron cache than as resident weights.
// Each row is read from the file given (an io::DirectReader: O_DIRECT, bounced when unaligned) and checked against a
// hash taken at Create, when the whole tensor was read once: a row that reads back different is read again once, then
// an error names the file, token and offset.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/status.h"

namespace nflash::sparse {

// Thread-safety: Row may be called from any thread (ReadableFile::ReadAt is thread-safe; the hashes are immutable).
class FlashEmbedding {
 public:
  // `range`: the tensor's bytes in `file`, `rows` rows of `row_bytes` each.
  static Result<std::unique_ptr<FlashEmbedding>> Create(std::shared_ptr<const ReadableFile> file, ByteRange range,
                                                        int64_t rows, size_t row_bytes);

  // Row `token` (< rows) into `dst` (row_bytes).
  Status Row(int32_t token, uint8_t* dst) const;

  int64_t rows() const { return rows_; }
  size_t row_bytes() const { return row_bytes_; }
  // Memory held: the row hashes.
  uint64_t memory_bytes() const { return hashes_.size() * sizeof(uint64_t); }
  // Rows read by Row so far.
  uint64_t rows_read() const { return rows_read_; }

 private:
  FlashEmbedding() = default;
  std::shared_ptr<const ReadableFile> file_;
  ByteRange range_;
  int64_t rows_ = 0;
  size_t row_bytes_ = 0;
  std::vector<uint64_t> hashes_;
  mutable std::atomic<uint64_t> rows_read_{0};
};

}  // namespace nflash::sparse
