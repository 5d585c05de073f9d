// `nflash serve`: opens the dense engine (-m, as `nflash run`) or the flash-offloaded sparse runtime (-d, as
// `nflash offload`), binds the HTTP server, prints `listening on http://HOST:PORT` and serves until SIGINT/SIGTERM.
#include "runtime/server/serve_command.h"

#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "packer/deployment.h"
#include "runtime/cli/model_loader.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/server/http_server.h"
#include "runtime/sparse/commands.h"

namespace nflash::server {
namespace {

struct ServeFlags {
  cli::ModelSource source;
  bool no_mmap = false;
  sparse::RuntimeFlags runtime;  // -d and the offloaded runtime's flags; its ctx and threads serve both engines
  std::vector<std::string> runtime_only;  // the names of the flags that apply to -d only
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string chat_template;  // --chat-template: a format name; "" the model's template, recognised
};

// The chat format of POST /v1/chat/completions: --chat-template's, else the one the model's Jinja template writes; when
// there is none, `served.no_chat` says why and how to give one. InvalidArgument for an unknown --chat-template name.
Status ResolveChat(const std::string& flag, ServedModel* served) {
  const std::string names = ChatFormatNames();
  if (!flag.empty()) {
    NF_ASSIGN_OR_RETURN(const ChatFormat format, ParseChatFormat(flag));
    served->chat = ChatTemplate{format, ""};
    NF_LOG(Info) << "chat messages in the " << flag << " format (--chat-template)";
    return Status::Ok();
  }
  const std::string& jinja = served->tokenizer->chat_template();
  if (jinja.empty()) {
    served->no_chat = "the model has no chat template (tokenizer.chat_template): start nflash serve with "
                      "--chat-template NAME (" + names + ")";
    NF_LOG(Info) << "no chat template in the model: POST /v1/chat/completions needs --chat-template";
    return Status::Ok();
  }
  served->chat = DetectChatTemplate(jinja);
  if (!served->chat) {
    served->no_chat = "the model's chat template (tokenizer.chat_template) writes none of the formats nflash knows (" +
                      names + "): start nflash serve with --chat-template NAME";
    NF_LOG(Warning) << "the model's chat template is none of " << names << ": POST /v1/chat/completions needs "
                    << "--chat-template";
    return Status::Ok();
  }
  NF_LOG(Info) << "chat messages in the " << ChatFormatName(served->chat->format) << " format, recognised from the "
               << "model's chat template" << (served->chat->default_system.empty() ? "" : ", with its default system "
                                                                                          "message");
  return Status::Ok();
}

// The engine behind the server: the model and its context (dense), or the deployment's runtime (offloaded), with the
// thread pool they compute on. Members are destroyed in reverse order: contexts before models, all before the pool.
struct Engine {
  std::unique_ptr<ThreadPool> pool;
  cli::LoadedModel dense;
  std::unique_ptr<InferenceContext> dense_ctx;
  std::unique_ptr<Tokenizer> deploy_tokenizer;
  std::unique_ptr<sparse::SparseRuntime> offloaded;
  ServedModel served;
  std::string description;
};

Result<std::unique_ptr<Engine>> OpenDense(const ServeFlags& f) {
  auto e = std::make_unique<Engine>();
  cli::ModelSource src = f.source;
  src.use_mmap = !f.no_mmap;
  NF_ASSIGN_OR_RETURN(e->dense, cli::LoadModelForInference(src));
  e->pool = std::make_unique<ThreadPool>(f.runtime.threads);
  NF_ASSIGN_OR_RETURN(const KvType kv_type, ParseKvType(f.runtime.kv_type.empty() ? "f32" : f.runtime.kv_type));
  e->dense_ctx = std::make_unique<InferenceContext>(*e->dense.model, e->pool.get(), f.runtime.ctx, kv_type);
  e->served.context = e->dense_ctx.get();
  e->served.tokenizer = e->dense.tokenizer.get();
  e->description = "dense engine (" + e->dense.description + ")";
  return e;
}

Result<std::unique_ptr<Engine>> OpenOffloaded(const ServeFlags& f) {
  auto e = std::make_unique<Engine>();
  NF_ASSIGN_OR_RETURN(GgufFile resident, GgufFile::OpenPath(f.runtime.deploy + "/" + packer::kResidentFileName));
  NF_ASSIGN_OR_RETURN(e->deploy_tokenizer, LoadTokenizer(resident));
  sparse::SparseRuntimeOptions o;
  int threads = 0;
  // -c 0: the model's context, so that any request the model allows fits (the KV cache counts in --memory).
  NF_RETURN_IF_ERROR(sparse::MakeRuntimeOptions(f.runtime, /*default_ctx=*/0, &o, &threads));
  e->pool = std::make_unique<ThreadPool>(threads);
  NF_ASSIGN_OR_RETURN(e->offloaded, sparse::OpenRuntime(f.runtime, o, e->pool.get()));
  e->served.context = &e->offloaded->context();
  e->served.tokenizer = e->deploy_tokenizer.get();
  e->description = "offloaded sparse runtime (" + f.runtime.mode + ", " +
                   (e->offloaded->predictor() ? "predictor" : "oracle") + ")";
  return e;
}

// SIGINT and SIGTERM are blocked in every thread (the thread pools and httplib's workers inherit the mask of the
// thread that starts them, so this runs first) and taken by one thread with sigwait, which stops the server: nothing
// runs in a signal handler. A signal that comes before the server exists stops it as soon as it is attached.
// Thread-safety: Attach from any thread; the destructor joins the waiting thread.
class ShutdownOnSignal {
 public:
  ShutdownOnSignal() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    // A client that goes away makes a write fail with EPIPE (which ends its stream) instead of killing the process.
    std::signal(SIGPIPE, SIG_IGN);
    thread_ = std::thread([this] { Wait(); });
  }
  ~ShutdownOnSignal() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    pthread_kill(thread_.native_handle(), SIGTERM);  // wakes sigwait; `done_` tells it to return
    thread_.join();
  }
  // The server to stop (nullptr: none; call before the server is destroyed).
  void Attach(CompletionServer* server) {
    std::lock_guard<std::mutex> lock(mu_);
    server_ = server;
    if (server_ && signalled_) server_->Stop();
  }

 private:
  void Wait() {
    while (true) {
      int sig = 0;
      if (sigwait(&set_, &sig) != 0) continue;
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      NF_LOG(Info) << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ": shutting down";
      signalled_ = true;
      if (server_) server_->Stop();
    }
  }

  sigset_t set_;
  std::thread thread_;
  std::mutex mu_;
  CompletionServer* server_ = nullptr;
  bool signalled_ = false;
  bool done_ = false;
};

Status RunServe(const ServeFlags& f) {
  const bool deployed = !f.runtime.deploy.empty();
  if (deployed == !f.source.path.empty()) return Status::InvalidArgument("give -m MODEL or -d DEPLOY_DIR (one of them)");
  if (!deployed && !f.runtime_only.empty()) {
    return Status::InvalidArgument(f.runtime_only.front() + " applies to -d (the offloaded runtime), not to -m");
  }
  if (f.runtime.ctx < 0) return Status::InvalidArgument("--ctx " + std::to_string(f.runtime.ctx) + ": expected 0 or more");
  ShutdownOnSignal signals;
  NF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, deployed ? OpenOffloaded(f) : OpenDense(f));
  // The name clients see: the file or directory served, without its folders.
  std::filesystem::path path(deployed ? f.runtime.deploy : f.source.path);
  if (path.filename().empty()) path = path.parent_path();
  engine->served.name = path.filename().string();
  NF_RETURN_IF_ERROR(ResolveChat(f.chat_template, &engine->served));
  const int64_t n_ctx = engine->served.context->n_ctx();

  CompletionServer server(engine->served);
  NF_ASSIGN_OR_RETURN(int port, server.Bind(f.host, f.port));
  NF_LOG(Info) << "serving " << engine->served.name << " with the " << engine->description << ", context " << n_ctx
               << " tokens, " << engine->pool->NumThreads() << " compute thread(s); one request at a time";
  // The one line on stdout: scripts and tests read the port from it (with --port 0 the kernel picked it).
  std::printf("listening on http://%s:%d\n", f.host.c_str(), port);
  std::fflush(stdout);
  signals.Attach(&server);
  const Status served = server.Serve();
  signals.Attach(nullptr);
  NF_LOG(Info) << "server stopped";
  return served;
}

}  // namespace

void RegisterServeCommand(CLI::App& app, cli::CommandAction* action) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "HTTP server: llama.cpp-style POST /completion, OpenAI-style POST /v1/completions and /v1/chat/completions "
      "(docs/server.md)");
  cli::AddModelOptions(cmd, &f->source, &f->runtime.threads, &f->no_mmap, /*model_required=*/false);
  cmd->add_option("-d,--deploy", f->runtime.deploy, "Instead of -m: a deployment directory (nflash pack), served "
                                                    "through the offloaded sparse runtime (FFN on flash)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("-c,--ctx", f->runtime.ctx, "Context size shared by a request's prompt and completion (0: the model's)");
  cmd->add_option("--host", f->host, "Address to listen on");
  cmd->add_option("--port", f->port, "Port (0: any free port; the one bound is printed)")->check(CLI::Range(0, 65535));
  cmd->add_option("--chat-template", f->chat_template,
                  "Format of POST /v1/chat/completions' messages: " + ChatFormatNames() +
                      " (default: the one the model's chat template writes, recognised)");
  const size_t first_runtime = cmd->get_options().size();
  sparse::AddRuntimeOptions(cmd, &f->runtime);
  cmd->callback([f, action, cmd, first_runtime] {
    const auto options = cmd->get_options();
    for (size_t i = first_runtime; i < options.size(); ++i) {
      // --kv-type sizes the context of either engine.
      if (options[i]->count() > 0 && options[i]->get_name() != "--kv-type") {
        f->runtime_only.push_back(options[i]->get_name());
      }
    }
    *action = [f] { return RunServe(*f); };
  });
}

}  // namespace nflash::server
