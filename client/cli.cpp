#include "client/cli.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <ostream>
#include <thread>

#include <CLI/CLI.hpp>

#include "client/api.h"
#include "client/batch.h"
#include "client/format.h"
#include "client/report.h"
#include "client/verify.h"
#include "common/batch.h"
#include "common/error.h"
#include "common/fidelity.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/protocol.h"
#include "common/request.h"
#include "common/trajectory.h"

namespace assay::client {

namespace {

using common::Json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kExitCodesHelp =
    "Exit status:\n"
    "  0  success (verify: every check passed; wait: the job succeeded)\n"
    "  1  unexpected error\n"
    "  2  bad command line\n"
    "  3  assayd not reachable (no socket, connection refused, no answer in time)\n"
    "  4  assayd refused the request (HTTP 4xx/5xx; the message carries the daemon's code)\n"
    "  5  the job ended failed or cancelled (wait, submit --wait)\n"
    "  6  verify: a check failed (the record is not what it claims)\n"
    "  7  a local file is unreadable or invalid (request check, submit, verify)\n"
    "  8  wait --timeout expired (the job goes on)\n"
    "\n"
    "The socket is --socket, else $ASSAY_SOCKET, else /run/assay/assayd.sock.";

// A condition that ends the command with a given status after printing its message.
struct ExitWith {
  int status;
  std::string message;
};

struct Options {
  std::string socket;
  bool json = false;
  double timeout_s = 60;
  // Positional and per-command values.
  std::string file, id, output, model, envelope, pubkey, artifact, state;
  bool wait = false;
  bool retry = false;
  bool batch = false;  // submit: FILE is JSONL, one next-token request per line
  double wait_timeout_s = 0;
  bool refresh = false;
};

class Cli {
 public:
  Cli(const Options& o, std::ostream& out, std::ostream& err, const Environment& env)
      : o_(o),
        out_(out),
        err_(err),
        env_(env),
        api_({.socket_path = o.socket,
              .timeout = std::chrono::milliseconds(static_cast<long long>(o.timeout_s * 1000))}) {}

  // `only`: the one request schema this command accepts (assay fidelity/trajectory submit).
  int submit(std::string_view only = {});
  int fidelity_show();
  int trajectory_show();
  int show_result(std::string_view schema, const char* kind, std::string (*report)(const Json&));
  int fingerprint_refresh();
  int wait(const std::string& id);
  int status();
  int list();
  int result();
  int artifact();
  int cancel();
  int verify();
  int keys();
  int health();
  int info();
  int request_check();
  int report();

 private:
  void print_json(const Json& j) { out_ << j.dump(o_.json ? -1 : 2) << "\n"; }
  void save(const fs::path& path, std::string_view bytes, mode_t mode = 0644);
  int finished(const Json& job);

  const Options& o_;
  std::ostream& out_;
  std::ostream& err_;
  const Environment& env_;
  Api api_;
};

std::string read_local(const fs::path& path, std::size_t max_bytes, const char* what) {
  try {
    return common::read_file(path, max_bytes);
  } catch (const common::Error& e) {
    throw ExitWith{kExitInvalidInput, std::string("cannot read ") + what + ": " + e.what()};
  }
}

std::string url_encode(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

void Cli::save(const fs::path& path, std::string_view bytes, mode_t mode) {
  try {
    common::atomic_write_file(path, bytes, mode);
  } catch (const common::Error& e) {
    throw ExitWith{kExitError, std::string("cannot write ") + path.string() + ": " + e.what()};
  }
}

// Parses a request file of either kind offline, refusing locally what assayd would refuse.
// Returns its request_sha256; `fidelity` tells which kind it is.
std::string check_request_file(const std::string& file, const std::string& text, bool& fidelity,
                               Json* report = nullptr) {
  try {
    Json doc = common::parse_strict(text, {.max_bytes = common::kMaxRequestBytes});
    fidelity = doc.is_object() && doc.value("schema", Json()) == protocol::kFidelityRequest;
    if (doc.is_object() && doc.value("schema", Json()) == protocol::kNextTokenBatchRequest) {
      auto b = common::validate_batch_request(doc);
      if (report)
        *report = Json{{"schema", b.schema},
                       {"request_sha256", b.request_sha256},
                       {"states", b.states.size()}};
      return b.request_sha256;
    }
    if (doc.is_object() && doc.value("schema", Json()) == common::kTrajectoryRequest) {
      auto r = common::validate_trajectory_request(doc);
      if (report) {
        Json lengths = Json::object();
        for (const auto& c : r.continuations) lengths[c.engine] = c.token_ids.size();
        *report = Json{{"schema", r.schema},
                       {"request_sha256", r.request_sha256},
                       {"prompt_length", r.prompt_token_ids.size()},
                       {"prompt_token_ids_sha256", common::token_ids_sha256(r.prompt_token_ids)},
                       {"continuation_lengths", lengths}};
      }
      return r.request_sha256;
    }
    if (fidelity) {
      auto r = common::validate_fidelity_request(doc);
      if (report)
        *report = Json{{"schema", r.schema},
                       {"request_sha256", r.request_sha256},
                       {"panel_sha256", r.panel_sha256},
                       {"contexts", r.panel.size()},
                       {"scored_positions", r.scored_positions()},
                       {"candidate", r.candidate_model ? "model" : "logits"}};
      return r.request_sha256;
    }
    auto r = common::validate_request(doc);
    if (report) *report = r.check_report();
    return r.request_sha256;
  } catch (const common::Error& e) {
    throw ExitWith{kExitInvalidInput, file + ": " + e.what() + " [" + e.code() + "]"};
  }
}

int Cli::submit(std::string_view only) {
  std::string body = read_local(o_.file, common::kMaxRequestBytes, "the request");
  bool fidelity = false;
  std::string request_sha256;
  if (o_.batch) {
    try {
      BatchDocument b = batch_from_jsonl(body, fs::path(o_.file).stem().string());
      body = std::move(b.body);
      request_sha256 = b.request_sha256;
    } catch (const common::Error& e) {
      throw ExitWith{kExitInvalidInput, o_.file + ": " + e.what() + " [" + e.code() + "]"};
    }
  } else {
    request_sha256 = check_request_file(o_.file, body, fidelity);
  }
  // Valid once checked.
  const std::string schema_name =
      common::parse_strict(body, {.max_bytes = common::kMaxRequestBytes}).value("schema", "");
  const bool trajectory = schema_name == common::kTrajectoryRequest;
  const bool batch = schema_name == protocol::kNextTokenBatchRequest;
  std::string_view schema = trajectory ? common::kTrajectoryRequest
                            : fidelity ? protocol::kFidelityRequest
                                       : std::string_view{};
  if (!only.empty() && schema != only)
    throw ExitWith{kExitInvalidInput, o_.file + " is not an " + std::string(only) +
                                          " request; submit it with `assay submit`"};
  if (trajectory && !o_.model.empty())
    throw ExitWith{kExitUsage, "--model does not apply to a trajectory request: it has model_dir"};
  if (fidelity && !o_.model.empty())
    throw ExitWith{kExitUsage,
                   "--model does not apply to a fidelity request: it names its "
                   "reference and candidate itself"};
  std::string target = "/v1/jobs";
  if (!o_.model.empty()) {
    std::error_code ec;
    fs::path model = fs::absolute(o_.model, ec);
    if (ec) throw ExitWith{kExitUsage, "--model " + o_.model + ": " + ec.message()};
    target += "?model_dir=" + url_encode(model.lexically_normal().string());
  }
  if (o_.retry) target += std::string(o_.model.empty() ? "?" : "&") + "retry=1";
  Response r;
  try {
    r = api_.request("POST", target, std::move(body));
  } catch (const ApiError& e) {
    if (e.code() != "request.no_model_dir") throw;
    throw ExitWith{kExitApiError, std::string(e.what()) + " (with assay: give --model DIR)"};
  }
  Json job = common::parse_strict(r.body);
  std::string id = job_id(job);
  const bool retried = job.value("retried", false);
  const std::string state = job_state(job);
  // The daemon answers an identical request with the job it already has, even a failed one:
  // say so, since nothing runs again without --retry.
  if (!retried && r.status == 200 && (state == "failed" || state == "cancelled"))
    err_ << "assay: an identical request already "
         << (state == "failed" ? "failed" : "was cancelled") << " as " << id
         << "; resubmit with --retry to run it again\n";
  if (o_.wait) return wait(id);
  if (o_.json) {
    print_json(job);
  } else {
    out_ << (retried           ? "resubmitted "
             : r.status == 200 ? "existing "
                               : "submitted ")
         << (fidelity     ? "fidelity job "
             : trajectory ? "trajectory job "
             : batch      ? "batch job "
                          : "job ")
         << id << " (" << state << ")  request " << request_sha256 << "\n";
  }
  return kExitOk;
}

// The job's final status: print it and turn it into the exit status.
int Cli::finished(const Json& job) {
  bool ok = state_is_success(job_state(job));
  if (o_.json) {
    print_json(job);
  } else {
    Json shown = job;
    if (ok && job.value("request_schema", "") == protocol::kFidelityRequest) {
      out_ << describe_job(shown) << "\n"
           << fidelity_report(api_.get_json(job_path(job_id(job), "result")));
      return kExitOk;
    }
    if (ok && job.value("request_schema", "") == protocol::kNextTokenBatchRequest) {
      out_ << describe_job(shown) << "\n"
           << batch_report(api_.get_json(job_path(job_id(job), "result")));
      return kExitOk;
    }
    if (ok && job.value("request_schema", "") == common::kTrajectoryRequest) {
      out_ << describe_job(shown) << "\n"
           << trajectory_report(api_.get_json(job_path(job_id(job), "result")));
      return kExitOk;
    }
    if (ok) {
      // The verdict lives in the result; show it with the status so `wait` answers the question.
      Json result = api_.get_json(job_path(job_id(job), "result"));
      for (const char* k : {"verdict", "result_sha256"})
        if (result.contains(k)) shown[k] = result[k];
    }
    out_ << describe_job(shown);
  }
  return ok ? kExitOk : kExitJobFailed;
}

int Cli::wait(const std::string& id) {
  const std::string status_path = job_path(id);
  const std::string events_path = job_path(id, "events");
  const auto start = Clock::now();
  const bool live = env_.stdout_is_tty && !o_.json;
  // How long assayd may stay unreachable (a restart) before wait gives up.
  const auto kReconnectFor = std::chrono::seconds(30);
  Progress progress;  // the latest state seen
  bool timed_out = false;

  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto render = [&] {
    if (live) out_ << "\r\033[K" << progress_line(id, progress, elapsed()) << std::flush;
  };
  auto check_deadline = [&] {
    if (o_.wait_timeout_s > 0 && elapsed() > o_.wait_timeout_s) timed_out = true;
    return !timed_out;
  };
  auto on_line = [&](std::string_view line) {
    Json ev;
    try {
      ev = common::parse_strict(line);
    } catch (const common::Error& e) {
      err_ << "assay: ignoring a malformed event: " << e.what() << "\n";
      return check_deadline();
    }
    progress.update(ev);
    if (live)
      render();
    else if (!o_.json)
      out_ << progress_line(id, progress, elapsed()) << "\n" << std::flush;
    return check_deadline();
  };

  Json job;
  bool streamed = false;
  auto last_contact = Clock::now();
  while (true) {
    try {
      job = api_.get_json(status_path);
      last_contact = Clock::now();
      // A finished job still gets one pass over its events (assayd replays them and ends the
      // stream), so plain output always shows the history.
      if ((state_is_final(job_state(job)) && streamed) || !check_deadline()) break;
      progress.update(job);
      render();
      auto stream_start = Clock::now();
      api_.stream_lines(events_path, {.on_line = on_line, .on_tick = [&] {
                                        render();
                                        return check_deadline();
                                      }});
      last_contact = Clock::now();
      streamed = true;
      if (timed_out) break;
      // The stream ended: normally the job did too; if not (assayd restarting), do not spin.
      if (Clock::now() - stream_start < std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } catch (const UnreachableError& e) {
      if (Clock::now() - last_contact > kReconnectFor || !check_deadline()) {
        if (live) out_ << "\n";
        throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  if (live) out_ << "\r\033[K";
  if (timed_out) {
    if (!o_.json) out_ << progress_line(id, progress, elapsed()) << "\n";
    throw ExitWith{kExitWaitTimeout, "gave up waiting for job " + id + " after " +
                                         format_seconds(o_.wait_timeout_s) + "; it goes on"};
  }
  return finished(job);
}

int Cli::status() {
  Json job = api_.get_json(job_path(o_.id));
  if (o_.json)
    print_json(job);
  else
    out_ << describe_job(job);
  return kExitOk;
}

int Cli::list() {
  std::string target = "/v1/jobs";
  if (!o_.state.empty()) target += "?state=" + url_encode(o_.state);
  Json doc = api_.get_json(target);
  if (o_.json) {
    print_json(doc);
  } else {
    out_ << jobs_table(doc);
  }
  return kExitOk;
}

int Cli::result() {
  Response r = api_.request("GET", job_path(o_.id, "result"));
  if (o_.output.empty()) {
    out_ << r.body;  // the exact bytes: `assay result ID > r.json` stays verifiable
    if (env_.stdout_is_tty) out_ << "\n";
    return kExitOk;
  }
  Response env = api_.request("GET", job_path(o_.id, "attestation"));
  fs::path envelope = default_envelope_path(o_.output);
  save(o_.output, r.body);
  save(envelope, env.body);
  if (!o_.json)
    out_ << "wrote " << o_.output << " (" << r.body.size() << " bytes) and " << envelope.string()
         << "\n";
  return kExitOk;
}

int Cli::artifact() {
  Response r = api_.request("GET", job_path(o_.id, "artifact"));
  save(o_.output, r.body);
  if (!o_.json) out_ << "wrote " << o_.output << " (" << r.body.size() << " bytes)\n";
  return kExitOk;
}

int Cli::cancel() {
  Response r = api_.request("DELETE", job_path(o_.id));
  Json job = r.body.empty() ? api_.get_json(job_path(o_.id)) : common::parse_strict(r.body);
  if (o_.json)
    print_json(job);
  else
    out_ << "job " << o_.id << ": " << job_state(job) << "\n";
  return kExitOk;
}

int Cli::verify() {
  VerifyInputs in;
  in.result = o_.file;
  if (!o_.envelope.empty()) {
    in.envelope = o_.envelope;
  } else if (fs::exists(default_envelope_path(in.result))) {
    in.envelope = default_envelope_path(in.result);
  }
  if (!o_.artifact.empty()) in.artifact = o_.artifact;
  std::string key_source;
  if (!o_.pubkey.empty()) {
    in.public_key = read_local(o_.pubkey, 64 * 1024, "the public key");
    key_source = o_.pubkey;
  } else {
    // Online fallback: trust the daemon we are talking to for its own key.
    Json info;
    try {
      info = api_.get_json("/v1/info");
    } catch (const UnreachableError& e) {
      throw ExitWith{kExitUnreachable,
                     std::string(e.what()) + "; give --pubkey FILE to verify offline"};
    }
    auto pem = public_key_pem(info);
    if (!pem)
      throw ExitWith{kExitApiError, "assayd's /v1/info has no public key; give --pubkey FILE"};
    in.public_key = *pem;
    key_source = "assayd at " + api_.socket_path();
  }
  VerifyReport report;
  try {
    report = verify_result(in);
  } catch (const common::Error& e) {
    throw ExitWith{kExitInvalidInput, std::string(e.what()) + " [" + e.code() + "]"};
  }
  if (o_.json) {
    Json j = report.to_json();
    j["public_key_from"] = key_source;
    print_json(j);
  } else {
    out_ << checks_table(report);
    out_ << (report.ok() ? "verified: " : "NOT VERIFIED: ") << o_.file << " (public key from "
         << key_source << ")\n";
  }
  return report.ok() ? kExitOk : kExitVerifyFailed;
}

int Cli::keys() {
  Json info = api_.get_json("/v1/info");
  auto pem = public_key_pem(info);
  std::string key_id = key_id_of(info);
  if (!o_.output.empty()) {
    if (!pem) throw ExitWith{kExitApiError, "assayd's /v1/info has no public key PEM"};
    save(o_.output, *pem);
  }
  if (o_.json) {
    print_json({{"key_id", key_id}, {"public_key_pem", pem ? Json(*pem) : Json(nullptr)}});
  } else {
    out_ << "key id: " << key_id << "\n";
    if (pem) out_ << *pem << (pem->ends_with('\n') ? "" : "\n");
    if (!o_.output.empty()) out_ << "wrote " << o_.output << "\n";
  }
  return kExitOk;
}

int Cli::health() {
  Json h = api_.get_json("/v1/health");
  if (o_.json)
    print_json(h);
  else
    out_ << describe_object(h);
  return kExitOk;
}

int Cli::info() {
  Json i = api_.get_json("/v1/info");
  if (o_.json)
    print_json(i);
  else
    out_ << describe_object(i);
  return kExitOk;
}

int Cli::request_check() {
  std::string text = read_local(o_.file, common::kMaxRequestBytes, "the request");
  bool fidelity = false;
  Json report;
  check_request_file(o_.file, text, fidelity, &report);
  out_ << report.dump(o_.json ? -1 : 2) << "\n";
  return kExitOk;
}

int Cli::report() {
  Json result;
  try {
    result = common::parse_strict(read_local(o_.file, 64 << 20, "the result"));
  } catch (const common::Error& e) {
    if (e.code().rfind("json.", 0) != 0) throw;
    throw ExitWith{kExitInvalidInput, o_.file + " is not JSON: " + e.what()};
  }
  std::string html;
  try {
    html = render_report(result, fs::absolute(o_.file).parent_path());
  } catch (const common::Error& e) {
    if (e.code() != "client.report") throw;
    throw ExitWith{kExitInvalidInput, o_.file + ": " + e.what()};
  }
  save(o_.output, html);
  out_ << "wrote " << o_.output << " (" << html.size() << " bytes)\n";
  return kExitOk;
}

// `assay fidelity show` / `assay trajectory show`: the job while it is not done, then its result
// as `report` renders it (or as JSON).
int Cli::show_result(std::string_view schema, const char* kind,
                     std::string (*report)(const Json&)) {
  Json job = api_.get_json(job_path(o_.id));
  if (job.value("request_schema", "") != schema)
    throw ExitWith{kExitUsage, "job " + o_.id + " is not a " + kind + " job (" +
                                   job.value("request_schema", std::string("unknown")) +
                                   "); use `assay status`"};
  if (!state_is_success(job_state(job))) {
    if (o_.json)
      print_json(job);
    else
      out_ << describe_job(job);
    return state_is_final(job_state(job)) ? kExitJobFailed : kExitOk;
  }
  Json result = api_.get_json(job_path(o_.id, "result"));
  if (o_.json)
    print_json(result);
  else
    out_ << report(result);
  return kExitOk;
}

int Cli::fidelity_show() {
  return show_result(protocol::kFidelityRequest, "fidelity", &fidelity_report);
}

int Cli::trajectory_show() {
  return show_result(common::kTrajectoryRequest, "trajectory", &trajectory_report);
}

// Forgets assayd's cached per-file digests of a model directory: its next job hashes every file.
int Cli::fingerprint_refresh() {
  if (!o_.refresh)
    throw ExitWith{kExitUsage,
                   "assay fingerprint: only --refresh is offered (jobs fingerprint by themselves)"};
  std::error_code ec;
  fs::path model = fs::absolute(o_.model, ec);
  if (ec) throw ExitWith{kExitUsage, o_.model + ": " + ec.message()};
  Response r = api_.request("POST", "/v1/fingerprint-cache/refresh?model_dir=" +
                                        url_encode(model.lexically_normal().string()));
  Json answer = common::parse_strict(r.body);
  if (o_.json)
    print_json(answer);
  else
    out_ << (answer.value("dropped", false) ? "dropped the cached digests of "
                                            : "no cached digests for ")
         << model.lexically_normal().string() << "; its next fingerprint hashes every file\n";
  return kExitOk;
}

int exit_status_of(const common::Error& e) {
  if (dynamic_cast<const UnreachableError*>(&e)) return kExitUnreachable;
  if (dynamic_cast<const ApiError*>(&e)) return kExitApiError;
  if (e.code() == "client.bad_id") return kExitUsage;
  return kExitError;
}

}  // namespace

int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
            const Environment& env) {
  Options o;
  o.socket = env.socket.empty() ? kDefaultSocket : env.socket;

  CLI::App app{
      "assay: submit next-token oracle and fidelity jobs to assayd and verify their "
      "signed results",
      "assay"};
  app.footer(kExitCodesHelp);
  app.require_subcommand(1);
  app.fallthrough();
  app.set_version_flag("--version", "assay " ASSAY_VERSION);
  app.add_option("--socket", o.socket, "assayd's unix socket ($ASSAY_SOCKET)")
      ->capture_default_str();
  app.add_flag("--json", o.json, "machine-readable JSON output");
  app.add_option("--timeout", o.timeout_s, "seconds to wait for one API request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);

  auto* submit = app.add_subcommand("submit", "submit a request file as a job");
  submit
      ->add_option("FILE", o.file,
                   "assay.next-token-request.v1, kiln.hf-next-token-request.v1, "
                   "assay.next-token-batch-request.v1, assay.fidelity-request.v1 or "
                   "assay.trajectory-request.v1 (with --batch: JSONL of next-token requests)")
      ->required();
  submit->add_option("--model", o.model,
                     "model directory (required for Kiln requests; overrides an assay request's)");
  submit->add_flag("--batch", o.batch,
                   "FILE is JSONL: one next-token request per line (assay's or Kiln's), all on "
                   "one model; submitted as one batch job (one model load, a signed result per "
                   "state, a signed summary), its id FILE's name without the extension");
  submit->add_flag("--wait", o.wait, "wait for the job to finish (as `assay wait`)");
  submit->add_flag(
      "--retry", o.retry,
      "run a failed or cancelled identical job again (else its old status is returned)");
  submit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);

  auto* fidelity = app.add_subcommand(
      "fidelity", "fidelity jobs: KL(reference || candidate) over a panel of contexts");
  fidelity->require_subcommand(1);
  auto* fsubmit = fidelity->add_subcommand("submit", "submit an assay.fidelity-request.v1 file");
  fsubmit->add_option("FILE", o.file, "assay.fidelity-request.v1")->required();
  fsubmit->add_flag("--wait", o.wait, "wait for the job, then print its metric table");
  fsubmit->add_flag("--retry", o.retry, "run a failed or cancelled identical job again");
  fsubmit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);
  auto* fshow = fidelity->add_subcommand(
      "show", "a fidelity job's metrics, per-context table and KL histogram (--json: the receipt)");
  fshow->add_option("ID", o.id, "job id")->required();

  auto* trajectory = app.add_subcommand(
      "trajectory",
      "trajectory jobs: where each engine's greedy continuation first left the reference argmax");
  trajectory->require_subcommand(1);
  auto* tsubmit =
      trajectory->add_subcommand("submit", "submit an assay.trajectory-request.v1 file");
  tsubmit->add_option("FILE", o.file, "assay.trajectory-request.v1")->required();
  tsubmit->add_flag("--wait", o.wait, "wait for the job, then print each engine's departure");
  tsubmit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);
  auto* tshow = trajectory->add_subcommand(
      "show", "a trajectory job's departures and divergence (--json: the result)");
  tshow->add_option("ID", o.id, "job id")->required();

  auto* fingerprint = app.add_subcommand(
      "fingerprint",
      "the fingerprint cache: --refresh DIR forgets the cached per-file digests of a model "
      "directory, so that its next job hashes every file");
  fingerprint->add_option("DIR", o.model, "model directory")->required();
  fingerprint->add_flag("--refresh", o.refresh, "forget DIR's cached digests");

  auto* report = app.add_subcommand(
      "report",
      "write one self-contained HTML report (inline SVG and CSS, no script, no network) "
      "of a result file; its artifact is read from beside it when there");
  report->add_option("RESULT", o.file, "result.json (next-token or fidelity)")
      ->required()
      ->check(CLI::ExistingFile);
  report->add_option("-o,--output", o.output, "the HTML file to write")->required();

  auto* wait = app.add_subcommand("wait", "follow a job until it ends (live progress on a TTY)");
  wait->add_option("ID", o.id, "job id")->required();
  wait->add_option("--timeout-wait,--wait-timeout", o.wait_timeout_s,
                   "give up after SECONDS (exit 8)")
      ->check(CLI::NonNegativeNumber);

  auto* status = app.add_subcommand("status", "show one job");
  status->add_option("ID", o.id, "job id")->required();

  auto* list = app.add_subcommand("list", "list jobs");
  list->add_option("--state", o.state, "only jobs in this state");

  auto* result = app.add_subcommand("result", "fetch a job's result record");
  result->add_option("ID", o.id, "job id")->required();
  result->add_option("-o,--output", o.output,
                     "write the result here and its DSSE envelope beside it (<stem>.dsse.json); "
                     "default: the result bytes to stdout");

  auto* artifact = app.add_subcommand(
      "artifact", "fetch a job's artifact (logits; a fidelity job's token-wise KL vector)");
  artifact->add_option("ID", o.id, "job id")->required();
  artifact->add_option("-o,--output", o.output, "file to write (safetensors)")->required();

  auto* cancel = app.add_subcommand("cancel", "cancel a queued or running job");
  cancel->add_option("ID", o.id, "job id")->required();

  auto* verify = app.add_subcommand(
      "verify", "check a result offline: result_sha256, DSSE signature, subjects' digests");
  verify->add_option("RESULT", o.file, "result.json")->required()->check(CLI::ExistingFile);
  verify
      ->add_option("--envelope", o.envelope,
                   "DSSE envelope (default: <stem>.dsse.json beside RESULT)")
      ->check(CLI::ExistingFile);
  verify
      ->add_option("--pubkey", o.pubkey,
                   "assayd's public key PEM (default: ask assayd's /v1/info, online)")
      ->check(CLI::ExistingFile);
  verify->add_option("--artifact", o.artifact, "the logits artifact, to check its digest too")
      ->check(CLI::ExistingFile);

  auto* keys = app.add_subcommand("keys", "show assayd's signing key id and public key");
  keys->add_option("-o,--output", o.output, "also write the public key PEM to this file");

  auto* health = app.add_subcommand("health", "ask assayd whether it is healthy");
  auto* info = app.add_subcommand("info", "show assayd's version, containment and limits");

  auto* request = app.add_subcommand("request", "offline tools for request documents");
  request->require_subcommand(1);
  auto* check = request->add_subcommand(
      "check", "validate a request offline and print its recomputed identities as JSON");
  check->add_option("FILE", o.file, "request document")->required();

  if (args.size() > 1 && !args[1].starts_with("-")) {
    const auto& subs = app.get_subcommands([](CLI::App*) { return true; });
    bool known = std::any_of(subs.begin(), subs.end(),
                             [&](const CLI::App* a) { return a->get_name() == args[1]; });
    if (!known) {
      err << "assay: unknown command \"" << args[1] << "\"\nRun `assay --help` for usage.\n";
      return kExitUsage;
    }
  }
  std::vector<std::string> rev(args.rbegin(), args.rend());  // CLI11 takes them reversed
  if (!rev.empty()) rev.pop_back();                          // without the program name
  try {
    app.parse(rev);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::CallForVersion*>(&e)) {
      out << e.what() << "\n";
      return kExitOk;
    }
    if (e.get_exit_code() == 0) return app.exit(e, out, err);  // --help
    err << "assay: " << e.what() << "\nRun `assay --help` for usage.\n";
    return kExitUsage;
  }

  try {
    Cli cli(o, out, err, env);
    if (*submit) return cli.submit();
    if (*fsubmit) return cli.submit(protocol::kFidelityRequest);
    if (*fshow) return cli.fidelity_show();
    if (*tsubmit) return cli.submit(common::kTrajectoryRequest);
    if (*tshow) return cli.trajectory_show();
    if (*fingerprint) return cli.fingerprint_refresh();
    if (*wait) return cli.wait(o.id);
    if (*status) return cli.status();
    if (*list) return cli.list();
    if (*result) return cli.result();
    if (*artifact) return cli.artifact();
    if (*cancel) return cli.cancel();
    if (*verify) return cli.verify();
    if (*keys) return cli.keys();
    if (*health) return cli.health();
    if (*info) return cli.info();
    if (*check) return cli.request_check();
    if (*report) return cli.report();
    err << "assay: no command\n";
    return kExitUsage;
  } catch (const ExitWith& e) {
    err << "assay: " << e.message << "\n";
    return e.status;
  } catch (const common::Error& e) {
    err << "assay: " << e.what() << "\n";
    return exit_status_of(e);
  } catch (const std::exception& e) {
    err << "assay: unexpected error: " << e.what() << "\n";
    return kExitError;
  }
}

}  // namespace assay::client
