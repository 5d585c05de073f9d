// Tests of the compute kernels: every kernel x weight type x ISA against a double-precision reference built from the
// dequantized weights (and the Q8_0-quantized activation where the kernel quantizes it), AVX2 / AVX-512 vs scalar
// agreement,
// odd shapes, thread-count independence (bit-exact), sparse = dense restricted to the chosen rows, and the vector
// AccumulateRows kernels bit for bit against the per-element FMA sequence they implement.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/core/float16.h"
#include "runtime/core/kernels.h"
#include "runtime/core/kernels_internal.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_pool.h"

namespace nflash {
namespace {

constexpr GgmlType kTypes[] = {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0, GgmlType::kQ4_0};
// fp32 unit roundoff.
constexpr double kU = 1.0 / (1 << 24);

bool IsQuant(GgmlType t) { return t == GgmlType::kQ8_0 || t == GgmlType::kQ4_0; }

std::vector<float> RandomFloats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// A matrix of `type` from random floats, with optional padding after each row, and its dequantized values.
struct TestMatrix {
  GgmlType type;
  int64_t rows, cols;
  size_t row_bytes;
  std::vector<uint8_t> data;
  std::vector<double> deq;  // rows x cols
  MatrixView view() const { return MatrixView{type, data.data(), rows, cols, row_bytes}; }
};

TestMatrix MakeMatrix(GgmlType type, int64_t rows, int64_t cols, uint32_t seed, size_t pad = 0) {
  TestMatrix m{type, rows, cols, *RowBytes(type, cols) + pad, {}, {}};
  m.data.assign(m.row_bytes * rows + 1, 0xee);
  m.deq.resize(rows * cols);
  const auto f = RandomFloats(rows * cols, seed, 0.5f);
  std::vector<float> back(cols);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(QuantizeRow(type, f.data() + r * cols, m.data.data() + r * m.row_bytes, cols).ok());
    EXPECT_TRUE(DequantizeRow(type, m.data.data() + r * m.row_bytes, back.data(), cols).ok());
    for (int64_t c = 0; c < cols; ++c) m.deq[r * cols + c] = back[c];
  }
  return m;
}

// The activation as the kernel sees it: Q8_0-rounded for quantized weights, else as is.
std::vector<double> EffectiveActivation(GgmlType type, const float* x, int64_t cols) {
  std::vector<double> out(cols);
  if (IsQuant(type)) {
    std::vector<BlockQ8_0> q(cols / 32);
    QuantizeRowQ8_0(x, q.data(), cols);
    std::vector<float> back(cols);
    DequantizeRowQ8_0(q.data(), back.data(), cols);
    for (int64_t c = 0; c < cols; ++c) out[c] = back[c];
  } else {
    for (int64_t c = 0; c < cols; ++c) out[c] = x[c];
  }
  return out;
}

// Tolerance from the recursive-summation bound |err| <= m * u * sum |terms| (first order), m = the most roundings
// any term goes through. Both ISAs keep 8 partial sums (lane c % 8) for float types, so a term sees at most cols/8
// lane additions, 3 horizontal ones, up to 7 tail additions and its product: m <= cols/8 + 16. Quantized types sum
// exact integer block dots, so a term (d_w * d_x * sumi, two roundings) sees at most cols/32 additions: m <=
// cols/32 + 16. A kernel that sums in a different structure (e.g. in float inside a block) exceeds it.
struct RefDot {
  double value;
  double tol;
};
RefDot Reference(const TestMatrix& m, int64_t row, const std::vector<double>& x) {
  double s = 0, a = 0;
  for (int64_t c = 0; c < m.cols; ++c) {
    s += m.deq[row * m.cols + c] * x[c];
    a += std::fabs(m.deq[row * m.cols + c] * x[c]);
  }
  const double m_roundings = (IsQuant(m.type) ? m.cols / 32 : m.cols / 8) + 16;
  return {s, m_roundings * kU * a + 1e-30};
}

std::string Name(GgmlType t, int64_t rows, int64_t cols) {
  return std::string(GgmlTypeName(t)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " isa " +
         KernelIsaName(ActiveIsa());
}

// Shapes: 1 row, rows not a multiple of the 4-row tile, cols = 32 (one block), 224 (7 blocks: 4-block steps plus a
// 3-block tail), wide rows; float types also get
// column counts that are not multiples of 8 (vector tails).
std::vector<std::pair<int64_t, int64_t>> Shapes(GgmlType t) {
  std::vector<std::pair<int64_t, int64_t>> s = {{1, 32}, {3, 32}, {5, 64}, {7, 96}, {17, 256}, {9, 224}, {6, 4096}};
  if (!IsQuant(t)) s.insert(s.end(), {{1, 1}, {5, 7}, {9, 13}, {4, 35}, {3, 100}});
  return s;
}

class KernelIsaTest : public ::testing::TestWithParam<KernelIsa> {
 protected:
  void SetUp() override {
    if (!SetKernelIsa(GetParam())) GTEST_SKIP() << "CPU lacks " << KernelIsaName(GetParam());
  }
  void TearDown() override { SetKernelIsa(BestKernelIsa()); }
};

TEST_P(KernelIsaTest, GemvAndRowDotMatchReference) {
  for (GgmlType type : kTypes) {
    for (auto [rows, cols] : Shapes(type)) {
      for (size_t pad : {size_t{0}, size_t{6}}) {
        const TestMatrix m = MakeMatrix(type, rows, cols, static_cast<uint32_t>(rows * 131 + cols), pad);
        const auto x = RandomFloats(cols, 99);
        const auto xe = EffectiveActivation(type, x.data(), cols);
        std::vector<float> y(rows, -1.0f);
        Gemv(m.view(), x.data(), y.data(), nullptr);
        const Activation act(x.data(), 1, cols);
        for (int64_t r = 0; r < rows; ++r) {
          const RefDot ref = Reference(m, r, xe);
          ASSERT_NEAR(y[r], ref.value, ref.tol) << Name(type, rows, cols) << " row " << r << " pad " << pad;
          EXPECT_EQ(RowDot(m.view(), r, act), y[r]) << Name(type, rows, cols) << " row " << r;
        }
      }
    }
  }
}

TEST_P(KernelIsaTest, GemmMatchesReferenceAndEqualsGemvPerTokenExactly) {
  for (GgmlType type : kTypes) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 32}, {7, 64}, {18, 128}, {33, 96}}) {
      const TestMatrix m = MakeMatrix(type, rows, cols, static_cast<uint32_t>(rows + cols));
      for (int64_t n : {1, 2, 3, 5, 8, 17}) {
        const auto x = RandomFloats(n * cols, static_cast<uint32_t>(n));
        std::vector<float> y(n * rows, -1.0f);
        Gemm(m.view(), x.data(), n, y.data(), nullptr);
        for (int64_t t = 0; t < n; ++t) {
          std::vector<float> yv(rows);
          Gemv(m.view(), x.data() + t * cols, yv.data(), nullptr);
          const auto xe = EffectiveActivation(type, x.data() + t * cols, cols);
          for (int64_t r = 0; r < rows; ++r) {
            const RefDot ref = Reference(m, r, xe);
            ASSERT_NEAR(y[t * rows + r], ref.value, ref.tol) << Name(type, rows, cols) << " n " << n << " t " << t;
            ASSERT_EQ(y[t * rows + r], yv[r]) << Name(type, rows, cols) << " n " << n << " t " << t << " r " << r;
          }
        }
      }
    }
  }
}

// Rows that end where readable memory ends: every kernel reads only its rows' bytes, also for the partial vector
// steps (an odd block count leaves the AVX-512 two-block step one block; float tails). The rows sit at the end of a
// mapping followed by an inaccessible page (and after one), so a read past the last byte (or before the first) faults
// and the test dies; the results must still match the reference.
TEST_P(KernelIsaTest, ReadsNoByteOutsideTheRows) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (GgmlType type : kTypes) {
    for (int64_t cols : IsQuant(type) ? std::vector<int64_t>{32, 96, 160, 224} : std::vector<int64_t>{7, 13, 96, 100}) {
      constexpr int64_t kRows = 9;
      const TestMatrix m = MakeMatrix(type, kRows, cols, static_cast<uint32_t>(cols + 5));
      const size_t bytes = m.row_bytes * kRows;
      const size_t span = (bytes + page - 1) / page * page;
      // [inaccessible page][span bytes, the rows at their end][inaccessible page]
      void* map = mmap(nullptr, span + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_NE(map, MAP_FAILED);
      uint8_t* base = static_cast<uint8_t*>(map) + page;
      ASSERT_EQ(mprotect(base, span, PROT_READ | PROT_WRITE), 0);
      uint8_t* rows = base + span - bytes;
      std::memcpy(rows, m.data.data(), bytes);
      const MatrixView w{type, rows, kRows, cols, m.row_bytes};
      const std::string what = Name(type, kRows, cols);
      // Gemm over 1, 2, 3 and 5 tokens (token tiles and their tails), GemvRows over the last rows, row pointers.
      for (int64_t n : {1, 2, 3, 5}) {
        const auto x = RandomFloats(n * cols, static_cast<uint32_t>(n + cols));
        std::vector<float> y(static_cast<size_t>(n * kRows));
        Gemm(w, x.data(), n, y.data(), nullptr);
        for (int64_t t = 0; t < n; ++t) {
          const auto xe = EffectiveActivation(type, x.data() + t * cols, cols);
          for (int64_t r = 0; r < kRows; ++r) {
            const RefDot ref = Reference(m, r, xe);
            ASSERT_NEAR(y[t * kRows + r], ref.value, ref.tol) << what << " n " << n << " row " << r;
          }
        }
      }
      const auto x = RandomFloats(cols, 3);
      const Activation act(x.data(), 1, cols);
      const std::vector<int32_t> last = {kRows - 1, kRows - 2, 0, kRows - 1};
      std::vector<float> yr(last.size());
      GemvRows(w, last, act, yr.data(), nullptr);
      std::vector<const uint8_t*> ptrs;
      for (int32_t r : last) ptrs.push_back(rows + static_cast<size_t>(r) * m.row_bytes);
      std::vector<float> yp(last.size());
      GemvRowPtrs(w, ptrs, act, yp.data(), nullptr);
      for (size_t i = 0; i < last.size(); ++i) {
        EXPECT_EQ(yr[i], RowDot(w, last[i], act)) << what;
        EXPECT_EQ(yp[i], yr[i]) << what;
      }
      // AccumulateRows over 1 to 9 of them, the last row included (the 8-, 4- and 1-row groups).
      for (int64_t count = 1; count <= kRows; ++count) {
        std::vector<int32_t> idx;
        for (int64_t k = 0; k < count; ++k) idx.push_back(static_cast<int32_t>(kRows - 1 - k));
        const auto a = RandomFloats(count, static_cast<uint32_t>(count));
        std::vector<float> y(static_cast<size_t>(cols), 0.0f);
        AccumulateRows(w, idx, a.data(), y.data(), nullptr);
        for (int64_t c = 0; c < cols; ++c) {
          double want = 0.0, mag = 0.0;
          for (int64_t k = 0; k < count; ++k) {
            want += a[k] * m.deq[idx[k] * cols + c];
            mag += std::fabs(a[k] * m.deq[idx[k] * cols + c]);
          }
          ASSERT_NEAR(y[c], want, 4 * kU * (count + 2) * mag + 1e-30) << what << " count " << count << " col " << c;
        }
      }
      ASSERT_EQ(munmap(map, span + 2 * page), 0);
    }
  }
}

// Q8_0 weights written by other tools may hold -128, which the quantizer never produces; the kernels must still
// give the exact block dot (AVX2 via |w| = 128 read unsigned, AVX-512 via w + 128 = 0).
TEST_P(KernelIsaTest, Q8_0WeightsOfMinus128AreExact) {
  const int64_t rows = 9, cols = 96;  // 3 blocks per row: a pair and an odd tail for the 2-block AVX-512 step
  TestMatrix m{GgmlType::kQ8_0, rows, cols, *RowBytes(GgmlType::kQ8_0, cols), {}, std::vector<double>(rows * cols)};
  m.data.resize(m.row_bytes * rows);
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> byte(-128, 127);
  for (int64_t r = 0; r < rows; ++r) {
    auto* blocks = reinterpret_cast<BlockQ8_0*>(m.data.data() + r * m.row_bytes);
    for (int64_t b = 0; b < cols / 32; ++b) {
      blocks[b].d = Fp32ToFp16(0.01f * static_cast<float>(r + b + 1));
      for (int j = 0; j < 32; ++j) blocks[b].qs[j] = static_cast<int8_t>((j + r) % 5 == 0 ? -128 : byte(rng));
      for (int j = 0; j < 32; ++j) m.deq[r * cols + b * 32 + j] = Fp16ToFp32(blocks[b].d) * blocks[b].qs[j];
    }
  }
  const auto x = RandomFloats(cols, 42);
  const auto xe = EffectiveActivation(GgmlType::kQ8_0, x.data(), cols);
  std::vector<float> y(rows);
  Gemv(m.view(), x.data(), y.data(), nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    const RefDot ref = Reference(m, r, xe);
    ASSERT_NEAR(y[r], ref.value, ref.tol) << Name(GgmlType::kQ8_0, rows, cols) << " row " << r;
  }
}

// Duplicate-free random subset of [0, rows), in random order.
std::vector<int32_t> RandomRows(int64_t rows, double fraction, uint32_t seed) {
  std::vector<int32_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::max<int64_t>(1, static_cast<int64_t>(rows * fraction)));
  return all;
}

TEST_P(KernelIsaTest, GemvRowsEqualsDenseRestrictedToTheRows) {
  for (GgmlType type : kTypes) {
    const int64_t rows = 203, cols = 160;
    const TestMatrix m = MakeMatrix(type, rows, cols, 5);
    const auto x = RandomFloats(cols, 6);
    std::vector<float> dense(rows);
    Gemv(m.view(), x.data(), dense.data(), nullptr);
    for (double fraction : {0.0, 0.1, 0.37, 1.0}) {
      auto idx = RandomRows(rows, fraction, 8);
      std::vector<float> y(idx.size(), -1.0f);
      GemvRows(m.view(), idx, x.data(), y.data(), nullptr);
      for (size_t k = 0; k < idx.size(); ++k) ASSERT_EQ(y[k], dense[idx[k]]) << Name(type, rows, cols) << " k " << k;
    }
    // Several tokens through one shared Activation: y is tokens x rows.size().
    const auto x3 = RandomFloats(3 * cols, 12);
    const Activation act(x3.data(), 3, cols);
    const auto idx = RandomRows(rows, 0.2, 9);
    std::vector<float> y(3 * idx.size());
    GemvRows(m.view(), idx, act, y.data(), nullptr);
    std::vector<float> full(3 * rows);
    Gemm(m.view(), act, full.data(), nullptr);
    for (int t = 0; t < 3; ++t)
      for (size_t k = 0; k < idx.size(); ++k) ASSERT_EQ(y[t * idx.size() + k], full[t * rows + idx[k]]);
  }
}

TEST_P(KernelIsaTest, AccumulateRowsMatchesReference) {
  for (GgmlType type : kTypes) {
    for (auto [rows, cols] : Shapes(type)) {
      const TestMatrix m = MakeMatrix(type, rows, cols, static_cast<uint32_t>(7 * rows + cols));
      for (double fraction : {0.0, 0.5, 1.0}) {
        const auto idx = RandomRows(rows, fraction, 3);
        const auto a = RandomFloats(idx.size(), 4);
        const auto y0 = RandomFloats(cols, 5);
        std::vector<float> y = y0;
        AccumulateRows(m.view(), idx, a.data(), y.data(), nullptr);
        // Sequential sum of K+1 terms with one extra rounding per term for the a*d scale: error <=
        // (K + 4) u (|y0| + sum |a w|).
        const double k = static_cast<double>(idx.size());
        for (int64_t c = 0; c < cols; ++c) {
          double s = y0[c], abs = std::fabs(y0[c]);
          for (size_t i = 0; i < idx.size(); ++i) {
            s += a[i] * m.deq[idx[i] * cols + c];
            abs += std::fabs(a[i] * m.deq[idx[i] * cols + c]);
          }
          ASSERT_NEAR(y[c], s, (k + 4) * kU * abs) << Name(type, rows, cols) << " col " << c << " k " << k;
        }
      }
    }
  }
}

// Rows given by address, scattered over two buffers in a shuffled order: the same values as GemvRows /
// AccumulateRows over the same rows in the same order (bit for bit: the ISA kernels' tiles compute every row alike),
// at 1 and 2 threads, with row counts that leave tile tails.
TEST_P(KernelIsaTest, RowPointersEqualIndexedRows) {
  for (GgmlType type : kTypes) {
    const int64_t rows = 700, cols = 1024;
    const TestMatrix m = MakeMatrix(type, rows, cols, 31);
    const auto idx = RandomRows(rows, 0.6, 32);
    // Copy each selected row to one of two other buffers (alternating), far from the matrix.
    std::vector<uint8_t> buf_a(idx.size() * m.row_bytes), buf_b(idx.size() * m.row_bytes);
    std::vector<const uint8_t*> ptrs(idx.size());
    for (size_t k = 0; k < idx.size(); ++k) {
      uint8_t* dst = (k % 2 ? buf_b.data() : buf_a.data()) + (idx.size() - 1 - k) * m.row_bytes;
      std::memcpy(dst, m.data.data() + static_cast<size_t>(idx[k]) * m.row_bytes, m.row_bytes);
      ptrs[k] = dst;
    }
    const auto x = RandomFloats(cols, 33);
    const Activation act(x.data(), 1, cols);
    const auto a = RandomFloats(idx.size(), 34);
    for (int threads : {1, 2}) {
      ThreadPool pool(threads);
      std::vector<float> want(idx.size()), got(idx.size(), -1.0f);
      GemvRows(m.view(), idx, act, want.data(), &pool);
      GemvRowPtrs(m.view(), ptrs, act, got.data(), &pool);
      const std::string what = Name(type, rows, cols) + " threads " + std::to_string(threads);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), idx.size() * 4), 0) << what;
      std::vector<float> acc_want(cols, 0.5f), acc_got(cols, 0.5f);
      AccumulateRows(m.view(), idx, a.data(), acc_want.data(), &pool);
      AccumulateRowPtrs(m.view(), ptrs, a.data(), acc_got.data(), &pool);
      EXPECT_EQ(std::memcmp(acc_want.data(), acc_got.data(), cols * 4), 0) << what;
      // And each value equals RowDot of its row.
      for (size_t k = 0; k < idx.size(); k += 37) ASSERT_EQ(got[k], RowDot(m.view(), idx[k], act, 0)) << what;
    }
  }
}

TEST_P(KernelIsaTest, ThreadCountsGiveBitIdenticalResults) {
  // Sizes chosen so that the kernels' chunk (>= 256 KiB of weights) still gives every call at least 2 chunks: e.g.
  // Q4_0 Gemv 464-row chunks of 1500 rows, AccumulateRows 1024-column chunks of 2048 columns.
  for (GgmlType type : kTypes) {
    const int64_t rows = 1500, cols = 2048;
    const TestMatrix m = MakeMatrix(type, rows, cols, 21);
    const auto x = RandomFloats(4 * cols, 22);
    const auto idx = RandomRows(rows, 0.4, 23);
    const auto a = RandomFloats(idx.size(), 24);
    std::vector<float> gemv1, gemm1, rows1, acc1;
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> gemv(rows), gemm(4 * rows), sparse(idx.size()), acc(cols, 0.25f);
      Gemv(m.view(), x.data(), gemv.data(), &pool);
      Gemm(m.view(), x.data(), 4, gemm.data(), &pool);
      GemvRows(m.view(), idx, x.data(), sparse.data(), &pool);
      AccumulateRows(m.view(), idx, a.data(), acc.data(), &pool);
      if (threads == 1) {
        gemv1 = gemv, gemm1 = gemm, rows1 = sparse, acc1 = acc;
        continue;
      }
      const std::string what = Name(type, rows, cols) + " threads " + std::to_string(threads);
      EXPECT_EQ(std::memcmp(gemv.data(), gemv1.data(), rows * 4), 0) << what;
      EXPECT_EQ(std::memcmp(gemm.data(), gemm1.data(), 4 * rows * 4), 0) << what;
      EXPECT_EQ(std::memcmp(sparse.data(), rows1.data(), idx.size() * 4), 0) << what;
      EXPECT_EQ(std::memcmp(acc.data(), acc1.data(), cols * 4), 0) << what;
    }
  }
}

TEST_P(KernelIsaTest, GemmManyMatchesReferenceAndSeparateGemmCalls) {
  // Three matrices of different row counts (not multiples of the tiles) and, for quantized types, enough rows that
  // the stacked row range is cut into several chunks that straddle the matrix boundaries.
  for (GgmlType type : kTypes) {
    const int64_t cols = 1024;
    const int64_t row_counts[] = {700, 37, 1301};
    std::vector<TestMatrix> ms;
    for (int i = 0; i < 3; ++i) ms.push_back(MakeMatrix(type, row_counts[i], cols, 40 + i));
    for (int64_t n : {1, 3}) {
      const auto x = RandomFloats(n * cols, 50);
      const Activation act(x.data(), n, cols);
      std::vector<std::vector<float>> sep(3);
      for (int i = 0; i < 3; ++i) {
        sep[i].resize(n * row_counts[i]);
        Gemm(ms[i].view(), act, sep[i].data(), nullptr);
      }
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        std::vector<std::vector<float>> many(3);
        for (int i = 0; i < 3; ++i) many[i].assign(n * row_counts[i], -7.0f);
        const MatrixView ws[] = {ms[0].view(), ms[1].view(), ms[2].view()};
        float* const ys[] = {many[0].data(), many[1].data(), many[2].data()};
        GemmMany(ws, act, ys, &pool);
        for (int i = 0; i < 3; ++i) {
          const std::string what = Name(type, row_counts[i], cols) + " n " + std::to_string(n) + " threads " +
                                   std::to_string(threads) + " matrix " + std::to_string(i);
          EXPECT_EQ(std::memcmp(many[i].data(), sep[i].data(), many[i].size() * 4), 0) << what;
          for (int64_t t = 0; t < n; ++t) {
            const auto xe = EffectiveActivation(type, x.data() + t * cols, cols);
            for (int64_t r = 0; r < row_counts[i]; r += 13) {
              const RefDot ref = Reference(ms[i], r, xe);
              ASSERT_NEAR(many[i][t * row_counts[i] + r], ref.value, ref.tol) << what << " row " << r;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, KernelIsaTest,
                         ::testing::Values(KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512),
                         [](const auto& info) { return std::string(KernelIsaName(info.param)); });

// Each vector ISA against the scalar path on the same inputs (the per-ISA tests above check each against the exact
// value; this checks that they are the same function).
class KernelAgreementTest : public ::testing::TestWithParam<KernelIsa> {
 protected:
  void TearDown() override { SetKernelIsa(BestKernelIsa()); }
};

TEST_P(KernelAgreementTest, VectorIsaAndScalarAgreeWithinRounding) {
  if (!SetKernelIsa(GetParam())) GTEST_SKIP() << "CPU lacks " << KernelIsaName(GetParam());
  for (GgmlType type : kTypes) {
    const int64_t rows = 37, cols = 512;
    const TestMatrix m = MakeMatrix(type, rows, cols, 31);
    const auto x = RandomFloats(3 * cols, 32);
    const auto idx = RandomRows(rows, 0.6, 33);
    const auto a = RandomFloats(idx.size(), 34);
    std::vector<float> gs(3 * rows), ga(3 * rows), as(cols, 1.0f), aa(cols, 1.0f);
    ASSERT_TRUE(SetKernelIsa(KernelIsa::kScalar));
    Gemm(m.view(), x.data(), 3, gs.data(), nullptr);
    AccumulateRows(m.view(), idx, a.data(), as.data(), nullptr);
    ASSERT_TRUE(SetKernelIsa(GetParam()));
    Gemm(m.view(), x.data(), 3, ga.data(), nullptr);
    AccumulateRows(m.view(), idx, a.data(), aa.data(), nullptr);
    for (int64_t t = 0; t < 3; ++t) {
      const auto xe = EffectiveActivation(type, x.data() + t * cols, cols);
      for (int64_t r = 0; r < rows; ++r) {
        // Each is within tol of the exact value, so they are within 2 tol of each other.
        const RefDot ref = Reference(m, r, xe);
        ASSERT_NEAR(gs[t * rows + r], ga[t * rows + r], 2 * ref.tol) << GgmlTypeName(type);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      double abs = 1.0;
      for (size_t i = 0; i < idx.size(); ++i) abs += std::fabs(a[i] * m.deq[idx[i] * cols + c]);
      ASSERT_NEAR(as[c], aa[c], 2 * (idx.size() + 4) * kU * abs) << GgmlTypeName(type) << " col " << c;
    }
  }
}

// The activations' Q8_0 quantization is QuantizeRowQ8_0 byte for byte on every ISA, halfway cases included (std::round
// takes them away from zero; a vector round-to-nearest-even would not).
TEST_P(KernelAgreementTest, ActivationQuantizationIsTheScalarOneByteForByte) {
  if (!SetKernelIsa(GetParam())) GTEST_SKIP() << "CPU lacks " << KernelIsaName(GetParam());
  const int64_t cols = 32 * 64;
  std::vector<float> x = RandomFloats(cols, 41);
  for (int j = 0; j < 32; ++j) x[j] = (j % 2 ? -1.0f : 1.0f) * (static_cast<float>(j) + 0.5f);  // ties at scale 1
  x[31] = 127.0f;  // amax 127: d = id = 1, so the block's values are quantized as they are
  for (int j = 32; j < 64; ++j) x[j] = 0.0f;  // an all-zero block (d = 0)
  x[40] = -0.0f;
  for (int j = 64; j < 96; ++j) x[j] = 1e-30f * static_cast<float>(j - 80);  // tiny magnitudes
  for (int j = 96; j < 128; ++j) x[j] = static_cast<float>(j - 111) * 8.5f;  // ties at another scale
  std::vector<BlockQ8_0> expect(cols / 32);
  QuantizeRowQ8_0(x.data(), expect.data(), cols);
  EXPECT_EQ(expect[0].qs[0], 1);   // 0.5 -> 1
  EXPECT_EQ(expect[0].qs[1], -2);  // -1.5 -> -2
  EXPECT_EQ(expect[0].qs[2], 3);   // 2.5 -> 3 (to even would give 2)
  const Activation a(x.data(), 1, cols);
  ASSERT_NE(a.q8(), nullptr);
  ASSERT_EQ(0, std::memcmp(a.q8(), expect.data(), expect.size() * sizeof(BlockQ8_0)));
}

INSTANTIATE_TEST_SUITE_P(Isa, KernelAgreementTest, ::testing::Values(KernelIsa::kAvx2, KernelIsa::kAvx512),
                         [](const auto& info) { return std::string(KernelIsaName(info.param)); });

// AccumulateRows in the vector ISAs is one fused multiply-add per row and element, rows in the given order:
// y = fma(w, s, y) with s = a_k (float rows) or s = a_k * d rounded to float (Q8_0/Q4_0 blocks), w the exact weight.
// This is that sequence written out element by element (std::fma), independent of the kernels; the AVX2 and AVX-512
// kernels must equal it bit for bit, which also makes them equal to each other (the offloaded runtime compares
// runs bitwise). The scalar kernel rounds the product separately (no FMA), so it only agrees within rounding.
void FmaModel(GgmlType type, const std::vector<const uint8_t*>& rows, const float* a, int64_t c0, int64_t c1,
              float* y) {
  for (size_t k = 0; k < rows.size(); ++k) {
    const uint8_t* row = rows[k];
    for (int64_t c = c0; c < c1; ++c) {
      float w, s = a[k];
      if (IsQuant(type)) {
        const int64_t b = c / 32, j = c % 32;
        const uint8_t* blk = row + b * (type == GgmlType::kQ8_0 ? sizeof(BlockQ8_0) : sizeof(BlockQ4_0));
        uint16_t d;
        std::memcpy(&d, blk, 2);
        s = a[k] * Fp16ToFp32(d);
        if (type == GgmlType::kQ8_0) {
          w = static_cast<float>(static_cast<int8_t>(blk[2 + j]));
        } else {
          const uint8_t byte = blk[2 + j % 16];
          w = static_cast<float>((j < 16 ? byte & 0x0f : byte >> 4) - 8);
        }
      } else if (type == GgmlType::kF32) {
        std::memcpy(&w, row + 4 * c, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, row + 2 * c, 2);
        w = type == GgmlType::kF16 ? Fp16ToFp32(h) : Bf16ToFp32(h);
      }
      y[c] = std::fma(w, s, y[c]);
    }
  }
}

// Each vector ISA's accumulate kernel, called directly so that column ranges [c0, c1) other than the splits the
// front end makes are covered: starts at any multiple of 32, ends at a multiple of 32 or the row end, neither a
// multiple of the kernels' 64-column steps; row counts around the 4- and 8-row groups; duplicate rows, zero
// coefficients (+0 and -0), padded rows (row starts not 4-byte aligned); rows by index and by address.
TEST(AccumulateKernelTest, VectorIsasEqualTheFmaSequenceBitForBit) {
  std::vector<std::pair<const char*, const internal::IsaKernels*>> isas;
  if (CpuHasAvx2()) isas.push_back({"avx2", &internal::kAvx2Kernels});
  if (CpuHasAvx512()) isas.push_back({"avx512", &internal::kAvx512Kernels});
  if (isas.empty()) GTEST_SKIP() << "CPU lacks AVX2";
  for (GgmlType type : kTypes) {
    const int64_t rows = 40, cols = IsQuant(type) ? 416 : 413;  // 13 blocks / 25 vectors and a 13-column tail
    const TestMatrix m = MakeMatrix(type, rows, cols, 61, /*pad=*/6);
    // Scattered copies of every row, in reverse order, for the by-address form.
    std::vector<uint8_t> scattered(rows * (m.row_bytes + 10));
    std::vector<const uint8_t*> row_ptr(rows);
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* dst = scattered.data() + (rows - 1 - r) * (m.row_bytes + 10) + 3;
      std::memcpy(dst, m.data.data() + r * m.row_bytes, m.row_bytes);
      row_ptr[r] = dst;
    }
    const std::pair<int64_t, int64_t> ranges[] = {{0, cols}, {32, cols}, {64, 96},  {96, 224},
                                                  {0, 32},   {384, cols}, {32, 288}, {160, 192}};
    std::mt19937 rng(62);
    for (int64_t count : {0, 1, 3, 4, 7, 8, 9, 12, 15, 16, 17, 25}) {
      std::vector<int32_t> idx(count);
      for (auto& i : idx) i = static_cast<int32_t>(rng() % rows);  // duplicates likely
      std::vector<float> a = RandomFloats(count, static_cast<uint32_t>(63 + count));
      for (int64_t k = 0; k < count; k += 3) a[k] = k % 2 ? -0.0f : 0.0f;
      std::vector<const uint8_t*> ptrs(count);
      for (int64_t k = 0; k < count; ++k) ptrs[k] = row_ptr[idx[k]];
      const internal::RowSet by_index{m.data.data(), m.row_bytes, idx.data()};
      const internal::RowSet by_ptr{nullptr, m.row_bytes, nullptr, ptrs.data()};
      for (auto [c0, c1] : ranges) {
        const auto y0 = RandomFloats(cols, static_cast<uint32_t>(64 + c0));
        std::vector<float> want = y0;
        FmaModel(type, ptrs, a.data(), c0, c1, want.data());
        for (const auto& [name, kernels] : isas) {
          for (const internal::RowSet* rs : {&by_index, &by_ptr}) {
            std::vector<float> got = y0;
            kernels->accumulate(type, *rs, count, a.data(), c0, c1, got.data());
            const std::string what = std::string(GgmlTypeName(type)) + " " + name + " count " +
                                     std::to_string(count) + " cols [" + std::to_string(c0) + ", " +
                                     std::to_string(c1) + ") " + (rs == &by_ptr ? "ptrs" : "index");
            for (int64_t c = 0; c < cols; ++c) {
              uint32_t gb, wb;
              std::memcpy(&gb, &got[c], 4);
              std::memcpy(&wb, &want[c], 4);
              ASSERT_EQ(gb, wb) << what << " col " << c << ": " << got[c] << " vs " << want[c];
            }
          }
        }
      }
    }
  }
}

// Through the public entry points, with the thread split: AVX-512 and AVX2 give the same bits for AccumulateRows and
// AccumulateRowPtrs at 1 and 2 threads on model-sized rows (4096 columns: two 2048-column thread ranges).
TEST(AccumulateKernelTest, Avx512EqualsAvx2ThroughThePublicApi) {
  if (!CpuHasAvx512()) GTEST_SKIP() << "CPU lacks AVX-512";
  for (GgmlType type : kTypes) {
    const int64_t rows = 300, cols = 4096;
    const TestMatrix m = MakeMatrix(type, rows, cols, 71);
    const auto idx = RandomRows(rows, 0.33, 72);  // 99 rows: 12 groups of 8, then 3
    std::vector<const uint8_t*> ptrs(idx.size());
    for (size_t k = 0; k < idx.size(); ++k) ptrs[k] = m.data.data() + static_cast<size_t>(idx[k]) * m.row_bytes;
    const auto a = RandomFloats(idx.size(), 73);
    for (int threads : {1, 2}) {
      ThreadPool pool(threads);
      std::vector<float> want(cols, 0.125f), got(cols, 0.125f), got_ptrs(cols, 0.125f);
      ASSERT_TRUE(SetKernelIsa(KernelIsa::kAvx2));
      AccumulateRows(m.view(), idx, a.data(), want.data(), &pool);
      ASSERT_TRUE(SetKernelIsa(KernelIsa::kAvx512));
      AccumulateRows(m.view(), idx, a.data(), got.data(), &pool);
      AccumulateRowPtrs(m.view(), ptrs, a.data(), got_ptrs.data(), &pool);
      SetKernelIsa(BestKernelIsa());
      const std::string what = std::string(GgmlTypeName(type)) + " threads " + std::to_string(threads);
      EXPECT_EQ(std::memcmp(want.data(), got.data(), cols * 4), 0) << what;
      EXPECT_EQ(std::memcmp(want.data(), got_ptrs.data(), cols * 4), 0) << what;
      // Not vacuous: the rows changed y.
      EXPECT_NE(want[0], 0.125f) << what;
    }
  }
}

// An activation is quantized (for Q8_0/Q4_0 weights) only when its rows are whole 32-element blocks and it is asked
// for; float weights read the floats.
TEST(ActivationTest, QuantizedOnlyInWholeBlocks) {
  const auto x = RandomFloats(2 * 64, 5);
  EXPECT_NE(Activation(x.data(), 2, 64).q8(), nullptr);
  EXPECT_EQ(Activation(x.data(), 2, 33).q8(), nullptr);
  EXPECT_EQ(Activation(x.data(), 1, 100).q8(), nullptr);
  Activation a;
  a.Set(x.data(), 2, 64, /*quantize=*/false);
  EXPECT_EQ(a.q8(), nullptr);
  EXPECT_EQ(a.f32(), x.data());
}

TEST(KernelIsaSelectionTest, DefaultIsTheBestTheCpuHas) {
  const KernelIsa best = CpuHasAvx512() ? KernelIsa::kAvx512 : CpuHasAvx2() ? KernelIsa::kAvx2 : KernelIsa::kScalar;
  EXPECT_EQ(BestKernelIsa(), best);
  EXPECT_EQ(ActiveIsa(), best);
  EXPECT_TRUE(!CpuHasAvx512() || CpuHasAvx2());
  EXPECT_TRUE(SetKernelIsa(KernelIsa::kScalar));
  EXPECT_EQ(ActiveIsa(), KernelIsa::kScalar);
  EXPECT_EQ(SetKernelIsa(KernelIsa::kAvx2), CpuHasAvx2());
  EXPECT_EQ(ActiveIsa(), CpuHasAvx2() ? KernelIsa::kAvx2 : KernelIsa::kScalar);
  EXPECT_TRUE(SetKernelIsa(KernelIsa::kScalar));
  EXPECT_EQ(SetKernelIsa(KernelIsa::kAvx512), CpuHasAvx512());
  EXPECT_EQ(ActiveIsa(), CpuHasAvx512() ? KernelIsa::kAvx512 : KernelIsa::kScalar);
  EXPECT_STREQ(KernelIsaName(KernelIsa::kAvx512), "avx512");
  SetKernelIsa(best);
}

TEST(ValidateMatrixTest, RejectsWhatTheKernelsCannotRun) {
  uint8_t buf[4096] = {};
  EXPECT_TRUE(ValidateMatrix(DenseMatrix(GgmlType::kQ4_0, buf, 4, 64), "w").ok());
  EXPECT_EQ(DenseMatrix(GgmlType::kQ4_0, buf, 4, 64).row_bytes, 36u);
  Status s = ValidateMatrix(MatrixView{GgmlType::kQ4_1, buf, 4, 64, 40}, "blk.0.ffn_up.weight");
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("blk.0.ffn_up.weight"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("q4_1"), std::string::npos) << s.message();
  s = ValidateMatrix(MatrixView{GgmlType::kQ8_0, buf, 4, 48, 100}, "w");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("48"), std::string::npos) << s.message();
  s = ValidateMatrix(MatrixView{GgmlType::kF16, buf, 4, 64, 127}, "w");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("128"), std::string::npos) << s.message();
  EXPECT_FALSE(ValidateMatrix(MatrixView{GgmlType::kF32, nullptr, 4, 8, 32}, "w").ok());
  EXPECT_FALSE(ValidateMatrix(MatrixView{GgmlType::kF32, buf, 4, 0, 32}, "w").ok());
  EXPECT_TRUE(ValidateMatrix(MatrixView{GgmlType::kF32, nullptr, 0, 8, 32}, "w").ok());
}

TEST(KernelDeathTest, OutOfRangeRowIndexAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<uint8_t> buf(4 * 36);
  const MatrixView w = DenseMatrix(GgmlType::kQ4_0, buf.data(), 4, 64);
  std::vector<float> x(64, 1.0f), y(2);
  const std::vector<int32_t> rows = {1, 4};
  EXPECT_DEATH(GemvRows(w, rows, x.data(), y.data(), nullptr), "row index 4 out of range");
  const Activation narrow(x.data(), 1, 32);
  std::vector<float> y4(4);
  EXPECT_DEATH(Gemv(w, narrow, y4.data(), nullptr), "activation has 32 columns, weights have 64");
}

TEST(TouchCacheLinesTest, ReadsOneByteOfEveryLine) {
  std::vector<uint8_t> bytes(64 * 300 + 17);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{64}, size_t{65}, size_t{256}, size_t{1000}, bytes.size()}) {
    uint64_t expected = 0;
    for (size_t i = 0; i < n; i += 64) expected += bytes[i];
    EXPECT_EQ(TouchCacheLines(bytes.data(), n), expected) << n << " bytes";
  }
}

TEST(CacheSizeTest, ParsesSysfsSizes) {
  EXPECT_EQ(ParseCacheSize("32768K"), uint64_t{32} << 20);
  EXPECT_EQ(ParseCacheSize("48K\n"), uint64_t{48} << 10);
  EXPECT_EQ(ParseCacheSize("2M"), uint64_t{2} << 20);
  EXPECT_EQ(ParseCacheSize("1G"), uint64_t{1} << 30);
  EXPECT_EQ(ParseCacheSize("512"), 512u);
  EXPECT_EQ(ParseCacheSize(""), 0u);
  EXPECT_EQ(ParseCacheSize("K"), 0u);
  EXPECT_EQ(ParseCacheSize("12X"), 0u);
}

// LastLevelCacheBytes against the same sysfs tree walked here another way (directory iteration, streams).
TEST(CacheSizeTest, LastLevelCacheIsCpu0sHighestDataOrUnifiedCache) {
  namespace fs = std::filesystem;
  const fs::path root = "/sys/devices/system/cpu/cpu0/cache";
  int best_level = 0;
  uint64_t best = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().filename().string().rfind("index", 0) != 0) continue;
    std::string type, size;
    int level = 0;
    std::ifstream(e.path() / "type") >> type;
    std::ifstream(e.path() / "level") >> level;
    std::ifstream(e.path() / "size") >> size;
    if (type == "Instruction" || size.empty()) continue;
    uint64_t bytes = std::stoull(size);
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    if (level > best_level || (level == best_level && bytes > best)) {
      best_level = level;
      best = bytes;
    }
  }
  EXPECT_EQ(LastLevelCacheBytes(), best) << "level " << best_level;
  if (best > 0) {
    EXPECT_GE(best_level, 2);
  }
}

}  // namespace
}  // namespace nflash
