// `assay report` (report.h): picks the page for the result's schema, and the HTML helpers both
// pages share (report_html.h): escaping, formatting, key/value tables and the page shell with
// its inline CSS. The pages are report_next_token.cpp, report_fidelity.cpp, report_layers.cpp,
// report_numerics.cpp (engine audits) and report_trajectory.cpp (trajectories and batches).
#include "client/report.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "client/format.h"
#include "client/report_html.h"
#include "common/audit.h"
#include "common/error.h"
#include "common/layers.h"
#include "common/protocol.h"
#include "common/trajectory.h"

namespace assay::client {
namespace html {
namespace {

using common::Json;

constexpr const char* kCss = R"(
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1000px;color:#1d2430;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dde6;padding-bottom:4px}
.sub{color:#5a6473;margin:0 0 16px}code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #eceff4;text-align:left;vertical-align:top}
th{background:#f5f7fa;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.verdict{border-radius:8px;padding:14px 18px;margin:12px 0;font-size:16px}
.ok{background:#e6f4ea;border:1px solid #8cc79c}.bad{background:#fdecea;border:1px solid #e59a93}.neutral{background:#eef2f8;border:1px solid #b8c4d6}
.pass{color:#1e7b34;font-weight:600}.fail{color:#b3261e;font-weight:600}.undecided{color:#8a6d00;font-weight:600}
svg{display:block;margin:8px 0;background:#fcfdff;border:1px solid #e3e7ee;border-radius:6px}
svg text{font:11px system-ui,sans-serif;fill:#3b4452}
.grid{stroke:#e6e9ef}.axis{stroke:#8a93a3}
details{margin:6px 0}summary{cursor:pointer;color:#3b5b9a}
.kv td:first-child{color:#5a6473;white-space:nowrap}
tr.marked td{background:#fff4e0}table.layers td,table.layers th{padding:2px 5px;font-size:12px}
.verified,.unverified{border-radius:6px;padding:8px 12px;margin:0 0 12px;font-weight:600}
.verified{background:#e6f4ea;border:1px solid #8cc79c}.unverified{background:#fff4e0;border:1px solid #e0b25c}
.kv td.mono{word-break:break-all}pre.prompt{white-space:pre-wrap;word-break:break-word;background:#f5f7fa;border:1px solid #e3e7ee;border-radius:6px;padding:8px 10px;margin:4px 0;font:12px/1.5 ui-monospace,SFMono-Regular,Menlo,monospace}h3{font-size:15px;margin:16px 0 4px}.ctl{color:#b3261e;background:#fdecea;border-radius:3px;padding:0 2px;font-family:ui-monospace,monospace}
)";

// A leaf's text, with its unit humanised where its key names one (`peak_bytes`, `user_usec`,
// `timeout_ms`, `elapsed_seconds`, `_ns`): "1.5 MiB (1572864)".
std::string leaf_text(const std::string& key, const Json& v) {
  if (!v.is_number() || v.is_boolean()) return text_of(v);
  const double x = v.get<double>();
  auto ends = [&](const char* suffix) { return key.ends_with(suffix); };
  std::string human;
  if (ends("bytes") || ends("_bytes_before") || ends("memory_max") || ends("memory_high"))
    human = format_bytes(x);
  else if (ends("_usec"))
    human = format_duration(x / 1e6);
  else if (ends("_ns") || ends("cpuacct.usage") || ends("cpuacct.usage_sys") ||
           ends("cpuacct.usage_user"))
    human = format_duration(x / 1e9);
  else if (ends("_ms"))
    human = format_duration(x / 1e3);
  else if (ends("_seconds"))
    human = format_duration(x);
  return human.empty() ? text_of(v) : human + " (" + text_of(v) + ")";
}

// Appends `j`'s leaves as (dotted key, text) rows.
void flatten(const Json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(*it, prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else if (j.is_array() && !j.empty() && j[0].is_object()) {
    for (std::size_t i = 0; i < j.size(); ++i)
      flatten(j[i], prefix + "[" + std::to_string(i) + "]", out);
  } else {
    out.emplace_back(prefix, leaf_text(prefix, j));
  }
}

}  // namespace

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&#39;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string visible(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char b[8];
      const char* named = c == '\n' ? "\\n" : c == '\t' ? "\\t" : c == '\r' ? "\\r" : nullptr;
      if (!named) std::snprintf(b, sizeof b, "\\u%04x", c);
      o += std::string("<span class=\"ctl\">") + (named ? named : b) + "</span>";
    } else {
      o += esc(std::string(1, static_cast<char>(c)));
    }
  }
  return o;
}

std::string fmt(double v, const char* f) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string text_of(const Json& v) {
  if (v.is_null()) return "—";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<std::int64_t>());
  if (v.is_number()) return fmt(v.get<double>());
  return v.dump();
}

std::string get(const Json& j, std::initializer_list<const char*> path) {
  const Json* at = &j;
  for (const char* k : path) {
    if (!at->is_object() || !at->contains(k)) return "—";
    at = &(*at)[k];
  }
  return text_of(*at);
}

std::string kv_table(const Json& j) {
  std::vector<std::pair<std::string, std::string>> rows;
  flatten(j, "", rows);
  std::string o = "<table class=\"kv\">";
  for (const auto& [k, v] : rows)
    o += "<tr><td>" + esc(k) + "</td><td class=\"mono\">" + esc(v) + "</td></tr>";
  return o + "</table>";
}

std::string page(const std::string& title, const std::string& body) {
  return "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
         "<title>" +
         esc(title) + "</title><style>" + kCss + "</style></head><body>\n" + body +
         "\n<p class=\"sub\">Generated by <code>assay report</code>: one file, no script, no "
         "network. The signed result is the record; this page is a view of "
         "it.</p>\n</body></html>\n";
}

}  // namespace html

namespace {

std::string page_of(const common::Json& result, const std::filesystem::path& artifact_dir,
                    const Prompt* prompt) {
  const std::string schema = result.is_object() ? result.value("schema", std::string()) : "";
  if (schema == "assay.next-token-oracle-result.v1")
    return html::next_token_page(result, artifact_dir, prompt);
  if (prompt)
    throw common::Error("client.report", "--request applies to a next-token result, not to a \"" +
                                             schema + "\" document");
  if (schema == "assay.fidelity-result.v1") return html::fidelity_page(result, artifact_dir);
  if (schema == common::kLayerResult) return html::layers_page(result, artifact_dir);
  if (schema == common::kAuditResult) return html::audit_page(result, artifact_dir);
  if (schema == common::kTrajectoryResult) return html::trajectory_page(result, artifact_dir);
  if (schema == protocol::kNextTokenBatchResult) return html::batch_page(result, artifact_dir);
  throw common::Error("client.report",
                      "a report needs an assay.next-token-oracle-result.v1, "
                      "assay.fidelity-result.v1, " +
                          std::string(common::kLayerResult) + ", " +
                          std::string(common::kAuditResult) + ", " +
                          std::string(common::kTrajectoryResult) + " or " +
                          std::string(protocol::kNextTokenBatchResult) +
                          " document, not schema \"" + schema + "\"");
}

}  // namespace

std::string render_report(const common::Json& result, const std::filesystem::path& artifact_dir,
                          const std::string& verification, bool verified, const Prompt* prompt) {
  std::string out = page_of(result, artifact_dir, prompt);
  // First thing in the body: what was checked before this page was drawn.
  const std::string body = "<body>\n";
  std::size_t at = out.find(body);
  if (at == std::string::npos) throw common::Error("client.report", "page without a body");
  out.insert(at + body.size(), std::string("<p class=\"") + (verified ? "verified" : "unverified") +
                                   "\" role=\"status\">" + html::esc(verification) + "</p>\n");
  return out;
}

}  // namespace assay::client
