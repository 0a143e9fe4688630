// assayd serve: the supervisor daemon.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>

#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/error.h"
#include "supervisor/api/metrics_listener.h"
#include "supervisor/api/server.h"
#include "supervisor/commands.h"
#include "supervisor/config.h"
#include "supervisor/service.h"

namespace assay::supervisor {

namespace {

void arm_watchdog(boost::asio::steady_timer& timer, std::chrono::microseconds interval) {
  timer.expires_after(interval / 2);
  timer.async_wait([&timer, interval](boost::system::error_code ec) {
    if (ec) return;
    sd_notify(0, "WATCHDOG=1");
    arm_watchdog(timer, interval);
  });
}

}  // namespace

int serve_main(int argc, char** argv) {
  CLI::App app{
      "assayd serve: run the supervisor daemon. Accepts next-token oracle and fidelity jobs over "
      "HTTP/1.1 on a unix socket, runs the fingerprint, oracle and compare workers in contained "
      "processes, and keeps signed results under the state directory.",
      "assayd serve"};
  Config config;
  std::string config_file, socket, state_dir, containment, fingerprint_worker, oracle_worker,
      compare_worker, hf_worker, executor, log_level = "info";
  int slots = 0;
  int resident = -1;
  app.add_option("--socket", socket, "unix socket path (default: systemd socket activation)");
  app.add_option("--state-dir", state_dir, "state directory (jobs, keys)");
  std::string keys;
  for (std::string_view k : config_keys()) keys += (keys.empty() ? "" : ", ") + std::string(k);
  app.add_option("--config", config_file,
                 "JSON config file (the packages install /etc/assay/assayd.json), an object with "
                 "any of the keys " +
                     keys +
                     "; each key's meaning, unit and default: the \"Limits (config keys)\" "
                     "table of supervisor/README.md. A flag below overrides its key");
  app.add_option("--containment", containment, "containment backend: auto|v2|v1|none");
  app.add_option("--fingerprint-worker", fingerprint_worker, "assay-fingerprint executable");
  app.add_option("--oracle-worker", oracle_worker, "assay-oracle executable");
  app.add_option("--compare-worker", compare_worker, "assay-compare executable (fidelity jobs)");
  app.add_option("--hf-worker", hf_worker,
                 "assay-hf-worker executable (transformers: Kiln's prompt check)");
  app.add_option("--device-slots", slots, "jobs that run at once (default 1)");
  app.add_option("--executor", executor,
                 "where worker steps run: local (default) or slurm (Slurm batch jobs; needs the "
                 "config file's \"slurm\": {\"shared_dir\", ...})")
      ->check(CLI::IsMember({"local", "slurm"}));
  app.add_option("--resident-models", resident,
                 "resident oracle workers at most (config resident_models.count; 0, the default: "
                 "none, every job loads its model)")
      ->check(CLI::Range(0, 64));
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  bool allow_root_workers = false;
  app.add_flag("--allow-root-workers", allow_root_workers,
               "development only: run workers as root when assayd is root (they still hold no "
               "capabilities); by default they run as worker_user, assay-worker or a transient id");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  try {
    if (!config_file.empty()) config.load_file(config_file);
    if (!socket.empty()) config.socket = socket;
    if (!state_dir.empty()) config.state_dir = state_dir;
    if (!containment.empty()) config.containment.mode = mode_from_name(containment);
    if (!fingerprint_worker.empty()) config.fingerprint_worker = fingerprint_worker;
    if (!oracle_worker.empty()) config.oracle_worker = oracle_worker;
    if (!compare_worker.empty()) config.compare_worker = compare_worker;
    if (!hf_worker.empty()) config.hf_worker = hf_worker;
    if (slots) config.device_slots = slots;
    if (resident >= 0) config.resident.count = static_cast<unsigned>(resident);
    if (!executor.empty()) config.executor = executor;
    if (allow_root_workers) config.allow_root_workers = true;
    config.finalize();

    boost::asio::io_context io;
    Service service(io, config);
    api::Server server(io, service);
    std::optional<api::MetricsListener> metrics;
    if (!config.metrics_listen.empty())
      metrics.emplace(io, service, metrics_endpoint(config.metrics_listen));
    service.start();
    server.start();
    if (metrics) metrics->start();

    // Resident workers were told to exit: they are reaped, and their cgroups and workspaces
    // removed, within this long, rather than left for the next start to find as orphans.
    boost::asio::steady_timer reaping(io);
    auto patience = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::function<void()> stop_when_reaped = [&] {
      if (service.residents() == 0 || std::chrono::steady_clock::now() >= patience) {
        if (service.residents() != 0)
          spdlog::warn("{} resident worker(s) not reaped within 5 s", service.residents());
        io.stop();
        return;
      }
      reaping.expires_after(std::chrono::milliseconds(20));
      reaping.async_wait([&](boost::system::error_code) { stop_when_reaped(); });
    };
    boost::asio::signal_set signals(io, SIGTERM, SIGINT);
    signals.async_wait([&](boost::system::error_code ec, int sig) {
      if (ec) return;
      spdlog::info("signal {}: stopping", sig);
      sd_notify(0, "STOPPING=1\nSTATUS=stopping");
      server.stop();
      if (metrics) metrics->stop();
      service.stop();
      patience = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      stop_when_reaped();
    });
    std::signal(SIGPIPE, SIG_IGN);

    boost::asio::steady_timer watchdog(io);
    std::uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) > 0) arm_watchdog(watchdog, std::chrono::microseconds(usec));

    std::string status =
        "STATUS=serving on " +
        (config.socket.empty() ? std::string("the systemd socket") : config.socket.string()) +
        ", containment " + service.backend() + ", key " + service.key_id();
    sd_notify(0, ("READY=1\n" + status).c_str());
    spdlog::info("assayd ready: {} state {} key {}", service.backend(), config.state_dir.string(),
                 service.key_id());
    if (::access(config.hf_worker.c_str(), X_OK) != 0)
      spdlog::warn(
          "no transformers worker at {} (config hf_worker): requests for the transformers "
          "backend, the numerics envelope or an engine audit are refused at admission, and Kiln "
          "requests run without Kiln's prompt check",
          config.hf_worker.string());
    io.run();
    return 0;
  } catch (const common::Error& e) {
    std::fprintf(stderr, "assayd serve: %s (%s)\n", e.what(), e.code().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "assayd serve: %s\n", e.what());
    return 1;
  }
}

}  // namespace assay::supervisor
