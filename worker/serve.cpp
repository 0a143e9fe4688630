#include "worker/serve.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <iostream>

#include <c10/util/Exception.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/time.h"
#include "common/worker_document.h"
#include "worker/batch.h"
#include "worker/loader.h"
#include "worker/model_files.h"
#include "worker/run.h"
#include "worker/runtime.h"
#include "worker/tokenizer.h"

namespace assay::oracle {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxMessage = 4096;

void send_message(int fd, const std::string& message) {
  ssize_t n;
  do {
    n = ::send(fd, message.data(), message.size(), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(message.size()))
    common::throw_errno("serve.control", "cannot send \"" + message + "\" to the supervisor",
                        errno);
}

// The next message, or nullopt once the supervisor closed its end.
std::optional<std::string> receive_message(int fd) {
  char buf[kMaxMessage];
  ssize_t n;
  do {
    n = ::recv(fd, buf, sizeof buf, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) common::throw_errno("serve.control", "cannot read the control socket", errno);
  if (n == 0) return std::nullopt;
  return std::string(buf, static_cast<std::size_t>(n));
}

bool plain_name(const std::string& name) {
  return !name.empty() && name.size() <= 200 && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

struct Resident {
  fs::path model_dir;
  Execution execution;
  ExecOptions options;
  std::unique_ptr<ModelFiles> files;
  std::unique_ptr<Tokenizer> tokenizer;
  LoadedModel loaded;
  Json bytes_used;
  std::string loaded_at;
  double load_seconds = 0;
  std::uint64_t jobs = 0;
};

// A job runs on this worker only with the worker's model and execution, and no descriptors.
void check_job_fits(const Resident& r, const fs::path& model_dir, bool names_fds,
                    const Execution& execution) {
  if (names_fds) throw Error("input.invalid", "a resident worker's job input names no model_fds");
  if (model_dir != r.model_dir)
    throw Error("input.invalid", "job model_dir \"" + model_dir.string() +
                                     "\" is not the resident worker's \"" + r.model_dir.string() +
                                     "\"");
  if (execution.device != r.execution.device || execution.dtype != r.execution.dtype ||
      execution.threads != r.execution.threads)
    throw Error("input.invalid", "job execution (" + execution.device + ", " + execution.dtype +
                                     ", " + std::to_string(execution.threads) +
                                     " threads) is not the resident worker's");
}

Json resident_fields(const Resident& r) {
  return Json{
      {"loaded_at", r.loaded_at}, {"load_seconds", r.load_seconds}, {"jobs_before", r.jobs}};
}

// One job in `dir`: a next-token job as run_next_token does it, or a batch as
// run_next_token_batch does it, on the loaded model.
void run_job(Resident& r, const fs::path& dir) {
  auto t0 = Clock::now();
  Json doc = common::parse_strict(common::read_file(dir / protocol::kInputFile, 256u << 20));
  if (doc.is_object() && doc.value("schema", Json()) == protocol::kOracleBatchInput) {
    OracleBatchInput in = parse_oracle_batch_input(doc);
    check_job_fits(r, in.model_dir, in.model_fds.has_value(), in.execution);
    run_batch_states(in, dir, r.options, r.loaded, *r.tokenizer,
                     Json{{"bytes_used", r.bytes_used}, {"load_seconds", 0.0}},
                     Json{{"resident", resident_fields(r)}}, t0);
    return;
  }
  OracleInput in = parse_oracle_input(doc);
  if (!in.unchanged_files.empty())
    throw Error("input.invalid",
                "input.json: unchanged_files names files to read, but a resident worker read "
                "its model when it loaded (their digests are in loaded.json)");
  check_job_fits(r, in.model_dir, in.model_fds.has_value(), in.execution);
  check_candidates(in.candidates, *r.tokenizer, r.loaded.model->vocab_size());
  check_prefix_texts(in.continuation_prefix, *r.tokenizer);
  Forward f = run_forward(in.model_dir, in.input_token_ids, r.options, r.loaded);
  Json out = next_token_output(dir, "logits.safetensors", in.input_token_ids, in.candidates, f,
                               r.options, r.loaded, *r.tokenizer);
  out["bytes_used"] = r.bytes_used;
  add_execution_report(out, r.options, r.execution.threads, f.attention, f.linear_attention);
  out["load_seconds"] = 0.0;
  out["forward_seconds"] = f.forward_seconds;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["duration_seconds"] = seconds_since(t0);
  out["resident"] = resident_fields(r);
  common::write_worker_document(dir / protocol::kOutputFile, out.dump(2) + "\n");
}

void write_error(const fs::path& dir, const std::string& code, const std::string& message) {
  std::cerr << "assay-oracle serve: " << dir.filename().string() << ": error [" << code
            << "]: " << message << "\n";
  common::atomic_write_file(dir / "error.json",
                            Json{{"code", code}, {"message", message}}.dump() + "\n");
}

}  // namespace

ServeInput parse_serve_input(const Json& doc) {
  const std::string where = "input.json";
  if (!doc.is_object()) throw Error("input.invalid", where + ": not an object");
  common::reject_unknown_fields(
      doc, {"schema", "model_dir", "model_fds", "execution", "control_fd"}, where);
  std::string schema = common::require_string(doc, "schema", where);
  if (schema != protocol::kOracleServeInput)
    throw Error("input.invalid", where + ": schema \"" + schema + "\" is not \"" +
                                     std::string(protocol::kOracleServeInput) + "\"");
  ServeInput in;
  in.model_dir = common::require_string(doc, "model_dir", where);
  if (!in.model_dir.is_absolute())
    throw Error("input.invalid",
                where + ": model_dir \"" + in.model_dir.string() + "\" must be an absolute path");
  in.model_fds = parse_optional_model_fds(doc, where);
  if (!in.model_fds) throw Error("input.invalid", where + ": a resident worker needs model_fds");
  in.execution = parse_execution(common::require(doc, "execution", where), where + " execution");
  const Json& fd = common::require(doc, "control_fd", where);
  if (!fd.is_number_integer() || fd.get<std::int64_t>() < 3 || fd.get<std::int64_t>() > 65535)
    throw Error("input.invalid", where + ": control_fd " + fd.dump() + " is not a descriptor >= 3");
  in.control_fd = fd.get<int>();
  return in;
}

int run_serve(const std::string& input_path, const std::string& workdir) {
  ServeInput in = parse_serve_input(common::parse_strict(common::read_file(input_path, 64u << 20)));
  const fs::path dir(workdir);
  Resident r;
  r.model_dir = in.model_dir;
  r.execution = in.execution;
  r.files = std::make_unique<ModelFiles>(open_model_files(in.model_dir, in.model_fds));
  r.options = prepare_execution(in.execution, *r.files);
  r.tokenizer = std::make_unique<Tokenizer>(load_tokenizer(*r.files));
  auto t0 = Clock::now();
  r.loaded = load_model(*r.files, r.options, io_threads());
  // Waits for every digest: what the worker binds is fixed before it serves any job.
  r.bytes_used = bytes_used(*r.files, r.loaded.weight_files);
  r.load_seconds = seconds_since(t0);
  r.loaded_at = common::now_rfc3339();
  Json loaded{{"schema", protocol::kOracleServeLoaded},
              {"model_dir", r.model_dir.string()},
              {"architecture", r.loaded.model->architecture()},
              {"model_type", r.loaded.model_type},
              {"bytes_used", r.bytes_used},
              {"loaded_at", r.loaded_at},
              {"load_seconds", r.load_seconds},
              {"peak_rss_bytes", peak_rss_bytes()}};
  common::atomic_write_file(dir / "loaded.json", loaded.dump(2) + "\n");
  send_message(in.control_fd, "loaded");

  while (auto message = receive_message(in.control_fd)) {
    if (message->rfind("run ", 0) != 0 || !plain_name(message->substr(4))) {
      std::cerr << "assay-oracle serve: unknown control message \"" << message->substr(0, 80)
                << "\"\n";
      return 2;
    }
    const std::string name = message->substr(4);
    const fs::path job = dir / name;
    try {
      run_job(r, job);
      ++r.jobs;
      send_message(in.control_fd, "done " + name);
      continue;
    } catch (const Error& e) {
      write_error(job, e.code(), e.what());
    } catch (const c10::Error& e) {
      write_error(job, "oracle.torch", e.what_without_backtrace());
    } catch (const std::exception& e) {
      write_error(job, "oracle.internal", e.what());
    }
    ++r.jobs;
    send_message(in.control_fd, "failed " + name);
  }
  return 0;
}

}  // namespace assay::oracle
