#include "common/kiln_receipt.h"

#include "common/error.h"
#include "common/identity.h"
#include "common/sign.h"
#include "common/text.h"

namespace assay::common {

namespace {

// The benchmark driver version Kiln's receipt checks accept (hf_next_token_contract.py).
constexpr std::string_view kKilnDriverVersion = "7";

// One receipt's checks, each throwing with the engine and the check's name.
class ReceiptChecker {
 public:
  ReceiptChecker(const NextTokenRequest& request, const ReceiptSlot& slot)
      : request_(request), slot_(slot) {
    report_.engine = slot.engine;
  }

  ReceiptReport run(std::string_view bytes) {
    const Json& named = request_.source[slot_.key];
    report_.file_sha256 = sha256_id(bytes);
    expect("file_sha256", report_.file_sha256 == named["file_sha256"],
           "the file's sha256 is " + report_.file_sha256 + ", request.source." + slot_.key +
               ".file_sha256 is " + named["file_sha256"].get<std::string>());

    Json receipt;
    try {
      receipt = parse_strict(bytes, {.max_bytes = kMaxReceiptBytes});
    } catch (const Error& e) {
      fail("json", std::string("the receipt is not JSON Kiln could have written: ") + e.what());
    }
    expect("json", receipt.is_object(), "the receipt is not a JSON object");
    passed("json");

    begin("receipt_sha256");
    const Json& stored = at(receipt, {"receipt_sha256"});
    expect("receipt_sha256", stored.is_string(), "receipt_sha256 is not a string");
    Json body = receipt;
    body.erase("receipt_sha256");
    std::string recomputed = sha256_id(python_canonical(body));
    expect("receipt_sha256", stored == recomputed,
           "the receipt says " + stored.get<std::string>() +
               ", its body (Kiln's canonical form, without the field) hashes to " + recomputed);
    report_.receipt_sha256 = recomputed;
    expect("content_sha256", recomputed == named["content_sha256"],
           "the receipt's receipt_sha256 is " + recomputed + ", request.source." + slot_.key +
               ".content_sha256 is " + named["content_sha256"].get<std::string>());

    begin("engine");
    const Json& engine = at(receipt, {"engine", "name"});
    expect("engine", engine == slot_.engine,
           "request.source." + slot_.key + " is the receipt of engine " + show(engine) + ", not " +
               slot_.engine);

    // Kiln accepts receipts of one benchmark driver only (scripts/bench-concurrent-batch.py).
    begin("driver_version");
    expect("driver_version", at(receipt, {"driver_version"}) == Json(kKilnDriverVersion),
           "driver_version is " + show(at(receipt, {"driver_version"})) +
               ", Kiln's receipts come "
               "from driver version \"" +
               std::string(kKilnDriverVersion) + "\"");

    const Json& source = request_.source;
    begin("source_commit");
    const Json& repo = at(receipt, {"driver_environment", "repository"});
    expect("source_commit", at(repo, {"commit"}) == source["source_commit"],
           "driver_environment.repository.commit is " + show(at(repo, {"commit"})) +
               ", request.source.source_commit is " + show(source["source_commit"]));
    begin("clean_tree");
    expect("clean_tree", at(repo, {"dirty"}) == Json(false),
           "driver_environment.repository.dirty is " + show(at(repo, {"dirty"})) +
               ": the engine ran from a modified tree");

    begin("run_id");
    const Json& run_id = at(request_.document, {"prompt", "generator", "run_id"});
    expect("run_id", at(receipt, {"workload", "run_id"}) == run_id,
           "workload.run_id is " + show(at(receipt, {"workload", "run_id"})) +
               ", request.prompt.generator.run_id is " + show(run_id));

    begin("model_identity");
    Json identity = at(receipt, {"engine", "model_identity"});
    if (identity.is_object()) identity.erase("path");
    expect("model_identity", request_.model_identity && identity == *request_.model_identity,
           "engine.model_identity (without path) differs from request.model_identity: " +
               differing_keys(identity, request_.model_identity.value_or(Json())));

    begin("single_run");
    const Json& runs = at(receipt, {"runs"});
    expect("single_run", runs.is_array() && runs.size() == 1,
           "runs has " + count(runs) + " entries, not exactly one");
    const Json& run = runs[0];
    expect("single_run", at(run, {"concurrency"}) == Json(1),
           "runs[0].concurrency is " + show(at(run, {"concurrency"})) + ", not 1");
    // The measured run, not a warm-up (-1) or a later repeat; an integer, as Kiln writes it.
    const Json& repeat = at(run, {"repeat"});
    expect("single_run", repeat.is_number_integer() && repeat == Json(0),
           "runs[0].repeat is " + show(repeat) + ", not 0 (the measured run)");
    check_prompt_tokens(run);
    check_output(run);
    return report_;
  }

 private:
  // The check whose fields are read next (a missing field fails it).
  void begin(const std::string& check) { check_ = check; }
  void passed(const std::string& check) {
    if (report_.checks.empty() || report_.checks.back() != check) report_.checks.push_back(check);
  }
  [[noreturn]] void fail(const std::string& check, const std::string& why) {
    throw Error("request.receipt_mismatch", slot_.engine + " receipt (request.source." + slot_.key +
                                                "): check " + check + " failed: " + why);
  }
  void expect(const std::string& check, bool ok, const std::string& why) {
    if (!ok) fail(check, why);
    passed(check);
  }

  // The value at `path` below `doc`, or a failure of the check under way naming the field.
  const Json& at(const Json& doc, std::initializer_list<std::string_view> path) {
    const Json* v = &doc;
    std::string where;
    for (auto key : path) {
      where += (where.empty() ? "" : ".") + std::string(key);
      if (!v->is_object() || !v->contains(key)) fail(check_, where + " is missing");
      v = &(*v)[std::string(key)];
    }
    return *v;
  }

  static std::string show(const Json& v) { return printable(v.dump(), 200); }
  static std::string keys_of(const Json& v) {
    if (!v.is_object()) return show(v);
    std::string out;
    for (const auto& [k, x] : v.items()) out += (out.empty() ? "" : ", ") + printable(k, 80);
    return "[" + out + "]";
  }
  static std::string count(const Json& v) {
    return v.is_array() ? std::to_string(v.size()) : std::string(v.type_name());
  }
  static std::string differing_keys(const Json& a, const Json& b) {
    if (!a.is_object() || !b.is_object()) return show(a) + " vs " + show(b);
    std::string keys;
    for (const auto& [k, v] : b.items())
      if (!a.contains(k) || a[k] != v) keys += (keys.empty() ? "" : ", ") + k;
    for (const auto& [k, v] : a.items())
      if (!b.contains(k)) keys += (keys.empty() ? "" : ", ") + k;
    return "differs in " + keys;
  }

  void check_prompt_tokens(const Json& run) {
    begin("prompt_token_count");
    const Json& want = at(request_.document, {"prompt", "token_count"});
    const Json& counts = at(run, {"prompt_token_counts"});
    // One request, one count: exactly [n], n the prompt's own tokens (without the prefix).
    bool ok = counts.is_array() && counts.size() == 1 && counts[0].is_number_integer() &&
              counts[0] == want;
    expect("prompt_token_count", ok,
           "runs[0].prompt_token_counts is " + show(counts) + ", not [" + show(want) +
               "] (one request of request.prompt.token_count tokens)");
    for (const char* k : {"prompt_tokens_min", "prompt_tokens_max"})
      expect("prompt_token_count", at(run, {k}) == want,
             std::string("runs[0].") + k + " is " + show(at(run, {k})) +
                 ", request.prompt.token_count is " + show(want));
  }

  void check_output(const Json& run) {
    begin("single_output");
    const Json& rows = at(run, {"output_evidence"});
    expect("single_output", rows.is_array() && rows.size() == 1,
           "runs[0].output_evidence has " + count(rows) + " rows, not exactly one");
    const Json& row = rows[0];
    const Json& exact = at(row, {"exact_output"});
    expect("single_output",
           exact.is_object() && exact.size() == 2 && exact.contains("content_base64") &&
               exact.contains("reasoning_content_base64"),
           "output_evidence[0].exact_output has keys " + keys_of(exact) +
               ", not exactly content_base64 and reasoning_content_base64");
    std::string content = decode(at(exact, {"content_base64"}), "content_base64");
    std::string reasoning =
        decode(at(exact, {"reasoning_content_base64"}), "reasoning_content_base64");
    begin("empty_reasoning");
    expect("empty_reasoning", reasoning.empty() && at(row, {"reasoning_utf8_bytes"}) == Json(0),
           "the output has " + std::to_string(reasoning.size()) + " bytes of reasoning");
    begin("output_sha256");
    expect("output_sha256", at(row, {"content_sha256"}) == sha256_id(content),
           "output_evidence[0].content_sha256 is " + show(at(row, {"content_sha256"})) +
               ", the decoded content hashes to " + sha256_id(content));

    std::string expected;
    for (const auto& t : request_.continuation_prefix) expected += t.text;
    const Candidate* candidate = nullptr;
    for (const auto& c : request_.candidates)
      if (c.engine == slot_.engine) candidate = &c;
    expect("continuation", candidate != nullptr,
           "the request has no candidate of engine " + slot_.engine);
    expected += candidate->text;
    expect("continuation", content.starts_with(expected),
           "the output starts " + show(Json(content.substr(0, expected.size() + 16))) +
               ", not with the continuation prefix and the candidate: " + show(Json(expected)));
  }

  std::string decode(const Json& v, const std::string& name) {
    if (!v.is_string()) fail("single_output", name + " is not a string");
    try {
      return base64_decode(v.get_ref<const std::string&>());
    } catch (const Error& e) {
      fail("single_output", name + " is not base64: " + e.what());
    }
  }

  const NextTokenRequest& request_;
  const ReceiptSlot& slot_;
  ReceiptReport report_;
  std::string check_ = "json";
};

}  // namespace

std::vector<ReceiptSlot> receipt_slots() {
  return {{"kiln", "kiln_receipt"}, {"vllm", "vllm_receipt"}};
}

Json ReceiptReport::to_json() const {
  return Json{{"engine", engine},
              {"file_sha256", file_sha256},
              {"receipt_sha256", receipt_sha256},
              {"checks", checks}};
}

ReceiptReport check_kiln_receipt(const NextTokenRequest& request, const ReceiptSlot& slot,
                                 std::string_view bytes) {
  if (request.kind != RequestKind::kKiln)
    throw Error("request.receipt_mismatch", "only a Kiln request names engine receipts");
  return ReceiptChecker(request, slot).run(bytes);
}

Json receipts_checked(const std::vector<ReceiptReport>& reports) {
  Json list = Json::array();
  for (const auto& r : reports) list.push_back(r.to_json());
  return Json{{"checked", true}, {"receipts", list}};
}

Json receipts_not_checked(std::string_view reason) {
  return Json{{"checked", false}, {"reason", reason}};
}

Json receipts_not_given(const NextTokenRequest& request) {
  return receipts_not_checked(request.kind == RequestKind::kKiln
                                  ? "no receipts were given (assay submit --receipts DIR)"
                                  : "an assay request names no receipts");
}

}  // namespace assay::common
