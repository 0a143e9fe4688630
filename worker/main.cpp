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
#ifdef ASSAY_ORACLE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "worker/capture.h"
#include "worker/loader.h"
#include "worker/model_files.h"
#include "worker/next_token.h"
#include "worker/runtime.h"
#include "worker/tokenizer.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;
using Clock = std::chrono::steady_clock;

const Clock::time_point kStart = Clock::now();

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

// Deterministic algorithms, no TF32, a fixed number of threads. Must run before any ATen work.
void make_deterministic(int threads) {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::set_num_interop_threads(1);
  at::set_num_threads(threads);
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
  ctx.setAllowTF32CuBLAS(false);
  ctx.setAllowTF32CuDNN(false);
  ctx.setBenchmarkCuDNN(false);
  ctx.setDeterministicCuDNN(true);
  ctx.setFloat32MatmulPrecision("highest");
}

c10::ScalarType parse_dtype(const std::string& requested, const Json& config) {
  std::string name = requested.empty() ? declared_dtype(config) : requested;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float32") return at::kFloat;
  if (requested.empty()) {
    throw Error("model.unsupported",
                "config.json declares dtype \"" + name +
                    "\"; pass --dtype bfloat16 or --dtype float32 to choose one");
  }
  throw Error("input.invalid", "dtype \"" + name + "\" is not bfloat16 or float32");
}

c10::Device parse_device(const std::string& name) {
  if (name != "cpu" && name != "cuda" && !name.starts_with("cuda:")) {
    throw Error("input.invalid", "device \"" + name + "\" is not cpu, cuda or cuda:N");
  }
  c10::Device device(name);
  if (device.is_cuda() && !at::hasCUDA()) {
    throw Error("oracle.device_unavailable",
                "device \"" + name + "\" requested but this LibTorch build has no usable CUDA");
  }
  return device;
}

std::string device_name(const c10::Device& device) {
#ifdef ASSAY_ORACLE_CUDA
  if (device.is_cuda()) {
    return at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0)->name;
  }
#endif
  if (device.is_cpu()) {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line)) {
      if (line.starts_with("model name")) {
        auto colon = line.find(':');
        if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
      }
    }
    return "cpu";
  }
  return device.str();
}

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

struct Forward {
  at::Tensor logits;  // F32 [T, vocab] on CPU, contiguous
  double load_seconds = 0, forward_seconds = 0;
  std::string architecture, attention, linear_attention;
};

Forward run_forward(const std::filesystem::path& model_dir, std::span<const std::int64_t> ids,
                    const ExecOptions& options, const LoadedModel& loaded) {
  Forward out;
  out.architecture = loaded.model->architecture();
  out.attention = loaded.model->attention_implementation();
  out.linear_attention = loaded.model->linear_attention_implementation();
  check_token_ids(ids, loaded.model->vocab_size(), "input_token_ids");
  auto t0 = Clock::now();
  c10::InferenceMode guard;
  at::Tensor input = at::tensor(std::vector<std::int64_t>(ids.begin(), ids.end()), at::kLong)
                         .unsqueeze(0)
                         .to(options.device);
  at::Tensor logits = loaded.model->forward(input);
  auto t = static_cast<std::int64_t>(ids.size());
  if (logits.dim() != 3 || logits.size(0) != 1 || logits.size(1) != t ||
      logits.size(2) != loaded.model->vocab_size() || logits.scalar_type() != options.dtype) {
    throw Error("oracle.internal", model_dir.string() + ": forward returned logits " +
                                       logits.toString() + " of the wrong shape or dtype");
  }
  out.logits = logits[0].to(at::kFloat).to(at::kCPU).contiguous();
  out.forward_seconds = seconds_since(t0);
  return out;
}

void write_logits(const std::filesystem::path& path, std::span<const std::int64_t> ids,
                  const at::Tensor& logits, const std::map<std::string, std::string>& metadata) {
  std::vector<std::int64_t> logits_shape(logits.sizes().begin(), logits.sizes().end());
  common::write_safetensors(path,
                            {{"input_ids",
                              common::Dtype::kI64,
                              {1, static_cast<std::int64_t>(ids.size())},
                              std::as_bytes(ids)},
                             {"logits",
                              common::Dtype::kF32,
                              logits_shape,
                              {reinterpret_cast<const std::byte*>(logits.data_ptr<float>()),
                               static_cast<std::size_t>(logits.numel()) * sizeof(float)}}},
                            metadata);
}

std::map<std::string, std::string> logits_metadata(const Forward& f, const ExecOptions& o) {
  return {{"architecture", f.architecture},
          {"dtype", o.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
          {"device", o.device.str()},
          {"torch_version", TORCH_VERSION}};
}

struct LogitsArgs {
  std::string model, token_ids, out, device = "cpu", dtype, gdn_variant = "current";
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
  options.gdn_variant = a.gdn_variant;
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  Forward f = run_forward(a.model, ids, options, loaded);
  at::Tensor logits = a.all_positions ? f.logits : f.logits[-1].contiguous();
  write_logits(a.out, ids, logits, logits_metadata(f, options));
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

std::string executable_sha256() {
  return common::sha256_file_id(std::filesystem::read_symlink("/proc/self/exe"));
}

// What every worker-protocol output says about how it ran.
void add_execution_report(Json& out, const ExecOptions& options, int threads,
                          const std::string& attention, const std::string& linear_attention) {
  out["device"] = options.device.str();
  out["device_name"] = device_name(options.device);
  out["dtype"] = options.dtype == at::kBFloat16 ? "bfloat16" : "float32";
  out["torch_version"] = TORCH_VERSION;
  out["threads"] = threads;
  out["deterministic_algorithms"] = at::globalContext().deterministicAlgorithms();
  out["tf32_allowed"] =
      at::globalContext().allowTF32CuBLAS() || at::globalContext().allowTF32CuDNN();
  out["attention_implementation"] = attention;
  out["linear_attention_implementation"] = linear_attention;
  out["gdn_variant"] = options.gdn_variant;
  out["executable_sha256"] = executable_sha256();
  Json configuration = execution_configuration(options, attention, linear_attention);
  out["configuration_sha256"] = common::sha256_canonical_id(configuration);
  out["configuration"] = std::move(configuration);
  out["runtime"] = runtime_report(options.device);
  out["loaded_libraries"] = loaded_libraries();
}

ModelFiles open_model_files(const std::filesystem::path& dir, const ModelFds& fds) {
  return fds ? ModelFiles::from_fds(dir, *fds) : ModelFiles::from_directory(dir);
}

// The worker-protocol "execution" object as options, after making ATen deterministic (which
// must come before any ATen work).
ExecOptions prepare_execution(const Execution& e, ModelFiles& files) {
  if (e.gdn_variant != "current" && e.gdn_variant != "legacy") {
    throw Error("input.invalid",
                "execution.gdn_variant \"" + e.gdn_variant + "\" is not current or legacy");
  }
  make_deterministic(e.threads);
  ExecOptions options;
  options.device = parse_device(e.device);
  options.dtype = parse_dtype(e.dtype, read_config(files));
  options.gdn_variant = e.gdn_variant;
  return options;
}

int run_next_token(const std::string& input_path, const std::string& workdir) {
  Json doc = common::parse_strict(common::read_file(input_path, 64u << 20));
  OracleInput in = parse_oracle_input(doc);
  ModelFiles files = open_model_files(in.model_dir, in.model_fds);
  ExecOptions options = prepare_execution(in.execution, files);

  Tokenizer tokenizer = Tokenizer::load(files);
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  check_candidates(in.candidates, tokenizer, loaded.model->vocab_size());
  check_prefix_texts(in.continuation_prefix, tokenizer);
  Forward f = run_forward(in.model_dir, in.input_token_ids, options, loaded);
  at::Tensor last = f.logits[-1].contiguous();
  std::span<const float> values(last.data_ptr<float>(), static_cast<std::size_t>(last.numel()));

  std::filesystem::path dir(workdir);
  write_logits(dir / "logits.safetensors", in.input_token_ids, last, logits_metadata(f, options));
  Json out = rank_logits(values, tokenizer, in.candidates);
  out["schema"] = protocol::kOracleOutput;
  out["architecture"] = f.architecture;
  out["model_type"] = loaded.model_type;
  out["vocab_size"] = loaded.model->vocab_size();
  out["logits_file"] = "logits.safetensors";
  out["logits_sha256"] = common::sha256_id(values.data(), values.size_bytes());
  out["input_token_count"] = in.input_token_ids.size();
  out["input_token_ids_sha256"] = common::sha256_canonical_id(Json(in.input_token_ids));
  out["bytes_used"] = bytes_used(files, loaded.weight_files);
  add_execution_report(out, options, in.execution.threads, f.attention, f.linear_attention);
  out["load_seconds"] = load_seconds;
  out["forward_seconds"] = f.forward_seconds;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["duration_seconds"] = seconds_since(kStart);
  common::atomic_write_file(dir / protocol::kOutputFile, out.dump(2) + "\n");
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
      {"torch_version", TORCH_VERSION},
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
  common::atomic_write_file(dir / protocol::kOutputFile, out.dump(2) + "\n");
  return 0;
}

}  // namespace
}  // namespace assay::oracle

int main(int argc, char** argv) {
  using namespace assay::oracle;
  CLI::App app{"assay-oracle: eager, deterministic reference forward (LibTorch " TORCH_VERSION ")"};
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
  logits->add_option("--gdn-variant", la.gdn_variant, "Qwen3.5 Gated DeltaNet: current|legacy")
      ->check(CLI::IsMember({"current", "legacy"}))
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

  CLI11_PARSE(app, argc, argv);
  try {
    if (*logits) return run_logits(la);
    if (*capture) return run_capture(capture_input, capture_workdir);
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
