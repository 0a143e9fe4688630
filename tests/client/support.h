// Helpers for the client tests: a temporary directory and running the CLI in-process.
#pragma once

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "client/cli.h"
#include "common/fs.h"

namespace assay::client::test {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "assay-client-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  std::string write(const std::string& name, std::string_view content) const {
    common::atomic_write_file(path_ / name, content);
    return (path_ / name).string();
  }

 private:
  std::filesystem::path path_;
};

struct Run {
  int status;
  std::string out, err;
};

inline Run run(std::vector<std::string> args, Environment env = {}) {
  args.insert(args.begin(), "assay");
  std::ostringstream out, err;
  int status = run_cli(args, out, err, env);
  return {status, out.str(), err.str()};
}

}  // namespace assay::client::test
