// Private to the `assay` command line: the parsed options, the Cli object whose methods are the
// commands (defined by group in cli_jobs.cpp, cli_results.cpp and cli_daemon.cpp), the ExitWith
// condition they end with, and the few helpers more than one group uses. The CLI11 wiring that
// fills Options and calls a command is cli.cpp.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <ostream>
#include <string>
#include <string_view>

#include "client/api.h"
#include "client/cli.h"
#include "common/json.h"

namespace assay::client::cli {

// A condition that ends the command with a given status after printing its message.
struct ExitWith {
  int status;
  std::string message;
};

struct Options {
  std::string socket;
  bool json = false;
  bool kiln = false;  // verify: FILE is a record Kiln wrote
  double timeout_s = 60;
  // Positional and per-command values.
  std::string file, id, output, model, envelope, pubkey, artifact, state;
  std::string numerics_file;     // verify --kiln --numerics: assay's addendum beside the record
  std::string receipts;          // submit: the directory with a Kiln request's engine receipts
  std::string format = "assay";  // result: assay or kiln-v2
  std::string contract_path;     // result --format kiln-v2: request.contract_path
  std::string request_file;      // report --request: the request the job ran, for its prompt
  bool wait = false;
  bool decide = false;  // submit --wait, wait, status, show: a "neither" verdict exits 12
  bool retry = false;
  bool batch = false;     // submit: FILE is JSONL, one next-token request per line
  bool numerics = false;  // submit: add "numerics": {} (the envelope, every default)
  double wait_timeout_s = 0;
  bool refresh = false;
  bool parts = false;  // list: also the states of batches
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

  // cli_jobs.cpp: submitting, checking and following jobs.
  // `only`: the one request schema this command accepts (assay fidelity/trajectory/layer submit).
  int submit(std::string_view only = {});
  std::string receipts_dir(const std::string& body, const std::string& schema);
  int request_check();
  // `numerics classify FILE`: numerics_verdict on each line's envelope, offline.
  int numerics_classify();
  // `numerics audit FILE`: audit_statistics on each line's per-context figures, offline.
  int numerics_audit();
  // A succeeded next-token job's document with its result's verdict, result_sha256 and
  // numerics verdict, for the terminal.
  common::Json with_verdict(common::Json job);
  common::Json check_receipts_locally(const std::string& request_text);
  int wait(const std::string& id);
  int status();
  int list();
  int cancel();
  // cli_results.cpp: a finished job's result and artifact, and its reports for people.
  int result();
  int kiln_v2(const std::string& result_body);
  int artifact();
  int show_result(std::string_view schema, const char* kind,
                  std::string (*report)(const common::Json&));
  // `show ID`: the report of the job's kind (next_token_report for a next-token job).
  int show();
  int fidelity_show();
  int trajectory_show();
  int layer_show();
  int report();
  // cli_daemon.cpp: verifying a result, and assayd's keys, health, info and fingerprint cache.
  int verify();
  int keys();
  int health();
  int info();
  int fingerprint_refresh();

 private:
  void print_json(const common::Json& j) { out_ << j.dump(o_.json ? -1 : 2) << "\n"; }
  // cli.cpp: writes atomically, or ends with ExitWith(kExitError) naming the path.
  void save(const std::filesystem::path& path, std::string_view bytes, mode_t mode = 0644);
  int finished(const common::Json& job);  // cli_jobs.cpp

  const Options& o_;
  std::ostream& out_;
  std::ostream& err_;
  const Environment& env_;
  Api api_;
};

// kExitGateFailed when a fidelity result's gates say "failed", else kExitOk (cli_results.cpp).
int gates_status(const common::Json& result);
// kExitNoDecision when a next-token result's verdict is "neither", or a batch's counts have a
// "neither" state; else kExitOk (cli_results.cpp). Other kinds decide nothing here.
int decision_status(const common::Json& result);
// A local file's bytes, or ExitWith(kExitInvalidInput) naming `what` when it cannot be read.
std::string read_local(const std::filesystem::path& path, std::size_t max_bytes, const char* what);
// Percent-encodes all but unreserved characters and '/', for a query parameter.
std::string url_encode(std::string_view s);
// Parses a request file of either kind offline, refusing locally what assayd would refuse.
// Returns its request_sha256; `fidelity` tells which kind it is.
// With `report`, also the identities `assay request check` prints.
std::string check_request_file(const std::string& file, const std::string& text, bool& fidelity,
                               common::Json* report = nullptr);

}  // namespace assay::client::cli
