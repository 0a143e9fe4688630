// A batch's states: each ends as a job of its own, terminal from the start, with the request,
// the sealed and signed result and the artifact a single job of that request would have. A
// state recorded is never run again: a restart hands the pipeline the parts the store holds.
#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/result.h"
#include "common/text.h"
#include "common/time.h"
#include "supervisor/jobs/engine.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

void Engine::restore_parts(JobRun& run) {
  for (std::size_t i = 0; i < run.pipeline->part_count(); ++i) {
    std::string id = part_job_id(run.id, i);
    Job* part = store_.find(id);
    if (!part || !is_terminal(part->state)) continue;
    PartRecord record{i, id, part->state == JobState::kSucceeded, Json(nullptr),
                      part->error ? *part->error : Json(nullptr)};
    if (record.succeeded) {
      try {
        record.result = common::parse_strict(
            common::read_file(store_.job_dir(id) / common::kResultFileName, 64 << 20));
      } catch (const Error& e) {
        // Unreadable: run the state again rather than summarise what cannot be read.
        spdlog::error("cannot read the result of part {} of {}: {}", i, run.id, e.what());
        continue;
      }
    }
    run.pipeline->part_recorded(record);
  }
}

void Engine::record_part(JobRun& run, Part& part) {
  const Job& batch = *store_.find(run.id);
  Job job;
  job.id = part_job_id(run.id, part.index);
  job.key = common::sha256_canonical_id(Json{{"batch_key", batch.key}, {"index", part.index}});
  job.request_sha256 = part.admission.request_sha256;
  job.request_schema = part.admission.request_schema;
  job.request_id = part.admission.request_id;
  job.model_dir = part.admission.model_dir;
  job.submitter_uid = batch.submitter_uid;
  job.created_at = common::now_rfc3339();
  job.created_unix = common::now_unix();
  job.attempts = 1;
  job.batch = Json{{"id", run.id}, {"index", part.index}};
  JobStore::add_event(job, "part " + std::to_string(part.index) + " of batch " + run.id);
  CommitFiles files;
  std::vector<std::pair<fs::path, std::string>> moved;
  PartRecord record{part.index, job.id, part.sealed.has_value(), Json(nullptr), Json(nullptr)};
  if (part.sealed) {
    files = seal(*part.sealed, key_);
    moved.emplace_back(part.sealed->artifact, part.sealed->artifact_name);
    job.state = JobState::kSucceeded;
    record.result = part.sealed->result;
  } else {
    job.state = JobState::kFailed;
    job.error = part.error.value_or(Json{{"code", "job.part_failed"}, {"message", "failed"}});
    (*job.error)["message"] = common::printable((*job.error).value("message", ""), 16 * 1024);
    record.error = *job.error;
  }
  job.phase = std::string(state_name(job.state));
  JobStore::add_event(job, part.message);
  Job& stored =
      store_.create_finished(std::move(job), common::canonical(part.request), files, moved);
  watchers_.publish(stored);
  run.pipeline->part_recorded(record);
}

void Engine::harvest_step(const std::string& id) {
  auto it = runs_.find(id);
  if (it == runs_.end() || !it->second->harvesting) return;
  JobRun& run = *it->second;
  Step& step = run.steps[run.next_step - 1];
  Step::Then then = Step::Then::kNext;
  try {
    std::vector<Part> parts =
        step.harvest(run_facts(run), store_.job_dir(id) / step.role, *run.harvesting, then);
    for (Part& part : parts) record_part(run, part);
  } catch (const Error& e) {
    return fail(run.id, e.code() == "fs.no_space" ? "store.full" : e.code(), e.what());
  } catch (const std::exception& e) {
    return fail(run.id, "supervisor.internal", e.what());
  }
  if (then == Step::Then::kMore) return boost::asio::post(io_, [this, id] { harvest_step(id); });
  run.harvesting.reset();
  if (run.cancel_requested)
    return finish(run.id, JobState::kCancelled,
                  "cancelled while the " + step.role + " worker ran (its ended parts recorded)");
  return then == Step::Then::kAgain ? start_step(run, step) : next_step(run);
}

}  // namespace assay::supervisor
