"""assayd's metrics listener (config metrics_listen): on loopback it serves GET and HEAD /metrics,
the same text as the unix socket's, and nothing else (the job API: 404; another method: 405; a
body: 400), keeps at most 32 connections (more are closed at once, the listener goes on), and is
absent by default; a non-loopback or malformed address stops assayd at start naming the value.

Usage: metrics_listener_test.py ASSAYD. Exit 0 when every check holds."""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

failed = []


def check(name, ok, got=None):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {got!r}"), flush=True)
    if not ok:
        failed.append(name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(raw: bytes, tcp=None, unix=None) -> bytes:
    s = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX)
    s.settimeout(10)
    s.connect(tcp or unix)
    s.sendall(raw)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
        if unix and b"\r\n\r\n" in out:
            head, _, body = out.partition(b"\r\n\r\n")
            n = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")]
            if n and len(body) >= n[0]:
                break
    s.close()
    return out


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def start(assayd, tmp, name, config):
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    log = open(d / "assayd.log", "w")
    p = subprocess.Popen([assayd, "serve", "--socket", str(d / "sock"), "--state-dir",
                          str(d / "state"), "--containment", "none", "--config",
                          str(d / "config.json"), "--log-level", "info"],
                         stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if p.poll() is not None:
            return p, d, False
        try:
            if status(http(b"GET /v1/health HTTP/1.1\r\nHost: a\r\n\r\n", unix=str(d / "sock"))) == 200:
                return p, d, True
        except OSError:
            pass
        time.sleep(0.1)
    return p, d, False


def main(assayd):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="assay-metrics-"))
    procs = []
    try:
        port = free_port()
        p, d, up = start(assayd, tmp, "on", {"metrics_listen": f"127.0.0.1:{port}"})
        procs.append(p)
        check("assayd starts with metrics_listen", up, (d / "assayd.log").read_text()[-2000:])
        addr = ("127.0.0.1", port)
        got = http(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", tcp=addr)
        body = got.partition(b"\r\n\r\n")[2].decode()
        check("GET /metrics over TCP is 200 Prometheus text",
              status(got) == 200 and b"text/plain; version=0.0.4" in got, got[:300])
        check("with the job gauges", 'assay_jobs{state="queued"}' in body, body[:300])
        unix = http(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", unix=str(d / "sock"))
        names = lambda t: sorted({l.split("{")[0].split(" ")[0] for l in t.splitlines() if l and not l.startswith("#")})  # noqa: E731
        check("the same series as the unix socket's /metrics",
              names(body) == names(unix.partition(b"\r\n\r\n")[2].decode()))
        got = http(b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n", tcp=addr)
        check("HEAD /metrics is 200 without a body", status(got) == 200 and got.endswith(b"\r\n\r\n"),
              got[-100:])
        for raw, want, what in (
                (b"GET /v1/health HTTP/1.1\r\nHost: a\r\n\r\n", 404, "the API's health"),
                (b"GET /v1/jobs HTTP/1.1\r\nHost: a\r\n\r\n", 404, "the job list"),
                (b"POST /v1/jobs HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}", 400,
                 "a submission (a body)"),
                (b"DELETE /metrics HTTP/1.1\r\nHost: a\r\n\r\n", 405, "another method on /metrics"),
                (b"GET /metrics/../v1/info HTTP/1.1\r\nHost: a\r\n\r\n", 404, "a path around it"),
                (b"\x16\x03\x01 not http\r\n\r\n", 400, "bytes that are not HTTP")):
            got = http(raw, tcp=addr)
            check(f"{what} over TCP is {want}", status(got) == want, got[:200])
        got = http(b"DELETE /metrics HTTP/1.1\r\nHost: a\r\n\r\n", tcp=addr)
        check("405 names the methods it takes", b"Allow: GET, HEAD" in got, got[:300])

        # More idle connections than it keeps: the extra ones are closed, it goes on serving.
        idle = []
        for _ in range(40):
            s = socket.create_connection(addr, timeout=5)
            idle.append(s)
        time.sleep(0.5)
        closed = 0
        for s in idle:
            s.settimeout(0.2)
            try:
                closed += s.recv(1) == b""
            except (socket.timeout, OSError):
                pass
        check("connections past 32 are closed at once", closed >= 8, closed)
        for s in idle:
            s.close()
        time.sleep(0.3)
        check("after them it still serves", status(http(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", tcp=addr)) == 200)
        check("and the unix API never stopped",
              status(http(b"GET /v1/health HTTP/1.1\r\nHost: a\r\n\r\n", unix=str(d / "sock"))) == 200)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)

        # Off by default: nothing listens.
        port2 = free_port()
        p, d, up = start(assayd, tmp, "off", {})
        procs.append(p)
        try:
            socket.create_connection(("127.0.0.1", port2), timeout=2).close()
            check("by default nothing listens", False)
        except OSError:
            check("by default nothing listens", True)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)

        def refused(name, value):
            """assayd started with metrics_listen VALUE: whether it came up, its exit, its log."""
            p, d, up = start(assayd, tmp, name, {"metrics_listen": value})
            procs.append(p)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            return up, p.returncode, (d / "assayd.log").read_text()

        for value, why in (("0.0.0.0:9464", "is not a loopback address"),
                           ("10.1.2.3:9464", "is not a loopback address"),
                           ("127.0.0.1", "is not HOST:PORT"),
                           ("127.0.0.1:0", "has no port"),
                           ("metrics.example:9464", "does not name a numeric IP")):
            up, code, log = refused(f"bad-{len(procs)}", value)
            check(f"{value!r}: assayd refuses to start, naming it",
                  not up and code not in (None, 0) and value in log and why in log, log[-400:])
        # The port taken by someone else: a clear error, not a daemon without its listener.
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            taken = holder.getsockname()[1]
            up, code, log = refused("taken", f"127.0.0.1:{taken}")
            check("a port in use stops assayd naming it",
                  not up and code not in (None, 0) and f"127.0.0.1:{taken}" in log, log[-400:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
