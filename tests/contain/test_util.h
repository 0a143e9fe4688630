// Small helpers shared by the contain tests.
#pragma once

#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "common/json.h"

namespace assay::contain::test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A scratch directory removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "contain-test-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Validates a document against schemas/process-containment.schema.json with python3-jsonschema.
inline void check_schema(const common::Json& evidence, const std::filesystem::path& dir) {
  std::filesystem::path doc = dir / "evidence.json";
  std::ofstream(doc) << evidence.dump();
  std::string cmd = std::string(ASSAY_PYTHON3) +
                    " -c 'import json,sys,jsonschema; "
                    "s=json.load(open(sys.argv[1])); d=json.load(open(sys.argv[2])); "
                    "jsonschema.Draft202012Validator(s).validate(d)' " ASSAY_SCHEMA_DIR
                    "/process-containment.schema.json " +
                    doc.string();
  CHECK_MESSAGE(std::system(cmd.c_str()) == 0, "schema validation failed for " << evidence.dump());
}

}  // namespace assay::contain::test
