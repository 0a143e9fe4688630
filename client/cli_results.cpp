// The `assay` commands that fetch what a finished job produced: result (the exact bytes, or the
// file and its DSSE envelope beside it), artifact, `fidelity show` / `trajectory show` /
// `layer show` (the job's report for people) and report (a result file as self-contained HTML).
#include <filesystem>
#include <optional>

#include "client/batch.h"
#include "client/cli_internal.h"
#include "client/format.h"
#include "client/kiln_export.h"
#include "client/report.h"
#include "client/verify.h"
#include "common/audit.h"
#include "common/error.h"
#include "common/json.h"
#include "common/layers.h"
#include "common/protocol.h"
#include "common/trajectory.h"

namespace assay::client::cli {

using common::Json;
namespace fs = std::filesystem;

int Cli::result() {
  Response r = api_.request("GET", job_path(o_.id, "result"));
  if (o_.format == "kiln-v2") return kiln_v2(r.body);
  if (o_.output.empty()) {
    if (env_.stdout_is_tty && !o_.json) {
      // For eyes: indented (the signed bytes are what -o writes, or a pipe gets).
      out_ << common::parse_strict(r.body).dump(2) << "\n";
      return kExitOk;
    }
    out_ << r.body;  // the exact bytes: `assay result ID > r.json` stays verifiable
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

// `assay result ID --format kiln-v2`: Kiln's record, or the list of fields it would get wrong.
int Cli::kiln_v2(const std::string& body) {
  KilnExportOptions options;
  if (!o_.contract_path.empty()) options.contract_path = o_.contract_path;
  KilnExport record;
  try {
    record = kiln_v2_record(common::parse_strict(body), options);
  } catch (const common::Error& e) {
    throw ExitWith{kExitUsage, std::string(e.what()) + " [" + e.code() + "]"};
  }
  if (!record.writable()) {
    err_ << "assay: Kiln's v2 record of job " << o_.id
         << " not written: " << record.false_fields.size()
         << " of its fields would not be facts of the run:\n";
    for (const auto& f : record.false_fields) err_ << "  " << f << "\n";
    return kExitNotAFact;
  }
  std::string text = kiln_file_text(record.record);
  if (o_.output.empty()) {
    out_ << text;
    if (!record.numerics.is_null())
      err_ << "assay: the result has a numerics envelope, assay's addition to Kiln's record: "
              "-o FILE writes it beside the record\n";
  } else {
    save(o_.output, text);
    if (!o_.json) out_ << "wrote " << o_.output << " (" << text.size() << " bytes)\n";
    if (!record.numerics.is_null()) {
      // Beside Kiln's record, which admits no field of assay's: `assay verify --kiln` reads it.
      const std::string beside = kiln_numerics_path(o_.output).string();
      std::string addendum = record.numerics.dump(2) + "\n";
      save(beside, addendum);
      if (!o_.json)
        out_ << "wrote " << beside << " (" << addendum.size()
             << " bytes: assay's numerics envelope, bound to the record)\n";
    }
  }
  return kExitOk;
}

int Cli::artifact() {
  Response r = api_.request("GET", job_path(o_.id, "artifact"));
  save(o_.output, r.body);
  if (!o_.json) out_ << "wrote " << o_.output << " (" << r.body.size() << " bytes)\n";
  return kExitOk;
}

// `assay fidelity show` / `trajectory show` / `layer show`: the job while it is not done, then its
// result as `report` renders it (or as JSON).
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
  if (o_.decide && decision_status(result) != kExitOk) return decision_status(result);
  return gates_status(result);
}

int decision_status(const Json& result) {
  using common::member;
  if (member(result, "schema") == protocol::kNextTokenResult)
    return member(member(result, "verdict"), "argmax_candidate") == "neither" ? kExitNoDecision
                                                                              : kExitOk;
  if (member(result, "schema") == protocol::kNextTokenBatchResult) {
    const Json& n = member(member(member(result, "counts"), "argmax_candidate"), "neither");
    return n.is_number_integer() && n.get<std::int64_t>() > 0 ? kExitNoDecision : kExitOk;
  }
  return kExitOk;
}

int gates_status(const Json& result) {
  const Json& gates = common::member(result, "gates");
  return common::member(gates, "status") == "failed" ? kExitGateFailed : kExitOk;
}

int Cli::show() {
  Json job = api_.get_json(job_path(o_.id));
  const std::string schema = job.value("request_schema", "");
  std::string (*report)(const Json&) = &next_token_report;
  if (schema == protocol::kFidelityRequest) report = &fidelity_report;
  if (schema == common::kTrajectoryRequest) report = &trajectory_report;
  if (schema == common::kLayerRequest) report = &layer_report;
  if (schema == protocol::kNextTokenBatchRequest) report = &batch_report;
  if (schema == common::kAuditRequest) report = &describe_object;
  return show_result(schema, "", report);
}

int Cli::fidelity_show() {
  return show_result(protocol::kFidelityRequest, "fidelity", &fidelity_report);
}

int Cli::trajectory_show() {
  return show_result(common::kTrajectoryRequest, "trajectory", &trajectory_report);
}

int Cli::layer_show() {
  return show_result(common::kLayerRequest, "layer-attribution", &layer_report);
}

int Cli::report() {
  Json result;
  try {
    result = common::parse_strict(read_local(o_.file, 64 << 20, "the result"));
  } catch (const common::Error& e) {
    if (e.code().rfind("json.", 0) != 0) throw;
    throw ExitWith{kExitInvalidInput, o_.file + " is not JSON: " + e.what()};
  }
  // What the page may claim: checked first, refused when the record does not hold.
  VerifyInputs in;
  in.result = o_.file;
  if (!o_.envelope.empty())
    in.envelope = o_.envelope;
  else if (fs::exists(default_envelope_path(in.result)))
    in.envelope = default_envelope_path(in.result);
  if (!o_.pubkey.empty()) in.public_key = read_local(o_.pubkey, 64 * 1024, "the public key");
  VerifyReport checked;
  try {
    checked = verify_result(in);
  } catch (const common::Error& e) {
    throw ExitWith{kExitInvalidInput, std::string(e.what()) + " [" + e.code() + "]"};
  }
  // Without a key only what the record says of itself can be checked: its form, its self-hash
  // and the figures it recomputes from its own members; the signature's checks are skipped.
  auto intrinsic = [](const std::string& name) {
    return name.rfind("result", 0) == 0 || name.rfind("numerics.", 0) == 0 ||
           name.rfind("audit.", 0) == 0;
  };
  std::string failed;
  for (const Check& c : checked.checks)
    if (!c.ok && (!o_.pubkey.empty() || intrinsic(c.name)))
      failed += "\n  " + c.name + ": " + c.detail;
  std::string banner;
  if (!o_.pubkey.empty())
    banner =
        "Verified: the self-hash and every figure the record recomputes hold, and the "
        "signature verifies with the key in " +
        o_.pubkey + " (" + std::to_string(checked.checks.size()) + " checks).";
  else
    banner =
        "NOT VERIFIED: the self-hash holds, but no signature was checked (give --pubkey "
        "with assayd's key, from `assay keys`): anyone could have written this record.";
  std::optional<Prompt> prompt;
  const std::string schema = result.is_object() ? result.value("schema", std::string()) : "";
  if (!o_.request_file.empty() && schema != protocol::kNextTokenResult)
    throw ExitWith{kExitInvalidInput, "--request applies to a next-token result, not to " +
                                          o_.file + " (schema \"" + schema + "\")"};
  if (!o_.request_file.empty()) {
    try {
      prompt = load_prompt(result, o_.request_file,
                           o_.model.empty() ? std::nullopt : std::optional<fs::path>(o_.model));
    } catch (const common::Error& e) {
      if (e.code() == "client.report_request_invalid")
        throw ExitWith{kExitInvalidInput, std::string(e.what()) + "; no report written"};
      if (e.code() != "client.report_request") throw;
      throw ExitWith{kExitVerifyFailed, std::string(e.what()) + "; no report written"};
    }
  } else if (!o_.model.empty()) {
    throw ExitWith{kExitUsage, "--model " + o_.model + " needs --request (it decodes the prompt)"};
  }
  std::string html;
  try {
    html = render_report(result, fs::absolute(o_.file).parent_path(), banner, !o_.pubkey.empty(),
                         prompt ? &*prompt : nullptr);
  } catch (const common::Error& e) {
    if (e.code() != "client.report") throw;
    throw ExitWith{kExitInvalidInput, o_.file + ": " + e.what()};
  }
  // After the kind is known to have a page (another document is named as such), before saving.
  if (!failed.empty())
    throw ExitWith{kExitVerifyFailed, o_.file + " does not hold; no report written:" + failed};
  save(o_.output, html);
  out_ << "wrote " << o_.output << " (" << html.size() << " bytes; "
       << (o_.pubkey.empty() ? "self-hash checked, signature NOT checked" : "verified") << ")\n";
  return kExitOk;
}

}  // namespace assay::client::cli
