"""assay's Python client: talk to assayd over its unix socket and check its signed records.

    from assay_client import Client
    c = Client()                                  # $ASSAY_SOCKET or /run/assay/assayd.sock
    job = c.submit(request)                       # a dict: any request POST /v1/jobs takes
    job = c.wait(job.id, progress=print)          # events as they come
    result = c.result(job.id)                     # the signed document
    c.artifact(job.id, "logits.safetensors")
    report = c.verify(job.id, public_key=open("assayd.pub").read())
    assert report.ok, report
"""
from .canonical import canonical, python_canonical, sha256_id
from .client import DEFAULT_SOCKET, TERMINAL_STATES, AssayError, Client, Job
from .verify import Check, VerifyReport, public_key_raw, verify_kiln_hash, verify_result

__all__ = ["Client", "Job", "AssayError", "DEFAULT_SOCKET", "TERMINAL_STATES", "Check",
           "VerifyReport", "verify_result", "verify_kiln_hash", "public_key_raw", "canonical",
           "python_canonical", "sha256_id"]
__version__ = "0.1.0"
