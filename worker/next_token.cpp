#include "worker/next_token.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/error.h"
#include "common/protocol.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;

constexpr int kTopTokens = 10;
constexpr int kMaxThreads = 1024;

Json token_text(const Tokenizer& tokenizer, std::int64_t id) {
  return tokenizer.knows(id) ? Json(tokenizer.decode_one(id)) : Json(nullptr);
}

}  // namespace

ModelFds parse_optional_model_fds(const Json& doc, const std::string& where) {
  if (!doc.contains("model_fds")) return std::nullopt;
  return fingerprint::parse_model_fds(doc["model_fds"], where, "input.invalid");
}

Execution parse_execution(const Json& ex, const std::string& w) {
  Execution out;
  if (!ex.is_object()) throw Error("input.invalid", w + ": not an object");
  common::reject_unknown_fields(ex, {"device", "dtype", "threads"}, w);
  out.device = common::require_string(ex, "device", w);
  out.dtype = common::require_string(ex, "dtype", w);
  std::int64_t threads = common::require_int(ex, "threads", w);
  if (threads < 1 || threads > kMaxThreads) {
    throw Error("input.invalid", w + ": threads " + std::to_string(threads) + " is outside [1, " +
                                     std::to_string(kMaxThreads) + "]");
  }
  out.threads = static_cast<int>(threads);
  return out;
}

namespace {

// The fields a single input and each state of a batch input share.
void parse_dispute(const Json& doc, const std::string& where, Dispute& d) {
  const Json& ids = common::require(doc, "input_token_ids", where);
  if (!ids.is_array() || ids.empty()) {
    throw Error("input.invalid", where + ": input_token_ids must be a non-empty array");
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (!ids[i].is_number_integer()) {
      throw Error("input.invalid", where + ": input_token_ids[" + std::to_string(i) +
                                       "] is not an integer: " + ids[i].dump());
    }
    d.input_token_ids.push_back(ids[i].get<std::int64_t>());
  }
  const Json& cands = common::require(doc, "candidate_tokens", where);
  if (!cands.is_array() || cands.size() < 2) {
    throw Error("input.invalid", where + ": candidate_tokens must be an array of two or more");
  }
  for (std::size_t i = 0; i < cands.size(); ++i) {
    std::string w = where + " candidate_tokens[" + std::to_string(i) + "]";
    if (!cands[i].is_object()) throw Error("input.invalid", w + ": not an object");
    common::reject_unknown_fields(cands[i], {"engine", "token_id", "text"}, w);
    Candidate c;
    c.engine = common::require_string(cands[i], "engine", w);
    if (c.engine.empty()) throw Error("input.invalid", w + ": engine is empty");
    c.token_id = common::require_int(cands[i], "token_id", w);
    c.text = common::require_string(cands[i], "text", w);
    d.candidates.push_back(std::move(c));
  }
  if (auto it = doc.find("continuation_prefix"); it != doc.end()) {
    if (!it->is_array())
      throw Error("input.invalid", where + ": continuation_prefix must be an array");
    for (std::size_t i = 0; i < it->size(); ++i) {
      std::string w = where + " continuation_prefix[" + std::to_string(i) + "]";
      const Json& t = (*it)[i];
      if (!t.is_object()) throw Error("input.invalid", w + ": not an object");
      common::reject_unknown_fields(t, {"token_id", "text"}, w);
      Candidate c;
      c.token_id = common::require_int(t, "token_id", w);
      c.text = common::require_string(t, "text", w);
      d.continuation_prefix.push_back(std::move(c));
    }
  }
}

}  // namespace

OracleInput parse_oracle_input(const Json& doc) {
  const std::string where = "input.json";
  if (!doc.is_object()) throw Error("input.invalid", where + ": not an object");
  common::reject_unknown_fields(
      doc,
      {"schema", "model_dir", "model_fds", "unchanged_files", "input_token_ids", "candidate_tokens",
       "continuation_prefix", "execution"},
      where);
  std::string schema = common::require_string(doc, "schema", where);
  if (schema != protocol::kOracleInput) {
    throw Error("input.invalid", where + ": schema \"" + schema + "\" is not \"" +
                                     std::string(protocol::kOracleInput) + "\"");
  }
  OracleInput in;
  in.model_dir = common::require_string(doc, "model_dir", where);
  if (!in.model_dir.is_absolute()) {
    throw Error("input.invalid",
                where + ": model_dir \"" + in.model_dir.string() + "\" must be an absolute path");
  }
  in.model_fds = parse_optional_model_fds(doc, where);
  if (doc.contains("unchanged_files"))
    in.unchanged_files = fingerprint::parse_file_states(
        doc["unchanged_files"], where + ": unchanged_files", "input.invalid");
  parse_dispute(doc, where, in);
  in.execution = parse_execution(common::require(doc, "execution", where), where + " execution");
  return in;
}

OracleBatchInput parse_oracle_batch_input(const Json& doc) {
  const std::string where = "input.json";
  if (!doc.is_object()) throw Error("input.invalid", where + ": not an object");
  common::reject_unknown_fields(doc, {"schema", "model_dir", "model_fds", "states", "execution"},
                                where);
  std::string schema = common::require_string(doc, "schema", where);
  if (schema != protocol::kOracleBatchInput)
    throw Error("input.invalid", where + ": schema \"" + schema + "\" is not \"" +
                                     std::string(protocol::kOracleBatchInput) + "\"");
  OracleBatchInput in;
  in.model_dir = common::require_string(doc, "model_dir", where);
  if (!in.model_dir.is_absolute())
    throw Error("input.invalid",
                where + ": model_dir \"" + in.model_dir.string() + "\" must be an absolute path");
  in.model_fds = parse_optional_model_fds(doc, where);
  const Json& states = common::require(doc, "states", where);
  if (!states.is_array() || states.empty())
    throw Error("input.invalid", where + ": states must be a non-empty array");
  for (std::size_t i = 0; i < states.size(); ++i) {
    std::string w = where + " states[" + std::to_string(i) + "]";
    const Json& s = states[i];
    if (!s.is_object()) throw Error("input.invalid", w + ": not an object");
    common::reject_unknown_fields(
        s, {"index", "input_token_ids", "candidate_tokens", "continuation_prefix"}, w);
    BatchState state;
    std::int64_t index = common::require_int(s, "index", w);
    if (index < 0) throw Error("input.invalid", w + ": index " + std::to_string(index) + " < 0");
    state.index = static_cast<std::size_t>(index);
    parse_dispute(s, w, state);
    in.states.push_back(std::move(state));
  }
  in.execution = parse_execution(common::require(doc, "execution", where), where + " execution");
  return in;
}

namespace {

// A token's text for a message: decoding one byte-level token may give part of a character.
std::string shown_text(const std::string& text) {
  return Json(text).dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

void check_prefix_texts(const std::vector<Candidate>& prefix, const Tokenizer& tokenizer) {
  for (std::size_t i = 0; i < prefix.size(); ++i) {
    const Candidate& t = prefix[i];
    std::string what = "continuation_prefix[" + std::to_string(i) + "]";
    std::string decoded =
        tokenizer.knows(t.token_id) ? tokenizer.decode_one(t.token_id) : std::string();
    if (!tokenizer.knows(t.token_id) || decoded != t.text)
      throw Error("request.token_text_mismatch",
                  what + ": token_id " + std::to_string(t.token_id) + " claims text " +
                      shown_text(t.text) + " but decodes to " +
                      (tokenizer.knows(t.token_id) ? shown_text(decoded)
                                                   : std::string("nothing (no tokenizer entry)")));
  }
}

void check_token_ids(std::span<const std::int64_t> ids, std::int64_t vocab_size,
                     const std::string& what) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      throw Error("request.invalid_token_id",
                  what + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                      " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
  }
}

namespace {

std::string candidate_name(const std::vector<Candidate>& candidates, std::size_t i) {
  return "candidate_tokens[" + std::to_string(i) + "] (" + candidates[i].engine + ")";
}

}  // namespace

void check_candidates(const std::vector<Candidate>& candidates, const Tokenizer& tokenizer,
                      std::int64_t vocab_size) {
  for (std::size_t i = 0; i < candidates.size(); ++i)
    check_token_ids(std::span(&candidates[i].token_id, 1), vocab_size,
                    candidate_name(candidates, i) + " token_id");
  check_candidate_texts(candidates, tokenizer);
}

void check_candidate_texts(const std::vector<Candidate>& candidates, const Tokenizer& tokenizer) {
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    const std::string what = candidate_name(candidates, i);
    if (!tokenizer.knows(c.token_id)) {
      throw Error("request.candidate_text_mismatch",
                  what + ": token_id " + std::to_string(c.token_id) + " has no tokenizer entry");
    }
    std::string decoded = tokenizer.decode_one(c.token_id);
    if (decoded != c.text) {
      throw Error("request.candidate_text_mismatch",
                  what + ": text " + shown_text(c.text) + " is not the decoding of token_id " +
                      std::to_string(c.token_id) + ", which is " + shown_text(decoded));
    }
  }
}

Json rank_logits(std::span<const float> logits, const Tokenizer& tokenizer,
                 const std::vector<Candidate>& candidates) {
  for (std::size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      throw Error("oracle.non_finite_logits",
                  "logit of token " + std::to_string(i) + " is " + std::to_string(logits[i]));
    }
  }
  if (logits.size() < 2) throw Error("oracle.non_finite_logits", "fewer than 2 logits");
  std::vector<std::int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  auto higher = [&](std::int64_t a, std::int64_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  std::size_t top_n = std::min<std::size_t>(kTopTokens, logits.size());
  std::partial_sort(order.begin(), order.begin() + std::max<std::size_t>(top_n, 2), order.end(),
                    higher);
  Json out = Json::object();
  std::int64_t argmax = order[0];
  out["argmax"] = argmax;
  out["argmax_text"] = token_text(tokenizer, argmax);
  Json top = Json::array();
  for (std::size_t k = 0; k < top_n; ++k) {
    top.push_back({{"token_id", order[k]},
                   {"text", token_text(tokenizer, order[k])},
                   {"logit", static_cast<double>(logits[order[k]])}});
  }
  out["top_tokens"] = std::move(top);
  double margin = static_cast<double>(logits[order[0]]) - static_cast<double>(logits[order[1]]);
  out["top_logit_margin"] = margin;
  out["top_logit_tie"] = margin == 0.0;
  Json cands = Json::array();
  for (const Candidate& c : candidates) {
    float value = logits[c.token_id];
    auto greater = std::count_if(logits.begin(), logits.end(), [&](float x) { return x > value; });
    cands.push_back({{"engine", c.engine},
                     {"token_id", c.token_id},
                     {"text", c.text},
                     {"logit", static_cast<double>(value)},
                     {"rank", 1 + greater},
                     {"is_argmax", c.token_id == argmax}});
  }
  out["candidate_tokens"] = std::move(cands);
  return out;
}

}  // namespace assay::oracle
