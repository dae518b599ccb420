# Finds every dependency of ringattn. None is vendored or downloaded: a missing one stops the
# configuration with the Debian/Ubuntu package that provides it.

function(ringattn_require found_var what package)
  if(NOT ${found_var})
    message(FATAL_ERROR
      "ringattn needs ${what}, which was not found. On Debian/Ubuntu: apt-get install ${package}")
  endif()
endfunction()

find_package(Threads REQUIRED)

find_package(MPI COMPONENTS C CXX)
ringattn_require(MPI_FOUND "MPI (C and C++)" "libopenmpi-dev openmpi-bin")
if(NOT MPIEXEC_EXECUTABLE)
  message(FATAL_ERROR "ringattn needs mpiexec to run its mpi tests. On Debian/Ubuntu: apt-get install openmpi-bin")
endif()

find_package(HDF5 COMPONENTS C)
ringattn_require(HDF5_FOUND "HDF5 (C API)" "libhdf5-dev")
if(NOT TARGET HDF5::HDF5)
  add_library(HDF5::HDF5 INTERFACE IMPORTED)
  target_include_directories(HDF5::HDF5 INTERFACE ${HDF5_INCLUDE_DIRS})
  target_link_libraries(HDF5::HDF5 INTERFACE ${HDF5_LIBRARIES})
  target_compile_definitions(HDF5::HDF5 INTERFACE ${HDF5_DEFINITIONS})
endif()

find_package(yaml-cpp QUIET)
ringattn_require(yaml-cpp_FOUND "yaml-cpp" "libyaml-cpp-dev")
# yaml-cpp 0.8 names its target yaml-cpp::yaml-cpp, 0.7 plain yaml-cpp.
if(TARGET yaml-cpp::yaml-cpp)
  set(RINGATTN_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(RINGATTN_YAML_TARGET yaml-cpp)
endif()

find_package(CLI11 QUIET)
ringattn_require(CLI11_FOUND "CLI11" "libcli11-dev")

if(RINGATTN_BUILD_TESTS)
  find_package(GTest QUIET)
  ringattn_require(GTest_FOUND "GoogleTest" "libgtest-dev libgmock-dev")
endif()

# CUDA: AUTO builds the CUDA backend when nvcc is found, ON requires it, OFF never builds it.
set(RINGATTN_WITH_CUDA OFF)
if(NOT RINGATTN_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "RINGATTN_CUDA is '${RINGATTN_CUDA}'; expected AUTO, ON or OFF")
endif()
if(NOT RINGATTN_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(RINGATTN_WITH_CUDA ON)
  elseif(RINGATTN_CUDA STREQUAL "ON")
    message(FATAL_ERROR
      "RINGATTN_CUDA=ON but no CUDA compiler was found; install the CUDA toolkit "
      "(nvcc under /usr/local/cuda/bin or on PATH) or configure with -DRINGATTN_CUDA=OFF")
  endif()
endif()

if(RINGATTN_WITH_CUDA)
  # sm_80 for Ampere, sm_90a for Hopper (wgmma and setmaxnreg need the "a" target).
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "80;90a" CACHE STRING "CUDA architectures to build for")
  endif()
  # CMake 3.25 does not know the C++20 flag of nvcc; device code is written in C++17.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  # nvcc 12 and later take -std=c++20; a target that includes C++20 headers in its .cu files
  # (the trainer's, through the CPU ops' std::span) sets CUDA_STANDARD 20.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION
     AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  find_package(CUDAToolkit REQUIRED)
  find_package(NCCL)
  ringattn_require(NCCL_FOUND "NCCL (nccl.h and libnccl)" "libnccl-dev (or the NCCL of the CUDA toolkit)")
  set(RINGATTN_CUDA_ARCH_NOTE " (architectures ${CMAKE_CUDA_ARCHITECTURES})")
  set(RINGATTN_WITH_CUDA_01 1)
  if("90a" IN_LIST CMAKE_CUDA_ARCHITECTURES)
    set(RINGATTN_WITH_SM90A_01 1)
  else()
    set(RINGATTN_WITH_SM90A_01 0)
  endif()
else()
  set(RINGATTN_WITH_CUDA_01 0)
  set(RINGATTN_WITH_SM90A_01 0)
endif()
