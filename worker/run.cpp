#include "worker/run.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "worker/runtime.h"

namespace assay::oracle {

using common::Error;
using common::Json;

const Clock::time_point kStart = Clock::now();

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

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
  if (device.is_cuda()) {
    load_gpu_backend();
    int count = at::detail::getCUDAHooks().getNumGPUs();
    int index = device.has_index() ? device.index() : 0;
    if (index >= count) {
      throw Error("oracle.device_unavailable", "device \"" + name + "\" requested but " +
                                                   std::to_string(count) + " GPU(s) are visible");
    }
  }
  return device;
}

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

std::map<std::string, std::string> logits_metadata(const Forward& f, const ExecOptions& o,
                                                   std::span<const std::int64_t> ids,
                                                   bool last_position) {
  const Json& torch = torch_identity();
  auto label = [](const Json& v, const Json& otherwise) {
    return v.is_string()           ? v.get<std::string>()
           : otherwise.is_string() ? otherwise.get<std::string>()
                                   : "";
  };
  std::map<std::string, std::string> out{
      {"architecture", f.architecture},
      {"dtype", o.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
      {"device", o.device.str()},
      // Kiln's keys (its reference writer's, qwen35_hf_logits.py), each what this run was: the
      // torch label as torch.__version__ states it, the HIP version as str(torch.version.hip)
      // ("None" on a build without HIP), the token ids as compact JSON.
      {"attention_implementation", f.attention},
      {"linear_attention_implementation", f.linear_attention},
      {"device_name", device_name(o.device)},
      {"input_token_ids", Json(std::vector<std::int64_t>(ids.begin(), ids.end())).dump()},
      {"torch_version", label(torch["version_label"], torch["version"])},
      {"torch_hip_version", label(torch["hip_version"], Json("None"))}};
  if (torch["git_commit"].is_string()) out["torch_commit"] = torch["git_commit"].get<std::string>();
  // The layout Kiln's readers take: input_ids I64 [1, N] and the last position's F32 logits.
  if (last_position) out["schema"] = std::string(common::kKilnFullLogitsSchema);
  return out;
}

namespace {
// Hashed once per process: /proc/self/exe opens the very file that was executed (its path may
// name another file by now), and the kernel refuses writes to a file while it is being executed
// (ETXTBSY), so its bytes cannot change while this process runs. A resident worker's jobs
// then no longer re-read the 45 MB binary each.
const std::string& executable_sha256() {
  static const std::string digest = [] {
    common::UniqueFd fd(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
    struct stat st {};
    if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
      throw Error("oracle.internal", "cannot open /proc/self/exe as a regular file to hash it");
    }
    return common::sha256_fd_id(fd.get(), "/proc/self/exe");
  }();
  return digest;
}
}  // namespace

void add_execution_report(Json& out, const ExecOptions& options, int threads,
                          const std::string& attention, const std::string& linear_attention) {
  out["device"] = options.device.str();
  out["device_name"] = device_name(options.device);
  out["dtype"] = options.dtype == at::kBFloat16 ? "bfloat16" : "float32";
  out["torch_version"] = torch_identity()["version"];
  out["threads"] = threads;
  out["deterministic_algorithms"] = at::globalContext().deterministicAlgorithms();
  out["tf32_allowed"] =
      at::globalContext().allowTF32CuBLAS() || at::globalContext().allowTF32CuDNN();
  out["attention_implementation"] = attention;
  out["linear_attention_implementation"] = linear_attention;
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
  make_deterministic(e.threads);
  ExecOptions options;
  options.device = parse_device(e.device);
  options.dtype = parse_dtype(e.dtype, read_config(files));
  return options;
}

Json next_token_output(const std::filesystem::path& workdir, const std::string& logits_file,
                       std::span<const std::int64_t> ids, const std::vector<Candidate>& candidates,
                       const Forward& f, const ExecOptions& options, const LoadedModel& loaded,
                       const Tokenizer& tokenizer) {
  at::Tensor last = f.logits[-1].contiguous();
  std::span<const float> values(last.data_ptr<float>(), static_cast<std::size_t>(last.numel()));
  write_logits(workdir / logits_file, ids, last, logits_metadata(f, options, ids, true));
  Json out = rank_logits(values, tokenizer, candidates);
  out["schema"] = protocol::kOracleOutput;
  out["architecture"] = f.architecture;
  out["model_type"] = loaded.model_type;
  out["vocab_size"] = loaded.model->vocab_size();
  out["logits_file"] = logits_file;
  out["logits_sha256"] = common::sha256_id(values.data(), values.size_bytes());
  out["input_token_count"] = ids.size();
  out["input_token_ids_sha256"] =
      common::sha256_canonical_id(Json(std::vector<std::int64_t>(ids.begin(), ids.end())));
  return out;
}

}  // namespace assay::oracle
