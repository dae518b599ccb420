# Installs the library, its public headers and a CMake package, so that another project can
#   find_package(ringattn) and target_link_libraries(app PRIVATE ringattn::ringattn).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The installed library finds CUDA and NCCL where it was linked against them (outside the system
# directories on some machines) without LD_LIBRARY_PATH.
set_target_properties(ringattn PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

set(RINGATTN_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/ringattn")

install(TARGETS ringattn EXPORT ringattnTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/ringattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/include/ringattn/config.h"
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ringattn)
install(EXPORT ringattnTargets NAMESPACE ringattn:: DESTINATION ${RINGATTN_CMAKE_DIR})

configure_package_config_file(cmake/ringattnConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/ringattnConfig.cmake"
  INSTALL_DESTINATION ${RINGATTN_CMAKE_DIR})
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/ringattnConfigVersion.cmake"
  COMPATIBILITY SameMajorVersion)
install(FILES
  "${CMAKE_CURRENT_BINARY_DIR}/ringattnConfig.cmake"
  "${CMAKE_CURRENT_BINARY_DIR}/ringattnConfigVersion.cmake"
  DESTINATION ${RINGATTN_CMAKE_DIR})
