// The sparse runtime's subcommands of the `nflash` CLI, and the flags that shape the flash-offloaded runtime, shared
// by the commands that open one from a deployment (`nflash offload`, `nflash serve -d`): their registration, their
// translation (with --plan) into SparseRuntimeOptions, and the opening itself (all in offload_command.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/cli/command.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/sparse/sparse_runtime.h"

namespace nflash::sparse {

// `nflash offload`: greedy generation from a deployment directory with the FFN on flash.
void RegisterOffloadCommand(CLI::App& app, cli::CommandAction* action);

// RuntimeFlags::lookahead when --lookahead is not given: the plan's choice (planner::Plan::lookahead), else -1.
inline constexpr int64_t kLookaheadNotGiven = -2;

// One command line's runtime flags. Thread-safety: a value type.
struct RuntimeFlags {
  std::string deploy;  // -d: each command registers it (required or not)
  std::string mode = "full";
  std::string memory;
  std::string active_set = "auto";
  int64_t hot_slots = 0, cold_slots = 0;
  std::string hot_fraction = "auto";  // "auto" (kAutoHotFraction) or a share in [0, 1]
  bool hot_fraction_given = false;    // on the command line (only a --memory budget without a plan uses it)
  int64_t cluster_groups = 0;
  int64_t chunk_requests = 0;  // 0: not given (kDefaultChunkRequests, or the plan's)
  unsigned queue_depth = 0;     // 0: not given (io::kDefaultQueueDepth, or the plan's)
  bool buffered = false;
  bool token_prefill = false;
  bool prefill_in_cache = false;
  int64_t prefill_batch_min = kDefaultBatchedPrefillMinTokens;
  int64_t max_batch = kDefaultMaxBatch;
  bool no_scatter = false;
  uint64_t slot_alignment = 0;
  bool resident_embedding = false;
  bool no_cold_overflow = false;
  bool no_cold_preload = false;
  bool no_sibling_readahead = false;
  double cold_protected = kDefaultColdProtectedFraction;
  std::string two_phase = "off";
  int64_t lookahead = kLookaheadNotGiven;
  double lookahead_keep = kDefaultLookaheadKeep;
  double warm_next_mib = -1.0;
  uint64_t warm_next_ab = 0;
  std::string pin_threads = "auto";
  uint64_t pin_threads_ab = 0;
  uint64_t lookahead_input_ab = 0;  // --lookahead-input-ab: projected or hits at random per token (0: off)
  std::string lookahead_source = "next-layer";
  std::string lookahead_input = "projected";
  std::string lookahead_replay;
  std::string cold_pool = "per-layer";
  std::string hot_policy = "pinned";
  std::string plan;
  std::string kv_type;  // empty: f32, or the plan's
  int64_t ctx = 0;  // -c: each command registers it (what 0 means differs)
  int threads = 0;  // -t: each command registers it (0: all cores, or the plan's)
};

// Reads per pipeline chunk without --chunk-requests or a plan.
inline constexpr int64_t kDefaultChunkRequests = 16;

// Adds --mode, --memory, --active-set, --hot-slots, --cold-slots, --hot-fraction, --hot-policy, --cluster-groups,
// --chunk-requests, --queue-depth, --buffered, --token-prefill, --prefill-in-cache, --prefill-batch-min, --no-scatter,
// --slot-alignment, --resident-embedding, --two-phase, --lookahead, --lookahead-keep, --warm-next, --pin-threads,
// --cold-pool, --cold-protected, --no-cold-overflow, --no-cold-preload, --no-sibling-readahead, --kv-type and --plan
// (and the A/B switches --warm-next-ab and --pin-threads-ab, which only `nflash offload` uses).
void AddRuntimeOptions(CLI::App* cmd, RuntimeFlags* flags);

// The cache is sized one way: by a plan, by a --memory budget the runtime splits (--hot-fraction), or by --hot-slots
// and --cold-slots without a budget. InvalidArgument naming the flags when a command line gives --memory with either
// slot count, which the runtime would otherwise ignore.
Status CheckCacheSizeFlags(const std::string& memory, int64_t hot_slots, int64_t cold_slots);

// The options of SparseRuntime::Open for `f`: the context is f.ctx, or `default_ctx` when f.ctx is 0 (<= 0: the
// model's), unless --plan sets it; `*threads` becomes f.threads or the plan's compute threads. With --plan, -t,
// --queue-depth and --chunk-requests, when given, replace the plan's values (logged); InvalidArgument for a bad flag
// value, --plan combined with the memory, cache-size, --hot-fraction or context flags, or cache-size flags that
// conflict (CheckCacheSizeFlags; --hot-fraction without --memory).
Status MakeRuntimeOptions(const RuntimeFlags& f, int64_t default_ctx, SparseRuntimeOptions* o, int* threads);

// SparseRuntime::Open(f.deploy, o, pool), warning when --two-phase on does not apply.
Result<std::unique_ptr<SparseRuntime>> OpenRuntime(const RuntimeFlags& f, const SparseRuntimeOptions& o,
                                                   ThreadPool* pool);

}  // namespace nflash::sparse
