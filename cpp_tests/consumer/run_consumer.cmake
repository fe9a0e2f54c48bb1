# Installs the graphed build into a scratch prefix, configures and builds the
# consumer project against it with find_package(graphed), runs its programs
# (one in C, one through graphed.hpp) and checks that both report the
# expected version. Run by ctest (Package.FindPackageConsumer).
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run("${CMAKE_COMMAND}" --install "${GRAPHED_BUILD_DIR}" --prefix "${prefix}")
run("${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${build}" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix}")
run("${CMAKE_COMMAND}" --build "${build}")
foreach(program consumer consumer_cxx)
  run("${build}/${program}")
  string(STRIP "${last_output}" got)
  if(NOT got STREQUAL "graphed ${EXPECTED_VERSION}")
    message(FATAL_ERROR "${program} printed '${got}', expected 'graphed ${EXPECTED_VERSION}'")
  endif()
  message(STATUS "${program} linked the installed graphed: ${got}")
endforeach()
