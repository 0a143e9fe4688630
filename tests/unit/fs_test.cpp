#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/fs.h"
#include "test_util.h"

using namespace assay::common;

TEST_CASE("atomic write creates and replaces a file with the given mode") {
  assay::test::TempDir dir;
  atomic_write_file(dir / "f.json", "first", 0600);
  CHECK(assay::test::read_bytes(dir / "f.json") == "first");
  struct stat st {};
  REQUIRE(stat((dir / "f.json").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  atomic_write_file(dir / "f.json", "second");
  CHECK(assay::test::read_bytes(dir / "f.json") == "second");
  // No temp files are left beside it.
  int entries = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) entries += !e.path().empty();
  CHECK(entries == 1);
}

TEST_CASE("a failed atomic write leaves the target untouched and no temp file behind") {
  assay::test::TempDir dir;
  std::filesystem::create_directory(dir / "target");
  assay::test::write_bytes(dir / "target" / "inner", "keep");
  try {
    atomic_write_file(dir / "target", "data");
    FAIL("rename over a non-empty directory must fail");
  } catch (const Error& e) {
    CHECK(e.code() == "fs.rename");
    CHECK(std::string(e.what()).find((dir / "target").string()) != std::string::npos);
  }
  CHECK(assay::test::read_bytes(dir / "target" / "inner") == "keep");
  int entries = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) entries += !e.path().empty();
  CHECK(entries == 1);
  CHECK_THROWS_AS(atomic_write_file(dir / "missing-dir" / "f", "x"), Error);
}

TEST_CASE("open_nofollow refuses a symlink and names the path") {
  assay::test::TempDir dir;
  assay::test::write_bytes(dir / "real", "x");
  std::filesystem::create_symlink(dir / "real", dir / "link");
  CHECK(open_nofollow(dir / "real", O_RDONLY));
  try {
    open_nofollow(dir / "link", O_RDONLY);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == "fs.open");
    // Not O_NOFOLLOW's "Too many levels of symbolic links" (issue 36).
    CHECK(std::string(e.what()) ==
          (dir / "link").string() + " is a symlink; links are not followed");
  }
}

TEST_CASE("read_file enforces its size limit and refuses non-regular files") {
  assay::test::TempDir dir;
  assay::test::write_bytes(dir / "f", "0123456789");
  CHECK(read_file(dir / "f", 10) == "0123456789");
  try {
    read_file(dir / "f", 9);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == "fs.too_large");
    CHECK(std::string(e.what()).find("10 bytes") != std::string::npos);
  }
  CHECK_THROWS_AS(read_file(dir.path(), 100), Error);
}
