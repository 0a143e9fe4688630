# The source tree's identity, embedded in assayd: the git commit, whether the tree differed from
# it, and the version. A target that runs at every build regenerates the header, which is
# rewritten only when its content changed, so a commit is picked up without re-running cmake and
# an unchanged tree recompiles nothing. Link `assay_build_info` to include <assay/build_info.h>.
set(ASSAY_BUILD_INFO_DIR ${CMAKE_BINARY_DIR}/generated)
set(ASSAY_BUILD_INFO_HEADER ${ASSAY_BUILD_INFO_DIR}/assay/build_info.h)
find_program(ASSAY_GIT git)
add_custom_target(assay_build_info_header
  COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DOUTPUT=${ASSAY_BUILD_INFO_HEADER}
          -DVERSION=${PROJECT_VERSION} -DGIT=${ASSAY_GIT}
          -P ${PROJECT_SOURCE_DIR}/cmake/build_info_generate.cmake
  BYPRODUCTS ${ASSAY_BUILD_INFO_HEADER}
  COMMENT "Checking the source tree's git identity"
  VERBATIM)
add_library(assay_build_info INTERFACE)
target_include_directories(assay_build_info INTERFACE ${ASSAY_BUILD_INFO_DIR})
add_dependencies(assay_build_info assay_build_info_header)
