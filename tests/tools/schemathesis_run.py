#!/usr/bin/env python3
"""Property-based run of Schemathesis against a live assayd: the daemon is started on a temporary
unix socket (containment none, a fingerprint worker that fails at once, so submitted jobs end
quickly), a loopback TCP bridge forwards to the socket, and `schemathesis run schemas/openapi.yaml`
checks every answer: no 5xx, status codes, content types and bodies as described. Afterwards the
daemon must still be alive and answer /v1/health. Exit 0 only when all of that held; 77 when
schemathesis is not installed (ctest SKIP_RETURN_CODE).

  schemathesis_run.py --assayd PATH --source DIR [--max-examples N] [--seed S] [--report FILE]
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")


def unix_get(path: pathlib.Path, target: str, timeout: float = 2.0) -> tuple[int, str]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: assayd\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        return 0, ""
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head[9:12]) if len(head) >= 12 else 0), body.decode(errors="replace")


def pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while chunk := a.recv(65536):
            b.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def bridge(listener: socket.socket, unix_path: pathlib.Path) -> None:
    """Loopback TCP -> the daemon's unix socket, one thread pair per connection."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(str(unix_path))
        except OSError:
            client.close()
            continue
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


def local_schemas(source: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of schemas/ whose references by $id (https://assay.dev/schemas/...) name the copied
    files by their relative names, so that schemathesis checks those parts of the answers too instead of skipping them
    as unresolvable. Returns the copy's openapi.yaml."""
    into.mkdir()
    files = sorted((source / "schemas").glob("*.json"))
    by_id = {}
    for f in files:
        doc = json.loads(f.read_text())
        if "$id" in doc:
            by_id[doc["$id"]] = f.name

    def rewrite(node):
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    base, _, fragment = v.partition("#")
                    if base in by_id:
                        v = by_id[base] + ("#" + fragment if fragment else "")
                out[k] = rewrite(v)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for f in files:
        text = json.dumps(rewrite(json.loads(f.read_text())))
        (into / f.name).write_text(text)
        # Also under the last part of its $id (process-containment.v1.json), which schemathesis
        # resolves a reference to against the referring file's folder.
        doc_id = json.loads(text).get("$id", "")
        if doc_id and doc_id.rsplit("/", 1)[-1] != f.name:
            (into / doc_id.rsplit("/", 1)[-1]).write_text(text)
    shutil.copy(source / "schemas" / "openapi.yaml", into / "openapi.yaml")
    return into / "openapi.yaml"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--assayd", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--max-examples", type=int, default=25)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--report", help="append a JSON line with the outcome here")
    args = ap.parse_args()
    st = shutil.which("schemathesis") or str(pathlib.Path(sys.executable).parent / "schemathesis")
    if not os.access(st, os.X_OK):
        print("schemathesis is not installed (pip install schemathesis==4.32.5)")
        return 77
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="assay-st-"))
    spec = local_schemas(pathlib.Path(args.source).resolve(), tmp / "schemas")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 260}))
    sock = tmp / "assayd.sock"
    log = open(tmp / "assayd.log", "wb")
    daemon = subprocess.Popen([args.assayd, "serve", "--socket", str(sock), "--state-dir",
                               str(tmp / "state"), "--containment", "none",
                               "--fingerprint-worker", "/bin/false"], stdout=log, stderr=log)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    threading.Thread(target=bridge, args=(listener, sock), daemon=True).start()
    ok = False
    try:
        for _ in range(200):
            if unix_get(sock, "/v1/health")[0] == 200:
                break
            time.sleep(0.05)
        else:
            print("assayd did not answer /v1/health:\n" + (tmp / "assayd.log").read_text())
            return 1
        t0 = time.monotonic()
        run = subprocess.run(
            [st, "run", str(spec), "--url", f"http://127.0.0.1:{port}", "--checks", CHECKS,
             "--max-examples", str(args.max_examples), "--seed", str(args.seed),
             "--workers", "1", "--request-timeout", "10", "--phases", "examples,fuzzing"],
            capture_output=True, text=True, cwd=tmp)  # its .schemathesis/ cache stays there
        seconds = time.monotonic() - t0
        print(run.stdout[-20000:])
        print(run.stderr[-5000:])
        alive = daemon.poll() is None
        health = unix_get(sock, "/v1/health", 2.0)[0]
        print(f"schemathesis exit {run.returncode} after {seconds:.1f} s; assayd alive: {alive}; "
              f"/v1/health afterwards: {health}")
        ok = run.returncode == 0 and alive and health == 200
        if args.report:
            with open(args.report, "a") as f:
                f.write(json.dumps({"max_examples": args.max_examples, "seed": args.seed,
                                    "schemathesis_exit": run.returncode, "seconds": round(seconds, 1),
                                    "assayd_alive": alive, "health": health,
                                    "summary": run.stdout.strip().splitlines()[-6:]}) + "\n")
        if not alive:
            print("assayd ended:\n" + (tmp / "assayd.log").read_text()[-5000:])
    finally:
        listener.close()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
