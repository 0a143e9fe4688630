// The workers' output.json documents as assayd reads them: a job of each kind is run through its
// real pipeline (supervisor/pipelines/) the way the engine runs it (jobs/engine.cpp): plan(), then
// per step input() and move_in(), the output parsed and checked against its schema as step_ended
// does and handed to accept(); after the last step assemble() and seal(). Only the workers are
// missing: their outputs are the input. A worker runs contained, but it computes over files from
// outside (a checkpoint, an engine's rows), so its output is not trusted either.
//
// The input is the kind's name on the first line, then each step's output.json in plan order,
// cut by the part separator (tests/fuzz/worker_output/ has the requests, the model's config.json
// and, for layer attribution, checks.json; make_corpus.py writes them and the seeds). The engine
// fails a job on common::Error and, with "supervisor.internal", on any other std::exception;
// both end the job here too, the second counted and printed at exit: it means a check let
// through a document that a later step could not read.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/sign.h"
#include "common/time.h"
#include "supervisor/config.h"
#include "supervisor/jobs/store.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"
#include "tests/fuzz/fuzz.h"

namespace {

using namespace assay;
using common::Json;
namespace fs = std::filesystem;

// As jobs/engine.cpp reads output.json.
constexpr std::size_t kMaxWorkerOutputBytes = 64 * 1024 * 1024;
// The bytes of every artifact a worker leaves for assemble() to take; the seeds report this
// digest.
constexpr std::string_view kArtifactBytes = "artifact";

struct Kind {
  std::string name;
  std::string request;  // file under tests/fuzz/worker_output/
  std::unique_ptr<supervisor::Pipeline> (*open)(const supervisor::Config&, const fs::path&,
                                                const std::string&);
  // Where the kind's assemble() takes its artifact from, below the job directory ("" for
  // next-token: the oracle names its file).
  std::string artifact;
  bool checks = false;  // the job has checks.json (layer attribution)
};

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> all{
      {"next-token", "next-token.request.json", &supervisor::open_next_token, ""},
      {"next-token-both", "next-token-both.request.json", &supervisor::open_next_token, ""},
      {"kiln-next-token", "kiln-next-token.request.json", &supervisor::open_next_token, ""},
      {"next-token-numerics", "next-token-numerics.request.json", &supervisor::open_next_token, ""},
      {"fidelity", "fidelity.request.json", &supervisor::open_fidelity, "compare/kl.safetensors"},
      {"trajectory", "trajectory.request.json", &supervisor::open_trajectory,
       "compare/trajectory.safetensors"},
      {"layer-attribution", "layer-attribution.request.json", &supervisor::open_layers,
       "compare/reference.safetensors", true},
  };
  return all;
}

// The model directories the requests name (MODEL_DIR, CANDIDATE_DIR), each with the
// config.json of the seeds' model; the workers, one file that is executable (the prompt check
// runs only when assay-hf-worker is); a job directory per kind.
struct Setup {
  supervisor::Config config;
  fs::path model, candidate;
  common::SigningKey key = common::SigningKey::generate();
  std::map<std::string, fs::path> jobs;

  Setup() {
    const fs::path root = fuzz::scratch_dir();
    const std::string config_json = fuzz::source_file("tests/fuzz/worker_output/config.json");
    model = root / "model";
    candidate = root / "candidate";
    for (const fs::path& dir : {model, candidate}) {
      fs::create_directories(dir);
      common::write_unsynced(dir / "config.json", config_json, 0644);
    }
    fs::create_directories(root / "bin");
    common::write_unsynced(root / "bin/worker", "#!/bin/sh\nexit 1\n", 0755);
    config.state_dir = root / "state";
    config.fingerprint_cache = false;  // nothing written outside the job directory
    config.fingerprint_worker = config.oracle_worker = config.hf_worker = config.compare_worker =
        root / "bin/worker";
    for (const Kind& k : kinds()) {
      fs::path job = root / "jobs" / ("j-" + common::sha256_id(k.name).substr(7, 24));
      fs::create_directories(job);
      std::string request = fuzz::source_file("tests/fuzz/worker_output/" + k.request);
      for (auto [name, dir] :
           {std::pair{"MODEL_DIR", model}, std::pair{"CANDIDATE_DIR", candidate}})
        for (auto at = request.find(name); at != std::string::npos; at = request.find(name))
          request.replace(at, std::string(name).size(), dir.string());
      common::write_unsynced(job / "request.json", request, 0600);
      if (k.checks)
        common::write_unsynced(
            job / "checks.json",
            fuzz::source_file("tests/fuzz/worker_output/" + k.name + ".checks.json"), 0600);
      jobs[k.name] = job;
    }
  }
};

Setup& setup() {
  static Setup s;
  return s;
}

// The job directory as a fresh attempt finds it: the request (and checks.json), nothing else.
void reset(const fs::path& job) {
  for (const auto& entry : fs::directory_iterator(job))
    if (entry.path().filename() != "request.json" && entry.path().filename() != "checks.json")
      fs::remove_all(entry.path());
}

void leave_artifact(const fs::path& path) {
  fs::create_directories(path.parent_path());
  common::write_unsynced(path, kArtifactBytes, 0600);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Setup& s = setup();
  auto in = fuzz::parts(fuzz::as_text(data, size), 16);
  if (in.size() < 2) return 0;
  const Kind* kind = nullptr;
  for (const Kind& k : kinds())
    if (in[0] == k.name) kind = &k;
  if (!kind) return 0;
  const fs::path job = s.jobs.at(kind->name);
  reset(job);

  std::unique_ptr<supervisor::Pipeline> pipeline;
  std::vector<supervisor::Step> steps;
  if (!fuzz::as_the_engine_does([&] {
        pipeline = kind->open(s.config, job, s.model.string());
        steps = pipeline->plan();
      }))
    std::abort();  // the request is the harness's own: it must open
  const contain::Evidence evidence;
  std::vector<Json> outputs;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    supervisor::Step& step = steps[i];
    if (i + 1 >= in.size()) return 0;
    if (step.harvest || !step.accept) std::abort();  // no kind here has harvest steps
    if (!fuzz::as_the_engine_does([&] {
          (void)step.input();
          if (step.move_in) (void)step.move_in();
        }))
      return 0;
    Json output;
    try {
      output = common::parse_strict(in[i + 1],
                                    {.max_bytes = kMaxWorkerOutputBytes, .exact_integers = false});
    } catch (const common::Error&) {
      return 0;  // worker.<role>_output
    }
    outputs.push_back(output);
    if (!fuzz::as_the_engine_does(
            [&] { supervisor::accept_output(step, std::move(output), evidence); }))
      return 0;
  }

  // assemble() takes the artifact the last worker left, as the engine's complete() does.
  if (!kind->artifact.empty()) {
    leave_artifact(job / kind->artifact);
  } else {
    // The oracle's output names the logits file: the last one (a numerics envelope runs after).
    const Json* oracle = &outputs.back();
    for (auto it = outputs.rbegin(); it != outputs.rend(); ++it)
      if (it->is_object() && it->value("schema", Json()) == "assay.oracle-output.v1") {
        oracle = &*it;
        break;
      }
    std::string name;
    if (!fuzz::as_the_engine_does([&] { name = supervisor::oracle_artifact_name(*oracle); }))
      return 0;
    // A name no file can have (NUL, longer than NAME_MAX): no worker could have left it, and the
    // engine finds no artifact; the harness stands in for the worker, so it stops here.
    if (name.find('\0') != std::string::npos || name.size() > 255) return 0;
    leave_artifact(job / "oracle" / name);
  }
  supervisor::RunFacts facts{.job_id = job.filename().string(),
                             .job_dir = job,
                             .started_unix = common::now_unix(),
                             .host_memory = Json::object(),
                             .backend = "none",
                             .key_id = s.key.key_id()};
  fuzz::as_the_engine_does([&] {
    supervisor::Sealed sealed = pipeline->assemble(facts);
    supervisor::CommitFiles files = supervisor::seal(sealed, s.key);
    if (sealed.message.empty() || files.write.size() != 2) std::abort();
  });
  return 0;
}
