# CI's fuzz smoke tests (included by the top CMakeLists.txt with the tests): fuzz_build builds
# every libFuzzer target with clang in its own directory (BUILD/fuzz, scripts/fuzz), then
# fuzz_smoke_1..3 each replay the regression inputs of a third of the targets and run each of
# those targets 30 s on its seeds with one fixed libFuzzer seed, so that a target that crashes at
# once fails CI and a commit that passed once passes again (bench/fuzz.sh searches with random
# seeds; what it finds lands in tests/fuzz/regressions/, which every run replays). Without clang
# (scripts/install-deps installs it) there are no fuzz tests.
find_program(ASSAY_CLANGXX clang++)
if(NOT ASSAY_CLANGXX)
  message(STATUS "clang++ not found: no fuzz smoke tests")
  return()
endif()
set(_fuzz_build ${CMAKE_BINARY_DIR}/fuzz)
add_test(NAME fuzz_build
         COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz --build-only --build ${_fuzz_build})
set_tests_properties(fuzz_build PROPERTIES FIXTURES_SETUP fuzz_targets TIMEOUT 3600)
foreach(k 1 2 3)
  add_test(NAME fuzz_smoke_${k}
           COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz 30 --seed 1 --no-build --build ${_fuzz_build}
                   --group ${k}/3)
  set_tests_properties(fuzz_smoke_${k} PROPERTIES FIXTURES_REQUIRED fuzz_targets TIMEOUT 600)
endforeach()
