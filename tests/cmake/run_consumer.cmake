# Builds tests/cmake/consumer against zeal (MODE=build: the build tree; MODE=install: an install
# made here) and checks that it runs and reads a shipped config correctly.
file(REMOVE_RECURSE ${WORK})
if(MODE STREQUAL "install")
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${ZEAL_BUILD} --prefix ${WORK}/prefix
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "cmake --install failed: ${rc}")
  endif()
  set(zeal_dir ${WORK}/prefix/lib/cmake/zeal)
else()
  set(zeal_dir ${ZEAL_BUILD})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/build -G ${GENERATOR} -Dzeal_DIR=${zeal_dir}
                        -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc)
  message(FATAL_ERROR "building the consumer failed:\n${out}")
endif()
get_filename_component(root ${SRC}/../../.. ABSOLUTE)
execute_process(COMMAND ${WORK}/build/consumer ${root}/configs/zero2.yaml
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc OR NOT out MATCHES "stage=2")
  message(FATAL_ERROR "the consumer ran with status ${rc} and printed '${out}' '${err}' (expected stage=2)")
endif()
message(STATUS "consumer (${MODE}) read configs/zero2.yaml: ${out}")
