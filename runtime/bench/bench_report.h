// What `nflash bench` measures and prints: the row specification (model x mode x memory budget x test), the row
// result, the statistics over repetitions, the flag-list parsers, and the md / json / csv formatters
// (docs/bench.md lists the columns).
#pragma once

#include <nlohmann/json.hpp>

#include "runtime/core/stats.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/status.h"

namespace nflash::bench {

enum class BenchMode {
  kFull,       // sparse runtime, FFN on flash, io_uring pipeline (SparseRuntime, OffloadMode::kFull)
  kLlmFlash,   // sparse runtime, blocking reads, no pipeline (OffloadMode::kLlmFlash)
  kDenseMmap,  // dense engine, GGUF mmapped (what llama.cpp does): in a memory cgroup of the budget when possible
  kInMemory,   // dense engine, the whole GGUF read into memory (the speed ceiling; ignores budgets)
  kBundles,    // ablation: llmflash with hot and cold caches of 0 slots (every active bundle read, blocking, each token)
};
const char* BenchModeName(BenchMode mode);
Result<BenchMode> ParseBenchMode(std::string_view name);

// One llama-bench test: "pp128" (prefill 128 tokens in one batch) or "tg128" (128 decode steps after a prompt).
struct BenchTest {
  bool decode = false;
  int64_t n_tokens = 0;
  std::string Name() const { return (decode ? "tg" : "pp") + std::to_string(n_tokens); }
};
Result<BenchTest> ParseBenchTest(std::string_view text);

// Comma-separated lists, empty items rejected. InvalidArgument names the flag and the item.
std::vector<std::string> SplitList(std::string_view text);
Result<std::vector<BenchMode>> ParseModeList(std::string_view text);
Result<std::vector<BenchTest>> ParseTestList(std::string_view text);
// "1G,1.5G,800M" (sparse::ParseMemorySize units: K/M/G binary). Zero is rejected.
Result<std::vector<uint64_t>> ParseSizeList(std::string_view text);

// Mean and sample standard deviation (n - 1 denominator, as llama-bench; 0 for fewer than two samples).
struct MeanSd {
  double mean = 0, sd = 0;
};
MeanSd ComputeMeanSd(const std::vector<double>& v);
// Percentile (nearest rank): runtime/core/stats.h.
using nflash::Percentile;

struct RowSpec {
  std::string model;       // GGUF (or llama2.c checkpoint, dense modes only)
  std::string deploy;      // deployment directory (sparse modes)
  std::string tokenizer;   // llama2.c only
  std::string activation;  // llama2.c only
  BenchMode mode = BenchMode::kDenseMmap;
  uint64_t memory_budget = 0;  // 0: none
  double offload = -1;         // the --offload fraction the budget was derived from (< 0: not from --offload)
  BenchTest test;
  int64_t prompt_tokens = 32;  // tg: tokens prefilled (not timed) before the decode steps
  int repetitions = 3;
  int warmup = 1;              // untimed runs of the test before the repetitions
  int threads = 2;
  bool use_cgroup = true;      // dense-mmap with a budget: try a memory cgroup
  bool drop_all_caches = false;  // also `echo 1 > drop_caches` before the row (root)
  std::string hw;              // hw.json: sparse tg rows also report the speed floors (planner/floors.h)
  int64_t lookahead = -1;      // full mode: SparseRuntimeOptions::lookahead_slots (-1 auto, 0 off)
  std::string kv_type = "f32";  // KV cache element type of every engine (KvTypeName)

  nlohmann::json ToJson() const;
  static Result<RowSpec> FromJson(const nlohmann::json& j);
};

struct RowResult {
  RowSpec spec;
  std::string status = "ok";       // "ok", "unavailable: <why>", "error: <message>"
  std::vector<double> tok_s;       // per repetition
  MeanSd speed;                    // over tok_s
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;  // tg: per-token latency over every step of every repetition
  double hit_rate = -1;            // sparse: neuron cache hits / lookups (hot and cold together); < 0: not applicable
  // Sparse: the same per region, as `nflash offload` reports them (0 for a region with no lookups); < 0: not applicable.
  double hot_hit_rate = -1, cold_hit_rate = -1;
  double mb_read_per_token = 0;    // sparse: flash bytes read; dense: bytes the kernel read from storage (/proc/self/io)
  double reads_per_token = 0;      // sparse: read requests after coalescing; dense: major page faults
  // Sparse tg rows: per token, the share of its active neurons that had to be read from flash (paper Table 4's cache
  // miss rate): the mean over tokens and the 99th percentile; < 0: not applicable.
  double miss_rate_mean = -1, miss_rate_p99 = -1;
  uint64_t peak_rss_bytes = 0;     // the row's process, from wait4 (VmHWM in-process)
  uint64_t cgroup_peak_bytes = 0;  // the cgroup's recorded peak (RSS + page cache), 0 without a cgroup
  double cpu_util = 0;             // (user + sys CPU time) / wall time over the measured runs: 2.0 = two cores busy
  std::string constraint = "-";    // "cgroup v1 memory.limit_in_bytes=1.00 GiB", "runtime budget", "unconstrained: ..."
  // Sparse tg rows with --hw (docs/planner.md, Floors): compute and I/O floors per token and the measured mean token
  // time over max(compute, io); < 0: not computed.
  double floor_compute_ms = -1, floor_io_ms = -1, floor_ratio = -1;
  bool has_floors() const { return floor_ratio >= 0; }

  bool ok() const { return status == "ok"; }
  nlohmann::json ToJson() const;
  static Result<RowResult> FromJson(const nlohmann::json& j);
};

// A llama-bench-like markdown table. Both tables get the floor columns (after CPU) only when a row has floors.
std::string FormatMarkdown(const std::vector<RowResult>& rows);
// An array of row objects (RowResult::ToJson), pretty-printed.
std::string FormatJson(const std::vector<RowResult>& rows);
// A header line and one line per row; fields with commas or quotes are quoted (RFC 4180).
std::string FormatCsv(const std::vector<RowResult>& rows);

}  // namespace nflash::bench
