// What assay-compare compares: an assay.compare-input.v1 document parsed strictly into a
// CompareInput (every refusal input.invalid, naming the field and the value), and the one-context
// input `assay-compare kl` makes of two or three files, its shape read from the reference's
// safetensors header alone.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "compare/compare.h"
#include "compare/logits.h"

namespace assay::compare {
namespace {

using common::Error;
using common::Json;

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

// One entry of "contexts" at `w`; `seen_ids` holds the ids of the entries before it.
ContextSpec parse_context(const Json& c, const std::string& w, std::int64_t vocab_size,
                          std::set<std::string>& seen_ids) {
  check_object(c, {"id", "positions", "reference", "candidate", "reproduction", "token_ids"},
               {"id", "positions", "reference", "candidate"}, w);
  ContextSpec ctx;
  ctx.id = string_field(c, "id", w);
  if (ctx.id.empty() || ctx.id.size() > 256 || !printable_ascii(ctx.id))
    invalid(w + ".id", shown(c.at("id")) + " is not 1..256 printable ASCII characters");
  if (!seen_ids.insert(ctx.id).second) invalid(w + ".id", "\"" + ctx.id + "\" is not unique");
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
          ids[k].get<std::int64_t>() >= vocab_size)
        invalid(w + ".token_ids[" + std::to_string(k) + "]",
                shown(ids[k]) + " is not a token id in [0, " + std::to_string(vocab_size) + ")");
      tokens.push_back(ids[k].get<std::int64_t>());
    }
    if (previous_end > static_cast<std::int64_t>(tokens.size()))
      invalid(w + ".positions", "scores position " + std::to_string(previous_end - 1) +
                                    " but token_ids holds " + std::to_string(tokens.size()) +
                                    " tokens");
    ctx.token_ids = std::move(tokens);
  }
  return ctx;
}

}  // namespace

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
    in.contexts.push_back(parse_context(contexts[i], w, in.vocab_size, ids));
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

}  // namespace assay::compare
