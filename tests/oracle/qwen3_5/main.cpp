// doctest main for the Qwen3.5 architecture tests: one intra-op thread, like the reference
// (make_case.py), so reductions split the same way.
#include <ATen/Parallel.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  doctest::Context context(argc, argv);
  return context.run();
}
