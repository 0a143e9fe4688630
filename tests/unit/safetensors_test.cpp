#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/safetensors.h"
#include "test_util.h"

using namespace assay::common;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// A file image with a hand-written header and `data_size` bytes of data.
std::string image(const std::string& header, std::size_t data_size) {
  std::string out(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data_size, '\x2a');
  return out;
}

std::string error_of(const std::string& img) {
  try {
    parse_safetensors(bytes_of(img));
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors round-trips tensors, shapes, dtypes and metadata through a file") {
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  std::vector<std::int64_t> ids = {1, 2, 3};
  std::vector<TensorToWrite> t = {
      {"logits", Dtype::kF32, {2, 3}, std::as_bytes(std::span(a))},
      {"input_ids", Dtype::kI64, {1, 3}, std::as_bytes(std::span(ids))},
  };
  assay::test::TempDir dir;
  write_safetensors(dir / "x.safetensors", t, {{"arch", "llama"}});
  std::string raw = assay::test::read_bytes(dir / "x.safetensors");
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  CHECK(header_len % 8 == 0);  // header padded to 8 bytes
  CHECK(raw.size() == 8 + header_len + 6 * 4 + 3 * 8);

  SafetensorsFile f = SafetensorsFile::open(dir / "x.safetensors");
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.metadata().at("arch") == "llama");
  const TensorView* l = f.find("logits");
  REQUIRE(l);
  CHECK(l->dtype == Dtype::kF32);
  CHECK(l->shape == std::vector<std::int64_t>{2, 3});
  CHECK(l->numel() == 6);
  CHECK(std::memcmp(l->data, a.data(), 24) == 0);
  const TensorView* i = f.find("input_ids");
  REQUIRE(i);
  CHECK(std::memcmp(i->data, ids.data(), 24) == 0);
  CHECK(f.find("nope") == nullptr);
}

TEST_CASE("safetensors refuses a file shorter than its length prefix") {
  CHECK(error_of("abc").find("has no header length") != std::string::npos);
}

TEST_CASE("safetensors refuses a header length past the end of the file") {
  std::string img = image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
  img[0] = '\x7f';
  img[1] = '\x01';
  CHECK(error_of(img).find("runs past the end of the file") != std::string::npos);
}

TEST_CASE("safetensors refuses an oversized header length before reading it") {
  std::string img(8, '\xff');
  CHECK(error_of(img).find("exceeds the limit") != std::string::npos);
}

TEST_CASE("safetensors refuses a truncated data section") {
  std::string img = image(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16);
  img.resize(img.size() - 1);
  std::string err = error_of(img);
  CHECK(err.find("safetensors.invalid") == 0);
  CHECK(err.find("\"w\" ends at 16") != std::string::npos);
}

TEST_CASE("safetensors refuses a shape whose size disagrees with the offsets") {
  std::string err =
      error_of(image(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})", 10));
  CHECK(err.find("shape x dtype size 12 but data_offsets span 10") != std::string::npos);
}

TEST_CASE("safetensors refuses overlapping tensors and names both") {
  std::string err = error_of(image(
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
      6));
  CHECK(err.find("\"a\" and \"b\" overlap") != std::string::npos);
}

TEST_CASE("safetensors refuses a non-JSON header, duplicate keys and unknown dtypes") {
  CHECK(error_of(image("not json at all", 0)).find("header") != std::string::npos);
  CHECK(error_of(image("[1,2]", 0)).find("not a JSON object") != std::string::npos);
  CHECK(
      error_of(
          image(
              R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
              1))
          .find("duplicate key") != std::string::npos);
  CHECK(error_of(image(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16))
            .find("F128") != std::string::npos);
  CHECK(error_of(image(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1))
            .find("non-negative") != std::string::npos);
  CHECK(error_of(image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", 1))
            .find("begin > end") != std::string::npos);
  CHECK(error_of(image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1))
            .find("unknown field") != std::string::npos);
}

TEST_CASE("safetensors refuses non-string metadata values") {
  CHECK(error_of(image(R"({"__metadata__":{"k":1}})", 0)).find("is not a string") !=
        std::string::npos);
  CHECK(error_of(image(R"({"__metadata__":{"k":"v"}})", 0)).empty());
}

TEST_CASE("safetensors refuses a shape whose element count overflows") {
  std::string err = error_of(
      image(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8));
  CHECK(err.find("overflows") != std::string::npos);
}

TEST_CASE("opening a hostile file names the path; an empty file is refused") {
  assay::test::TempDir dir;
  assay::test::write_bytes(dir / "empty.safetensors", "");
  try {
    SafetensorsFile::open(dir / "empty.safetensors");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("empty.safetensors") != std::string::npos);
  }
  CHECK_THROWS_AS(SafetensorsFile::open(dir / "missing.safetensors"), Error);
}

TEST_CASE("the writer refuses data whose size disagrees with the shape") {
  std::vector<float> a = {1.0f, 2.0f};
  std::vector<TensorToWrite> t = {{"x", Dtype::kF32, {3}, std::as_bytes(std::span(a))}};
  CHECK_THROWS_AS(serialize_safetensors(t), Error);
}

TEST_CASE("the stream writer writes in pieces what serialize_safetensors writes at once") {
  assay::test::TempDir dir;
  std::vector<std::int64_t> pos = {3, 4, 9};
  std::vector<float> rows(3 * 5);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = 0.25f * static_cast<float>(i) - 1.0f;
  std::map<std::string, std::string> meta = {{"k", "v"}};
  std::string whole = serialize_safetensors({{"positions", Dtype::kI64, {3}, std::as_bytes(std::span(pos))},
                                             {"logits", Dtype::kF32, {3, 5}, std::as_bytes(std::span(rows))}},
                                            meta);
  {
    SafetensorsStreamWriter w(dir / "s.safetensors",
                              {{"positions", Dtype::kI64, {3}}, {"logits", Dtype::kF32, {3, 5}}},
                              meta);
    w.write(std::as_bytes(std::span(pos)));
    for (std::size_t r = 0; r < 3; ++r) w.write(std::as_bytes(std::span(rows).subspan(r * 5, 5)));
    CHECK_FALSE(std::filesystem::exists(dir / "s.safetensors"));
    w.finish();
  }
  CHECK(assay::test::read_bytes(dir / "s.safetensors") == whole);
  auto f = SafetensorsFile::open(dir / "s.safetensors");
  REQUIRE(f.find("logits") != nullptr);
  CHECK(f.find("logits")->shape == std::vector<std::int64_t>{3, 5});
}

TEST_CASE("the stream writer leaves nothing behind when it is short, long or abandoned") {
  assay::test::TempDir dir;
  std::vector<float> row(4, 1.0f);
  auto count = [&] {
    return std::distance(std::filesystem::directory_iterator(dir.path()),
                         std::filesystem::directory_iterator());
  };
  {
    SafetensorsStreamWriter w(dir / "a.safetensors", {{"x", Dtype::kF32, {2, 4}}});
    w.write(std::as_bytes(std::span(row)));
    CHECK_THROWS_AS(w.finish(), Error);  // 16 of 32 bytes
  }
  {
    SafetensorsStreamWriter w(dir / "b.safetensors", {{"x", Dtype::kF32, {1, 2}}});
    CHECK_THROWS_AS(w.write(std::as_bytes(std::span(row))), Error);  // 16 > 8 bytes
  }
  {
    SafetensorsStreamWriter w(dir / "c.safetensors", {{"x", Dtype::kF32, {1, 4}}});
    w.write(std::as_bytes(std::span(row)));
  }  // never finished
  CHECK(count() == 0);
}
