// How `assay` shows assayd's documents to people: tables, job lines, progress.
#pragma once

#include <optional>
#include <string>

#include "client/verify.h"
#include "common/json.h"

namespace assay::client {

std::string job_id(const common::Json& job);     // throws Error("client.bad_response")
std::string job_state(const common::Json& job);  // "" when absent
bool state_is_final(const std::string& state);
bool state_is_success(const std::string& state);

// Multi-line "key: value" description of a job, verdict first when there is one.
std::string describe_job(const common::Json& job);
// "key: value" lines for a flat object (health, info); nested values as compact JSON.
std::string describe_object(const common::Json& object);
// A table of jobs from GET /v1/jobs ({"jobs": [...]} or a bare array).
std::string jobs_table(const common::Json& jobs);
// A fidelity receipt (assay.fidelity-result.v1) for people: identities, the KL metric table,
// top-1 agreement, reproduction, a per-context table and a text histogram of token-wise KL.
std::string fidelity_report(const common::Json& result);
// A trajectory result as text: per engine its first departure (reference top-10 and margin
// there), which engine departed first, and the engines' first divergence with its attribution.
std::string trajectory_report(const common::Json& result);
// A layer-attribution result as text: the request, engine and reference lines, one row per
// boundary (bitwise yes/no/omitted, cosine, max and mean abs error, RMSE, reference RMS, relative
// RMSE, its growth, and with patching the patched argmax) with the first non-bitwise boundary,
// the first over tolerance, the largest growth and the patching bracket marked, then a summary.
std::string layer_report(const common::Json& result);

// A next-token result (assay.next-token-oracle-result.v1) for people: the verdict in words, the
// candidates (engine, token, text with control bytes escaped, logit, rank, gap to the argmax),
// the reference's top tokens, the margin, the model, and the oracle's device, times and memory,
// humanised; a numerics envelope's class when present.
std::string next_token_report(const common::Json& result);

// One line per check: "ok  name  detail" / "FAIL  name  detail".
std::string checks_table(const VerifyReport& report);
// "0.42s", "1m03s", "2h05m".
std::string format_seconds(double seconds);
// "512 B", "3.4 KiB", "62.3 MiB", "7.45 GiB" (powers of 1024).
std::string format_bytes(double bytes);
// "850 us", "37.1 ms", "1.23 s", then as format_seconds from a minute.
std::string format_duration(double seconds);

// The last known phase of a job, from its status document and its events.
struct Progress {
  std::string state, phase, detail;
  std::optional<double> fraction;  // 0..1, when the worker reports progress
  void update(const common::Json& status_or_event);
};
// "job ID  running  oracle  12.3s  45%  <detail>".
std::string progress_line(const std::string& id, const Progress& p, double elapsed_seconds);

// The public key PEM and key id from GET /v1/info.
std::optional<std::string> public_key_pem(const common::Json& info);
std::string key_id_of(const common::Json& info);

}  // namespace assay::client
