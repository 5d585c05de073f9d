// `nflash offload`: greedy generation from a deployment directory with the FFN on flash (modes full and llmflash),
// reporting speed, per-token latency percentiles, cache hit rates, flash traffic, the memory accounting and the
// measured peak RSS. The dense baseline is `nflash run -m model.gguf` (mmap). Also the runtime flags it shares with
// `nflash serve -d` (commands.h: RuntimeFlags, AddRuntimeOptions, MakeRuntimeOptions, OpenRuntime).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "packer/deployment.h"
#include "planner/plan.h"
#include "runtime/cli/command.h"
#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/block_device.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/core/proc_stats.h"
#include "runtime/core/stats.h"
#include "runtime/sparse/commands.h"
#include "runtime/sparse/decode_floors.h"
#include "runtime/sparse/sparse_runtime.h"
#include "runtime/text/tokenizer.h"

namespace nflash::sparse {
namespace {

// SplitMix64's finalizer: a well-mixed 64-bit value from a counter (the per-token A/B draw of --warm-next-ab).
uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// -d, -c, -t and the flags that shape the runtime are RuntimeFlags (shared with `nflash serve -d`).
struct OffloadFlags : RuntimeFlags {
  std::string prompt = "Once upon a time";
  int64_t n_predict = 64;
  int64_t warmup = 0;
  bool json = false;
  std::string hw;  // hw.json: report the speed floors
  std::string trace_active;  // every active set of the decode path, one line each (OffloadFfn::SetActiveTrace)
  std::string trace_events;  // the decode's spans, Chrome Trace Event Format (OffloadFfn::SetEventTrace)
};

// plan.json (`nflash plan`) -> runtime options: the plan's memory limit, context, threads, queue depth, chunk size,
// hot clusters (the plan's hot neurons of each region, in clusters; with the LRU hot policy only the packer's hot part
// can be hot and hot neurons beyond it become cold slots) and cold slots per layer/expert; *lookahead gets the plan's
// lookahead (as --lookahead: -1 the runtime's rule, 0 off). Refuses a plan made for another deployment.
Status ApplyPlan(const std::string& plan_path, const std::string& deploy_dir, SparseRuntimeOptions* o, int* threads,
                 int64_t* lookahead) {
  NF_ASSIGN_OR_RETURN(planner::Plan plan, planner::LoadPlan(plan_path));
  NF_RETURN_IF_ERROR(planner::CheckPlanForDeployment(plan, deploy_dir));
  NF_ASSIGN_OR_RETURN(auto d, packer::Deployment::Open(deploy_dir));
  const auto& regions = d->manifest().regions;
  if (plan.regions.size() != regions.size()) {
    return Status::InvalidArgument(plan_path + ": " + std::to_string(plan.regions.size()) + " regions, " + deploy_dir +
                                   " has " + std::to_string(regions.size()));
  }
  const int64_t cluster = static_cast<int64_t>(OffloadFfn::HotSlotBytes(*d, o->cluster_groups) /
                                               d->layout().group_bytes) *
                          d->layout().slots_per_group;  // neurons per hot cluster
  o->hot_slots = 0;
  o->cold_slots_per_group.assign(regions.size(), 0);
  const bool pinned = o->hot_policy == sparse::HotPolicy::kPinned;
  if (pinned) o->hot_slots_per_group.assign(regions.size(), 0);
  for (size_t r = 0; r < regions.size(); ++r) {
    const planner::RegionPlan& rp = plan.regions[r];
    if (rp.layer != regions[r].layer || rp.expert != regions[r].expert) {
      return Status::InvalidArgument(plan_path + ": region " + std::to_string(r) + " is layer " +
                                     std::to_string(rp.layer) + ", the deployment's is layer " +
                                     std::to_string(regions[r].layer));
    }
    const int64_t hot = pinned ? rp.hot_neurons : std::min(rp.hot_neurons, regions[r].hot_count);
    // Pinned: whole clusters only (rounding down keeps the plan's memory). The memory of the hot neurons left over
    // (and, with LRU, of those beyond the packer's hot part) is not turned into this group's cold slots: a cold slot
    // may take more or less than a neuron's share of a cluster (4 KiB against 1 KiB for small bundles sharing a
    // group; 7168 against 8192 bytes for a 7B bundle at 512-byte alignment). Under the plan's budget the runtime gives
    // whatever the partitions leave to the shared overflow pool, at the real slot size.
    const int64_t clusters = pinned ? hot / cluster : (hot + cluster - 1) / cluster;
    o->hot_slots += clusters;
    if (pinned) o->hot_slots_per_group[r] = clusters;
    o->cold_slots_per_group[r] = rp.cold_slots;
  }
  o->shared_cold_pool = o->shared_cold_pool || plan.shared_cold_pool;
  o->memory_budget = plan.memory_limit_bytes;
  o->plan_fixed_bytes = plan.fixed_bytes;
  o->n_ctx = plan.n_ctx;
  NF_ASSIGN_OR_RETURN(o->kv_type, ParseKvType(plan.kv_type));
  o->io.queue_depth = static_cast<unsigned>(plan.queue_depth);
  o->chunk_requests = plan.cluster_neurons;
  *threads = plan.compute_threads;
  *lookahead = plan.lookahead;
  NF_LOG(Info) << "plan " << plan_path << ": " << plan.compute_threads << " compute thread(s), queue depth "
               << plan.queue_depth << ", " << o->hot_slots << " hot clusters"
               << (plan.shared_cold_pool ? ", one shared cold pool" : "")
               << (plan.lookahead == 0 ? ", no lookahead (plan --calibrate measured it slower)" : "") << ", predicted "
               << plan.predicted.tokens_per_s << " tok/s";
  return Status::Ok();
}

Status RunOffload(const OffloadFlags& f) {
  using Clock = std::chrono::steady_clock;
  // The tokenizer and the context size first (the KV cache is part of the fixed memory): -c 0 means prompt +
  // max tokens, as `nflash run` does, capped at the model's context length.
  LlamaHparams rhp;
  std::vector<int32_t> ids;
  {
    // Closed before the runtime opens: its metadata and this tokenizer (the vocabulary's arrays and strings: 18 MB
    // each for a 151936-token vocabulary) are not held twice beside the runtime's own, which its budget counts.
    NF_ASSIGN_OR_RETURN(GgufFile resident, GgufFile::OpenPathUncached(f.deploy + "/" + packer::kResidentFileName));
    NF_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> prompt_tok, LoadTokenizer(resident));
    NF_ASSIGN_OR_RETURN(rhp, ReadLlamaHparams(resident));
    ids = prompt_tok->Encode(f.prompt, prompt_tok->add_bos());
  }
  if (ids.empty()) return Status::InvalidArgument("the prompt is empty and the model adds no BOS token: pass -p");
  // The per-token A/B switch, if any: its seed, its JSON key and its name.
  struct AbSwitch {
    uint64_t seed;
    const char* key;
    const char* name;
  };
  const AbSwitch switches[] = {{f.warm_next_ab, "warm_next_ab", "warm-next"},
                               {f.pin_threads_ab, "pin_threads_ab", "pin-threads"},
                               {f.lookahead_input_ab, "lookahead_input_ab", "lookahead-input (on: projected, off: hits)"}};
  uint64_t ab_seed = 0;
  const char* ab_key = "";
  const char* ab_name = "";
  for (const AbSwitch& sw : switches) {
    if (sw.seed == 0) continue;
    if (ab_seed != 0) {
      return Status::InvalidArgument("--warm-next-ab, --pin-threads-ab, --lookahead-input-ab: one A/B switch per run");
    }
    ab_seed = sw.seed;
    ab_key = sw.key;
    ab_name = sw.name;
  }
  SparseRuntimeOptions o;
  int threads = 0;
  NF_RETURN_IF_ERROR(MakeRuntimeOptions(
      f, std::min<int64_t>(rhp.context_length, static_cast<int64_t>(ids.size()) + f.n_predict), &o, &threads));
  if (!f.plan.empty() && o.n_ctx < static_cast<int64_t>(ids.size()) + 1) {
    return Status::InvalidArgument("the plan's context (" + std::to_string(o.n_ctx) + " tokens) cannot hold the " +
                                   "prompt: re-plan with a larger --ctx");
  }
  ThreadPool pool(threads);
  NF_ASSIGN_OR_RETURN(std::unique_ptr<SparseRuntime> opened, OpenRuntime(f, o, &pool));
  SparseRuntime& rt = *opened;
  if (rt.tokenizer() == nullptr) return Status::Internal(f.deploy + ": the runtime loaded no tokenizer");
  const Tokenizer* tok = rt.tokenizer();
  if (f.lookahead_input_ab != 0 && rt.lookahead_input() != LookaheadInput::kProjected) {
    return Status::InvalidArgument("--lookahead-input-ab: the run guesses from " +
                                   std::string(LookaheadInputName(rt.lookahead_input())) + ", expected projected (" +
                                   f.deploy + " needs lookahead.gguf and a predictor, full mode, --lookahead-input "
                                   "projected, a lookahead and a dense model)");
  }
  std::unique_ptr<AtomicFileWriter> trace;
  if (!f.trace_active.empty()) {
    NF_ASSIGN_OR_RETURN(trace, AtomicFileWriter::Create(f.trace_active, /*overwrite=*/true));
    rt.ffn().SetActiveTrace(trace.get());
  }
  // --trace-events: opened now (a missing directory fails before the run), written and renamed after it.
  std::unique_ptr<AtomicFileWriter> events_out;
  if (!f.trace_events.empty()) {
    NF_ASSIGN_OR_RETURN(events_out, AtomicFileWriter::Create(f.trace_events, /*overwrite=*/true));
  }
  const LlamaHparams& hp = rt.model().hparams();
  // The disk's I/O scheduler: with none the decode's scattered reads waited less (docs/runtime.md); advice only, the
  // setting is the machine's.
  const BlockQueueInfo disk = rt.reader() ? DescribeBlockQueue(rt.reader()->Path()) : BlockQueueInfo{};
  if (rt.reader() && rt.reader()->direct_io() && !disk.scheduler.empty() && disk.scheduler != "none") {
    NF_LOG(Info) << "disk " << disk.device << " has the " << disk.scheduler << " I/O scheduler; with none the "
                 << "decode's reads waited ~13% less on the development VM (docs/runtime.md): echo none | sudo tee "
                 << "/sys/block/" << disk.device << "/queue/scheduler";
  }
  InferenceContext& ctx = rt.context();
  const int64_t room = ctx.n_ctx() - static_cast<int64_t>(ids.size());
  if (room <= 0) return Status::InvalidArgument("the prompt does not fit the context (" + std::to_string(ctx.n_ctx()) + ")");
  const int64_t n = std::min(f.n_predict, room);
  if (n < f.n_predict) {
    NF_LOG(Warning) << "the context holds " << ctx.n_ctx() << " tokens" << (f.plan.empty() ? "" : " (the plan's)")
                    << ": " << ids.size() << " of prompt leave room for " << n << " of the " << f.n_predict
                    << " tokens asked for";
  }

  const OffloadPrefillStats pf0 = rt.ffn().prefill_stats();
  const auto t0 = Clock::now();
  NF_RETURN_IF_ERROR(ctx.Eval(ids, false));
  auto t1 = Clock::now();
  const OffloadPrefillStats pf1 = rt.ffn().prefill_stats();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  rt.ffn().ResetStats();  // decode figures only
  EventTrace events;
  if (events_out) rt.ffn().SetEventTrace(&events);  // the decode, warm-up steps included
  uint64_t wait0 = rt.ffn().io_wait_ns();
  uint64_t busy0 = rt.ffn().io_busy_ns();
  io::IoCounters io0 = rt.reader() ? rt.reader()->Counters() : io::IoCounters{};
  double cpu0 = ProcessCpuSeconds();
  ContextSwitches csw0 = ProcessContextSwitches();
  const int64_t warmup = std::min<int64_t>(f.warmup, n - 1);
  std::vector<int32_t> out;
  std::vector<double> lat_ms;
  std::vector<double> miss_rate;  // per measured token: share of its active neurons read from flash
  std::vector<int64_t> tok_requests;  // per measured token: reads issued (lookahead included)
  std::vector<double> tok_wait_ms;    // per measured token: compute thread's time waiting for reads
  std::vector<int> tok_ab_on;         // --warm-next-ab / --pin-threads-ab: per measured token, whether it was on
  std::vector<double> tok_warm_mb;    // per measured token: MB streamed through the caches while waiting
  Detokenizer detok(*tok);
  std::string text;
  for (int32_t t : ids) text += detok.Push(t);
  for (int64_t i = 0; i < n; ++i) {
    if (i == warmup && warmup > 0) {
      // The warm-up steps filled the caches: measure from here (steady state, what the planner predicts).
      rt.ffn().ResetStats();
      wait0 = rt.ffn().io_wait_ns();
      busy0 = rt.ffn().io_busy_ns();
      io0 = rt.reader() ? rt.reader()->Counters() : io::IoCounters{};
      cpu0 = ProcessCpuSeconds();
      csw0 = ProcessContextSwitches();
      lat_ms.clear();
      miss_rate.clear();
      tok_requests.clear();
      tok_wait_ms.clear();
      tok_ab_on.clear();
      tok_warm_mb.clear();
      t1 = Clock::now();
    }
    const float* lg = ctx.logits();
    const int32_t next = static_cast<int32_t>(std::max_element(lg, lg + hp.n_vocab) - lg);
    out.push_back(next);
    text += detok.Push(next);
    if (tok->IsEndOfGeneration(next)) break;
    // --warm-next-ab / --pin-threads-ab: on or off at random per token (SplitMix64 of the seed and the step), so that
    // the two groups share the machine's state and the tokens' mix of reads.
    const bool ab_on = ab_seed == 0 || (SplitMix64(ab_seed * 0x100000001B3ull + static_cast<uint64_t>(i)) & 1);
    if (f.warm_next_ab != 0) rt.ffn().SetWarmNextEnabled(ab_on);
    if (f.pin_threads_ab != 0) rt.ffn().SetPinThreadsEnabled(ab_on);
    if (f.lookahead_input_ab != 0) rt.ffn().SetProjectedGuess(ab_on);
    const OffloadGroupStats before = rt.ffn().TotalStats();
    const uint64_t wait_before = rt.ffn().io_wait_ns();
    const uint64_t step_begin = SteadyNowNs();
    NF_RETURN_IF_ERROR(ctx.Eval(std::vector<int32_t>{next}, false));
    const uint64_t step_end = SteadyNowNs();
    lat_ms.push_back(static_cast<double>(step_end - step_begin) / 1e6);
    if (events_out) events.Add(TraceSpan{"token", TraceLane::kCompute, step_begin, step_end, -1, i});
    const OffloadGroupStats after = rt.ffn().TotalStats();
    tok_requests.push_back(after.requests - before.requests);
    tok_wait_ms.push_back(static_cast<double>(rt.ffn().io_wait_ns() - wait_before) / 1e6);
    tok_ab_on.push_back(ab_on ? 1 : 0);
    tok_warm_mb.push_back(static_cast<double>(after.warm_next_bytes - before.warm_next_bytes) / 1e6);
    if (after.active > before.active) {
      miss_rate.push_back(static_cast<double>(after.missed - before.missed) /
                          static_cast<double>(after.active - before.active));
    }
  }
  text += detok.Finish();
  if (trace) {
    rt.ffn().SetActiveTrace(nullptr);
    NF_RETURN_IF_ERROR(trace->Commit());
  }
  const auto t2 = Clock::now();
  const uint64_t io_busy_ns = rt.ffn().io_busy_ns() - busy0;
  if (events_out) {
    rt.ffn().SetEventTrace(nullptr);
    const std::string text = events.ToJson();
    NF_RETURN_IF_ERROR(events_out->Append(text.data(), text.size()));
    NF_RETURN_IF_ERROR(events_out->Commit());
  }
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const double decode_cpu_s = ProcessCpuSeconds() - cpu0;  // every thread: compute, pool, I/O
  const ContextSwitches csw = ProcessContextSwitches();
  const double steps = std::max<double>(1.0, static_cast<double>(lat_ms.size()));
  const OffloadGroupStats st = rt.ffn().TotalStats();
  const CacheCounters hot = rt.ffn().cache().hot().TotalCounters();
  const CacheCounters cold = rt.ffn().cache().cold().TotalCounters();
  const ProcessMemory mem = ReadProcessMemory();
  const double io_wait_ms = static_cast<double>(rt.ffn().io_wait_ns() - wait0) / 1e6;
  io::IoCounters ioc;
  if (rt.reader()) ioc = rt.reader()->Counters();
  // Per-request read latency (submission to completion) over the decode's requests, in microseconds.
  std::vector<double> io_lat_us;
  if (rt.reader()) {
    const std::vector<uint32_t> sample = rt.reader()->LatencySampleNs();
    const size_t n = std::min<size_t>(sample.size(), static_cast<size_t>(ioc.requests - io0.requests));
    for (size_t i = sample.size() - n; i < sample.size(); ++i) io_lat_us.push_back(sample[i] / 1e3);
  }
  const double token_ms_mean = Mean(lat_ms);
  const double miss_mean = Mean(miss_rate);
  const double miss_p99 = Percentile(miss_rate, 0.99);
  planner::Floors floors;
  if (!f.hw.empty()) {
    NF_ASSIGN_OR_RETURN(floors, DecodeFloors(rt, f.hw, MeasuredDecodeWork(rt, st, steps, pool.NumThreads(),
                                                                          token_ms_mean)));
  }

  nlohmann::json j = {
      {"deploy", f.deploy},
      {"mode", f.mode},
      {"active_set", rt.predictor() ? "predictor" : "oracle"},
      {"direct_io", rt.reader() ? rt.reader()->direct_io() : false},
      {"block_device", disk.device},
      {"io_scheduler", disk.scheduler},
      {"prompt_tokens", ids.size()},
      {"generated", out.size()},
      {"prefill_s", prefill_s},
      {"cold_preloaded_bundles", rt.ffn().preloaded_bundles()},
      {"cold_preload_s", rt.ffn().preload_seconds()},
      {"warmup_tokens", warmup},
      {"decode_tok_s", lat_ms.empty() ? 0.0 : static_cast<double>(lat_ms.size()) / decode_s},
      {"token_ms_p50", Percentile(lat_ms, 0.5)},
      {"token_ms_p90", Percentile(lat_ms, 0.9)},
      {"token_ms_p99", Percentile(lat_ms, 0.99)},
      {"token_latencies_ms", lat_ms},
      {"token_requests", tok_requests},
      {"token_io_wait_ms", tok_wait_ms},
      {"token_warm_next_mb", tok_warm_mb},
      {"token_ms_mean", token_ms_mean},
      {"hot_hit_rate", hot.HitRate()},
      {"cold_hit_rate", cold.HitRate()},
      {"miss_rate_mean", miss_mean},
      {"miss_rate_p99", miss_p99},
      {"active_neurons_per_token", static_cast<double>(st.active) / steps},
      // Of those, the ones whose gate passed the activation test (rows of the down accumulation): the rest were
      // predicted active (and read when missed) but contributed nothing.
      {"used_neurons_per_token", static_cast<double>(st.used) / steps},
      {"mb_read_per_token", static_cast<double>(st.bytes_read) / 1e6 / steps},
      {"requests_per_token", static_cast<double>(st.requests) / steps},
      {"scattered_requests_per_token", static_cast<double>(st.scattered_requests) / steps},
      {"io_wait_ms_per_token", io_wait_ms / steps},
      // Share of the measured decode time with reads in flight from the I/O thread (full mode; 0 in llmflash mode,
      // whose reads are the compute thread's own and counted in io_wait_ms_per_token).
      {"io_busy_share", decode_s > 0 ? static_cast<double>(io_busy_ns) / 1e9 / decode_s : 0.0},
      // Weights streamed through the CPU caches while waiting for reads (--warm-next), per token.
      {"warm_next_mb_per_token", static_cast<double>(st.warm_next_bytes) / 1e6 / steps},
      {"warm_next_bytes", rt.ffn().warm_next_cap()},
      {"pin_threads", f.pin_threads},
      {"io_submit_cpu_ms", static_cast<double>(ioc.submit_cpu_ns - io0.submit_cpu_ns) / 1e6},
      {"io_latency_us_p50", Percentile(io_lat_us, 0.5)},
      {"io_latency_us_p90", Percentile(io_lat_us, 0.9)},
      {"io_latency_us_p99", Percentile(io_lat_us, 0.99)},
      {"io_submit_calls_per_token", static_cast<double>(ioc.submit_calls - io0.submit_calls) / steps},
      {"voluntary_switches_per_token", static_cast<double>(csw.voluntary - csw0.voluntary) / steps},
      {"involuntary_switches_per_token", static_cast<double>(csw.involuntary - csw0.involuntary) / steps},
      {"compute_threads", pool.NumThreads()},
      {"queue_depth", rt.reader() ? static_cast<int64_t>(rt.reader()->queue_depth()) : int64_t{0}},
      {"chunk_requests", rt.ffn().chunk_requests()},
      {"cpu_ms_per_token", decode_cpu_s * 1e3 / steps},
      {"cpu_util", decode_s > 0 ? decode_cpu_s / decode_s : 0.0},
      {"retries", st.retries},
      {"two_phase", rt.ffn().two_phase()},
      {"lookahead_slots", rt.ffn().lookahead_slots()},
      {"lookahead_started_token", rt.ffn().lookahead_started_token()},
      // MoE decode: a layer's routed experts' misses read at its first expert (prefetched_per_token counts them).
      {"sibling_readahead", rt.ffn().sibling_readahead()},
      {"lookahead_source", LookaheadSourceName(rt.ffn().options().lookahead_source)},
      {"lookahead_input", LookaheadInputName(rt.lookahead_input())},
      {"lookahead_replay", rt.ffn().options().lookahead_replay.empty()
                               ? nlohmann::json(nullptr)
                               : nlohmann::json(rt.ffn().options().lookahead_replay)},
      {"lookahead_replay_followed", rt.ffn().replay_followed()},
      {"kv_type", KvTypeName(rt.context().kv_type())},
      {"kv_cache_bytes", rt.fixed().kv_cache},
      {"prefetched_per_token", static_cast<double>(st.prefetched) / steps},
      {"prefetch_used_per_token", static_cast<double>(st.prefetch_used) / steps},
      // The lookahead's share of mb_read_per_token and requests_per_token (the I/O floor leaves out the part of it
      // that no active set used).
      {"prefetch_mb_per_token", static_cast<double>(st.prefetch_bytes) / 1e6 / steps},
      {"prefetch_requests_per_token", static_cast<double>(st.prefetch_requests) / steps},
      {"gate_requests_per_token", static_cast<double>(st.gate_requests) / steps},
      {"gate_mb_per_token", static_cast<double>(st.gate_bytes) / 1e6 / steps},
      {"updown_requests_per_token", static_cast<double>(st.updown_requests) / steps},
      {"updown_mb_per_token", static_cast<double>(st.updown_bytes) / 1e6 / steps},
      {"updown_skipped_per_token", static_cast<double>(st.updown_skipped) / steps},
      {"memory_budget", rt.budget()},
      // The active-set source's weights read per token: the predictor's, or the oracle's gate rows (the floors'
      // predictor part).
      {"predictor_bytes", rt.fixed().predictor},
      {"accounted_bytes", rt.fixed().Total() + rt.split().hot_bytes + rt.split().cold_bytes},
      {"hot_slots", rt.split().hot_slots},
      {"cold_slots", rt.split().cold_slots},
      // The budget's cache split without a plan (-1: sizes given) and why; the profile's served shares (-1: none).
      {"hot_fraction", rt.hot_split().hot_fraction},
      {"hot_fraction_why", rt.hot_split().why},
      {"served_pinned_predicted", rt.hot_split().served_pinned},
      {"served_lru_predicted", rt.hot_split().served_lru},
      {"cold_slot_bytes", rt.cold_slot_bytes()},
      // One LRU pool for every layer/expert, or a partition each (a plan's regions, plus their overflow pool).
      {"cold_pool", rt.ffn().options().cold_slots_per_group.empty() ? "shared" : "per-layer"},
      {"peak_rss_bytes", mem.peak_rss_bytes},
      {"tokens", out},
      {"text", text},
  };
  // Decode, per layer (MoE: its experts summed), per measured token: where the reads and the waits are.
  nlohmann::json decode_layers = nlohmann::json::array();
  {
    const std::vector<OffloadGroupStats>& gs = rt.ffn().stats();
    const size_t per_layer = gs.size() / static_cast<size_t>(std::max<int64_t>(1, hp.n_layers));
    for (int64_t l = 0; l < hp.n_layers && per_layer > 0; ++l) {
      OffloadGroupStats s;
      for (size_t e = 0; e < per_layer; ++e) s.Add(gs[static_cast<size_t>(l) * per_layer + e]);
      decode_layers.push_back({{"layer", l},
                               {"active", static_cast<double>(s.active) / steps},
                               {"missed", static_cast<double>(s.missed) / steps},
                               {"used", static_cast<double>(s.used) / steps},
                               {"requests", static_cast<double>(s.requests) / steps},
                               {"prefetched", static_cast<double>(s.prefetched) / steps},
                               {"prefetch_used", static_cast<double>(s.prefetch_used) / steps},
                               {"io_wait_ms", static_cast<double>(s.io_wait_ns) / 1e6 / steps}});
    }
  }
  j["decode_layers"] = decode_layers;
  // Where the threads ran (--pin-threads): the caller's, the workers' and the I/O thread's CPU; null when unpinned.
  // And the flash disk's interrupts per CPU when the runtime opened, which chose those CPUs (empty: unknown).
  if (const ThreadCpuPlan* tp = rt.ffn().thread_plan()) {
    j["thread_cpus"] = {{"caller", tp->caller}, {"workers", tp->workers}, {"io", tp->io}};
  } else {
    j["thread_cpus"] = nullptr;
  }
  j["disk_interrupts_per_cpu"] = rt.ffn().disk_interrupts();
  j["cpu_capacity"] = rt.ffn().cpu_capacity();
  // Where the FFN's time went, per measured token (OffloadFfn::kFfnStepNames; the token path's wall time, every layer).
  nlohmann::json ffn_steps = nlohmann::json::object();
  for (int i = 0; i < OffloadFfn::kFfnSteps; ++i) {
    const double ns = static_cast<double>(rt.ffn().step_ns()[static_cast<size_t>(i)]);
    ffn_steps[OffloadFfn::kFfnStepNames[i]] = ns / 1e6 / steps;
  }
  j["ffn_step_ms_per_token"] = ffn_steps;
  if (ab_seed != 0) {
    // Measured tokens with the switch on and off (scripts/ab_tokens.py fits token time on reads and the switch over
    // several runs' JSON).
    double on_ms = 0, off_ms = 0;
    int64_t on_n = 0;
    for (size_t i = 0; i < lat_ms.size(); ++i) {
      (tok_ab_on[i] ? on_ms : off_ms) += lat_ms[i];
      on_n += tok_ab_on[i];
    }
    const int64_t off_n = static_cast<int64_t>(lat_ms.size()) - on_n;
    j[ab_key] = {{"seed", ab_seed},
                 {"token_on", tok_ab_on},
                 {"on_tokens", on_n},
                 {"off_tokens", off_n},
                 {"on_ms_mean", on_n > 0 ? on_ms / static_cast<double>(on_n) : 0.0},
                 {"off_ms_mean", off_n > 0 ? off_ms / static_cast<double>(off_n) : 0.0}};
  }
  nlohmann::json layers = nlohmann::json::array();
  for (const PrefillLayerTiming& l : rt.ffn().prefill_layers()) {
    layers.push_back({{"chunk", l.chunk},
                      {"layer", l.layer},
                      {"expert", l.expert},
                      {"mb", static_cast<double>(l.bytes) / 1e6},
                      {"read_ms", static_cast<double>(l.read_ns) / 1e6},
                      {"wait_ms", static_cast<double>(l.wait_ns) / 1e6},
                      {"verify_ms", static_cast<double>(l.verify_ns) / 1e6},
                      {"compute_ms", static_cast<double>(l.compute_ns) / 1e6}});
  }
  // Batched prefill of the prompt, per chunk (a prompt longer than --batch runs in chunks) and layer or MoE expert
  // pass (Fig. 8; expert -1 for a dense FFN); empty: token by token. "prefill": the same summed over the prompt.
  j["prefill_layers"] = layers;
  const auto ms = [](uint64_t ns) { return static_cast<double>(ns) / 1e6; };
  j["prefill"] = {
      {"chunks", layers.empty() ? int64_t{0} : rt.ffn().prefill_layers().back().chunk + 1},
      {"passes", pf1.layers - pf0.layers},
      {"token_ffn_pairs", pf1.tokens - pf0.tokens},
      {"mb_read", static_cast<double>(pf1.bytes_read - pf0.bytes_read) / 1e6},
      {"requests", pf1.requests - pf0.requests},
      {"prefetch_hits", pf1.prefetch_hits - pf0.prefetch_hits},
      {"prefetch_dropped", pf1.prefetch_dropped - pf0.prefetch_dropped},
      {"dropped_mb", static_cast<double>(pf1.dropped_bytes - pf0.dropped_bytes) / 1e6},
      {"io_wait_ms", ms(pf1.io_wait_ns - pf0.io_wait_ns)},
      {"verify_ms", ms(pf1.verify_ns - pf0.verify_ns)},
      {"compute_ms", ms(pf1.compute_ns - pf0.compute_ns)},
      {"warmed_hot_clusters", pf1.warmed_clusters - pf0.warmed_clusters},
      {"warmed_cold_bundles", pf1.warmed_bundles - pf0.warmed_bundles},
      {"retries", pf1.retries - pf0.retries},
  };
  if (!f.hw.empty()) {
    j["floor_compute_ms"] = floors.compute_ms;
    j["floor_io_ms"] = floors.io_ms;
    j["floor_ratio"] = floors.ratio;
    j["floor_parts_ms"] = {{"dense", floors.dense_ms}, {"predictor", floors.predictor_ms}, {"ffn", floors.ffn_ms}};
  }
  if (f.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return Status::Ok();
  }
  std::printf("%s\n\n", text.c_str());
  std::printf("%s", rt.Accounting().c_str());
  std::printf("  %-18s %12s\n", "peak RSS", FormatBytes(mem.peak_rss_bytes).c_str());
  const nlohmann::json& pf = j["prefill"];
  std::printf("prefill: %zu tokens in %.2f s", ids.size(), prefill_s);
  if (pf["passes"].get<int64_t>() > 0) {
    std::printf(", batched: %lld chunks, %lld FFN passes, %.1f MB read (%lld regions read ahead, %lld of them unused); "
                "I/O wait %.1f ms, verify %.1f ms, FFN compute %.1f ms",
                static_cast<long long>(pf["chunks"].get<int64_t>()), static_cast<long long>(pf["passes"].get<int64_t>()),
                pf["mb_read"].get<double>(),
                static_cast<long long>(pf["prefetch_hits"].get<int64_t>() + pf["prefetch_dropped"].get<int64_t>()),
                static_cast<long long>(pf["prefetch_dropped"].get<int64_t>()), pf["io_wait_ms"].get<double>(),
                pf["verify_ms"].get<double>(), pf["compute_ms"].get<double>());
  }
  std::printf("\n");
  std::printf("decode (%s, %s): %zu tokens, %.2f tok/s; per token P50 %.2f ms, P90 %.2f ms, P99 %.2f ms; CPU %.1f ms "
              "per token (%.2f cores busy)\n",
              f.mode.c_str(), rt.predictor() ? "predictor" : "oracle", lat_ms.size(),
              j["decode_tok_s"].get<double>(), Percentile(lat_ms, 0.5), Percentile(lat_ms, 0.9), Percentile(lat_ms, 0.99),
              j["cpu_ms_per_token"].get<double>(), j["cpu_util"].get<double>());
  std::printf("cache: hot hit rate %.3f (%d slots), cold hit rate %.3f (%d slots); per token: %.1f active neurons "
              "(miss rate mean %.3f, P99 %.3f), %.3f MB read in %.1f requests, %.3f ms waiting for I/O, reads in "
              "flight %.0f%% of the time; %lld retries%s\n",
              hot.HitRate(), static_cast<int>(rt.split().hot_slots), cold.HitRate(),
              static_cast<int>(rt.split().cold_slots), static_cast<double>(st.active) / steps, miss_mean, miss_p99,
              static_cast<double>(st.bytes_read) / 1e6 / steps, static_cast<double>(st.requests) / steps,
              io_wait_ms / steps, 100.0 * j["io_busy_share"].get<double>(), static_cast<long long>(st.retries),
              rt.reader() && !rt.reader()->direct_io() ? " (O_DIRECT refused: reads went through the page cache)" : "");
  if (ab_seed != 0) {
    const nlohmann::json& ab = j[ab_key];
    std::printf("%s A/B (seed %llu): on %lld tokens, %.2f ms mean; off %lld tokens, %.2f ms mean\n",
                ab_name, static_cast<unsigned long long>(ab_seed),
                static_cast<long long>(ab["on_tokens"].get<int64_t>()), ab["on_ms_mean"].get<double>(),
                static_cast<long long>(ab["off_tokens"].get<int64_t>()), ab["off_ms_mean"].get<double>());
  }
  if (rt.ffn().lookahead_slots() > 0 && !rt.ffn().lookahead_on()) {
    std::printf("lookahead adaptive, never on: waiting for reads stayed under its share of the time\n");
  } else if (rt.ffn().lookahead_slots() > 0) {
    if (rt.ffn().lookahead_started_token() > 0) {
      std::printf("lookahead adaptive, on after %lld tokens (the statistics cover the whole run)\n",
                  static_cast<long long>(rt.ffn().lookahead_started_token()));
    }
    std::printf("lookahead (%s from %s, %lld bundles per layer at most), per token: %.1f bundles read ahead, %.1f of "
                "them used (%.1f%% of the misses); %.3f ms choosing them, %.3f ms verifying them\n",
                LookaheadSourceName(rt.ffn().options().lookahead_source),
                LookaheadInputName(rt.lookahead_input()),
                static_cast<long long>(rt.ffn().lookahead_slots()), static_cast<double>(st.prefetched) / steps,
                static_cast<double>(st.prefetch_used) / steps,
                st.missed > 0 ? 100.0 * static_cast<double>(st.prefetch_used) / static_cast<double>(st.missed) : 0.0,
                static_cast<double>(st.lookahead_ns) / 1e6 / steps, static_cast<double>(st.lookahead_verify_ns) / 1e6 / steps);
  }
  if (rt.ffn().two_phase()) {
    std::printf("two-phase loading, per token: %.1f gate pages (%.3f MB), %.1f up+down reads (%.3f MB), %.1f up+down "
                "parts skipped (gate inactive)\n",
                static_cast<double>(st.gate_requests) / steps, static_cast<double>(st.gate_bytes) / 1e6 / steps,
                static_cast<double>(st.updown_requests) / steps, static_cast<double>(st.updown_bytes) / 1e6 / steps,
                static_cast<double>(st.updown_skipped) / steps);
  }
  if (!f.hw.empty()) {
    std::printf("floors (%s): compute %.3f ms (dense %.3f + active set %.3f + FFN rows %.3f), I/O %.3f ms; measured "
                "%.3f ms per token = %.2fx the floor\n",
                f.hw.c_str(), floors.compute_ms, floors.dense_ms, floors.predictor_ms, floors.ffn_ms, floors.io_ms,
                token_ms_mean, floors.ratio);
  }
  return Status::Ok();
}

}  // namespace

Status CheckCacheSizeFlags(const std::string& memory, int64_t hot_slots, int64_t cold_slots) {
  if (!memory.empty() && (hot_slots > 0 || cold_slots > 0)) {
    return Status::InvalidArgument("--memory " + memory +
                                   " is split into the cache regions by the runtime: drop --hot-slots and --cold-slots "
                                   "(or drop --memory to give the regions' sizes without a budget)");
  }
  return Status::Ok();
}

Status MakeRuntimeOptions(const RuntimeFlags& f, int64_t default_ctx, SparseRuntimeOptions* o, int* threads) {
  if (f.mode == "full") {
    o->mode = OffloadMode::kFull;
  } else if (f.mode == "llmflash") {
    o->mode = OffloadMode::kLlmFlash;
  } else {
    return Status::InvalidArgument("--mode " + f.mode +
                                   ": expected full or llmflash (dense-mmap: `nflash run -m MODEL.gguf`, or `nflash "
                                   "bench --modes dense-mmap,full,llmflash,in-memory --deploy DIR -m MODEL.gguf` for "
                                   "every mode side by side, dense-mmap in a memory cgroup of the budget)");
  }
  if (f.active_set == "auto") o->active_set = ActiveSetSource::kAuto;
  else if (f.active_set == "predictor") o->active_set = ActiveSetSource::kPredictor;
  else if (f.active_set == "oracle") o->active_set = ActiveSetSource::kOracle;
  else return Status::InvalidArgument("--active-set " + f.active_set + ": expected auto, predictor or oracle");
  if (!f.memory.empty()) {
    auto budget = ParseMemorySize(f.memory);
    if (!budget.ok()) return budget.status().WithContext("--memory");
    o->memory_budget = *budget;
    if (o->memory_budget == 0) return Status::InvalidArgument("--memory 0: give a budget, or leave --memory out");
  }
  o->n_ctx = f.ctx > 0 ? f.ctx : default_ctx;
  if (!f.kv_type.empty()) {
    NF_ASSIGN_OR_RETURN(o->kv_type, ParseKvType(f.kv_type));
  }
  o->hot_slots = f.hot_slots;
  o->cold_slots = f.cold_slots;
  if (f.hot_fraction == "auto") {
    o->hot_fraction = kAutoHotFraction;
  } else {
    char* end = nullptr;
    const double v = std::strtod(f.hot_fraction.c_str(), &end);
    if (f.hot_fraction.empty() || *end != '\0' || !(v >= 0.0 && v <= 1.0)) {
      return Status::InvalidArgument("--hot-fraction " + f.hot_fraction + ": expected auto or a share in [0, 1]");
    }
    o->hot_fraction = v;
  }
  if (f.plan.empty()) {
    NF_RETURN_IF_ERROR(CheckCacheSizeFlags(f.memory, f.hot_slots, f.cold_slots));
    if (f.memory.empty() && f.hot_fraction_given) {
      return Status::InvalidArgument("--hot-fraction " + f.hot_fraction +
                                     " shares a --memory budget's cache between pinned hot clusters and LRU slots: "
                                     "give --memory (without a budget the regions are --hot-slots and --cold-slots)");
    }
  }
  o->cluster_groups = f.cluster_groups;
  o->chunk_requests = f.chunk_requests > 0 ? f.chunk_requests : kDefaultChunkRequests;
  o->io.queue_depth = f.queue_depth > 0 ? f.queue_depth : io::kDefaultQueueDepth;
  o->io.buffered = f.buffered;
  o->batched_prefill = !f.token_prefill;
  o->prefill_in_cache = f.prefill_in_cache;
  o->batched_prefill_min_tokens = f.prefill_batch_min;
  o->max_batch = f.max_batch;
  o->scatter_reads = !f.no_scatter;
  o->slot_alignment = f.slot_alignment;
  o->embedding_on_flash = !f.resident_embedding;
  o->cold_overflow = !f.no_cold_overflow;
  o->preload_cold = !f.no_cold_preload;
  o->sibling_readahead = !f.no_sibling_readahead;
  o->cold_protected_fraction = f.cold_protected;
  if (f.two_phase != "on" && f.two_phase != "off" && f.two_phase != "auto") {
    return Status::InvalidArgument("--two-phase " + f.two_phase + ": expected on, off or auto");
  }
  o->two_phase = f.two_phase != "off";
  o->lookahead_keep = f.lookahead_keep;
  o->warm_next_bytes = f.warm_next_mib < 0 ? -1 : static_cast<int64_t>(f.warm_next_mib * 1048576.0);
  NF_ASSIGN_OR_RETURN(o->pin_threads, ParsePinThreads(f.pin_threads));
  NF_ASSIGN_OR_RETURN(o->lookahead_source, ParseLookaheadSource(f.lookahead_source));
  NF_ASSIGN_OR_RETURN(o->lookahead_input, ParseLookaheadInput(f.lookahead_input));
  o->lookahead_replay = f.lookahead_replay;
  if (f.cold_pool != "per-layer" && f.cold_pool != "shared") {
    return Status::InvalidArgument("--cold-pool " + f.cold_pool + ": expected per-layer or shared");
  }
  o->shared_cold_pool = f.cold_pool == "shared";
  NF_ASSIGN_OR_RETURN(o->hot_policy, ParseHotPolicy(f.hot_policy));
  *threads = f.threads;
  int64_t lookahead_flag = f.lookahead == kLookaheadNotGiven ? -1 : f.lookahead;
  if (!f.plan.empty()) {
    if (!f.memory.empty() || f.hot_slots > 0 || f.cold_slots > 0 || f.hot_fraction_given || f.ctx > 0) {
      return Status::InvalidArgument("--plan sets the memory, cache sizes and context: drop --memory, --hot-slots, "
                                     "--cold-slots, --hot-fraction and --ctx");
    }
    const KvType asked = o->kv_type;
    int64_t plan_lookahead = -1;
    NF_RETURN_IF_ERROR(ApplyPlan(f.plan, f.deploy, o, threads, &plan_lookahead));
    if (!f.kv_type.empty() && asked != o->kv_type) {  // the KV cache is part of the plan's memory
      return Status::InvalidArgument("--kv-type " + f.kv_type + ": the plan " + f.plan + " sized its KV cache as " +
                                     KvTypeName(o->kv_type) + " (re-plan with --kv-type " + f.kv_type + ")");
    }
    // Settings that do not change the memory: a flag given on the command line wins over the plan (a comparison
    // against the plan's choice).
    if (f.threads > 0) {
      NF_LOG(Info) << "-t " << f.threads << " replaces the plan's " << *threads << " compute thread(s)";
      *threads = f.threads;
    }
    if (f.queue_depth > 0) {
      NF_LOG(Info) << "--queue-depth " << f.queue_depth << " replaces the plan's " << o->io.queue_depth;
      o->io.queue_depth = f.queue_depth;
    }
    if (f.chunk_requests > 0) {
      NF_LOG(Info) << "--chunk-requests " << f.chunk_requests << " replaces the plan's " << o->chunk_requests;
      o->chunk_requests = f.chunk_requests;
    }
    if (f.lookahead == kLookaheadNotGiven) {
      lookahead_flag = plan_lookahead;
    } else if (f.lookahead != plan_lookahead) {
      NF_LOG(Info) << "--lookahead " << f.lookahead << " replaces the plan's " << plan_lookahead;
    }
  }
  const LookaheadChoice lookahead =
      AutoLookahead(lookahead_flag, *threads, ThreadsPinned(o->mode, o->pin_threads, *threads));
  o->lookahead_slots = lookahead.slots;
  o->lookahead_adaptive = lookahead.adaptive;
  return Status::Ok();
}

Result<std::unique_ptr<SparseRuntime>> OpenRuntime(const RuntimeFlags& f, const SparseRuntimeOptions& o,
                                                   ThreadPool* pool) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<SparseRuntime> rt, SparseRuntime::Open(f.deploy, o, pool));
  if (f.two_phase == "on" && !rt->ffn().two_phase()) {
    NF_LOG(Warning) << "--two-phase on: not applicable to this run (see the log line above); whole bundles are read";
  }
  // Flags of full mode's pipeline that this run cannot use: said, not dropped without a word.
  if (f.lookahead > 0 && rt->ffn().lookahead_slots() == 0) {
    NF_LOG(Warning) << "--lookahead " << f.lookahead
                    << ": not applicable to this run (reads ahead need full mode, whole-bundle reads, two layers or "
                       "more and cold slots); nothing is read ahead";
  }
  if (f.warm_next_mib > 0 && rt->ffn().warm_next_cap() == 0) {
    NF_LOG(Warning) << "--warm-next " << f.warm_next_mib
                    << ": not applicable to this run (warming needs full mode's I/O thread); nothing is warmed";
  }
  return rt;
}

void AddRuntimeOptions(CLI::App* cmd, RuntimeFlags* flags) {
  cmd->add_option("--mode", flags->mode, "full (io_uring, pipelined) or llmflash (blocking reads, no overlap)");
  cmd->add_option("--memory", flags->memory, "Memory budget for everything the process holds, e.g. 1.5G, 800M");
  cmd->add_option("--active-set", flags->active_set, "auto, predictor or oracle (exact; gate rows held in memory)");
  cmd->add_option("--hot-slots", flags->hot_slots, "Without --memory: hot cluster slots");
  cmd->add_option("--cold-slots", flags->cold_slots, "Without --memory: cold neuron slots");
  cmd->add_option("--hot-fraction", flags->hot_fraction,
                  "With --memory and no plan: share of the cache budget for pinned hot clusters, or auto (all pinned or "
                  "all one LRU pool, whichever the deployment's profile serves more with)")
      ->capture_default_str()
      ->each([flags](const std::string&) { flags->hot_fraction_given = true; });
  cmd->add_option("--hot-policy", flags->hot_policy,
                  "Hot region: pinned (each layer's hottest clusters loaded at start, never evicted) or lru (one "
                  "pool, LRU per cluster, filled on demand)")
      ->capture_default_str();
  cmd->add_option("--cluster-groups", flags->cluster_groups, "Hot cluster size in flash groups (0: 64 KiB)");
  cmd->add_option("--chunk-requests", flags->chunk_requests,
                  "Reads per pipeline chunk (default " + std::to_string(kDefaultChunkRequests) +
                      "; replaces the plan's)")
      ->check(cli::kPositive);
  cmd->add_option("--queue-depth", flags->queue_depth,
                  "io_uring queue depth (default " + std::to_string(io::kDefaultQueueDepth) + "; replaces the plan's)")
      ->check(cli::kPositive);
  cmd->add_flag("--buffered", flags->buffered, "Read through the page cache (no O_DIRECT): a comparison only");
  cmd->add_flag("--token-prefill", flags->token_prefill,
                "Prefill token by token through the decode path instead of whole layers (no prefill buffers): a "
                "comparison only");
  cmd->add_flag("--prefill-in-cache", flags->prefill_in_cache,
                "Batched prefill in cold-cache slots lent for each prompt also without --memory (the default under a "
                "memory budget): a comparison only")
      ->excludes("--token-prefill");
  cmd->add_option("--prefill-batch-min", flags->prefill_batch_min,
                  "Prompts (batches) shorter than this prefill token by token through the decode path: a batched "
                  "prefill reads the whole FFN from flash")
      ->check(cli::kPositive)
      ->capture_default_str();
  cli::AddBatchOption(cmd, &flags->max_batch, ": the context's scratch for that many tokens is counted in the fixed part");
  cmd->add_option("--cold-protected", flags->cold_protected,
                  "Share of each cold partition kept for neurons hit since they were loaded (segmented LRU; 0: plain "
                  "LRU)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  cmd->add_flag("--no-cold-overflow", flags->no_cold_overflow,
                "With per-layer cold partitions (a plan): keep the miss staging as staging instead of a cold overflow "
                "pool shared by the layers: a comparison only");
  cmd->add_flag("--no-cold-preload", flags->no_cold_preload,
                "Start with an empty cold region instead of reading each layer's most popular cold neurons into it "
                "at load: a comparison only");
  cmd->add_flag("--no-sibling-readahead", flags->no_sibling_readahead,
                "MoE decode: let each routed expert read its own misses when it runs, instead of reading the layer's "
                "other experts' misses (their exact active sets) at its first expert: a comparison only");
  cmd->add_flag("--no-scatter", flags->no_scatter,
                "Merge only reads whose cache slots are adjacent in memory, not flash neighbours into one scattered "
                "read (readv): a comparison only");
  cmd->add_option("--slot-alignment", flags->slot_alignment,
                  "Cold cache slots are a bundle rounded up to this many bytes (a power of two, 512-4096); 0: the "
                  "flash file's direct-I/O alignment (statx, e.g. 512 on a virtio disk). 4096 keeps whole 4 KiB-aligned "
                  "groups: a comparison")
      ->check(CLI::IsMember({0, 512, 1024, 2048, 4096}))
      ->capture_default_str();
  cmd->add_flag("--resident-embedding", flags->resident_embedding,
                "Hold token_embd in memory instead of reading one row per token from flash (models with their own "
                "output head; tied embeddings always stay): a comparison");
  cmd->add_option("--two-phase", flags->two_phase,
                  "on, off or auto: read a cold neuron's gate page first and its up+down part only when the gate "
                  "passes (predictor mode, one bundle per flash group; auto/on fall back to whole bundles otherwise)");
  cmd->add_option("--lookahead", flags->lookahead,
                  "Bundles read ahead for the next layer while one runs (full mode, whole bundles; MoE: per guessed "
                  "expert): -1 auto (n_ff/8; from the start when a core is left beyond the compute threads, else "
                  "adaptive: on once waiting for reads takes 15% of 8 tokens), 0 off; default: the plan's (0 where "
                  "`plan --calibrate` measured the lookahead slower), else -1");
  cmd->add_option("--lookahead-source", flags->lookahead_source,
                  "Where a layer's guess comes from: next-layer (during the previous layer's FFN, from its input) or "
                  "same-layer (before the layer's attention, from its input)")
      ->check(CLI::IsMember({"next-layer", "same-layer"}))
      ->capture_default_str();
  cmd->add_option("--lookahead-input", flags->lookahead_input,
                  "What the next-layer guess is computed from: projected (the hits' guess through the deployment's "
                  "lookahead table: no down columns summed; hits without the table), hits (the residual plus the "
                  "layer's cache hits' share of its output, once they are computed; dense models) or ffn-input (the "
                  "layer's FFN input, as soon as its misses are submitted; MoE always): hits and ffn-input for "
                  "comparison")
      ->check(CLI::IsMember({"projected", "hits", "ffn-input"}))
      ->capture_default_str();
  cmd->add_option("--lookahead-replay", flags->lookahead_replay,
                  "Measure what a perfect guess would give: read ahead exactly the active sets an earlier "
                  "--trace-active run of the same prompt and settings recorded (dense models; results unchanged)");
  cmd->add_option("--lookahead-keep", flags->lookahead_keep,
                  "With a predictor: the share of the lookahead's candidates read ahead, largest logits first (1: all)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--warm-next", flags->warm_next_mib,
                  "MiB of the weights computed next (the next layer's attention) streamed through the CPU caches "
                  "while a layer waits for its reads (full mode): -1 half the last-level cache, 0 off")
      ->check(CLI::Range(-1.0, 1024.0))
      ->capture_default_str();
  cmd->add_option("--warm-next-ab", flags->warm_next_ab,
                  "A/B inside one run: the warming (--warm-next) on or off at random per token, drawn from this seed "
                  "(0: always on); the JSON's warm_next_ab gives each measured token's switch and both groups' means")
      ->capture_default_str();
  cmd->add_option("--pin-threads", flags->pin_threads,
                  "auto, on or off (full mode): pin the thread calling the model, each pool worker and the I/O thread "
                  "to a CPU each for each evaluation: the compute threads on the fastest CPUs (sysfs cpu_capacity), "
                  "the caller where the flash disk's interrupts arrive least among those, the I/O thread where they "
                  "arrive most (beside a worker when no CPU is left; auto: when the compute threads take every CPU the "
                  "process may use, or the CPUs differ in speed)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  cmd->add_option("--pin-threads-ab", flags->pin_threads_ab,
                  "A/B inside one run: the pinning (--pin-threads) on or off at random per token, drawn from this "
                  "seed (0: as --pin-threads says); the JSON's pin_threads_ab gives each measured token's switch and "
                  "both groups' means")
      ->capture_default_str();
  cmd->add_option("--lookahead-input-ab", flags->lookahead_input_ab,
                  "A/B inside one run: the lookahead's guess through the deployment's table (projected, on) or from "
                  "the hits' down columns (hits, off) at random per token, drawn from this seed (0: as "
                  "--lookahead-input says; needs --lookahead-input projected and the table); the JSON's "
                  "lookahead_input_ab gives each measured token's switch and both groups' means")
      ->capture_default_str();
  cmd->add_option("--cold-pool", flags->cold_pool,
                  "With --plan: per-layer (each layer's cold slots its own LRU, as planned) or shared (the plan's cold "
                  "slots as one LRU pool over all layers)")
      ->capture_default_str();
  cli::AddKvTypeOption(cmd, &flags->kv_type, "KV cache element type (default f32, or the plan's)");
  cmd->add_option("--plan", flags->plan, "plan.json from `nflash plan` for this deployment: memory, cache sizes, "
                                         "context, KV type, threads, queue depth")->check(CLI::ExistingFile);
}

void RegisterOffloadCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<OffloadFlags>();
  CLI::App* cmd = app.add_subcommand("offload", "Generate (greedy) from a deployment with the FFN on flash");
  cmd->add_option("-d,--deploy", flags->deploy, "Deployment directory (nflash pack)")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("-p,--prompt", flags->prompt, "Prompt text");
  cmd->add_option("-n,--max-tokens", flags->n_predict, "Tokens to generate at most")->check(cli::kPositive);
  cmd->add_option("--warmup", flags->warmup,
                  "Decode steps not measured (of the -n): the figures then describe warm caches")
      ->check(cli::kNonNegative);
  cmd->add_option("-c,--ctx", flags->ctx, "Context size (0: prompt + max tokens, capped at the model's)");
  cmd->add_option("-t,--threads", flags->threads, "Compute threads (0: all cores, or the plan's; replaces the plan's)");
  AddRuntimeOptions(cmd, flags.get());
  cmd->add_flag("--json", flags->json, "Print the result as JSON");
  cmd->add_option("--hw", flags->hw, "Hardware profile (nflash profile-hw): also report the compute and I/O floors "
                                     "per token and the measured time's ratio to them (docs/planner.md, Floors)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--trace-active", flags->trace_active,
                  "Write every active set of the decode path (prompt and generated tokens) to this file: one line per "
                  "layer step, the layer then the active neuron indices; a prompt prefilled in batches (--prefill-batch-min) "
                  "has no lines (for cache-policy studies: scripts/cache_policy_sim.py)");
  cmd->add_option("--trace-events", flags->trace_events,
                  "Write the decode's timeline to this file (Chrome Trace Event Format, for chrome://tracing or "
                  "ui.perfetto.dev; scripts/trace_summary.py): each token, each layer's attention and FFN, the waits for "
                  "reads, and the I/O thread's read streams");
  cmd->callback([flags, action] { *action = [flags] { return RunOffload(*flags); }; });
}

}  // namespace nflash::sparse
