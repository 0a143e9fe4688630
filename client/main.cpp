// assay: the client CLI of assayd.
#include <cstdlib>
#include <iostream>

#include <unistd.h>

#include "client/cli.h"

int main(int argc, char** argv) {
  assay::client::Environment env;
  if (const char* s = std::getenv("ASSAY_SOCKET")) env.socket = s;
  env.stdout_is_tty = ::isatty(STDOUT_FILENO) == 1;
  return assay::client::run_cli({argv, argv + argc}, std::cout, std::cerr, env);
}
