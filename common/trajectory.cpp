#include "common/trajectory.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include "common/error.h"
#include "common/identity.h"
#include "common/request_fields.h"

namespace assay::common {

using namespace request_fields;

std::optional<TrajectoryRequest::Divergence> TrajectoryRequest::divergence() const {
  std::size_t shortest = SIZE_MAX, longest = 0;
  for (const auto& c : continuations) {
    shortest = std::min(shortest, c.token_ids.size());
    longest = std::max(longest, c.token_ids.size());
  }
  std::optional<std::size_t> d;
  for (std::size_t i = 0; i < shortest && !d; ++i)
    for (const auto& c : continuations)
      if (c.token_ids[i] != continuations[0].token_ids[i]) d = i;
  if (!d && longest != shortest) d = shortest;
  if (!d) return std::nullopt;
  Divergence out;
  out.index = *d;
  out.input_token_ids = prompt_token_ids;
  for (const auto& c : continuations) {
    if (*d < c.token_ids.size()) {
      if (out.candidates.is_null())  // the shared prefix, from the first engine that has it
        out.input_token_ids.insert(out.input_token_ids.end(), c.token_ids.begin(),
                                   c.token_ids.begin() + static_cast<std::ptrdiff_t>(*d));
      out.candidates.push_back(Json{{"engine", c.engine}, {"token_id", c.token_ids[*d]}});
    }
  }
  return out;  // d < longest: some engine has a token there
}

std::vector<std::int64_t> TrajectoryRequest::sequence(std::size_t i) const {
  std::vector<std::int64_t> ids = prompt_token_ids;
  const auto& c = continuations.at(i).token_ids;
  ids.insert(ids.end(), c.begin(), c.end());
  return ids;
}

void TrajectoryRequest::check_vocab(std::int64_t vocab_size) const {
  auto check = [&](const std::vector<std::int64_t>& ids, const std::string& where) {
    for (std::size_t j = 0; j < ids.size(); ++j)
      if (ids[j] >= vocab_size)
        throw Error("request.invalid_token_id",
                    where + "[" + std::to_string(j) + "] = " + std::to_string(ids[j]) +
                        " is not below the model's vocab_size " + std::to_string(vocab_size));
  };
  check(prompt_token_ids, "request.prompt_token_ids");
  for (std::size_t i = 0; i < continuations.size(); ++i)
    check(continuations[i].token_ids, "request.continuations[" + std::to_string(i) + "].token_ids");
}

void TrajectoryRequest::check_context_length(std::int64_t max_positions) const {
  for (const auto& c : continuations) {
    auto n = static_cast<std::int64_t>(prompt_token_ids.size() + c.token_ids.size());
    if (n > max_positions)
      throw Error("request.too_long",
                  "prompt + the continuation of \"" + c.engine + "\" is " + std::to_string(n) +
                      " tokens, more than the model's max_position_embeddings " +
                      std::to_string(max_positions));
  }
}

TrajectoryRequest validate_trajectory_request(const Json& doc) {
  if (!doc.is_object()) invalid("the request must be a JSON object");
  const Json& schema = field(doc, "schema", "request");
  if (!schema.is_string() || schema.get<std::string>() != kTrajectoryRequest)
    throw Error("request.unknown_schema", "request.schema " + schema.dump().substr(0, 80) +
                                              " is not \"" + std::string(kTrajectoryRequest) +
                                              "\"");
  only_fields(doc,
              {"schema", "id", "model_dir", "model_identity", "prompt_token_ids", "continuations",
               "block_positions", "limits", "numerics"},
              "request");
  TrajectoryRequest r;
  r.schema = kTrajectoryRequest;
  r.id = string_field(doc, "id", "request", 256);
  r.model_dir = string_field(doc, "model_dir", "request", 4096);
  if (r.model_dir.front() != '/' || r.model_dir.find('\0') != std::string::npos)
    invalid("request.model_dir \"" + r.model_dir + "\" is not an absolute path");
  while (r.model_dir.size() > 1 && r.model_dir.back() == '/') r.model_dir.pop_back();
  if (auto mi = doc.find("model_identity"); mi != doc.end()) {
    validate_model_identity(*mi, "request.model_identity");
    r.model_identity = *mi;
  }
  r.prompt_token_ids = parse_token_id_array(doc, "prompt_token_ids", "request", false);

  const Json& conts = field(doc, "continuations", "request");
  if (!conts.is_array() || conts.size() < 2 || conts.size() > kMaxTrajectoryEngines)
    invalid("request.continuations must be an array of 2.." +
            std::to_string(kMaxTrajectoryEngines) + " engines, got " +
            (conts.is_array() ? std::to_string(conts.size()) + " entries" : conts.type_name()));
  std::set<std::string> engines;
  for (std::size_t i = 0; i < conts.size(); ++i) {
    std::string where = "request.continuations[" + std::to_string(i) + "]";
    if (!conts[i].is_object()) invalid(where + " must be an object, got " + conts[i].dump());
    only_fields(conts[i], {"engine", "token_ids"}, where);
    Continuation c;
    c.engine = string_field(conts[i], "engine", where, 64);
    for (unsigned char ch : c.engine)
      if (ch < 0x20 || ch > 0x7e)
        invalid(where + ".engine \"" + c.engine + "\" is not printable ASCII");
    if (c.engine == "neither") invalid(where + ".engine \"neither\" is reserved");
    if (!engines.insert(c.engine).second)
      invalid(where + ".engine \"" + c.engine + "\" is named twice");
    c.token_ids = parse_token_id_array(conts[i], "token_ids", where, false);
    if (r.prompt_token_ids.size() + c.token_ids.size() > kMaxTrajectoryTokens)
      invalid(where + ": prompt + continuation is " +
              std::to_string(r.prompt_token_ids.size() + c.token_ids.size()) +
              " tokens, more than " + std::to_string(kMaxTrajectoryTokens));
    r.continuations.push_back(std::move(c));
  }
  if (auto it = doc.find("block_positions"); it != doc.end()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1 || it->get<std::int64_t>() > 4096)
      invalid("request.block_positions must be an integer in [1, 4096], got " + it->dump());
    r.block_positions = it->get<std::int64_t>();
  }
  r.limits = parse_request_limits(doc);
  r.numerics = parse_numerics_spec(doc);
  r.request_sha256 = sha256_canonical_id(doc);
  r.document = doc;
  return r;
}

}  // namespace assay::common
