// Private to `assay report`: the HTML helpers both pages share (escaping, number formatting,
// key/value tables of JSON objects, the page shell with its inline CSS) and the pages, one per
// result kind (report_next_token.cpp, report_fidelity.cpp, report_layers.cpp,
// report_numerics.cpp, report_trajectory.cpp, report_prompt.cpp); report.cpp picks the page.
#pragma once

#include <filesystem>
#include <initializer_list>
#include <string>

#include "client/report.h"
#include "common/json.h"

namespace assay::client::html {

// s with & < > " ' escaped for text and attribute values.
std::string esc(const std::string& s);
// A token's text for the page: HTML-escaped, each control byte shown as its escape (\n, \t,
// \u0019) in a marked span, never as an invisible character or an empty box.
std::string visible(const std::string& s);
// v through snprintf's format f.
std::string fmt(double v, const char* f = "%.6g");
// A JSON value as table text: "—" for null, strings unquoted, numbers as fmt does.
std::string text_of(const common::Json& v);
// text_of the value at `path`, or "—" where the path does not lead to one.
std::string get(const common::Json& j, std::initializer_list<const char*> path);
// A key/value table of an object, nested objects flattened with dotted keys.
std::string kv_table(const common::Json& j);
// The whole document: title, inline CSS, body and the footer.
std::string page(const std::string& title, const std::string& body);

// An assay.next-token-oracle-result.v1 page; the artifact is looked for in `dir`; the prompt
// section shows `prompt` or says how to get it.
std::string next_token_page(const common::Json& r, const std::filesystem::path& dir,
                            const Prompt* prompt);
// The next-token page's prompt section (report_prompt.cpp).
std::string prompt_section(const Prompt* prompt);
// An assay.fidelity-result.v1 page; the artifact is looked for in `dir`.
std::string fidelity_page(const common::Json& r, const std::filesystem::path& dir);
// An assay.layer-attribution-result.v1 page; layers.safetensors is looked for in `dir`.
std::string layers_page(const common::Json& r, const std::filesystem::path& dir);
// An assay.trajectory-result.v1 page; trajectory.safetensors is looked for in `dir`
// (report_trajectory.cpp).
std::string trajectory_page(const common::Json& r, const std::filesystem::path& dir);
// An assay.next-token-batch-result.v1 page; states.jsonl is looked for in `dir`.
std::string batch_page(const common::Json& r, const std::filesystem::path& dir);
// An assay.engine-audit-result.v1 page (report_numerics.cpp).
std::string audit_page(const common::Json& r, const std::filesystem::path& dir);
// A next-token result's "numerics" (the envelope, its class and a strip plot), or why it did not
// run; any shape of document draws without throwing.
std::string numerics_section(const common::Json& numerics);

}  // namespace assay::client::html
