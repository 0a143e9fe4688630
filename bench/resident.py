#!/opt/assay/venv/bin/python
"""Issue 27's benchmark: a next-token job's wall against the eager reference and the forward.

    resident.py --build DIR --case NAME:MODEL_DIR:T [--case ...] --work DIR --out JSON
                [--repeats N] [--many N] [--containment MODE]

Per case, in one run on this machine:
  - transformers' eager forward in a fresh process (bench/oracle_vs_hf.py's HF_RUN: import,
    load, bf16 forward, F32 logits written), from outside (/usr/bin/time): the eager reference;
  - assayd without resident workers, a fresh state directory (fingerprint cache cold, page
    cache warm): the cold job, then a repeat job (fingerprint cache warm, a new oracle process);
  - assayd with resident_models {count 1}, a fresh state directory: the cold job (it starts
    and loads the resident worker), then --repeats repeat jobs (each on the resident worker);
    "the forward alone" is the forward_seconds those jobs' oracle reports (median);
  - --many repeat single jobs (submitted at once) against one batch job of the same states,
    both on the resident worker.
Each job's wall is from its POST to the first GET that shows it ended (polled every 5 ms).
"""
import argparse, json, os, random, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from assayd_http import call, wait_healthy  # noqa: E402
from oracle_vs_hf import HF_RUN, timed  # noqa: E402


def state(seed, t):
    rng = random.Random(seed)
    return {"schema": "assay.next-token-request.v1", "id": "bench-%d" % seed,
            "input_token_ids": [rng.randint(32, 126) for _ in range(t)],
            "candidates": [{"engine": "kiln", "token_id": 65, "text": "A"},
                           {"engine": "vllm", "token_id": 66, "text": "B"}]}


class Daemon:
    def __init__(self, args, work, name, resident):
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.sock = os.path.join(self.dir, "sock")
        cfg = os.path.join(self.dir, "config.json")
        json.dump({"resident_models": {"count": 1 if resident else 0}}, open(cfg, "w"))
        b = args.build
        self.proc = subprocess.Popen(
            [b + "/supervisor/assayd", "serve", "--socket", self.sock, "--state-dir",
             self.dir + "/state", "--containment", args.containment, "--config", cfg,
             "--fingerprint-worker", b + "/fingerprint/assay-fingerprint",
             "--oracle-worker", b + "/worker/assay-oracle"],
            stdout=open(self.dir + "/assayd.log", "w"), stderr=subprocess.STDOUT)
        wait_healthy(self.sock)

    def wait(self, ids):
        # One job polled at a time, in order: polling all of them would load the daemon (and the
        # 2 CPUs it shares with the workers) with requests in proportion to the queue.
        ends = {}
        for i in ids:
            while True:
                s = call(self.sock, "GET", "/v1/jobs/" + i)[1]
                if s["state"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.005)
            if s["state"] != "succeeded":
                sys.exit("job %s %s: %s" % (i, s["state"], json.dumps(s.get("error"))))
            ends[i] = time.monotonic()
        return ends

    def job(self, doc, query=""):
        t0 = time.monotonic()
        st, j = call(self.sock, "POST", "/v1/jobs" + query, doc)
        assert st == 201, j
        end = self.wait([j["id"]])[j["id"]]
        return end - t0, call(self.sock, "GET", "/v1/jobs/%s/result" % j["id"])[1]

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def measure(args, name, model, t):
    row = {"case": name, "T": t}
    ids = state(1, t)["input_token_ids"]
    with tempfile.TemporaryDirectory() as d:
        wall, rss, err = timed([args.python, "-c", HF_RUN, model, ",".join(map(str, ids)),
                                d + "/hf.safetensors", str(args.threads)])
        hf = json.loads(err.strip().splitlines()[-1])
    row.update(hf_wall=wall, hf_forward=hf["forward_seconds"], hf_load=hf["load_seconds"],
               hf_import=hf["import_seconds"])

    seed = [100]

    def doc():
        seed[0] += 1
        return dict(state(seed[0], t), model_dir=model)

    one = Daemon(args, args.work, name + "-oneshot", False)
    row["cold_oneshot"], r = one.job(doc())
    row["cold_oneshot_oracle_load"] = r["oracle"]["load_seconds"]
    row["cold_oneshot_oracle_forward"] = r["oracle"]["forward_seconds"]
    row["repeat_oneshot"], r = one.job(doc())
    one.stop()

    res = Daemon(args, args.work, name + "-resident", True)
    row["cold_resident"], r = res.job(doc())
    worker = r["oracle"]["process"]["resident"]["worker"]
    walls, forwards, durations = [], [], []
    for _ in range(args.repeats):
        w, r = res.job(doc())
        assert r["oracle"]["process"]["resident"]["worker"] == worker, "not the resident worker"
        assert r["oracle"]["bytes_used"]["weight_files"] == r["model_identity"]["weight_files"]
        walls.append(w)
        forwards.append(r["oracle"]["forward_seconds"])
        durations.append(r["duration_seconds"])
    row.update(repeat_resident=statistics.median(walls), repeat_resident_all=walls,
               forward_alone=statistics.median(forwards),
               repeat_server_seconds=statistics.median(durations), resident_worker=worker)

    n = args.many
    states = [state(10_000 + i, t) for i in range(n)]
    t0 = time.monotonic()
    ids = []
    for s in states:
        st, j = call(res.sock, "POST", "/v1/jobs", dict(s, model_dir=model))
        assert st == 201, j
        ids.append(j["id"])
    res.wait(ids)
    row["many_singles"] = time.monotonic() - t0
    single0 = call(res.sock, "GET", "/v1/jobs/%s/result" % ids[0])[1]["oracle"]["logits_sha256"]
    for s in states:
        s["id"] = s["id"] + "-b"
    w, summary = res.job({"schema": "assay.next-token-batch-request.v1", "id": "bench-batch",
                          "states": states}, "?model_dir=" + model)
    row["many_batch"] = w
    assert summary["counts"]["succeeded"] == n, summary["counts"]
    batch0 = call(res.sock, "GET", "/v1/jobs/%s/result" % summary["states"][0]["job_id"])[1]
    row["logits_equal"] = batch0["oracle"]["logits_sha256"] == single0
    row["batch_on_resident"] = batch0["oracle"]["process"].get("resident", {}).get("worker") == worker
    row["many"] = n
    res.stop()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--many", type=int, default=100)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--containment", default="auto")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    rows = []
    for c in args.case:
        name, model, t = c.split(":")
        rows.append(measure(args, name, model, int(t)))
        print(json.dumps(rows[-1]), file=sys.stderr)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
