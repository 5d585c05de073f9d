// Runs one bench row in this process or in a child process (see bench_runner.h).
#include "runtime/bench/bench_runner.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "runtime/cli/model_loader.h"
#include "runtime/core/log.h"
#include "runtime/core/proc_stats.h"
#include "runtime/engine/context.h"
#include "runtime/sparse/decode_floors.h"
#include "runtime/sparse/memory_budget.h"
#include "runtime/sparse/sparse_runtime.h"
#include "runtime/text/tokenizer.h"

namespace nflash::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A fixed English text for the prompt tokens (repeated as needed): the small story models' domain, so the FFN
// activation pattern (and the sparse modes' cache behaviour) is that of real text, identical in every mode.
constexpr char kPromptText[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
    "One day, she saw a big red ball under a tree. She wanted to share it with her brother Tom, so she ran home. ";

// What the kernel counts for this process, to take differences around the measured runs.
struct ProcCounters {
  double cpu_s = 0;          // user + system CPU time of every thread
  uint64_t majflt = 0;       // major page faults (mmapped weights read from storage)
  uint64_t read_bytes = 0;   // bytes this process caused to be read from storage (/proc/self/io)
};

ProcCounters ReadProcCounters() {
  ProcCounters c;
  c.cpu_s = ProcessCpuSeconds();
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) == 0) c.majflt = static_cast<uint64_t>(ru.ru_majflt);
  std::ifstream io("/proc/self/io");
  for (std::string key; io >> key;) {
    uint64_t v = 0;
    io >> v;
    if (key == "read_bytes:") c.read_bytes = v;
  }
  return c;
}

// What a row's engine exposes to the measurement loop, whichever mode built it.
struct Engine {
  std::unique_ptr<ThreadPool> pool;
  cli::LoadedModel dense;                        // dense modes
  std::unique_ptr<InferenceContext> dense_ctx;   // dense modes
  std::unique_ptr<sparse::SparseRuntime> rt;     // sparse modes
  InferenceContext* ctx = nullptr;
  const Tokenizer* tokenizer = nullptr;
  int64_t n_vocab = 0;
};

// Flash traffic and cache lookups of the sparse runtime so far.
struct SparseCounters {
  uint64_t bytes = 0, requests = 0;
  sparse::CacheCounters hot, cold;  // lookups per region
  int64_t active = 0, used = 0;  // neurons computed, and those with h != 0 (the floors' FFN bytes)
  int64_t missed = 0;            // active neurons read from flash
};
SparseCounters ReadSparseCounters(const Engine& e) {
  SparseCounters c;
  if (!e.rt) return c;
  const sparse::OffloadGroupStats st = e.rt->ffn().TotalStats();
  c.bytes = st.bytes_read;
  c.requests = static_cast<uint64_t>(st.requests);
  c.active = st.active;
  c.missed = st.missed;
  c.used = st.used;
  c.hot = e.rt->ffn().cache().hot().TotalCounters();
  c.cold = e.rt->ffn().cache().cold().TotalCounters();
  return c;
}

std::vector<int32_t> PromptTokens(const Tokenizer* tok, int64_t n_vocab, int64_t n) {
  std::vector<int32_t> ids;
  if (n <= 0) return ids;
  if (tok != nullptr) {
    std::vector<int32_t> first = tok->Encode(kPromptText, tok->add_bos());
    std::vector<int32_t> more = tok->Encode(kPromptText, false);
    ids = first;
    while (!more.empty() && static_cast<int64_t>(ids.size()) < n) ids.insert(ids.end(), more.begin(), more.end());
  }
  // No tokenizer, or one that encodes nothing: a fixed pseudo-random sequence (7919 is prime, so it walks the vocab).
  for (int64_t i = static_cast<int64_t>(ids.size()); i < n; ++i) {
    ids.push_back(static_cast<int32_t>((i * 7919 + 1) % std::max<int64_t>(1, n_vocab)));
  }
  ids.resize(static_cast<size_t>(n));
  return ids;
}

Status OpenEngine(const RowSpec& s, int64_t n_ctx, Engine* e, std::string* unavailable) {
  e->pool = std::make_unique<ThreadPool>(s.threads);
  if (s.mode == BenchMode::kDenseMmap || s.mode == BenchMode::kInMemory) {
    cli::ModelSource src;
    src.path = s.model;
    src.tokenizer = s.tokenizer;
    src.activation = s.activation;
    src.use_mmap = s.mode == BenchMode::kDenseMmap;
    NF_ASSIGN_OR_RETURN(e->dense, cli::LoadModelForInference(src));
    const LlamaHparams& hp = e->dense.model->hparams();
    if (n_ctx > hp.context_length) {
      return Status::InvalidArgument("the test needs " + std::to_string(n_ctx) + " positions; " + s.model +
                                     " has a context of " + std::to_string(hp.context_length));
    }
    NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(s.kv_type));
    e->dense_ctx = std::make_unique<InferenceContext>(*e->dense.model, e->pool.get(), n_ctx, kv_type);
    e->ctx = e->dense_ctx.get();
    e->tokenizer = e->dense.tokenizer.get();
    e->n_vocab = hp.n_vocab;
    return Status::Ok();
  }
  if (s.deploy.empty()) {
    *unavailable = "unavailable: no --deploy directory for this model";
    return Status::Ok();
  }
  sparse::SparseRuntimeOptions o;
  o.mode = s.mode == BenchMode::kFull ? sparse::OffloadMode::kFull : sparse::OffloadMode::kLlmFlash;
  o.memory_budget = s.memory_budget;
  o.n_ctx = n_ctx;
  NF_ASSIGN_OR_RETURN(o.kv_type, ParseKvType(s.kv_type));
  const sparse::LookaheadChoice lookahead =
      sparse::AutoLookahead(s.lookahead, s.threads, sparse::ThreadsPinned(o.mode, o.pin_threads, s.threads));
  o.lookahead_slots = lookahead.slots;
  o.lookahead_adaptive = lookahead.adaptive;
  if (s.mode == BenchMode::kBundles) {
    // Bundles only: no hot clusters and 0 cold slots per region, given explicitly so that a budget is still checked
    // against the fixed part but not split into caches.
    NF_ASSIGN_OR_RETURN(auto d, packer::Deployment::Open(s.deploy));
    o.hot_slots = 0;
    o.cold_slots_per_group.assign(d->manifest().regions.size(), 0);
    o.cold_overflow = false;  // the staging stays staging: no cache at all
  }
  NF_ASSIGN_OR_RETURN(e->rt, sparse::SparseRuntime::Open(s.deploy, o, e->pool.get()));
  const LlamaHparams& hp = e->rt->model().hparams();
  if (n_ctx > hp.context_length) {
    return Status::InvalidArgument("the test needs " + std::to_string(n_ctx) + " positions; " + s.deploy +
                                   " has a context of " + std::to_string(hp.context_length));
  }
  e->ctx = &e->rt->context();
  e->tokenizer = e->rt->tokenizer();  // the runtime's (counted in its budget; nullptr without a vocabulary)
  e->n_vocab = hp.n_vocab;
  return Status::Ok();
}

Status Measure(const RowSpec& s, Engine& e, RowResult* r) {
  const BenchTest& t = s.test;
  const std::vector<int32_t> ids = PromptTokens(e.tokenizer, e.n_vocab, t.decode ? s.prompt_tokens : t.n_tokens);
  std::vector<double> latencies_ms;
  std::vector<double> miss_rates;  // per decode token, sparse rows
  double wall_s = 0, cpu_s = 0;
  uint64_t tokens = 0, majflt = 0, read_bytes = 0;
  SparseCounters sparse_sum;
  // Warm-up runs (llama-bench's default) are run in full and not recorded: thread start-up, first-touch page faults.
  for (int rep = -s.warmup; rep < s.repetitions; ++rep) {
    e.ctx->Reset();
    if (t.decode && !ids.empty()) NF_RETURN_IF_ERROR(e.ctx->Eval(ids, false));  // the prompt: not timed
    const ProcCounters p0 = ReadProcCounters();
    const SparseCounters c0 = ReadSparseCounters(e);
    const auto t0 = Clock::now();
    if (!t.decode) {
      NF_RETURN_IF_ERROR(e.ctx->Eval(ids, false));
    } else {
      for (int64_t i = 0; i < t.n_tokens; ++i) {
        // Greedy: the token the model itself would produce (its prompt's BOS when nothing was evaluated yet).
        int32_t next = ids.empty() ? 0 : ids.front();
        if (e.ctx->pos() > 0) {
          const float* lg = e.ctx->logits();
          next = static_cast<int32_t>(std::max_element(lg, lg + e.n_vocab) - lg);
        }
        const SparseCounters m0 = e.rt && rep >= 0 ? ReadSparseCounters(e) : SparseCounters();
        const auto s0 = Clock::now();
        NF_RETURN_IF_ERROR(e.ctx->Eval(std::span<const int32_t>(&next, 1), false));
        if (rep >= 0) latencies_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
        if (e.rt && rep >= 0) {
          const SparseCounters m1 = ReadSparseCounters(e);
          const int64_t active = m1.active - m0.active;
          if (active > 0) miss_rates.push_back(static_cast<double>(m1.missed - m0.missed) / static_cast<double>(active));
        }
      }
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const ProcCounters p1 = ReadProcCounters();
    const SparseCounters c1 = ReadSparseCounters(e);
    if (rep < 0) continue;
    r->tok_s.push_back(dt > 0 ? static_cast<double>(t.n_tokens) / dt : 0.0);
    wall_s += dt;
    cpu_s += p1.cpu_s - p0.cpu_s;
    tokens += static_cast<uint64_t>(t.n_tokens);
    majflt += p1.majflt - p0.majflt;
    read_bytes += p1.read_bytes - p0.read_bytes;
    sparse_sum.bytes += c1.bytes - c0.bytes;
    sparse_sum.requests += c1.requests - c0.requests;
    sparse_sum.hot.hits += c1.hot.hits - c0.hot.hits;
    sparse_sum.hot.misses += c1.hot.misses - c0.hot.misses;
    sparse_sum.cold.hits += c1.cold.hits - c0.cold.hits;
    sparse_sum.cold.misses += c1.cold.misses - c0.cold.misses;
    sparse_sum.active += c1.active - c0.active;
    sparse_sum.used += c1.used - c0.used;
  }
  r->speed = ComputeMeanSd(r->tok_s);
  r->p50_ms = Percentile(latencies_ms, 0.50);
  r->p90_ms = Percentile(latencies_ms, 0.90);
  r->p99_ms = Percentile(latencies_ms, 0.99);
  r->cpu_util = wall_s > 0 ? cpu_s / wall_s : 0.0;
  const double n = static_cast<double>(std::max<uint64_t>(1, tokens));
  if (e.rt) {
    sparse::CacheCounters both = sparse_sum.hot;
    both += sparse_sum.cold;
    r->hit_rate = both.HitRate();
    r->hot_hit_rate = sparse_sum.hot.HitRate();
    r->cold_hit_rate = sparse_sum.cold.HitRate();
    r->mb_read_per_token = static_cast<double>(sparse_sum.bytes) / 1e6 / n;
    r->reads_per_token = static_cast<double>(sparse_sum.requests) / n;
    if (!miss_rates.empty()) {
      r->miss_rate_mean = Mean(miss_rates);
      r->miss_rate_p99 = Percentile(miss_rates, 0.99);
    }
    if (!s.hw.empty() && t.decode && !latencies_ms.empty()) {
      const double mean_ms = Mean(latencies_ms);
      sparse::OffloadGroupStats st;
      st.active = sparse_sum.active;
      st.used = sparse_sum.used;
      st.bytes_read = sparse_sum.bytes;
      st.requests = static_cast<int64_t>(sparse_sum.requests);
      NF_ASSIGN_OR_RETURN(planner::Floors fl,
                          sparse::DecodeFloors(*e.rt, s.hw,
                                               sparse::MeasuredDecodeWork(*e.rt, st, n, e.pool->NumThreads(), mean_ms)));
      r->floor_compute_ms = fl.compute_ms;
      r->floor_io_ms = fl.io_ms;
      r->floor_ratio = fl.ratio;
    }
  } else {
    r->mb_read_per_token = static_cast<double>(read_bytes) / 1e6 / n;
    r->reads_per_token = static_cast<double>(majflt) / n;
  }
  return Status::Ok();
}

std::string SignalName(int sig) {
  const char* d = ::strsignal(sig);
  return "signal " + std::to_string(sig) + (d ? std::string(" (") + d + ")" : "");
}

}  // namespace

Result<RowResult> RunRow(const RowSpec& spec) {
  RowResult r;
  r.spec = spec;
  if (spec.mode == BenchMode::kFull || spec.mode == BenchMode::kLlmFlash) {
    r.constraint = spec.memory_budget ? "runtime budget (O_DIRECT)" : "no budget: cache empty, every neuron read";
  } else if (spec.mode == BenchMode::kBundles) {
    r.constraint = spec.memory_budget ? "runtime budget (O_DIRECT), caches of 0 slots" : "caches of 0 slots";
  }
  const int64_t n_ctx = spec.test.decode ? spec.prompt_tokens + spec.test.n_tokens : spec.test.n_tokens;
  Engine e;
  std::string unavailable;
  Status st = OpenEngine(spec, n_ctx, &e, &unavailable);
  if (st.ok() && !unavailable.empty()) {
    r.status = unavailable;
    return r;
  }
  if (st.ok()) st = Measure(spec, e, &r);
  if (!st.ok()) {
    r.status = "error: " + st.ToString();
    r.tok_s.clear();
  }
  r.peak_rss_bytes = ReadProcessMemory().peak_rss_bytes;
  return r;
}

RowResult RunRowInChild(const std::string& binary, const RowSpec& spec, const CgroupSupport& cgroups, bool quiet,
                        double timeout_s) {
  static std::atomic<int> row_counter{0};
  RowResult fallback;
  fallback.spec = spec;
  auto fail = [&](const std::string& msg) {
    fallback.status = "error: " + msg;
    return fallback;
  };
  std::unique_ptr<MemoryCgroup> cgroup;
  std::string constraint;
  if (spec.mode == BenchMode::kDenseMmap) {
    if (spec.drop_all_caches) {
      Status d = DropAllPageCache();
      if (!d.ok()) NF_LOG(Warning) << "could not drop the page cache: " << d.message();
    }
    // Cold start: the model's pages must come from storage within the budget, not from an earlier row's cache.
    Status d = DropFileCache(spec.model);
    if (!d.ok()) NF_LOG(Warning) << d.message();
    if (spec.memory_budget > 0) {
      if (!spec.use_cgroup) {
        constraint = "unconstrained: --no-cgroup";
      } else if (cgroups.version == CgroupVersion::kNone) {
        constraint = "unconstrained: " + cgroups.reason;
      } else {
        const std::string name =
            "nflash-bench-" + std::to_string(::getpid()) + "-" + std::to_string(row_counter.fetch_add(1));
        auto cg = MemoryCgroup::Create(cgroups, name, spec.memory_budget);
        if (cg.ok()) {
          cgroup = std::move(cg).value();
        } else {
          constraint = "unconstrained: " + cg.status().message();
        }
      }
    }
  }

  const std::string spec_json = spec.ToJson().dump();
  std::vector<std::string> args = {binary};
  if (quiet) args.push_back("-q");
  args.insert(args.end(), {"bench-row", "--spec", spec_json});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  int out_pipe[2], go_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return fail(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(go_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return fail(std::string("pipe: ") + std::strerror(errno));
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) return fail(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec. Wait until the parent has put us in the cgroup.
    ::dup2(out_pipe[1], STDOUT_FILENO);
    char go = 0;
    while (::read(go_pipe[0], &go, 1) < 0 && errno == EINTR) {
    }
    ::execv(binary.c_str(), argv.data());
    static constexpr char kMsg[] = "nflash bench: exec of the row process failed\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(go_pipe[0]);
  if (cgroup) {
    Status moved = cgroup->AddProcess(pid);
    if (moved.ok()) {
      constraint = cgroup->Describe();
    } else {
      constraint = "unconstrained: " + moved.message();
    }
  }
  const char go = 1;
  (void)!::write(go_pipe[1], &go, 1);
  ::close(go_pipe[1]);
  std::string out;
  char buf[4096];
  const auto started = Clock::now();
  bool timed_out = false;
  for (;;) {
    int wait_ms = -1;
    if (timeout_s > 0) {
      const double left = timeout_s - std::chrono::duration<double>(Clock::now() - started).count();
      if (left <= 0) {
        timed_out = true;
        ::kill(pid, SIGKILL);
        break;
      }
      wait_ms = static_cast<int>(std::min(left * 1000.0 + 1.0, 60000.0));
    }
    pollfd pfd{out_pipe[0], POLLIN, 0};
    const int ready = ::poll(&pfd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) continue;  // re-check the deadline
    const ssize_t n = ::read(out_pipe[0], buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(out_pipe[0]);
  int wstatus = 0;
  rusage ru{};
  while (::wait4(pid, &wstatus, 0, &ru) < 0 && errno == EINTR) {
  }
  const uint64_t child_peak = static_cast<uint64_t>(ru.ru_maxrss) * 1024;  // ru_maxrss is in KiB on Linux

  RowResult r = fallback;
  // The row is the last line that parses as a JSON object (logs go to stderr, but be lenient).
  bool parsed = false;
  size_t end = out.size();
  while (!parsed && end > 0) {
    const size_t start = out.rfind('\n', end - 1);
    const std::string line = out.substr(start == std::string::npos ? 0 : start + 1,
                                        end - (start == std::string::npos ? 0 : start + 1));
    if (!line.empty() && line.front() == '{') {
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) {
        auto row = RowResult::FromJson(j);
        if (row.ok()) {
          r = std::move(row).value();
          parsed = true;
        }
      }
    }
    if (start == std::string::npos) break;
    end = start;
  }
  if (timed_out) {
    r.status = "error: row timed out after " + std::to_string(static_cast<int64_t>(timeout_s)) + " s (--row-timeout)";
  } else if (WIFSIGNALED(wstatus)) {
    r.status = "error: row process killed by " + SignalName(WTERMSIG(wstatus)) +
               (cgroup && WTERMSIG(wstatus) == SIGKILL ? ": out of memory in the cgroup?" : "");
  } else if (!parsed) {
    r.status = "error: row process exited with code " + std::to_string(WEXITSTATUS(wstatus)) + " and no result";
  }
  r.spec = spec;
  r.peak_rss_bytes = std::max(r.peak_rss_bytes, child_peak);
  if (cgroup) r.cgroup_peak_bytes = cgroup->PeakBytes();
  if (!constraint.empty()) r.constraint = constraint;
  return r;
}

Result<uint64_t> OffloadBudget(const RowSpec& model_spec, double fraction, int64_t n_ctx) {
  if (!(fraction >= 0 && fraction <= 1)) {
    return Status::InvalidArgument("--offload " + std::to_string(fraction) + ": expected a fraction in [0, 1]");
  }
  cli::ModelSource src;
  src.path = model_spec.model;
  src.tokenizer = model_spec.tokenizer;
  src.activation = model_spec.activation;
  src.use_mmap = true;
  NF_ASSIGN_OR_RETURN(cli::LoadedModel lm, cli::LoadModelForInference(src));
  const LlamaHparams& hp = lm.model->hparams();
  NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(model_spec.kv_type));
  uint64_t ffn = 0, other = 0;
  for (const GgufTensorInfo& t : lm.model->gguf().tensors()) {
    const bool is_ffn = (t.name.find("ffn_gate") != std::string::npos && t.name.find("ffn_gate_inp") == std::string::npos) ||
                        t.name.find("ffn_up") != std::string::npos || t.name.find("ffn_down") != std::string::npos;
    (is_ffn ? ffn : other) += t.n_bytes;
  }
  const uint64_t kept = static_cast<uint64_t>((1.0 - fraction) * static_cast<double>(ffn));
  const int64_t kv_positions = InferenceContext::KvPositions(hp, std::min<int64_t>(n_ctx, hp.context_length));
  return other + kept + sparse::KvCacheBytes(hp.n_layers, kv_positions, hp.kv_dim(), KvElementBytes(kv_type)) +
         kOffloadOverheadBytes;
}

}  // namespace nflash::bench
