// What the API answers, before it becomes HTTP; and the one place that turns an error into one.
#pragma once

#include <exception>
#include <filesystem>
#include <string>

#include "common/error.h"
#include "common/json.h"

namespace assay::supervisor::api {

struct Answer {
  unsigned status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::filesystem::path file;  // when set, the body is this file (an artifact or a result)
  std::string allow;           // the Allow header of a 405
  std::string stream_job;      // when set, the answer is this job's event stream
};

Answer json_answer(unsigned status, const common::Json& j);
// {"error":{"code","message"}} with the status its code maps to (answer.cpp has the table).
Answer error_answer(const common::Error& e);
Answer error_answer(unsigned status, const std::string& code, const std::string& message);
// The catch-all: anything unexpected is logged and answered 500; the daemon keeps serving.
Answer internal_error(const std::exception& e);
unsigned status_for(const std::string& code);

}  // namespace assay::supervisor::api
