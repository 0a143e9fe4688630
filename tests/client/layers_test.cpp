// The client side of layer-attribution jobs: `request check` and `layer submit` on requests,
// `layer show`'s table (layer_report), the report page and its log axis, HTML escaping, and
// `assay verify` on a sealed, signed result with its layers.safetensors. The result documents are
// built here and validated against schemas/layer-attribution-result.schema.json first.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>

#include <doctest/doctest.h>

#include "client/format.h"
#include "client/report.h"
#include "client/verify.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/layers.h"
#include "common/result.h"
#include "common/sign.h"
#include "common/trajectory.h"
#include "support.h"

namespace {

using assay::common::Json;
namespace common = assay::common;
namespace client = assay::client;
using client::test::run;
using client::test::TempDir;

// A boundary's relative RMSE in a built result: 0 is bitwise equal; kOmitted: the engine's file
// lacks it; kUndefined: the reference's rows are all zero and the engine's are not.
constexpr double kOmitted = -1, kUndefined = -2;

struct Spec {
  std::string name;
  double rel;
};

struct Options {
  std::string engine = "kiln";
  std::string job_id = "j-layers-0001";
  double tolerance = 0.01;
  std::int64_t flip = -2;  // patching's first flip; -1: patched without a flip; -2: no patching
};

// Two decoder layers: bitwise up to the first layer's post-attention norm, an omitted layer
// output, an undefined relative RMSE, over the tolerance from layers.1.post_attention_layernorm.
const std::vector<Spec> kTwoLayers{
    {"embedding", 0},
    {"layers.0.input_layernorm", 0},
    {"layers.0.self_attn", 0},
    {"layers.0.post_attention_layernorm", 2e-5},
    {"layers.0.mlp", 2e-4},
    {"layers.0", kOmitted},
    {"layers.1.input_layernorm", 2e-3},
    {"layers.1.self_attn", kUndefined},
    {"layers.1.post_attention_layernorm", 2e-2},
    {"layers.1.mlp", 0.015},
    {"layers.1", 0.03},
    {"norm", 0.025},
};

Json fixture_result() {
  return common::parse_strict(
      common::read_file(ASSAY_CLIENT_TEST_DIR "/fixtures/report/result.json", 1 << 22));
}

Json at(std::int64_t i, const std::string& name) {
  return Json{{"index", i}, {"name", name}};
}

// A layer-attribution result as assayd seals it, with metrics that follow Kiln's definitions
// from each boundary's relative RMSE (reference RMS 0.5), growth, the three departures and,
// with o.flip > -2, patching over every boundary the engine gave.
Json layer_result(const std::vector<Spec>& spec, const Options& o = {}) {
  const Json fx = fixture_result();
  const Json process = fx["oracle"]["process"];
  const std::string digest = common::sha256_id("rows");
  constexpr double kRms = 0.5;
  Json boundaries = Json::array(), omitted = Json::array();
  Json first_nb, first_over, largest;
  double best_growth = 0, prev = 0;
  bool have_prev = false;
  std::int64_t given = 0;
  for (std::size_t k = 0; k < spec.size(); ++k) {
    const auto i = static_cast<std::int64_t>(k);
    const Spec& s = spec[k];
    Json b{{"index", i},
           {"name", s.name},
           {"present", s.rel != kOmitted},
           {"reference_sha256", common::sha256_id("reference " + s.name)}};
    for (const char* m :
         {"bitwise_equal", "cosine_similarity", "max_abs_error", "mean_abs_error",
          "root_mean_square_error", "reference_root_mean_square", "relative_root_mean_square_error",
          "relative_rmse_growth", "engine_sha256", "engine_dtype"})
      b[m] = nullptr;
    if (s.rel == kOmitted) {
      omitted.push_back(s.name);
    } else {
      ++given;
      b["engine_sha256"] = common::sha256_id("engine " + s.name);
      b["engine_dtype"] = "BF16";
      if (s.rel == kUndefined) {
        b["bitwise_equal"] = false;
        b["max_abs_error"] = 0.25;
        b["mean_abs_error"] = 0.125;
        b["root_mean_square_error"] = 0.125;
        b["reference_root_mean_square"] = 0.0;
      } else {
        b["bitwise_equal"] = s.rel == 0;
        b["cosine_similarity"] = 1 - s.rel * s.rel / 2;
        b["max_abs_error"] = 4 * s.rel * kRms;
        b["mean_abs_error"] = 0.8 * s.rel * kRms;
        b["root_mean_square_error"] = s.rel * kRms;
        b["reference_root_mean_square"] = kRms;
        b["relative_root_mean_square_error"] = s.rel;
        if (have_prev) {
          const double g = s.rel - prev;
          b["relative_rmse_growth"] = g;
          if (g > best_growth) {
            best_growth = g;
            largest = at(i, s.name);
            largest["relative_rmse_growth"] = g;
          }
        }
        prev = s.rel;
        have_prev = true;
        if (first_over.is_null() && s.rel > o.tolerance) {
          first_over = at(i, s.name);
          first_over["relative_root_mean_square_error"] = s.rel;
        }
      }
      if (first_nb.is_null() && b["bitwise_equal"] == false) first_nb = at(i, s.name);
    }
    boundaries.push_back(b);
  }

  Json patching;
  if (o.flip > -2) {
    Json rows = Json::array(), hold;
    for (const Json& b : boundaries) {
      if (!b["present"].get<bool>()) continue;
      const std::int64_t i = b["index"].get<std::int64_t>();
      const bool flips = o.flip >= 0 && i >= o.flip;
      if (o.flip >= 0 && i < o.flip) hold = at(i, b["name"].get<std::string>());
      rows.push_back({{"index", i},
                      {"name", b["name"]},
                      {"argmax_token_id", flips ? 7 : 3},
                      {"becomes_candidate", flips},
                      {"logits_sha256", "sha256:" + std::string(64, flips ? '7' : '3')},
                      {"seconds", 0.25},
                      {"rounded_elements", i == 4 ? 12 : 0}});
    }
    patching = {{"candidate_token_id", 7},
                {"reference_argmax_token_id", 3},
                {"forwards", rows.size()},
                {"seconds", 0.25 * static_cast<double>(rows.size())},
                {"boundaries", rows},
                {"first_flip", o.flip >= 0 ? at(o.flip, spec[o.flip].name) : Json()},
                {"last_hold", hold}};
  }

  const std::string artifact = "the reference rows";
  Json r{
      {"schema", std::string(common::kLayerResult)},
      {"created_at_utc", "2026-12-01T10:00:00Z"},
      {"duration_seconds", 4.5},
      {"job_id", o.job_id},
      {"supervisor", {{"version", "0.1.0"}, {"key_id", common::sha256_id("key")}}},
      {"request",
       {{"schema", std::string(common::kLayerRequest)},
        {"id", "layers-1"},
        {"sha256", common::sha256_id("request")},
        {"model_dir", "/models/tiny"},
        {"input_length", 4},
        {"input_token_ids_sha256", common::sha256_id("[1,2,3,4]")},
        {"rows", o.flip > -2 ? "all" : "last"},
        {"tolerance", {{"relative_rmse", o.tolerance}}},
        {"patching", o.flip > -2}}},
      {"model_identity", fx["model_identity"]},
      {"model_fingerprint",
       {{"implementation_sha256", common::sha256_id("assay-fingerprint")},
        {"files", nullptr},
        {"process", process}}},
      {"engine",
       {{"name", o.engine},
        {"next_token_id", o.flip > -2 ? Json(7) : Json()},
        {"rows_file", {{"path", "/data/rows.safetensors"}, {"sha256", digest}, {"bytes", 4096}}},
        {"boundaries_given", given},
        {"omitted", omitted}}},
      {"reference",
       {{"argmax_token_id", 3},
        {"argmax_logit", 12.5},
        {"logits_sha256", common::sha256_id("logits")},
        {"hidden_size", 64},
        {"boundary_count", spec.size()},
        {"rows_sha256", common::sha256_id(artifact)},
        {"output", {{"forward_seconds", 0.5}}},
        {"process", process}}},
      {"boundaries", boundaries},
      {"first_non_bitwise", first_nb},
      {"first_over_tolerance", first_over},
      {"largest_growth", largest},
      {"patching", patching},
      {"comparison", {{"seconds", 0.01}, {"process", process}}},
      {"containment", fx["containment"]},
      {"layers_artifact",
       {{"name", std::string(common::kLayerArtifactFileName)},
        {"bytes", artifact.size()},
        {"sha256", common::sha256_id(artifact)}}},
  };
  common::seal_result(r);
  return r;
}

// The document against the result schema, with the Python tool the other schema tests use.
void check_valid(const Json& doc) {
  TempDir dir;
  const std::string path = dir.write("result.json", doc.dump());
  const std::string cmd = "'" ASSAY_VALIDATE_PYTHON "' '" ASSAY_SOURCE_DIR
                          "/tests/tools/validate_schema.py' '" ASSAY_SOURCE_DIR
                          "/schemas/layer-attribution-result.schema.json' '" +
                          path + "' 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  CHECK_MESSAGE(status == 0, "not a valid layer-attribution result: " << out);
}

// The line of `text` that contains `needle`, or "".
std::string line_with(const std::string& text, const std::string& needle) {
  std::size_t at = text.find(needle);
  if (at == std::string::npos) return "";
  std::size_t begin = text.rfind('\n', at);
  begin = begin == std::string::npos ? 0 : begin + 1;
  return text.substr(begin, text.find('\n', at) - begin);
}

// A table row's cells: the text between runs of two or more spaces.
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  const std::regex gap(" {2,}");
  for (auto it = std::sregex_token_iterator(line.begin(), line.end(), gap, -1);
       it != std::sregex_token_iterator(); ++it)
    if (it->length() > 0) out.push_back(*it);
  return out;
}

// The boundary's row of layer_report's table, as cells.
std::vector<std::string> row_of(const std::string& text, const std::string& name) {
  return cells(line_with(text, "  " + name + "  "));
}

// The chart's data points by boundary index: {cx, cy} of each circle of `kind` (zero, value).
std::map<int, std::pair<double, double>> circles(const std::string& html, const std::string& kind) {
  std::map<int, std::pair<double, double>> out;
  const std::regex re("<circle class=\"pt " + kind +
                      "\" data-index=\"([0-9]+)\" cx=\"([0-9.]+)\" cy=\"([0-9.]+)\"");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), re); it != std::sregex_iterator();
       ++it)
    out[std::stoi((*it)[1])] = {std::stod((*it)[2]), std::stod((*it)[3])};
  return out;
}

double attribute_of(const std::string& html, const std::string& element_start,
                    const std::string& attr) {
  const std::regex re(element_start + "[^>]*? " + attr + "=\"([0-9.]+)\"");
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(html, m, re), element_start << " " << attr);
  return std::stod(m[1]);
}

const std::string kRowsSha =
    "sha256:abababababababababababababababababababababababababababababababab";

// A layer request with patching, as `assay layer submit` takes it.
Json request_doc() {
  return {{"schema", "assay.layer-attribution-request.v1"},
          {"id", "layers-1"},
          {"model_dir", "/models/tiny"},
          {"input_token_ids", {1, 2, 3, 4}},
          {"engine",
           {{"name", "kiln"},
            {"rows_file", {{"path", "/data/rows.safetensors"}, {"sha256", kRowsSha}}},
            {"next_token_id", 7}}},
          {"rows", "all"},
          {"patching", true}};
}

}  // namespace

TEST_CASE("the built layer-attribution results are valid against the result schema") {
  check_valid(layer_result(kTwoLayers, {.flip = 6}));
  check_valid(layer_result(kTwoLayers));
  check_valid(layer_result(kTwoLayers, {.engine = "<script>alert(1)</script>", .flip = -1}));
  // The validator does fail: a boundary without its metrics is not a result.
  Json broken = layer_result(kTwoLayers);
  broken["boundaries"][3].erase("cosine_similarity");
  TempDir dir;
  const std::string cmd = "'" ASSAY_VALIDATE_PYTHON "' '" ASSAY_SOURCE_DIR
                          "/tests/tools/validate_schema.py' '" ASSAY_SOURCE_DIR
                          "/schemas/layer-attribution-result.schema.json' '" +
                          dir.write("broken.json", broken.dump()) + "' >/dev/null 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
}

TEST_CASE("request check recognises a layer-attribution request and prints its identities") {
  TempDir dir;
  auto r = run({"--json", "request", "check", dir.write("layers.json", request_doc().dump())});
  REQUIRE(r.status == 0);
  Json report = common::parse_strict(r.out);
  // Both digests computed by Python's json.dumps(sort_keys=True, separators=(",", ":")).
  CHECK(report == Json{{"schema", "assay.layer-attribution-request.v1"},
                       {"request_sha256",
                        "sha256:b2ab3271cdbee04d6d061e8216eafb53a33cc3d4ab66da8ed6f8a80a4692e00a"},
                       {"input_length", 4},
                       {"input_token_ids_sha256",
                        "sha256:f6bd10506e9a4daed7c03eda2f2fde54be3bd58eee49dab471c18a888ffbdb6f"},
                       {"engine", "kiln"},
                       {"rows_file_sha256", kRowsSha},
                       {"rows", "all"},
                       {"tolerance", {{"relative_rmse", 0.01}}},
                       {"patching", true}});
}

TEST_CASE("layer submit checks the request locally before it contacts assayd") {
  TempDir dir;
  client::Environment env{.socket = "/nonexistent/assayd.sock"};
  // Valid: it gets as far as the absent daemon.
  auto r = run({"layer", "submit", dir.write("good.json", request_doc().dump())}, env);
  CHECK(r.status == 3);
  // Patching with only the last rows is refused by name, before any connection.
  Json bad = request_doc();
  bad["rows"] = "last";
  r = run({"layer", "submit", dir.write("bad.json", bad.dump())}, env);
  CHECK(r.status == 7);
  CHECK(r.err.find("request.patching needs request.rows \"all\"") != std::string::npos);
  CHECK(r.err.find("[request.invalid]") != std::string::npos);
  CHECK(r.err.find("cannot connect") == std::string::npos);
  // Another kind of request is not a layer request.
  Json other = {{"schema", "assay.next-token-request.v1"}, {"id", "x"}};
  r = run({"layer", "submit", dir.write("other.json", other.dump())}, env);
  CHECK(r.status == 7);
  // --model does not apply: the request names its model_dir.
  r = run({"submit", dir / "good.json", "--model", "/x"}, env);
  CHECK(r.status == 2);
  CHECK(r.err.find("--model does not apply to a layer-attribution request") != std::string::npos);
  // Plain submit accepts the kind too.
  CHECK(run({"submit", dir / "good.json"}, env).status == 3);
  // show needs an id; --help describes both commands.
  CHECK(run({"layer", "show"}, env).status == 2);
  r = run({"layer", "show", "j-000000000000000000000000"}, env);
  CHECK(r.status == 3);
  r = run({"layer", "--help"});
  CHECK(r.status == 0);
  CHECK(r.out.find("submit") != std::string::npos);
  CHECK(r.out.find("show") != std::string::npos);
  r = run({"--help"});
  CHECK(r.out.find("  layer ") != std::string::npos);
  CHECK(run({"layer", "show", "--help"}).out.find("first non-bitwise") != std::string::npos);
}

TEST_CASE("layer show's table marks the departures and the patching bracket") {
  const Json r = layer_result(kTwoLayers, {.flip = 6});
  check_valid(r);
  const std::string text = client::layer_report(r);
  INFO(text);
  const std::vector<std::string> header = cells(line_with(text, "  #"));
  CHECK(header == std::vector<std::string>{"#", "boundary", "bitwise", "cosine", "max abs",
                                           "mean abs", "RMSE", "ref RMS", "rel RMSE", "growth",
                                           "patched argmax"});
  // Each row: index, name, bitwise, the seven metrics, the patched argmax, the marks.
  CHECK(row_of(text, "layers.0.self_attn") == std::vector<std::string>{"2", "layers.0.self_attn",
                                                                       "yes", "1", "0", "0", "0",
                                                                       "0.5", "0", "+0", "3"});
  CHECK(row_of(text, "layers.0.post_attention_layernorm") ==
        std::vector<std::string>{"3", "layers.0.post_attention_layernorm", "no", "0.9999999998",
                                 "4e-05", "8e-06", "1e-05", "0.5", "2e-05", "+2e-05", "3",
                                 "<- first non-bitwise"});
  CHECK(row_of(text, "layers.0.mlp").back() == "<- last hold");
  CHECK(row_of(text, "layers.0") == std::vector<std::string>{"5", "layers.0", "omitted", "-", "-",
                                                             "-", "-", "-", "-", "-", "-"});
  const auto flip = row_of(text, "layers.1.input_layernorm");
  REQUIRE(flip.size() == 12);
  CHECK(flip[10] == "7 (engine's)");
  CHECK(flip[11] == "<- first flip");
  const auto undefined = row_of(text, "layers.1.self_attn");
  CHECK(undefined == std::vector<std::string>{"7", "layers.1.self_attn", "no", "-", "0.25", "0.125",
                                              "0.125", "0", "-", "-", "7 (engine's)"});
  CHECK(row_of(text, "layers.1.post_attention_layernorm").back() ==
        "<- first over tolerance, largest growth");
  for (const char* s :
       {"first non-bitwise:    3 layers.0.post_attention_layernorm\n",
        "first over tolerance: 8 layers.1.post_attention_layernorm (relative RMSE 0.02 > 0.01)\n",
        "largest growth:       8 layers.1.post_attention_layernorm (+0.018)\n",
        "patching: engine's token 7, reference argmax 3; 11 forwards in 2.8s; 12 engine elements "
        "rounded to the model's dtype\n",
        "  last hold:  4 layers.0.mlp (argmax stays 3)\n",
        "  first flip: 6 layers.1.input_layernorm (argmax becomes 7)\n",
        "  the decisive departure is after 4 layers.0.mlp, at or before 6 "
        "layers.1.input_layernorm\n",
        "engine:     kiln, next token 7; rows file sha256:",
        "11 of 12 boundaries given; omitted: layers.0\n"})
    CHECK_MESSAGE(text.find(s) != std::string::npos, std::string(s));
}

TEST_CASE("layer show says so when every boundary is bitwise equal and nothing was patched") {
  const Json r = layer_result(
      {{"embedding", 0}, {"layers.0", 0}, {"norm", 0}, {"layers.1", kOmitted}}, {.flip = -2});
  check_valid(r);
  const std::string text = client::layer_report(r);
  INFO(text);
  CHECK(text.find("patched argmax") == std::string::npos);
  CHECK(text.find("<-") == std::string::npos);
  CHECK(text.find("first non-bitwise:    none: every boundary the engine gave is bitwise equal") !=
        std::string::npos);
  CHECK(text.find("first over tolerance: none: no relative RMSE above 0.01") != std::string::npos);
  CHECK(text.find("largest growth:       none: relative RMSE never grows") != std::string::npos);
  CHECK(text.find("patching: not requested") != std::string::npos);
  // Patched without a flip: the bracket is absent and the table says so.
  const std::string no_flip = client::layer_report(layer_result(kTwoLayers, {.flip = -1}));
  CHECK(no_flip.find("first flip: none: no single substitution") != std::string::npos);
  CHECK(no_flip.find("decisive departure") == std::string::npos);
}

TEST_CASE("the layer report escapes every string it takes from the result") {
  std::vector<Spec> spec = kTwoLayers;
  spec[3].name = "layers.0.<script>alert(2)</script>";
  const Json r = layer_result(
      spec, {.engine = "<script>alert(1)</script>", .job_id = "j-\"quoted\"&<b>", .flip = 3});
  check_valid(r);
  TempDir dir;
  const std::string html = client::render_report(r, dir.path(), "not checked in this test", false);
  std::string lower = html;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  CHECK(lower.find("<script") == std::string::npos);
  CHECK(html.find("j-\"quoted\"&<b>") == std::string::npos);
  CHECK(html.find("&lt;script&gt;alert(1)&lt;/script&gt;") != std::string::npos);
  CHECK(html.find("layers.0.&lt;script&gt;alert(2)&lt;/script&gt;") != std::string::npos);
  CHECK(html.find("j-&quot;quoted&quot;&amp;&lt;b&gt;") != std::string::npos);
  // The chart's labels and tooltips escape too.
  CHECK(html.find("first non-bitwise: 3 layers.0.&lt;script&gt;") != std::string::npos);
  CHECK(html.find("decisive (first flip): 3 layers.0.&lt;script&gt;") != std::string::npos);
}

TEST_CASE("the log axis puts zeros on a floor and keeps omitted and undefined boundaries apart") {
  const Json r = layer_result(kTwoLayers, {.flip = 6});
  TempDir dir;
  const std::string html = client::render_report(r, dir.path(), "not checked in this test", false);
  const std::size_t svg_begin = html.find("<svg"), svg_end = html.find("</svg>");
  REQUIRE(svg_begin != std::string::npos);
  const std::string svg = html.substr(svg_begin, svg_end - svg_begin);
  for (const char* bad : {"nan", "inf", "-nan"}) CHECK(svg.find(bad) == std::string::npos);

  const auto zeros = circles(svg, "zero");
  const auto values = circles(svg, "value");
  CHECK(zeros.size() == 3);  // embedding and layers.0's first two boundaries
  CHECK(values.size() == 7);
  // Exact zeros sit on the floor line; the smallest value, 2e-5, is log10(2e-5 / 1e-6) = 1.301
  // decades above it: the floor is one decade below the smallest nonzero value's.
  const double floor_y = attribute_of(svg, "<line class=\"floor\"", "y1");
  for (const auto& [i, p] : zeros) CHECK(p.second == doctest::Approx(floor_y).epsilon(0.001));
  const double decade = values.at(4).second - values.at(6).second;  // 2e-4 to 2e-3
  CHECK(decade > 10);
  CHECK(values.at(3).second - values.at(4).second == doctest::Approx(decade).epsilon(0.005));
  CHECK(values.at(6).second - values.at(8).second == doctest::Approx(decade).epsilon(0.005));
  CHECK(floor_y - values.at(3).second ==
        doctest::Approx(std::log10(2e-5 / 1e-6) * decade).epsilon(0.005));
  // 0.03 lies above 0.025 and 0.02, by their log distances.
  CHECK(values.at(8).second - values.at(10).second ==
        doctest::Approx(std::log10(0.03 / 0.02) * decade).epsilon(0.01));
  CHECK(svg.find(">0</text>") != std::string::npos);  // the floor is labelled 0, not 1e-6
  CHECK(html.find("3 here) is drawn on the dashed floor line at 1e-6") != std::string::npos);
  CHECK(html.find("Boundaries the engine omitted (1 here)") != std::string::npos);
  CHECK(html.find("undefined values (reference RMS 0; 1 here)") != std::string::npos);

  // Omitted and undefined boundaries: their own marks, not points on the line.
  CHECK(zeros.count(5) + values.count(5) + zeros.count(7) + values.count(7) == 0);
  CHECK(svg.find("class=\"pt omitted\" data-index=\"5\"") != std::string::npos);
  CHECK(svg.find("class=\"pt undefined\" data-index=\"7\"") != std::string::npos);
  std::smatch line;
  REQUIRE(std::regex_search(svg, line, std::regex("<path d=\"([^\"]*)\" fill=\"none\"")));
  const std::string d = line[1];
  CHECK(std::count(d.begin(), d.end(), 'M') == 3);  // broken at 5 and at 7: never interpolated

  // The first non-bitwise and the decisive boundary are marked where their points are.
  CHECK(attribute_of(svg, "<line class=\"first-non-bitwise\"", "x1") ==
        doctest::Approx(values.at(3).first));
  CHECK(attribute_of(svg, "<line class=\"decisive\"", "x1") == doctest::Approx(values.at(6).first));
  CHECK(attribute_of(svg, "<rect class=\"bracket\"", "x") == doctest::Approx(values.at(4).first));
  CHECK(svg.find("first non-bitwise: 3 layers.0.post_attention_layernorm") != std::string::npos);
  CHECK(svg.find("decisive (first flip): 6 layers.1.input_layernorm") != std::string::npos);
  CHECK(svg.find("tolerance 0.01") != std::string::npos);
  // A result without a decisive boundary draws no such marker.
  const std::string plain = client::render_report(layer_result(kTwoLayers), dir.path(),
                                                  "not checked in this test", false);
  CHECK(plain.find("class=\"decisive\"") == std::string::npos);
  CHECK(plain.find("class=\"first-non-bitwise\"") != std::string::npos);
}

TEST_CASE("assay report writes the layer page and reads layers.safetensors beside the result") {
  TempDir dir;
  Json r = layer_result(kTwoLayers, {.flip = 6});
  const std::string path = dir.write("result.json", common::canonical(r));
  const std::string out = (dir / "report.html").string();
  auto run1 = run({"report", path, "-o", out});
  REQUIRE(run1.status == 0);
  std::string html = common::read_file(out, 1 << 22);
  CHECK(html.find("<h1>Layer attribution</h1>") != std::string::npos);
  CHECK(html.find("layers.safetensors is not beside the result") != std::string::npos);
  dir.write("layers.safetensors", "the reference rows");
  REQUIRE(run({"report", path, "-o", out}).status == 0);
  html = common::read_file(out, 1 << 22);
  CHECK(html.find("layers.safetensors beside the result is the result&#39;s artifact") !=
        std::string::npos);
  dir.write("layers.safetensors", "other rows");
  REQUIRE(run({"report", path, "-o", out}).status == 0);
  CHECK(common::read_file(out, 1 << 22).find("not the result&#39;s") != std::string::npos);
}

TEST_CASE("assay verify accepts a sealed layer-attribution result with its envelope and rows") {
  TempDir dir;
  common::SigningKey key = common::SigningKey::generate();
  Json r = layer_result(kTwoLayers, {.flip = 6});
  r["supervisor"]["key_id"] = key.key_id();
  const std::string bytes = common::seal_result(r);
  check_valid(r);
  const std::string result = dir.write("result.json", bytes);
  const std::string artifact = dir.write("layers.safetensors", "the reference rows");
  auto sign = [&](std::string_view predicate) {
    Json statement = common::make_statement(predicate, bytes, common::kLayerArtifactFileName,
                                            r["layers_artifact"]["sha256"].get<std::string>());
    Json env = common::dsse_sign(common::kInTotoPayloadType, common::canonical(statement), key);
    return dir.write("result.dsse.json", common::canonical(env) + "\n");
  };
  const std::string envelope = sign(common::kLayerPredicateType);
  const std::string pubkey = dir.write("pubkey.pem", key.public_key_pem());
  client::VerifyInputs in{.result = result,
                          .envelope = envelope,
                          .public_key = key.public_key_pem(),
                          .artifact = artifact};
  auto report = client::verify_result(in);
  for (const auto& c : report.checks) CHECK_MESSAGE(c.ok, c.name << ": " << c.detail);
  CHECK(report.checks.size() == 10);
  CHECK(report.ok());
  auto cli = run({"verify", result, "--pubkey", pubkey, "--artifact", artifact});
  CHECK(cli.status == 0);
  CHECK(cli.out.find("layers_artifact") != std::string::npos);

  // Signed as another kind: the predicate type does not match the result's.
  sign(common::kTrajectoryPredicateType);
  report = client::verify_result(in);
  CHECK(!report.ok());
  for (const auto& c : report.checks) CHECK(c.ok == (c.name != "statement.type"));
  // Other rows beside it: the artifact check fails, naming the file.
  sign(common::kLayerPredicateType);
  dir.write("layers.safetensors", "the reference rowz");
  CHECK(run({"verify", result, "--pubkey", pubkey, "--artifact", artifact}).status == 6);
}

TEST_CASE(
    "assay report checks the record before it draws it: a changed record is refused and nothing "
    "is written; without a key the page says the signature was not checked; with one, verified") {
  TempDir dir;
  common::SigningKey key = common::SigningKey::generate();
  Json r = layer_result(kTwoLayers, {.flip = 6});
  r["supervisor"]["key_id"] = key.key_id();
  const std::string bytes = common::seal_result(r);
  const std::string result = dir.write("result.json", bytes);
  Json statement =
      common::make_statement(common::kLayerPredicateType, bytes, common::kLayerArtifactFileName,
                             r["layers_artifact"]["sha256"].get<std::string>());
  const std::string envelope = common::canonical(common::dsse_sign(
                                   common::kInTotoPayloadType, common::canonical(statement), key)) +
                               "\n";
  dir.write("result.dsse.json", envelope);
  const std::string pubkey = dir.write("pubkey.pem", key.public_key_pem());
  const std::string out = (dir / "report.html").string();
  auto page = [&] { return common::read_file(out, 1 << 22); };

  auto verified = run({"report", result, "-o", out, "--pubkey", pubkey});
  CHECK_MESSAGE(verified.status == 0, verified.err);
  CHECK(page().find("<p class=\"verified\" role=\"status\">Verified: ") != std::string::npos);
  auto unsigned_check = run({"report", result, "-o", out});
  CHECK_MESSAGE(unsigned_check.status == 0, unsigned_check.err);
  CHECK(unsigned_check.out.find("signature NOT checked") != std::string::npos);
  CHECK(page().find("<p class=\"unverified\" role=\"status\">NOT VERIFIED: the self-hash holds, "
                    "but no signature was checked") != std::string::npos);

  // The decisive boundary changed in the file, not resealed: refused, with or without a key.
  Json changed = common::parse_strict(bytes);
  changed["patching"]["first_flip"]["index"] = 5;
  const std::string tampered = dir.write("tampered.json", common::canonical(changed));
  for (bool with_key : {false, true}) {
    CAPTURE(with_key);
    std::filesystem::remove(out);
    std::vector<std::string> args{"report", tampered, "-o", out};
    if (with_key)
      args.insert(args.end(),
                  {"--pubkey", pubkey, "--envelope", (dir / "result.dsse.json").string()});
    auto refused = run(args);
    CHECK(refused.status == 6);
    CHECK(refused.err.find("does not hold; no report written") != std::string::npos);
    CHECK(refused.err.find("result_sha256: claimed") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(out));
  }
  // Resealed after the change: its self-hash holds, so without a key it is drawn as unverified,
  // and with the key the signature (over the original bytes) refuses it.
  changed.erase("result_sha256");
  const std::string resealed = dir.write("resealed.json", common::seal_result(changed));
  dir.write("resealed.dsse.json", envelope);
  CHECK(run({"report", resealed, "-o", out}).status == 0);
  CHECK(page().find("NOT VERIFIED") != std::string::npos);
  std::filesystem::remove(out);
  auto forged = run({"report", resealed, "-o", out, "--pubkey", pubkey});
  CHECK(forged.status == 6);
  CHECK(forged.err.find("subject.result: no subject has the result file's sha256") !=
        std::string::npos);
  CHECK_FALSE(std::filesystem::exists(out));
}
