// The `assay` commands that submit, check and follow jobs: submit (single, batch, fidelity,
// trajectory and layer-attribution requests, each checked locally first as `request check` does),
// wait (the live progress line, reconnecting across an assayd restart, then the job's final status
// with its verdict or report), status, list and cancel.
#include <chrono>
#include <filesystem>
#include <functional>
#include <iostream>
#include <iterator>
#include <thread>

#include "client/batch.h"
#include "client/cli_internal.h"
#include "client/format.h"
#include "common/audit.h"
#include "common/batch.h"
#include "common/error.h"
#include "common/fidelity.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/kiln_receipt.h"
#include "common/layers.h"
#include "common/numerics.h"
#include "common/protocol.h"
#include "common/request.h"
#include "common/trajectory.h"

namespace assay::client::cli {

using common::Json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string check_request_file(const std::string& file, const std::string& text, bool& fidelity,
                               Json* report) {
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
    if (doc.is_object() && doc.value("schema", Json()) == common::kLayerRequest) {
      auto r = common::validate_layer_request(doc);
      if (report)
        *report = Json{{"schema", r.schema},
                       {"request_sha256", r.request_sha256},
                       {"input_length", r.input_token_ids.size()},
                       {"input_token_ids_sha256", common::token_ids_sha256(r.input_token_ids)},
                       {"engine", r.engine},
                       {"rows_file_sha256", r.rows_sha256},
                       {"rows", common::layer_rows_name(r.rows)},
                       {"tolerance", {{"relative_rmse", r.tolerance}}},
                       {"patching", r.patching}};
      return r.request_sha256;
    }
    if (doc.is_object() && doc.value("schema", Json()) == common::kAuditRequest) {
      auto r = common::validate_audit_request(doc);
      if (report)
        *report = Json{{"schema", r.schema},
                       {"request_sha256", r.request_sha256},
                       {"engine", r.engine},
                       {"contexts", r.contexts.size()},
                       {"positions", r.positions()},
                       {"members", r.member_names()},
                       {"policy", common::to_json(r.policy)}};
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

// Where the receipts of a Kiln request are: --receipts, else the request's directory when both
// are there (said on stderr either way when none are sent). Empty: none to send.
std::string Cli::receipts_dir(const std::string& body, const std::string& schema) {
  if (schema != protocol::kKilnNextTokenRequest) {
    if (!o_.receipts.empty())
      throw ExitWith{kExitUsage, "--receipts applies to a Kiln request only; " + o_.file + " is " +
                                     (schema.empty() ? "not one" : schema)};
    return "";
  }
  std::error_code ec;
  if (!o_.receipts.empty()) {
    fs::path dir = fs::absolute(o_.receipts, ec);
    if (ec) throw ExitWith{kExitUsage, "--receipts " + o_.receipts + ": " + ec.message()};
    return dir.lexically_normal().string();
  }
  fs::path beside = fs::absolute(o_.file, ec).parent_path();
  Json source = common::parse_strict(body, {.max_bytes = common::kMaxRequestBytes})["source"];
  for (const char* key : {"kiln_receipt", "vllm_receipt"}) {
    fs::path name = fs::path(source[key]["path"].get<std::string>()).filename();
    if (ec || !fs::is_regular_file(beside / name, ec)) {
      err_ << "assay: the receipts " << o_.file
           << " names are not beside it; they are not checked (give --receipts DIR)\n";
      return "";
    }
  }
  return beside.lexically_normal().string();
}

namespace {

// `body` with "numerics": {} added when it is a next-token request without one (--numerics).
std::string with_numerics(const std::string& file, const std::string& body) {
  Json doc;
  try {
    doc = common::parse_strict(body, {.max_bytes = common::kMaxRequestBytes});
  } catch (const common::Error& e) {
    throw ExitWith{kExitInvalidInput, file + ": " + e.what() + " [" + e.code() + "]"};
  }
  const std::string schema = doc.is_object() ? doc.value("schema", "") : "";
  if (schema != protocol::kNextTokenRequest && schema != protocol::kKilnNextTokenRequest)
    throw ExitWith{kExitUsage, "--numerics applies to a next-token request; " + file + " is " +
                                   (schema.empty() ? "not one" : schema)};
  if (!doc.contains("numerics")) doc["numerics"] = Json::object();
  return doc.dump();
}

}  // namespace

int Cli::submit(std::string_view only) {
  std::string body = read_local(o_.file, common::kMaxRequestBytes, "the request");
  bool fidelity = false;
  std::string request_sha256;
  if (o_.batch && o_.numerics)
    throw ExitWith{kExitUsage, "--numerics applies to one next-token request, not --batch"};
  if (o_.batch) {
    try {
      BatchDocument b = batch_from_jsonl(body, fs::path(o_.file).stem().string());
      body = std::move(b.body);
      request_sha256 = b.request_sha256;
    } catch (const common::Error& e) {
      throw ExitWith{kExitInvalidInput, o_.file + ": " + e.what() + " [" + e.code() + "]"};
    }
  } else {
    if (o_.numerics) body = with_numerics(o_.file, body);
    request_sha256 = check_request_file(o_.file, body, fidelity);
  }
  // Valid once checked.
  const std::string schema_name =
      common::parse_strict(body, {.max_bytes = common::kMaxRequestBytes}).value("schema", "");
  const bool trajectory = schema_name == common::kTrajectoryRequest;
  const bool layer = schema_name == common::kLayerRequest;
  const bool batch = schema_name == protocol::kNextTokenBatchRequest;
  if (schema_name == common::kAuditRequest && !o_.model.empty())
    throw ExitWith{kExitUsage,
                   "--model does not apply to an engine-audit request: it has model_dir"};
  std::string_view schema = trajectory ? common::kTrajectoryRequest
                            : layer    ? common::kLayerRequest
                            : fidelity ? protocol::kFidelityRequest
                                       : std::string_view{};
  if (!only.empty() && schema != only)
    throw ExitWith{kExitInvalidInput, o_.file + " is not an " + std::string(only) +
                                          " request; submit it with `assay submit`"};
  if ((trajectory || layer) && !o_.model.empty())
    throw ExitWith{kExitUsage, std::string("--model does not apply to a ") +
                                   (layer ? "layer-attribution" : "trajectory") +
                                   " request: it has model_dir"};
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
  if (std::string dir = receipts_dir(body, schema_name); !dir.empty())
    target += std::string(target.find('?') == std::string::npos ? "?" : "&") +
              "receipts_dir=" + url_encode(dir);
  if (o_.retry)
    target += std::string(target.find('?') == std::string::npos ? "?" : "&") + "retry=1";
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
             : layer      ? "layer-attribution job "
             : batch      ? "batch job "
                          : "job ")
         << id << " (" << state << ")  request " << request_sha256 << "\n";
  }
  return kExitOk;
}

// The job's final status: print it and turn it into the exit status.
int Cli::finished(const Json& job) {
  bool ok = state_is_success(job_state(job));
  // A fidelity job's gates decide its exit status, with --json too (CI gates on it).
  const bool fidelity = ok && job.value("request_schema", "") == protocol::kFidelityRequest;
  // --decide: a next-token job or batch whose verdict is "neither" is no decision (exit 12).
  auto decided = [&] {
    if (!ok) return static_cast<int>(kExitJobFailed);
    const std::string s = job.value("request_schema", "");
    if (!o_.decide || s == protocol::kFidelityRequest || s == common::kTrajectoryRequest ||
        s == common::kLayerRequest || s == common::kAuditRequest)
      return static_cast<int>(kExitOk);
    return decision_status(api_.get_json(job_path(job_id(job), "result")));
  };
  if (o_.json) {
    print_json(job);
    if (fidelity) return gates_status(api_.get_json(job_path(job_id(job), "result")));
  } else {
    Json shown = job;
    if (fidelity) {
      Json result = api_.get_json(job_path(job_id(job), "result"));
      out_ << describe_job(shown) << "\n" << fidelity_report(result);
      return gates_status(result);
    }
    if (ok && job.value("request_schema", "") == protocol::kNextTokenBatchRequest) {
      out_ << describe_job(shown) << "\n"
           << batch_report(api_.get_json(job_path(job_id(job), "result")));
      return decided();
    }
    if (ok && job.value("request_schema", "") == common::kTrajectoryRequest) {
      out_ << describe_job(shown) << "\n"
           << trajectory_report(api_.get_json(job_path(job_id(job), "result")));
      return kExitOk;
    }
    if (ok && job.value("request_schema", "") == common::kLayerRequest) {
      out_ << describe_job(shown) << "\n"
           << layer_report(api_.get_json(job_path(job_id(job), "result")));
      return kExitOk;
    }
    if (ok) shown = with_verdict(std::move(shown));
    out_ << describe_job(shown);
  }
  return decided();
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
    out_ << describe_job(state_is_success(job_state(job)) ? with_verdict(job) : job);
  if (o_.decide && state_is_success(job_state(job)) && !job.contains("batch"))
    return decision_status(api_.get_json(job_path(o_.id, "result")));
  return kExitOk;
}

Json Cli::with_verdict(Json job) {
  // The verdict lives in the result: shown with the status so that the answer is there.
  const std::string schema = job.value("request_schema", "");
  if (schema == protocol::kFidelityRequest || schema == common::kTrajectoryRequest ||
      schema == common::kLayerRequest || job.contains("batch"))
    return job;  // their results have their own `show`; a batch's state has its own result
  Json result = api_.get_json(job_path(job_id(job), "result"));
  for (const char* k : {"verdict", "result_sha256"})
    if (result.contains(k)) job[k] = result[k];
  if (result.contains("numerics") && result["numerics"].is_object())
    job["numerics"] = result["numerics"].value("verdict", Json());
  // An engine audit's answer: its class and the figures behind it, in words.
  if (schema == common::kAuditRequest && result.contains("statistics") &&
      result["statistics"].is_object())
    job["audit"] = result["statistics"];
  return job;
}

int Cli::list() {
  std::string target = "/v1/jobs";
  if (!o_.state.empty()) target += "?state=" + url_encode(o_.state);
  Json doc = api_.get_json(target);
  if (o_.json) {
    print_json(doc);
    return kExitOk;
  }
  // A batch's states are jobs of their own; a sweep's hundreds of them hide the rest.
  std::size_t hidden = 0;
  if (!o_.parts && doc.contains("jobs") && doc["jobs"].is_array()) {
    Json kept = Json::array();
    for (const Json& job : doc["jobs"]) {
      if (job.is_object() && job.contains("batch"))
        ++hidden;
      else
        kept.push_back(job);
    }
    doc["jobs"] = std::move(kept);
  }
  out_ << jobs_table(doc);
  if (hidden > 0)
    out_ << "(" << hidden << " states of batch jobs not shown; `assay list --parts` shows them)\n";
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

int Cli::request_check() {
  std::string text = read_local(o_.file, common::kMaxRequestBytes, "the request");
  bool fidelity = false;
  Json report;
  check_request_file(o_.file, text, fidelity, &report);
  if (!o_.receipts.empty()) report["receipts"] = check_receipts_locally(text);
  out_ << report.dump(o_.json ? -1 : 2) << "\n";
  return kExitOk;
}

namespace {

// Each non-blank line of FILE ('-': standard input) as one JSON object, handed to `each`, whose
// output line is printed; an error names the file and line (exit kExitInvalidInput).
void each_json_line(const std::string& file, const char* what, const char* code, std::ostream& out,
                    const std::function<Json(const Json&)>& each) {
  std::string text;
  if (file == "-")
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  else
    text = read_local(file, 1u << 30, what);
  std::size_t line_no = 0, start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + start, end - start);
    start = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    try {
      Json doc = common::parse_strict(line, {.max_bytes = 64u << 20});
      if (!doc.is_object()) throw common::Error(code, "not a JSON object");
      out << each(doc).dump() << "\n";
    } catch (const common::Error& e) {
      throw ExitWith{kExitInvalidInput, file + " line " + std::to_string(line_no) + ": " +
                                            e.what() + " [" + e.code() + "]"};
    }
  }
}

}  // namespace

int Cli::numerics_classify() {
  each_json_line(o_.file, "the envelopes", "numerics.invalid", out_, [](const Json& doc) {
    return common::numerics_verdict(
        doc.value("members", Json()), doc.value("candidates", Json()), doc.value("fp32", Json()),
        common::numerics_policy(doc.value("policy", Json::object()), "policy"));
  });
  return kExitOk;
}

int Cli::numerics_audit() {
  each_json_line(o_.file, "the audits", "audit.invalid", out_, [](const Json& doc) {
    return common::audit_statistics(doc.value("members", Json()), doc.value("contexts", Json()),
                                    common::audit_policy(doc.value("policy", Json()), "policy"));
  });
  return kExitOk;
}

// `request check --receipts DIR`: the checks assayd makes at submission, offline, on the files
// in DIR (read without following a link; a FIFO or device is refused).
Json Cli::check_receipts_locally(const std::string& text) {
  auto request =
      common::validate_request(common::parse_strict(text, {.max_bytes = common::kMaxRequestBytes}));
  if (request.kind != common::RequestKind::kKiln)
    throw ExitWith{kExitUsage, "--receipts applies to a Kiln request only; " + o_.file + " is " +
                                   request.schema};
  std::vector<common::ReceiptReport> reports;
  for (const auto& slot : common::receipt_slots()) {
    fs::path file = fs::path(o_.receipts) /
                    fs::path(request.source[slot.key]["path"].get<std::string>()).filename();
    try {
      reports.push_back(common::check_kiln_receipt(
          request, slot, common::read_file(file, common::kMaxReceiptBytes)));
    } catch (const common::Error& e) {
      throw ExitWith{kExitInvalidInput, file.string() + ": " + e.what() + " [" + e.code() + "]"};
    }
  }
  return common::receipts_checked(reports);
}

}  // namespace assay::client::cli
