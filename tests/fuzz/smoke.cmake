# CI's fuzz smoke tests (included by the top CMakeLists.txt with the tests): fuzz_build_* build
# every libFuzzer target with clang in its own directory (BUILD/fuzz, scripts/fuzz), then
# fuzz_smoke_1..3 each replay the regression inputs of a third of the targets and run each of
# those targets 6 s on its seeds with one fixed libFuzzer seed, so that a target that crashes at
# once fails CI and a commit that passed once passes again (bench/fuzz.sh searches with random
# seeds; what it finds lands in tests/fuzz/regressions/, which every run replays). Without clang
# (scripts/install-deps installs it) there are no fuzz tests.
find_program(ASSAY_CLANGXX clang++)
if(NOT ASSAY_CLANGXX)
  message(STATUS "clang++ not found: no fuzz smoke tests")
  return()
endif()
set(_fuzz_build ${CMAKE_BINARY_DIR}/fuzz)
# The build in steps, each well inside a test's timeout on a loaded 2-core machine (one build of
# everything took 914 s in CI; the whole daemon library alone 747 s): the instrumented libraries
# in four parts (the daemon's job kinds apart from the rest of it), then each third of the
# targets. They share one build tree, so they run one at a time (RESOURCE_LOCK) and in order
# (each step's fixture is the next one's requirement).
set(_fuzz_libs_common assay_base,assay_common,assay_fingerprint_lib,assay_fuzz_oracle_core)
set(_fuzz_libs_client assay_contain,assay_executors,assay_fuzz_client)
set(_fuzz_libs_pipelines assay_supervisor_pipelines)
set(_fuzz_libs_supervisor assay_fuzz_supervisor)
set(_fuzz_previous "")
foreach(name common client pipelines supervisor)
  add_test(NAME fuzz_build_${name}
           COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz --libs ${_fuzz_libs_${name}}
                   --build ${_fuzz_build})
  set_tests_properties(fuzz_build_${name} PROPERTIES FIXTURES_SETUP fuzz_${name}
                       FIXTURES_REQUIRED "${_fuzz_previous}" RESOURCE_LOCK fuzz_tree TIMEOUT 900)
  set(_fuzz_previous fuzz_${name})
endforeach()
foreach(k 1 2 3)
  add_test(NAME fuzz_build_${k}
           COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz --build-only --group ${k}/3 --build ${_fuzz_build})
  set_tests_properties(fuzz_build_${k} PROPERTIES FIXTURES_SETUP fuzz_targets_${k}
                       FIXTURES_REQUIRED "${_fuzz_previous}" RESOURCE_LOCK fuzz_tree TIMEOUT 900)
  add_test(NAME fuzz_smoke_${k}
           COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz 6 --seed 1 --no-build --build ${_fuzz_build}
                   --group ${k}/3)
  set_tests_properties(fuzz_smoke_${k} PROPERTIES FIXTURES_REQUIRED fuzz_targets_${k} TIMEOUT 600)
endforeach()
