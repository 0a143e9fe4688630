#include "worker/runtime.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/native/DispatchStub.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>

#include "common/error.h"

namespace assay::oracle {

using common::Error;
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

// The folder of the libtorch_cpu.so mapped in this process (the LibTorch it links).
std::filesystem::path torch_library_dir() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) {
        std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.ends_with("/libtorch_cpu.so")) {
          *static_cast<std::string*>(out) = name;
          return 1;
        }
        return 0;
      },
      &found);
  if (found.empty()) return {};
  return std::filesystem::weakly_canonical(found).parent_path();
}

// The GPU runtime's C entry points, from the libraries libtorch_cuda/libtorch_hip brought in;
// looked up by name so that the oracle builds without a CUDA or ROCm toolkit.
template <typename F>
F runtime_symbol(void* library, const char* name) {
  void* p = dlsym(library ? library : RTLD_DEFAULT, name);
  return reinterpret_cast<F>(p);
}

bool is_hip() {
  return at::detail::getCUDAHooks().hasROCM();
}

Json cuda_report(int index) {
  // cudaDeviceAttr values from the CUDA runtime's driver_types.h (stable since CUDA 3).
  constexpr int kComputeCapabilityMajor = 75, kComputeCapabilityMinor = 76;
  using AttrFn = int (*)(int*, int, int);
  using VersionFn = int (*)(int*);
  using MemFn = int (*)(std::size_t*, std::size_t*);
  using SetFn = int (*)(int);
  auto attr = runtime_symbol<AttrFn>(nullptr, "cudaDeviceGetAttribute");
  auto driver_version = runtime_symbol<VersionFn>(nullptr, "cudaDriverGetVersion");
  auto runtime_version = runtime_symbol<VersionFn>(nullptr, "cudaRuntimeGetVersion");
  auto mem_info = runtime_symbol<MemFn>(nullptr, "cudaMemGetInfo");
  auto set_device = runtime_symbol<SetFn>(nullptr, "cudaSetDevice");
  // The device's name is the driver API's (libcuda, loaded by the runtime when it started).
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  using DeviceGetFn = int (*)(int*, int);
  using NameFn = int (*)(char*, int, int);
  auto device_get = runtime_symbol<DeviceGetFn>(libcuda, "cuDeviceGet");
  auto get_name = runtime_symbol<NameFn>(libcuda, "cuDeviceGetName");
  if (!attr || !driver_version || !runtime_version || !mem_info || !set_device) {
    throw Error("oracle.device_unavailable",
                "the CUDA runtime LibTorch loaded does not export cudaDeviceGetAttribute, "
                "cudaDriverGetVersion, cudaRuntimeGetVersion, cudaMemGetInfo and cudaSetDevice");
  }
  int major = -1, minor = -1, driver = 0, runtime = 0;
  std::size_t free_bytes = 0, total_bytes = 0;
  set_device(index);
  attr(&major, kComputeCapabilityMajor, index);
  attr(&minor, kComputeCapabilityMinor, index);
  driver_version(&driver);
  runtime_version(&runtime);
  mem_info(&free_bytes, &total_bytes);
  char name[256] = {};
  int dev = 0;
  bool named = device_get && get_name && device_get(&dev, index) == 0 &&
               get_name(name, sizeof name - 1, dev) == 0;
  return Json{{"name", named ? Json(std::string(name)) : Json(nullptr)},
              {"compute_capability", std::to_string(major) + "." + std::to_string(minor)},
              {"total_memory_bytes", static_cast<std::uint64_t>(total_bytes)},
              {"driver_version", driver},
              {"runtime_version", runtime}};
}

Json hip_report(int index) {
  using NameFn = int (*)(char*, int, int);
  using VersionFn = int (*)(int*);
  using MemFn = int (*)(std::size_t*, std::size_t*);
  using SetFn = int (*)(int);
  auto get_name = runtime_symbol<NameFn>(nullptr, "hipDeviceGetName");
  auto driver_version = runtime_symbol<VersionFn>(nullptr, "hipDriverGetVersion");
  auto runtime_version = runtime_symbol<VersionFn>(nullptr, "hipRuntimeGetVersion");
  auto mem_info = runtime_symbol<MemFn>(nullptr, "hipMemGetInfo");
  auto set_device = runtime_symbol<SetFn>(nullptr, "hipSetDevice");
  if (!get_name || !driver_version || !runtime_version || !mem_info || !set_device) {
    throw Error("oracle.device_unavailable",
                "the HIP runtime LibTorch loaded does not export hipDeviceGetName, "
                "hipDriverGetVersion, hipRuntimeGetVersion, hipMemGetInfo and hipSetDevice");
  }
  char name[256] = {};
  int driver = 0, runtime = 0;
  std::size_t free_bytes = 0, total_bytes = 0;
  set_device(index);
  bool named = get_name(name, sizeof name - 1, index) == 0;
  driver_version(&driver);
  runtime_version(&runtime);
  mem_info(&free_bytes, &total_bytes);
  // A compute capability is CUDA's notion; the gfx target is in hooks_config.
  return Json{{"name", named ? Json(std::string(name)) : Json(nullptr)},
              {"compute_capability", nullptr},
              {"total_memory_bytes", static_cast<std::uint64_t>(total_bytes)},
              {"driver_version", driver},
              {"runtime_version", runtime}};
}

Json gpu_report(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  const auto& hooks = at::detail::getCUDAHooks();
  int index = device.has_index() ? device.index() : 0;
  Json out = is_hip() ? hip_report(index) : cuda_report(index);
  out["platform"] = is_hip() ? "hip" : "cuda";
  out["index"] = index;
  out["cudnn_version"] = is_hip() ? hooks.versionMIOpen() : hooks.versionRuntimeCuDNN();
  out["hooks_config"] = hooks.showConfig();
  return out;
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
  return Json{
      {"dtype", options.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
      {"device", options.device.str()},
      {"deterministic_algorithms", ctx.deterministicAlgorithms()},
      {"deterministic_algorithms_warn_only", ctx.deterministicAlgorithmsWarnOnly()},
      {"tf32_cublas", ctx.allowTF32CuBLAS()},
      {"tf32_cudnn", ctx.allowTF32CuDNN()},
      {"cudnn_benchmark", ctx.benchmarkCuDNN()},
      {"cudnn_deterministic", ctx.deterministicCuDNN()},
      {"float32_matmul_precision", precision_name(ctx.float32MatmulPrecision())},
      // torch's defaults, as transformers runs (reduced-precision split-K reductions
      // allowed); recorded, not changed.
      {"fp16_reduction_cublas", ctx.allowFP16ReductionCuBLAS() ==
                                    at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK},
      {"bf16_reduction_cublas", ctx.allowBF16ReductionCuBLAS() ==
                                    at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK},
      {"intra_op_threads", at::get_num_threads()},
      {"inter_op_threads", at::get_num_interop_threads()},
      {"cublas_workspace_config", workspace ? Json(workspace) : Json(nullptr)},
      {"inference_mode", true},
      {"attention_implementation", attention},
      {"linear_attention_implementation", linear_attention}};
}

Json runtime_report(const c10::Device& device) {
  std::string config = at::show_config();
  return Json{
      {"torch_version", torch_identity()["version"]},
      {"torch", torch_identity()},
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

Json torch_version_file(const std::filesystem::path& version_py) {
  Json out{{"version_label", nullptr}, {"hip_version", nullptr}};
  std::ifstream in(version_py);
  // `NAME = 'value'` or `NAME: Optional[str] = 'value'`; None (or anything unquoted) stays null.
  auto quoted = [](const std::string& line) -> Json {
    auto eq = line.find('=');
    if (eq == std::string::npos) return nullptr;
    auto q = line.find_first_of("'\"", eq);
    auto e = q == std::string::npos ? q : line.find(line[q], q + 1);
    if (e == std::string::npos || e == q + 1) return nullptr;
    return line.substr(q + 1, e - q - 1);
  };
  auto named = [](const std::string& line, std::string_view name) {
    return line.starts_with(name) && line.size() > name.size() &&
           (line[name.size()] == ' ' || line[name.size()] == '=' || line[name.size()] == ':');
  };
  for (std::string line; std::getline(in, line);) {
    if (named(line, "__version__")) out["version_label"] = quoted(line);
    if (named(line, "hip")) out["hip_version"] = quoted(line);
  }
  return out;
}

const Json& torch_identity() {
  // The loaded library cannot change within the process: read once.
  static const Json identity = [] {
    std::string config = at::show_config();
    std::filesystem::path dir = torch_library_dir();
    // The wheel's label (with its local part, "+cu130") and the HIP version of a ROCm build (what
    // torch.version.hip reports; show_config has no such setting) are written beside the
    // library, not in it.
    Json version_py =
        dir.empty() ? torch_version_file({}) : torch_version_file(dir / ".." / "version.py");
    return Json{{"version", build_setting(config, "TORCH_VERSION")},
                {"version_label", version_py["version_label"]},
                {"git_commit", build_setting(config, "COMMIT_SHA")},
                {"cuda_version", build_setting(config, "CUDA_VERSION")},
                {"hip_version", version_py["hip_version"]},
                {"compiled_against", TORCH_VERSION},
                {"library_dir", dir.empty() ? Json(nullptr) : Json(dir.string())}};
  }();
  return identity;
}

void load_gpu_backend() {
  static bool loaded = false;
  if (loaded) return;
  std::filesystem::path dir = torch_library_dir();
  if (dir.empty()) {
    throw Error("oracle.device_unavailable", "no libtorch_cpu.so is mapped in this process");
  }
  std::filesystem::path library;
  for (const char* name : {"libtorch_cuda.so", "libtorch_hip.so"}) {
    if (std::filesystem::exists(dir / name)) {
      library = dir / name;
      break;
    }
  }
  if (library.empty()) {
    throw Error("oracle.device_unavailable",
                "a GPU was requested but the LibTorch at " + dir.string() +
                    " has neither libtorch_cuda.so nor libtorch_hip.so (a CPU build); build "
                    "assay-oracle against this host's CUDA or ROCm PyTorch (packaging/README.md)");
  }
  if (!dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
    throw Error("oracle.device_unavailable", library.string() + " does not load: " + dlerror());
  }
  if (!at::hasCUDA()) {
    throw Error("oracle.device_unavailable",
                library.string() +
                    " loaded but sees no usable GPU (driver, device nodes, or "
                    "CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)");
  }
  loaded = true;
}

std::string device_name(const c10::Device& device) {
  if (device.is_cuda()) {
    Json gpu = gpu_report(device);
    return gpu["name"].is_string() ? gpu["name"].get<std::string>() : device.str();
  }
  std::string model = cpuinfo_value(
      [] {
        std::ifstream f("/proc/cpuinfo");
        std::stringstream text;
        text << f.rdbuf();
        return text.str();
      }(),
      "model name");
  return model.empty() ? "cpu" : model;
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
