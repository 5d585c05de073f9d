// `nflash run` (streamed generation with speed and memory report) and `nflash perplexity` (non-overlapping windows,
// through the dense engine, the in-memory sparse FFN or a deployment's offloaded sparse runtime).
#include "runtime/cli/run_command.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "packer/deployment.h"
#include "profiler/predictor_train.h"
#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/checksum.h"
#include "runtime/core/cpu_affinity.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/core/proc_stats.h"
#include "runtime/core/stats.h"
#include "runtime/core/thread_placement.h"
#include "runtime/engine/context.h"
#include "runtime/engine/generate.h"
#include "runtime/engine/predictor.h"
#include "runtime/engine/sparse_ffn.h"
#include "runtime/sparse/commands.h"
#include "runtime/sparse/sparse_runtime.h"
#include "runtime/text/sampler.h"

namespace nflash::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// The sparse FFN options shared by `run` and `perplexity` (see docs/predictor.md).
struct SparseFlags {
  std::string mode;         // "", "oracle", "predictor"
  std::string predictor;    // predictor file
  std::string thresholds;   // comma-separated per-layer activation thresholds
  double target_sparsity = -1;
  std::string calib_text;   // for --target-sparsity
  int64_t calib_tokens = 8192;
  bool measure_recall = false;
  bool skip_hash = false;
  int64_t prefill_batch_min = kDefaultBatchedPrefillMinTokens;
};

// The options AddSparseOptions registers, for the commands that refuse some of them beside others.
struct SparseOptions {
  CLI::Option* sparse = nullptr;
  std::vector<CLI::Option*> model_only;  // every one but --sparse: settings of the in-memory sparse FFN of -m
};

SparseOptions AddSparseOptions(CLI::App* sub, SparseFlags* s) {
  SparseOptions out;
  out.sparse = sub->add_option("--sparse", s->mode, "Sparse FFN: oracle (exact active set) or predictor (predicted set)")
                   ->check(CLI::IsMember({"oracle", "predictor"}));
  CLI::Option* predictor =
      sub->add_option("--predictor", s->predictor, "Predictor file (train-predictor); its activation thresholds apply")
          ->check(CLI::ExistingFile);
  CLI::Option* thresholds =
      sub->add_option("--activation-thresholds", s->thresholds,
                      "Per-layer active thresholds on |act(gate)|, comma-separated (default: the predictor's, or 0)");
  CLI::Option* target = sub->add_option("--target-sparsity", s->target_sparsity,
                                        "SiLU: thresholds for this inactive fraction, calibrated on --calib-text");
  // Settings of one way only, refused by CLI11 without it (a usage error naming what they need): before session 50
  // they were ignored without a word.
  thresholds->excludes(target);
  CLI::Option* calib_text =
      sub->add_option("--calib-text", s->calib_text, "Calibration text for --target-sparsity")
          ->check(CLI::ExistingFile)
          ->needs(target);
  CLI::Option* calib_tokens =
      sub->add_option("--calib-tokens", s->calib_tokens, "Calibration tokens for --target-sparsity")->needs(target);
  CLI::Option* recall = sub->add_flag("--measure-recall", s->measure_recall,
                                      "Predictor mode: also compute every gate row to report recall (slower)")
                            ->needs(out.sparse);
  CLI::Option* skip_hash =
      sub->add_flag("--skip-predictor-hash", s->skip_hash,
                    "Accept a predictor recorded for another file of the same shape (e.g. the GGUF of the same weights)")
          ->needs(predictor);
  out.model_only = {predictor, thresholds, target, calib_text, calib_tokens, recall, skip_hash};
  return out;
}

struct SparseSetup {
  std::unique_ptr<Predictor> predictor;
  std::unique_ptr<SparseFfn> ffn;
};

Result<SparseSetup> SetupSparse(const SparseFlags& s, const ModelSource& src, const LoadedModel& lm, ThreadPool* pool,
                                bool sparse_prefill) {
  SparseSetup out;
  if (s.mode.empty()) {
    if (!s.predictor.empty() || !s.thresholds.empty() || s.target_sparsity >= 0) {
      return Status::InvalidArgument("--predictor, --activation-thresholds and --target-sparsity need --sparse");
    }
    return out;
  }
  const LlamaHparams& hp = lm.model->hparams();
  SparseFfnOptions o;
  o.mode = s.mode == "predictor" ? SparseMode::kPredictor : SparseMode::kOracle;
  o.sparse_prefill = sparse_prefill;
  o.batched_prefill_min_tokens = s.prefill_batch_min;
  o.measure_recall = s.measure_recall;
  if (s.measure_recall && o.mode == SparseMode::kOracle) {
    NF_LOG(Warning) << "--measure-recall: the oracle's active set is the exact one (recall 1); nothing to measure";
  }
  if (o.mode == SparseMode::kPredictor && s.predictor.empty()) {
    return Status::InvalidArgument("--sparse predictor needs --predictor FILE");
  }
  if (!s.predictor.empty()) {
    NF_ASSIGN_OR_RETURN(out.predictor, Predictor::Load(s.predictor));
    std::string hash;
    if (!s.skip_hash) {
      NF_ASSIGN_OR_RETURN(uint64_t h, HashFile(src.path));
      hash = HashToHex(h);
    }
    NF_RETURN_IF_ERROR(out.predictor->CheckForModel(*lm.model, hash, src.path));
    for (int64_t l = 0; l < hp.n_layers; ++l) o.activation_threshold.push_back(out.predictor->activation_threshold(l));
  }
  if (!s.thresholds.empty()) {
    o.activation_threshold.clear();
    std::stringstream ss(s.thresholds);
    for (std::string item; std::getline(ss, item, ',');) {
      try {
        o.activation_threshold.push_back(std::stof(item));
      } catch (...) {
        return Status::InvalidArgument("--activation-thresholds: '" + item + "' is not a number");
      }
    }
    if (o.activation_threshold.size() == 1) o.activation_threshold.assign(static_cast<size_t>(hp.n_layers), o.activation_threshold[0]);
  } else if (s.target_sparsity >= 0) {
    if (s.target_sparsity >= 1) return Status::InvalidArgument("--target-sparsity must be in [0, 1)");
    if (s.calib_text.empty()) return Status::InvalidArgument("--target-sparsity needs --calib-text (calibration text)");
    std::vector<uint8_t> bytes;
    NF_ASSIGN_OR_RETURN(bytes, ReadWholeFile(s.calib_text));
    // A prefix is enough: 8 bytes per token bounds the small tokenizers used here.
    const size_t take = std::min(bytes.size(), static_cast<size_t>(s.calib_tokens * 8 + 4096));
    std::vector<int32_t> ids = lm.tokenizer->Encode(std::string(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(take)), true);
    if (static_cast<int64_t>(ids.size()) > s.calib_tokens) ids.resize(static_cast<size_t>(s.calib_tokens));
    NF_ASSIGN_OR_RETURN(profiler::ActivationSamples samples,
                        profiler::CollectSamples(*lm.model, ids, std::min<int64_t>(256, hp.context_length), pool));
    o.activation_threshold = profiler::SparsityThresholds(samples, s.target_sparsity);
  }
  NF_ASSIGN_OR_RETURN(out.ffn, SparseFfn::Create(*lm.model, out.predictor.get(), o, pool));
  std::string thr;
  const int64_t n_groups = hp.n_layers * std::max<int64_t>(1, hp.n_experts);  // MoE: one per (layer, expert)
  for (int64_t g = 0; g < n_groups; ++g) thr += (g ? "," : "") + std::to_string(out.ffn->activation_threshold(g));
  NF_LOG(Info) << "sparse FFN (" << s.mode << "), activation thresholds " << (hp.n_experts > 0 ? "per expert " : "")
               << thr << "; transposed down "
               << out.ffn->extra_bytes() / 1048576.0 << " MiB"
               << (out.predictor ? ", predictor " + std::to_string(out.predictor->PredictorBytes()) + " bytes" : "");
  return out;
}

// Per-layer and mean fractions of neurons computed / active (and recall when known), as JSON and as text on stderr.
nlohmann::json SparseReport(const SparseFfn& ffn, int64_t n_ff, bool print) {
  if (print) std::fflush(stdout);  // after the streamed text, not inside it
  nlohmann::json layers = nlohmann::json::array();
  double sum_c = 0, sum_a = 0, sum_t = 0, sum_r = 0;
  bool has_truth = true;
  const auto& st = ffn.stats();
  for (size_t l = 0; l < st.size(); ++l) {
    const SparseFfnLayerStats& s = st[l];
    const double pairs = static_cast<double>(std::max<int64_t>(1, s.tokens) * n_ff);
    nlohmann::json j = {{"layer", l}, {"tokens", s.tokens}, {"computed_fraction", s.computed / pairs},
                        {"active_fraction", s.active / pairs}};
    sum_c += s.computed / pairs;
    sum_a += s.active / pairs;
    if (s.true_active >= 0) {
      const double recall = s.true_active > 0 ? static_cast<double>(s.true_positive) / s.true_active : 1.0;
      j["true_active_fraction"] = s.true_active / pairs;
      j["recall"] = recall;
      sum_t += s.true_active / pairs;
      sum_r += recall;
    } else {
      has_truth = false;
    }
    if (print) {
      std::fprintf(stderr, "layer %zu: computed %.4f, active %.4f", l, s.computed / pairs, s.active / pairs);
      if (s.true_active >= 0) {
        std::fprintf(stderr, ", true active %.4f, recall %.4f", j["true_active_fraction"].get<double>(),
                     j["recall"].get<double>());
      }
      std::fprintf(stderr, "\n");
    }
    layers.push_back(j);
  }
  const double n = static_cast<double>(std::max<size_t>(1, st.size()));
  nlohmann::json out = {{"layers", layers}, {"mean_computed_fraction", sum_c / n}, {"mean_active_fraction", sum_a / n}};
  if (has_truth) {
    out["mean_true_active_fraction"] = sum_t / n;
    out["mean_recall"] = sum_r / n;
  }
  if (print) {
    std::fprintf(stderr, "sparse FFN: mean computed fraction %.4f, mean active fraction %.4f", sum_c / n, sum_a / n);
    if (has_truth) std::fprintf(stderr, ", true active %.4f, recall %.4f", sum_t / n, sum_r / n);
    std::fprintf(stderr, "\n");
  }
  return out;
}

struct RunFlags {
  ModelSource source;
  std::string prompt;
  std::string prompt_file;
  int64_t n_predict = 256;
  int64_t ctx = 0;
  std::string kv_type = "f32";
  int64_t max_batch = kDefaultMaxBatch;
  int threads = 0;
  std::string pin_threads = "auto";
  bool no_mmap = false;
  bool json = false;
  SamplerConfig sampler;
  std::vector<std::string> stop;
  SparseFlags sparse;
};

Status RunGenerate(const RunFlags& f) {
  ModelSource src = f.source;
  src.use_mmap = !f.no_mmap;
  NF_ASSIGN_OR_RETURN(LoadedModel lm, LoadModelForInference(src));
  const LlamaHparams& hp = lm.model->hparams();
  if (hp.synthetic) NF_LOG(Info) << "model " << hp.name << ": SYNTHETIC weights (speed figures only, no quality)";

  std::string prompt = f.prompt;
  if (!f.prompt_file.empty()) {
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(f.prompt_file));
    prompt.assign(bytes.begin(), bytes.end());
  }
  std::vector<int32_t> ids = lm.tokenizer->Encode(prompt, lm.tokenizer->add_bos());
  if (ids.empty()) return Status::InvalidArgument("the prompt is empty and the model adds no BOS token: pass -p");
  int64_t n_ctx = f.ctx > 0 ? f.ctx : std::min<int64_t>(hp.context_length, static_cast<int64_t>(ids.size()) + f.n_predict);
  if (static_cast<int64_t>(ids.size()) >= n_ctx) {
    return Status::InvalidArgument("the prompt has " + std::to_string(ids.size()) +
                                   " tokens, more than the context size " + std::to_string(n_ctx));
  }
  NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(f.kv_type));
  NF_ASSIGN_OR_RETURN(const PinThreads pin, ParsePinThreads(f.pin_threads));
  ThreadPool pool(f.threads);
  // The same placement rule as `nflash offload` (runtime/core/thread_placement.h), for a like-for-like comparison:
  // the caller and the workers on the fastest CPUs, one each, for the whole run (there is no I/O thread here).
  const std::vector<int> allowed = ThreadCpus(pthread_self());
  const std::optional<ThreadCpuPlan> placed =
      PlanThreadCpus(pin, pool.NumThreads(), allowed, {}, CpuCapacities(allowed));
  std::optional<ThreadPlacement> placement;
  if (placed) {
    placement.emplace(*placed, pool.WorkerHandles(), std::nullopt);
    NF_RETURN_IF_ERROR(placement->Begin());
  }
  InferenceContext ctx(*lm.model, &pool, n_ctx, kv_type);
  ctx.SetMaxBatch(f.max_batch);
  // Sparse decode only: the prompt's batched prefill stays dense.
  NF_ASSIGN_OR_RETURN(SparseSetup sparse, SetupSparse(f.sparse, src, lm, &pool, /*sparse_prefill=*/false));
  if (sparse.ffn) ctx.SetFfnBackend(sparse.ffn.get());
  GenerateOptions options;
  options.sampler = f.sampler;
  options.max_tokens = f.n_predict;
  options.stop_strings = f.stop;
  // Echo the prompt as the model sees it (after BOS), as llama2.c and llama.cpp do.
  options.echo_prompt = true;
  std::string text;
  const auto t0 = Clock::now();
  NF_ASSIGN_OR_RETURN(GenerateResult g, Generate(ctx, *lm.tokenizer, ids, options, [&](std::string_view s) {
                        text += s;
                        if (!f.json) {
                          std::fwrite(s.data(), 1, s.size(), stdout);
                          std::fflush(stdout);
                        }
                        return true;
                      }));
  const auto t2 = Clock::now();
  if (!f.json) std::fputs("\n", stdout);

  const std::vector<double>& latencies = g.step_ms;
  const double prefill_s = g.prefill_ms / 1000.0;
  double decode_ms = 0;
  for (double l : latencies) decode_ms += l;
  const StopReason reason = g.reason;
  const ProcessMemory mem = ReadProcessMemory();
  nlohmann::json j;
  j["model"] = f.source.path;
  j["model_name"] = hp.name;
  j["synthetic"] = hp.synthetic;
  j["load"] = lm.description;
  j["threads"] = pool.NumThreads();
  j["pin_threads"] = f.pin_threads;
  j["thread_cpus"] = placed ? nlohmann::json{{"caller", placed->caller}, {"workers", placed->workers}}
                            : nlohmann::json(nullptr);
  j["prompt_tokens"] = ids.size();
  j["generated_tokens"] = g.generated_tokens;
  j["stop_reason"] = StopReasonName(reason);
  j["prefill_tok_s"] = prefill_s > 0 ? static_cast<double>(ids.size()) / prefill_s : 0.0;
  j["decode_tok_s"] = decode_ms > 0 ? static_cast<double>(latencies.size()) / (decode_ms / 1000.0) : 0.0;
  j["latency_ms"] = {{"mean", latencies.empty() ? 0.0 : decode_ms / static_cast<double>(latencies.size())},
                     {"p50", Percentile(latencies, 0.5)},
                     {"p90", Percentile(latencies, 0.9)},
                     {"p99", Percentile(latencies, 0.99)}};
  j["token_latencies_ms"] = latencies;  // per decode step, in order
  j["weights_bytes"] = lm.model->weight_bytes();
  j["state_bytes"] = ctx.state_bytes();
  j["rss_bytes"] = mem.rss_bytes;
  j["peak_rss_bytes"] = mem.peak_rss_bytes;
  j["total_s"] = Seconds(t0, t2);
  if (sparse.ffn) j["sparse"] = SparseReport(*sparse.ffn, hp.n_ff, !f.json);
  if (f.json) {
    j["text"] = text;
    std::printf("%s\n", j.dump(2).c_str());
    return Status::Ok();
  }
  std::fprintf(stderr,
               "\n%s%lld prompt tokens, %lld generated (%s); %d threads\n"
               "prefill %.1f tok/s, decode %.1f tok/s; per-token latency mean %.2f ms, P50 %.2f, P90 %.2f, P99 %.2f\n"
               "memory: weights %.1f MiB (%s), KV cache and buffers %.1f MiB, RSS %.1f MiB, peak RSS %.1f MiB\n",
               hp.synthetic ? "SYNTHETIC weights. " : "", static_cast<long long>(ids.size()),
               static_cast<long long>(g.generated_tokens), StopReasonName(reason), pool.NumThreads(),
               j["prefill_tok_s"].get<double>(), j["decode_tok_s"].get<double>(),
               j["latency_ms"]["mean"].get<double>(), j["latency_ms"]["p50"].get<double>(),
               j["latency_ms"]["p90"].get<double>(), j["latency_ms"]["p99"].get<double>(),
               lm.model->weight_bytes() / 1048576.0, lm.description.c_str(), ctx.state_bytes() / 1048576.0,
               mem.rss_bytes / 1048576.0, mem.peak_rss_bytes / 1048576.0);
  return Status::Ok();
}

struct PplFlags {
  ModelSource source;
  std::string text_file;
  int64_t ctx = 256;
  std::string kv_type = "f32";
  int64_t max_windows = 0;
  int threads = 0;
  bool no_mmap = false;
  bool json = false;
  SparseFlags sparse;
  // Instead of -m: a deployment through the offloaded sparse runtime (the FFN read from flash).
  std::string deploy;
  std::string offload_mode = "full";
  std::string active_set = "auto";
  std::string memory;
  int64_t hot_slots = 0, cold_slots = 0;
};

struct PerplexityResult {
  int64_t predictions = 0;
  double perplexity = 0;
  double seconds = 0;
};

// The method of ../shared/models/stories260K/README.md over `ids` (BOS + the whole text encoded as one string):
// `n_windows` non-overlapping windows of `window` tokens, each from an empty context, scoring the next token at every
// position. The one loop of every engine `nflash perplexity` runs (dense, in-memory sparse, offloaded), so their
// figures differ only by what `ctx`'s FFN computes.
Result<PerplexityResult> WindowPerplexity(InferenceContext& ctx, const std::vector<int32_t>& ids, int64_t window,
                                          int64_t n_windows, int64_t n_vocab) {
  double nll = 0;
  PerplexityResult r;
  ProgressBar bar("perplexity", static_cast<uint64_t>(n_windows * window), "tok");
  const auto t0 = Clock::now();
  for (int64_t w = 0; w < n_windows; ++w) {
    ctx.Reset();
    std::span<const int32_t> tokens(ids.data() + w * window, static_cast<size_t>(window));
    NF_RETURN_IF_ERROR(ctx.Eval(tokens, true));
    for (int64_t i = 0; i < window; ++i) {
      const float* lg = ctx.logits(i);
      const int32_t target = ids[static_cast<size_t>(w * window + i + 1)];
      double mx = *std::max_element(lg, lg + n_vocab);
      double sum = 0;
      for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(static_cast<double>(lg[v]) - mx);
      nll += -(static_cast<double>(lg[target]) - mx - std::log(sum));
      ++r.predictions;
    }
    bar.Update(static_cast<uint64_t>((w + 1) * window));
  }
  bar.Finish();
  r.seconds = Seconds(t0, Clock::now());
  r.perplexity = std::exp(nll / static_cast<double>(r.predictions));
  return r;
}

// The offloaded engine of `perplexity --deploy`: the deployment's sparse runtime with a context of `n_ctx`.
Result<std::unique_ptr<sparse::SparseRuntime>> OpenDeployment(const PplFlags& f, int64_t n_ctx, ThreadPool* pool) {
  sparse::SparseRuntimeOptions o;
  o.mode = f.offload_mode == "llmflash" ? sparse::OffloadMode::kLlmFlash : sparse::OffloadMode::kFull;
  o.active_set = f.active_set == "oracle"      ? sparse::ActiveSetSource::kOracle
                 : f.active_set == "predictor" ? sparse::ActiveSetSource::kPredictor
                                               : sparse::ActiveSetSource::kAuto;
  NF_RETURN_IF_ERROR(sparse::CheckCacheSizeFlags(f.memory, f.hot_slots, f.cold_slots));
  if (!f.memory.empty()) {
    auto budget = sparse::ParseMemorySize(f.memory);
    if (!budget.ok()) return budget.status().WithContext("--memory");
    o.memory_budget = *budget;
  }
  o.hot_slots = f.hot_slots;
  o.cold_slots = f.cold_slots;
  o.n_ctx = n_ctx;
  NF_ASSIGN_OR_RETURN(o.kv_type, ParseKvType(f.kv_type));
  // Windows go token by token through the decode path, as `--sparse` runs them in memory (SparseFfn with
  // sparse_prefill): in oracle mode batched prefill computes every neuron of a layer, and a window is scored as
  // decode sees it.
  o.batched_prefill = false;
  o.logits_tokens = n_ctx;  // every position of a window is scored: its logits are held, so the budget counts them
  return sparse::SparseRuntime::Open(f.deploy, o, pool);
}

Status RunPerplexity(const PplFlags& f) {
  const bool deployed = !f.deploy.empty();
  if (deployed == !f.source.path.empty()) return Status::InvalidArgument("give -m MODEL or --deploy DIR (one of them)");
  if (deployed && !f.sparse.mode.empty()) {
    return Status::InvalidArgument("--sparse applies to -m; a deployment's active set is --active-set");
  }
  ModelSource src = f.source;
  src.use_mmap = !f.no_mmap;
  // The model's tokenizer and shape: the model itself, or the deployment's resident image.
  LoadedModel lm;
  std::unique_ptr<Tokenizer> deploy_tok;
  LlamaHparams hp;
  if (deployed) {
    NF_ASSIGN_OR_RETURN(GgufFile resident, GgufFile::OpenPathUncached(f.deploy + "/" + packer::kResidentFileName));
    NF_ASSIGN_OR_RETURN(deploy_tok, LoadTokenizer(resident));
    NF_ASSIGN_OR_RETURN(hp, ReadLlamaHparams(resident));
  } else {
    NF_ASSIGN_OR_RETURN(lm, LoadModelForInference(src));
    hp = lm.model->hparams();
  }
  const Tokenizer& tok = deployed ? *deploy_tok : *lm.tokenizer;
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(f.text_file));
  std::string text(bytes.begin(), bytes.end());
  std::vector<int32_t> ids = tok.Encode(text, true);
  deploy_tok.reset();  // not held beside the runtime's own tokenizer, which its memory budget counts
  if (f.ctx < 2 || f.ctx > hp.context_length) {
    return Status::InvalidArgument("--ctx " + std::to_string(f.ctx) + " must be in [2, " +
                                   std::to_string(hp.context_length) + "]");
  }
  int64_t n_windows = (static_cast<int64_t>(ids.size()) - 1) / f.ctx;
  if (f.max_windows > 0) n_windows = std::min(n_windows, f.max_windows);
  if (n_windows == 0) {
    return Status::InvalidArgument(f.text_file + ": " + std::to_string(ids.size()) + " tokens, fewer than one window of " +
                                   std::to_string(f.ctx) + " + 1");
  }
  ThreadPool pool(f.threads);
  std::unique_ptr<sparse::SparseRuntime> offloaded;
  std::unique_ptr<InferenceContext> own_ctx;
  SparseSetup in_memory;
  InferenceContext* ctx = nullptr;
  if (deployed) {
    NF_ASSIGN_OR_RETURN(offloaded, OpenDeployment(f, f.ctx, &pool));
    ctx = &offloaded->context();
  } else {
    NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(f.kv_type));
    own_ctx = std::make_unique<InferenceContext>(*lm.model, &pool, f.ctx, kv_type);
    ctx = own_ctx.get();
    // Every token goes through the sparse FFN (windows are prefilled token by token there).
    NF_ASSIGN_OR_RETURN(in_memory, SetupSparse(f.sparse, src, lm, &pool, /*sparse_prefill=*/true));
    if (in_memory.ffn) ctx->SetFfnBackend(in_memory.ffn.get());
  }
  NF_ASSIGN_OR_RETURN(PerplexityResult r, WindowPerplexity(*ctx, ids, f.ctx, n_windows, hp.n_vocab));
  nlohmann::json offload;
  if (offloaded) {
    const sparse::OffloadGroupStats st = offloaded->ffn().TotalStats();
    const double n = static_cast<double>(std::max<int64_t>(1, r.predictions));
    offload = {{"deploy", f.deploy},
               {"mode", f.offload_mode},
               {"active_set", offloaded->predictor() ? "predictor" : "oracle"},
               {"hot_slots", offloaded->split().hot_slots},
               {"cold_slots", offloaded->split().cold_slots},
               {"hot_hit_rate", offloaded->ffn().cache().hot().TotalCounters().HitRate()},
               {"cold_hit_rate", offloaded->ffn().cache().cold().TotalCounters().HitRate()},
               {"mb_read_per_token", static_cast<double>(st.bytes_read) / 1e6 / n}};
  }
  if (f.json) {
    nlohmann::json j = {{"model", deployed ? f.deploy : f.source.path},
                        {"text", f.text_file},
                        {"ctx", f.ctx},
                        {"windows", n_windows},
                        {"predictions", r.predictions},
                        {"perplexity", r.perplexity},
                        {"tokens_per_s", r.predictions / r.seconds},
                        {"synthetic", hp.synthetic}};
    if (in_memory.ffn) j["sparse"] = SparseReport(*in_memory.ffn, hp.n_ff, false);
    if (offloaded) j["offload"] = offload;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    if (in_memory.ffn) SparseReport(*in_memory.ffn, hp.n_ff, true);
    if (offloaded) {
      std::fprintf(stderr, "offloaded (%s, %s): %lld hot cluster slots, %lld cold slots, %.3f MB read per token\n",
                   f.offload_mode.c_str(), offload["active_set"].get<std::string>().c_str(),
                   static_cast<long long>(offloaded->split().hot_slots),
                   static_cast<long long>(offloaded->split().cold_slots), offload["mb_read_per_token"].get<double>());
    }
    std::printf("perplexity %.4f over %lld windows of %lld tokens (%lld predictions), %.1f tok/s%s\n", r.perplexity,
                static_cast<long long>(n_windows), static_cast<long long>(f.ctx), static_cast<long long>(r.predictions),
                r.predictions / r.seconds, hp.synthetic ? " [SYNTHETIC weights]" : "");
  }
  return Status::Ok();
}

}  // namespace

void RegisterRunCommand(CLI::App& app, CommandAction* action) {
  auto f = std::make_shared<RunFlags>();
  f->sampler.temperature = 0.8f;
  CLI::App* sub = app.add_subcommand("run", "Generate text with the dense engine, streaming it, then report speed and memory");
  AddModelOptions(sub, &f->source, &f->threads, &f->no_mmap);
  auto* p = sub->add_option("-p,--prompt", f->prompt, "Prompt text (BOS is added when the model asks for it)");
  sub->add_option("-f,--file", f->prompt_file, "Read the prompt from a file")->excludes(p)->check(CLI::ExistingFile);
  sub->add_option("-n,--max-tokens", f->n_predict, "Tokens to generate at most")->check(cli::kPositive);
  sub->add_option("-c,--ctx", f->ctx, "Context size (0: prompt + max tokens, capped at the model's)");
  AddKvTypeOption(sub, &f->kv_type, "KV cache element type")->capture_default_str();
  AddSamplerOptions(sub, &f->sampler);
  sub->add_option("--stop", f->stop, "Stop when the text contains this string (repeatable)");
  sub->add_flag("--json", f->json, "Print a JSON summary (with the text) instead of streaming");
  const SparseOptions sparse = AddSparseOptions(sub, &f->sparse);
  sub->add_option("--prefill-batch-min", f->sparse.prefill_batch_min,
                  "--sparse oracle: prompts of at least this many tokens prefill by GEMM over every neuron, shorter "
                  "ones token by token (as `nflash offload --prefill-batch-min`, same default; the same logits either "
                  "way); --sparse predictor prefills token by token")
      ->check(cli::kPositive)
      ->capture_default_str()
      ->needs(sparse.sparse);
  AddBatchOption(sub, &f->max_batch, "; the same default as `nflash offload --batch`");
  sub->add_option("--pin-threads", f->pin_threads,
                  "auto, on or off: pin the calling thread and each pool worker to a CPU each, fastest CPUs first "
                  "(sysfs cpu_capacity), as `nflash offload --pin-threads` does (auto: when the threads take every CPU "
                  "the process may use, or the CPUs differ in speed)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  sub->callback([f, action] { *action = [f] { return RunGenerate(*f); }; });
}

void RegisterPerplexityCommand(CLI::App& app, CommandAction* action) {
  auto f = std::make_shared<PplFlags>();
  CLI::App* sub = app.add_subcommand("perplexity", "Perplexity of a text over non-overlapping windows");
  AddModelOptions(sub, &f->source, &f->threads, &f->no_mmap, /*model_required=*/false);
  sub->add_option("-f,--file", f->text_file, "Text file")->required()->check(CLI::ExistingFile);
  sub->add_option("--ctx", f->ctx, "Window size in tokens");
  AddKvTypeOption(sub, &f->kv_type, "KV cache element type")->capture_default_str();
  sub->add_option("--max-windows", f->max_windows, "Evaluate only the first N windows (0: all)");
  sub->add_flag("--json", f->json, "Print a JSON summary");
  const SparseOptions sparse = AddSparseOptions(sub, &f->sparse);
  // The offloaded engine (docs/runtime.md): same windows, the FFN read from the deployment's flash image.
  CLI::Option* deploy = sub->add_option("--deploy", f->deploy, "Instead of -m: a deployment directory (nflash pack), "
                                                               "run through the offloaded sparse runtime")
                            ->check(CLI::ExistingDirectory);
  // Each engine's own settings are refused beside the other's (CLI11 names both), where they were ignored before.
  for (CLI::Option* o : sparse.model_only) o->excludes(deploy);
  ExcludeModelOnlyOptions(sub, deploy);
  sub->add_option("--mode", f->offload_mode, "--deploy: full (io_uring, pipelined) or llmflash (blocking reads)")
      ->check(CLI::IsMember({"full", "llmflash"}))
      ->needs(deploy);
  sub->add_option("--active-set", f->active_set, "--deploy: auto, predictor or oracle")
      ->check(CLI::IsMember({"auto", "predictor", "oracle"}))
      ->needs(deploy);
  sub->add_option("--memory", f->memory, "--deploy: memory budget for everything the process holds, e.g. 2M")
      ->needs(deploy);
  sub->add_option("--hot-slots", f->hot_slots, "--deploy without --memory: hot cluster slots")->needs(deploy);
  sub->add_option("--cold-slots", f->cold_slots, "--deploy without --memory: cold neuron slots")->needs(deploy);
  sub->callback([f, action] { *action = [f] { return RunPerplexity(*f); }; });
}

}  // namespace nflash::cli
