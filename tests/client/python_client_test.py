"""The Python client (clients/python) against a real assayd: installed with pip from the tree,
it submits a dispute, waits with progress, fetches the result and the artifact, and verifies
them offline with a key taken from `assay keys` (not from the client); a changed byte in the
result, the artifact or the envelope, or another key, fails the check that covers it; assayd's
errors arrive as AssayError with assayd's own code; Kiln's real records pass the Kiln self-hash.

Usage: python_client_test.py BUILD_DIR. Exit 0 when every check holds.
"""
import base64
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
failed = []


def check(name, ok, got=None):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {got!r}"), flush=True)
    if not ok:
        failed.append(name)


def main(build):
    build = pathlib.Path(build)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="assay-pyclient-"))
    os.chmod(tmp, 0o755)
    daemon = None
    try:
        # 1. pip install from the tree (no network: no dependency resolution, no build isolation).
        # From a copy: pip's build writes beside the sources, and the tree must stay clean.
        site, src = tmp / "site", tmp / "src"
        shutil.copytree(ROOT / "clients/python", src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(site), str(src)],
                       check=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
        check("pip installs the package from the tree", (site / "assay_client/__init__.py").exists())
        sys.path.insert(0, str(site))
        import assay_client
        from assay_client import AssayError, Client, verify_kiln_hash, verify_result
        check("it is imported from the installed copy",
              pathlib.Path(assay_client.__file__).resolve().is_relative_to(site.resolve()),
              assay_client.__file__)

        # 2. assayd, its workers and a tiny model.
        model = tmp / "model"
        subprocess.run([sys.executable, str(ROOT / "tests/fixtures/make_fixture.py"), "--arch",
                        "llama", "--size", "tiny", "--out", str(model)], check=True,
                       capture_output=True)
        sock = tmp / "assayd.sock"
        log = open(tmp / "assayd.log", "w")
        daemon = subprocess.Popen(
            [str(build / "supervisor/assayd"), "serve", "--socket", str(sock), "--state-dir",
             str(tmp / "state"), "--containment", "none", "--log-level", "warn",
             "--fingerprint-worker", str(build / "fingerprint/assay-fingerprint"),
             "--oracle-worker", str(build / "worker/assay-oracle")],
            stdout=log, stderr=subprocess.STDOUT)
        c = Client(str(sock))
        for _ in range(300):
            try:
                c.health()
                break
            except AssayError:
                time.sleep(0.1)
        check("health answers", c.health() is not None)

        # 3. Errors are assayd's own, typed.
        try:
            Client(str(tmp / "none.sock")).health()
            check("a missing socket is an error", False)
        except AssayError as e:
            check("a missing socket is client.no_socket naming it",
                  e.code == "client.no_socket" and "none.sock" in e.message, e)
        try:
            c.submit({"schema": "assay.next-token-request.v1"})
            check("an invalid request is refused", False)
        except AssayError as e:
            check("an invalid request is refused with assayd's code and status",
                  e.code.startswith("request.") and e.status in (400, 422), (e.code, e.status))
        try:
            c.job("../../etc/passwd")
            check("a bad id is refused", False)
        except AssayError as e:
            check("a malformed job id is refused before any request", e.code == "client.bad_job_id",
                  e.code)
        try:
            c.job("j-" + "0" * 24)
            check("an unknown job is an error", False)
        except AssayError as e:
            check("an unknown job is assayd's 404", e.status == 404, (e.code, e.status))

        # 4. A dispute: "Hello", two candidates whose texts are their decodings in the fixture.
        request = {"schema": "assay.next-token-request.v1", "id": "py-client",
                   "input_token_ids": [72, 101, 108, 108, 111],
                   "candidates": [{"engine": "kiln", "token_id": 44, "text": ","},
                                  {"engine": "vllm", "token_id": 33, "text": "!"}]}
        job = c.submit(request, model_dir=str(model))
        check("submit returns a job", job.id.startswith("j-") and not job.done, job)
        events = []
        job = c.wait(job.id, timeout=300, progress=events.append)
        check("wait returns the job succeeded", job.state == "succeeded", job.raw)
        check("wait passed the job's events to progress", len(events) >= 2, events)
        check("the list has it", any(j.id == job.id for j in c.jobs()))
        result = c.result(job.id)
        check("the result is the job's", result.get("job_id") == job.id, result.get("job_id"))
        check("its verdict names an engine or neither",
              result["verdict"]["argmax_candidate"] in ("kiln", "vllm", "neither"))
        # The source facts the build recorded (issue 39): the commit's tree object, and what
        # origin/main named, as git says of this checkout.
        src = result["source"]
        if src.get("git_commit"):
            git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True,  # noqa: E731
                                            text=True).stdout.strip()
            check("source.git_tree is the recorded commit's tree",
                  src.get("git_tree") == git("rev-parse", src["git_commit"] + "^{tree}"), src)
            check("source.origin_main is what refs/remotes/origin/main names (null without it)",
                  src.get("origin_main") == (git("rev-parse", "--verify", "-q",
                                                 "refs/remotes/origin/main^{commit}") or None), src)
        art = c.artifact(job.id, tmp / "logits.safetensors")
        check("artifact is written whole", art.stat().st_size == result["reference_artifact"]["bytes"])
        umask = os.umask(0)
        os.umask(umask)
        check("it has the caller's usual mode (0666 less the umask)",
              (art.stat().st_mode & 0o777) == (0o666 & ~umask), oct(art.stat().st_mode))
        check("no temporary file is left beside it",
              sorted(p.name for p in tmp.iterdir() if p.name.startswith(".logits")) == [])

        # 5. Verified with a key that did not come through the client.
        pem = tmp / "pubkey.pem"
        subprocess.run([str(build / "client/assay"), "--socket", str(sock), "keys", "-o", str(pem)],
                       check=True, stdout=subprocess.DEVNULL)
        report = c.verify(job.id, public_key=pem.read_text())
        print(report)
        check("verify passes", report.ok, report.failed())
        names = sorted(ch.name for ch in report.checks)
        out = tmp / "out"
        out.mkdir()
        (out / "result.json").write_bytes(c.result_bytes(job.id))
        (out / "result.dsse.json").write_text(json.dumps(c.attestation(job.id)))
        cli = subprocess.run([str(build / "client/assay"), "--socket", "/nonexistent", "verify",
                              str(out / "result.json"), "--pubkey", str(pem), "--artifact",
                              str(art), "--json"], capture_output=True, text=True)
        cli_names = sorted(ch["name"] for ch in json.loads(cli.stdout)["checks"])
        check("the same checks as `assay verify`, by name", names == cli_names, (names, cli_names))
        own = c.verify(job.id)
        check("without a key the daemon's own is used and said so",
              own.ok and "not an independent key" in (own.key_source or ""), own.key_source)

        # 6. Each change fails the check that covers it.
        data = (out / "result.json").read_bytes()
        env = json.loads((out / "result.dsse.json").read_text())
        logits = art.read_bytes()
        doc = json.loads(data)
        doc["verdict"]["argmax_candidate"] = "vllm" if doc["verdict"]["argmax_candidate"] != "vllm" \
            else "kiln"
        edited = json.dumps(doc).encode()
        r = verify_result(edited, envelope=env, public_key=pem.read_text(), artifact=logits)
        check("an edited verdict fails result_sha256 and subject.result",
              {"result_sha256", "subject.result"} <= set(r.failed()), r.failed())
        resealed = dict(doc)
        resealed.pop("result_sha256")
        resealed["result_sha256"] = assay_client.sha256_id(assay_client.canonical(resealed))
        r = verify_result(assay_client.canonical(resealed).encode(), envelope=env,
                          public_key=pem.read_text(), artifact=logits)
        check("resealed, it still fails subject.result (the signature binds the bytes)",
              r.failed() == ["subject.result"], r.failed())
        r = verify_result(data, envelope=env, public_key=pem.read_text(),
                          artifact=logits[:-1] + bytes([logits[-1] ^ 1]))
        check("a flipped artifact byte fails artifact.file only", r.failed() == ["artifact.file"],
              r.failed())
        bad = dict(env)
        sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
        sig[0] ^= 1
        bad["signatures"] = [dict(env["signatures"][0], sig=base64.b64encode(bytes(sig)).decode())]
        r = verify_result(data, envelope=bad, public_key=pem.read_text(), artifact=logits)
        check("a flipped signature bit fails signature", "signature" in r.failed(), r.failed())
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        other = Ed25519PrivateKey.generate().public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        r = verify_result(data, envelope=env, public_key=other, artifact=logits)
        check("another key fails key_id and signature",
              {"key_id", "signature"} <= set(r.failed()), r.failed())
        r = verify_result(b"\xff not json", envelope=None, public_key=pem.read_text())
        check("garbage is a failed check, never an exception", not r.ok, r.failed())
        cli = subprocess.run([sys.executable, "-m", "assay_client.verify", str(out / "result.json"),
                              "--pubkey", str(pem), "--artifact", str(art)],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(site)))
        check("assay-py-verify exits 0 on the record", cli.returncode == 0, cli.stdout + cli.stderr)

        # 7. Kiln's real records, by Kiln's canonical form.
        for f in sorted((ROOT / "tests/client/fixtures/kiln").glob("*.json")):
            r = verify_kiln_hash(f)
            check(f"Kiln's {f.name} passes kiln.result_sha256", r.ok, str(r))
            d = json.loads(f.read_text())
            d["created_at_utc"] = "2026-01-01T00:00:00Z"
            check(f"changed, {f.name} fails it", not verify_kiln_hash(d).ok)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait()
            if failed:
                print((tmp / "assayd.log").read_text()[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
