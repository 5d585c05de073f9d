// `nflash bench`: a llama-bench-like grid of models x modes x memory budgets x tests, each row run in its own child
// process (peak RSS and memory cgroup per row), printed as md / json / csv; and the hidden `nflash bench-row` that
// such a child runs.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/bench/bench_report.h"
#include "runtime/bench/bench_runner.h"
#include "runtime/cli/model_loader.h"
#include "runtime/bench/cgroup.h"
#include "runtime/bench/commands.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/sparse/memory_budget.h"

namespace nflash::bench {
namespace {

struct BenchFlags {
  std::string models;
  std::string deploys;
  std::string tokenizer;
  std::string activation;
  std::string modes;  // empty: every mode when --deploy is given, else dense-mmap,in-memory
  std::string memory;
  std::string offload;
  std::string tests = "pp128,pp512,tg128";
  int64_t prompt_tokens = 32;
  int64_t lookahead = -1;
  std::string kv_type = "f32";
  int repetitions = 3;
  int warmup = 1;
  int threads = 2;
  std::string output = "md";
  std::string out_path;
  bool force = false;
  bool no_cgroup = false;
  bool drop_caches = false;
  bool verbose_rows = false;
  double row_timeout = 0;
  std::string hw;
  std::set<std::string> given;  // the options on the command line (by their long name), for the warnings below
};

Status RunBench(const BenchFlags& f) {
  if (f.output != "md" && f.output != "json" && f.output != "csv") {
    return Status::InvalidArgument("--output " + f.output + ": expected md, json or csv");
  }
  if (!f.out_path.empty() && !f.force && FileExists(f.out_path)) {
    return Status::InvalidArgument(f.out_path + " exists; pass --force to overwrite");
  }
  if (!f.memory.empty() && !f.offload.empty()) {
    return Status::InvalidArgument("--memory and --offload are alternatives: give one");
  }
  if (f.repetitions < 1) return Status::InvalidArgument("--repetitions must be >= 1");
  if (f.warmup < 0) return Status::InvalidArgument("--warmup must be >= 0");
  if (f.prompt_tokens < 1) return Status::InvalidArgument("--prompt-tokens must be >= 1");
  const std::vector<std::string> models = SplitList(f.models);
  std::vector<std::string> deploys = f.deploys.empty() ? std::vector<std::string>{} : SplitList(f.deploys);
  if (deploys.size() > models.size()) {
    return Status::InvalidArgument("--deploy has " + std::to_string(deploys.size()) + " directories for " +
                                   std::to_string(models.size()) + " models (the i-th directory is the i-th model's)");
  }
  deploys.resize(models.size());
  for (const std::string& m : models) {
    if (m.empty() || !FileExists(m)) return Status::InvalidArgument("--model: '" + m + "' does not exist");
  }
  const std::string mode_list = !f.modes.empty() ? f.modes
                                : f.deploys.empty() ? "dense-mmap,in-memory"
                                                    : "full,llmflash,dense-mmap,in-memory";
  NF_ASSIGN_OR_RETURN(std::vector<BenchMode> modes, ParseModeList(mode_list));
  NF_ASSIGN_OR_RETURN(std::vector<BenchTest> tests, ParseTestList(f.tests));
  std::vector<uint64_t> budgets;
  std::vector<double> fractions;
  if (!f.memory.empty()) {
    NF_ASSIGN_OR_RETURN(budgets, ParseSizeList(f.memory));
  } else if (!f.offload.empty()) {
    for (const std::string& item : SplitList(f.offload)) {
      double v = -1;
      try {
        size_t used = 0;
        v = std::stod(item, &used);
        if (used != item.size()) v = -1;
      } catch (...) {
      }
      if (!(v >= 0 && v <= 1)) return Status::InvalidArgument("--offload: '" + item + "' is not a fraction in [0, 1]");
      fractions.push_back(v);
    }
  }
  int64_t max_ctx = 1;
  for (const BenchTest& t : tests) max_ctx = std::max(max_ctx, t.decode ? f.prompt_tokens + t.n_tokens : t.n_tokens);

  // The grid, model-major like llama-bench. in-memory ignores budgets: one row per model and test.
  std::vector<RowSpec> specs;
  for (size_t mi = 0; mi < models.size(); ++mi) {
    RowSpec base;
    base.model = models[mi];
    base.deploy = deploys[mi];
    base.tokenizer = f.tokenizer;
    base.activation = f.activation;
    base.prompt_tokens = f.prompt_tokens;
    base.repetitions = f.repetitions;
    base.warmup = f.warmup;
    base.threads = f.threads;
    base.use_cgroup = !f.no_cgroup;
    base.drop_all_caches = f.drop_caches;
    base.hw = f.hw;
    base.lookahead = f.lookahead;
    base.kv_type = f.kv_type;
    std::vector<std::pair<uint64_t, double>> model_budgets;  // (budget, offload fraction or -1)
    for (uint64_t b : budgets) model_budgets.emplace_back(b, -1.0);
    for (double fr : fractions) {
      NF_ASSIGN_OR_RETURN(uint64_t b, OffloadBudget(base, fr, max_ctx));
      NF_LOG(Info) << models[mi] << ": --offload " << fr << " -> memory budget " << sparse::FormatBytes(b);
      model_budgets.emplace_back(b, fr);
    }
    if (model_budgets.empty()) model_budgets.emplace_back(0, -1.0);
    for (BenchMode mode : modes) {
      const auto& mb = mode == BenchMode::kInMemory ? std::vector<std::pair<uint64_t, double>>{{0, -1.0}} : model_budgets;
      for (const auto& [budget, fraction] : mb) {
        for (const BenchTest& t : tests) {
          RowSpec s = base;
          s.mode = mode;
          s.memory_budget = budget;
          s.offload = fraction;
          s.test = t;
          specs.push_back(s);
        }
      }
    }
  }

  // Flags no row of this grid uses: said, not dropped without a word (before session 50 they were; the JSON even
  // recorded --prompt-tokens and --lookahead for rows that never read them).
  const auto any_row = [&](auto pred) { return std::any_of(specs.begin(), specs.end(), pred); };
  const auto offloaded = [](const RowSpec& s) {
    return s.mode != BenchMode::kInMemory && s.mode != BenchMode::kDenseMmap;
  };
  const auto unused = [&](const std::string& flag, bool used, const std::string& why) {
    if (f.given.count(flag) > 0 && !used) NF_LOG(Warning) << flag << ": no row of this grid uses it (" << why << ")";
  };
  const bool budgets_used = any_row([](const RowSpec& s) { return s.memory_budget > 0; });
  unused("--memory", budgets_used, "in-memory rows run without a budget");
  unused("--offload", budgets_used, "in-memory rows run without a budget");
  unused("--prompt-tokens", any_row([](const RowSpec& s) { return s.test.decode; }), "only tg tests prefill a prompt");
  unused("--lookahead", any_row([](const RowSpec& s) { return s.mode == BenchMode::kFull; }), "full mode only");
  unused("--deploy", any_row(offloaded), "only full, llmflash and bundles rows read a deployment");
  unused("--hw", any_row([&](const RowSpec& s) { return offloaded(s) && s.test.decode; }),
         "floors are reported for the offloaded modes' tg rows");
  // (--offload loads the model itself to size its budgets.)
  for (const char* flag : {"--tokenizer", "--activation"}) {
    unused(flag, !fractions.empty() || any_row([&](const RowSpec& s) { return !offloaded(s); }),
           "offloaded rows read the deployment's tokenizer and activation");
  }

  const CgroupSupport cgroups = DetectMemoryCgroup();
  const bool any_cgroup_rows = std::any_of(specs.begin(), specs.end(), [](const RowSpec& s) {
    return s.mode == BenchMode::kDenseMmap && s.memory_budget > 0;
  });
  if (any_cgroup_rows) {
    if (cgroups.version == CgroupVersion::kNone) {
      NF_LOG(Warning) << "dense-mmap rows run unconstrained: " << cgroups.reason;
    } else {
      NF_LOG(Info) << "dense-mmap rows run in memory cgroups (" << (cgroups.version == CgroupVersion::kV2 ? "v2" : "v1")
                   << ") under " << cgroups.parent_dir;
    }
  }
  NF_ASSIGN_OR_RETURN(std::string self, SelfExecutable());
  std::vector<RowResult> rows;
  for (size_t i = 0; i < specs.size(); ++i) {
    const RowSpec& s = specs[i];
    NF_LOG(Info) << "row " << (i + 1) << "/" << specs.size() << ": " << s.model << " " << BenchModeName(s.mode) << " "
                 << (s.memory_budget ? sparse::FormatBytes(s.memory_budget) : std::string("no budget")) << " "
                 << s.test.Name();
    RowResult r = RunRowInChild(self, s, cgroups, !f.verbose_rows, f.row_timeout);
    if (r.ok()) {
      NF_LOG(Info) << "  " << r.speed.mean << " +- " << r.speed.sd << " tok/s, peak RSS "
                   << sparse::FormatBytes(r.peak_rss_bytes) << ", " << r.constraint;
    } else {
      NF_LOG(Warning) << "  " << r.status;
    }
    rows.push_back(std::move(r));
  }
  const std::string text = f.output == "json" ? FormatJson(rows) : f.output == "csv" ? FormatCsv(rows) : FormatMarkdown(rows);
  if (f.out_path.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return Status::Ok();
  }
  NF_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> w, AtomicFileWriter::Create(f.out_path, f.force));
  NF_RETURN_IF_ERROR(w->Append(text.data(), text.size()));
  NF_RETURN_IF_ERROR(w->Commit());
  NF_LOG(Info) << "wrote " << rows.size() << " rows to " << f.out_path;
  return Status::Ok();
}

Status RunBenchRow(const std::string& spec_json) {
  auto j = nlohmann::json::parse(spec_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument("bench-row --spec: not valid JSON");
  NF_ASSIGN_OR_RETURN(RowSpec spec, RowSpec::FromJson(j));
  NF_ASSIGN_OR_RETURN(RowResult r, RunRow(spec));
  std::fflush(stderr);
  std::printf("%s\n", r.ToJson().dump().c_str());
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace

void RegisterBenchCommand(CLI::App& app, cli::CommandAction* action) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Benchmark a grid of models x modes x memory budgets x tests (llama-bench-like; md, json or csv)");
  cmd->add_option("-m,--model", f->models, "Model GGUF files (llama2.c checkpoints: dense modes), comma-separated")
      ->required();
  cmd->add_option("--deploy", f->deploys, "Deployment directories (nflash pack) of the models, in the same order");
  cmd->add_option("--tokenizer", f->tokenizer, "llama2.c only: tokenizer.bin (default: beside the checkpoint)");
  cmd->add_option("--activation", f->activation, "llama2.c only: FFN activation silu|relu|drelu");
  cmd->add_option("--modes", f->modes,
                  "Comma-separated: full, llmflash, dense-mmap, in-memory, bundles (llmflash with caches of 0 slots; "
                  "default: the first four with --deploy, else the dense two)");
  cmd->add_option("--memory", f->memory, "Memory budgets, comma-separated (e.g. 1G,2G): sparse runtime budget, "
                                          "dense-mmap memory cgroup limit");
  cmd->add_option("--offload", f->offload, "Instead of --memory: FFN fractions left on flash (e.g. 0.5), each turned "
                                            "into a budget per model");
  cmd->add_option("--tests", f->tests, "Tests: ppN (prefill N tokens in one batch), tgN (N decode steps)");
  cmd->add_option("--prompt-tokens", f->prompt_tokens, "tg tests: prompt tokens prefilled (not timed) first");
  cmd->add_option("--lookahead", f->lookahead,
                  "full mode: bundles read ahead for the next layer (-1 auto: n_ff/8, from the start when a core is left "
                  "beyond the compute threads, else adaptive: on once waiting for reads takes 15% of 8 tokens; 0 off: "
                  "the pipeline without lookahead)")
      ->capture_default_str();
  cli::AddKvTypeOption(cmd, &f->kv_type, "KV cache element type of every row (--offload budgets count it)")
      ->capture_default_str();
  cmd->add_option("-r,--repetitions", f->repetitions, "Runs of each test per row (mean and sd over them)");
  cmd->add_option("--warmup", f->warmup, "Untimed runs of each test before the repetitions (0: measure the cold start)");
  cmd->add_option("-t,--threads", f->threads, "Compute threads (0: all cores)");
  cmd->add_option("--output", f->output, "Output format: md, json or csv");
  cmd->add_option("-o,--out", f->out_path, "Write the output to this file (atomically) instead of stdout");
  cmd->add_flag("--force", f->force, "Overwrite -o if it exists");
  cmd->add_flag("--no-cgroup", f->no_cgroup, "Run dense-mmap rows unconstrained even where a memory cgroup is possible");
  cmd->add_flag("--drop-caches", f->drop_caches,
                "Root: drop the whole page cache (echo 1 > /proc/sys/vm/drop_caches) before each dense-mmap row");
  cmd->add_option("--row-timeout", f->row_timeout,
                  "Seconds after which a row's process is killed and the row reported as timed out (0: none); "
                  "a thrashing dense-mmap baseline can take hours");
  cmd->add_flag("--row-logs", f->verbose_rows, "Show the row processes' info logs");
  cmd->add_option("--hw", f->hw, "Hardware profile (nflash profile-hw): sparse tg rows also report the compute and I/O "
                                 "floors per token and the measured time's ratio to them (docs/planner.md, Floors)")
      ->check(CLI::ExistingFile);
  cmd->callback([f, action, cmd] {
    for (const CLI::Option* o : cmd->get_options()) {
      if (o->count() > 0) f->given.insert(o->get_name());
    }
    *action = [f] { return RunBench(*f); };
  });

  auto spec = std::make_shared<std::string>();
  CLI::App* row = app.add_subcommand("bench-row", "Run one bench row (internal: nflash bench runs it in a child)");
  row->group("");  // hidden from --help
  row->add_option("--spec", *spec, "The row as JSON")->required();
  row->callback([spec, action] { *action = [spec] { return RunBenchRow(*spec); }; });
}

}  // namespace nflash::bench
