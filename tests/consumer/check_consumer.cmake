# The test install.consumer: ringattn as another project sees it. Installs the build tree into a
# prefix, then configures, builds and runs the standalone project of this folder against that
# prefix through find_package(ringattn). Each step that fails stops the test and is named.
#
# cmake -D RINGATTN_BINARY_DIR=<top build dir> -D CONSUMER_SOURCE_DIR=<this folder>
#       -D WORK_DIR=<scratch dir> [-D CONFIG=<config>] [-D GENERATOR=<generator>]
#       [-D CXX_COMPILER=<compiler>] -P check_consumer.cmake

foreach(required RINGATTN_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${required})
    message(FATAL_ERROR "check_consumer.cmake needs -D ${required}=...")
  endif()
endforeach()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/build")
# A fresh prefix and build each time, so that nothing left from an earlier run can stand in for
# a file the install forgot.
file(REMOVE_RECURSE "${prefix}" "${consumer_build}")

set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()

function(run_step step)
  message(STATUS "install.consumer: ${step}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "install.consumer: step '${step}' failed (${result})")
  endif()
endfunction()

run_step(install
  "${CMAKE_COMMAND}" --install "${RINGATTN_BINARY_DIR}" --prefix "${prefix}" ${config_args})

set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}"
  "-DCMAKE_PREFIX_PATH=${prefix}")
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
endif()
run_step(configure "${CMAKE_COMMAND}" ${configure_args})

run_step(build "${CMAKE_COMMAND}" --build "${consumer_build}" ${config_args})

# Single-config generators put the program in the build directory, multi-config ones in a
# folder named after the configuration.
set(program "${consumer_build}/consumer")
if(CONFIG AND EXISTS "${consumer_build}/${CONFIG}/consumer")
  set(program "${consumer_build}/${CONFIG}/consumer")
endif()
run_step(run "${program}")
