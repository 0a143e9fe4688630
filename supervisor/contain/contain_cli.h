// `assayd contain`: runs one contained process and prints its evidence (contain_cli.cpp).
#pragma once

namespace assay::supervisor {

// argv[0] is the subcommand name. Exit 0 when the process ran and was measured, whatever its own
// outcome; 1 when containment itself failed; 2 on a usage error.
int contain_main(int argc, char** argv);

}  // namespace assay::supervisor
