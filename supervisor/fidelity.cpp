// Fidelity jobs: KL(reference || candidate) over a panel of contexts.
//
// Pipeline, each worker contained like a next-token job's: fingerprint the reference (and a
// candidate checkpoint), capture the reference's logits at every scored position with
// `assay-oracle capture` (again in a second run for reproduction_confirmation, and for a
// candidate checkpoint), compare with `assay-compare run` in fp64, then seal and sign the
// receipt `assay.fidelity-result.v1`. Capture files move from one worker's workspace into the
// next one's, since a worker sees no other part of the state directory.
#include <algorithm>
#include <thread>

#include <grp.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fidelity.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "supervisor/evidence.h"
#include "supervisor/service.h"

#ifndef ASSAY_VERSION
#define ASSAY_VERSION "0.0.0"
#endif

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr const char* kCompareRole = "compare";

// Whether the peer could itself read `path` (and search every directory above it): assayd and
// its workers may be able to read files the submitting user cannot, and must not read them on
// that user's behalf.
bool peer_can_read(const std::string& path, const Peer& peer) {
  if (peer.admin) return true;
  std::vector<gid_t> groups(64);
  if (struct passwd* pw = ::getpwuid(peer.uid)) {
    int n = static_cast<int>(groups.size());
    if (::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n) < 0) {
      groups.resize(static_cast<std::size_t>(n));
      ::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n);
    }
    groups.resize(static_cast<std::size_t>(std::max(n, 0)));
  } else {
    groups.clear();
  }
  groups.push_back(peer.gid);
  auto allowed = [&](const struct stat& st, mode_t user_bit, mode_t group_bit, mode_t other_bit) {
    if (st.st_uid == peer.uid) return (st.st_mode & user_bit) != 0;
    if (std::find(groups.begin(), groups.end(), st.st_gid) != groups.end())
      return (st.st_mode & group_bit) != 0;
    return (st.st_mode & other_bit) != 0;
  };
  fs::path p(path);
  struct stat st {};
  for (fs::path dir = p.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    if (::stat(dir.c_str(), &st) != 0 || !allowed(st, S_IXUSR, S_IXGRP, S_IXOTH)) return false;
    if (dir == dir.root_path()) break;
  }
  return ::stat(p.c_str(), &st) == 0 && allowed(st, S_IRUSR, S_IRGRP, S_IROTH);
}

void check_candidate_file(const common::CandidateLogitsFile& f, std::size_t index,
                          const Peer& peer) {
  std::string where = "request.candidate.logits[" + std::to_string(index) + "].path \"" + f.path +
                      "\"";
  struct stat st {};
  if (::lstat(f.path.c_str(), &st) != 0)
    throw Error("request.bad_logits_file", where + " does not exist");
  if (S_ISLNK(st.st_mode)) throw Error("request.bad_logits_file", where + " is a symlink");
  if (!S_ISREG(st.st_mode)) throw Error("request.bad_logits_file", where + " is not a regular file");
  if (!peer_can_read(f.path, peer))
    throw Error("request.bad_logits_file",
                where + " is not readable by uid " + std::to_string(peer.uid) + ", who submitted it");
}

Json capture_input(const std::string& model_dir, const common::FidelityRequest& r,
                   const std::string& device) {
  Json contexts = Json::array();
  for (const auto& c : r.panel)
    contexts.push_back(Json{{"id", c.id},
                            {"token_ids", c.token_ids},
                            {"positions", common::position_ranges_json(c.positions)}});
  return Json{{"schema", protocol::kOracleCaptureInput},
              {"model_dir", model_dir},
              {"contexts", contexts},
              {"block_positions", r.block_positions},
              {"execution",
               {{"device", device},
                {"dtype", execution_dtype(model_dir)},
                {"threads", static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))}}}};
}

// Checks a capture's output.json against what was asked; throws Error("worker.capture_output").
void check_capture_output(const Json& out, const common::FidelityRequest& r, std::int64_t vocab,
                          const std::string& side) {
  auto bad = [&](const std::string& m) {
    throw Error("worker.capture_output", side + " capture: " + m);
  };
  if (out.value("schema", "") != protocol::kOracleCaptureOutput)
    bad("output.json has schema " + out.value("schema", std::string("(none)")));
  if (out.value("vocab_size", std::int64_t{-1}) != vocab)
    bad("vocab_size " + out.value("vocab_size", Json()).dump() + ", expected " +
        std::to_string(vocab));
  const Json& caps = common::require(out, "captures", "capture output");
  if (!caps.is_array() || caps.size() != r.panel.size())
    bad("captures for " + std::to_string(caps.size()) + " contexts, expected " +
        std::to_string(r.panel.size()));
  for (std::size_t i = 0; i < caps.size(); ++i) {
    const Json& c = caps[i];
    if (c.value("id", "") != r.panel[i].id ||
        c.value("scored_positions", std::int64_t{-1}) != r.panel[i].scored ||
        c.value("file", "") != "capture-" + std::to_string(i) + ".safetensors" ||
        !common::is_identity(c.value("logits_sha256", "")))
      bad("captures[" + std::to_string(i) + "] does not match context \"" + r.panel[i].id +
          "\": " + c.dump().substr(0, 300));
  }
}

// The receipt's view of one capture run: what ran, how, and the digest of every context.
Json capture_section(const Json& out, const Json& evidence) {
  Json section = out;
  for (const char* k : {"schema", "peak_rss_bytes"}) section.erase(k);
  for (Json& c : section["captures"]) c.erase("file");
  section["process"] = evidence;
  return section;
}

std::vector<std::string> capture_digests(const Json& out) {
  std::vector<std::string> d;
  for (const Json& c : out["captures"]) d.push_back(c["logits_sha256"].get<std::string>());
  return d;
}

}  // namespace

Job Service::accept_fidelity(const Json& document, const Peer& peer) {
  common::FidelityRequest r = common::validate_fidelity_request(document);
  std::string ref_dir = check_model_dir(r.reference.model_dir);
  std::int64_t vocab = read_vocab_size(ref_dir);
  r.check_vocab(vocab);
  if (auto max_positions = read_max_positions(ref_dir)) r.check_context_length(*max_positions);
  if (r.candidate_model) {
    std::string cand_dir = check_model_dir(r.candidate_model->model_dir);
    std::int64_t cand_vocab = read_vocab_size(cand_dir);
    if (cand_vocab != vocab)
      throw Error("request.vocab_mismatch",
                  "the candidate checkpoint " + cand_dir + " has vocab_size " +
                      std::to_string(cand_vocab) + " but the reference " + ref_dir + " has " +
                      std::to_string(vocab) + "; KL needs the same vocabulary");
  }
  for (std::size_t i = 0; i < r.candidate_logits.size(); ++i)
    check_candidate_file(r.candidate_logits[i], i, peer);
  Job job;
  job.key = common::sha256_canonical_id(
      Json{{"request_sha256", r.request_sha256}, {"kind", "fidelity"}});
  job.request_sha256 = r.request_sha256;
  job.request_schema = r.schema;
  job.request_id = r.id;
  job.model_dir = ref_dir;
  return job;
}

const common::FidelityRequest& Service::fidelity_request(const std::string& id) {
  auto it = fidelity_requests_.find(id);
  if (it == fidelity_requests_.end()) {
    auto r = common::validate_fidelity_request(
        common::parse_strict(common::read_file(store_.job_dir(id) / "request.json", 64 << 20)));
    it = fidelity_requests_.emplace(id, std::move(r)).first;
  }
  return it->second;
}

std::uint64_t Service::fidelity_required_bytes(const Job& job) {
  // The workers run one after another: the larger checkpoint sets the need.
  std::uint64_t need = estimate_required_bytes(job.model_dir);
  const common::FidelityRequest& r = fidelity_request(job.id);
  if (r.candidate_model)
    need = std::max(need, estimate_required_bytes(r.candidate_model->model_dir));
  return need;
}

void Service::fidelity_start(const std::string& id) {
  const common::FidelityRequest& r = fidelity_request(id);
  Json& s = scratch_[id];
  s["limits"] = r.document.value("limits", Json::object());
  s["vocab_size"] = read_vocab_size(r.reference.model_dir);
  Json plan = Json::array({"fingerprint-reference"});
  if (r.candidate_model) plan.push_back("fingerprint-candidate");
  plan.push_back("capture-reference");
  if (r.reproduction_confirmation) plan.push_back("capture-reproduction");
  if (r.candidate_model) plan.push_back("capture-candidate");
  plan.push_back(kCompareRole);
  s["plan"] = plan;
  s["fidelity"] = Json::object();
  fidelity_next(id);
}

void Service::fidelity_next(const std::string& id) {
  Json& plan = scratch_[id]["plan"];
  if (plan.empty()) return fidelity_finish(id);
  std::string step = plan[0].get<std::string>();
  plan.erase(plan.begin());
  if (step.rfind("fingerprint-", 0) == 0) return fidelity_fingerprint(id, step.substr(12));
  if (step.rfind("capture-", 0) == 0) return fidelity_capture(id, step.substr(8));
  return fidelity_compare(id);
}

void Service::fidelity_fingerprint(const std::string& id, const std::string& side) {
  const common::FidelityRequest& r = fidelity_request(id);
  const common::ModelSide& m = side == "reference" ? r.reference : *r.candidate_model;
  std::string name = m.model_identity ? (*m.model_identity)["id"].get<std::string>()
                                      : fs::path(m.model_dir).filename().string();
  Json input{{"schema", protocol::kFingerprintInput},
             {"model_dir", m.model_dir},
             {"id", name},
             {"threads", config_.fingerprint_threads}};
  std::optional<Json> expected = m.model_identity;
  start_worker(id, "fingerprint-" + side, config_.fingerprint_worker, "run", input,
               [this, id, side, expected](Json output) {
                 if (output.value("schema", "") != protocol::kFingerprintOutput)
                   throw Error("worker.fingerprint_output",
                               "fingerprint output.json has schema " +
                                   output.value("schema", std::string("(none)")));
                 const Json& identity =
                     common::require(output, "model_identity", "fingerprint output");
                 if (expected && (*expected)["content_sha256"] != identity["content_sha256"])
                   throw Error("job.identity_mismatch",
                               "the " + side + " model directory's identity " +
                                   identity["content_sha256"].get<std::string>() +
                                   " differs from the request's expected identity " +
                                   (*expected)["content_sha256"].get<std::string>());
                 scratch_[id]["fidelity"]["fingerprint-" + side] = std::move(output);
                 fidelity_next(id);
               });
}

void Service::fidelity_capture(const std::string& id, const std::string& side) {
  const common::FidelityRequest& r = fidelity_request(id);
  const std::string& dir =
      side == "candidate" ? r.candidate_model->model_dir : r.reference.model_dir;
  std::int64_t vocab = scratch_[id]["vocab_size"].get<std::int64_t>();
  start_worker(id, "capture-" + side, config_.oracle_worker, "capture",
               capture_input(dir, r, config_.oracle_device), [this, id, side, vocab](Json output) {
                 check_capture_output(output, fidelity_request(id), vocab, side);
                 scratch_[id]["fidelity"]["capture-" + side] = std::move(output);
                 fidelity_next(id);
               });
}

void Service::fidelity_compare(const std::string& id) {
  fs::path dir = store_.job_dir(id);
  const common::FidelityRequest& r = fidelity_request(id);
  fs::path ws = dir / kCompareRole;
  const Json& f = scratch_[id]["fidelity"];
  std::vector<std::pair<fs::path, std::string>> move_in;
  Json contexts = Json::array();
  auto take = [&](const std::string& side, std::size_t i) {
    std::string name = side + "-" + std::to_string(i) + ".safetensors";
    move_in.emplace_back(dir / ("capture-" + side) / ("capture-" + std::to_string(i) + ".safetensors"),
                         name);
    return Json{{"path", (ws / name).string()}, {"sha256", nullptr}};
  };
  for (std::size_t i = 0; i < r.panel.size(); ++i) {
    Json c{{"id", r.panel[i].id},
           {"positions", common::position_ranges_json(r.panel[i].positions)},
           {"reference", take("reference", i)}};
    if (r.candidate_model)
      c["candidate"] = take("candidate", i);
    else
      c["candidate"] = Json{{"path", r.candidate_logits[i].path},
                            {"sha256", r.candidate_logits[i].sha256}};
    if (f.contains("capture-reproduction")) c["reproduction"] = take("reproduction", i);
    contexts.push_back(std::move(c));
  }
  Json input{{"schema", protocol::kCompareInput},
             {"vocab_size", scratch_[id]["vocab_size"]},
             {"kl_file", common::kKlArtifactFileName},
             {"contexts", contexts}};
  start_worker(
      id, kCompareRole, config_.compare_worker, "run", input,
      [this, id](Json output) {
        const common::FidelityRequest& r = fidelity_request(id);
        if (output.value("schema", "") != protocol::kCompareOutput)
          throw Error("worker.compare_output", "compare output.json has schema " +
                                                   output.value("schema", std::string("(none)")));
        // The comparison read the very bytes the captures wrote and the user named.
        const Json& f = scratch_[id]["fidelity"];
        const Json& ctx = common::require(output, "contexts", "compare output");
        if (!ctx.is_array() || ctx.size() != r.panel.size())
          throw Error("worker.compare_output", "compare output covers " +
                                                   std::to_string(ctx.size()) + " contexts, not " +
                                                   std::to_string(r.panel.size()));
        auto ref = capture_digests(f["capture-reference"]);
        auto cand = r.candidate_model ? capture_digests(f["capture-candidate"])
                                      : std::vector<std::string>{};
        auto repro = f.contains("capture-reproduction")
                         ? capture_digests(f["capture-reproduction"])
                         : std::vector<std::string>{};
        for (std::size_t i = 0; i < r.panel.size(); ++i) {
          auto mismatch = [&](const std::string& what, const Json& got, const std::string& want) {
            if (got != Json(want))
              throw Error("worker.compare_output",
                          "context \"" + r.panel[i].id + "\": the comparison read " + what + " " +
                              got.dump() + " but " + want + " was captured or named");
          };
          mismatch("reference logits", ctx[i].value("reference_sha256", Json()), ref[i]);
          if (r.candidate_model)
            mismatch("candidate logits", ctx[i].value("candidate_sha256", Json()), cand[i]);
          else
            mismatch("candidate file", ctx[i].value("candidate_file_sha256", Json()),
                     r.candidate_logits[i].sha256);
          if (!repro.empty())
            mismatch("reproduction logits",
                     ctx[i].value("reproduction", Json::object()).value("sha256", Json()),
                     repro[i]);
        }
        scratch_[id]["fidelity"]["compare"] = std::move(output);
        fidelity_next(id);
      },
      move_in);
}

void Service::fidelity_finish(const std::string& id) {
  Job* job = store_.find(id);
  set_phase(*job, "assembling", "assembling and signing the receipt");
  fs::path dir = store_.job_dir(id);
  const common::FidelityRequest& r = fidelity_request(id);
  Json& s = scratch_[id];
  const Json& f = s["fidelity"];
  const Json& cmp = f["compare"];

  fs::path artifact = dir / common::kKlArtifactFileName;
  fs::path artifact_src = dir / kCompareRole / common::kKlArtifactFileName;
  std::error_code ec;
  fs::rename(artifact_src, artifact, ec);
  if (ec)
    throw Error("job.artifact", "cannot move the comparison's KL vector " + artifact_src.string() +
                                    ": " + ec.message());
  ::chmod(artifact.c_str(), 0600);
  std::string artifact_sha = common::sha256_file_id(artifact);
  if (cmp.value("kl_file_sha256", "") != artifact_sha)
    throw Error("worker.compare_output", "the KL vector hashes to " + artifact_sha +
                                             ", the comparison reported " +
                                             cmp.value("kl_file_sha256", Json()).dump());
  auto artifact_bytes = fs::file_size(artifact);

  auto model_block = [&](const std::string& side) {
    const Json& fp = f["fingerprint-" + side];
    return Json{{"model_dir", side == "reference" ? r.reference.model_dir
                                                  : r.candidate_model->model_dir},
                {"model_identity", fp["model_identity"]},
                {"model_fingerprint",
                 {{"implementation_sha256", fp.value("implementation_sha256", Json(nullptr))},
                  {"process", s["fingerprint-" + side + "_evidence"]}}},
                {"capture", capture_section(f["capture-" + side], s["capture-" + side + "_evidence"])}};
  };
  Json candidate;
  if (r.candidate_model) {
    candidate = model_block("candidate");
    candidate["kind"] = "model";
  } else {
    Json files = Json::array();
    for (std::size_t i = 0; i < r.candidate_logits.size(); ++i)
      files.push_back(Json{{"context", r.panel[i].id},
                           {"path", r.candidate_logits[i].path},
                           {"file_sha256", r.candidate_logits[i].sha256},
                           {"logits_sha256", cmp["contexts"][i].value("candidate_sha256", Json())},
                           {"dtype", cmp["contexts"][i].value("candidate_dtype", Json())}});
    candidate = Json{{"kind", "logits"}, {"model_identity", nullptr}, {"logits_files", files}};
  }
  candidate["label"] = r.candidate_label.empty() ? Json(nullptr) : Json(r.candidate_label);

  Json reproduction = nullptr;
  if (f.contains("capture-reproduction")) {
    reproduction = cmp.value("reproduction", Json(nullptr));
    if (reproduction.is_object())
      reproduction["capture"] =
          capture_section(f["capture-reproduction"], s["capture-reproduction_evidence"]);
  }

  Json panel_contexts = Json::array();
  for (const auto& c : r.panel)
    panel_contexts.push_back(Json{{"id", c.id},
                                  {"token_count", c.token_ids.size()},
                                  {"input_token_ids_sha256", common::token_ids_sha256(c.token_ids)},
                                  {"positions", common::position_ranges_json(c.positions)},
                                  {"scored_positions", c.scored}});
  Json result{
      {"schema", protocol::kFidelityResult},
      {"created_at_utc", now_rfc3339()},
      {"duration_seconds", now_unix() - s["started_unix"].get<double>()},
      {"job_id", id},
      {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", key_.key_id()}}},
      {"request",
       {{"schema", r.schema},
        {"id", r.id},
        {"sha256", r.request_sha256},
        {"panel_sha256", r.panel_sha256},
        {"reproduction_confirmation", r.reproduction_confirmation},
        {"block_positions", r.block_positions}}},
      {"panel",
       {{"contexts", panel_contexts},
        {"scored_positions", r.scored_positions()},
        {"vocab_size", s["vocab_size"]}}},
      {"reference", model_block("reference")},
      {"candidate", candidate},
      {"reproduction", reproduction},
      {"comparison",
       {{"metrics", cmp["metrics"]},
        {"contexts", cmp["contexts"]},
        {"histogram", cmp.value("histogram", Json(nullptr))},
        {"positions", cmp.value("positions", Json(nullptr))},
        {"seconds", cmp.value("seconds", Json(nullptr))},
        {"process", s[std::string(kCompareRole) + "_evidence"]}}},
      {"containment",
       {{"host_memory", s["host_memory"]},
        {"backend", runtime_->backend()},
        {"network",
         s["capture-reference_evidence"].value("network", Json(nullptr)).is_null()
             ? Json("host")
             : s["capture-reference_evidence"]["network"]}}},
      {"kl_artifact",
       {{"name", common::kKlArtifactFileName},
        {"bytes", artifact_bytes},
        {"sha256", artifact_sha}}}};
  std::string result_bytes = common::seal_result(result);
  Json statement = common::make_statement(protocol::kFidelityPredicateType, result_bytes,
                                          common::kKlArtifactFileName, artifact_sha);
  Json envelope = common::dsse_sign(common::kInTotoPayloadType, common::canonical(statement), key_);
  CommitFiles files{{{std::string(common::kResultFileName), result_bytes},
                     {std::string(common::kEnvelopeFileName), common::canonical(envelope) + "\n"}},
                    {artifact}};
  const Json& kl = cmp["metrics"]["kl"];
  char summary[160];
  std::snprintf(summary, sizeof summary, "succeeded: mean KL %.6g, max %.6g, top-1 agreement %.6g",
                kl.value("mean", 0.0), kl.value("max", 0.0),
                cmp["metrics"].value("top1_agreement", 0.0));
  finish(*job, JobState::kSucceeded, summary, std::nullopt, files);
  release_slot(id);
}

}  // namespace assay::supervisor
