#!/opt/assay/venv/bin/python
"""Does assayd keep answering while a job starts on a model whose pages are not yet written back?

    dirty_model.py --build DIR [--gib N] [--runs N] [--containment MODE] [--out FILE]

A model copied in just before a job has dirty pages; settling its files (the fingerprint reuse
check, the directory record) writes them back (sync_file_range), about 0.6 s per GiB on this
machine's disk. assayd does that writeback on its digest thread first (engine.cpp, start_step),
not on the event loop that serves every client. Measured here, interleaved, on the tiny fixture
with an extra N GiB file beside its weights: "dirty" (the file written just before the job is
submitted) against "clean" (the same file, written back with sync first). During each job a
client asks /v1/health every 5 ms; the row gives the slowest answer and the job's wall. Writes
bench/dirty_model.md (or --out) with the machine's facts.
"""
import argparse, json, os, platform, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from assayd_http import call, wait_healthy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", required=True)
    p.add_argument("--gib", type=float, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--containment", default="auto")
    p.add_argument("--out", default=os.path.join(HERE, "dirty_model.md"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="assay-dirty-", dir="/var/tmp")
    model = os.path.join(work, "model")
    subprocess.run([sys.executable, os.path.join(HERE, "..", "tests", "fixtures", "make_fixture.py"),
                    "--arch", "llama", "--size", "tiny", "--out", model], check=True,
                   capture_output=True)
    sock = os.path.join(work, "sock")
    daemon = subprocess.Popen(
        [a.build + "/supervisor/assayd", "serve", "--socket", sock, "--state-dir", work + "/state",
         "--containment", a.containment, "--fingerprint-worker",
         a.build + "/fingerprint/assay-fingerprint", "--oracle-worker",
         a.build + "/worker/assay-oracle"],
        stdout=open(work + "/assayd.log", "w"), stderr=subprocess.STDOUT)
    wait_healthy(sock)
    block = os.urandom(1 << 20)
    rows = {"dirty": [], "clean": []}
    try:
        for run in range(a.runs):
            for case in ("dirty", "clean"):
                pad = os.path.join(model, "extra.bin")
                with open(pad, "wb") as f:
                    for i in range(int(a.gib * 1024)):
                        f.write(i.to_bytes(8, "little") + block[8:])
                if case == "clean":
                    os.sync()
                    time.sleep(3)  # older than the settle's 2 s tick, as the dirty file is not
                slowest, done = [0.0], threading.Event()

                def poll():
                    while not done.is_set():
                        t = time.monotonic()
                        call(sock, "GET", "/v1/health")
                        slowest[0] = max(slowest[0], time.monotonic() - t)
                        time.sleep(0.005)
                poller = threading.Thread(target=poll)
                poller.start()
                t0 = time.monotonic()
                st, j = call(sock, "POST", "/v1/jobs", {
                    "schema": "assay.next-token-request.v1", "id": "dirty-%s-%d" % (case, run),
                    "model_dir": model, "input_token_ids": list(b"Hello, wor"),
                    "candidates": [{"engine": "kiln", "token_id": 108, "text": "l"},
                                   {"engine": "vllm", "token_id": 120, "text": "x"}]})
                assert st == 201, j
                while True:
                    s = call(sock, "GET", "/v1/jobs/" + j["id"])[1]
                    if s["state"] in ("succeeded", "failed", "cancelled"):
                        break
                    time.sleep(0.02)
                wall = time.monotonic() - t0
                done.set()
                poller.join()
                if s["state"] != "succeeded":
                    sys.exit("job %s %s: %s" % (j["id"], s["state"], json.dumps(s.get("error"))))
                rows[case].append((slowest[0], wall))
                print(case, run, "slowest health answer %.3f s, job %.2f s" % (slowest[0], wall),
                      flush=True)
                os.unlink(pad)
    finally:
        daemon.terminate()
        daemon.wait()
    import torch
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    med = lambda case, i: statistics.median(r[i] for r in rows[case])  # noqa: E731
    lines = ["# A job on a model with unwritten pages: does assayd keep answering?", "",
             f"`bench/dirty_model.py --gib {a.gib:g} --runs {a.runs}`, run "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {cpu}, "
             f"{os.cpu_count()} CPUs, ATEN_CPU_CAPABILITY {torch.backends.cpu.get_cpu_capability()}, "
             f"{platform.machine()}, containment `{a.containment}`. Tiny llama fixture plus an "
             f"extra {a.gib:g} GiB file in its directory; /v1/health asked every 5 ms during each "
             "job. Baseline: the same job with the file written back first (\"clean\"), "
             "interleaved in the same run.", "",
             "| case | slowest /v1/health answer, s (median of runs) | job wall s (median) |",
             "|---|---|---|"]
    for case in ("dirty", "clean"):
        lines.append(f"| {case} | {med(case, 0):.3f} | {med(case, 1):.2f} |")
    lines += ["", f"Ratio, dirty / clean: slowest answer {med('dirty', 0) / med('clean', 0):.2f}x, "
              f"job {med('dirty', 1) / med('clean', 1):.2f}x.", ""]
    open(a.out, "w").write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
