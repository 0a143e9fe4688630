#include "common/batch.h"

#include "common/error.h"
#include "common/identity.h"
#include "common/protocol.h"

namespace assay::common {

namespace {

void invalid(const std::string& message) {
  throw Error("request.invalid", message);
}

}  // namespace

BatchRequest validate_batch_request(const Json& doc) {
  if (!doc.is_object())
    invalid(std::string("a batch request must be a JSON object, got ") + doc.type_name());
  reject_unknown_fields(doc, {"schema", "id", "model_dir", "limits", "states"}, "batch");
  BatchRequest b;
  b.schema = require_string(doc, "schema", "batch");
  if (b.schema != protocol::kNextTokenBatchRequest)
    throw Error("request.unknown_schema", "batch.schema \"" + b.schema + "\" is not " +
                                              std::string(protocol::kNextTokenBatchRequest));
  b.id = require_string(doc, "id", "batch");
  if (b.id.empty() || b.id.size() > 256)
    invalid("batch.id must be 1 to 256 bytes, got " + std::to_string(b.id.size()));
  if (auto md = doc.find("model_dir"); md != doc.end()) {
    std::string dir = require_string(doc, "model_dir", "batch");
    if (dir.empty() || dir.front() != '/')
      invalid("batch.model_dir \"" + dir + "\" must be an absolute path");
    b.model_dir = dir;
  }
  b.limits = parse_request_limits(doc);
  const Json& states = require(doc, "states", "batch");
  if (!states.is_array() || states.empty() || states.size() > kMaxBatchStates)
    invalid("batch.states must be an array of 1 to " + std::to_string(kMaxBatchStates) +
            " requests, got " + (states.is_array() ? std::to_string(states.size()) : "none"));
  for (std::size_t i = 0; i < states.size(); ++i) {
    std::string where = "states[" + std::to_string(i) + "]";
    NextTokenRequest r;
    try {
      r = validate_request(states[i]);
    } catch (const Error& e) {
      throw Error(e.code(), where + ": " + e.what());
    }
    if (states[i].contains("limits"))
      invalid(where + ": a state has no limits of its own; the batch's \"limits\" apply to it");
    if (r.model_dir) {
      if (!b.model_dir) b.model_dir = r.model_dir;
      if (*r.model_dir != *b.model_dir)
        throw Error("request.mixed_models", where + ": model_dir \"" + *r.model_dir +
                                                "\" is not the batch's \"" + *b.model_dir + "\"");
    }
    if (r.model_identity) {
      if (!b.model_identity) b.model_identity = r.model_identity;
      const std::string mine = (*r.model_identity)["content_sha256"];
      const std::string batch = (*b.model_identity)["content_sha256"];
      if (mine != batch)
        throw Error("request.mixed_models", where + ": model_identity.content_sha256 " + mine +
                                                " is not the batch's " + batch);
    }
    // One envelope worker measures every state that asks (one model load): they ask alike.
    if (!r.numerics.is_null()) {
      for (const auto& earlier : b.states)
        if (!earlier.numerics.is_null() && earlier.numerics != r.numerics)
          invalid(where + ": numerics " + r.numerics.dump() + " is not the earlier states' " +
                  earlier.numerics.dump() +
                  "; the states of a batch that ask for the envelope ask for the same one");
    }
    b.states.push_back(std::move(r));
  }
  b.request_sha256 = sha256_canonical_id(doc);
  return b;
}

}  // namespace assay::common
