#!/opt/assay/venv/bin/python
"""Repeat next-token jobs on a resident worker driven directly, as assayd drives one: the
worker's `serve` mode (assay-oracle serve or assay-hf-worker serve) with the model's files on
descriptors 4.. and the control socket on 3; each job's wall from "run NAME" to "done NAME".

    serve_repeat.py WORKER MODEL_DIR INPUT_JSON WORKDIR REPEATS

INPUT_JSON is an assay.oracle-input.v1 naming MODEL_DIR (no model_fds). Prints one JSON line:
{"load_seconds" (spawn to "loaded"), "job_seconds": [...], "forward_seconds": [...],
"logits_sha256": [...]}.
"""
import fcntl, json, os, shutil, socket, subprocess, sys, time


def main(worker, model_dir, input_json, workdir, repeats):
    job = json.load(open(input_json))
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    names = sorted(n for n in os.listdir(model_dir) if os.path.isfile(os.path.join(model_dir, n)))
    # Held well above the numbers the child gets, so that no dup2 below clobbers one of them.
    files = [fcntl.fcntl(os.open(os.path.join(model_dir, n), os.O_RDONLY), fcntl.F_DUPFD_CLOEXEC, 200)
             for n in names]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 200)
    json.dump({"schema": "assay.oracle-serve-input.v1", "model_dir": model_dir,
               "model_fds": [{"name": n, "fd": 4 + i} for i, n in enumerate(names)],
               "execution": job["execution"], "control_fd": 3},
              open(os.path.join(workdir, "input.json"), "w"))

    def wire():
        os.dup2(control, 3)
        for i, fd in enumerate(files):
            os.dup2(fd, 4 + i)

    t0 = time.monotonic()
    proc = subprocess.Popen([worker, "serve", "--input", "input.json", "--workdir", "."], cwd=workdir,
                            pass_fds=[3] + [4 + i for i in range(len(files))], preexec_fn=wire,
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "stderr"), "w"))
    if ours.recv(4096) != b"loaded":
        raise SystemExit(open(os.path.join(workdir, "stderr")).read())
    out = {"load_seconds": time.monotonic() - t0, "job_seconds": [], "forward_seconds": [],
           "logits_sha256": []}
    for i in range(repeats):
        name = "job-%d" % i
        os.mkdir(os.path.join(workdir, name))
        json.dump(job, open(os.path.join(workdir, name, "input.json"), "w"))
        t = time.monotonic()
        ours.send(("run " + name).encode())
        reply = ours.recv(4096).decode()
        out["job_seconds"].append(time.monotonic() - t)
        if reply != "done " + name:
            raise SystemExit(reply + ": " + open(os.path.join(workdir, "stderr")).read()[-2000:])
        o = json.load(open(os.path.join(workdir, name, "output.json")))
        out["forward_seconds"].append(o["forward_seconds"])
        out["logits_sha256"].append(o["logits_sha256"])
    ours.close()
    proc.wait(timeout=60)
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) != 6:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
