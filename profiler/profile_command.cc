// `nflash profile`: runs calibration text through the dense engine and records every FFN neuron's activation
// statistics (activation_stats.h) into a profile file (profile.h), optionally with zstd-compressed activation traces.
#include <CLI/CLI.hpp>
#include <zstd.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "profiler/activation_stats.h"
#include "profiler/commands.h"
#include "profiler/profile.h"
#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"
#include "runtime/engine/context.h"
#include "runtime/text/sampler.h"

namespace nflash::profiler {
namespace {

namespace fs = std::filesystem;

// A contribution is "non-negligible" when above this share of the token's largest one over its gate-active neurons
// (docs/profile-format.md): 1e-3 is well below Q8_0/Q4_0 rounding noise relative to the row maximum.
constexpr double kNegligibleShare = 1e-3;
// Pass 1 (threshold calibration) keeps at most this many |act(gate)| samples per FFN (16 MiB of floats): the
// quantile's sampling error at 4M samples is ~1e-4 in rank, far below any sparsity a user asks for.
constexpr int64_t kMaxThresholdSamples = int64_t{1} << 22;
// Trace file magic "NFTR" (little-endian u32) and version.
constexpr uint32_t kTraceMagic = 0x5254464e;
constexpr uint32_t kTraceVersion = 1;

struct ProfileFlags {
  cli::ModelSource source;
  std::string text;
  std::string output;
  int64_t tokens = 0;            // 0: the whole text
  int64_t ctx = 256;
  std::string batch_sizes = "1,2,4";
  double target_sparsity = -1;   // < 0: 0.5 for silu, 0 for relu/drelu
  std::vector<double> report_sparsities;
  int64_t threshold_tokens = 8192;
  int64_t coact_k = 16;
  int64_t coact_tokens = 1024;
  std::string traces;
  int64_t generate = 0;          // > 0: record the model's own decode, this many tokens per window
  int64_t prompt_tokens = 16;    // decode mode: text tokens prefilled (not recorded) before each window's decode
  float temperature = 0.0f;      // decode mode: 0 greedy
  uint64_t seed = 1;
  int threads = 0;
  bool force = false;
  // Given on the command line (their defaults are in use either way, so a count is needed to tell).
  bool threshold_tokens_given = false;
  bool coact_tokens_given = false;
};

// Byte offset of the first invalid UTF-8 sequence (overlongs, surrogates and code points > U+10FFFF are invalid),
// or -1.
int64_t FirstInvalidUtf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return static_cast<int64_t>(i);
    }
    if (i + static_cast<size_t>(len) > n) return static_cast<int64_t>(i);
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return static_cast<int64_t>(i);
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return static_cast<int64_t>(i);
    i += static_cast<size_t>(len);
  }
  return -1;
}

// Encodes enough of the text for `want` tokens (0: all) without tokenizing a 4 MB file for 2000 tokens: a prefix cut
// at a newline, doubled until it yields enough tokens or is the whole text.
std::vector<int32_t> EncodePrefix(const Tokenizer& tok, const std::string& text, int64_t want) {
  // Stories text averages ~4 bytes per token with small vocabularies; 16 leaves room for any tokenizer.
  size_t bytes = want > 0 ? static_cast<size_t>(want) * 16 + 4096 : text.size();
  while (true) {
    size_t cut = std::min(bytes, text.size());
    if (cut < text.size()) {
      const size_t nl = text.rfind('\n', cut);
      if (nl != std::string::npos && nl > 0) cut = nl;
    }
    std::vector<int32_t> ids = tok.Encode(std::string_view(text).substr(0, cut), true);
    if (cut >= text.size() || static_cast<int64_t>(ids.size()) >= want) return ids;
    bytes *= 2;
  }
}

// Streams per-token active bitsets into a zstd frame written atomically (format in docs/profile-format.md).
// Thread-safety: not thread-safe.
class TraceWriter {
 public:
  ~TraceWriter() {
    if (cctx_ != nullptr) ZSTD_freeCCtx(cctx_);
  }
  Status Open(const std::string& path, bool overwrite, const std::vector<FfnStats>& ffns) {
    NF_ASSIGN_OR_RETURN(out_, AtomicFileWriter::Create(path, overwrite));
    cctx_ = ZSTD_createCCtx();
    if (cctx_ == nullptr) return Status::ResourceExhausted("cannot create a zstd context");
    // Level 3: zstd's default, ~100 MB/s on one core, far faster than the engine produces traces.
    ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, 3);
    path_ = path;
    std::vector<uint32_t> header = {kTraceMagic, kTraceVersion, static_cast<uint32_t>(ffns.size())};
    for (const FfnStats& f : ffns) header.push_back(static_cast<uint32_t>(f.n_neurons()));
    return Write(header.data(), header.size() * 4, false);
  }
  bool is_open() const { return out_ != nullptr; }
  // One record: u32 ffn index, u32 token index (in the calibration stream), then ceil(n/64) u64 words of bitset.
  Status Record(uint32_t ffn, uint32_t token, std::span<const int32_t> active, int64_t n_neurons) {
    words_.assign(static_cast<size_t>((n_neurons + 63) / 64), 0);
    for (int32_t i : active) words_[i >> 6] |= uint64_t{1} << (i & 63);
    const uint32_t head[2] = {ffn, token};
    NF_RETURN_IF_ERROR(Write(head, sizeof head, false));
    return Write(words_.data(), words_.size() * 8, false);
  }
  Status Finish() {
    NF_RETURN_IF_ERROR(Write(nullptr, 0, true));
    return out_->Commit();
  }

 private:
  Status Write(const void* data, size_t size, bool end) {
    ZSTD_inBuffer in{data, size, 0};
    buf_.resize(ZSTD_CStreamOutSize());
    while (true) {
      ZSTD_outBuffer o{buf_.data(), buf_.size(), 0};
      const size_t rem = ZSTD_compressStream2(cctx_, &o, &in, end ? ZSTD_e_end : ZSTD_e_continue);
      if (ZSTD_isError(rem)) return Status::Internal(path_ + ": zstd: " + ZSTD_getErrorName(rem));
      NF_RETURN_IF_ERROR(out_->Append(buf_.data(), o.pos));
      if (end ? rem == 0 : in.pos == in.size) return Status::Ok();
    }
  }
  std::string path_;
  std::unique_ptr<AtomicFileWriter> out_;
  ZSTD_CCtx* cctx_ = nullptr;
  std::vector<uint8_t> buf_;
  std::vector<uint64_t> words_;
};

// ||column i|| of every expert's down projection (dim rows of n_ff): the weight of neuron i's output.
Result<std::vector<float>> DownColumnNorms(const Model& model, int64_t layer, int64_t expert) {
  const LlamaHparams& hp = model.hparams();
  const LayerWeights& L = model.layers()[static_cast<size_t>(layer)];
  const MatrixView down = expert >= 0 ? L.Expert(L.down, L.expert_stride_down, expert) : L.down;
  std::vector<double> sq(static_cast<size_t>(hp.n_ff), 0.0);
  std::vector<float> row(static_cast<size_t>(down.cols));
  for (int64_t r = 0; r < down.rows; ++r) {
    NF_RETURN_IF_ERROR(DequantizeRow(down.type, static_cast<const uint8_t*>(down.data) + r * down.row_bytes,
                                     row.data(), down.cols));
    for (int64_t i = 0; i < down.cols; ++i) sq[i] += static_cast<double>(row[i]) * row[i];
  }
  std::vector<float> norms(sq.size());
  for (size_t i = 0; i < sq.size(); ++i) norms[i] = static_cast<float>(std::sqrt(sq[i]));
  return norms;
}

// Set by SIGINT/SIGTERM: the run stops after the current window and returns an error, so the destructors remove the
// temporary outputs (a default signal death would leave the traces' temporary file behind).
std::atomic<bool> g_interrupted{false};
extern "C" void OnInterrupt(int) { g_interrupted.store(true); }

// Where the recorded tokens come from. Text: tokens [0, n) of the text in windows of `ctx`, each from an empty context
// as one batched prefill (teacher forcing). Decode: per window, `prompt` text tokens prefilled unobserved, then
// `generate` tokens decoded one at a time from the model's own samples (what the sparse decode runtime serves).
struct TokenSource {
  const std::vector<int32_t>* ids = nullptr;
  int64_t ctx = 256;
  int64_t generate = 0;
  int64_t prompt = 0;
  SamplerConfig sampling;
};

// Runs the source until `n` tokens are recorded. Before the observed rows of each Eval, `on_rows(window, base)`
// names the window and the position (within the recorded tokens of the window) of the Eval's first row; the
// observer must only count rows while `*observing` is true.
Status RunSource(InferenceContext* ctx, const TokenSource& src, int64_t n, ProgressBar* bar, bool* observing,
                 const std::function<void(int64_t, int64_t)>& on_rows) {
  const std::vector<int32_t>& ids = *src.ids;
  if (src.generate == 0) {
    for (int64_t start = 0, w = 0; start < n; start += src.ctx, ++w) {
      if (g_interrupted.load()) return Status::IOError("interrupted: no profile written");
      const int64_t len = std::min(src.ctx, n - start);
      on_rows(w, 0);
      ctx->Reset();
      *observing = true;
      NF_RETURN_IF_ERROR(ctx->Eval(std::span<const int32_t>(ids.data() + start, static_cast<size_t>(len)), false));
      bar->Update(static_cast<uint64_t>(start + len));
    }
    bar->Finish();
    return Status::Ok();
  }
  NF_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(src.sampling));
  for (int64_t done = 0, w = 0; done < n; ++w) {
    if (g_interrupted.load()) return Status::IOError("interrupted: no profile written");
    // Prompts are consecutive stretches of the text; the caller encoded enough of it (wraps around if not).
    const size_t start = static_cast<size_t>(w * src.prompt) % (ids.size() - static_cast<size_t>(src.prompt) + 1);
    ctx->Reset();
    sampler.Reset(src.sampling.seed + static_cast<uint64_t>(w));
    *observing = false;
    NF_RETURN_IF_ERROR(ctx->Eval(std::span<const int32_t>(ids.data() + start, static_cast<size_t>(src.prompt)), false));
    const int64_t len = std::min(src.generate, n - done);
    for (int64_t step = 0; step < len; ++step) {
      const int32_t next = sampler.Sample(std::span<const float>(ctx->logits(), static_cast<size_t>(ctx->n_vocab())));
      sampler.Accept(next);
      on_rows(w, step);
      *observing = true;
      NF_RETURN_IF_ERROR(ctx->Eval(std::span<const int32_t>(&next, 1), false));
      *observing = false;
    }
    done += len;
    bar->Update(static_cast<uint64_t>(done));
  }
  bar->Finish();
  return Status::Ok();
}

Status RunProfile(const ProfileFlags& f) {
  // Fail before the long run on what can be checked up front.
  if (fs::exists(f.output) && !f.force) return Status::InvalidArgument(f.output + " exists; pass --force to overwrite");
  {
    const fs::path parent = fs::absolute(f.output).parent_path();
    if (!fs::is_directory(parent) || access(parent.c_str(), W_OK) != 0) {
      return Status::IOError("cannot write " + f.output + ": directory " + parent.string() +
                             " does not exist or is not writable");
    }
  }
  // No partners kept, nothing sampled: the sample size would be dropped without a word.
  if (f.coact_tokens_given && f.coact_k == 0) {
    return Status::InvalidArgument("--coact-tokens " + std::to_string(f.coact_tokens) +
                                   " needs --coact-k > 0 (with --coact-k 0 no co-activation is sampled)");
  }
  {
    std::stringstream ss(f.batch_sizes);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item != "1" && item != "2" && item != "4") {
        return Status::InvalidArgument("--batch-sizes: \"" + item + "\" is not supported; the profile records 1,2,4");
      }
    }
  }
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(f.text));
  std::string text(bytes.begin(), bytes.end());
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    return Status::InvalidArgument(f.text + ": the calibration text is empty");
  }
  if (const int64_t bad = FirstInvalidUtf8(text); bad >= 0) {
    return Status::InvalidArgument(f.text + ": not valid UTF-8 (first invalid byte at offset " + std::to_string(bad) +
                                   ")");
  }
  NF_ASSIGN_OR_RETURN(cli::LoadedModel lm, cli::LoadModelForInference(f.source));
  const LlamaHparams& hp = lm.model->hparams();
  NF_ASSIGN_OR_RETURN(uint64_t model_hash, HashFile(f.source.path));
  if (f.ctx < 1 || f.ctx > hp.context_length) {
    return Status::InvalidArgument("--ctx " + std::to_string(f.ctx) + " must be in [1, " +
                                   std::to_string(hp.context_length) + "] (the model's context length)");
  }
  if (f.generate > 0) {
    if (f.tokens < 1) return Status::InvalidArgument("--generate needs --tokens (how many decoded tokens to record)");
    if (f.prompt_tokens + f.generate > f.ctx) {
      return Status::InvalidArgument("--prompt-tokens " + std::to_string(f.prompt_tokens) + " + --generate " +
                                     std::to_string(f.generate) + " must fit --ctx " + std::to_string(f.ctx));
    }
  }
  // Decode mode needs one prompt per window of `generate` recorded tokens.
  const int64_t text_tokens =
      f.generate > 0 ? (f.tokens + f.generate - 1) / f.generate * f.prompt_tokens : f.tokens;
  const std::vector<int32_t> ids = EncodePrefix(*lm.tokenizer, text, text_tokens);
  if (f.generate > 0 && static_cast<int64_t>(ids.size()) < f.prompt_tokens) {
    return Status::InvalidArgument(f.text + ": encodes to " + std::to_string(ids.size()) +
                                   " tokens, fewer than --prompt-tokens " + std::to_string(f.prompt_tokens));
  }
  const int64_t n_tokens = f.generate > 0 ? f.tokens
                           : f.tokens > 0 ? std::min<int64_t>(f.tokens, static_cast<int64_t>(ids.size()))
                                          : static_cast<int64_t>(ids.size());
  if (n_tokens < 1) return Status::InvalidArgument(f.text + ": the text encodes to no tokens");
  TokenSource source;
  source.ids = &ids;
  source.ctx = f.ctx;
  source.generate = f.generate;
  source.prompt = f.prompt_tokens;
  source.sampling.temperature = f.temperature;
  source.sampling.seed = f.seed;
  bool observing = false;
  const bool relu_like = hp.activation != FfnActivation::kSilu;
  const std::string act_name = relu_like ? (hp.activation == FfnActivation::kRelu ? "relu" : "drelu") : "silu";
  const double target = f.target_sparsity >= 0 ? f.target_sparsity : (relu_like ? 0.0 : 0.5);
  if (target >= 1.0) return Status::InvalidArgument("--target-sparsity must be in [0, 1)");
  if (relu_like && f.target_sparsity > 0) {
    NF_LOG(Warning) << "--target-sparsity is ignored for " << act_name << " models: the active test is act > 0";
  }
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
  ThreadPool pool(f.threads);
  InferenceContext ctx(*lm.model, &pool, f.ctx);
  const int64_t n_exp = std::max<int64_t>(hp.n_experts, 1);
  const int64_t n_ffns = hp.n_layers * n_exp;
  auto ffn_index = [&](const FfnObservation& o) { return o.layer * n_exp + std::max<int64_t>(o.expert, 0); };

  // Pass 1: thresholds. |act(gate)| samples (a strided subset of each token's neurons) per FFN.
  std::vector<float> thresholds(static_cast<size_t>(n_ffns), 0.0f);
  std::vector<std::vector<float>> report(static_cast<size_t>(n_ffns));
  const bool need_pass1 = (!relu_like && target > 0) || !f.report_sparsities.empty();
  // Without pass 1 the threshold sample size has nothing to size (a ReLU-family model's test is act > 0).
  if (f.threshold_tokens_given && !need_pass1) {
    return Status::InvalidArgument("--threshold-tokens " + std::to_string(f.threshold_tokens) +
                                   ": no threshold is calibrated for this " + act_name + " model " +
                                   (relu_like ? "" : "at --target-sparsity 0 ") + "(needs --report-thresholds" +
                                   (relu_like ? ")" : " or --target-sparsity > 0)"));
  }
  if (need_pass1) {
    const int64_t n1 = std::min(n_tokens, f.threshold_tokens);
    const int64_t stride = std::max<int64_t>(1, n1 * hp.n_ff / kMaxThresholdSamples);
    std::vector<std::vector<float>> samples(static_cast<size_t>(n_ffns));
    int64_t offset = 0;
    ctx.SetFfnObserver([&](const FfnObservation& o) {
      if (!observing) return;
      std::vector<float>& s = samples[static_cast<size_t>(ffn_index(o))];
      for (int64_t t = 0; t < o.n_tokens; ++t) {
        const float* g = o.gate_act + t * hp.n_ff;
        // A rotating start spreads the stride over all neurons.
        for (int64_t i = (offset++) % stride; i < hp.n_ff; i += stride) s.push_back(std::fabs(g[i]));
      }
    });
    ProgressBar bar("thresholds", static_cast<uint64_t>(n1), "tok");
    NF_RETURN_IF_ERROR(RunSource(&ctx, source, n1, &bar, &observing, [](int64_t, int64_t) {}));
    for (int64_t i = 0; i < n_ffns; ++i) {
      std::vector<float>& s = samples[static_cast<size_t>(i)];
      if (!relu_like) thresholds[i] = QuantileThreshold(&s, target);
      for (double sp : f.report_sparsities) report[i].push_back(QuantileThreshold(&s, sp));
      std::vector<float>().swap(s);
    }
  }

  // Pass 2: statistics.
  FfnStatsOptions opt;
  opt.ctx = f.ctx;
  opt.coact_k = f.coact_k;
  opt.coact_tokens = f.coact_tokens;
  std::vector<FfnStats> stats;
  std::vector<std::vector<float>> down_norms;
  stats.reserve(static_cast<size_t>(n_ffns));
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    for (int64_t e = 0; e < n_exp; ++e) {
      const int64_t expert = hp.n_experts > 0 ? e : -1;
      stats.emplace_back(l, expert, hp.n_ff, thresholds[static_cast<size_t>(l * n_exp + e)], opt);
      NF_ASSIGN_OR_RETURN(std::vector<float> norms, DownColumnNorms(*lm.model, l, expert));
      down_norms.push_back(std::move(norms));
    }
  }
  SharedLruStats shared(n_ffns, hp.n_ff);
  TraceWriter traces;
  if (!f.traces.empty()) NF_RETURN_IF_ERROR(traces.Open(f.traces, f.force, stats));
  // Co-activation samples every `coact_stride`-th token so the sample spans the whole calibration run.
  const int64_t coact_stride = std::max<int64_t>(1, n_tokens / std::max<int64_t>(f.coact_tokens, 1));
  int64_t window = 0, window_start = 0, row_base = 0;
  Status observer_status;
  std::vector<int32_t> active;
  ctx.SetFfnObserver([&](const FfnObservation& o) {
    if (!observing) return;
    const size_t fi = static_cast<size_t>(ffn_index(o));
    FfnStats& st = stats[fi];
    const float thr = st.threshold();
    const float* norms = down_norms[fi].data();
    for (int64_t r = 0; r < o.n_tokens; ++r) {
      const int64_t pos = row_base + (o.token_index != nullptr ? o.token_index[r] : o.first_token + r);
      const float* g = o.gate_act + r * hp.n_ff;
      const float* h = o.hidden + r * hp.n_ff;
      active.clear();
      float max_up = 0, max_down = 0;
      for (int64_t i = 0; i < hp.n_ff; ++i) {
        if (std::fabs(g[i]) > thr) {
          active.push_back(static_cast<int32_t>(i));
          max_up = std::max(max_up, std::fabs(h[i] / g[i]));
          max_down = std::max(max_down, std::fabs(h[i]) * norms[i]);
        }
      }
      int64_t up_ok = 0, down_ok = 0;
      for (int32_t i : active) {
        up_ok += std::fabs(h[i] / g[i]) > kNegligibleShare * max_up;
        down_ok += std::fabs(h[i]) * norms[i] > kNegligibleShare * max_down;
      }
      const int64_t token = window_start + pos;
      st.AddToken(active, window, pos, token % coact_stride == 0);
      shared.Add(static_cast<int64_t>(fi), window, pos, active);
      st.AddGateCoactivation(static_cast<int64_t>(active.size()), up_ok, down_ok);
      if (traces.is_open() && observer_status.ok()) {
        observer_status = traces.Record(static_cast<uint32_t>(fi), static_cast<uint32_t>(token), active, hp.n_ff);
      }
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  ProgressBar bar("profile", static_cast<uint64_t>(n_tokens), "tok");
  // Recorded tokens per window: the window length (text) or the decoded tokens.
  const int64_t per_window = f.generate > 0 ? f.generate : f.ctx;
  NF_RETURN_IF_ERROR(RunSource(&ctx, source, n_tokens, &bar, &observing, [&](int64_t w, int64_t base) {
    window = w;
    window_start = w * per_window;
    row_base = base;
  }));
  NF_RETURN_IF_ERROR(observer_status);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  ModelProfile p;
  p.model_hash = HashToHex(model_hash);
  p.model_name = hp.name;
  p.activation = act_name;
  p.n_layers = hp.n_layers;
  p.n_ff = hp.n_ff;
  p.n_experts = hp.n_experts;
  p.dim = hp.dim;
  p.tokens = n_tokens;
  p.text_path = f.text;
  p.ctx = f.ctx;
  p.target_sparsity = relu_like ? 0.0 : target;
  if (f.generate > 0) {
    p.decode_tokens = f.generate;
    p.decode_prompt_tokens = f.prompt_tokens;
    p.decode_temperature = f.temperature;
  }
  for (double s : f.report_sparsities) p.report_sparsities.push_back(static_cast<float>(s));
  const auto t_finish = std::chrono::steady_clock::now();
  for (size_t i = 0; i < stats.size(); ++i) {
    p.ffns.push_back(stats[i].Finish(&pool));
    p.ffns.back().report_thresholds = report[i];
  }
  p.lru_hit_rate_shared = shared.Finish();
  NF_LOG(Info) << "curves and co-activation partners: "
               << std::chrono::duration<double>(std::chrono::steady_clock::now() - t_finish).count() << " s";
  if (traces.is_open()) NF_RETURN_IF_ERROR(traces.Finish());
  NF_RETURN_IF_ERROR(SaveProfile(p, f.output, f.force));
  NF_LOG(Info) << "profiled " << n_tokens << " tokens in " << seconds << " s ("
               << static_cast<double>(n_tokens) / std::max(seconds, 1e-9) << " tok/s); wrote " << f.output;
  PrintThresholdTable(p);
  double mean = 0;
  for (const FfnProfile& fp : p.ffns) mean += fp.mean_active_fraction;
  std::printf("mean active fraction %.4f over %zu FFNs (threshold: %s)\n", mean / static_cast<double>(p.ffns.size()),
              p.ffns.size(), relu_like ? "act > 0" : "per-layer quantile of |silu(gate)|");
  return Status::Ok();
}

}  // namespace

void RegisterProfileCommand(CLI::App& app, cli::CommandAction* action) {
  auto f = std::make_shared<ProfileFlags>();
  CLI::App* sub = app.add_subcommand("profile", "Record FFN neuron activation statistics over calibration text");
  sub->add_option("-m,--model", f->source.path, "Model: GGUF, or llama2.c checkpoint (converted in memory)")
      ->required()
      ->check(CLI::ExistingFile);
  sub->add_option("--tokenizer", f->source.tokenizer, "llama2.c only: tokenizer.bin (default: beside the checkpoint)");
  sub->add_option("--activation", f->source.activation, "llama2.c only: FFN activation silu|relu|drelu");
  sub->add_option("-f,--file", f->text, "Calibration text (UTF-8)")->required()->check(CLI::ExistingFile);
  sub->add_option("-o,--output", f->output, "Profile file to write")->required();
  sub->add_option("--tokens", f->tokens, "Calibration tokens (0: the whole text)")->check(cli::kNonNegative);
  sub->add_option("--ctx", f->ctx, "Window length: the text runs in windows of this many tokens")
      ->check(cli::kPositive);
  sub->add_option("--batch-sizes", f->batch_sizes, "Batch sizes whose union counts are recorded (always 1,2,4)");
  sub->add_option("--target-sparsity", f->target_sparsity,
                  "silu models: share of |silu(gate)| below each layer's threshold (default 0.5)")
      ->check(CLI::Range(0.0, 0.999));
  sub->add_option("--report-thresholds", f->report_sparsities,
                  "Also compute and print thresholds for these sparsities, e.g. 0,0.3,0.5,0.7,0.9")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 0.999));
  CLI::Option* threshold_tokens =
      sub->add_option("--threshold-tokens", f->threshold_tokens,
                      "Tokens used to calibrate thresholds (--report-thresholds, or a silu model's --target-sparsity)")
          ->check(cli::kPositive);
  sub->add_option("--coact-k", f->coact_k, "Co-activation partners kept per neuron")->check(cli::kNonNegative);
  CLI::Option* coact_tokens =
      sub->add_option("--coact-tokens", f->coact_tokens, "Tokens sampled for co-activation counts (--coact-k > 0)")
          ->check(cli::kPositive);
  sub->add_option("--traces", f->traces, "Also write per-token active bitsets here (zstd)");
  CLI::Option* generate =
      sub->add_option("--generate", f->generate,
                      "Record the model's own decode instead of the text: per window, --prompt-tokens of text "
                      "prefilled (not recorded), then this many tokens generated one at a time and recorded (0: the "
                      "text itself)")
          ->check(cli::kNonNegative);
  // The decode's settings: the text source reads none of them, so without --generate CLI11 refuses them by name.
  sub->add_option("--prompt-tokens", f->prompt_tokens, "--generate: text tokens prefilled before each window's decode")
      ->check(cli::kPositive)
      ->needs(generate);
  sub->add_option("--temp", f->temperature, "--generate: sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0, 10.0))
      ->needs(generate);
  sub->add_option("--seed", f->seed, "--generate: sampling seed (window w uses seed + w)")->needs(generate);
  sub->add_option("-t,--threads", f->threads, "Compute threads (0: all cores)");
  sub->add_flag("--force", f->force, "Overwrite existing outputs");
  sub->callback([f, action, threshold_tokens, coact_tokens] {
    f->threshold_tokens_given = threshold_tokens->count() > 0;
    f->coact_tokens_given = coact_tokens->count() > 0;
    *action = [f] { return RunProfile(*f); };
  });
}

}  // namespace nflash::profiler
