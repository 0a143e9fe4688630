#include "compare/compare.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include <fcntl.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "compare/kernel.h"
#include "compare/statistics.h"

namespace assay::compare {
namespace {

using common::Error;
using common::Json;

constexpr std::int64_t kMaxVocab = std::int64_t{1} << 24;  // bounds the per-row buffer (128 MiB)
constexpr std::string_view kKlSchema = "assay.fidelity-kl.v1";

// ---- input.json ----

[[noreturn]] void invalid(const std::string& where, const std::string& message) {
  throw Error("input.invalid", where + ": " + message);
}

std::string shown(const Json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

void check_object(const Json& v, std::initializer_list<std::string_view> allowed,
                  std::initializer_list<std::string_view> required, const std::string& where) {
  if (!v.is_object()) invalid(where, "must be an object, got " + shown(v));
  for (auto it = v.begin(); it != v.end(); ++it)
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end())
      invalid(where, "unknown field \"" + it.key() + "\"");
  for (std::string_view key : required)
    if (!v.contains(key)) invalid(where, "missing field \"" + std::string(key) + "\"");
}

std::string string_field(const Json& v, const char* key, const std::string& where) {
  const Json& s = v.at(key);
  if (!s.is_string()) invalid(where + "." + key, "must be a string, got " + shown(s));
  return s.get<std::string>();
}

std::int64_t int_field(const Json& v, const char* key, const std::string& where) {
  const Json& i = v.at(key);
  if (!i.is_number_integer()) invalid(where + "." + key, "must be an integer, got " + shown(i));
  return i.get<std::int64_t>();
}

LogitsFileRef parse_file_ref(const Json& v, const std::string& where) {
  LogitsFileRef r;
  if (v.is_object() && v.contains("fd")) {
    check_object(v, {"fd", "sha256", "path"}, {"fd", "sha256"}, where);
    const Json& fd = v.at("fd");
    if (!fd.is_number_integer() || fd.get<std::int64_t>() < 3 || fd.get<std::int64_t>() > 65535)
      invalid(where + ".fd", shown(fd) + " is not a descriptor number >= 3");
    r.fd = static_cast<int>(fd.get<std::int64_t>());
    // The file's name where the user keeps it, for messages only: never opened.
    r.path = v.contains("path") && v.at("path").is_string()
                 ? v.at("path").get<std::string>() + " (fd " + std::to_string(r.fd) + ")"
                 : "fd " + std::to_string(r.fd);
  } else {
    check_object(v, {"path", "sha256"}, {"path", "sha256"}, where);
    r.path = string_field(v, "path", where);
    bool parent =
        r.path == ".." || r.path.rfind("../", 0) == 0 || r.path.find("/../") != std::string::npos;
    if (r.path.empty() || parent || r.path.find('\0') != std::string::npos)
      invalid(where + ".path", "\"" + r.path + "\" is not a path inside the workspace or absolute");
  }
  const Json& sha = v.at("sha256");
  if (!sha.is_null()) {
    if (!sha.is_string() || !common::is_identity(sha.get<std::string>()))
      invalid(where + ".sha256", shown(sha) + " is neither null nor \"sha256:<64 lowercase hex>\"");
    r.sha256 = sha.get<std::string>();
  }
  return r;
}

bool printable_ascii(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

// ---- logits files ----

// Opens and validates a safetensors file; any failure is compare.bad_file naming `what`.
common::SafetensorsFile open_logits_file(const LogitsFileRef& r, const std::string& what) {
  if (r.fd >= 0) {
    try {
      return common::SafetensorsFile::open_fd(r.fd, r.path);
    } catch (const Error& e) {
      throw Error("compare.bad_file", what + ": " + e.what());
    }
  }
  const std::string& path = r.path;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec) && std::filesystem::file_size(path, ec) == 0)
    throw Error("compare.bad_file", what + " is empty");
  try {
    return common::SafetensorsFile::open(path);
  } catch (const Error& e) {
    if (e.code().rfind("fs.", 0) == 0)
      throw Error("compare.bad_file", what + ": cannot open: " + e.what());
    throw Error("compare.bad_file", what + ": " + e.what());
  }
}

// One opened, validated logits file. Not movable: views point into the mapping.
struct Logits {
  Logits(const LogitsFileRef& r, std::string role_, const std::string& context_)
      : ref(r),
        role(std::move(role_)),
        what(role + " logits " + r.path + " (context '" + context_ + "')"),
        file(open_logits_file(r, what)) {
    const common::TensorView* t = file.find("logits");
    if (!t) {
      if (file.tensors().size() != 1) {
        std::string names;
        for (const auto& v : file.tensors())
          names += (names.empty() ? "\"" : ", \"") + v.name + "\"";
        throw Error("compare.missing_tensor", what + " has no tensor \"logits\" and " +
                                                  std::to_string(file.tensors().size()) +
                                                  " tensors (" + (names.empty() ? "none" : names) +
                                                  "), not exactly one");
      }
      t = &file.tensors().front();
    }
    tensor = *t;
    if (tensor.dtype == common::Dtype::kF32)
      element = Element::kF32;
    else if (tensor.dtype == common::Dtype::kBF16)
      element = Element::kBF16;
    else
      throw Error("compare.bad_dtype", what + ": tensor \"" + tensor.name + "\" has dtype " +
                                           std::string(common::dtype_name(tensor.dtype)) +
                                           ", not F32 or BF16");
  }
  Logits(const Logits&) = delete;
  Logits& operator=(const Logits&) = delete;

  std::string shape_text() const {
    std::string s = "[";
    for (std::size_t i = 0; i < tensor.shape.size(); ++i)
      s += (i ? ", " : "") + std::to_string(tensor.shape[i]);
    return s + "]";
  }

  void check_shape(std::int64_t rows, std::int64_t vocab) const {
    const std::string expected =
        "[" + std::to_string(rows) + ", " + std::to_string(vocab) + "] (scored positions, vocab)";
    if (tensor.shape.size() != 2)
      throw Error("compare.bad_shape", what + ": tensor \"" + tensor.name + "\" has shape " +
                                           shape_text() + ", expected " + expected);
    if (tensor.shape[1] != vocab)
      throw Error("compare.vocab_mismatch",
                  what + ": tensor \"" + tensor.name + "\" has " + std::to_string(tensor.shape[1]) +
                      " columns but vocab_size is " + std::to_string(vocab));
    if (tensor.shape[0] != rows)
      throw Error("compare.bad_shape", what + ": tensor \"" + tensor.name + "\" has " +
                                           std::to_string(tensor.shape[0]) +
                                           " rows but the context scores " + std::to_string(rows) +
                                           " positions; expected shape " + expected);
  }

  // One pass over the mapping feeding both hashes: the whole file, and the tensor's raw bytes.
  void hash(bool whole_file, bool raw) {
    constexpr std::size_t kChunk = 4 << 20;
    common::Sha256 file_hash, tensor_hash;
    std::span<const std::byte> image = file.image();
    const std::byte* t0 = tensor.data;
    const std::byte* t1 = tensor.data + tensor.nbytes;
    for (std::size_t off = 0; off < image.size(); off += kChunk) {
      const std::byte* a = image.data() + off;
      const std::byte* b = a + std::min(kChunk, image.size() - off);
      if (whole_file) file_hash.update(a, static_cast<std::size_t>(b - a));
      const std::byte* lo = std::max(a, t0);
      const std::byte* hi = std::min(b, t1);
      if (raw && lo < hi) tensor_hash.update(lo, static_cast<std::size_t>(hi - lo));
    }
    if (whole_file) file_sha256 = common::identity(file_hash.finish());
    if (raw) tensor_sha256 = common::identity(tensor_hash.finish());
  }

  void check_sha256() const {
    if (ref.sha256 && *ref.sha256 != *file_sha256)
      throw Error("compare.sha_mismatch", what + ": the file's sha256 is " + *file_sha256 +
                                              " but the input expects " + *ref.sha256);
  }

  Row row(std::size_t i, std::size_t vocab) const {
    std::size_t esize = element == Element::kF32 ? 4 : 2;
    return {tensor.data + i * vocab * esize, element};
  }

  // The element at (row, column), widened exactly to double.
  double at(std::size_t row, std::size_t vocab, std::int64_t column) const {
    const std::byte* p = tensor.data + (row * vocab + static_cast<std::size_t>(column)) *
                                           (element == Element::kF32 ? 4 : 2);
    float f;
    if (element == Element::kF32) {
      std::memcpy(&f, p, sizeof f);
    } else {
      std::uint16_t h;
      std::memcpy(&h, p, sizeof h);
      std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
      std::memcpy(&f, &w, sizeof f);
    }
    return f;
  }

  std::string value_text(std::size_t row, std::size_t vocab, std::int64_t column) const {
    float f;
    const std::byte* p = tensor.data + (row * vocab + static_cast<std::size_t>(column)) *
                                           (element == Element::kF32 ? 4 : 2);
    if (element == Element::kF32) {
      std::memcpy(&f, p, sizeof f);
    } else {
      std::uint16_t h;
      std::memcpy(&h, p, sizeof h);
      std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
      std::memcpy(&f, &w, sizeof f);
    }
    if (std::isnan(f)) return "NaN";
    return f > 0 ? "+Inf" : "-Inf";
  }

  const LogitsFileRef& ref;
  std::string role;
  std::string what;
  common::SafetensorsFile file;
  common::TensorView tensor;
  Element element = Element::kF32;
  std::optional<std::string> file_sha256, tensor_sha256;
};

struct OpenedContext {
  const ContextSpec* spec;
  std::unique_ptr<Logits> reference, candidate, reproduction;
};

Json nullable(const std::optional<std::string>& s) {
  return s ? Json(*s) : Json(nullptr);
}

std::string dtype_text(Element e) {
  return e == Element::kF32 ? "F32" : "BF16";
}

template <typename T>
std::span<const std::byte> raw(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

double neumaier_sum(std::span<const double> v) {
  double sum = 0, c = 0;
  for (double x : v) {
    double t = sum + x;
    c += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  return sum + c;
}

Json input_dtypes(const std::vector<OpenedContext>& opened) {
  std::set<std::string> dtypes;
  for (const OpenedContext& o : opened)
    for (const Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()})
      if (l) dtypes.insert(dtype_text(l->element));
  return Json(std::vector<std::string>(dtypes.begin(), dtypes.end()));
}

}  // namespace

const std::string& executable_sha256() {
  // The link itself, not its target's path: that is the file this process runs.
  static const std::string id = [] {
    std::ifstream in("/proc/self/exe", std::ios::binary);
    if (!in) throw Error("compare.internal", "cannot open /proc/self/exe to hash the estimator");
    common::Sha256 h;
    std::vector<char> buf(1 << 20);
    while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0)
      h.update(buf.data(), static_cast<std::size_t>(in.gcount()));
    return common::identity(h.finish());
  }();
  return id;
}

std::int64_t ContextSpec::rows() const {
  std::int64_t n = 0;
  for (const Range& r : positions) n += r.end - r.begin;
  return n;
}

CompareInput parse_input(const Json& doc, const std::string& where) {
  check_object(doc, {"schema", "vocab_size", "kl_file", "contexts", "thresholds"},
               {"schema", "vocab_size", "kl_file", "contexts"}, where);
  std::string schema = string_field(doc, "schema", where);
  if (schema != protocol::kCompareInput)
    invalid(where + ".schema",
            "\"" + schema + "\" is not \"" + std::string(protocol::kCompareInput) + "\"");
  CompareInput in;
  in.vocab_size = int_field(doc, "vocab_size", where);
  if (in.vocab_size < 1 || in.vocab_size > kMaxVocab)
    invalid(where + ".vocab_size",
            std::to_string(in.vocab_size) + " is outside 1.." + std::to_string(kMaxVocab));
  in.kl_file = string_field(doc, "kl_file", where);
  const std::string suffix = ".safetensors";
  bool name_ok =
      in.kl_file.size() > suffix.size() && in.kl_file.size() <= 255 && in.kl_file.front() != '.' &&
      in.kl_file.ends_with(suffix) && std::all_of(in.kl_file.begin(), in.kl_file.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      });
  if (!name_ok)
    invalid(where + ".kl_file", "\"" + in.kl_file +
                                    "\" is not a plain file name ([A-Za-z0-9._-], not starting "
                                    "with '.') ending in .safetensors");
  const Json& contexts = doc.at("contexts");
  if (!contexts.is_array() || contexts.empty())
    invalid(where + ".contexts", "must be a non-empty array, got " + shown(contexts));
  std::set<std::string> ids;
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    const std::string w = where + ".contexts[" + std::to_string(i) + "]";
    const Json& c = contexts[i];
    check_object(c, {"id", "positions", "reference", "candidate", "reproduction", "token_ids"},
                 {"id", "positions", "reference", "candidate"}, w);
    ContextSpec ctx;
    ctx.id = string_field(c, "id", w);
    if (ctx.id.empty() || ctx.id.size() > 256 || !printable_ascii(ctx.id))
      invalid(w + ".id", shown(c.at("id")) + " is not 1..256 printable ASCII characters");
    if (!ids.insert(ctx.id).second) invalid(w + ".id", "\"" + ctx.id + "\" is not unique");
    const Json& ranges = c.at("positions");
    if (!ranges.is_array() || ranges.empty())
      invalid(w + ".positions",
              "must be a non-empty array of [begin, end) ranges, got " + shown(ranges));
    std::int64_t previous_end = 0;
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const Json& r = ranges[k];
      const std::string rw = w + ".positions[" + std::to_string(k) + "]";
      if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer())
        invalid(rw, shown(r) + " is not a [begin, end) pair of integers");
      Range range{r[0].get<std::int64_t>(), r[1].get<std::int64_t>()};
      if (range.begin < 0 || range.end <= range.begin)
        invalid(rw, shown(r) + " is not a non-empty range of non-negative positions");
      if (range.begin < previous_end)
        invalid(rw, shown(r) + " starts before the previous range ends (" +
                        std::to_string(previous_end) + "): ranges must be sorted and disjoint");
      previous_end = range.end;
      ctx.positions.push_back(range);
    }
    ctx.reference = parse_file_ref(c.at("reference"), w + ".reference");
    ctx.candidate = parse_file_ref(c.at("candidate"), w + ".candidate");
    if (c.contains("reproduction") && !c.at("reproduction").is_null())
      ctx.reproduction = parse_file_ref(c.at("reproduction"), w + ".reproduction");
    if (c.contains("token_ids") && !c.at("token_ids").is_null()) {
      const Json& ids = c.at("token_ids");
      if (!ids.is_array() || ids.empty())
        invalid(w + ".token_ids", "must be a non-empty array of token ids, got " + shown(ids));
      std::vector<std::int64_t> tokens;
      tokens.reserve(ids.size());
      for (std::size_t k = 0; k < ids.size(); ++k) {
        if (!ids[k].is_number_integer() || ids[k].get<std::int64_t>() < 0 ||
            ids[k].get<std::int64_t>() >= in.vocab_size)
          invalid(
              w + ".token_ids[" + std::to_string(k) + "]",
              shown(ids[k]) + " is not a token id in [0, " + std::to_string(in.vocab_size) + ")");
        tokens.push_back(ids[k].get<std::int64_t>());
      }
      if (previous_end > static_cast<std::int64_t>(tokens.size()))
        invalid(w + ".positions", "scores position " + std::to_string(previous_end - 1) +
                                      " but token_ids holds " + std::to_string(tokens.size()) +
                                      " tokens");
      ctx.token_ids = std::move(tokens);
    }
    in.contexts.push_back(std::move(ctx));
  }
  if (doc.contains("thresholds") && !doc.at("thresholds").is_null())
    in.thresholds =
        common::parse_thresholds(doc.at("thresholds"), where + ".thresholds", "input.invalid");
  bool some = false, all = true;
  for (const auto& c : in.contexts) {
    some |= c.reproduction.has_value();
    all &= c.reproduction.has_value();
  }
  if (some && !all)
    invalid(where + ".contexts",
            "a reproduction is given for some contexts but not all: all or none");
  return in;
}

namespace {

bool usable_shape(const std::vector<std::int64_t>& shape) {
  return shape.size() == 2 && shape[0] >= 1 && shape[1] >= 1 && shape[1] <= kMaxVocab;
}

// The [rows, vocab] shape of the tensor a Logits would take ("logits", else the only one), from
// the file's header alone: mapping the whole file only to read its shape costs as much as the
// comparison maps it again (populating and tearing down every page table entry). compare()
// validates the whole file; nullopt whenever the header is not plainly usable, and the caller
// then opens the file fully, which reports what is wrong with it.
std::optional<std::vector<std::int64_t>> header_shape(const std::string& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) return std::nullopt;
  unsigned char len[8];
  if (::pread(fd.get(), len, sizeof len, 0) != static_cast<ssize_t>(sizeof len))
    return std::nullopt;
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n == 0 || n > (1u << 20)) return std::nullopt;
  std::string header(n, '\0');
  if (::pread(fd.get(), header.data(), n, 8) != static_cast<ssize_t>(n)) return std::nullopt;
  try {
    const Json h = common::parse_strict(header);
    if (!h.is_object()) return std::nullopt;
    const Json* t = nullptr;
    if (h.contains("logits")) {
      t = &h.at("logits");
    } else {
      for (auto it = h.begin(); it != h.end(); ++it) {
        if (it.key() == "__metadata__") continue;
        if (t) return std::nullopt;
        t = &it.value();
      }
    }
    if (!t || !t->is_object() || !t->contains("shape") || !t->at("shape").is_array())
      return std::nullopt;
    std::vector<std::int64_t> shape;
    for (const Json& d : t->at("shape")) {
      if (!d.is_number_integer()) return std::nullopt;
      shape.push_back(d.get<std::int64_t>());
    }
    if (!usable_shape(shape)) return std::nullopt;
    return shape;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

CompareInput input_for_files(const std::string& reference, const std::string& candidate,
                             const std::optional<std::string>& reproduction) {
  auto ref = [](const std::string& p) {
    return LogitsFileRef{std::filesystem::absolute(p).lexically_normal().string(), std::nullopt};
  };
  ContextSpec ctx;
  ctx.id = "c0";
  ctx.reference = ref(reference);
  ctx.candidate = ref(candidate);
  if (reproduction) ctx.reproduction = ref(*reproduction);
  std::optional<std::vector<std::int64_t>> shape = header_shape(ctx.reference.path);
  if (!shape) {
    Logits r(ctx.reference, "reference", ctx.id);
    if (!usable_shape(r.tensor.shape))
      throw Error("compare.bad_shape", r.what + ": tensor \"" + r.tensor.name + "\" has shape " +
                                           r.shape_text() +
                                           ", expected [positions >= 1, vocab in 1..2^24]");
    shape = r.tensor.shape;
  }
  ctx.positions.push_back({0, (*shape)[0]});
  CompareInput in;
  in.vocab_size = (*shape)[1];
  in.kl_file = "kl.safetensors";
  in.contexts.push_back(std::move(ctx));
  return in;
}

double percentile(std::span<const double> x, double pct) {
  const double q = pct / 100.0;
  const std::size_t n = x.size();
  const double h = static_cast<double>(n - 1) * q;
  if (h >= static_cast<double>(n - 1)) return x[n - 1];
  if (h <= 0) return x[0];
  const double lo = std::floor(h);
  const std::size_t i = static_cast<std::size_t>(lo);
  const double t = h - lo;
  const double a = x[i], b = x[i + 1];
  const double diff = b - a;
  return t >= 0.5 ? b - diff * (1.0 - t) : a + diff * t;
}

Stats summarize(std::span<const double> values) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  Stats s;
  s.mean = neumaier_sum(values) / static_cast<double>(values.size());
  s.median = percentile(sorted, 50);
  s.p95 = percentile(sorted, 95);
  s.p99 = percentile(sorted, 99);
  s.p99_9 = percentile(sorted, 99.9);
  s.max = sorted.back();
  s.min = sorted.front();
  return s;
}

Json to_json(const Stats& s) {
  return {{"mean", s.mean},   {"median", s.median}, {"p95", s.p95}, {"p99", s.p99},
          {"p99_9", s.p99_9}, {"max", s.max},       {"min", s.min}};
}

Json histogram(std::span<const double> kl) {
  static constexpr double kEdges[] = {1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7,
                                      1e-6,  1e-5,  1e-4,  1e-3,  1e-2,  1e-1,  1e0,  1e1,  1e2};
  constexpr std::size_t kBins = std::size(kEdges) + 1;
  std::vector<std::int64_t> counts(kBins, 0);
  std::int64_t zero = 0, negative = 0;
  for (double v : kl) {
    if (v == 0.0) {
      ++zero;
    } else if (v < 0) {
      ++negative;
    } else {
      counts[static_cast<std::size_t>(std::upper_bound(std::begin(kEdges), std::end(kEdges), v) -
                                      std::begin(kEdges))]++;
    }
  }
  return {{"zero", zero},
          {"negative", negative},
          {"edges", std::vector<double>(std::begin(kEdges), std::end(kEdges))},
          {"counts", counts}};
}

Comparison compare(const CompareInput& input, const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::size_t vocab = static_cast<std::size_t>(input.vocab_size);

  // Structure of every file first (cheap), so a bad shape in the last context is reported
  // before any hashing or arithmetic.
  std::vector<OpenedContext> opened;
  for (const ContextSpec& spec : input.contexts) {
    OpenedContext o{&spec, nullptr, nullptr, nullptr};
    if (!options.digests && (spec.reference.sha256 || spec.candidate.sha256 || spec.reproduction))
      throw Error("compare.usage",
                  "--no-digests goes with neither sha256 values nor a reproduction");
    o.reference = std::make_unique<Logits>(spec.reference, "reference", spec.id);
    o.candidate = std::make_unique<Logits>(spec.candidate, "candidate", spec.id);
    if (spec.reproduction)
      o.reproduction = std::make_unique<Logits>(*spec.reproduction, "reproduction", spec.id);
    for (Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()})
      if (l) l->check_shape(spec.rows(), input.vocab_size);
    opened.push_back(std::move(o));
  }
  for (OpenedContext& o : opened)
    for (Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()}) {
      if (!l) continue;
      // The whole file's digest only where the input names one to check (a user's candidate
      // file); the tensor's raw-byte digest, which identifies the logits, always.
      l->hash(l->ref.sha256.has_value(), options.digests);
      if (l->ref.sha256) l->check_sha256();
    }

  std::int64_t total = 0;
  for (const ContextSpec& spec : input.contexts) total += spec.rows();
  const bool with_reproduction = !input.contexts.empty() && input.contexts[0].reproduction;
  std::vector<double> kl, repro_kl;
  std::vector<std::int64_t> context_index, position, ref_argmax, cand_argmax, repro_argmax;
  kl.reserve(static_cast<std::size_t>(total));
  context_index.reserve(kl.capacity());
  position.reserve(kl.capacity());
  ref_argmax.reserve(kl.capacity());
  cand_argmax.reserve(kl.capacity());
  std::vector<double> scratch(scratch_size(vocab));
  Series series;

  auto check_finite = [&](const RowResult& r, const Logits& a, const Logits& b, std::size_t row,
                          std::int64_t pos) {
    if (r.non_finite < 0) return;
    const Logits& bad = r.non_finite == 0 ? a : b;
    throw Error("compare.non_finite", bad.what + ": row " + std::to_string(row) + " (position " +
                                          std::to_string(pos) + "), column " +
                                          std::to_string(r.non_finite_column) + " is " +
                                          bad.value_text(row, vocab, r.non_finite_column) +
                                          "; non-finite logits fail the job (never clamped)");
  };

  Json contexts = Json::array();
  std::int64_t agree_total = 0;
  bool digests_equal = true;
  for (std::size_t ci = 0; ci < opened.size(); ++ci) {
    const OpenedContext& o = opened[ci];
    const std::size_t first = kl.size();
    std::int64_t agree = 0, repro_agree = 0;
    std::size_t row = 0;
    for (const Range& range : o.spec->positions) {
      for (std::int64_t pos = range.begin; pos < range.end; ++pos, ++row) {
        // The next row pair is read ahead while this one's arithmetic runs (a hint).
        const bool more = pos + 1 < range.end || &range != &o.spec->positions.back();
        RowResult r = kl_row(o.reference->row(row, vocab), o.candidate->row(row, vocab), vocab,
                             scratch.data(), more ? o.reference->row(row + 1, vocab).data : nullptr,
                             more ? o.candidate->row(row + 1, vocab).data : nullptr);
        check_finite(r, *o.reference, *o.candidate, row, pos);
        kl.push_back(r.kl);
        series.same_top.push_back(r.reference_argmax == r.candidate_argmax);
        {
          // Log-probabilities exactly as the kernel's log-softmax; p = exp(log p) by the
          // kernel's exp, so equal rows give exactly equal probabilities.
          auto logp_r = [&](std::int64_t t) {
            return (o.reference->at(row, vocab, t) - r.reference_max) - r.reference_log_sum;
          };
          auto logp_c = [&](std::int64_t t) {
            return (o.candidate->at(row, vocab, t) - r.candidate_max) - r.candidate_log_sum;
          };
          double lp[4] = {logp_r(r.reference_argmax), logp_c(r.reference_argmax), 0, 0};
          const auto& ids = o.spec->token_ids;
          const bool next = ids && pos + 1 < static_cast<std::int64_t>(ids->size());
          if (next) {
            const std::int64_t t = (*ids)[static_cast<std::size_t>(pos + 1)];
            lp[2] = logp_r(t);
            lp[3] = logp_c(t);
          }
          double pr[4];
          exp_nonpositive(lp, pr, 4);
          series.delta_p_top.push_back(pr[1] - pr[0]);
          if (next) {
            series.delta_p_next.push_back(pr[3] - pr[2]);
            series.nll_reference.push_back(-lp[2]);
            series.nll_candidate.push_back(-lp[3]);
          }
        }
        context_index.push_back(static_cast<std::int64_t>(ci));
        position.push_back(pos);
        ref_argmax.push_back(r.reference_argmax);
        cand_argmax.push_back(r.candidate_argmax);
        agree += r.reference_argmax == r.candidate_argmax;
        if (o.reproduction) {
          RowResult p = kl_row(o.reference->row(row, vocab), o.reproduction->row(row, vocab), vocab,
                               scratch.data(), nullptr,
                               more ? o.reproduction->row(row + 1, vocab).data : nullptr);
          check_finite(p, *o.reference, *o.reproduction, row, pos);
          repro_kl.push_back(p.kl);
          repro_argmax.push_back(p.candidate_argmax);
          repro_agree += p.reference_argmax == p.candidate_argmax;
        }
      }
    }
    agree_total += agree;
    const auto n = static_cast<std::int64_t>(row);
    const std::span<const double> ctx_kl(kl.data() + first, row);
    Json reproduction = nullptr;
    if (o.reproduction) {
      const std::span<const double> ctx_repro(repro_kl.data() + first, row);
      Stats s = summarize(ctx_repro);
      bool equal = *o.reproduction->tensor_sha256 == *o.reference->tensor_sha256;
      if (equal && (s.max != 0.0 || s.min != 0.0 || repro_agree != n))
        throw Error("compare.internal", "context '" + o.spec->id +
                                            "': the reproduction's logits digest equals the "
                                            "reference's (" +
                                            *o.reference->tensor_sha256 + ") but KL ranges over [" +
                                            num(s.min) + ", " + num(s.max) + "] with " +
                                            std::to_string(repro_agree) + "/" + std::to_string(n) +
                                            " argmaxes equal");
      digests_equal &= equal;
      reproduction = {{"sha256", *o.reproduction->tensor_sha256},
                      {"file_sha256", nullable(o.reproduction->file_sha256)},
                      {"dtype", dtype_text(o.reproduction->element)},
                      {"digest_equal", equal},
                      {"kl_max", s.max},
                      {"kl_mean", s.mean},
                      {"top1_agreement", static_cast<double>(repro_agree) / n},
                      {"top1_agree_count", repro_agree}};
    }
    contexts.push_back({{"id", o.spec->id},
                        {"positions", n},
                        {"reference_sha256", nullable(o.reference->tensor_sha256)},
                        {"reference_file_sha256", nullable(o.reference->file_sha256)},
                        {"reference_dtype", dtype_text(o.reference->element)},
                        {"candidate_sha256", nullable(o.candidate->tensor_sha256)},
                        {"candidate_file_sha256", nullable(o.candidate->file_sha256)},
                        {"candidate_dtype", dtype_text(o.candidate->element)},
                        {"kl", to_json(summarize(ctx_kl))},
                        {"top1_agreement", static_cast<double>(agree) / n},
                        {"top1_agree_count", agree},
                        {"reproduction", reproduction}});
  }

  series.kl = kl;
  const Json statistics = statistics_json(series);
  const Stats all = summarize(kl);
  const std::size_t at =
      static_cast<std::size_t>(std::find(kl.begin(), kl.end(), all.max) - kl.begin());
  Json reproduction = nullptr;
  Json reproduction_gates = nullptr;
  if (with_reproduction) {
    Stats s = summarize(repro_kl);
    std::int64_t agree = 0;
    for (std::size_t i = 0; i < repro_argmax.size(); ++i) agree += repro_argmax[i] == ref_argmax[i];
    double top1 = static_cast<double>(agree) / static_cast<double>(total);
    reproduction = {{"kl", to_json(s)},
                    {"top1_agreement", top1},
                    {"top1_agree_count", agree},
                    {"digests_equal", digests_equal},
                    {"confirmed", digests_equal && s.max == 0.0 && s.min == 0.0 && top1 == 1.0}};
    // What this comparison can decide; the supervisor decides the other two from the capture
    // runs and the fingerprints (common::finalize_gates then recomputes the status).
    reproduction_gates = {{"asserted_exact_zero", s.max == 0.0 && s.min == 0.0 && top1 == 1.0},
                          {"head_digest_equal", digests_equal},
                          {"capture_content_digest_equal", nullptr},
                          {"weights_identity_equal", nullptr}};
  }
  Json gates = common::finalize_gates(
      {{"reproduction", reproduction_gates},
       {"thresholds", common::evaluate_thresholds(input.thresholds, statistics)}});

  Json positions_per_context = Json::array();
  bool all_positions = true, ids_known = true;
  std::int64_t next_known = 0;
  for (const ContextSpec& spec : input.contexts) {
    positions_per_context.push_back(spec.rows());
    if (!spec.token_ids) {
      ids_known = false;
      continue;
    }
    const auto len = static_cast<std::int64_t>(spec.token_ids->size());
    all_positions &=
        spec.positions.size() == 1 && spec.positions[0].begin == 0 && spec.positions[0].end == len;
    for (const Range& range : spec.positions)
      next_known += std::max<std::int64_t>(0, std::min(range.end, len - 1) - range.begin);
  }
  Json scope{{"contexts", input.contexts.size()},
             {"positions_per_context", positions_per_context},
             {"scored_positions", total},
             {"next_token_positions", ids_known ? Json(next_known) : Json(nullptr)},
             {"position_filter", ids_known && all_positions ? "all" : "request_ranges"},
             {"covers_full_panel", true}};

  std::vector<common::TensorToWrite> tensors = {
      {"kl", common::Dtype::kF64, {total}, raw(kl)},
      {"context_index", common::Dtype::kI64, {total}, raw(context_index)},
      {"position", common::Dtype::kI64, {total}, raw(position)},
      {"reference_argmax", common::Dtype::kI64, {total}, raw(ref_argmax)},
      {"candidate_argmax", common::Dtype::kI64, {total}, raw(cand_argmax)}};
  if (with_reproduction) {
    tensors.push_back({"reproduction_kl", common::Dtype::kF64, {total}, raw(repro_kl)});
    tensors.push_back({"reproduction_argmax", common::Dtype::kI64, {total}, raw(repro_argmax)});
  }
  Json ids = Json::array();
  for (const ContextSpec& spec : input.contexts) ids.push_back(spec.id);
  Comparison out;
  out.kl_artifact = common::serialize_safetensors(
      tensors, {{"schema", std::string(kKlSchema)}, {"contexts", common::canonical(ids)}});

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.document = {
      {"schema", protocol::kCompareOutput},
      {"vocab_size", input.vocab_size},
      {"positions", total},
      {"metrics",
       {{"kl", to_json(all)},
        {"max_at",
         {{"context", input.contexts[static_cast<std::size_t>(context_index[at])].id},
          {"position", position[at]}}},
        {"top1_agreement", static_cast<double>(agree_total) / static_cast<double>(total)},
        {"top1_agree_count", agree_total}}},
      {"contexts", contexts},
      {"reproduction", reproduction},
      {"histogram", histogram(kl)},
      {"kl_file", input.kl_file},
      {"kl_file_sha256", common::sha256_id(out.kl_artifact)},
      {"kernel", active_clone()},
      {"comparison_kind", with_reproduction ? "reproduction_confirmation" : "candidate_comparison"},
      {"metric",
       {{"name", "mean_tokenwise_kld"},
        {"direction", "reference_to_candidate"},
        {"units", "nats"},
        {"higher_is_better", false},
        {"value", all.mean}}},
      {"scope", scope},
      {"comparator",
       {{"estimator", "assay-compare"},
        {"estimator_sha256", executable_sha256()},
        {"accumulation_dtype", "float64"},
        {"logprob_dtype", "float64"},
        {"input_dtypes", input_dtypes(opened)},
        {"kernel", active_clone()},
        {"fp_contract", "off"},
        {"exp_log", "own"},
        {"deterministic_algorithms", true},
        {"tf32", false},
        {"device", "cpu"},
        {"blas", "none"}}},
      {"statistics", statistics},
      {"gates", gates},
      {"seconds", seconds}};
  return out;
}

void write_outputs(const Comparison& c, const std::filesystem::path& workdir,
                   const std::string& kl_file) {
  const std::filesystem::path kl_path = workdir / kl_file;
  common::atomic_write_file(kl_path, c.kl_artifact);
  try {
    common::atomic_write_file(workdir / protocol::kOutputFile, c.document.dump(2) + "\n");
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(kl_path, ec);
    throw;
  }
}

}  // namespace assay::compare
