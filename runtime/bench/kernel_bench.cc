// Kernel microbenchmarks: STREAM-like memory bandwidth measured in the same run, then GEMV / sparse GEMV /
// AccumulateRows per weight type as GB/s of weights and as a fraction of that bandwidth (bw_ratio), and GEMM GFLOP/s.
//
// Also measures one core's int8 dot-product peak (vpdpbusd), the ceiling for the quantized GEMM's GFLOP/s, and the
// per-bundle checksums (Checksum/*: xxHash64 vs XXH3-64 on 8 KiB buffers, one thread).
//
// Usage: nflash_kernel_bench [--isa=scalar|avx2|avx512] [google benchmark flags]
#include <benchmark/benchmark.h>
#include <xxhash.h>
// GCC 12's AVX-512 intrinsics warn about their own _mm512_undefined_*() values (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <time.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/core/checksum.h"
#include "runtime/core/kernels.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_pool.h"

namespace nflash {
namespace {

// 1 GiB: far beyond any cache this code runs on, so every pass streams from DRAM.
constexpr size_t kStreamBytes = size_t{1} << 30;
// llama-7b FFN: n_ff x dim. The up/gate matrices are 11008 x 4096; the down matrix stored transposed has the same
// shape (one row of length dim per neuron).
constexpr int64_t kRows = 11008;
constexpr int64_t kCols = 4096;
// Weights are rotated over copies totalling at least this much, so a matrix small enough for a big L3 (Q4_0 is
// 25 MB) is still read from DRAM.
constexpr size_t kWeightWorkingSet = size_t{1} << 30;
// Sparse kernels select this fraction of the rows (PowerInfer-style activation sparsity).
constexpr double kSparseFraction = 0.10;
constexpr int kMaxThreads = 2;  // the target machines have 2 cores
constexpr int kRepetitions = 5;
constexpr double kMinTimeSeconds = 0.2;

ThreadPool* Pool(int threads) {
  static std::unique_ptr<ThreadPool> pools[kMaxThreads + 1];
  if (!pools[threads]) pools[threads] = std::make_unique<ThreadPool>(threads);
  return pools[threads].get();
}

// One 1 GiB buffer, touched once so its pages exist before anything is timed.
uint8_t* StreamBuffer() {
  static uint8_t* buf = [] {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, kStreamBytes));
    if (p == nullptr) {
      std::fprintf(stderr, "cannot allocate the 1 GiB bandwidth buffer\n");
      std::exit(1);
    }
    for (size_t i = 0; i < kStreamBytes; i += 4096) p[i] = static_cast<uint8_t>(i >> 12);
    std::memset(p, 1, kStreamBytes);
    return p;
  }();
  return buf;
}

// Read-only: an integer sum (vectorizes with any SSE level, and the result is used so nothing is elided).
uint64_t ReadPass(int threads) {
  const auto* p = reinterpret_cast<const uint64_t*>(StreamBuffer());
  const int64_t n = kStreamBytes / 8;
  uint64_t sums[kMaxThreads] = {};
  Pool(threads)->ParallelFor(n, 4096, [&](int64_t b, int64_t e, int t) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = b; i + 4 <= e; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
    sums[t] += s0 + s1 + s2 + s3;
  });
  return std::accumulate(sums, sums + kMaxThreads, uint64_t{0});
}

// Copy: the first half of the buffer into the second (bytes moved = read + written = 1 GiB).
void CopyPass(int threads) {
  uint8_t* p = StreamBuffer();
  const int64_t half = kStreamBytes / 2;
  Pool(threads)->ParallelFor(half, 1 << 20, [&](int64_t b, int64_t e, int) { std::memcpy(p + half + b, p + b, e - b); });
}

// Triad a = b + s * c over three 256 MiB double arrays (bytes moved = 3 x 256 MiB).
constexpr size_t kTriadBytes = kStreamBytes / 4;
void TriadPass(int threads) {
  auto* d = reinterpret_cast<double*>(StreamBuffer());
  const int64_t n = kTriadBytes / 8;
  double* a = d;
  const double* b = d + n;
  const double* c = d + 2 * n;
  Pool(threads)->ParallelFor(n, 4096, [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0 * c[i];
  });
}

double ReadBandwidth[kMaxThreads + 1];  // bytes per second, measured at startup

double MedianSeconds(int runs, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void MeasureBandwidth() {
  std::printf("Memory bandwidth (median of 5 passes over 1 GiB), GB/s = 1e9 bytes/s:\n");
  std::printf("  threads  read    copy    triad\n");
  for (int threads = 1; threads <= kMaxThreads; ++threads) {
    uint64_t sink = 0;
    ReadPass(threads);  // warm the pool's threads
    const double read = MedianSeconds(5, [&] { sink += ReadPass(threads); });
    const double copy = MedianSeconds(5, [&] { CopyPass(threads); });
    const double triad = MedianSeconds(5, [&] { TriadPass(threads); });
    benchmark::DoNotOptimize(sink);
    ReadBandwidth[threads] = kStreamBytes / read;
    std::printf("  %-7d  %-6.1f  %-6.1f  %-6.1f\n", threads, kStreamBytes / read / 1e9, kStreamBytes / copy / 1e9,
                3.0 * kTriadBytes / triad / 1e9);
  }
  std::fflush(stdout);
}

// Compute peak of one core for the quantized GEMM's inner instruction: `vpdpbusd` (64 int8 multiply-adds = 128
// ops, the unit the GEMM's GFLOP/s counts) on 12 independent accumulators, enough to cover its latency on current
// cores. Returns ops per second of the calling thread's CPU time, so a loaded machine understates it less than a
// wall-clock figure; 0 when the CPU lacks AVX-512 VNNI.
[[gnu::target("avx512f,avx512bw,avx512vnni")]] double VnniPeakOps() {
  constexpr int64_t kIters = 20'000'000;  // ~0.1 s at 2-4 GHz
  constexpr int kChains = 12;
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  timespec t0{}, t1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  for (int64_t it = 0; it < kIters; ++it) {
    #pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]));
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  __m512i sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  benchmark::DoNotOptimize(sum);
  const double secs = static_cast<double>(t1.tv_sec - t0.tv_sec) + 1e-9 * static_cast<double>(t1.tv_nsec - t0.tv_nsec);
  return 128.0 * kChains * static_cast<double>(kIters) / secs;
}

void MeasureComputePeak() {
  if (!CpuHasAvx512()) {
    std::printf("Compute peak: no AVX-512 VNNI on this CPU, not measured\n");
    return;
  }
  std::vector<double> runs;
  for (int i = 0; i < 3; ++i) runs.push_back(VnniPeakOps());
  std::sort(runs.begin(), runs.end());
  std::printf("Compute peak (vpdpbusd, one core, per CPU-second, median of 3): %.1f int8 GOP/s "
              "(x2 cores: %.1f); Gemm GFLOP/s below count the same ops\n",
              runs[1] / 1e9, 2 * runs[1] / 1e9);
  std::fflush(stdout);
}

void BM_MemRead(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(ReadPass(threads));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kStreamBytes);
}

void BM_MemTriad(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  for (auto _ : state) TriadPass(threads);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * kTriadBytes);
}

// Copies of one kRows x kCols matrix of `type`, back to back, filling at least kWeightWorkingSet.
struct WeightSet {
  GgmlType type;
  size_t matrix_bytes = 0;
  int copies = 0;
  uint8_t* data = nullptr;
  MatrixView Copy(int i) const {
    return DenseMatrix(type, data + static_cast<size_t>(i % copies) * matrix_bytes, kRows, kCols);
  }
};

const WeightSet& Weights(GgmlType type) {
  static WeightSet current{GgmlType::kF32};
  if (current.data != nullptr && current.type == type) return current;
  std::free(current.data);  // one type at a time keeps the footprint at ~1 GiB
  current = WeightSet{type};
  const size_t row_bytes = *RowBytes(type, kCols);
  current.matrix_bytes = row_bytes * kRows;
  current.copies = static_cast<int>((kWeightWorkingSet + current.matrix_bytes - 1) / current.matrix_bytes);
  current.data = static_cast<uint8_t*>(std::aligned_alloc(64, current.matrix_bytes * current.copies));
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> row(kCols);
  for (int64_t r = 0; r < kRows; ++r) {
    for (auto& v : row) v = normal(rng);
    (void)QuantizeRow(type, row.data(), current.data + r * row_bytes, kCols);
  }
  for (int i = 1; i < current.copies; ++i) {
    std::memcpy(current.data + i * current.matrix_bytes, current.data, current.matrix_bytes);
  }
  return current;
}

std::vector<float> RandomVector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// Sorted random subset, as a predictor's active-neuron list would be.
std::vector<int32_t> SparseRows() {
  std::vector<int32_t> all(kRows);
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(kRows * kSparseFraction));
  std::sort(all.begin(), all.end());
  return all;
}

void SetWeightCounters(benchmark::State& state, int threads, double bytes_per_iter) {
  const double bytes = bytes_per_iter * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["bw_ratio"] = benchmark::Counter(bytes / ReadBandwidth[threads], benchmark::Counter::kIsRate);
}

void BM_Gemv(benchmark::State& state, GgmlType type) {
  const int threads = static_cast<int>(state.range(0));
  const WeightSet& w = Weights(type);
  const auto x = RandomVector(kCols, 1);
  const Activation act(x.data(), 1, kCols);
  std::vector<float> y(kRows);
  int i = 0;
  for (auto _ : state) {
    Gemv(w.Copy(i++), act, y.data(), Pool(threads));
    benchmark::ClobberMemory();
  }
  SetWeightCounters(state, threads, static_cast<double>(w.matrix_bytes));
}

// The same kernel on the first 64 rows only (~150 KB to 1 MB: L2-resident): the compute ceiling of one core, to tell
// a compute-bound kernel from a memory-bound one.
constexpr int64_t kCachedRows = 64;
void BM_GemvCached(benchmark::State& state, GgmlType type) {
  const WeightSet& w = Weights(type);
  MatrixView view = w.Copy(0);
  view.rows = kCachedRows;
  const auto x = RandomVector(kCols, 1);
  const Activation act(x.data(), 1, kCols);
  std::vector<float> y(kCachedRows);
  for (auto _ : state) {
    Gemv(view, act, y.data(), nullptr);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kCachedRows * view.row_bytes));
}

void BM_GemvRows(benchmark::State& state, GgmlType type) {
  const int threads = static_cast<int>(state.range(0));
  const WeightSet& w = Weights(type);
  const auto x = RandomVector(kCols, 1);
  const Activation act(x.data(), 1, kCols);
  const auto rows = SparseRows();
  std::vector<float> y(rows.size());
  int i = 0;
  for (auto _ : state) {
    GemvRows(w.Copy(i++), rows, act, y.data(), Pool(threads));
    benchmark::ClobberMemory();
  }
  SetWeightCounters(state, threads, static_cast<double>(rows.size() * w.Copy(0).row_bytes));
}

void BM_AccumulateRows(benchmark::State& state, GgmlType type) {
  const int threads = static_cast<int>(state.range(0));
  const WeightSet& w = Weights(type);
  const auto rows = SparseRows();
  const auto a = RandomVector(static_cast<int64_t>(rows.size()), 2);
  std::vector<float> y(kCols, 0.0f);
  int i = 0;
  for (auto _ : state) {
    AccumulateRows(w.Copy(i++), rows, a.data(), y.data(), Pool(threads));
    benchmark::ClobberMemory();
  }
  SetWeightCounters(state, threads, static_cast<double>(rows.size() * w.Copy(0).row_bytes));
}

void BM_Gemm(benchmark::State& state, GgmlType type) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t n = state.range(1);
  const WeightSet& w = Weights(type);
  const auto x = RandomVector(n * kCols, 3);
  const Activation act(x.data(), n, kCols);
  std::vector<float> y(n * kRows);
  for (auto _ : state) {
    Gemm(w.Copy(0), act, y.data(), Pool(threads));
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kRows * kCols * n * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

// Per-bundle checksums as the offloaded runtime computes them: one hash per buffer of kChecksumBytes (a llama-7b Q4_0
// bundle is 6912 B, its up+down part 4608 B; 8 KiB is one padded group), on one thread. Arg 0: the same buffer
// every time (L1-resident: the hash's own speed); arg 1: consecutive buffers of the 1 GiB stream buffer (from DRAM,
// like bundles that just arrived from flash and are not in cache).
constexpr size_t kChecksumBytes = 8192;
template <uint64_t (*Hash)(const void*, size_t)>
void BM_Checksum(benchmark::State& state) {
  const bool from_dram = state.range(0) != 0;
  const uint8_t* base = StreamBuffer();
  const size_t chunks = from_dram ? kStreamBytes / kChecksumBytes : 1;
  size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(Hash(base + (i % chunks) * kChecksumBytes, kChecksumBytes));
    ++i;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kChecksumBytes));
}
uint64_t HashXxh64(const void* p, size_t n) { return Xxh64(p, n); }
// libxxhash's plain XXH3_64bits entry, for comparison with Xxh3's dispatched one: Debian's 0.8.1 build of it is much
// slower than the dispatched AVX2/AVX-512 loop (and than XXH64) on this machine, which is why Xxh3 never calls it.
uint64_t HashXxh3Plain(const void* p, size_t n) { return XXH3_64bits(p, n); }

void Register() {
  auto common = [](benchmark::internal::Benchmark* b) {
    b->UseRealTime()->Repetitions(kRepetitions)->ReportAggregatesOnly(true)->MinTime(kMinTimeSeconds);
    b->Unit(benchmark::kMillisecond);
  };
  common(benchmark::RegisterBenchmark("MemRead", BM_MemRead)->Arg(1)->Arg(2)->ArgName("threads"));
  common(benchmark::RegisterBenchmark("MemTriad", BM_MemTriad)->Arg(1)->Arg(2)->ArgName("threads"));
  auto checksum = [&](const char* name, void (*fn)(benchmark::State&)) {
    auto* b = benchmark::RegisterBenchmark(name, fn)->Arg(0)->Arg(1)->ArgName("dram");
    common(b);
    b->Unit(benchmark::kNanosecond);
  };
  checksum("Checksum/xxh64", BM_Checksum<HashXxh64>);
  checksum("Checksum/xxh3", BM_Checksum<Xxh3>);
  checksum("Checksum/xxh3_plain", BM_Checksum<HashXxh3Plain>);
  const GgmlType types[] = {GgmlType::kQ4_0, GgmlType::kQ8_0, GgmlType::kF16, GgmlType::kBF16, GgmlType::kF32};
  for (GgmlType t : types) {
    const std::string name(GgmlTypeName(t));
    common(benchmark::RegisterBenchmark(("Gemv/" + name).c_str(), BM_Gemv, t)->Arg(1)->Arg(2)->ArgName("threads"));
    common(benchmark::RegisterBenchmark(("GemvL2/" + name).c_str(), BM_GemvCached, t));
    common(benchmark::RegisterBenchmark(("GemvRows10/" + name).c_str(), BM_GemvRows, t)
               ->Arg(1)->Arg(2)->ArgName("threads"));
    common(benchmark::RegisterBenchmark(("AccumulateRows10/" + name).c_str(), BM_AccumulateRows, t)
               ->Arg(1)->Arg(2)->ArgName("threads"));
    common(benchmark::RegisterBenchmark(("Gemm/" + name).c_str(), BM_Gemm, t)
               ->Args({1, 32})->Args({2, 32})->Args({2, 128})->ArgNames({"threads", "n"}));
  }
}

}  // namespace
}  // namespace nflash

int main(int argc, char** argv) {
  // Our own flag first: --isa=NAME forces those kernels (the default is the best the CPU has).
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--isa=", 6) == 0) {
      bool known = false;
      nflash::KernelIsa isa = nflash::KernelIsa::kScalar;
      for (nflash::KernelIsa k : {nflash::KernelIsa::kScalar, nflash::KernelIsa::kAvx2, nflash::KernelIsa::kAvx512}) {
        if (std::strcmp(argv[i] + 6, nflash::KernelIsaName(k)) == 0) known = true, isa = k;
      }
      if (!known) {
        std::fprintf(stderr, "unknown %s (expected scalar, avx2 or avx512)\n", argv[i]);
        return 2;
      }
      if (!nflash::SetKernelIsa(isa)) {
        std::fprintf(stderr, "this CPU cannot run %s\n", argv[i]);
        return 2;
      }
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      --i;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  std::printf("Kernel ISA: %s\n", nflash::KernelIsaName(nflash::ActiveIsa()));
  nflash::MeasureBandwidth();
  nflash::MeasureComputePeak();
  nflash::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
