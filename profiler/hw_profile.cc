// Measures the hardware profile: kernels (runtime/core/kernels.h) per thread count, memory bandwidth, and flash
// through the runtime's own reader (runtime/io/direct_reader.h), so the numbers are what the sparse runtime gets.
#include "profiler/hw_profile.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "profiler/median_timing.h"
#include "runtime/core/block_device.h"
#include "runtime/core/cpu_affinity.h"
#include "runtime/core/kernels.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"
#include "runtime/core/thread_placement.h"
#include "runtime/core/thread_pool.h"
#include "runtime/io/direct_reader.h"

namespace nflash::profiler {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Sizes of the two modes. Full: a 4096x4096 matrix (a 7B model's attention projection, 64 MiB in F32: well beyond the
// last-level cache in F32, as real weights are); a 1 GiB buffer for bandwidth; a 2 GiB flash file (larger than any
// device cache we expect in front of the flash); 250 ms per cell (enough requests for a P99 even at QD 1 on a noisy
// shared disk; whole run about a minute, budget 3 min). Quick: the
// same shapes scaled down so the run takes seconds (CI, smoke tests); its numbers are indicative only.
struct Mode {
  int64_t matrix_dim;
  size_t memory_bytes;
  uint64_t file_bytes;
  double cell_seconds;
  double seq_cell_seconds;
  size_t cold_weight_bytes;  // copies of the compute matrix used in turn (see MakeWeights)
};
constexpr Mode kFullMode{4096, size_t{1} << 30, uint64_t{2} << 30, 0.25, 0.5, size_t{256} << 20};
constexpr Mode kQuickMode{1024, size_t{128} << 20, uint64_t{256} << 20, 0.02, 0.05, size_t{64} << 20};

// 10% of rows: the activation density PowerInfer-2 reports for ReLU-fied FFNs, what GemvRows/AccumulateRows serve.
constexpr double kSparseFraction = 0.10;
// Writes of 4 MiB: large enough to reach the device's sequential bandwidth, as the packer writes.
constexpr size_t kWriteBlock = size_t{4} << 20;
const std::vector<size_t> kRandomSizes = {4096, 8192, 16384, 32768, 65536, 131072};
const std::vector<unsigned> kQueueDepths = {1, 2, 4, 8, 16, 32, 64};
const std::vector<size_t> kSeqSizes = {size_t{1} << 20, size_t{4} << 20};
const std::vector<unsigned> kSeqDepths = {4, 8};

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "unknown";
}

// Other processes compete for the cores and the disk; the 1-minute load average at the start says how much.
double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

json MachineInfo() {
  utsname u{};
  uname(&u);
  const uint64_t ram = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return {{"cpu_model", CpuModel()},
          {"hardware_threads", ThreadPool::HardwareThreads()},
          {"isa", KernelIsaName(ActiveIsa())},
          {"ram_bytes", ram},
          {"kernel", std::string(u.sysname) + " " + u.release},
          {"load_average_1m", LoadAverage()}};
}

// ---- threads -------------------------------------------------------------------------------------------------------

// One pool per thread count, placed as the decode places its compute threads (PlanThreadCpus under the same
// --pin-threads policy, fastest CPUs first by CpuCapacities): on big and little cores the decode's threads run on the
// fastest CPUs, and a cell timed wherever the scheduler happened to put its threads would rate other cores. Enter(i),
// untimed before each of pool i's calls, moves the calling thread and pool i's workers to pool i's CPUs; the
// destructor gives every thread its CPUs back.
class PlacedPools {
 public:
  PlacedPools(const std::vector<int>& thread_counts, PinThreads policy)
      : thread_counts_(thread_counts), allowed_(ThreadCpus(pthread_self())), capacity_(CpuCapacities(allowed_)) {
    for (int threads : thread_counts) {
      pools_.push_back(std::make_unique<ThreadPool>(threads));
      std::optional<ThreadCpuPlan> plan = PlanThreadCpus(policy, threads, allowed_, {}, capacity_);
      if (plan) placements_.emplace_back(std::in_place, *plan, pools_.back()->WorkerHandles(), std::nullopt);
      else placements_.emplace_back(std::nullopt);
    }
    observed_.resize(pools_.size());
  }
  ~PlacedPools() { Leave(); }
  PlacedPools(const PlacedPools&) = delete;
  PlacedPools& operator=(const PlacedPools&) = delete;

  size_t size() const { return pools_.size(); }
  int threads(size_t i) const { return thread_counts_[i]; }
  ThreadPool& pool(size_t i) { return *pools_[i]; }
  ThreadPool& largest() { return *pools_.back(); }

  void Enter(size_t i) {
    if (current_ == static_cast<int>(i)) return;
    Leave();
    current_ = static_cast<int>(i);
    if (!placements_[i]) return;
    if (Status st = placements_[i]->Begin(); !st.ok()) {
      NF_LOG(Warning) << "profile-hw: " << thread_counts_[i] << " thread(s) not pinned: " << st.message();
      placements_[i].reset();
    }
  }

  // Enter(i), then wakes pool i's workers (untimed, before each timed call): a decode calls its pool hundreds of
  // times a token, microseconds apart, so its workers are spinning when a call starts. Timed in turns after another
  // pool's call, they would have gone to sleep and every call would include waking them (tens of microseconds on a
  // VM): the cells' calls take 40-400 us, and two profiles of this project's 2-vCPU machine minutes apart rated the
  // 2-thread neuron path 12.5 and 18.2 GB/s, the lower one below what the in-memory decode achieved.
  void Ready(size_t i) {
    Enter(i);
    OnEveryThread(i, [](int64_t) {});
  }

  // Records the CPUs pool i's threads run on now, for the profile: what the placement achieved, not what it asked
  // for.
  void Observe(size_t i) {
    Enter(i);
    std::vector<int> seen(static_cast<size_t>(pools_[i]->NumThreads()), -1);
    for (int job = 0; job < 4; ++job) {
      OnEveryThread(i, [&](int64_t chunk) { seen[static_cast<size_t>(chunk)] = sched_getcpu(); });
      for (int cpu : seen) {
        if (cpu >= 0) observed_[i].insert(cpu);
      }
    }
  }

  json Describe() const {
    json pools = json::array();
    for (size_t i = 0; i < pools_.size(); ++i) {
      json cpus = nullptr;
      if (placements_[i]) {
        const ThreadCpuPlan& p = placements_[i]->plan();
        cpus = json::array({p.caller});
        for (int w : p.workers) cpus.push_back(w);
      }
      pools.push_back({{"threads", thread_counts_[i]},
                       {"cpus", cpus},
                       {"observed_cpus", std::vector<int>(observed_[i].begin(), observed_[i].end())}});
    }
    std::vector<uint64_t> capacity;
    for (int c : allowed_) {
      capacity.push_back(static_cast<size_t>(c) < capacity_.size() ? capacity_[static_cast<size_t>(c)] : 0);
    }
    return {{"allowed_cpus", allowed_}, {"cpu_capacity", capacity_.empty() ? json(nullptr) : json(capacity)},
            {"pools", pools}};
  }

 private:
  // One job of pool i with a chunk per thread: each chunk calls fn(chunk) and then waits (up to 100 ms) for every
  // chunk to start, so that no thread takes two and every worker has run when it returns.
  template <typename Fn>
  void OnEveryThread(size_t i, Fn&& fn) {
    const int n = pools_[i]->NumThreads();
    std::atomic<int> started{0};
    pools_[i]->ParallelFor(n, 1, [&](int64_t begin, int64_t, int) {
      fn(begin);
      started.fetch_add(1);
      const auto deadline = Clock::now() + std::chrono::milliseconds(100);
      while (started.load() < n && Clock::now() < deadline) std::this_thread::yield();
    });
  }
  void Leave() {
    if (current_ >= 0 && placements_[static_cast<size_t>(current_)]) placements_[static_cast<size_t>(current_)]->End();
    current_ = -1;
  }
  std::vector<int> thread_counts_;
  std::vector<int> allowed_;
  std::vector<uint64_t> capacity_;
  std::vector<std::unique_ptr<ThreadPool>> pools_;
  std::vector<std::optional<ThreadPlacement>> placements_;
  std::vector<std::set<int>> observed_;
  int current_ = -1;
};

// ---- compute -------------------------------------------------------------------------------------------------------

// Several copies of one quantized matrix, used in turn: a real model's weights are far larger than the last-level
// cache, so each matrix comes from DRAM; timing one small matrix over and over would measure the cache instead.
// Full mode: 256 MiB of copies, several times any server or phone LLC; quick mode: 64 MiB, still above most LLCs.

struct Weights {
  GgmlType type;
  std::vector<uint8_t> bytes;    // `copies` matrices back to back
  std::vector<MatrixView> views;  // one per copy
  size_t matrix_bytes = 0;
};

Weights MakeWeights(GgmlType type, int64_t dim, const std::vector<float>& values, size_t cold_bytes,
                    ThreadPool* pool) {
  Weights w{type, {}, {}, 0};
  const size_t row_bytes = *RowBytes(type, static_cast<uint64_t>(dim));
  w.matrix_bytes = row_bytes * static_cast<size_t>(dim);
  const size_t copies = std::max<size_t>(2, cold_bytes / w.matrix_bytes);
  w.bytes.resize(w.matrix_bytes * copies);
  pool->ParallelFor(dim, 16, [&](int64_t begin, int64_t end, int) {
    for (int64_t r = begin; r < end; ++r) {
      (void)QuantizeRow(type, values.data() + r * dim, w.bytes.data() + r * row_bytes, dim);
    }
  });
  for (size_t c = 1; c < copies; ++c) {
    std::memcpy(w.bytes.data() + c * w.matrix_bytes, w.bytes.data(), w.matrix_bytes);
  }
  for (size_t c = 0; c < copies; ++c) w.views.push_back(DenseMatrix(type, w.bytes.data() + c * w.matrix_bytes, dim, dim));
  return w;
}

json MeasureCompute(const Mode& mode, PlacedPools& pools) {
  const int64_t dim = mode.matrix_dim;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(static_cast<size_t>(dim * dim));
  for (float& v : values) v = normal(rng);
  constexpr int64_t kMaxTokens = 128;  // the prefill batch of the GEMM cells
  std::vector<float> x(static_cast<size_t>(kMaxTokens * dim));
  for (float& v : x) v = normal(rng) * 50.0f;
  std::vector<float> y(static_cast<size_t>(kMaxTokens * dim));
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::lround(kSparseFraction * dim)));
  // 7 random row sets used in turn (7: coprime with the number of copies in practice, so matrix and row set
  // combinations cycle slowly): repeating one set on few copies would keep its rows in the LLC.
  constexpr int kRowSets = 7;
  std::vector<std::vector<int32_t>> row_sets(kRowSets);
  for (auto& rows : row_sets) {
    rows.resize(static_cast<size_t>(dim));
    for (int64_t i = 0; i < dim; ++i) rows[i] = static_cast<int32_t>(i);
    std::shuffle(rows.begin(), rows.end(), rng);
    rows.resize(static_cast<size_t>(k));
    std::sort(rows.begin(), rows.end());
  }
  size_t row_turn = 0;
  auto next_rows = [&]() -> std::span<const int32_t> { return row_sets[row_turn++ % kRowSets]; };

  json results = json::array();
  // One type at a time so only one set of copies is in memory.
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    const Weights w = MakeWeights(type, dim, values, mode.cold_weight_bytes, &pools.largest());
    size_t turn = 0;
    auto next = [&]() -> const MatrixView& { return w.views[turn++ % w.views.size()]; };
    // neuron_path's row addresses and outputs (k neurons).
    std::vector<const uint8_t*> gate_up_ptrs(2 * static_cast<size_t>(k)), down_ptrs(static_cast<size_t>(k));
    std::vector<float> gate_up(2 * static_cast<size_t>(k)), neuron_h(static_cast<size_t>(k));
    const double bytes = static_cast<double>(w.matrix_bytes);
    // One cell: `call(pool)` timed with every thread count in turns (MedianSecondsEach), a result row each.
    auto cell = [&](const char* kernel, int64_t tokens, double fraction, auto&& call) {
      const std::vector<double> secs = MedianSecondsEach(
          mode.cell_seconds, pools.size(), [&](size_t pi) { call(pools.pool(pi)); }, [&](size_t pi) { pools.Ready(pi); });
      const double weight_bytes = bytes * fraction;
      const double flops =
          2.0 * static_cast<double>(dim) * static_cast<double>(dim) * fraction * static_cast<double>(tokens);
      for (size_t pi = 0; pi < pools.size(); ++pi) {
        results.push_back({{"threads", pools.threads(pi)},
                           {"kernel", kernel},
                           {"type", std::string(GgmlTypeName(type))},
                           {"tokens", tokens},
                           {"row_fraction", fraction},
                           {"seconds_per_call", secs[pi]},
                           {"weight_gb_per_s", weight_bytes / secs[pi] / 1e9},
                           {"gflop_per_s", flops / secs[pi] / 1e9}});
      }
    };
    Activation act;
    act.Set(x.data(), 1, dim);
    cell("gemv", 1, 1.0, [&](ThreadPool& pool) { Gemv(next(), act, y.data(), &pool); });
    for (int64_t n : {int64_t{8}, kMaxTokens}) {
      Activation batch(x.data(), n, dim);
      cell("gemm", n, 1.0, [&](ThreadPool& pool) { Gemm(next(), batch, y.data(), &pool); });
    }
    const double frac = static_cast<double>(k) / static_cast<double>(dim);
    cell("gemv_rows", 1, frac, [&](ThreadPool& pool) { GemvRows(next(), next_rows(), act, y.data(), &pool); });
    cell("accumulate_rows", 1, frac, [&](ThreadPool& pool) {
      std::fill(y.begin(), y.begin() + dim, 0.0f);
      AccumulateRows(next(), next_rows(), x.data(), y.data(), &pool);
    });
    // The offloaded decode's per-neuron path (runtime/sparse/offload_ffn.cc ComputeItems): the active neurons'
    // gate and up rows, scattered over the cache (rows of two different matrices here), in one GemvRowPtrs call
    // over their addresses, the activation, then one AccumulateRowPtrs over the down rows of the neurons in use.
    // Row addresses defeat the hardware prefetchers that contiguous GemvRows rows enjoy, so this rate, not
    // gemv_rows, is what the planner's FFN compute term needs. Weight bytes counted: 3 rows per neuron.
    cell("neuron_path", 1, 3.0 * frac, [&](ThreadPool& pool) {
      const MatrixView& gate = next();
      const MatrixView& up = next();
      const MatrixView& down = next();
      const std::span<const int32_t> rows = next_rows();
      const size_t n = rows.size();
      for (size_t j = 0; j < n; ++j) {
        const size_t off = static_cast<size_t>(rows[j]) * gate.row_bytes;
        gate_up_ptrs[2 * j] = static_cast<const uint8_t*>(gate.data) + off;
        gate_up_ptrs[2 * j + 1] = static_cast<const uint8_t*>(up.data) + off;
        down_ptrs[j] = static_cast<const uint8_t*>(down.data) + off;
      }
      GemvRowPtrs(gate, std::span(gate_up_ptrs.data(), 2 * n), act, gate_up.data(), &pool);
      for (size_t j = 0; j < n; ++j) neuron_h[j] = std::max(0.0f, gate_up[2 * j]) * gate_up[2 * j + 1];
      std::fill(y.begin(), y.begin() + dim, 0.0f);
      AccumulateRowPtrs(down, std::span(down_ptrs.data(), n), neuron_h.data(), y.data(), &pool);
    });
  }
  // Grouped by thread count, as the report prints them.
  std::stable_sort(results.begin(), results.end(), [](const json& a, const json& b) {
    return a["threads"].get<int>() < b["threads"].get<int>();
  });
  return {{"matrix_rows", dim}, {"matrix_cols", dim}, {"results", results}};
}

json MeasureMemory(const Mode& mode, PlacedPools& pools) {
  const size_t words = mode.memory_bytes / sizeof(uint64_t);
  std::vector<uint64_t> buf(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;  // touches every page before timing
  json results = json::array();
  volatile uint64_t sink = 0;  // keeps the reads from being optimised away
  auto ready = [&](size_t pi) { pools.Ready(pi); };
  // Each cell with every thread count in turns (MedianSecondsEach).
  const std::vector<double> read_s = MedianSecondsEach(mode.seq_cell_seconds, pools.size(), [&](size_t pi) {
    ThreadPool& pool = pools.pool(pi);
    std::vector<uint64_t> partial(static_cast<size_t>(pool.NumThreads()), 0);
    pool.ParallelFor(static_cast<int64_t>(words), 4096, [&](int64_t b, int64_t e, int t) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // independent sums so loads are not serialized
      int64_t i = b;
      for (; i + 4 <= e; i += 4) {
        s0 += buf[i];
        s1 += buf[i + 1];
        s2 += buf[i + 2];
        s3 += buf[i + 3];
      }
      for (; i < e; ++i) s0 += buf[i];
      partial[static_cast<size_t>(t)] += s0 + s1 + s2 + s3;
    });
    for (uint64_t p : partial) sink = sink + p;
  }, ready);
  // Copy: the first half onto the second; reported as bytes copied per second (each read once, written once).
  const size_t half = words / 2;
  const std::vector<double> copy_s = MedianSecondsEach(mode.seq_cell_seconds, pools.size(), [&](size_t pi) {
    pools.pool(pi).ParallelFor(static_cast<int64_t>(half), 4096, [&](int64_t b, int64_t e, int) {
      std::memcpy(buf.data() + half + b, buf.data() + b, static_cast<size_t>(e - b) * sizeof(uint64_t));
    });
  }, ready);
  for (size_t pi = 0; pi < pools.size(); ++pi) {
    results.push_back({{"threads", pools.threads(pi)},
                       {"buffer_bytes", mode.memory_bytes},
                       {"read_gb_per_s", static_cast<double>(mode.memory_bytes) / read_s[pi] / 1e9},
                       {"copy_gb_per_s", static_cast<double>(half * sizeof(uint64_t)) / copy_s[pi] / 1e9}});
  }
  return results;
}

// ---- flash ---------------------------------------------------------------------------------------------------------

struct LatencyStats {
  double mean_us = 0, p50_us = 0, p99_us = 0;
};

LatencyStats Summarize(std::vector<uint32_t> ns) {
  LatencyStats s;
  if (ns.empty()) return s;
  std::sort(ns.begin(), ns.end());
  double sum = 0;
  for (uint32_t v : ns) sum += v;
  s.mean_us = sum / static_cast<double>(ns.size()) / 1e3;
  s.p50_us = ns[ns.size() / 2] / 1e3;
  s.p99_us = ns[std::min(ns.size() - 1, ns.size() * 99 / 100)] / 1e3;
  return s;
}

// Fills with a xorshift stream so no layer below (compression, deduplication, zero detection) can shortcut the I/O.
void FillPseudoRandom(uint8_t* p, size_t n, uint64_t seed) {
  uint64_t s = seed | 1;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    std::memcpy(p + i, &s, 8);
  }
}

struct ScratchFile {
  int fd = -1;
  bool direct = false;
  ~ScratchFile() {
    if (fd >= 0) ::close(fd);
  }
};

// Creates the test file, unlinks its name at once (so it disappears with the process whatever happens), and writes it
// sequentially with O_DIRECT when the filesystem allows; returns the write throughput in the json.
Status CreateScratchFile(const std::string& dir, uint64_t bytes, ScratchFile* file, json* write_result) {
  const std::string path = dir + "/.nflash-profile-hw-" + std::to_string(::getpid()) + ".tmp";
  file->fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  file->direct = file->fd >= 0;
  if (file->fd < 0 && errno == EINVAL) {
    NF_LOG(Warning) << "--dir " << dir << ": the filesystem refuses O_DIRECT; flash numbers include the page cache";
    file->fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (file->fd < 0) return Status::FromErrno("--dir " + dir + ": cannot create the test file " + path, errno);
  ::unlink(path.c_str());

  NF_ASSIGN_OR_RETURN(auto block, io::AlignedArena::Create(kWriteBlock, 1, io::kDefaultDirectAlignment));
  FillPseudoRandom(block->data(), kWriteBlock, 99);
  ProgressBar bar("profile-hw: writing the flash test file", bytes);
  const auto t0 = Clock::now();
  for (uint64_t off = 0; off < bytes; off += kWriteBlock) {
    reinterpret_cast<uint64_t*>(block->data())[0] = off;  // every block differs
    size_t done = 0;
    while (done < kWriteBlock) {
      const ssize_t n = ::pwrite(file->fd, block->data() + done, kWriteBlock - done, static_cast<off_t>(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno("--dir " + dir + ": writing the test file at offset " +
                                              std::to_string(off + done), errno);
      done += static_cast<size_t>(n);
    }
    bar.Update(off + kWriteBlock);
  }
  if (::fdatasync(file->fd) != 0) return Status::FromErrno("--dir " + dir + ": fdatasync of the test file", errno);
  const double secs = Seconds(t0, Clock::now());
  bar.Finish();
  // Drop whatever the page cache holds (only matters in the buffered fallback; O_DIRECT bypasses it anyway).
  ::posix_fadvise(file->fd, 0, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  *write_result = {{"block_bytes", kWriteBlock},
                   {"bytes", bytes},
                   {"direct_io", file->direct},
                   {"mb_per_s", static_cast<double>(bytes) / secs / 1e6}};
  return Status::Ok();
}

// One cell: reads of `size` bytes (random 4 KiB-aligned offsets, or sequential wrapping around the file) with
// `depth` reads in flight, for `budget` seconds, through a DirectReader with that queue depth.
Result<json> ReadCell(int fd, const std::string& name, uint64_t file_bytes, size_t size, unsigned depth,
                      bool sequential, double budget, std::mt19937_64* rng) {
  io::DirectReaderOptions opt;
  opt.queue_depth = depth;
  const int dup_fd = ::dup(fd);
  if (dup_fd < 0) return Status::FromErrno("dup of the test file descriptor", errno);
  NF_ASSIGN_OR_RETURN(auto reader, io::DirectReader::FromFd(dup_fd, name, opt));
  NF_ASSIGN_OR_RETURN(auto arena, reader->CreateArena(size, depth));
  // A batch of 8x the queue depth keeps the queue full most of the time (it drains only at the batch's end) while
  // checking the clock often enough to respect the cell's budget.
  const size_t batch_size = std::max<size_t>(8 * depth, 16);
  const uint64_t slots = (file_bytes - size) / 4096 + 1;
  std::vector<ReadRequest> batch(batch_size);
  std::vector<double> batch_mb_per_s;  // one per batch: a median that one stall of a shared disk cannot drag down
  uint64_t seq_offset = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    for (size_t i = 0; i < batch_size; ++i) {
      uint64_t off;
      if (sequential) {
        if (seq_offset + size > file_bytes) seq_offset = 0;
        off = seq_offset;
        seq_offset += size;
      } else {
        off = ((*rng)() % slots) * 4096;
      }
      batch[i] = {off, size, arena->Slot(i % depth)};
    }
    const auto b0 = Clock::now();
    NF_RETURN_IF_ERROR(reader->ReadBatch(batch));
    const auto b1 = Clock::now();
    batch_mb_per_s.push_back(static_cast<double>(batch_size * size) / Seconds(b0, b1) / 1e6);
    elapsed = Seconds(t0, b1);
  } while (elapsed < budget);
  std::sort(batch_mb_per_s.begin(), batch_mb_per_s.end());
  const io::IoCounters c = reader->Counters();
  const LatencyStats lat = Summarize(reader->LatencySampleNs());
  return json{{"block_bytes", size},
              {"queue_depth", depth},
              {"requests", c.requests},
              {"mb_per_s", static_cast<double>(c.bytes) / elapsed / 1e6},
              {"mb_per_s_median_batch", batch_mb_per_s[batch_mb_per_s.size() / 2]},
              {"batches", batch_mb_per_s.size()},
              {"iops", static_cast<double>(c.requests) / elapsed},
              {"latency_mean_us", lat.mean_us},
              {"latency_p50_us", lat.p50_us},
              {"latency_p99_us", lat.p99_us},
              {"submit_cpu_us_per_request",
               c.requests ? static_cast<double>(c.submit_cpu_ns) / 1e3 / static_cast<double>(c.requests) : 0.0}};
}

// Synchronous pread on the O_DIRECT descriptor (the "llmflash" baseline: one read at a time).
Result<json> PreadCell(int fd, const std::string& name, uint64_t file_bytes, size_t size, double budget,
                       std::mt19937_64* rng) {
  const int dup_fd = ::dup(fd);
  if (dup_fd < 0) return Status::FromErrno("dup of the test file descriptor", errno);
  NF_ASSIGN_OR_RETURN(auto reader, io::DirectReader::FromFd(dup_fd, name, {}));
  NF_ASSIGN_OR_RETURN(auto arena, reader->CreateArena(size, 1));
  const uint64_t slots = (file_bytes - size) / 4096 + 1;
  std::vector<uint32_t> lat;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    const auto a = Clock::now();
    NF_RETURN_IF_ERROR(reader->PreadAt(((*rng)() % slots) * 4096, size, arena->Slot(0)));
    lat.push_back(static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - a).count()));
    elapsed = Seconds(t0, Clock::now());
  } while (elapsed < budget);
  const LatencyStats s = Summarize(lat);
  return json{{"block_bytes", size},
              {"requests", lat.size()},
              {"mb_per_s", static_cast<double>(lat.size() * size) / elapsed / 1e6},
              {"iops", static_cast<double>(lat.size()) / elapsed},
              {"latency_mean_us", s.mean_us},
              {"latency_p50_us", s.p50_us},
              {"latency_p99_us", s.p99_us}};
}

Result<json> MeasureFlash(const Mode& mode, const std::string& dir) {
  const FilesystemInfo fs_info = DescribeFilesystem(dir);
  const BlockQueueInfo disk = DescribeBlockQueue(dir);
  if (fs_info.tmpfs) {
    NF_LOG(Warning) << "--dir " << dir << " is on tmpfs (RAM): the flash numbers will measure memory, not flash";
  }
  ScratchFile file;
  json write;
  NF_RETURN_IF_ERROR(CreateScratchFile(dir, mode.file_bytes, &file, &write));
  const bool direct = file.direct && !fs_info.tmpfs;
  const std::string name = dir + "/.nflash-profile-hw (unlinked)";
  std::mt19937_64 rng(4321);

  json random = json::array();
  ProgressBar bar("profile-hw: flash reads", kRandomSizes.size() * kQueueDepths.size() + kSeqSizes.size() * 2, "");
  uint64_t cells = 0;
  for (size_t size : kRandomSizes) {
    for (unsigned depth : kQueueDepths) {
      NF_ASSIGN_OR_RETURN(json cell,
                          ReadCell(file.fd, name, mode.file_bytes, size, depth, false, mode.cell_seconds, &rng));
      random.push_back(std::move(cell));
      bar.Update(++cells);
    }
  }
  json sequential = json::array();
  for (size_t size : kSeqSizes) {
    for (unsigned depth : kSeqDepths) {
      NF_ASSIGN_OR_RETURN(json cell,
                          ReadCell(file.fd, name, mode.file_bytes, size, depth, true, mode.seq_cell_seconds, &rng));
      sequential.push_back(std::move(cell));
    }
    bar.Update(cells += 2);
  }
  bar.Finish();
  json pread = json::array();
  for (size_t size : {size_t{4096}, size_t{65536}}) {
    NF_ASSIGN_OR_RETURN(json cell, PreadCell(file.fd, name, mode.file_bytes, size, mode.cell_seconds, &rng));
    pread.push_back(std::move(cell));
  }
  return json{{"dir", dir},
              {"filesystem", fs_info.type},
              {"device", fs_info.device},
              {"mount_point", fs_info.mount_point},
              {"block_device", disk.device},
              {"io_scheduler", disk.scheduler},
              {"direct_io", direct},
              {"direct_alignment_bytes", io::QueryDirectAlignment(file.fd)},
              {"file_bytes", mode.file_bytes},
              {"random_read", random},
              {"sequential_read", sequential},
              {"sync_pread", pread},
              {"sequential_write", write}};
}

}  // namespace

FilesystemInfo DescribeFilesystem(const std::string& path) {
  FilesystemInfo info;
  info.tmpfs = OnMemoryFilesystem(path);
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return info;
  const std::string want = std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  std::error_code ec;
  const std::string canonical = std::filesystem::canonical(path, ec).string();
  // mountinfo: "id parent major:minor root mount_point options [optional...] - fstype source superoptions"
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  size_t best = 0;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string id, parent, devno, root, mount;
    ss >> id >> parent >> devno >> root >> mount;
    if (devno != want) continue;
    const auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream rest(line.substr(dash + 3));
    std::string type, source;
    rest >> type >> source;
    const bool prefix = canonical.rfind(mount, 0) == 0;
    if (mount.size() + 1 > best && (prefix || best == 0)) {
      best = mount.size() + 1;
      info.type = type;
      info.device = source;
      info.mount_point = mount;
    }
  }
  if (info.tmpfs && info.type == "unknown") info.type = "tmpfs";
  return info;
}

Result<json> MeasureHardware(const HwProfileOptions& options) {
  const Mode& mode = options.quick ? kQuickMode : kFullMode;
  std::vector<int> threads = options.threads;
  if (threads.empty()) {
    for (int t = 1; t <= ThreadPool::HardwareThreads(); ++t) threads.push_back(t);
  }
  const auto t0 = Clock::now();
  json profile = {{"format", "nflash.hw_profile"}, {"version", kHwProfileVersion}, {"quick", options.quick}};
  profile["machine"] = MachineInfo();
  NF_LOG(Info) << "profile-hw: compute kernels (" << mode.matrix_dim << "x" << mode.matrix_dim << ")";
  json compute;
  {
    PlacedPools pools(threads, options.pin_threads);
    compute = MeasureCompute(mode, pools);
    NF_LOG(Info) << "profile-hw: memory bandwidth (" << (mode.memory_bytes >> 20) << " MiB)";
    compute["memory"] = MeasureMemory(mode, pools);
    for (size_t i = 0; i < pools.size(); ++i) pools.Observe(i);
    compute["placement"] = pools.Describe();
    compute["placement"]["policy"] = PinThreadsName(options.pin_threads);
  }
  profile["compute"] = std::move(compute);
  NF_LOG(Info) << "profile-hw: flash in " << options.dir << " (" << (mode.file_bytes >> 20) << " MiB test file)";
  NF_ASSIGN_OR_RETURN(profile["flash"], MeasureFlash(mode, options.dir));
  profile["duration_seconds"] = Seconds(t0, Clock::now());
  return profile;
}

std::string FormatHwProfile(const json& p) {
  std::ostringstream os;
  char line[256];
  const json& m = p["machine"];
  os << "machine: " << m["cpu_model"].get<std::string>() << ", " << m["hardware_threads"].get<int>()
     << " threads, ISA " << m["isa"].get<std::string>() << ", RAM "
     << m["ram_bytes"].get<uint64_t>() / (1ull << 20) << " MiB, " << m["kernel"].get<std::string>()
     << ", load average " << m["load_average_1m"].get<double>() << " at start\n\n";
  os << "compute (" << p["compute"]["matrix_rows"].get<int64_t>() << "x" << p["compute"]["matrix_cols"].get<int64_t>()
     << ", median per call)\n";
  std::snprintf(line, sizeof line, "%7s %-16s %-5s %6s %9s %11s %10s\n", "threads", "kernel", "type", "tokens",
                "rows", "weight GB/s", "GFLOP/s");
  os << line;
  for (const json& r : p["compute"]["results"]) {
    std::snprintf(line, sizeof line, "%7d %-16s %-5s %6lld %8.0f%% %11.2f %10.2f\n", r["threads"].get<int>(),
                  r["kernel"].get<std::string>().c_str(), r["type"].get<std::string>().c_str(),
                  static_cast<long long>(r["tokens"].get<int64_t>()), r["row_fraction"].get<double>() * 100,
                  r["weight_gb_per_s"].get<double>(), r["gflop_per_s"].get<double>());
    os << line;
  }
  os << "\nmemory bandwidth\n";
  for (const json& r : p["compute"]["memory"]) {
    std::snprintf(line, sizeof line, "%7d threads  read %7.2f GB/s  copy %7.2f GB/s  (%llu MiB buffer)\n",
                  r["threads"].get<int>(), r["read_gb_per_s"].get<double>(), r["copy_gb_per_s"].get<double>(),
                  static_cast<unsigned long long>(r["buffer_bytes"].get<uint64_t>() >> 20));
    os << line;
  }
  // Profiles made before placement was recorded have none.
  if (const auto pl = p["compute"].find("placement"); pl != p["compute"].end()) {
    os << "\nthread placement (--pin-threads " << pl->value("policy", "?") << ")";
    if ((*pl)["cpu_capacity"].is_array()) {
      os << ", CPU capacities";
      for (const json& c : (*pl)["cpu_capacity"]) os << " " << c.get<uint64_t>();
    }
    os << "\n";
    auto list = [](const json& cpus) {
      std::string text;
      for (const json& c : cpus) text += (text.empty() ? "" : ",") + std::to_string(c.get<int>());
      return text;
    };
    for (const json& pool : (*pl)["pools"]) {
      os << "  " << pool["threads"].get<int>() << " thread(s): "
         << (pool["cpus"].is_array() ? "pinned to CPUs " + list(pool["cpus"]) : std::string("not pinned"))
         << ", ran on " << list(pool["observed_cpus"]) << "\n";
    }
  }
  const json& f = p["flash"];
  const std::string scheduler = f.value("io_scheduler", "");  // absent from profiles made before it was recorded
  os << "\nflash: " << f["dir"].get<std::string>() << " on " << f["device"].get<std::string>() << " ("
     << f["filesystem"].get<std::string>() << (scheduler.empty() ? "" : ", I/O scheduler " + scheduler) << "), "
     << (f["direct_io"].get<bool>() ? "O_DIRECT" : "PAGE CACHE IN USE")
     << ", " << (f["file_bytes"].get<uint64_t>() >> 20) << " MiB test file\n";
  os << "random reads, io_uring: MB/s (IOPS) [p50/p99 us]\n";
  std::snprintf(line, sizeof line, "%8s", "QD");
  os << line;
  for (unsigned qd : kQueueDepths) {
    std::snprintf(line, sizeof line, " %22u", qd);
    os << line;
  }
  os << "\n";
  for (size_t size : kRandomSizes) {
    std::snprintf(line, sizeof line, "%6zuK ", size / 1024);
    os << line;
    for (const json& r : f["random_read"]) {
      if (r["block_bytes"].get<size_t>() != size) continue;
      std::snprintf(line, sizeof line, " %6.0f (%5.0fk) [%.0f/%.0f]", r["mb_per_s"].get<double>(),
                    r["iops"].get<double>() / 1e3, r["latency_p50_us"].get<double>(),
                    r["latency_p99_us"].get<double>());
      os << line;
    }
    os << "\n";
  }
  os << "random reads, median over batches: MB/s (robust to stalls of a shared disk)\n";
  for (size_t size : kRandomSizes) {
    std::snprintf(line, sizeof line, "%6zuK ", size / 1024);
    os << line;
    for (const json& r : f["random_read"]) {
      if (r["block_bytes"].get<size_t>() != size) continue;
      std::snprintf(line, sizeof line, " %22.0f", r["mb_per_s_median_batch"].get<double>());
      os << line;
    }
    os << "\n";
  }
  for (const json& r : f["sequential_read"]) {
    std::snprintf(line, sizeof line, "sequential read %4zu KiB QD %u: %8.0f MB/s (median batch %.0f MB/s)\n",
                  r["block_bytes"].get<size_t>() / 1024, r["queue_depth"].get<unsigned>(), r["mb_per_s"].get<double>(),
                  r["mb_per_s_median_batch"].get<double>());
    os << line;
  }
  for (const json& r : f["sync_pread"]) {
    std::snprintf(line, sizeof line, "sync pread %3zu KiB QD 1: %8.0f MB/s, p50 %.0f us, p99 %.0f us\n",
                  r["block_bytes"].get<size_t>() / 1024, r["mb_per_s"].get<double>(),
                  r["latency_p50_us"].get<double>(), r["latency_p99_us"].get<double>());
    os << line;
  }
  std::snprintf(line, sizeof line, "sequential write %zu KiB blocks: %8.0f MB/s\n",
                f["sequential_write"]["block_bytes"].get<size_t>() / 1024,
                f["sequential_write"]["mb_per_s"].get<double>());
  os << line;
  std::snprintf(line, sizeof line, "\ntotal %.1f s\n", p["duration_seconds"].get<double>());
  os << line;
  return os.str();
}

}  // namespace nflash::profiler
