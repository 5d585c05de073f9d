// `nflash serve`: opens the dense engine (-m, as `nflash run`) or the flash-offloaded sparse runtime (-d, as
// `nflash offload`), binds the HTTP server, prints `listening on http://HOST:PORT` and serves until SIGINT/SIGTERM.
#include "runtime/server/serve_command.h"

#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/core/log.h"
#include "runtime/server/engine.h"
#include "runtime/server/http_server.h"

namespace nflash::server {
namespace {

struct ServeFlags {
  EngineFlags engine;
  std::string host = "127.0.0.1";
  int port = 8080;
};

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
  ShutdownOnSignal signals;
  NF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, OpenEngine(f.engine, "serve"));
  const int64_t n_ctx = engine->served.context->n_ctx();

  CompletionServer server(engine->served);
  NF_ASSIGN_OR_RETURN(int port, server.Bind(f.host, f.port));
  NF_LOG(Info) << "serving " << engine->served.name << " with the " << engine->served.description << ", context "
               << n_ctx << " tokens, " << engine->pool->NumThreads() << " compute thread(s); one request at a time";
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
  const RuntimeOptionRange runtime_options =
      AddEngineOptions(cmd, &f->engine, "Context size shared by a request's prompt and completion (0: the model's)");
  cmd->add_option("--host", f->host, "Address to listen on");
  cmd->add_option("--port", f->port, "Port (0: any free port; the one bound is printed)")->check(CLI::Range(0, 65535));
  cmd->callback([f, action, cmd, runtime_options] {
    NoteRuntimeOnly(cmd, runtime_options, &f->engine);
    *action = [f] { return RunServe(*f); };
  });
}

}  // namespace nflash::server
