// Compute kernels of the runtime: dense and row-sparse matrix-vector / matrix-matrix products over F32, F16, BF16,
// Q8_0 and Q4_0 weights, with a scalar path, an AVX2 path and an AVX-512 path (Q4_0/Q8_0 dots and the row
// accumulation of every type; the other dots as AVX2) chosen at run time. AccumulateRows gives bit-identical results
// under AVX2 and AVX-512 (the same fma per element, rows in order); the scalar path rounds differently (mul then add).
//
// Numerics (as llama.cpp): Q8_0/Q4_0 weights are multiplied with the activation quantized to Q8_0 by
// QuantizeRowQ8_0 (integer dot per block of 32, scaled by d_w * d_x in float); F32/F16/BF16 weights with the float
// activation. Results are deterministic: every output element is computed by one thread in a fixed order, so it does
// not depend on the thread count or on how rows are partitioned, and Gemm gives bit-for-bit the same values as Gemv
// for each token (same ISA). The ISAs agree with each other to rounding, not bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/core/ggml_type.h"
#include "runtime/core/quant.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"

namespace nflash {

// A row-major weight matrix in memory (often a mapped GGUF tensor). Row r starts at data + r * row_bytes.
struct MatrixView {
  GgmlType type = GgmlType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;  // >= RowBytes(type, cols); larger for padded rows
};

// Builds a view of densely packed rows (row_bytes = RowBytes(type, cols)).
MatrixView DenseMatrix(GgmlType type, const void* data, int64_t rows, int64_t cols);

// Checks that the kernels accept `w`: type F32/F16/BF16/Q8_0/Q4_0, cols > 0 and a multiple of the block size,
// row_bytes large enough, data set when rows > 0. The kernels themselves abort on a view that fails this check.
Status ValidateMatrix(const MatrixView& w, const char* name);

enum class KernelIsa { kScalar, kAvx2, kAvx512 };
// True when the CPU has AVX2, FMA and F16C (all three are needed by the AVX2 path).
bool CpuHasAvx2();
// True when the CPU (and OS) has AVX-512 F, BW, VL and VNNI plus everything CpuHasAvx2 needs.
bool CpuHasAvx512();
// Bytes of the CPU's last-level cache as seen by CPU 0 (the highest-level data or unified cache in
// /sys/devices/system/cpu/cpu0/cache), 0 when unknown. Shared by all cores of that cache.
uint64_t LastLevelCacheBytes();
// A sysfs cache size ("32768K", "1M", "512"), in bytes; 0 when malformed.
uint64_t ParseCacheSize(const std::string& text);
// The fastest ISA this CPU runs: kAvx512, else kAvx2, else kScalar. ActiveIsa() starts as this.
KernelIsa BestKernelIsa();
// The ISA used by every kernel call from now on; the best the CPU supports unless changed by SetKernelIsa.
KernelIsa ActiveIsa();
// Forces an ISA (tests and comparisons). Returns false, changing nothing, when the CPU cannot run it.
// Not synchronized with running kernels: call it while no kernel is running.
bool SetKernelIsa(KernelIsa isa);
const char* KernelIsaName(KernelIsa isa);

// `n` tokens of `cols` floats (row-major) in the forms the weight types consume: the floats themselves (for
// F32/F16/BF16 weights) and, when cols is a multiple of 32, their Q8_0 quantization (for Q8_0/Q4_0 weights), so that
// several matrices multiplied with the same input share one quantization.
// Thread-safety: Set must not run concurrently with anything else on the object; const methods may run concurrently.
class Activation {
 public:
  Activation() = default;
  Activation(const float* x, int64_t n, int64_t cols) { Set(x, n, cols); }
  // Views x (not copied: it must stay valid and unchanged while this object is used) and quantizes it. Reuses the
  // object's buffer, so one Activation per layer input avoids allocation in the decode loop. `quantize` false: the
  // floats only (for an input that only float weights consume; q8() is then nullptr).
  void Set(const float* x, int64_t n, int64_t cols, bool quantize = true);

  int64_t n() const { return n_; }
  int64_t cols() const { return cols_; }
  const float* f32() const { return x_; }
  // Q8_0 blocks, cols/32 per token; nullptr when cols is not a multiple of 32.
  const BlockQ8_0* q8() const { return q8_.empty() ? nullptr : q8_.data(); }

 private:
  const float* x_ = nullptr;
  int64_t n_ = 0;
  int64_t cols_ = 0;
  std::vector<BlockQ8_0> q8_;
};

// Loads one byte of every 64-byte line of [p, p + n), bringing the range into the CPU caches (e.g. weights about to
// be computed, streamed while the thread would otherwise wait); returns a value that depends on the bytes, so the
// loads are not optimized away.
uint64_t TouchCacheLines(const void* p, size_t n);

// Dot product of row `row` of w with token `token` of x (x.cols() == w.cols).
float RowDot(const MatrixView& w, int64_t row, const Activation& x, int64_t token = 0);

// y[r] = W[r,:] . x for every row (x: one token of w.cols floats; y: w.rows floats). `pool` may be nullptr.
void Gemv(const MatrixView& w, const float* x, float* y, ThreadPool* pool);
void Gemv(const MatrixView& w, const Activation& x, float* y, ThreadPool* pool);

// Y[t, r] = W[r,:] . X[t,:] for t < n (X: n x cols, Y: n x rows, both row-major). Each weight row is loaded once per
// tile of tokens, so this is much faster than n Gemv calls; the values equal those of n Gemv calls exactly.
void Gemm(const MatrixView& w, const float* x, int64_t n, float* y, ThreadPool* pool);
void Gemm(const MatrixView& w, const Activation& x, float* y, ThreadPool* pool);

// Several matrices with the same column count times one activation in one parallel loop over all their rows:
// ys[i] = Gemm(ws[i], x). Equal, value for value, to separate Gemm calls; saves one pool wake-up and barrier per
// extra matrix (decode: q/k/v and gate/up). ws.size() == ys.size().
void GemmMany(std::span<const MatrixView> ws, const Activation& x, std::span<float* const> ys, ThreadPool* pool);

// Sparse gate/up projection: y[k] = W[rows[k],:] . x for k < rows.size() (compact output). Indices must be in
// [0, w.rows); duplicates are allowed (computed twice).
void GemvRows(const MatrixView& w, std::span<const int32_t> rows, const float* x, float* y, ThreadPool* pool);
void GemvRows(const MatrixView& w, std::span<const int32_t> rows, const Activation& x, float* y, ThreadPool* pool);

// Sparse down projection with the matrix stored transposed (one row per FFN neuron, each of length w.cols = model
// dim): y[c] += sum_k a[k] * W[rows[k], c] for c < w.cols, k in order. Work is split over output columns, never
// over k, so the summation order is fixed.
void AccumulateRows(const MatrixView& w, std::span<const int32_t> rows, const float* a, float* y, ThreadPool* pool);

// The same two operations on rows given by address, for rows scattered over several buffers (the offloaded FFN's
// neuron bundles in the cache arena and staging memory): `shape` gives type, cols and row_bytes (its data and rows
// are ignored); every pointer addresses a row of that shape. Values equal GemvRows / AccumulateRows on the same bytes
// in the same order, bit for bit, and the multi-row tiles keep several rows' loads in flight, unlike one RowDot per
// row.
void GemvRowPtrs(const MatrixView& shape, std::span<const uint8_t* const> rows, const Activation& x, float* y,
                 ThreadPool* pool);
void AccumulateRowPtrs(const MatrixView& shape, std::span<const uint8_t* const> rows, const float* a, float* y,
                       ThreadPool* pool);

}  // namespace nflash
