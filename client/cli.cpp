// `assay`'s command line: the CLI11 wiring of every command and option (whose order is the order
// of `assay --help`), the dispatch to the Cli method that runs a command, the one place where a
// command's failure becomes an exit status, and the small helpers every command group shares.
// The commands themselves are in cli_jobs.cpp, cli_results.cpp and cli_daemon.cpp.
#include "client/cli.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <ostream>

#include <CLI/CLI.hpp>

#include "client/api.h"
#include "client/cli_internal.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/layers.h"
#include "common/protocol.h"
#include "common/trajectory.h"

namespace assay::client {

namespace cli {

namespace fs = std::filesystem;

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

}  // namespace cli

namespace {

constexpr const char* kDecideHelp =
    "a next-token job must decide: exit 12 when its verdict is neither (no engine's candidate "
    "alone holds the reference argmax; a batch: when any state's is), with --json too";

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
    "  8  --wait-timeout expired (wait, submit --wait; the job goes on)\n"
    "  9  result --format kiln-v2: a field of Kiln's record would not be a fact of the run "
    "(nothing written)\n"
    " 10  verify --kiln: a Kiln record of a kind assay does not check (neither verified nor "
    "refused)\n"
    " 11  a fidelity receipt's gates failed (fidelity submit --wait, fidelity show, wait): the "
    "job succeeded, the engine did not pass\n"
    " 12  --decide (submit --wait, wait, status, show): the next-token verdict is neither (no "
    "engine's candidate alone holds the reference argmax; a batch: any state)\n"
    "\n"
    "The socket is --socket, else $ASSAY_SOCKET, else /run/assay/assayd.sock.";

// What a command's own --help says after its options: the options every command takes, which
// its own list does not show, and where the exit codes are.
constexpr const char* kCommandFooter =
    "Options of every command (before or after it): --socket PATH (assayd's unix socket, else "
    "$ASSAY_SOCKET, else /run/assay/assayd.sock), --json (machine-readable output), --timeout "
    "SECONDS (for one API request).\nExit status: see `assay --help`.";

// A job id as assayd gives it ("j-" and 24 lowercase hex digits): a malformed one is a bad
// command line (exit 2), not a request assayd refuses.
const CLI::Validator kJobId(
    [](std::string& id) -> std::string {
      bool ok = id.size() == 26 && id.rfind("j-", 0) == 0 &&
                id.find_first_not_of("0123456789abcdef", 2) == std::string::npos;
      return ok ? std::string()
                : "\"" + id + "\" is not a job id (\"j-\" and 24 lowercase hex digits)";
    },
    "JOB-ID");

// The subcommands that run a command, to tell after parsing which one was given.
struct Commands {
  CLI::App *submit, *fsubmit, *fshow, *tsubmit, *tshow, *lsubmit, *lshow, *fingerprint, *report;
  CLI::App* classify;
  CLI::App* audit;
  CLI::App *wait, *status, *show, *list, *result, *artifact, *cancel;
  CLI::App *verify, *keys, *health, *info, *check;
};

// submit, fidelity, trajectory, layer, fingerprint and report: the commands that start work.
void add_work_commands(CLI::App& app, cli::Options& o, Commands& c) {
  c.submit = app.add_subcommand("submit", "submit a request file as a job");
  c.submit
      ->add_option("FILE", o.file,
                   "assay.next-token-request.v1, kiln.hf-next-token-request.v1, "
                   "assay.next-token-batch-request.v1, assay.fidelity-request.v1, "
                   "assay.trajectory-request.v1, assay.layer-attribution-request.v1 or "
                   "assay.engine-audit-request.v1 (with "
                   "--batch: JSONL of next-token requests)")
      ->required();
  c.submit->add_option(
      "--model", o.model,
      "model directory (required for Kiln requests; overrides an assay request's)");
  c.submit->add_option("--receipts", o.receipts,
                       "directory holding the engine receipts a Kiln request names (by their "
                       "file names); assayd checks them before queueing. Default: the request's "
                       "own directory when both receipts are there, else they are not checked "
                       "and the result says so");
  c.submit->add_flag("--batch", o.batch,
                     "FILE is JSONL: one next-token request per line (assay's or Kiln's), all on "
                     "one model; submitted as one batch job (one model load, a signed result per "
                     "state, a signed summary), its id FILE's name without the extension");
  c.submit->add_flag("--numerics", o.numerics,
                     "also run the numerics envelope (a next-token request without "
                     "\"numerics\" gets {}: every default) and classify the dispute as "
                     "reference_decides, numerically_tied or neither");
  auto* submit_wait =
      c.submit->add_flag("--wait", o.wait, "wait for the job to finish (as `assay wait`)");
  c.submit->add_flag("--decide", o.decide, kDecideHelp)->needs(submit_wait);
  c.submit->add_flag(
      "--retry", o.retry,
      "run a failed or cancelled identical job again (else its old status is returned)");
  c.submit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);

  auto* fidelity = app.add_subcommand(
      "fidelity", "fidelity jobs: KL(reference || candidate) over a panel of contexts");
  fidelity->require_subcommand(1);
  c.fsubmit = fidelity->add_subcommand("submit", "submit an assay.fidelity-request.v1 file");
  c.fsubmit->add_option("FILE", o.file, "assay.fidelity-request.v1")->required();
  c.fsubmit->add_flag("--wait", o.wait, "wait for the job, then print its metric table");
  c.fsubmit->add_flag("--retry", o.retry, "run a failed or cancelled identical job again");
  c.fsubmit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);
  c.fshow = fidelity->add_subcommand(
      "show", "a fidelity job's metrics, per-context table and KL histogram (--json: the receipt)");
  c.fshow->add_option("ID", o.id, "job id")->required()->check(kJobId);

  auto* trajectory = app.add_subcommand(
      "trajectory",
      "trajectory jobs: where each engine's greedy continuation first left the reference argmax");
  trajectory->require_subcommand(1);
  c.tsubmit = trajectory->add_subcommand("submit", "submit an assay.trajectory-request.v1 file");
  c.tsubmit->add_option("FILE", o.file, "assay.trajectory-request.v1")->required();
  c.tsubmit->add_flag("--wait", o.wait, "wait for the job, then print each engine's departure");
  c.tsubmit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);
  c.tshow = trajectory->add_subcommand(
      "show", "a trajectory job's departures and divergence (--json: the result)");
  c.tshow->add_option("ID", o.id, "job id")->required()->check(kJobId);

  auto* layer = app.add_subcommand(
      "layer",
      "layer-attribution jobs: where inside the model an engine's hidden states leave the "
      "reference, and (with patching) which departure decides the token");
  layer->require_subcommand(1);
  c.lsubmit = layer->add_subcommand(
      "submit",
      "submit an assay.layer-attribution-request.v1 file (checked locally first; the engine's "
      "rows file is read by assayd as the submitter)");
  c.lsubmit->add_option("FILE", o.file, "assay.layer-attribution-request.v1")->required();
  c.lsubmit->add_flag("--wait", o.wait, "wait for the job, then print its per-boundary table");
  c.lsubmit->add_flag("--retry", o.retry, "run a failed or cancelled identical job again");
  c.lsubmit->add_option("--wait-timeout", o.wait_timeout_s, "with --wait: give up after SECONDS")
      ->check(CLI::NonNegativeNumber);
  c.lshow = layer->add_subcommand(
      "show",
      "a layer-attribution job: per boundary bitwise equality, cosine, max and mean abs error, "
      "RMSE, reference RMS, relative RMSE and its growth, with the first non-bitwise boundary, "
      "the first over tolerance, the largest growth and the patching bracket marked; the job's "
      "state while it is not done (--json: the result)");
  c.lshow->add_option("ID", o.id, "job id")->required()->check(kJobId);

  c.fingerprint = app.add_subcommand(
      "fingerprint",
      "the fingerprint cache: --refresh DIR forgets the cached per-file digests of a model "
      "directory, so that its next job hashes every file");
  c.fingerprint->add_option("DIR", o.model, "model directory")->required();
  c.fingerprint->add_flag("--refresh", o.refresh, "forget DIR's cached digests");

  c.report = app.add_subcommand(
      "report",
      "write one self-contained HTML report (inline SVG and CSS, no script, no network) "
      "of a result file after checking it (a record whose self-hash or, with --pubkey, "
      "signature does not hold is refused, exit 6); its artifact is read from beside it when "
      "there");
  c.report->add_option("RESULT", o.file, "result.json (next-token, fidelity or layer-attribution)")
      ->required()
      ->check(CLI::ExistingFile);
  c.report->add_option("-o,--output", o.output, "the HTML file to write")->required();
  c.report->add_option("--pubkey", o.pubkey,
                       "assayd's public key (PEM; `assay keys`): the signature is checked too, and "
                       "the page says verified; without it the page says the signature was not "
                       "checked");
  c.report->add_option("--envelope", o.envelope,
                       "DSSE envelope (default: <stem>.dsse.json beside RESULT)");
  c.report
      ->add_option("--request", o.request_file,
                   "next-token: the request the job ran, shown as the prompt (its sha256 must be "
                   "the result's request.sha256, else exit 6)")
      ->check(CLI::ExistingFile);
  c.report->add_option("--model", o.model,
                       "with --request: the model directory whose tokenizer decodes the prompt's "
                       "ids (default: the request's model_dir; used only when its tokenizer.json "
                       "is the result's tokenizer_hash)");
}

// wait, status, list, result, artifact and cancel: the commands about one job or all of them.
void add_job_commands(CLI::App& app, cli::Options& o, Commands& c) {
  c.wait = app.add_subcommand("wait", "follow a job until it ends (live progress on a TTY)");
  c.wait->add_option("ID", o.id, "job id")->required()->check(kJobId);
  c.wait->add_flag("--decide", o.decide, kDecideHelp);
  c.wait
      ->add_option("--timeout-wait,--wait-timeout", o.wait_timeout_s,
                   "give up after SECONDS (exit 8)")
      ->check(CLI::NonNegativeNumber);

  c.status = app.add_subcommand("status", "show one job");
  c.status->add_option("ID", o.id, "job id")->required()->check(kJobId);
  c.status->add_flag("--decide", o.decide, kDecideHelp);

  c.show = app.add_subcommand(
      "show",
      "a finished job's answer for people, whatever its kind (next-token: the verdict, each "
      "candidate's text, logit, rank and gap to the argmax, the reference's top tokens, the "
      "oracle's time and memory; fidelity, trajectory, layer, batch: as their own show); --json: "
      "the result document; exit 11 when a fidelity gate failed");
  c.show->add_option("ID", o.id, "job id")->required()->check(kJobId);
  c.show->add_flag("--decide", o.decide, kDecideHelp);

  c.list = app.add_subcommand("list", "list jobs");
  c.list->add_option("--state", o.state, "only jobs in this state");
  c.list->add_flag("--parts", o.parts,
                   "also the states of batch jobs, each a job of its own (--json always lists "
                   "them, with \"batch\": {id, index})");

  c.result = app.add_subcommand("result", "fetch a job's result record");
  c.result->add_option("ID", o.id, "job id")->required()->check(kJobId);
  c.result->add_option("-o,--output", o.output,
                       "write the result here and its DSSE envelope beside it (<stem>.dsse.json); "
                       "default: the result bytes to stdout");
  c.result
      ->add_option("--format", o.format,
                   "assay (default: the signed record as assayd keeps it) or kiln-v2: Kiln's "
                   "kiln.rocm-hf-next-token-oracle.v2 record with Kiln's canonical self-hash, "
                   "written only when every field of it is a fact of the run; otherwise "
                   "nothing is written and each field that would be false is listed (exit 9); "
                   "with -o, a numerics envelope is written beside the record as "
                   "<stem>.assay-numerics.json (Kiln's schema admits no field of assay's)")
      ->check(CLI::IsMember({"assay", "kiln-v2"}));
  c.result->add_option("--contract-path", o.contract_path,
                       "kiln-v2: request.contract_path, where the request lives in Kiln's "
                       "repository (assay is not told)");

  c.artifact = app.add_subcommand(
      "artifact",
      "fetch a job's artifact (logits; a fidelity job's token-wise KL vector; a layer job's "
      "reference rows)");
  c.artifact->add_option("ID", o.id, "job id")->required()->check(kJobId);
  c.artifact->add_option("-o,--output", o.output, "file to write (safetensors)")->required();

  c.cancel = app.add_subcommand("cancel", "cancel a queued or running job");
  c.cancel->add_option("ID", o.id, "job id")->required()->check(kJobId);
}

// verify, keys, health, info and request check: trust, the daemon, and offline checks.
void add_trust_commands(CLI::App& app, cli::Options& o, Commands& c) {
  c.verify = app.add_subcommand(
      "verify", "check a result offline: result_sha256, DSSE signature, subjects' digests");
  c.verify->add_option("RESULT", o.file, "result.json")->required()->check(CLI::ExistingFile);
  c.verify
      ->add_option("--envelope", o.envelope,
                   "DSSE envelope (default: <stem>.dsse.json beside RESULT)")
      ->check(CLI::ExistingFile);
  c.verify
      ->add_option("--pubkey", o.pubkey,
                   "assayd's public key PEM (default: ask assayd's /v1/info, online)")
      ->check(CLI::ExistingFile);
  c.verify
      ->add_option("--artifact", o.artifact,
                   "the result's artifact (logits, token-wise KL, trajectory.safetensors, the "
                   "reference's layer rows), to check its digest too")
      ->check(CLI::ExistingFile);
  c.verify->add_flag("--kiln", o.kiln,
                     "RESULT is a record Kiln wrote (next-token or layer-attribution result): "
                     "result_sha256 in Kiln's canonical form, the document against Kiln's "
                     "published schema, and the facts that follow from it; with --artifact, the "
                     "logits file and the argmax, top tokens and ranks recomputed from it; with "
                     "assay's numerics addendum beside it (<stem>.assay-numerics.json, or "
                     "--numerics), its binding and class recomputed; offline, no key");
  c.verify
      ->add_option("--numerics", o.numerics_file,
                   "--kiln: assay's numerics addendum of the record (default: "
                   "<stem>.assay-numerics.json beside RECORD, when it is there)")
      ->check(CLI::ExistingFile);

  c.keys = app.add_subcommand("keys", "show assayd's signing key id and public key");
  c.keys->add_option("-o,--output", o.output, "also write the public key PEM to this file");

  c.health = app.add_subcommand("health", "ask assayd whether it is healthy");
  c.info = app.add_subcommand("info", "show assayd's version, containment and limits");

  auto* request = app.add_subcommand("request", "offline tools for request documents");
  request->require_subcommand(1);
  c.check = request->add_subcommand(
      "check", "validate a request offline and print its recomputed identities as JSON");
  c.check->add_option("FILE", o.file, "request document")->required();
  auto* numerics = app.add_subcommand("numerics", "offline tools for numerics envelopes");
  numerics->require_subcommand(1);
  c.classify = numerics->add_subcommand(
      "classify",
      "recompute the bug-or-numerics class of envelopes: FILE holds one JSON object per line, "
      "{members, candidates, fp32, policy} as a result's \"numerics\" has them; each line's "
      "verdict is printed as one JSON line (common/numerics.h has the rule)");
  c.classify->add_option("FILE", o.file, "JSONL of envelopes ('-': standard input)")->required();
  c.audit = numerics->add_subcommand(
      "audit",
      "recompute an engine audit's statistic: FILE holds one JSON object per line, {members, "
      "contexts, policy} as an engine-audit result has them (policy: request.audit.policy); each "
      "line's statistics are printed as one JSON line (common/audit.h has the rule)");
  c.audit->add_option("FILE", o.file, "JSONL of audits ('-': standard input)")->required();
  c.check->add_option("--receipts", o.receipts,
                      "a Kiln request's engine receipts are in this directory: run assayd's "
                      "receipt checks on them offline and add what passed to the report");
}

// Runs the command that was given; -1 when none was.
int dispatch(const Commands& c, const cli::Options& o, cli::Cli& cli) {
  if (*c.submit) return cli.submit();
  if (*c.fsubmit) return cli.submit(protocol::kFidelityRequest);
  if (*c.fshow) return cli.fidelity_show();
  if (*c.tsubmit) return cli.submit(common::kTrajectoryRequest);
  if (*c.tshow) return cli.trajectory_show();
  if (*c.lsubmit) return cli.submit(common::kLayerRequest);
  if (*c.lshow) return cli.layer_show();
  if (*c.fingerprint) return cli.fingerprint_refresh();
  if (*c.wait) return cli.wait(o.id);
  if (*c.status) return cli.status();
  if (*c.show) return cli.show();
  if (*c.list) return cli.list();
  if (*c.result) return cli.result();
  if (*c.artifact) return cli.artifact();
  if (*c.cancel) return cli.cancel();
  if (*c.verify) return cli.verify();
  if (*c.keys) return cli.keys();
  if (*c.health) return cli.health();
  if (*c.info) return cli.info();
  if (*c.check) return cli.request_check();
  if (*c.classify) return cli.numerics_classify();
  if (*c.audit) return cli.numerics_audit();
  if (*c.report) return cli.report();
  return -1;
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
  cli::Options o;
  o.socket = env.socket.empty() ? kDefaultSocket : env.socket;

  CLI::App app{
      "assay: submit next-token oracle, fidelity, trajectory and layer-attribution jobs to "
      "assayd and verify their signed results",
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
  Commands commands{};
  add_work_commands(app, o, commands);
  add_job_commands(app, o, commands);
  add_trust_commands(app, o, commands);
  // Each command, nested ones too (fidelity submit), instead of the exit table it inherits.
  std::vector<CLI::App*> todo = app.get_subcommands([](CLI::App*) { return true; });
  while (!todo.empty()) {
    CLI::App* sub = todo.back();
    todo.pop_back();
    sub->footer(kCommandFooter);
    for (CLI::App* child : sub->get_subcommands([](CLI::App*) { return true; }))
      todo.push_back(child);
  }

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
    cli::Cli cli(o, out, err, env);
    if (int status = dispatch(commands, o, cli); status >= 0) return status;
    err << "assay: no command\n";
    return kExitUsage;
  } catch (const cli::ExitWith& e) {
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
