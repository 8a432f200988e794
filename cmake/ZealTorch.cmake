# Finds LibTorch and defines the INTERFACE target zeal_torch (exported with zeal).
#
# Search order: -DZEAL_TORCH_DIR, $ZEAL_TORCH_DIR, the copy scripts/setup unpacks into
# ~/.cache/zeal/deps, then the torch package of `python3` (a GPU machine's CUDA build).
# Only libtorch_cpu and libc10 are linked unless libtorch_cuda sits beside them, in which case
# the CUDA half is linked too (ZEAL_TORCH_HAS_CUDA).
set(ZEAL_TORCH_VERSION_WANTED 2.11.0)
set(ZEAL_TORCH_DIR "$ENV{ZEAL_TORCH_DIR}" CACHE PATH "LibTorch root holding include/ and lib/")
if(NOT ZEAL_TORCH_DIR)
  set(_deps "$ENV{ZEAL_DEPS}")
  if(NOT _deps)
    set(_deps "$ENV{HOME}/.cache/zeal/deps")
  endif()
  if(EXISTS "${_deps}/libtorch-${ZEAL_TORCH_VERSION_WANTED}/include")
    set(ZEAL_TORCH_DIR "${_deps}/libtorch-${ZEAL_TORCH_VERSION_WANTED}" CACHE PATH "" FORCE)
  else()
    execute_process(COMMAND python3 -c "import os, torch; print(os.path.dirname(torch.__file__))"
      OUTPUT_VARIABLE _py_torch OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_py_torch)
      set(ZEAL_TORCH_DIR "${_py_torch}" CACHE PATH "" FORCE)
    endif()
  endif()
endif()
if(NOT ZEAL_TORCH_DIR OR NOT EXISTS "${ZEAL_TORCH_DIR}/include/torch")
  message(FATAL_ERROR "LibTorch not found (ZEAL_TORCH_DIR='${ZEAL_TORCH_DIR}'). "
    "Run scripts/setup, or pass -DZEAL_TORCH_DIR=<dir with include/ and lib/>.")
endif()

find_library(ZEAL_TORCH_CPU_LIBRARY torch_cpu PATHS "${ZEAL_TORCH_DIR}/lib" NO_DEFAULT_PATH REQUIRED)
find_library(ZEAL_C10_LIBRARY c10 PATHS "${ZEAL_TORCH_DIR}/lib" NO_DEFAULT_PATH REQUIRED)
set(_vh "${ZEAL_TORCH_DIR}/include/torch/headeronly/version.h")
if(NOT EXISTS "${_vh}")
  set(_vh "${ZEAL_TORCH_DIR}/include/torch/csrc/api/include/torch/version.h")
endif()
set(ZEAL_TORCH_VERSION "")
foreach(_part MAJOR MINOR PATCH)
  file(STRINGS "${_vh}" _line REGEX "#define TORCH_VERSION_${_part} ")
  string(REGEX REPLACE ".* ([0-9]+).*" "\\1" _num "${_line}")
  list(APPEND ZEAL_TORCH_VERSION ${_num})
endforeach()
list(JOIN ZEAL_TORCH_VERSION "." ZEAL_TORCH_VERSION)

add_library(zeal_torch INTERFACE)
target_include_directories(zeal_torch SYSTEM INTERFACE
  "${ZEAL_TORCH_DIR}/include" "${ZEAL_TORCH_DIR}/include/torch/csrc/api/include")
target_link_libraries(zeal_torch INTERFACE "${ZEAL_TORCH_CPU_LIBRARY}" "${ZEAL_C10_LIBRARY}")
# The PyPI wheels are built with the C++11 ABI.
target_compile_definitions(zeal_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)

option(ZEAL_TORCH_CUDA "Link LibTorch's CUDA half when it sits beside the CPU half" ON)
set(ZEAL_TORCH_HAS_CUDA OFF)
if(ZEAL_TORCH_CUDA AND EXISTS "${ZEAL_TORCH_DIR}/lib/libtorch_cuda.so" AND EXISTS "${ZEAL_TORCH_DIR}/lib/libc10_cuda.so")
  set(ZEAL_TORCH_HAS_CUDA ON)
  # Linked without --as-needed so that the CUDA backend registers itself at load time. The run path
  # is written as DT_RPATH (not RUNPATH) so that it also serves libtorch_cuda's own dependencies
  # (cuSPARSELt, NVSHMEM, cuFile, ...) that scripts/setup put beside it: libtorch_cuda has no run
  # path of its own (Python's torch preloads them).
  target_link_libraries(zeal_torch INTERFACE
    "-Wl,--no-as-needed,${ZEAL_TORCH_DIR}/lib/libtorch_cuda.so,${ZEAL_TORCH_DIR}/lib/libc10_cuda.so,--as-needed"
    "-Wl,--disable-new-dtags" "-Wl,-rpath-link,${ZEAL_TORCH_DIR}/lib")
endif()
message(STATUS "LibTorch ${ZEAL_TORCH_VERSION} at ${ZEAL_TORCH_DIR} (CUDA half: ${ZEAL_TORCH_HAS_CUDA})")
if(NOT ZEAL_TORCH_VERSION VERSION_EQUAL ZEAL_TORCH_VERSION_WANTED)
  message(WARNING "zeal is tested against LibTorch ${ZEAL_TORCH_VERSION_WANTED}; found ${ZEAL_TORCH_VERSION}")
endif()
