// `assay report --request`: the prompt a next-token page shows, from the request the job ran
// (report.h: load_prompt), and its section of the page.
#include <sstream>

#include "client/report.h"
#include "client/report_html.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/request.h"
#include "common/tokenizer.h"

namespace assay::client {

namespace fs = std::filesystem;
using common::Error;
using common::Json;

namespace {

std::string member(const Json& j, const char* a, const char* b) {
  if (!j.is_object() || !j.contains(a) || !j[a].is_object() || !j[a].contains(b) ||
      !j[a][b].is_string())
    return "";
  return j[a][b].get<std::string>();
}

// The ids decoded with the tokenizer of `dir`, when its tokenizer.json is the one the result
// names; otherwise nullopt and `note` says why.
std::optional<std::string> decode_with(const Json& result, const fs::path& dir,
                                       std::span<const std::int64_t> ids, std::string& note) {
  const std::string want = member(result, "model_identity", "tokenizer_hash");
  std::string tokenizer;
  try {
    tokenizer = common::read_file(dir / "tokenizer.json", common::kMaxTokenizerBytes);
  } catch (const Error& e) {
    note = std::string("not decoded: ") + e.what();
    return std::nullopt;
  }
  const std::string have = common::sha256_id(tokenizer);
  if (have != want) {
    note = "not decoded: " + (dir / "tokenizer.json").string() + " hashes to " + have +
           ", not the result's tokenizer_hash " + (want.empty() ? "(none)" : want);
    return std::nullopt;
  }
  std::optional<std::string> config;
  std::error_code ec;
  if (fs::exists(dir / "tokenizer_config.json", ec)) {
    try {
      config = common::read_file(dir / "tokenizer_config.json", common::kMaxTokenizerBytes);
    } catch (const Error& e) {
      note = std::string("not decoded: ") + e.what();
      return std::nullopt;
    }
  }
  try {
    common::Tokenizer t = common::Tokenizer::parse(tokenizer, config);
    note = "decoded with " + (dir / "tokenizer.json").string() + " (" + have +
           ", the result's tokenizer_hash)";
    return t.decode(ids);
  } catch (const Error& e) {
    note = std::string("not decoded: ") + e.what();
    return std::nullopt;
  }
}

}  // namespace

Prompt load_prompt(const Json& result, const fs::path& request_file,
                   const std::optional<fs::path>& model_dir) {
  common::NextTokenRequest req;
  try {
    req = common::parse_request(common::read_file(request_file, common::kMaxRequestBytes));
  } catch (const Error& e) {
    throw Error("client.report_request_invalid",
                request_file.string() + " is not a next-token request: " + e.what());
  }
  const std::string want = member(result, "request", "sha256");
  const std::string want_ids = member(result, "request", "input_token_ids_sha256");
  if (req.request_sha256 != want)
    throw Error("client.report_request",
                request_file.string() + " is not the request this result answers: its sha256 is " +
                    req.request_sha256 + ", the result's request.sha256 is " +
                    (want.empty() ? "(none)" : want));
  if (req.input_token_ids_sha256 != want_ids)
    throw Error("client.report_request", request_file.string() + "'s input_token_ids_sha256 is " +
                                             req.input_token_ids_sha256 + ", the result's is " +
                                             want_ids);
  Prompt p;
  p.request_path = request_file.string();
  p.request_sha256 = req.request_sha256;
  p.ids = req.input_token_ids;
  p.prompt_tokens = p.ids.size() - req.continuation_prefix.size();
  if (req.kind == common::RequestKind::kKiln) {
    const Json& prompt = req.document["prompt"];
    p.messages = prompt["messages"];
    p.template_options = Json{{"add_generation_prompt", prompt["add_generation_prompt"]},
                              {"template_kwargs", prompt["template_kwargs"]}};
  }
  std::optional<fs::path> dir = model_dir;
  if (!dir && req.model_dir) dir = fs::path(*req.model_dir);
  if (dir)
    p.rendering = decode_with(result, *dir, p.ids, p.rendering_note);
  else
    p.rendering_note =
        "not decoded: a Kiln request names no model directory (give --model DIR, the directory "
        "whose tokenizer.json the result's tokenizer_hash names)";
  return p;
}

namespace html {

namespace {

// visible(), with a real line break after each shown "\n" so that the text keeps its lines.
std::string visible_lines(const std::string& s) {
  std::string o;
  std::size_t from = 0;
  for (;;) {
    std::size_t nl = s.find('\n', from);
    o += visible(s.substr(from, nl == std::string::npos ? std::string::npos : nl + 1 - from));
    if (nl == std::string::npos) return o;
    o += "\n";
    from = nl + 1;
  }
}

}  // namespace

std::string prompt_section(const Prompt* p) {
  std::ostringstream b;
  b << "<h2>Prompt</h2>";
  if (!p) {
    b << "<p class=\"sub\">The result names its request by sha256 only. Give <code>assay report "
         "--request FILE</code> (the request the job ran; checked against that sha256) to show "
         "the prompt here.</p>";
    return b.str();
  }
  b << "<p class=\"sub\">From <code>" << esc(p->request_path) << "</code>, whose sha256 "
    << "<code>" << esc(p->request_sha256) << "</code> and token ids are the result's. "
    << p->ids.size() << " input tokens";
  if (p->prompt_tokens != p->ids.size())
    b << " (" << p->prompt_tokens << " of the prompt, then " << p->ids.size() - p->prompt_tokens
      << " forced by the continuation prefix)";
  b << ".</p>";
  if (p->messages.is_array()) {
    b << "<table><tr><th>role</th><th>content</th></tr>";
    for (const Json& m : p->messages)
      b << "<tr><td>" << esc(get(m, {"role"})) << "</td><td><pre class=\"prompt\">"
        << visible_lines(get(m, {"content"})) << "</pre></td></tr>";
    b << "</table>" << kv_table(p->template_options);
  }
  b << "<h3>As the model saw it</h3><p class=\"sub\">The input token ids decoded: the chat "
       "template's rendering, special tokens included; "
    << esc(p->rendering_note) << ".</p>";
  if (p->rendering) b << "<pre class=\"prompt\">" << visible_lines(*p->rendering) << "</pre>";
  std::string ids;
  for (std::size_t i = 0; i < p->ids.size(); ++i) ids += (i ? " " : "") + std::to_string(p->ids[i]);
  b << "<details><summary>token ids</summary><p class=\"mono\">" << esc(ids) << "</p></details>";
  return b.str();
}

}  // namespace html
}  // namespace assay::client
