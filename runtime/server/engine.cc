// Opening the dense engine or the offloaded runtime for `nflash serve` and `nflash chat` (see engine.h).
#include "runtime/server/engine.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>

#include "packer/deployment.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/engine/generate.h"
#include "runtime/text/chat_template.h"

namespace nflash::server {
namespace {

Result<std::unique_ptr<Engine>> OpenDense(const EngineFlags& f) {
  auto e = std::make_unique<Engine>();
  cli::ModelSource src = f.source;
  src.use_mmap = !f.no_mmap;
  NF_ASSIGN_OR_RETURN(e->dense, cli::LoadModelForInference(src));
  e->pool = std::make_unique<ThreadPool>(f.runtime.threads);
  NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(f.runtime.kv_type.empty() ? "f32" : f.runtime.kv_type));
  e->dense_ctx = std::make_unique<InferenceContext>(*e->dense.model, e->pool.get(), f.runtime.ctx, kv_type);
  e->served.context = e->dense_ctx.get();
  e->served.tokenizer = e->dense.tokenizer.get();
  e->served.description = "dense engine (" + e->dense.description + ")";
  return e;
}

Result<std::unique_ptr<Engine>> OpenOffloaded(const EngineFlags& f) {
  auto e = std::make_unique<Engine>();
  sparse::SparseRuntimeOptions o;
  int threads = 0;
  // -c 0: the model's context, so that any request the model allows fits (the KV cache counts in --memory).
  NF_RETURN_IF_ERROR(sparse::MakeRuntimeOptions(f.runtime, /*default_ctx=*/0, &o, &threads));
  // A request for the prompt's log-probabilities holds the logits of a piece of the prompt: counted in the budget.
  o.logits_tokens = std::max(o.logits_tokens, kPromptLogprobsPiece);
  e->pool = std::make_unique<ThreadPool>(threads);
  NF_ASSIGN_OR_RETURN(e->offloaded, sparse::OpenRuntime(f.runtime, o, e->pool.get()));
  e->served.context = &e->offloaded->context();
  // The runtime's tokenizer, which its memory budget counts.
  e->served.tokenizer = e->offloaded->tokenizer();
  if (e->served.tokenizer == nullptr) {
    return Status::InvalidArgument(f.runtime.deploy + "/" + packer::kResidentFileName +
                                   ": no tokenizer (no tokenizer.ggml.tokens, or one nflash cannot read: see the "
                                   "warning above); the server needs one");
  }
  e->served.description = "offloaded sparse runtime (" + f.runtime.mode + ", " +
                   (e->offloaded->predictor() ? "predictor" : "oracle") + ")";
  return e;
}

Status ResolveChat(const std::string& flag, const std::string& command, ServedModel* served) {
  const std::string names = ChatFormatNames();
  if (!flag.empty()) {
    NF_ASSIGN_OR_RETURN(const ChatFormat format, ParseChatFormat(flag));
    served->chat = ChatTemplate{format, "", ""};
    NF_LOG(Info) << "chat messages in the " << flag << " format (--chat-template)";
    return Status::Ok();
  }
  const std::string& jinja = served->tokenizer->chat_template();
  if (jinja.empty()) {
    served->no_chat = "the model has no chat template (tokenizer.chat_template): start nflash " + command +
                      " with --chat-template NAME (" + names + ")";
    NF_LOG(Info) << "no chat template in the model: chat needs --chat-template";
    return Status::Ok();
  }
  served->chat = DetectChatTemplate(jinja);
  if (!served->chat) {
    served->no_chat = "the model's chat template (tokenizer.chat_template) writes none of the formats nflash knows (" +
                      names + "): start nflash " + command + " with --chat-template NAME";
    NF_LOG(Warning) << "the model's chat template is none of " << names << ": chat needs --chat-template";
    return Status::Ok();
  }
  const ChatThinking thinking = served->chat->thinking;
  NF_LOG(Info) << "chat messages in the " << ChatFormatName(served->chat->format) << " format, recognised from the "
               << "model's chat template" << (served->chat->default_system.empty() ? "" : ", with its default system "
                                                                                          "message")
               << (thinking == ChatThinking::kNone ? ""
                   : thinking == ChatThinking::kForced
                       ? "; a reasoning template: replies open in <think>, returned as reasoning_content and content"
                   : thinking == ChatThinking::kSwitch
                       ? "; a reasoning template: thinking on unless chat_template_kwargs.enable_thinking is false, "
                         "returned as reasoning_content and content"
                       : "; a reasoning template: thinking returned as reasoning_content");
  return Status::Ok();
}

}  // namespace

RuntimeOptionRange AddEngineOptions(CLI::App* cmd, EngineFlags* f, const std::string& ctx_help) {
  cli::AddModelOptions(cmd, &f->source, &f->runtime.threads, &f->no_mmap, /*model_required=*/false);
  CLI::Option* deploy =
      cmd->add_option("-d,--deploy", f->runtime.deploy, "Instead of -m: a deployment directory (nflash pack), run "
                                                        "through the offloaded sparse runtime (FFN on flash)")
          ->check(CLI::ExistingDirectory);
  cli::ExcludeModelOnlyOptions(cmd, deploy);
  cmd->add_option("-c,--ctx", f->runtime.ctx, ctx_help);
  cmd->add_option("--chat-template", f->chat_template,
                  "Format chat messages are written in: " + ChatFormatNames() +
                      " (default: the one the model's chat template writes, recognised)");
  RuntimeOptionRange range;
  range.first = cmd->get_options().size();
  sparse::AddRuntimeOptions(cmd, &f->runtime);
  range.end = cmd->get_options().size();
  return range;
}

void NoteRuntimeOnly(CLI::App* cmd, RuntimeOptionRange range, EngineFlags* f) {
  const auto options = cmd->get_options();
  for (size_t i = range.first; i < range.end && i < options.size(); ++i) {
    // --kv-type sizes the context of either engine.
    if (options[i]->count() > 0 && options[i]->get_name() != "--kv-type") {
      f->runtime_only.push_back(options[i]->get_name());
    }
  }
}

Result<std::unique_ptr<Engine>> OpenEngine(const EngineFlags& f, const std::string& command) {
  const bool deployed = !f.runtime.deploy.empty();
  if (deployed == !f.source.path.empty()) return Status::InvalidArgument("give -m MODEL or -d DEPLOY_DIR (one of them)");
  if (!deployed && !f.runtime_only.empty()) {
    return Status::InvalidArgument(f.runtime_only.front() + " applies to -d (the offloaded runtime), not to -m");
  }
  if (f.runtime.ctx < 0) return Status::InvalidArgument("--ctx " + std::to_string(f.runtime.ctx) + ": expected 0 or more");
  if (!f.chat_template.empty()) NF_RETURN_IF_ERROR(ParseChatFormat(f.chat_template).status());
  NF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, deployed ? OpenOffloaded(f) : OpenDense(f));
  std::filesystem::path path(deployed ? f.runtime.deploy : f.source.path);
  if (path.filename().empty()) path = path.parent_path();
  engine->served.name = path.filename().string();
  NF_RETURN_IF_ERROR(ResolveChat(f.chat_template, command, &engine->served));
  return engine;
}

}  // namespace nflash::server
