"""Offline checks of assay's signed records, the same checks ``assay verify`` runs
(client/verify.cpp) and under the same names:

  result.json, result.schema   the document parses and is a result kind assay signs
  result.canonical             its bytes are its RFC 8785 canonical form (as assayd wrote it)
  result_sha256                the sha256 of the canonical form without that field
  key_id                       supervisor.key_id is the sha256 of the given public key
  envelope.payload_type        the DSSE envelope carries an in-toto statement
  signature                    an Ed25519 signature over DSSE's PAE verifies with the key
  statement.type               the statement's _type and predicateType for the result's kind
  subject.result               a subject has the result file's sha256
  subject.artifact             a subject has the artifact's sha256 as the result names it
  artifact.file                (with an artifact) its sha256 and size are the result's

``verify_kiln_hash`` checks a record Kiln wrote the way Kiln hashes it (``kiln.result_sha256``,
in Kiln's canonical form); ``assay verify --kiln`` applies Kiln's further rules.
"""
import base64
import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from .canonical import canonical, python_canonical, sha256_id

__all__ = ["Check", "VerifyReport", "verify_result", "verify_kiln_hash", "public_key_raw",
           "KINDS"]

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
IN_TOTO_STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
# schema: (predicateType, the key of the result's artifact)
KINDS = {
    "assay.next-token-oracle-result.v1": ("https://assay.dev/next-token-oracle/v1",
                                          "reference_artifact"),
    "assay.fidelity-result.v1": ("https://assay.dev/fidelity/v1", "kl_artifact"),
    "assay.trajectory-result.v1": ("https://assay.dev/trajectory/v1", "trajectory_artifact"),
    "assay.next-token-batch-result.v1": ("https://assay.dev/next-token-batch/v1",
                                         "states_artifact"),
    "assay.layer-attribution-result.v1": ("https://assay.dev/layer-attribution/v1",
                                          "layers_artifact"),
    "assay.engine-audit-result.v1": ("https://assay.dev/engine-audit/v1", "audit_artifact"),
}
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class VerifyReport:
    checks: List[Check] = field(default_factory=list)
    key_source: Optional[str] = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def failed(self) -> List[str]:
        return [c.name for c in self.checks if not c.ok]

    def check(self, name: str) -> Optional[Check]:
        return next((c for c in self.checks if c.name == name), None)

    def add(self, name: str, ok: bool, detail: str):
        self.checks.append(Check(name, bool(ok), detail))

    def to_json(self) -> dict:
        out = {"ok": self.ok, "checks": [c.__dict__ for c in self.checks]}
        if self.key_source:
            out["key_source"] = self.key_source
        return out

    def __str__(self):
        lines = [("VERIFIED" if self.ok else "NOT VERIFIED")]
        lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)


def public_key_raw(key) -> bytes:
    """The raw 32-byte Ed25519 key from PEM (text or bytes), DER SubjectPublicKeyInfo or raw."""
    if isinstance(key, str):
        key = key.encode("ascii")
    if len(key) == 32:
        return bytes(key)
    if key.lstrip().startswith(b"-----BEGIN"):
        lines = [l.strip() for l in key.strip().splitlines()]
        if not lines[0].startswith(b"-----BEGIN PUBLIC KEY") or \
                not lines[-1].startswith(b"-----END PUBLIC KEY"):
            raise ValueError("not a PEM PUBLIC KEY block")
        key = base64.b64decode(b"".join(lines[1:-1]), validate=True)
    if len(key) == 44 and key.startswith(_ED25519_SPKI_PREFIX):
        return key[len(_ED25519_SPKI_PREFIX):]
    raise ValueError("not an Ed25519 public key (PEM, DER SubjectPublicKeyInfo or 32 raw bytes)")


def _pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _ed25519_verify(raw_key: bytes, signature: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    try:
        Ed25519PublicKey.from_public_bytes(raw_key).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


def _get(doc, *path):
    for k in path:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


def verify_result(result, envelope=None, public_key=None, artifact=None) -> VerifyReport:
    """Checks a sealed result (its file's bytes, or a path), its DSSE envelope (a dict, the
    envelope file's bytes or a path), with an Ed25519 public key and optionally the artifact (its
    bytes or a path). Never raises for what the documents hold: every finding is a check."""
    from pathlib import Path
    r = VerifyReport()
    if isinstance(result, (str, Path)):
        result = Path(result).read_bytes()
    if isinstance(envelope, (str, Path)):
        envelope = Path(envelope).read_bytes()
    if isinstance(artifact, (str, Path)):
        artifact = Path(artifact).read_bytes()
    file_hex = hashlib.sha256(result).hexdigest()

    doc = None
    try:
        doc = json.loads(result.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        r.add("result.json", False, f"not JSON: {e}")
    if doc is not None and not isinstance(doc, dict):
        r.add("result.json", False, "not a JSON object")
        doc = None
    kind = None
    if doc is not None:
        schema = doc.get("schema")
        kind = KINDS.get(schema) if isinstance(schema, str) else None
        r.add("result.schema", kind is not None,
              f"schema {json.dumps(schema)}" + ("" if kind else ", not a result kind assay signs"))
        try:
            canon = canonical(doc).encode("utf-8")
            r.add("result.canonical", canon == result,
                  "file bytes are the RFC 8785 canonical form" if canon == result else
                  f"file bytes differ from the canonical form ({len(result)} vs {len(canon)} "
                  "bytes)")
            body = dict(doc)
            body.pop("result_sha256", None)
            recomputed = sha256_id(canonical(body))
        except (ValueError, TypeError) as e:
            recomputed = f"(not computable: {e})"
            r.add("result.canonical", False, recomputed)
        claimed = doc.get("result_sha256")
        r.add("result_sha256", claimed == recomputed,
              recomputed if claimed == recomputed else
              f"claimed {claimed}, recomputed {recomputed}" if isinstance(claimed, str) else
              f"result has no result_sha256 string (recomputed {recomputed})")

    raw = None
    if public_key is not None:
        try:
            raw = public_key_raw(public_key)
        except ValueError as e:
            r.add("public_key", False, f"cannot read the public key: {e}")
    key_id = sha256_id(raw) if raw else None
    if doc is not None and key_id:
        claimed = _get(doc, "supervisor", "key_id")
        r.add("key_id", claimed == key_id,
              key_id if claimed == key_id else
              f"result names key {claimed}, the given public key is {key_id}")

    statement = None
    if envelope is None:
        r.add("signature", False, "no envelope given")
    else:
        try:
            env = envelope if isinstance(envelope, dict) else json.loads(envelope)
            ptype = env.get("payloadType")
            r.add("envelope.payload_type", ptype == IN_TOTO_PAYLOAD_TYPE,
                  f"payloadType {json.dumps(ptype)}")
            payload = base64.b64decode(env["payload"], validate=True)
            good = []
            for i, s in enumerate(env.get("signatures") or []):
                sig = base64.b64decode(s.get("sig", ""), validate=True)
                if raw and isinstance(ptype, str) and _ed25519_verify(raw, sig, _pae(ptype, payload)):
                    good.append(f"signatures[{i}] verifies with key {key_id}")
            if raw is None:
                r.add("signature", False, "no usable public key")
            elif good:
                r.add("signature", True, "Ed25519 DSSE: " + "; ".join(good))
                statement = json.loads(payload)
            else:
                r.add("signature", False, f"no signature verifies with key {key_id}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            r.add("signature", False, f"the envelope is malformed: {e}")

    if isinstance(statement, dict):
        want = kind[0] if kind else None
        r.add("statement.type",
              statement.get("_type") == IN_TOTO_STATEMENT_TYPE and
              statement.get("predicateType") == want,
              f"_type {statement.get('_type')}, predicateType {statement.get('predicateType')}")
        subjects = [(s.get("name", ""), _get(s, "digest", "sha256") or "")
                    for s in statement.get("subject") or [] if isinstance(s, dict)]
        named = next((n for n, h in subjects if h == file_hex), None)
        r.add("subject.result", named is not None,
              f'subject "{named}" is sha256 {file_hex}' if named is not None else
              f"no subject has the result file's sha256 {file_hex}")
        if doc is not None and kind:
            art = _get(doc, kind[1], "sha256")
            art_hex = art[len("sha256:"):] if isinstance(art, str) and art.startswith("sha256:") \
                else None
            named = next((n for n, h in subjects if art_hex and h == art_hex), None)
            r.add("subject.artifact", named is not None,
                  f"result has no {kind[1]}.sha256" if art is None else
                  f'subject "{named}" is the result\'s {kind[1]} {art}' if named is not None else
                  f"no subject has the result's {kind[1]} sha256 {art}")

    if artifact is not None:
        key = kind[1] if kind else "reference_artifact"
        art = _get(doc, key, "sha256") if doc is not None else None
        size = _get(doc, key, "bytes") if doc is not None else None
        got = sha256_id(artifact)
        ok = art == got and size == len(artifact) and not isinstance(size, bool)
        r.add("artifact.file", ok, f"{got}, {len(artifact)} bytes; result names {art}, {size} "
                                   "bytes")
    return r


def verify_kiln_hash(record) -> VerifyReport:
    """A Kiln record's self-hash, in Kiln's canonical form (a dict, its bytes or a path)."""
    from pathlib import Path
    r = VerifyReport()
    try:
        if isinstance(record, (str, Path)):
            record = Path(record).read_bytes()
        doc = record if isinstance(record, dict) else json.loads(record)
    except (OSError, ValueError) as e:
        r.add("kiln.json", False, str(e))
        return r
    if not isinstance(doc, dict):
        r.add("kiln.json", False, "not a JSON object")
        return r
    body = {k: v for k, v in doc.items() if k != "result_sha256"}
    try:
        recomputed = sha256_id(python_canonical(body))
    except ValueError as e:
        recomputed = f"(not computable: {e})"
    claimed = doc.get("result_sha256")
    r.add("kiln.result_sha256", claimed == recomputed,
          f"{recomputed} (Kiln's canonical form)" if claimed == recomputed else
          f"claimed {claimed}, recomputed {recomputed} in Kiln's canonical form")
    return r


def main(argv=None):
    """assay-py-verify RESULT [--envelope FILE] --pubkey PEM [--artifact FILE] [--kiln] [--json]"""
    import argparse
    p = argparse.ArgumentParser(prog="assay-py-verify",
                                description="Check an assay result (or, with --kiln, a Kiln "
                                            "record's self-hash) offline.")
    p.add_argument("record")
    p.add_argument("--envelope", help="the DSSE envelope (default: RECORD's stem + .dsse.json)")
    p.add_argument("--pubkey", help="assayd's Ed25519 public key (PEM)")
    p.add_argument("--artifact", help="the result's artifact file")
    p.add_argument("--kiln", action="store_true", help="RECORD is a Kiln record")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    from pathlib import Path
    try:
        if a.kiln:
            report = verify_kiln_hash(a.record)
        else:
            env = Path(a.envelope) if a.envelope else \
                Path(a.record).with_name(Path(a.record).stem + ".dsse.json")
            report = verify_result(Path(a.record), envelope=env if env.exists() else None,
                                   public_key=Path(a.pubkey).read_bytes() if a.pubkey else None,
                                   artifact=Path(a.artifact) if a.artifact else None)
    except OSError as e:
        print(f"assay-py-verify: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if a.json else report)
    return 0 if report.ok else 6


if __name__ == "__main__":
    sys.exit(main())
