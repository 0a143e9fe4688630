// The `assay` commands about trust and the daemon itself: verify (offline with --pubkey, else
// with the key assayd's /v1/info gives), keys, health, info, and `fingerprint --refresh`, which
// makes assayd forget a model directory's cached digests.
#include <filesystem>

#include "client/cli_internal.h"
#include "client/format.h"
#include "client/verify.h"
#include "common/error.h"
#include "common/json.h"

namespace assay::client::cli {

using common::Json;
namespace fs = std::filesystem;

int Cli::verify() {
  if (o_.kiln) {
    if (!o_.envelope.empty() || !o_.pubkey.empty())
      throw ExitWith{kExitUsage,
                     "--kiln checks a Kiln record (and its --artifact): --envelope and --pubkey "
                     "do not apply, Kiln's records are not signed"};
    VerifyReport report;
    try {
      report = verify_kiln(
          o_.file, o_.artifact.empty() ? std::nullopt : std::optional<fs::path>(o_.artifact),
          o_.numerics_file.empty() ? std::nullopt : std::optional<fs::path>(o_.numerics_file));
    } catch (const common::Error& e) {
      throw ExitWith{kExitInvalidInput, std::string(e.what()) + " [" + e.code() + "]"};
    }
    if (report.not_checked_kind) {
      if (o_.json)
        print_json(report.to_json());
      else
        out_ << "NOT CHECKED (Kiln record): " << o_.file << " is a " << *report.not_checked_kind
             << " record, a kind assay does not check (it checks Kiln's next-token and "
                "layer-attribution results); neither verified nor refused\n";
      return kExitNotChecked;
    }
    if (o_.json) {
      print_json(report.to_json());
    } else {
      out_ << checks_table(report);
      out_ << (report.ok() ? "verified (Kiln record): " : "NOT VERIFIED (Kiln record): ") << o_.file
           << "\n";
    }
    return report.ok() ? kExitOk : kExitVerifyFailed;
  }
  if (!o_.numerics_file.empty())
    throw ExitWith{kExitUsage, "--numerics applies to --kiln: an assay result carries its own"};
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

}  // namespace assay::client::cli
