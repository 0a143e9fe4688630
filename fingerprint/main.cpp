// assay-fingerprint: a model directory's content identity, as a command and as a worker.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/protocol.h"
#include "common/worker_document.h"
#include "fingerprint/fingerprint.h"

namespace {

using assay::common::Error;
using assay::common::Json;
namespace fp = assay::fingerprint;
namespace protocol = assay::protocol;

// sha256 of the running binary: the implementation identity in every output.
std::string implementation_sha256() {
  // /proc/self/exe is a magic link, so it is opened without O_NOFOLLOW on purpose.
  assay::common::UniqueFd fd(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  if (!fd) assay::common::throw_errno("fingerprint.self", "open /proc/self/exe", errno);
  assay::common::Sha256 h;
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      assay::common::throw_errno("fingerprint.self", "read /proc/self/exe", errno);
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<std::size_t>(n));
  }
  return assay::common::identity(h.finish());
}

Json output_document(const fp::Fingerprint& f, const std::string& model_dir, double max_rate) {
  double mib = static_cast<double>(f.stats.bytes) / 1048576.0;
  Json files = Json::array();
  Json cacheable = Json::array();
  for (const auto& d : f.files) {
    files.push_back(fp::to_json(d));
    if (d.storable) cacheable.push_back(d.state.name);
  }
  // With deferred shards the identity is not complete: their digests and content_sha256 are the
  // supervisor's to fill from the next reader's bytes_used.
  Json identity = fp::to_json(f.identity);
  const bool pending = f.stats.deferred_files > 0;
  if (pending) {
    identity.erase("content_sha256");
    for (Json& w : identity["weight_files"])
      if (w["sha256"] == "") w["sha256"] = nullptr;
  }
  Json doc{{"schema", protocol::kFingerprintOutput},
           {"model_dir", model_dir},
           {pending ? "pending_identity" : "model_identity", std::move(identity)},
           {"stats",
            {{"bytes", f.stats.bytes},
             {"files", f.stats.files},
             {"seconds", f.stats.seconds},
             {"mib_per_second", f.stats.seconds > 0 ? mib / f.stats.seconds : 0.0},
             {"threads", f.stats.threads},
             {"cached_files", f.stats.cached_files},
             {"cached_bytes", f.stats.cached_bytes},
             {"max_read_mib_per_second", max_rate > 0 ? Json(max_rate) : Json(nullptr)}}},
           {"files", files},
           {"cacheable", cacheable},
           {"implementation_sha256", implementation_sha256()}};
  if (pending) {
    doc["stats"]["deferred_files"] = f.stats.deferred_files;
    doc["stats"]["deferred_bytes"] = f.stats.deferred_bytes;
  }
  return doc;
}

struct Request {
  std::string model_dir;
  std::string id;
  fp::Options options;
};

Request parse_input(const std::filesystem::path& input) {
  std::string text = assay::common::read_file(input, 1 << 20);
  Json j = assay::common::parse_strict(text);
  std::string where = input.string();
  if (!j.is_object()) throw Error("fingerprint.bad_input", where + " is not a JSON object");
  assay::common::reject_unknown_fields(
      j,
      {"schema", "model_dir", "id", "threads", "max_read_mib_per_second", "model_fds", "cache",
       "defer_shards"},
      where);
  std::string schema = assay::common::require_string(j, "schema", where);
  if (schema != protocol::kFingerprintInput)
    throw Error("fingerprint.bad_input", where + ": schema '" + schema + "' is not '" +
                                             std::string(protocol::kFingerprintInput) + "'");
  Request r;
  r.model_dir = assay::common::require_string(j, "model_dir", where);
  if (r.model_dir.empty() || r.model_dir.front() != '/')
    throw Error("fingerprint.bad_input",
                where + ": model_dir '" + r.model_dir + "' is not an absolute path");
  r.id = assay::common::require_string(j, "id", where);
  if (j.contains("threads")) {
    std::int64_t t = assay::common::require_int(j, "threads", where);
    if (t < 1 || t > 1024)
      throw Error("fingerprint.bad_input",
                  where + ": threads " + std::to_string(t) + " is outside 1..1024");
    r.options.threads = static_cast<unsigned>(t);
  }
  if (j.contains("max_read_mib_per_second")) {
    const Json& v = j["max_read_mib_per_second"];
    if (!v.is_number() || v.get<double>() <= 0)
      throw Error("fingerprint.bad_input",
                  where + ": max_read_mib_per_second " + v.dump() + " is not a positive number");
    r.options.max_read_mib_per_second = v.get<double>();
  }
  if (j.contains("cache"))
    r.options.cache = fp::parse_cache(j["cache"], where, "fingerprint.bad_input");
  if (j.contains("defer_shards")) {
    if (!j["defer_shards"].is_boolean())
      throw Error("fingerprint.bad_input",
                  where + ": defer_shards " + j["defer_shards"].dump() + " is not a boolean");
    r.options.defer_shards = j["defer_shards"].get<bool>();
  }
  if (j.contains("model_fds"))
    r.options.model_fds = fp::parse_model_fds(j["model_fds"], where, "fingerprint.bad_input");
  return r;
}

void write_or_print(const Json& doc, const std::string& out) {
  std::string text = doc.dump(2) + "\n";
  if (out.empty())
    std::cout << text << std::flush;
  else
    assay::common::atomic_write_file(out, text);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "assay-fingerprint: the content identity of a model directory (config, tokenizer, chat "
      "template, every weight shard), Kiln-compatible, each byte read once.\n"
      "Command:  assay-fingerprint --model DIR --id NAME [--threads N] "
      "[--max-read-mib-per-second N] [--out FILE]\n"
      "Worker:   assay-fingerprint run --input input.json --workdir DIR  (writes DIR/output.json)"};
  std::string model, id, out;
  unsigned threads = 0;
  double max_rate = 0;
  app.add_option("--model", model, "model directory");
  app.add_option("--id", id, "model id recorded in the identity (printable ASCII)");
  app.add_option("--threads", threads, "files hashed at once (default: one per CPU, at most 8)")
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--max-read-mib-per-second", max_rate, "cap on the total read rate (MiB/s)")
      ->check(CLI::PositiveNumber);
  app.add_option("--out", out, "write the JSON here (atomically) instead of stdout");

  auto* run = app.add_subcommand("run", "worker protocol: read input.json, write output.json");
  std::string input, workdir;
  run->add_option("--input", input, "input.json (assay.fingerprint-input.v1)")->required();
  run->add_option("--workdir", workdir, "workspace where output.json is written")->required();
  app.require_subcommand(0, 1);

  CLI11_PARSE(app, argc, argv);
  try {
    if (*run) {
      if (!model.empty() || !id.empty())
        throw Error("fingerprint.usage", "--model/--id do not go with 'run': use input.json");
      Request r = parse_input(input);
      fp::Fingerprint f = fp::fingerprint_model(r.model_dir, r.id, r.options);
      Json doc = output_document(f, r.model_dir, r.options.max_read_mib_per_second);
      assay::common::write_worker_document(std::filesystem::path(workdir) / protocol::kOutputFile,
                                           doc.dump(2) + "\n");
      return 0;
    }
    if (model.empty() || id.empty())
      throw Error("fingerprint.usage", "--model and --id are required (see --help)");
    fp::Options options;
    options.threads = threads;
    options.max_read_mib_per_second = max_rate;
    fp::Fingerprint f = fp::fingerprint_model(model, id, options);
    std::string abs = std::filesystem::absolute(model).lexically_normal().string();
    write_or_print(output_document(f, abs, max_rate), out);
    return 0;
  } catch (const Error& e) {
    std::cerr << "assay-fingerprint: " << e.code() << ": " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "assay-fingerprint: internal: " << e.what() << "\n";
    return 1;
  }
}
