// Kernel front end: validates views, picks the ISA, quantizes activations and splits work over the thread pool.
#include "runtime/core/kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "runtime/core/file.h"
#include "runtime/core/kernels_internal.h"
#include "runtime/core/round.h"

namespace nflash {
namespace {

using internal::IsaKernels;
using internal::RowSet;
using internal::TokenSet;

// Work per chunk in weight bytes. Threads take chunks dynamically, so a thread slowed by another process (or a
// slower core) does less; the size keeps the atomic counter and the prefetch restart at each chunk's first tile
// negligible.
constexpr int64_t kMinChunkBytes = 256 * 1024;
// Rows per chunk are a multiple of this, so chunks start on micro-tile boundaries (4 rows) with room to spare.
constexpr int64_t kRowGrain = 16;
// AccumulateRows splits columns in multiples of 256: a multiple of the 32-element block, and 1 KiB of y per grain so
// two threads never write the same cache line.
constexpr int64_t kColGrain = 256;

bool DetectAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool DetectAvx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // __builtin_cpu_supports also checks that the OS saves the zmm state (XCR0)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

std::atomic<KernelIsa>& IsaState() {
  static std::atomic<KernelIsa> isa{BestKernelIsa()};
  return isa;
}

const IsaKernels& Kernels() {
  switch (IsaState().load(std::memory_order_relaxed)) {
    case KernelIsa::kAvx512:
      return internal::kAvx512Kernels;
    case KernelIsa::kAvx2:
      return internal::kAvx2Kernels;
    case KernelIsa::kScalar:
      break;
  }
  return internal::kScalarKernels;
}

// A broken caller invariant (the runtime validates matrices when it loads them): report and abort.
[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "nflash kernels: %s\n", msg.c_str());
  std::abort();
}

void CheckOrDie(const Status& s) {
  if (!s.ok()) Die(s.ToString());
}

bool IsQuantized(GgmlType type) { return type == GgmlType::kQ8_0 || type == GgmlType::kQ4_0; }

TokenSet Tokens(const MatrixView& w, const Activation& x) {
  CheckOrDie(ValidateMatrix(w, "weights"));
  if (x.cols() != w.cols) {
    Die("activation has " + std::to_string(x.cols()) + " columns, weights have " + std::to_string(w.cols));
  }
  if (IsQuantized(w.type) && x.q8() == nullptr && x.n() > 0) Die("quantized weights need a Q8_0 activation");
  return TokenSet{x.f32(), x.q8(), x.n(), x.cols()};
}

// Calls fn(begin, end) for consecutive chunks of `chunk` items of [0, n), handed out on demand to the pool's threads.
// Which thread computes a chunk varies; what it computes does not (see IsaKernels), so results stay deterministic.
template <typename Fn>
void ForEachChunk(ThreadPool* pool, int64_t n, int64_t chunk, const Fn& fn) {
  if (n <= chunk) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  pool->ParallelFor(pool->NumThreads(), 1, [&](int64_t, int64_t, int) {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
      if (begin >= n) return;
      fn(begin, std::min(n, begin + chunk));
    }
  });
}

// Rows per chunk so that a chunk streams at least kMinChunkBytes, rounded to the row grain.
int64_t RowGrain(const MatrixView& w, int64_t n_tokens) {
  const int64_t bytes = static_cast<int64_t>(w.row_bytes) * std::max<int64_t>(1, n_tokens);
  const int64_t rows = std::max<int64_t>(1, kMinChunkBytes / std::max<int64_t>(1, bytes));
  return RoundUp<int64_t>(rows, kRowGrain);
}

void DotRowsParallel(const MatrixView& w, const RowSet& rs, int64_t count, const TokenSet& x, float* y,
                     int64_t y_stride, ThreadPool* pool) {
  if (count <= 0 || x.n <= 0) return;
  const IsaKernels& k = Kernels();
  if (pool == nullptr || pool->NumThreads() == 1) {
    k.dot_rows(w.type, rs, 0, count, x, y, y_stride);
    return;
  }
  ForEachChunk(pool, count, RowGrain(w, x.n), [&](int64_t begin, int64_t end) {
    k.dot_rows(w.type, rs, begin, end, x, y, y_stride);
  });
}

void CheckRows(const MatrixView& w, std::span<const int32_t> rows) {
  for (int32_t r : rows) {
    if (r < 0 || r >= w.rows) {
      Die("row index " + std::to_string(r) + " out of range [0, " + std::to_string(w.rows) + ")");
    }
  }
}

void AccumulateRowSet(const MatrixView& w, const RowSet& rs, int64_t count, const float* a, float* y,
                      ThreadPool* pool) {
  if (count == 0) return;
  const IsaKernels& k = Kernels();
  // Columns per chunk so that a chunk streams at least kMinChunkBytes of the selected rows.
  const int64_t bytes_per_col = std::max<int64_t>(1, static_cast<int64_t>(w.row_bytes) * count / w.cols);
  const int64_t min_cols = std::max<int64_t>(1, kMinChunkBytes / bytes_per_col);
  const int64_t grain = RoundUp<int64_t>(min_cols, kColGrain);
  if (pool == nullptr || pool->NumThreads() == 1 || w.cols <= grain) {
    k.accumulate(w.type, rs, count, a, 0, w.cols, y);
    return;
  }
  // Static contiguous column ranges, one per thread: dynamic 256-column chunks would cut every selected row into
  // short scattered pieces that defeat the prefetchers (measured 2x slower on 2 threads).
  pool->ParallelFor(w.cols, grain, [&](int64_t begin, int64_t end, int) {
    k.accumulate(w.type, rs, count, a, begin, end, y);
  });
}

}  // namespace

MatrixView DenseMatrix(GgmlType type, const void* data, int64_t rows, int64_t cols) {
  const auto bytes = RowBytes(type, static_cast<uint64_t>(std::max<int64_t>(cols, 0)));
  return MatrixView{type, data, rows, cols, bytes ? static_cast<size_t>(*bytes) : 0};
}

Status ValidateMatrix(const MatrixView& w, const char* name) {
  switch (w.type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
      break;
    default:
      return Status::Unsupported(std::string(name) + ": type " + std::string(GgmlTypeName(w.type)) +
                                 " has no kernel (expected f32, f16, bf16, q8_0 or q4_0)");
  }
  if (w.cols <= 0 || w.rows < 0) {
    return Status::InvalidArgument(std::string(name) + ": shape " + std::to_string(w.rows) + " x " +
                                   std::to_string(w.cols) + " (expected rows >= 0, cols > 0)");
  }
  const auto bytes = RowBytes(w.type, static_cast<uint64_t>(w.cols));
  if (!bytes) {
    return Status::InvalidArgument(std::string(name) + ": " + std::to_string(w.cols) +
                                   " columns is not a multiple of the block size of " +
                                   std::string(GgmlTypeName(w.type)));
  }
  if (w.row_bytes < *bytes) {
    return Status::InvalidArgument(std::string(name) + ": row_bytes " + std::to_string(w.row_bytes) + " < " +
                                   std::to_string(*bytes) + " needed by " + std::to_string(w.cols) + " " +
                                   std::string(GgmlTypeName(w.type)) + " elements");
  }
  if (w.rows > 0 && w.data == nullptr) return Status::InvalidArgument(std::string(name) + ": null data");
  return Status::Ok();
}

bool CpuHasAvx2() {
  static const bool has = DetectAvx2();
  return has;
}

uint64_t ParseCacheSize(const std::string& text) {
  size_t end = 0;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  if (end == 0 || end > 12) return 0;
  const uint64_t n = std::stoull(text.substr(0, end));
  std::string rest = text.substr(end);
  while (!rest.empty() && (rest.back() == '\n' || rest.back() == ' ')) rest.pop_back();
  if (rest.empty()) return n;
  if (rest == "K") return n << 10;
  if (rest == "M") return n << 20;
  if (rest == "G") return n << 30;
  return 0;
}

uint64_t LastLevelCacheBytes() {
  static const uint64_t bytes = [] {
    uint64_t best = 0;
    int best_level = 0;
    for (int i = 0; i < 16; ++i) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
      const std::string level = ReadKernelWord(dir + "level");
      if (level.empty()) break;
      const std::string type = ReadKernelWord(dir + "type");
      if (type != "Data" && type != "Unified") continue;
      const int l = std::atoi(level.c_str());
      const uint64_t size = ParseCacheSize(ReadKernelWord(dir + "size"));
      if (size > 0 && l >= best_level) {
        best_level = l;
        best = size;
      }
    }
    return best;
  }();
  return bytes;
}

bool CpuHasAvx512() {
  // The AVX-512 file also uses FMA/F16C and forwards float types to the AVX2 kernels.
  static const bool has = CpuHasAvx2() && DetectAvx512();
  return has;
}

KernelIsa BestKernelIsa() {
  if (CpuHasAvx512()) return KernelIsa::kAvx512;
  return CpuHasAvx2() ? KernelIsa::kAvx2 : KernelIsa::kScalar;
}

KernelIsa ActiveIsa() { return IsaState().load(std::memory_order_relaxed); }

bool SetKernelIsa(KernelIsa isa) {
  if (isa == KernelIsa::kAvx2 && !CpuHasAvx2()) return false;
  if (isa == KernelIsa::kAvx512 && !CpuHasAvx512()) return false;
  IsaState().store(isa, std::memory_order_relaxed);
  return true;
}

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return "avx512";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kScalar:
      break;
  }
  return "scalar";
}

void Activation::Set(const float* x, int64_t n, int64_t cols, bool quantize) {
  x_ = x;
  n_ = n;
  cols_ = cols;
  q8_.clear();
  if (!quantize || cols % kQBlock != 0 || n <= 0) return;
  const int64_t nb = cols / kQBlock;
  q8_.resize(static_cast<size_t>(n * nb));
  const auto quantize_row = Kernels().quantize_q8;
  for (int64_t t = 0; t < n; ++t) quantize_row(x + t * cols, q8_.data() + t * nb, cols);
}

uint64_t TouchCacheLines(const void* p, size_t n) {
  const auto* b = static_cast<const volatile uint8_t*>(p);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {  // four independent loads per step: the misses overlap
    s0 += b[i];
    s1 += b[i + 64];
    s2 += b[i + 128];
    s3 += b[i + 192];
  }
  for (; i < n; i += 64) s0 += b[i];
  return s0 + s1 + s2 + s3;
}

float RowDot(const MatrixView& w, int64_t row, const Activation& x, int64_t token) {
  const TokenSet all = Tokens(w, x);
  if (row < 0 || row >= w.rows || token < 0 || token >= x.n()) {
    Die("RowDot: row " + std::to_string(row) + " / token " + std::to_string(token) + " out of range");
  }
  const TokenSet one{all.f32 ? all.f32 + token * all.cols : nullptr,
                     all.q8 ? all.q8 + token * (all.cols / kQBlock) : nullptr, 1, all.cols};
  const RowSet rs{static_cast<const uint8_t*>(w.data) + static_cast<size_t>(row) * w.row_bytes, w.row_bytes, nullptr};
  float y = 0.0f;
  Kernels().dot_rows(w.type, rs, 0, 1, one, &y, 1);
  return y;
}

void Gemv(const MatrixView& w, const float* x, float* y, ThreadPool* pool) {
  Activation a(x, 1, w.cols);
  Gemv(w, a, y, pool);
}

void Gemv(const MatrixView& w, const Activation& x, float* y, ThreadPool* pool) {
  if (x.n() != 1) Die("Gemv: activation has " + std::to_string(x.n()) + " tokens, expected 1");
  Gemm(w, x, y, pool);
}

void Gemm(const MatrixView& w, const float* x, int64_t n, float* y, ThreadPool* pool) {
  Activation a(x, n, w.cols);
  Gemm(w, a, y, pool);
}

void Gemm(const MatrixView& w, const Activation& x, float* y, ThreadPool* pool) {
  const TokenSet ts = Tokens(w, x);
  const RowSet rs{static_cast<const uint8_t*>(w.data), w.row_bytes, nullptr};
  DotRowsParallel(w, rs, w.rows, ts, y, w.rows, pool);
}

void GemmMany(std::span<const MatrixView> ws, const Activation& x, std::span<float* const> ys, ThreadPool* pool) {
  if (ws.size() != ys.size()) Die("GemmMany: " + std::to_string(ws.size()) + " matrices, " +
                                  std::to_string(ys.size()) + " outputs");
  int64_t total = 0;
  MatrixView widest;
  for (const MatrixView& w : ws) {
    Tokens(w, x);
    total += w.rows;
    if (w.row_bytes >= widest.row_bytes) widest = w;
  }
  if (total == 0 || x.n() <= 0) return;
  const IsaKernels& k = Kernels();
  const TokenSet ts = Tokens(ws[0], x);
  // Rows [begin, end) of the matrices stacked in order: each overlapped matrix computes its part.
  auto run = [&](int64_t begin, int64_t end) {
    int64_t first = 0;
    for (size_t i = 0; i < ws.size() && begin < end; ++i) {
      const MatrixView& w = ws[i];
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + w.rows);
      if (lo < hi) {
        const RowSet rs{static_cast<const uint8_t*>(w.data), w.row_bytes, nullptr};
        k.dot_rows(w.type, rs, lo - first, hi - first, ts, ys[i], w.rows);
      }
      first += w.rows;
    }
  };
  if (pool == nullptr || pool->NumThreads() == 1) {
    run(0, total);
    return;
  }
  ForEachChunk(pool, total, RowGrain(widest, x.n()), run);
}

void GemvRows(const MatrixView& w, std::span<const int32_t> rows, const float* x, float* y, ThreadPool* pool) {
  Activation a(x, 1, w.cols);
  GemvRows(w, rows, a, y, pool);
}

void GemvRows(const MatrixView& w, std::span<const int32_t> rows, const Activation& x, float* y, ThreadPool* pool) {
  const TokenSet ts = Tokens(w, x);
  CheckRows(w, rows);
  const RowSet rs{static_cast<const uint8_t*>(w.data), w.row_bytes, rows.data()};
  const int64_t count = static_cast<int64_t>(rows.size());
  DotRowsParallel(w, rs, count, ts, y, count, pool);
}

void AccumulateRows(const MatrixView& w, std::span<const int32_t> rows, const float* a, float* y, ThreadPool* pool) {
  CheckOrDie(ValidateMatrix(w, "weights"));
  CheckRows(w, rows);
  const RowSet rs{static_cast<const uint8_t*>(w.data), w.row_bytes, rows.data()};
  AccumulateRowSet(w, rs, static_cast<int64_t>(rows.size()), a, y, pool);
}

namespace {

// `shape` with data and rows describing `rows` (for the checks and the chunking arithmetic).
MatrixView PointerShape(const MatrixView& shape, std::span<const uint8_t* const> rows) {
  MatrixView w = shape;
  w.data = rows.empty() ? nullptr : rows[0];
  w.rows = static_cast<int64_t>(rows.size());
  for (const uint8_t* p : rows) {
    if (p == nullptr) Die("a row pointer is null");
  }
  return w;
}

}  // namespace

void GemvRowPtrs(const MatrixView& shape, std::span<const uint8_t* const> rows, const Activation& x, float* y,
                 ThreadPool* pool) {
  const MatrixView w = PointerShape(shape, rows);
  const TokenSet ts = Tokens(w, x);
  const RowSet rs{nullptr, w.row_bytes, nullptr, rows.data()};
  DotRowsParallel(w, rs, w.rows, ts, y, w.rows, pool);
}

void AccumulateRowPtrs(const MatrixView& shape, std::span<const uint8_t* const> rows, const float* a, float* y,
                       ThreadPool* pool) {
  const MatrixView w = PointerShape(shape, rows);
  CheckOrDie(ValidateMatrix(w, "weights"));
  const RowSet rs{nullptr, w.row_bytes, nullptr, rows.data()};
  AccumulateRowSet(w, rs, w.rows, a, y, pool);
}

}  // namespace nflash
