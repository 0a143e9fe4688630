// assay-compare: KL(reference || candidate) over logits files, as a worker and as a command.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/fidelity.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/worker_document.h"
#include "compare/compare.h"
#include "compare/layers.h"
#include "compare/trajectory.h"

namespace {

using assay::common::Error;
using assay::common::Json;
namespace cmp = assay::compare;

cmp::CompareInput read_input(const std::filesystem::path& path) {
  const std::string where = path.string();
  Json doc;
  try {
    doc = assay::common::parse_strict(assay::common::read_file(path, 64 << 20));
  } catch (const Error& e) {
    throw Error("input.invalid", where + ": " + e.what());
  }
  return cmp::parse_input(doc, where);
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// The human summary of `assay-compare kl` without --json.
void print_summary(const Json& d) {
  const Json& m = d["metrics"];
  const Json& kl = m["kl"];
  const double seconds = d["seconds"].get<double>();
  const auto n = d["positions"].get<std::int64_t>();
  std::cout << "positions " << n << ", vocab " << d["vocab_size"].get<std::int64_t>() << ", kernel "
            << d["kernel"].get<std::string>() << ", " << fmt(seconds) << " s ("
            << fmt(seconds > 0 ? static_cast<double>(n) / seconds : 0.0) << " positions/s)\n";
  std::cout << "KL(reference || candidate), nats:\n";
  for (const char* k : {"mean", "median", "p95", "p99", "p99_9", "max", "min"})
    std::cout << "  " << k << std::string(8 - std::string(k).size(), ' ')
              << fmt(kl[k].get<double>()) << "\n";
  std::cout << "  max at context " << m["max_at"]["context"].get<std::string>() << ", position "
            << m["max_at"]["position"].get<std::int64_t>() << "\n";
  std::cout << "top-1 agreement " << fmt(m["top1_agreement"].get<double>()) << " ("
            << m["top1_agree_count"].get<std::int64_t>() << "/" << n << ")\n";
  const Json& h = d["histogram"];
  std::cout << "histogram: zero " << h["zero"].get<std::int64_t>() << ", negative "
            << h["negative"].get<std::int64_t>() << "\n";
  const Json& edges = h["edges"];
  const Json& counts = h["counts"];
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (counts[i].get<std::int64_t>() == 0) continue;
    std::string lo = i == 0 ? "0" : fmt(edges[i - 1].get<double>());
    std::string hi = i < edges.size() ? fmt(edges[i].get<double>()) : "inf";
    std::cout << "  [" << lo << ", " << hi << ") " << counts[i].get<std::int64_t>() << "\n";
  }
  std::cout << "\n" << assay::common::llama_cpp_block(d["statistics"]);
  if (d["gates"]["status"] != "none") std::cout << "\n" << assay::common::gates_text(d["gates"]);
  if (!d["reproduction"].is_null())
    std::cout << "reproduction confirmed: "
              << (d["reproduction"]["confirmed"].get<bool>() ? "yes" : "no") << "\n";
}

// Bad input (the job's fault) exits 2; anything else, including a failed write, exits 3.
int exit_code(const std::string& code) {
  if (code == "compare.internal") return 3;
  return code.starts_with("compare.") || code.starts_with("input.") || code.starts_with("request.")
             ? 2
             : 3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "assay-compare: KL(reference || candidate) per scored position, in fp64 over the full "
      "vocabulary, from logits safetensors files (F32 or BF16 [positions, vocab]).\n"
      "Worker:   assay-compare run --input input.json --workdir DIR  (writes DIR/output.json and "
      "DIR/<kl_file>)\n"
      "Worker:   assay-compare trajectory --input input.json --workdir DIR\n"
      "Worker:   assay-compare layers --input input.json --workdir DIR\n"
      "Command:  assay-compare kl --reference REF --candidate CAND [--json]"};
  app.require_subcommand(1, 1);

  auto* run = app.add_subcommand("run", "worker protocol: read input.json, write output.json");
  std::string input, workdir;
  run->add_option("--input", input, "input.json (assay.compare-input.v1)")->required();
  run->add_option("--workdir", workdir, "workspace where output.json and the kl file go")
      ->required();

  auto* trajectory = app.add_subcommand(
      "trajectory",
      "worker protocol (trajectory jobs): reference argmax, margin and top-10 per continuation "
      "token, each engine's first departure and the engines' first divergence");
  std::string tinput, tworkdir;
  trajectory->add_option("--input", tinput, "input.json (assay.compare-trajectory-input.v1)")
      ->required();
  trajectory->add_option("--workdir", tworkdir, "workspace where output.json and the artifact go")
      ->required();

  auto* layers = app.add_subcommand(
      "layers",
      "worker protocol (layer-attribution jobs): an engine's hidden-state rows against the "
      "reference's per boundary, with Kiln's metrics in fp64 and the first departures");
  std::string linput, lworkdir;
  layers->add_option("--input", linput, "input.json (assay.compare-layers-input.v1)")->required();
  layers->add_option("--workdir", lworkdir, "workspace where output.json goes")->required();

  auto* kl = app.add_subcommand(
      "kl", "compare two logits files directly (one context, every row) and print the result");
  std::string reference, candidate, reproduction, kl_file;
  bool json = false, no_digests = false;
  kl->add_option("--reference", reference, "reference logits (.safetensors)")->required();
  kl->add_option("--candidate", candidate, "candidate logits (.safetensors)")->required();
  kl->add_option("--reproduction", reproduction, "a second capture of the reference");
  kl->add_option("--kl-file", kl_file, "also write the token-wise KL artifact here");
  kl->add_flag("--json", json, "print the assay.compare-output.v1 document");
  kl->add_flag("--no-digests", no_digests,
               "skip the sha256 of the files (digest fields null); for benchmarks");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (*run) {
      cmp::CompareInput in = read_input(input);
      cmp::Comparison c = cmp::compare(in);
      cmp::write_outputs(c, workdir, in.kl_file);
      return 0;
    }
    if (*trajectory) {
      Json doc;
      try {
        doc = assay::common::parse_strict(assay::common::read_file(tinput, 64 << 20));
      } catch (const Error& e) {
        throw Error("input.invalid", tinput + ": " + e.what());
      }
      cmp::TrajectoryInput in = cmp::parse_trajectory_input(doc, tinput);
      cmp::write_trajectory_outputs(cmp::analyse_trajectory(in), tworkdir, in.artifact_file);
      return 0;
    }
    if (*layers) {
      Json doc;
      try {
        doc = assay::common::parse_strict(assay::common::read_file(linput, 64 << 20));
      } catch (const Error& e) {
        throw Error("input.invalid", linput + ": " + e.what());
      }
      cmp::LayersInput in = cmp::parse_layers_input(doc, linput);
      // The reference is a file of the workspace, named relative to it.
      in.reference = (std::filesystem::path(lworkdir) / in.reference).string();
      Json out = cmp::compare_layers(in);
      assay::common::write_worker_document(std::filesystem::path(lworkdir) / "output.json",
                                           out.dump(2) + "\n");
      return 0;
    }
    std::optional<std::string> repro;
    if (!reproduction.empty()) repro = reproduction;
    cmp::CompareInput in = cmp::input_for_files(reference, candidate, repro);
    cmp::Options options;
    options.digests = !no_digests;
    cmp::Comparison c = cmp::compare(in, options);
    if (kl_file.empty()) {
      c.document["kl_file"] = nullptr;
    } else {
      assay::common::atomic_write_file(kl_file, c.kl_artifact);
      c.document["kl_file"] = kl_file;
    }
    if (json)
      std::cout << c.document.dump(2) << "\n";
    else
      print_summary(c.document);
    return 0;
  } catch (const Error& e) {
    std::cerr << "assay-compare: error [" << e.code() << "]: " << e.what() << "\n";
    return exit_code(e.code());
  } catch (const std::exception& e) {
    std::cerr << "assay-compare: error [compare.internal]: " << e.what() << "\n";
    return 3;
  }
}
