#include "worker/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/DispatchStub.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>
#ifdef ASSAY_ORACLE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace assay::oracle {

using common::Json;

namespace {

std::string precision_name(at::Float32MatmulPrecision p) {
  switch (p) {
    case at::Float32MatmulPrecision::HIGHEST:
      return "highest";
    case at::Float32MatmulPrecision::HIGH:
      return "high";
    case at::Float32MatmulPrecision::MEDIUM:
      return "medium";
  }
  return "unknown";
}

// "KEY=value" from show_config's "Build settings" line, or null.
Json build_setting(const std::string& config, const std::string& key) {
  auto at = config.find(key + "=");
  if (at == std::string::npos) return nullptr;
  auto begin = at + key.size() + 1;
  auto end = config.find_first_of(",\n", begin);
  std::string v = config.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  return v.empty() ? Json(nullptr) : Json(v);
}

Json nonempty(const std::string& s) {
  return s.empty() ? Json(nullptr) : Json(s);
}

// The first "key : value" of /proc/cpuinfo for `key`.
std::string cpuinfo_value(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with(key)) continue;
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(name.find_last_not_of(" \t") + 1);
    if (name != key) continue;
    auto v = line.find_first_not_of(' ', colon + 1);
    return v == std::string::npos ? "" : line.substr(v);
  }
  return "";
}

Json cpu_report() {
  std::ifstream f("/proc/cpuinfo");
  std::stringstream text;
  text << f.rdbuf();
  std::string model = cpuinfo_value(text.str(), "model name");
  // The flags ATen's and oneDNN's dispatch pick kernels by.
  static constexpr const char* kKernelFlags[] = {
      "sse4_2",   "avx",      "avx2",        "fma",         "f16c",        "avx512f",  "avx512dq",
      "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
      "amx_bf16", "amx_int8", "asimd",       "sve",         "bf16",        "i8mm"};
  std::set<std::string> flags;
  std::istringstream words(cpuinfo_value(text.str(), "flags") +
                           cpuinfo_value(text.str(), "Features"));
  for (std::string w; words >> w;) flags.insert(w);
  Json kernel_flags = Json::array();
  for (const char* k : kKernelFlags)
    if (flags.count(k)) kernel_flags.push_back(k);
  return Json{{"model", nonempty(model)},
              {"logical_cpus", std::thread::hardware_concurrency()},
              {"kernel_flags", kernel_flags}};
}

// The kernel set ATen dispatches to, as at::show_config() states it ("CPU capability usage:
// AVX2"): get_cpu_capability() is not exported by every LibTorch build.
std::string cpu_capability_name() {
  std::string config = at::show_config();
  const std::string key = "CPU capability usage:";
  auto at = config.find(key);
  if (at == std::string::npos) return "unknown";
  auto start = config.find_first_not_of(' ', at + key.size());
  auto end = config.find('\n', start);
  return config.substr(start, end == std::string::npos ? end : end - start);
}

Json gpu_report([[maybe_unused]] const c10::Device& device) {
#ifdef ASSAY_ORACLE_CUDA
  if (device.is_cuda()) {
    // Compiled only against a CUDA/ROCm LibTorch; untested on this project's CPU hosts.
    int index = device.has_index() ? device.index() : 0;
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
#ifdef USE_ROCM
    const char* platform = "hip";
#else
    const char* platform = "cuda";
#endif
    return Json{{"platform", platform},
                {"index", index},
                {"name", std::string(p->name)},
                {"compute_capability", std::to_string(p->major) + "." + std::to_string(p->minor)},
                {"total_memory_bytes", static_cast<std::uint64_t>(p->totalGlobalMem)},
                {"driver_version", driver},
                {"runtime_version", runtime}};
  }
#endif
  return nullptr;
}

bool is_runtime_library(const std::string& name) {
  static constexpr const char* kPrefixes[] = {
      "libtorch",  "libc10",     "libcaffe2",   "libshm",       "libgomp",   "libiomp",
      "libomp",    "libmkl",     "libdnnl",     "libmkldnn",    "libblas",   "libopenblas",
      "liblapack", "libsleef",   "libcudnn",    "libcublas",    "libcudart", "libnvrtc",
      "libcufft",  "libcurand",  "libcusparse", "libcusolver",  "libnccl",   "libamdhip64",
      "libMIOpen", "librocblas", "libhipblas",  "libhipblaslt", "librccl",   "libroctx64"};
  if (name.find(".so") == std::string::npos) return false;
  return std::any_of(std::begin(kPrefixes), std::end(kPrefixes),
                     [&](const char* p) { return name.starts_with(p); });
}

}  // namespace

Json execution_configuration(const ExecOptions& options, const std::string& attention,
                             const std::string& linear_attention) {
  auto& ctx = at::globalContext();
  const char* workspace = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  return Json{{"dtype", options.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
              {"device", options.device.str()},
              {"deterministic_algorithms", ctx.deterministicAlgorithms()},
              {"deterministic_algorithms_warn_only", ctx.deterministicAlgorithmsWarnOnly()},
              {"tf32_cublas", ctx.allowTF32CuBLAS()},
              {"tf32_cudnn", ctx.allowTF32CuDNN()},
              {"cudnn_benchmark", ctx.benchmarkCuDNN()},
              {"cudnn_deterministic", ctx.deterministicCuDNN()},
              {"float32_matmul_precision", precision_name(ctx.float32MatmulPrecision())},
              {"fp16_reduction_cublas", ctx.allowFP16ReductionCuBLAS()},
              {"intra_op_threads", at::get_num_threads()},
              {"inter_op_threads", at::get_num_interop_threads()},
              {"cublas_workspace_config", workspace ? Json(workspace) : Json(nullptr)},
              {"inference_mode", true},
              {"attention_implementation", attention},
              {"linear_attention_implementation", linear_attention},
              {"gdn_variant", options.gdn_variant}};
}

Json runtime_report(const c10::Device& device) {
  std::string config = at::show_config();
  return Json{
      {"torch_version", TORCH_VERSION},
      {"show_config", config},
      {"parallel_info", at::get_parallel_info()},
      {"blas", build_setting(config, "BLAS_INFO")},
      {"lapack", build_setting(config, "LAPACK_INFO")},
      {"mkl_version", at::hasMKL() ? nonempty(at::get_mkl_version()) : Json(nullptr)},
      {"onednn_version", at::hasMKLDNN() ? nonempty(at::get_mkldnn_version()) : Json(nullptr)},
      {"openmp_version", nonempty(at::get_openmp_version())},
      {"cpu_capability", cpu_capability_name()},
      {"cpu", cpu_report()},
      {"gpu", gpu_report(device)}};
}

Json loaded_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> paths;
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.ends_with(" (deleted)")) continue;  // replaced since: nothing left to hash
    std::string name = path.substr(path.rfind('/') + 1);
    if (is_runtime_library(name)) paths.insert(path);
  }
  return Json(std::vector<std::string>(paths.begin(), paths.end()));
}

}  // namespace assay::oracle
