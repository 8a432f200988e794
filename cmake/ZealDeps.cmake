# Finds the libraries zeal builds against besides LibTorch and CUDA: yaml-cpp and fmt through their
# CMake packages; liburing, hwloc, utf8proc and PCRE2 by header and library (pkg-config is not needed, so a
# machine that only has these packages unpacked under a prefix, as scripts/gpu-check does, builds
# too: pass -DCMAKE_PREFIX_PATH=<prefix>/usr); CLI11, nlohmann-json and Gloo's headers by path.
# Defines the imported targets zeal::uring, zeal::hwloc, zeal::utf8proc and zeal::pcre2, and versions in
# ZEAL_URING_VERSION and ZEAL_HWLOC_VERSION.
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
find_path(ZEAL_JSON_INCLUDE_DIR nlohmann/json.hpp REQUIRED)
include_directories(SYSTEM ${ZEAL_JSON_INCLUDE_DIR})
# c10d's ProcessGroupGloo header needs Gloo's headers (LibTorch links Gloo in but does not ship
# them): Debian's libgloo-dev provides them; nothing links against its library.
find_path(ZEAL_GLOO_INCLUDE_DIR gloo/context.h REQUIRED)

# zeal_find_library(<target> <header> <library>): an imported target for one C library.
function(zeal_find_library target header library)
  string(TOUPPER ${target} up)
  find_path(ZEAL_${up}_INCLUDE_DIR ${header})
  find_library(ZEAL_${up}_LIBRARY NAMES ${library})
  if(NOT ZEAL_${up}_INCLUDE_DIR OR NOT ZEAL_${up}_LIBRARY)
    message(FATAL_ERROR "${library} not found (header ${header}: '${ZEAL_${up}_INCLUDE_DIR}', library: "
                        "'${ZEAL_${up}_LIBRARY}'). On Debian: scripts/setup installs it; elsewhere pass "
                        "-DCMAKE_PREFIX_PATH=<prefix holding include/ and lib/>")
  endif()
  add_library(zeal::${target} UNKNOWN IMPORTED)
  set_target_properties(zeal::${target} PROPERTIES IMPORTED_LOCATION "${ZEAL_${up}_LIBRARY}"
                                                   INTERFACE_INCLUDE_DIRECTORIES "${ZEAL_${up}_INCLUDE_DIR}")
endfunction()

zeal_find_library(uring liburing.h uring)
zeal_find_library(hwloc hwloc.h hwloc)
zeal_find_library(utf8proc utf8proc.h utf8proc)
zeal_find_library(pcre2 pcre2.h pcre2-8)

# Versions, read from the pkg-config files beside the libraries (what `zeal env` reports).
function(zeal_pc_version out library pc)
  get_filename_component(_dir "${library}" DIRECTORY)
  set(_version "")
  if(EXISTS "${_dir}/pkgconfig/${pc}.pc")
    file(STRINGS "${_dir}/pkgconfig/${pc}.pc" _line REGEX "^Version:")
    string(REGEX REPLACE "^Version: *" "" _version "${_line}")
  endif()
  set(${out} "${_version}" PARENT_SCOPE)
endfunction()
zeal_pc_version(ZEAL_URING_VERSION "${ZEAL_URING_LIBRARY}" liburing)
zeal_pc_version(ZEAL_HWLOC_VERSION "${ZEAL_HWLOC_LIBRARY}" hwloc)
