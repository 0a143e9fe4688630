"""assayd's HTTP API over its unix socket (supervisor/README.md, schemas/openapi.yaml)."""
import http.client
import json
import os
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["Client", "Job", "AssayError", "DEFAULT_SOCKET", "TERMINAL_STATES"]

DEFAULT_SOCKET = "/run/assay/assayd.sock"
TERMINAL_STATES = ("succeeded", "failed", "cancelled")
# assayd holds at most 4 MiB of unsent events per stream; one event is far smaller.
MAX_EVENT_BYTES = 4 << 20


class AssayError(Exception):
    """An answer assayd gave as an error ({"error": {"code", "message"}}), or a transport
    failure (code "client.*"). ``status`` is the HTTP status, 0 when no answer came."""

    def __init__(self, code: str, message: str, status: int = 0):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.status = code, message, status


@dataclass
class Job:
    """A job as GET /v1/jobs/ID describes it; ``raw`` is the whole document."""
    id: str
    state: str
    kind: Optional[str] = None
    phase: Optional[str] = None
    error: Optional[dict] = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_document(cls, doc: dict) -> "Job":
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), str):
            raise AssayError("client.bad_answer", f"not a job document: {str(doc)[:200]}")
        return cls(id=doc["id"], state=doc.get("state", "unknown"), kind=doc.get("kind"),
                   phase=doc.get("phase"), error=doc.get("error"), raw=doc)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


def _raise_answer(status: int, data: bytes, what: str):
    """assayd's error document as AssayError; anything else as client.http."""
    try:
        err = json.loads(data)["error"]
        code, message = err["code"], err["message"]
    except (ValueError, KeyError, TypeError):
        raise AssayError("client.http", f"{what}: HTTP {status}: {data[:300]!r}", status) from None
    raise AssayError(code, message, status)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class Client:
    """One assayd, reached over its unix socket (``ASSAY_SOCKET`` or /run/assay/assayd.sock).

    Every call opens its own connection, so a Client may be shared between threads. Errors are
    AssayError with assayd's own code (e.g. ``request.invalid``) or ``client.*``.
    """

    def __init__(self, socket_path: Optional[str] = None, timeout: float = 30.0):
        self.socket_path = socket_path or os.environ.get("ASSAY_SOCKET") or DEFAULT_SOCKET
        self.timeout = timeout

    # ---- transport
    def _open(self, method: str, path: str, body: Optional[bytes] = None,
              timeout: Optional[float] = None):
        conn = _UnixConnection(self.socket_path, self.timeout if timeout is None else timeout)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn, conn.getresponse()
        except FileNotFoundError:
            conn.close()
            raise AssayError("client.no_socket",
                             f"{self.socket_path} does not exist: is assayd running?") from None
        except ConnectionRefusedError:
            conn.close()
            raise AssayError("client.refused",
                             f"{self.socket_path} refused the connection: is assayd running?"
                             ) from None
        except PermissionError:
            conn.close()
            raise AssayError("client.permission",
                             f"no permission to connect to {self.socket_path} (assayd's group "
                             "may connect)") from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise AssayError("client.transport", f"{method} {path}: {e}") from None

    def _call(self, method: str, path: str, document=None, raw: bool = False):
        body = None if document is None else json.dumps(document).encode("utf-8")
        conn, resp = self._open(method, path, body)
        try:
            data = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            _raise_answer(resp.status, data, f"{method} {path}")
        if raw:
            return data
        try:
            return json.loads(data)
        except ValueError:
            raise AssayError("client.bad_answer", f"{method} {path}: not JSON: {data[:200]!r}",
                             resp.status) from None

    @staticmethod
    def _id(job_id: str) -> str:
        # assayd's ids are "j-" and hex; anything else is refused before it reaches a path.
        if not isinstance(job_id, str) or not job_id.startswith("j-") or \
                not all(c in "0123456789abcdef" for c in job_id[2:]) or len(job_id) < 3:
            raise AssayError("client.bad_job_id", f"{job_id!r} is not a job id (j-<hex>)")
        return job_id

    # ---- the API
    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def info(self) -> dict:
        return self._call("GET", "/v1/info")

    def metrics(self) -> str:
        return self._call("GET", "/metrics", raw=True).decode("utf-8")

    def submit(self, request: dict, model_dir=None, **query: str) -> Job:
        """POST /v1/jobs. ``model_dir`` names the model for a request that has none (made
        absolute: assayd resolves nothing against its own directory); ``query`` becomes the rest
        of the query string."""
        path = "/v1/jobs"
        if model_dir is not None:
            query = dict(query, model_dir=os.path.abspath(os.fspath(model_dir)))
        if query:
            from urllib.parse import urlencode
            path += "?" + urlencode(query)
        return Job.from_document(self._call("POST", path, request))

    def job(self, job_id: str) -> Job:
        return Job.from_document(self._call("GET", "/v1/jobs/" + self._id(job_id)))

    def jobs(self, state: Optional[str] = None) -> list:
        doc = self._call("GET", "/v1/jobs" + (f"?state={state}" if state else ""))
        items = doc.get("jobs", doc) if isinstance(doc, dict) else doc
        return [Job.from_document(j) for j in items]

    def cancel(self, job_id: str) -> Job:
        return Job.from_document(self._call("DELETE", "/v1/jobs/" + self._id(job_id)))

    def events(self, job_id: str, timeout: Optional[float] = None) -> Iterator[dict]:
        """The job's events as assayd streams them (every event so far, then each new one),
        until its last. ``timeout`` bounds the wait for each line (None: no bound)."""
        conn, resp = self._open("GET", "/v1/jobs/" + self._id(job_id) + "/events",
                                timeout=timeout)
        try:
            if resp.status >= 400:
                _raise_answer(resp.status, resp.read(), "events")
            while True:
                try:
                    line = resp.readline(MAX_EVENT_BYTES + 1)
                except socket.timeout:
                    raise AssayError("client.timeout", f"no event from {job_id} in {timeout} s"
                                     ) from None
                if not line:
                    return
                if len(line) > MAX_EVENT_BYTES and not line.endswith(b"\n"):
                    raise AssayError("client.bad_answer", f"an event of {job_id} is longer than "
                                     f"{MAX_EVENT_BYTES} bytes")
                line = line.strip()
                if line:
                    try:
                        yield json.loads(line)
                    except ValueError:
                        raise AssayError("client.bad_answer",
                                         f"an event of {job_id} is not JSON: {line[:200]!r}") from None
        finally:
            conn.close()

    def wait(self, job_id: str, timeout: Optional[float] = None,
             progress: Optional[Callable[[dict], None]] = None, poll: float = 0.2) -> Job:
        """Until the job is succeeded, failed or cancelled; returns it. ``progress`` is called
        with each event (phase changes, progress counts) as it comes. Raises AssayError
        ("client.timeout") after ``timeout`` seconds, leaving the job as it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.job(job_id)
        if job.done:
            return job
        if progress is not None:
            try:
                for event in self.events(job_id, timeout=timeout):
                    progress(event)
                    if deadline is not None and time.monotonic() > deadline:
                        break
            except AssayError as e:
                if e.code != "client.timeout":
                    raise
        while True:
            job = self.job(job_id)
            if job.done:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise AssayError("client.timeout",
                                 f"{job_id} still {job.state} after {timeout} s")
            time.sleep(poll)

    def result_bytes(self, job_id: str) -> bytes:
        """The signed result.json exactly as stored (the bytes its signature covers)."""
        return self._call("GET", "/v1/jobs/" + self._id(job_id) + "/result", raw=True)

    def result(self, job_id: str) -> dict:
        return json.loads(self.result_bytes(job_id))

    def attestation(self, job_id: str) -> dict:
        """The DSSE envelope over the in-toto statement naming the result and its artifact."""
        return self._call("GET", "/v1/jobs/" + self._id(job_id) + "/attestation")

    def artifact(self, job_id: str, path) -> Path:
        """Writes the job's artifact (logits, KL, states...) to ``path``: streamed to a
        temporary file beside it and renamed, so ``path`` is either whole or untouched."""
        path = Path(path)
        conn, resp = self._open("GET", "/v1/jobs/" + self._id(job_id) + "/artifact")
        try:
            if resp.status >= 400:
                _raise_answer(resp.status, resp.read(), "artifact")
            # Created with 0666 less the umask, as any file the caller writes (mkstemp's 0600
            # would leave the artifact unreadable to the group the record is shared with).
            tmp = str(path.parent / f".{path.name}.{secrets.token_hex(8)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                with os.fdopen(fd, "wb") as out:
                    while True:
                        chunk = resp.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
        finally:
            conn.close()
        return path

    def verify(self, job_id: str, public_key=None, artifact: bool = True):
        """Fetches the job's result, envelope and (with ``artifact``) its artifact and checks
        them (assay_client.verify.verify_result). ``public_key`` (PEM text or bytes, or the raw
        32 bytes) should come from somewhere other than this daemon; without it the daemon's
        own key (GET /v1/info) is used and the report's ``key_source`` says so."""
        from .verify import verify_result
        source = "given"
        if public_key is None:
            public_key = self.info()["public_key_pem"]
            source = "the daemon's own /v1/info (not an independent key)"
        data = self.result_bytes(job_id)
        envelope = self.attestation(job_id)
        art = None
        if artifact:
            with tempfile.TemporaryDirectory() as d:
                art = self.artifact(job_id, Path(d) / "artifact").read_bytes()
        report = verify_result(data, envelope=envelope, public_key=public_key, artifact=art)
        report.key_source = source
        return report
