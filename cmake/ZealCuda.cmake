# Enables CUDA when nvcc exists (and ZEAL_CUDA is ON): sets ZEAL_HAVE_CUDA, ZEAL_HAVE_NCCL and the
# imported target CUDA::cudart. Machines without a GPU still compile every .cu file and every CUDA
# branch of the engine, and link them (libzeal is linked with --no-undefined).
#
# NCCL: LibTorch's own copy first (the nvidia-nccl wheel beside a pip-installed torch, the one its
# CUDA half loads, so the process holds one NCCL), then the toolkit's, then the system's. nvcc
# without NCCL builds the kernels but no NCCL communicator, and says so loudly.
#
# -DZEAL_REQUIRE_CUDA=ON (scripts/gpu-check): configuring fails unless nvcc, LibTorch's CUDA half,
# NCCL and sm_90 kernels (for H100/H200) are all in.
option(ZEAL_REQUIRE_CUDA "Fail unless nvcc, LibTorch's CUDA half, NCCL and sm_90 are all available" OFF)
set(ZEAL_HAVE_CUDA OFF)
set(ZEAL_HAVE_NCCL OFF)
if(ZEAL_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere and Hopper; pass -DCMAKE_CUDA_ARCHITECTURES=native on the machine that runs it.
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    find_package(CUDAToolkit REQUIRED)
    set(ZEAL_HAVE_CUDA ON)

    set(_nccl_hints "")
    get_filename_component(_site "${ZEAL_TORCH_DIR}" DIRECTORY)
    if(EXISTS "${_site}/nvidia")
      file(GLOB_RECURSE _torch_nccl LIST_DIRECTORIES false "${_site}/nvidia/libnccl.so*")
      foreach(_lib IN LISTS _torch_nccl)
        get_filename_component(_dir "${_lib}" DIRECTORY)
        get_filename_component(_up "${_dir}" DIRECTORY)
        list(APPEND _nccl_hints "${_up}")
      endforeach()
    endif()
    # torch's copy alone first (header and library from the same NCCL), then the toolkit's and the
    # system's; pip's wheels ship libnccl.so.2 without the unversioned link.
    if(_nccl_hints)
      find_path(ZEAL_NCCL_INCLUDE_DIR nccl.h PATHS ${_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
      find_library(ZEAL_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR PATHS ${_nccl_hints}
                   PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
    endif()
    find_path(ZEAL_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_TARGET_DIR}
              PATH_SUFFIXES include)
    find_library(ZEAL_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
                 HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_TARGET_DIR} PATH_SUFFIXES lib lib64)
    set(_nccl_version "")
    if(ZEAL_NCCL_INCLUDE_DIR)
      file(STRINGS "${ZEAL_NCCL_INCLUDE_DIR}/nccl.h" _v REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3" _nccl_version "${_v}")
    endif()
    if(ZEAL_NCCL_INCLUDE_DIR AND ZEAL_NCCL_LIBRARY)
      set(ZEAL_HAVE_NCCL ON)
    else()
      message(WARNING "zeal: nvcc found but NCCL not (header: '${ZEAL_NCCL_INCLUDE_DIR}', library: "
                      "'${ZEAL_NCCL_LIBRARY}'): the CUDA kernels are built, the NCCL communicator is NOT, and "
                      "ranks on GPUs will need ZEAL_COMM_BACKEND=gloo. Install NCCL (the toolkit's, Debian's "
                      "libnccl-dev, or pip's nvidia-nccl beside torch) or pass -DZEAL_NCCL_INCLUDE_DIR and "
                      "-DZEAL_NCCL_LIBRARY")
    endif()
    message(STATUS "CUDA ${CUDAToolkit_VERSION} (${CMAKE_CUDA_COMPILER}), architectures "
                   "${CMAKE_CUDA_ARCHITECTURES}; NCCL: ${ZEAL_HAVE_NCCL} ${_nccl_version} ${ZEAL_NCCL_LIBRARY}")
  else()
    message(STATUS "nvcc not found: CUDA kernels are not compiled")
  endif()
else()
  message(STATUS "CUDA disabled (-DZEAL_CUDA=OFF)")
endif()

if(ZEAL_REQUIRE_CUDA)
  set(_missing "")
  if(NOT ZEAL_HAVE_CUDA)
    list(APPEND _missing "nvcc (set CMAKE_CUDA_COMPILER or put the toolkit's bin on PATH)")
  endif()
  if(NOT ZEAL_TORCH_HAS_CUDA)
    list(APPEND _missing "LibTorch's CUDA half (libtorch_cuda.so and libc10_cuda.so in ${ZEAL_TORCH_DIR}/lib)")
  endif()
  if(NOT ZEAL_HAVE_NCCL)
    list(APPEND _missing "NCCL (nccl.h and libnccl)")
  endif()
  if(ZEAL_HAVE_CUDA AND NOT CMAKE_CUDA_ARCHITECTURES MATCHES "(^|;)(90|90a|90-real|native|all|all-major)($|;)")
    list(APPEND _missing "sm_90 in CMAKE_CUDA_ARCHITECTURES (it is '${CMAKE_CUDA_ARCHITECTURES}')")
  endif()
  if(_missing)
    list(JOIN _missing "; " _text)
    message(FATAL_ERROR "ZEAL_REQUIRE_CUDA: missing ${_text}")
  endif()
endif()
