// What the oracle reports about how and on what it ran: the fixed execution configuration it
// enforced (read back from ATen, hashed canonically), the runtime LibTorch and the host report,
// and the runtime shared objects mapped in its process (which the supervisor hashes itself).
#pragma once

#include <string>

#include "common/json.h"
#include "worker/model.h"

namespace assay::oracle {

// {dtype, device, deterministic_algorithms, deterministic_algorithms_warn_only, tf32_cublas,
// tf32_cudnn, cudnn_benchmark, cudnn_deterministic, float32_matmul_precision,
// fp16_reduction_cublas, intra_op_threads, inter_op_threads, cublas_workspace_config,
// inference_mode, attention_implementation, linear_attention_implementation}:
// each read back from ATen (or the environment) after make_deterministic, not echoed from input.
common::Json execution_configuration(const ExecOptions& options, const std::string& attention,
                                     const std::string& linear_attention);

// The LibTorch this process runs, as the loaded library states it (at::show_config(), compiled
// into libtorch_cpu.so), never the headers assay was compiled against: {version (e.g. "2.13.0"),
// version_label (torch/version.py beside the library, e.g. "2.13.0+cu130", or null), git_commit,
// cuda_version (a build setting, or null), hip_version (torch/version.py's hip: a ROCm build's
// HIP version, as torch.version.hip reports it, or null), compiled_against (the header's
// TORCH_VERSION), library_dir}. Labels only: the loaded libraries' sha256 (loaded_libraries(),
// hashed by the supervisor) is the identity. Read once per process.
const common::Json& torch_identity();

// {version_label, hip_version} as torch/version.py states them (its __version__ and hip), each
// null when the file, the line or a quoted value is missing (a CUDA or CPU build's `hip = None`).
common::Json torch_version_file(const std::filesystem::path& version_py);

// The CUDA or ROCm half of LibTorch (libtorch_cuda.so or libtorch_hip.so, beside the
// libtorch_cpu.so this process mapped), loaded once with its kernels and hooks. Throws
// common::Error("oracle.device_unavailable") naming the folder when there is none, when it
// does not load, or when it sees no GPU. ROCm's HIP devices are "cuda" to LibTorch too.
void load_gpu_backend();

// A short name of the device: the CPU model, or the GPU's name.
std::string device_name(const c10::Device& device);

// {version, ... as torch_identity(), show_config, parallel_info, blas, lapack, mkl_version,
// onednn_version, openmp_version, cpu_capability, cpu {model, logical_cpus, kernel_flags}, gpu}.
// gpu is null on CPU; on CUDA/HIP {platform, index, name, compute_capability (null on HIP),
// total_memory_bytes, driver_version, runtime_version, cudnn_version (MIOpen's on HIP),
// hooks_config}.
common::Json runtime_report(const c10::Device& device);

// Absolute paths of the LibTorch and runtime libraries (libtorch*, libc10*, BLAS, oneDNN,
// OpenMP, CUDA/ROCm) mapped in this process, from /proc/self/maps, sorted and unique.
common::Json loaded_libraries();

}  // namespace assay::oracle
