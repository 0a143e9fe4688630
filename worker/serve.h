// `assay-oracle serve`: a resident oracle worker. It loads the model once through the
// descriptors the supervisor passed (and hashes it: its bytes_used is fixed from then), says so
// on the control socket, then runs next-token jobs and batches one at a time, each in a directory
// of its workspace the supervisor names, on the same loaded model, until the supervisor closes the
// socket.
#pragma once

#include <filesystem>
#include <string>

#include "common/json.h"
#include "worker/next_token.h"

namespace assay::oracle {

// assay.oracle-serve-input.v1: {schema, model_dir, model_fds, execution, control_fd}.
struct ServeInput {
  std::filesystem::path model_dir;
  ModelFds model_fds;
  Execution execution;
  int control_fd = -1;
};
// Throws Error("input.invalid" / "json.unknown_field") naming the field.
ServeInput parse_serve_input(const common::Json& doc);

// The control protocol, one datagram per message (a SOCK_SEQPACKET socketpair):
//   worker -> supervisor  "loaded"        loaded.json (assay.oracle-serve-loaded.v1) is written
//   supervisor -> worker  "run NAME"      NAME/input.json (assay.oracle-input.v1 or
//                                         assay.oracle-batch-input.v1, no model_fds)
//   worker -> supervisor  "done NAME"     NAME/output.json and NAME/logits.safetensors written
//                                         (a batch: each NAME/state-I.{json,safetensors} as its
//                                         state ends, then NAME/output.json)
//   worker -> supervisor  "failed NAME"   NAME/error.json ({code, message}) written
// NAME is one plain directory name below the workspace. The worker exits 0 when the socket
// closes, and non-zero (after "failed") on a message it cannot read.
int run_serve(const std::string& input_path, const std::string& workdir);

}  // namespace assay::oracle
