// Token embedding rows from flash (see flash_embedding.h).
#include "runtime/sparse/flash_embedding.h"

#include <sys/mman.h>

#include <algorithm>

#include "runtime/core/checksum.h"
#include "runtime/core/round.h"

namespace nflash::sparse {

namespace {

// Rows hashed per read at Create: 4 MiB reads keep the one pass over the tensor at the device's streaming speed.
constexpr size_t kCreateReadBytes = size_t{4} << 20;
constexpr uint64_t kBlock = 4096;  // reads at Create start and end on it, so that O_DIRECT needs no bounce buffer

// Anonymous memory for the pass at Create, unmapped at the end: the process's peak RSS must not keep it (heap memory
// freed by the allocator may stay resident).
struct Mapping {
  explicit Mapping(size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~Mapping() {
    if (data != nullptr) ::munmap(data, bytes);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  size_t bytes;
  uint8_t* data = nullptr;
};

}  // namespace

Result<std::unique_ptr<FlashEmbedding>> FlashEmbedding::Create(std::shared_ptr<const ReadableFile> file,
                                                               ByteRange range, int64_t rows, size_t row_bytes) {
  const std::string& path = file->Path();
  if (rows <= 0 || row_bytes == 0 || range.size != static_cast<uint64_t>(rows) * row_bytes) {
    return Status::InvalidArgument(path + ": embedding of " + std::to_string(range.size) + " bytes is not " +
                                   std::to_string(rows) + " rows of " + std::to_string(row_bytes) + " bytes");
  }
  std::unique_ptr<FlashEmbedding> e(new FlashEmbedding());
  e->file_ = std::move(file);
  if (range.offset + range.size > e->file_->Size()) {
    return Status::Corruption(path + ": embedding bytes [" + std::to_string(range.offset) + ", " +
                              std::to_string(range.offset + range.size) + ") end past the file's " +
                              std::to_string(e->file_->Size()) + " bytes");
  }
  e->range_ = range;
  e->rows_ = rows;
  e->row_bytes_ = row_bytes;
  e->hashes_.resize(static_cast<size_t>(rows));
  const int64_t rows_per_read = std::max<int64_t>(1, static_cast<int64_t>(kCreateReadBytes / row_bytes));
  Mapping buf(static_cast<size_t>(rows_per_read) * row_bytes + 2 * kBlock);
  if (buf.data == nullptr) return Status::ResourceExhausted(path + ": cannot map a read buffer for the embedding");
  for (int64_t r = 0; r < rows; r += rows_per_read) {
    const int64_t n = std::min(rows_per_read, rows - r);
    // The rows' bytes widened to whole blocks (up to the file's end).
    const uint64_t first = range.offset + static_cast<uint64_t>(r) * row_bytes;
    const uint64_t begin = first / kBlock * kBlock;
    const uint64_t end = std::min(e->file_->Size(), RoundUp<uint64_t>(first + static_cast<uint64_t>(n) * row_bytes, kBlock));
    NF_RETURN_IF_ERROR(e->file_->ReadAt(begin, static_cast<size_t>(end - begin), buf.data));
    const uint8_t* rows_at = buf.data + (first - begin);
    for (int64_t i = 0; i < n; ++i) e->hashes_[static_cast<size_t>(r + i)] = Xxh3(rows_at + i * row_bytes, row_bytes);
  }
  return e;
}

Status FlashEmbedding::Row(int32_t token, uint8_t* dst) const {
  if (token < 0 || token >= rows_) {
    return Status::InvalidArgument("token id " + std::to_string(token) + " is outside the embedding's " +
                                   std::to_string(rows_) + " rows");
  }
  const uint64_t offset = range_.offset + static_cast<uint64_t>(token) * row_bytes_;
  Status last;
  for (int attempt = 0; attempt < 2; ++attempt) {
    last = file_->ReadAt(offset, row_bytes_, dst);
    if (last.ok() && Xxh3(dst, row_bytes_) == hashes_[static_cast<size_t>(token)]) {
      rows_read_.fetch_add(1, std::memory_order_relaxed);
      return Status::Ok();
    }
  }
  const std::string where = file_->Path() + ": token_embd.weight row " + std::to_string(token) + " at offset " +
                            std::to_string(offset) + " (" + std::to_string(row_bytes_) + " bytes)";
  if (!last.ok()) return last.WithContext(where + ", read twice");
  return Status::Corruption(where + " reads back different from when it was loaded (hash mismatch, read twice)");
}

}  // namespace nflash::sparse
