// `nflash train-predictor`: trains per-layer activation predictors for a model from calibration text and writes the
// predictor side file (format: runtime/engine/predictor.h, docs/predictor.md).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "profiler/commands.h"
#include "profiler/predictor_lowrank.h"
#include "profiler/predictor_train.h"
#include "runtime/cli/model_loader.h"
#include "runtime/cli/validators.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/engine/predictor.h"

namespace nflash::profiler {
namespace {

struct TrainFlags {
  cli::ModelSource source;
  std::string calib_file, eval_file, output, ranks, method = "mlp", weight_type = "f32";
  int64_t tokens = 20000, eval_tokens = 20000, window = 256, max_rank = 256;
  double target_sparsity = -1;
  double val_fraction = 0.2;
  int threads = 0;
  bool force = false;
  TrainOptions train;
  LowRankOptions lowrank;
  // The flags given on the command line that only one method reads (named, for the refusal under the other).
  std::vector<std::string> mlp_only, lowrank_only;
};

// The first `n` tokens of a text file (BOS + the text as one string, as perplexity encodes it). Only a prefix of the
// file is encoded: kBytesPerToken is a generous bound for the byte-level and small-vocabulary tokenizers used here.
Result<std::vector<int32_t>> ReadTokens(const Tokenizer& tok, const std::string& path, int64_t n) {
  constexpr int64_t kBytesPerToken = 8;
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  const size_t take = std::min(bytes.size(), static_cast<size_t>(n * kBytesPerToken + 4096));
  std::vector<int32_t> ids = tok.Encode(std::string(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(take)),
                                        true);
  if (static_cast<int64_t>(ids.size()) > n) ids.resize(static_cast<size_t>(n));
  return ids;
}

Status RunTrain(TrainFlags f) {
  if (!f.force && FileExists(f.output)) return Status::InvalidArgument(f.output + " exists; pass --force to overwrite");
  if (f.train.target_recall <= 0 || f.train.target_recall > 1) {
    return Status::InvalidArgument("--recall must be in (0, 1]");
  }
  const bool lowrank = f.method == "lowrank";
  if (!lowrank && f.method != "mlp") {
    return Status::InvalidArgument("--method must be mlp or lowrank, not '" + f.method + "'");
  }
  // Each method reads its own settings only: another method's would be dropped without a word.
  const std::vector<std::string>& foreign = lowrank ? f.mlp_only : f.lowrank_only;
  if (!foreign.empty()) {
    return Status::InvalidArgument(foreign.front() + " applies to --method " + (lowrank ? "mlp" : "lowrank") +
                                   " only (" + (lowrank ? "Adam training" : "subspace iterations") +
                                   "); --method is " + f.method);
  }
  // The defaults are trimmed to --max-rank; a rank asked for by name above it would be dropped without a word.
  const bool ranks_given = !f.ranks.empty();
  if (f.ranks.empty()) f.ranks = lowrank ? "16,32,64" : "16,32,64,128,256";
  f.train.ranks.clear();
  std::stringstream ss(f.ranks);
  for (std::string item; std::getline(ss, item, ',');) {
    int64_t r = 0;
    try {
      r = std::stoll(item);
    } catch (...) {
      return Status::InvalidArgument("--ranks: '" + item + "' is not a number");
    }
    if (r <= 0) return Status::InvalidArgument("--ranks: rank " + item + " must be positive");
    if (ranks_given && r > f.max_rank) {
      return Status::InvalidArgument("--ranks: rank " + item + " is above --max-rank " + std::to_string(f.max_rank) +
                                     " (raise --max-rank or leave the rank out)");
    }
    if (r <= f.max_rank) f.train.ranks.push_back(r);
  }
  if (f.train.ranks.empty()) {
    return Status::InvalidArgument("no default rank (" + f.ranks + ") is <= --max-rank " +
                                   std::to_string(f.max_rank));
  }
  const auto wt = ParseGgmlType(f.weight_type);
  if (!wt || (*wt != GgmlType::kF32 && *wt != GgmlType::kF16)) {
    return Status::InvalidArgument("--weight-type must be f32 or f16");
  }
  NF_ASSIGN_OR_RETURN(cli::LoadedModel lm, cli::LoadModelForInference(f.source));
  const LlamaHparams& hp = lm.model->hparams();
  const bool silu = hp.activation == FfnActivation::kSilu;
  if (silu && !(f.target_sparsity > 0 && f.target_sparsity < 1)) {
    return Status::InvalidArgument("a SiLU model has no exact zeros: pass --target-sparsity S in (0, 1)");
  }
  if (!silu && f.target_sparsity >= 0) {
    return Status::InvalidArgument("--target-sparsity applies to SiLU models; " + hp.name +
                                   " uses ReLU-family zeros (threshold 0)");
  }
  NF_ASSIGN_OR_RETURN(uint64_t hash, HashFile(f.source.path));
  ThreadPool pool(f.threads);

  NF_ASSIGN_OR_RETURN(std::vector<int32_t> ids, ReadTokens(*lm.tokenizer, f.calib_file, f.tokens));
  const auto t0 = std::chrono::steady_clock::now();
  NF_ASSIGN_OR_RETURN(ActivationSamples samples, CollectSamples(*lm.model, ids, f.window, &pool));
  const int64_t per_layer = std::max<int64_t>(1, hp.n_experts);
  const int64_t n_groups = hp.n_layers * per_layer;
  // Each group is split into its first (1 - val_fraction) tokens for training and the rest for validation; a MoE
  // expert sees only the tokens routed to it.
  auto group_name = [&](int64_t g) {
    return hp.n_experts > 0 ? "layer " + std::to_string(g / per_layer) + " expert " + std::to_string(g % per_layer)
                            : "layer " + std::to_string(g);
  };
  auto too_few = [&](int64_t n, int64_t* n_train, int64_t* n_val) {
    *n_val = static_cast<int64_t>(static_cast<double>(n) * f.val_fraction);
    *n_train = n - *n_val;
    return *n_val < 1 || *n_train < (lowrank ? 2 : f.train.batch);
  };
  // A MoE expert the calibration tokens (almost) never reached (a router's rare choice; 128-expert models have
  // several per layer on a few thousand tokens) is fitted on its layer's other inputs instead, its own gate computed
  // on them: the predictor then covers the expert when a later text does route to it.
  std::vector<uint8_t> borrowed(static_cast<size_t>(n_groups), 0);
  if (hp.n_experts > 0) {
    for (int64_t g = 0; g < n_groups; ++g) {
      int64_t n_train = 0, n_val = 0;
      const int64_t own = samples.group_tokens[static_cast<size_t>(g)];
      if (!too_few(own, &n_train, &n_val)) continue;
      const int64_t rows = BorrowLayerInputs(*lm.model, &samples, g, samples.n_tokens, &pool);
      borrowed[static_cast<size_t>(g)] = 1;
      NF_LOG(Warning) << group_name(g) << " saw " << own << " of " << samples.n_tokens
                      << " calibration tokens: fitted on " << rows
                      << " FFN inputs its layer's other experts saw (its recall on its own tokens is not measured "
                         "there; the held-out column is, where the held-out text routes to it)";
    }
  }
  auto split = [&](int64_t g, int64_t* n_train, int64_t* n_val) -> Status {
    const int64_t n = samples.group_tokens[static_cast<size_t>(g)];
    if (too_few(n, n_train, n_val)) {
      return Status::InvalidArgument(f.calib_file + ": " + group_name(g) + " saw " + std::to_string(n) + " of " +
                                     std::to_string(samples.n_tokens) +
                                     " calibration tokens, too few (need a batch of " +
                                     std::to_string(lowrank ? 2 : f.train.batch) +
                                     " for training plus a validation split): pass more --tokens");
    }
    return Status::Ok();
  };
  std::vector<int64_t> group_train(static_cast<size_t>(n_groups)), group_val(static_cast<size_t>(n_groups));
  int64_t n_train_total = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    NF_RETURN_IF_ERROR(split(g, &group_train[static_cast<size_t>(g)], &group_val[static_cast<size_t>(g)]));
    n_train_total += group_train[static_cast<size_t>(g)];
  }
  NF_LOG(Info) << "collected " << samples.n_tokens << " calibration tokens ("
               << (hp.n_experts > 0 ? std::to_string(n_train_total) + " expert-token training pairs" :
                                      std::to_string(n_train_total / n_groups) + " train")
               << ", validation split " << f.val_fraction << ") in "
               << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s";
  const std::vector<float> thresholds =
      silu ? SparsityThresholds(samples, f.target_sparsity) : std::vector<float>(static_cast<size_t>(n_groups), 0.0f);

  std::unique_ptr<ActivationSamples> eval;
  if (!f.eval_file.empty()) {
    NF_ASSIGN_OR_RETURN(std::vector<int32_t> eval_ids, ReadTokens(*lm.tokenizer, f.eval_file, f.eval_tokens));
    NF_ASSIGN_OR_RETURN(ActivationSamples e, CollectSamples(*lm.model, eval_ids, f.window, &pool));
    eval = std::make_unique<ActivationSamples>(std::move(e));
  }

  PredictorData data;
  data.model_hash = HashToHex(hash);
  data.model_name = hp.name;
  data.activation = FfnActivationName(hp.activation);
  data.dim = hp.dim;
  data.n_ff = hp.n_ff;
  data.n_experts = hp.n_experts;
  data.target_recall = f.train.target_recall;
  data.train_tokens = hp.n_experts > 0 ? n_train_total : n_train_total / n_groups;
  std::printf("| %s | rank | act. threshold | recall | precision | predicted | true active | pred/true | bytes | "
              "train s |%s\n",
              hp.n_experts > 0 ? "layer/expert" : "layer",
              eval ? " held-out recall | precision | predicted | true active |" : "");
  std::printf("|---|---|---|---|---|---|---|---|---|---|%s\n", eval ? "---|---|---|---|" : "");
  double sum_recall = 0, sum_eval_recall = 0, sum_ratio = 0, sum_eval_ratio = 0;
  int64_t n_eval_groups = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t layer = g / per_layer, expert = hp.n_experts > 0 ? g % per_layer : -1;
    const int64_t n_train = group_train[static_cast<size_t>(g)], n_val = group_val[static_cast<size_t>(g)];
    const float thr = thresholds[static_cast<size_t>(g)];
    const std::vector<uint8_t> mask = ActiveMask(samples, g, thr);
    const float* x = samples.x[static_cast<size_t>(g)].data();
    bool fallback = false;
    PredictorLayerData L;
    if (lowrank) {
      LowRankOptions lo = f.lowrank;
      lo.ranks = f.train.ranks;
      lo.target_recall = f.train.target_recall;
      lo.max_predicted_ratio = f.train.max_predicted_ratio;
      lo.seed = f.train.seed;
      const LayerWeights& W = lm.model->layers()[static_cast<size_t>(layer)];
      const MatrixView gate = expert >= 0 ? W.Expert(W.gate, W.expert_stride_gate, expert) : W.gate;
      NF_ASSIGN_OR_RETURN(L, FitLowRankLayer(gate, x, mask.data(), n_train, n_val, ActivationBoundary(hp.activation, thr),
                                             lo, &pool, &fallback));
    } else {
      NF_ASSIGN_OR_RETURN(L, TrainLayerChooseRank(x, mask.data(), n_train, n_val, hp.dim, hp.n_ff, f.train, &pool,
                                                  &fallback));
    }
    L.info.activation_threshold = thr;
    if (fallback) {
      NF_LOG(Warning) << group_name(g) << ": no candidate rank reached recall " << f.train.target_recall
                      << " with predicted <= " << f.train.max_predicted_ratio << "x true; using rank " << L.info.rank
                      << " (smallest predicted fraction)";
    }
    const int64_t n_eval = eval ? eval->group_tokens[static_cast<size_t>(g)] : 0;
    if (n_eval > 0) {  // an expert the held-out text never routes to keeps -1 (not measured)
      const std::vector<uint8_t> emask = ActiveMask(*eval, g, thr);
      const PredictionQuality q =
          Evaluate(L, hp.dim, hp.n_ff, eval->x[static_cast<size_t>(g)].data(), emask.data(), n_eval, &pool);
      L.info.eval_recall = static_cast<float>(q.recall);
      L.info.eval_precision = static_cast<float>(q.precision);
      L.info.eval_predicted_fraction = static_cast<float>(q.predicted_fraction);
      L.info.eval_true_fraction = static_cast<float>(q.true_fraction);
      sum_eval_recall += q.recall;
      sum_eval_ratio += q.true_fraction > 0 ? q.predicted_fraction / q.true_fraction : 0;
      ++n_eval_groups;
    }
    const PredictorLayerInfo& i = L.info;
    const uint64_t bytes = static_cast<uint64_t>((i.rank * hp.dim + hp.n_ff * i.rank) * (*wt == GgmlType::kF16 ? 2 : 4) +
                                                 hp.n_ff * 4);
    sum_recall += i.recall;
    sum_ratio += i.true_fraction > 0 ? i.predicted_fraction / i.true_fraction : 0;
    const std::string label = hp.n_experts > 0 ? std::to_string(layer) + "/" + std::to_string(expert)
                                               : std::to_string(layer);
    std::printf("| %s%s | %lld%s | %.4g | %.4f | %.4f | %.4f | %.4f | %.2f | %llu | %.1f |", label.c_str(),
                borrowed[static_cast<size_t>(g)] ? " (layer's inputs)" : "", static_cast<long long>(i.rank),
                fallback ? " (fallback)" : "", i.activation_threshold, i.recall,
                i.precision, i.predicted_fraction, i.true_fraction,
                i.true_fraction > 0 ? i.predicted_fraction / i.true_fraction : 0.0, static_cast<unsigned long long>(bytes),
                i.train_seconds);
    if (eval) {
      std::printf(" %.4f | %.4f | %.4f | %.4f |", i.eval_recall, i.eval_precision, i.eval_predicted_fraction,
                  i.eval_true_fraction);
    }
    std::printf("\n");
    std::fflush(stdout);
    data.layers.push_back(std::move(L));
  }
  const double ng = static_cast<double>(n_groups);
  std::printf("mean over %s: validation recall %.4f, predicted/true %.2f", hp.n_experts > 0 ? "experts" : "layers",
              sum_recall / ng, sum_ratio / ng);
  if (n_eval_groups > 0) {
    std::printf("; held-out (%lld tokens of %s) recall %.4f, predicted/true %.2f", static_cast<long long>(eval->n_tokens),
                f.eval_file.c_str(), sum_eval_recall / static_cast<double>(n_eval_groups),
                sum_eval_ratio / static_cast<double>(n_eval_groups));
  }
  std::printf("\ntotal time %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  NF_RETURN_IF_ERROR(SavePredictor(data, f.output, f.force, *wt));
  NF_ASSIGN_OR_RETURN(std::unique_ptr<Predictor> check, Predictor::Load(f.output));
  std::printf("wrote %s (%llu bytes of predictor weights)\n", f.output.c_str(),
              static_cast<unsigned long long>(check->PredictorBytes()));
  return Status::Ok();
}

}  // namespace

void RegisterTrainPredictorCommand(CLI::App& app, cli::CommandAction* action) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* sub = app.add_subcommand("train-predictor", "Train per-layer activation predictors for a model");
  sub->add_option("-m,--model", f->source.path, "Model: GGUF, or llama2.c checkpoint")->required()->check(CLI::ExistingFile);
  sub->add_option("--tokenizer", f->source.tokenizer, "llama2.c only: tokenizer.bin");
  sub->add_option("--activation", f->source.activation, "llama2.c only: FFN activation silu|relu|drelu");
  sub->add_option("-f,--file", f->calib_file, "Calibration text")->required()->check(CLI::ExistingFile);
  sub->add_option("--tokens", f->tokens, "Calibration tokens (the last 20% are the validation split)")
      ->check(cli::kPositive);
  sub->add_option("--window", f->window, "Tokens per forward window (each from an empty context)")
      ->check(cli::kPositive);
  sub->add_option("--method", f->method,
                  "mlp: PowerInfer's MLP trained with Adam; lowrank: closed-form projection of the model's own gate "
                  "onto the principal directions of its pre-activations (file rank 2 x r)");
  CLI::Option* iterations =
      sub->add_option("--iterations", f->lowrank.iterations, "lowrank only: subspace iterations")
          ->check(cli::kPositive);
  sub->add_option("--recall", f->train.target_recall, "Target recall (micro, per layer)");
  sub->add_option("--max-rank", f->max_rank, "Largest candidate rank")->check(cli::kPositive);
  sub->add_option("--ranks", f->ranks, "Candidate ranks, comma-separated, tried smallest first (mlp: 16,32,64,128,256; "
                  "lowrank: subspace ranks r, 16,32,64)");
  sub->add_option("--max-ratio", f->train.max_predicted_ratio, "Accept a rank when predicted <= this x true active");
  sub->add_option("--target-sparsity", f->target_sparsity, "SiLU models: fraction of neurons counted inactive");
  const std::vector<CLI::Option*> mlp_only = {
      sub->add_option("--epochs", f->train.epochs, "mlp only: training epochs")->check(cli::kPositive),
      sub->add_option("--lr", f->train.learning_rate, "mlp only: Adam learning rate"),
      sub->add_option("--pos-weight", f->train.pos_weight, "mlp only: BCE weight of active neurons")};
  sub->add_option("--seed", f->train.seed, "Random seed (initialisation, shuffling)");
  CLI::Option* eval_text = sub->add_option("--eval-text", f->eval_file, "Held-out text for the recall/precision report")
                               ->check(CLI::ExistingFile);
  // Without a held-out text nothing is evaluated: CLI11 refuses the count by name ("requires --eval-text").
  sub->add_option("--eval-tokens", f->eval_tokens, "Held-out tokens to evaluate (with --eval-text)")
      ->check(cli::kPositive)
      ->needs(eval_text);
  sub->add_option("--weight-type", f->weight_type, "Predictor weight type: f32 or f16");
  sub->add_option("-t,--threads", f->threads, "Compute threads (0: all cores)");
  sub->add_option("-o,--output", f->output, "Output predictor file (.gguf)")->required();
  sub->add_flag("--force", f->force, "Overwrite the output");
  sub->callback([f, action, iterations, mlp_only] {
    for (CLI::Option* o : mlp_only) {
      if (o->count() > 0) f->mlp_only.push_back(o->get_name());
    }
    if (iterations->count() > 0) f->lowrank_only.push_back(iterations->get_name());
    *action = [f] { return RunTrain(*f); };
  });
}

}  // namespace nflash::profiler
