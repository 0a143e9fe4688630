// The `assay` command line: argument parsing and the commands, callable in-process.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace assay::client {

// Exit statuses of `assay`; documented in `assay --help` and client/README.md.
enum Exit : int {
  kExitOk = 0,
  kExitError = 1,         // unexpected failure (a bug, or a local I/O error)
  kExitUsage = 2,         // bad command line
  kExitUnreachable = 3,   // assayd not reachable (socket missing, refused, timed out)
  kExitApiError = 4,      // assayd refused the request (HTTP 4xx/5xx): the message says why
  kExitJobFailed = 5,     // the job ended failed or cancelled (wait, submit --wait)
  kExitVerifyFailed = 6,  // verify: a check failed
  kExitInvalidInput = 7,  // a local file is unreadable or invalid (request check, submit, verify)
  kExitWaitTimeout = 8,   // --wait-timeout expired; the job goes on
  kExitNotAFact = 9,      // result --format kiln-v2: a field would be false; nothing written
  kExitNotChecked = 10,   // verify --kiln: a Kiln record of a kind assay does not check
  kExitGateFailed = 11,   // a fidelity job succeeded and its receipt's gates say "failed"
  kExitNoDecision = 12,   // --decide: a next-token verdict (or a batch state's) is "neither"
};

struct Environment {
  std::string socket;  // $ASSAY_SOCKET, or empty for the default
  bool stdout_is_tty = false;
};

inline constexpr const char* kDefaultSocket = "/run/assay/assayd.sock";

// Runs `assay` with args (args[0] is the program name); writes to out/err, returns the exit
// status. Never throws.
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
            const Environment& env);

}  // namespace assay::client
