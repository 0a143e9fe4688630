// assayd's subcommands; each parses its own arguments (argv[0] is the subcommand name).
#pragma once

namespace assay::supervisor {

int serve_main(int argc, char** argv);    // supervisor/serve.cpp
int contain_main(int argc, char** argv);  // supervisor/contain/contain_cli.cpp

}  // namespace assay::supervisor
