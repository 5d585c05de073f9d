// The engine behind the text front ends that hold one model for many turns (`nflash serve`, `nflash chat`): the dense
// engine (-m, as `nflash run`) or the flash-offloaded sparse runtime (-d, as `nflash offload`), its one inference
// context and tokenizer, and the chat format its messages are written in.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/cli/command.h"
#include "runtime/cli/model_loader.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/server/http_server.h"
#include "runtime/sparse/commands.h"

namespace nflash::server {

// One command line's engine flags. Thread-safety: a value type.
struct EngineFlags {
  cli::ModelSource source;
  bool no_mmap = false;
  sparse::RuntimeFlags runtime;  // -d and the offloaded runtime's flags; its ctx and threads serve both engines
  std::vector<std::string> runtime_only;  // the names of the flags given that apply to -d only
  std::string chat_template;  // --chat-template: a format name; "" the model's template, recognised
};

// The model and its context (dense), or the deployment's runtime (offloaded), with the thread pool they compute on.
// Members are destroyed in reverse order: contexts before models, all before the pool.
struct Engine {
  std::unique_ptr<ThreadPool> pool;
  cli::LoadedModel dense;
  std::unique_ptr<InferenceContext> dense_ctx;
  std::unique_ptr<sparse::SparseRuntime> offloaded;
  ServedModel served;  // name: the file or directory, without its folders; description: the engine
};

// The offloaded runtime's options among a command's (indices into CLI::App::get_options()).
struct RuntimeOptionRange {
  size_t first = 0, end = 0;
};
// Adds -m (with the model options), -d, -c (described by `ctx_help`), --chat-template and the offloaded runtime's
// flags to `cmd`. Call NoteRuntimeOnly with what this returns from the command's callback.
RuntimeOptionRange AddEngineOptions(CLI::App* cmd, EngineFlags* f, const std::string& ctx_help);
// Records in f->runtime_only the -d-only flags the command line gave (all but --kv-type, which sizes either engine).
void NoteRuntimeOnly(CLI::App* cmd, RuntimeOptionRange range, EngineFlags* f);

// Opens the engine the flags name, with its chat format (--chat-template, else the one the model's Jinja template
// writes; when there is none, served.no_chat says why and how to give one, naming `command`). InvalidArgument for
// -m and -d both or neither, a -d flag with -m, a negative --ctx, an unknown --chat-template.
Result<std::unique_ptr<Engine>> OpenEngine(const EngineFlags& f, const std::string& command);

}  // namespace nflash::server
