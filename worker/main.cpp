// assay-oracle: the eager reference forward. `logits` writes the logits of a token sequence;
// `next-token` is the worker-protocol mode the supervisor runs (input.json -> output.json).
#include <sys/resource.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "common/worker_document.h"
#include "worker/attribution.h"
#include "worker/batch.h"
#include "worker/capture.h"
#include "worker/loader.h"
#include "worker/model_files.h"
#include "worker/next_token.h"
#include "worker/run.h"
#include "worker/runtime.h"
#include "worker/serve.h"
#include "worker/tokenizer.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;

std::vector<std::int64_t> parse_token_ids(const std::string& text) {
  std::vector<std::int64_t> ids;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (item.empty() || item.size() > 18 ||
        item.find_first_not_of("0123456789") != std::string::npos) {
      throw Error("request.invalid_token_id", "--token-ids item " + std::to_string(ids.size()) +
                                                  " \"" + item +
                                                  "\" is not a non-negative integer");
    }
    ids.push_back(std::stoll(item));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

struct LogitsArgs {
  std::string model, token_ids, out, device = "cpu", dtype;
  bool all_positions = false, verbose = false;
  int threads = 1;
};

int run_logits(const LogitsArgs& a) {
  make_deterministic(a.threads);
  auto ids = parse_token_ids(a.token_ids);
  ModelFiles files = ModelFiles::from_directory(a.model);
  ExecOptions options;
  options.device = parse_device(a.device);
  options.dtype = parse_dtype(a.dtype, read_config(files));
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  Forward f = run_forward(a.model, ids, options, loaded);
  at::Tensor logits = a.all_positions ? f.logits : f.logits[-1].contiguous();
  write_logits(a.out, ids, logits, logits_metadata(f, options, ids, !a.all_positions));
  if (a.verbose) {
    // Waits for the weight digests, as next-token and capture do before writing output.json.
    std::cerr << "assay-oracle: bytes_used=" << bytes_used(files, loaded.weight_files).dump()
              << "\n";
    std::cerr << "assay-oracle: load_seconds=" << load_seconds
              << " forward_seconds=" << f.forward_seconds
              << " total_seconds=" << seconds_since(kStart)
              << " peak_rss_bytes=" << peak_rss_bytes() << "\n";
  }
  return 0;
}

int run_next_token(const std::string& input_path, const std::string& workdir) {
  Json doc = common::parse_strict(common::read_file(input_path, 64u << 20));
  OracleInput in = parse_oracle_input(doc);
  ModelFiles files = open_model_files(in.model_dir, in.model_fds);
  files.expect_unchanged(in.unchanged_files);
  ExecOptions options = prepare_execution(in.execution, files);

  Tokenizer tokenizer = load_tokenizer(files);
  // What the tokenizer alone can refuse is refused before the weights are read.
  check_candidate_texts(in.candidates, tokenizer);
  check_prefix_texts(in.continuation_prefix, tokenizer);
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  check_candidates(in.candidates, tokenizer, loaded.model->vocab_size());
  Forward f = run_forward(in.model_dir, in.input_token_ids, options, loaded);
  std::filesystem::path dir(workdir);
  Json out = next_token_output(dir, "logits.safetensors", in.input_token_ids, in.candidates, f,
                               options, loaded, tokenizer);
  out["bytes_used"] = bytes_used(files, loaded.weight_files);
  add_execution_report(out, options, in.execution.threads, f.attention, f.linear_attention);
  out["load_seconds"] = load_seconds;
  out["forward_seconds"] = f.forward_seconds;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["duration_seconds"] = seconds_since(kStart);
  common::write_worker_document(dir / protocol::kOutputFile, out.dump(2) + "\n");
  return 0;
}

// Worker protocol, fidelity jobs: the logits of every scored position of every context, one
// safetensors file per context ("positions" I64 [N], "logits" F32 [N, vocab]). The forward runs
// once per context up to the final hidden states; the LM head then runs on blocks of at most
// block_positions rows, each block streamed to the file, so [T, vocab] is never held whole.
int run_capture(const std::string& input_path, const std::string& workdir) {
  Json doc = common::parse_strict(common::read_file(input_path, 256u << 20));
  CaptureInput in = parse_capture_input(doc);
  ModelFiles files = open_model_files(in.model_dir, in.model_fds);
  ExecOptions options = prepare_execution(in.execution, files);

  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  const std::int64_t vocab = loaded.model->vocab_size();
  std::filesystem::path dir(workdir);
  std::map<std::string, std::string> metadata = {
      {"architecture", loaded.model->architecture()},
      {"dtype", options.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
      {"device", options.device.str()},
      {"torch_version", torch_identity()["version"].get<std::string>()},
      {"block_positions", std::to_string(in.block_positions)}};

  Json captures = Json::array();
  double forward_seconds = 0, head_seconds = 0;
  c10::InferenceMode guard;
  for (std::size_t i = 0; i < in.contexts.size(); ++i) {
    const CaptureContext& ctx = in.contexts[i];
    const auto t = static_cast<std::int64_t>(ctx.token_ids.size());
    check_token_ids(ctx.token_ids, vocab, "contexts[" + std::to_string(i) + "].token_ids");
    auto t1 = Clock::now();
    at::Tensor input = at::tensor(ctx.token_ids, at::kLong).unsqueeze(0).to(options.device);
    at::Tensor hidden = loaded.model->hidden_states(input);
    if (hidden.dim() != 3 || hidden.size(0) != 1 || hidden.size(1) != t) {
      throw Error("oracle.internal", "hidden states " + hidden.toString() + " of shape " +
                                         c10::str(hidden.sizes()) + " for " + std::to_string(t) +
                                         " tokens");
    }
    forward_seconds += seconds_since(t1);

    auto t2 = Clock::now();
    std::vector<std::int64_t> positions;
    for (const auto& [b, e] : ctx.positions)
      for (std::int64_t p = b; p < e; ++p) positions.push_back(p);
    const auto n = static_cast<std::int64_t>(positions.size());
    std::string file = capture_file_name(i);
    common::SafetensorsStreamWriter writer(
        dir / file,
        {{"positions", common::Dtype::kI64, {n}}, {"logits", common::Dtype::kF32, {n, vocab}}},
        metadata);
    writer.write(std::as_bytes(std::span(positions)));
    common::Sha256 digest;
    for (const auto& [b, e] : ctx.positions) {
      for (std::int64_t p = b; p < e; p += in.block_positions) {
        std::int64_t rows = std::min(in.block_positions, e - p);
        at::Tensor logits = loaded.model->lm_head(hidden.narrow(1, p, rows));
        if (logits.dim() != 3 || logits.size(1) != rows || logits.size(2) != vocab) {
          throw Error("oracle.internal", "LM head returned " + c10::str(logits.sizes()) + " for " +
                                             std::to_string(rows) + " rows");
        }
        at::Tensor block = logits[0].to(at::kFloat).to(at::kCPU).contiguous();
        std::span<const std::byte> bytes(
            reinterpret_cast<const std::byte*>(block.data_ptr<float>()),
            static_cast<std::size_t>(block.numel()) * sizeof(float));
        writer.write(bytes);
        digest.update(bytes.data(), bytes.size());
      }
    }
    writer.finish();
    head_seconds += seconds_since(t2);
    captures.push_back(
        Json{{"id", ctx.id},
             {"file", file},
             {"token_count", t},
             {"input_token_ids_sha256", common::sha256_canonical_id(Json(ctx.token_ids))},
             {"positions", common::position_ranges_json(ctx.positions)},
             {"scored_positions", n},
             {"logits_sha256", common::identity(digest.finish())}});
  }

  Json out{{"schema", protocol::kOracleCaptureOutput},
           {"architecture", loaded.model->architecture()},
           {"model_type", loaded.model_type},
           {"vocab_size", vocab},
           {"block_positions", in.block_positions},
           {"captures", captures},
           {"bytes_used", bytes_used(files, loaded.weight_files)}};
  add_execution_report(out, options, in.execution.threads, loaded.model->attention_implementation(),
                       loaded.model->linear_attention_implementation());
  out["load_seconds"] = load_seconds;
  out["forward_seconds"] = forward_seconds;
  out["lm_head_seconds"] = head_seconds;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["duration_seconds"] = seconds_since(kStart);
  common::write_worker_document(dir / protocol::kOutputFile, out.dump(2) + "\n");
  return 0;
}

}  // namespace
}  // namespace assay::oracle

int main(int argc, char** argv) {
  using namespace assay::oracle;
  CLI::App app{
      "assay-oracle: eager, deterministic reference forward (built against LibTorch " TORCH_VERSION
      " headers; the evidence names the library it runs)"};
  app.require_subcommand(1);

  LogitsArgs la;
  auto* logits = app.add_subcommand("logits", "Write the logits of a token sequence");
  logits->add_option("--model", la.model, "Hugging Face checkpoint directory")->required();
  logits->add_option("--token-ids", la.token_ids, "comma-separated token ids")->required();
  logits->add_option("--out", la.out, "output safetensors file")->required();
  logits->add_flag("--all-positions", la.all_positions, "logits of every position [T, vocab]");
  logits->add_option("--device", la.device, "cpu, cuda or cuda:N")->capture_default_str();
  logits->add_option("--dtype", la.dtype, "bfloat16 or float32 (default: config's dtype)");
  logits->add_option("--threads", la.threads, "intra-op threads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  logits->add_flag("--verbose", la.verbose, "print load/forward seconds and peak RSS to stderr");

  std::string input, workdir;
  auto* next = app.add_subcommand(
      "next-token",
      "Worker protocol: read input.json (assay.oracle-input.v1), write "
      "output.json (assay.oracle-output.v1) and logits.safetensors into --workdir");
  next->add_option("--input", input, "input.json")->required();
  next->add_option("--workdir", workdir, "workspace directory")->required();

  std::string capture_input, capture_workdir;
  auto* capture = app.add_subcommand(
      "capture",
      "Worker protocol (fidelity jobs): read input.json (assay.oracle-capture-input.v1), write "
      "output.json (assay.oracle-capture-output.v1) and one capture-<i>.safetensors per context "
      "with the F32 logits of its scored positions");
  capture->add_option("--input", capture_input, "input.json")->required();
  capture->add_option("--workdir", capture_workdir, "workspace directory")->required();

  std::string batch_input, batch_workdir;
  auto* batch = app.add_subcommand(
      "next-token-batch",
      "Worker protocol (batch jobs): read input.json (assay.oracle-batch-input.v1), load the model "
      "once and write state-<index>.json and state-<index>.safetensors for every state in turn, "
      "then output.json (assay.oracle-batch-output.v1)");
  batch->add_option("--input", batch_input, "input.json")->required();
  batch->add_option("--workdir", batch_workdir, "workspace directory")->required();

  std::string layers_input, layers_workdir;
  auto* layers = app.add_subcommand(
      "layers",
      "Worker protocol (layer-attribution jobs): read input.json (assay.oracle-layers-input.v1), "
      "write layers.safetensors (the F32 rows of every boundary: embedding, layers.N.*, norm) and "
      "output.json (assay.oracle-layers-output.v1); with a patch, one more forward per named "
      "boundary with the engine's rows substituted there");
  layers->add_option("--input", layers_input, "input.json")->required();
  layers->add_option("--workdir", layers_workdir, "workspace directory")->required();

  std::string serve_input, serve_workdir;
  auto* serve = app.add_subcommand(
      "serve",
      "Worker protocol (resident workers): read input.json (assay.oracle-serve-input.v1), load the "
      "model once through its model_fds, write loaded.json, then run next-token jobs and batches "
      "one at a time as the supervisor names them on the control socket (worker/serve.h)");
  serve->add_option("--input", serve_input, "input.json")->required();
  serve->add_option("--workdir", serve_workdir, "workspace directory")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // A bad command line is an error like any other: one line, exit 2 (not CLI11's 106).
    std::cerr << "assay-oracle: error [usage]: " << e.what() << " (run assay-oracle --help)\n";
    return 2;
  }
  try {
    if (*serve) return run_serve(serve_input, serve_workdir);
    if (*layers) {
      run_layers(parse_layers_input(assay::common::parse_strict(
                     assay::common::read_file(layers_input, 64u << 20))),
                 layers_workdir);
      return 0;
    }
    if (*logits) return run_logits(la);
    if (*capture) return run_capture(capture_input, capture_workdir);
    if (*batch) return run_next_token_batch(batch_input, batch_workdir);
    return run_next_token(input, workdir);
  } catch (const assay::common::Error& e) {
    std::cerr << "assay-oracle: error [" << e.code() << "]: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "assay-oracle: error [oracle.torch]: " << e.what_without_backtrace() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "assay-oracle: error [oracle.internal]: " << e.what() << "\n";
    return 3;
  }
}
