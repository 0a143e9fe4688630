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
// inference_mode, attention_implementation, linear_attention_implementation, gdn_variant}:
// each read back from ATen (or the environment) after make_deterministic, not echoed from input.
common::Json execution_configuration(const ExecOptions& options, const std::string& attention,
                                     const std::string& linear_attention);

// {torch_version, show_config, parallel_info, blas, lapack, mkl_version, onednn_version,
// openmp_version, cpu_capability, cpu {model, logical_cpus, kernel_flags}, gpu}. gpu is null on
// CPU; on CUDA/HIP {platform, name, compute_capability, total_memory_bytes, driver_version,
// runtime_version}.
common::Json runtime_report(const c10::Device& device);

// Absolute paths of the LibTorch and runtime libraries (libtorch*, libc10*, BLAS, oneDNN,
// OpenMP, CUDA/ROCm) mapped in this process, from /proc/self/maps, sorted and unique.
common::Json loaded_libraries();

}  // namespace assay::oracle
