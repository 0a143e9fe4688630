#!/opt/assay/venv/bin/python
"""Issue 37, item 1: a cold next-token job that reads the weights once, against one that reads
them twice, and against transformers' eager forward of the same model and ids.

    cold_job.py --build DIR --case NAME:MODEL_DIR:T [--case ...] --work DIR --out MD
                [--rounds N] [--containment MODE] [--threads N]

Per case and round, interleaved, page cache warm, each job on a fresh assayd state directory
(fingerprint cache cold, no resident worker):
  - eager: transformers in a fresh process (bench/oracle_vs_hf.py's HF_RUN: import, load, bf16
    forward, F32 logits written), wall from outside;
  - two passes: the cold job with the shards' times just moved (`touch`, no byte changed): their
    state is no sound cache key for 2 s, so the fingerprint worker hashes them and the oracle
    hashes them again as it copies them (what every cold job did before);
  - one pass: the same job 2.1 s later, shards settled: the fingerprint leaves them to the
    oracle (unchanged_files), which hashes them once as it copies them.
Both jobs' results must name the same model identity. A job's wall is from its POST to the
first poll (every 5 ms) that shows it succeeded (bench/resident.py's Daemon); the fingerprint
column is the fingerprint worker's own stats.seconds.
"""
import argparse, datetime, itertools, json, os, platform, statistics, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_vs_hf import HF_RUN, timed, warm_page_cache  # noqa: E402
from resident import Daemon, state  # noqa: E402


def gemm_gflops(dtype, threads, n=1024, reps=3):
    """A bf16 n^3 matmul's rate (n=1024: without native bf16 a 4096^3 one takes minutes)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


RUNS = itertools.count()


def cold_job(args, model, t, name):
    """A fresh assayd (no resident worker, fingerprint cache cold), one job: its wall, its
    result and the fingerprint's output.json."""
    daemon = Daemon(args, args.work, "%s-%d" % (name, next(RUNS)), False)
    try:
        wall, result = daemon.job(dict(state(7, t), model_dir=model))
        with open(os.path.join(daemon.dir, "state", "jobs", result["job_id"], "fingerprint",
                               "output.json")) as f:
            return wall, result, json.load(f)
    finally:
        daemon.stop()


def shards(model):
    return [os.path.join(model, f) for f in sorted(os.listdir(model))
            if f.endswith(".safetensors")]


def measure(args, name, model, t):
    ids = state(7, t)["input_token_ids"]
    rows = {"eager": [], "two": [], "one": [], "two_fp": [], "one_fp": [], "two_load": [],
            "one_load": [], "forward": []}
    identity = None
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            wall, _, err = timed([args.python, "-c", HF_RUN, model, ",".join(map(str, ids)),
                                  d + "/hf.safetensors", str(args.threads)])
        rows["eager"].append(wall)
        for f in shards(model):
            os.utime(f)  # times moved, bytes unchanged: hashed by both workers
        touched = time.monotonic()
        wall, r, fp = cold_job(args, model, t, name + "-two")
        assert "model_identity" in fp and fp["stats"]["files"] >= len(shards(model)), fp["stats"]
        rows["two"].append(wall)
        rows["two_fp"].append(fp["stats"]["seconds"])
        rows["two_load"].append(r["oracle"]["load_seconds"])
        identity = identity or r["model_identity"]
        assert r["model_identity"] == identity
        time.sleep(max(0.0, 2.1 - (time.monotonic() - touched)))
        wall, r, fp = cold_job(args, model, t, name + "-one")
        assert fp.get("stats", {}).get("deferred_files") == len(shards(model)), fp["stats"]
        assert r["model_identity"] == identity, "one pass names another identity"
        rows["one"].append(wall)
        rows["one_fp"].append(fp["stats"]["seconds"])
        rows["one_load"].append(r["oracle"]["load_seconds"])
        rows["forward"].append(r["oracle"]["forward_seconds"])
    return {k: statistics.median(v) for k, v in rows.items()} | {"all": rows, "case": name,
                                                                  "T": t}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", required=True)
    p.add_argument("--case", action="append", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--containment", default="auto")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    import torch

    cases = []
    for c in args.case:
        name, model, t = c.split(":")
        warm_page_cache(model)
        cases.append((name, model, int(t)))
    gemm = gemm_gflops(torch.bfloat16, args.threads)
    results = [measure(args, *c) for c in cases]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    lines = [
        "# A cold job reads the weights once (`bench/cold_job.sh`)", "",
        "Run %s. CPU: %s, %d CPUs, `ATEN_CPU_CAPABILITY` %s, bf16 GEMM %.0f GFLOP/s (1024³, %d "
        "threads, best of 3, same run); containment `%s`; workers and transformers with %d "
        "threads." % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), cpu,
                      os.cpu_count(), torch.backends.cpu.get_cpu_capability(), gemm,
                      args.threads, args.containment, args.threads), "",
        "%d rounds per case, interleaved (eager, two passes, one pass), medians; each job on a "
        "fresh assayd state directory (fingerprint cache cold), page cache warm. **Two passes**: "
        "the shards' times moved just before (`touch`), so the fingerprint hashes them and the "
        "oracle hashes them again, as every cold job did before. **One pass**: the same job "
        "2.1 s later: the fingerprint leaves the settled shards to the oracle. Both name the same "
        "identity (checked)." % args.rounds, "",
        "| case | T | eager (s) | two passes (s) | one pass (s) | **one / two** | two / eager | "
        "**one / eager** | fingerprint two / one (s) | oracle load two / one (s) | forward (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            "| %s | %d | %.2f | %.2f | %.2f | **%.2fx** | %.2fx | **%.2fx** | %.2f / %.2f | "
            "%.2f / %.2f | %.3f |" % (r["case"], r["T"], r["eager"], r["two"], r["one"],
                                      r["one"] / r["two"], r["two"] / r["eager"],
                                      r["one"] / r["eager"], r["two_fp"], r["one_fp"],
                                      r["two_load"], r["one_load"], r["forward"]))
    lines += ["", "Every round (s):", ""]
    for r in results:
        a = r["all"]
        lines.append("- %s: eager %s; two passes %s; one pass %s." % (
            r["case"], ", ".join("%.2f" % x for x in a["eager"]),
            ", ".join("%.2f" % x for x in a["two"]), ", ".join("%.2f" % x for x in a["one"])))
    text = "\n".join(lines) + "\n"
    old = open(args.out).read() if os.path.exists(args.out) else ""
    history = old[old.find("\n## Notes"):] if "\n## Notes" in old else ""
    open(args.out, "w").write(text + history)
    print(text)


if __name__ == "__main__":
    main()
