// Worker protocol, batch jobs (`assay-oracle next-token-batch`): one model load, then every state
// of the input in order, each forward exactly as `next-token` runs it (run.h), so that a state's
// logits are bitwise those of a single job over the same ids.
#include "worker/batch.h"

#include <c10/util/Exception.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/worker_document.h"
#include "worker/run.h"

namespace assay::oracle {

using common::Error;
using common::Json;

std::string batch_state_file(std::size_t index, std::string_view extension) {
  return "state-" + std::to_string(index) + std::string(extension);
}

namespace {

// A state that cannot be run fails alone: its file says why, and the batch goes on.
void write_state_error(const std::filesystem::path& dir, std::size_t index, const std::string& code,
                       const std::string& message) {
  Json out{{"index", index}, {"error", {{"code", code}, {"message", message}}}};
  common::write_worker_document(dir / batch_state_file(index, ".json"), out.dump(2) + "\n");
}

}  // namespace

int run_next_token_batch(const std::string& input_path, const std::string& workdir) {
  Json doc = common::parse_strict(common::read_file(input_path, 256u << 20));
  OracleBatchInput in = parse_oracle_batch_input(doc);
  ModelFiles files = open_model_files(in.model_dir, in.model_fds);
  ExecOptions options = prepare_execution(in.execution, files);

  Tokenizer tokenizer = load_tokenizer(files);
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  // What the whole process computed with, before any state is written: a state file is whole on
  // its own, whatever happens to the process after it.
  run_batch_states(
      in, workdir, options, loaded, tokenizer,
      Json{{"bytes_used", bytes_used(files, loaded.weight_files)}, {"load_seconds", load_seconds}},
      Json::object(), kStart);
  return 0;
}

void run_batch_states(const OracleBatchInput& in, const std::filesystem::path& dir,
                      const ExecOptions& options, const LoadedModel& loaded,
                      const Tokenizer& tokenizer, Json process, const Json& extra,
                      Clock::time_point started) {
  add_execution_report(process, options, in.execution.threads,
                       loaded.model->attention_implementation(),
                       loaded.model->linear_attention_implementation());
  std::size_t succeeded = 0, failed = 0;
  for (const BatchState& state : in.states) {
    Json out;
    try {
      check_candidates(state.candidates, tokenizer, loaded.model->vocab_size());
      check_prefix_texts(state.continuation_prefix, tokenizer);
      Forward f = run_forward(in.model_dir, state.input_token_ids, options, loaded);
      out =
          next_token_output(dir, batch_state_file(state.index, ".safetensors"),
                            state.input_token_ids, state.candidates, f, options, loaded, tokenizer);
      out["forward_seconds"] = f.forward_seconds;
    } catch (const Error& e) {
      write_state_error(dir, state.index, e.code(), e.what());
      ++failed;
      continue;
    } catch (const c10::Error& e) {
      write_state_error(dir, state.index, "oracle.torch", e.what_without_backtrace());
      ++failed;
      continue;
    }
    out.update(process);
    out.update(extra);
    out["batch_index"] = state.index;
    out["peak_rss_bytes"] = peak_rss_bytes();
    out["duration_seconds"] = seconds_since(started);
    common::write_worker_document(dir / batch_state_file(state.index, ".json"), out.dump(2) + "\n");
    ++succeeded;
  }
  Json out{{"schema", protocol::kOracleBatchOutput},
           {"states", in.states.size()},
           {"succeeded", succeeded},
           {"failed", failed},
           {"peak_rss_bytes", peak_rss_bytes()},
           {"duration_seconds", seconds_since(started)},
           // What the supervisor hashes into every state's "implementation": named here too so
           // that it can hash them off its loop before it records the states.
           {"loaded_libraries", process["loaded_libraries"]}};
  common::write_worker_document(dir / protocol::kOutputFile, out.dump(2) + "\n");
}

}  // namespace assay::oracle
