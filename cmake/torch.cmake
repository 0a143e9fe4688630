# The LibTorch assay-oracle links: the one of a PyTorch 2.x installation, found in this order:
#   -DASSAY_TORCH_DIR=DIR (or the environment's ASSAY_TORCH_DIR): a torch root (the `torch`
#       folder of a wheel, or an unpacked libtorch archive) or its share/cmake/Torch;
#   -DTorch_DIR=DIR: a share/cmake/Torch folder;
#   ASSAY_PYTHON3's `import torch` (scripts/install-deps makes a pinned environment).
# The oracle links only LibTorch's CPU libraries (libtorch_cpu, libc10): it runs on any host,
# and loads the CUDA or ROCm half (libtorch_cuda.so / libtorch_hip.so, beside libtorch_cpu.so) at
# run time when a job asks for a GPU (worker/runtime.cpp). So no CUDA toolkit is needed to build
# it, and a CPU job never maps the GPU libraries. Debian's libtorch-dev (1.13) is refused: it is
# not the PyTorch anyone serves models with, and its logits are not those of torch 2.x.
#
# Sets ASSAY_TORCH_FOUND, ASSAY_TORCH_ROOT, ASSAY_TORCH_VERSION and the target assay::torch.

set(ASSAY_TORCH_DIR "$ENV{ASSAY_TORCH_DIR}" CACHE PATH "PyTorch installation the oracle links")
set(ASSAY_TORCH_FOUND OFF)

function(assay_torch_root_of dir out)
  get_filename_component(dir "${dir}" ABSOLUTE)
  if(EXISTS "${dir}/lib/libtorch_cpu.so" AND EXISTS "${dir}/include/ATen/ATen.h")
    set(${out} "${dir}" PARENT_SCOPE)
  elseif(EXISTS "${dir}/../../../lib/libtorch_cpu.so")  # share/cmake/Torch
    get_filename_component(root "${dir}/../../.." ABSOLUTE)
    set(${out} "${root}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

set(_torch_root "")
if(ASSAY_TORCH_DIR)
  assay_torch_root_of("${ASSAY_TORCH_DIR}" _torch_root)
  if(NOT _torch_root)
    message(FATAL_ERROR "ASSAY_TORCH_DIR=${ASSAY_TORCH_DIR} holds no lib/libtorch_cpu.so and "
                        "include/ATen/ATen.h (give a torch root or its share/cmake/Torch)")
  endif()
elseif(Torch_DIR)
  assay_torch_root_of("${Torch_DIR}" _torch_root)
  if(NOT _torch_root)
    message(FATAL_ERROR "Torch_DIR=${Torch_DIR} is not the share/cmake/Torch of a LibTorch")
  endif()
elseif(ASSAY_PYTHON3)
  execute_process(
    COMMAND "${ASSAY_PYTHON3}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE _torch_py_root OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET RESULT_VARIABLE _torch_py_rc)
  if(_torch_py_rc EQUAL 0)
    assay_torch_root_of("${_torch_py_root}" _torch_root)
  endif()
endif()

if(_torch_root)
  # MAJOR/MINOR/PATCH defines: torch/headeronly/version.h (2.9+) or torch/csrc/api's (older).
  set(ASSAY_TORCH_VERSION "")
  foreach(header torch/headeronly/version.h torch/csrc/api/include/torch/version.h)
    set(_header "${_torch_root}/include/${header}")
    if(NOT ASSAY_TORCH_VERSION AND EXISTS "${_header}")
      file(READ "${_header}" _text)
      if(_text MATCHES "TORCH_VERSION_MAJOR ([0-9]+)")
        set(_major ${CMAKE_MATCH_1})
        string(REGEX MATCH "TORCH_VERSION_MINOR ([0-9]+)" _ "${_text}")
        set(_minor ${CMAKE_MATCH_1})
        string(REGEX MATCH "TORCH_VERSION_PATCH ([0-9]+)" _ "${_text}")
        set(ASSAY_TORCH_VERSION "${_major}.${_minor}.${CMAKE_MATCH_1}")
      endif()
    endif()
  endforeach()
  if(NOT ASSAY_TORCH_VERSION OR ASSAY_TORCH_VERSION VERSION_LESS 2.0)
    message(FATAL_ERROR "LibTorch ${ASSAY_TORCH_VERSION} at ${_torch_root}: assay-oracle needs "
                        "PyTorch 2.x (scripts/install-deps makes the pinned environment)")
  endif()
  # The C++ ABI the library was built with, as its own CMake config states it.
  set(_torch_abi 1)
  set(_torch_config "${_torch_root}/share/cmake/Torch/TorchConfig.cmake")
  if(EXISTS "${_torch_config}")
    file(STRINGS "${_torch_config}" _abi_line REGEX "_GLIBCXX_USE_CXX11_ABI=[01]")
    if(_abi_line MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
      set(_torch_abi ${CMAKE_MATCH_1})
    endif()
  endif()
  add_library(assay_torch INTERFACE)
  add_library(assay::torch ALIAS assay_torch)
  # LibTorch's headers are not -Wextra clean: system headers.
  target_include_directories(assay_torch SYSTEM INTERFACE
    "${_torch_root}/include" "${_torch_root}/include/torch/csrc/api/include")
  target_compile_definitions(assay_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
  target_link_libraries(assay_torch INTERFACE
    "${_torch_root}/lib/libtorch_cpu.so" "${_torch_root}/lib/libc10.so")
  set(ASSAY_TORCH_ROOT "${_torch_root}")
  set(ASSAY_TORCH_FOUND ON)
  message(STATUS "LibTorch ${ASSAY_TORCH_VERSION} (C++11 ABI ${_torch_abi}) at ${_torch_root}")
endif()
