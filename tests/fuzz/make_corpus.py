#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) and the documents
fuzz_worker_output runs its jobs with (tests/fuzz/worker_output/), from the tree's fixtures:
Kiln's real request, receipts and records (tests/client/fixtures/), assay's result records
(tests/client/fixtures/report/), the model configs of tests/fixtures/arch_*.py, the Qwen3 tokenizer
(tests/fixtures/qwen3-tokenizer/), and the request shapes of the unit tests. Fixtures are copied,
never edited; a derived seed (a DSSE envelope, a shrunk tokenizer, a worker's output rebuilt from a
result) says so in its name. Run with the pinned Python (the arch fixtures import torch):

    /opt/assay/venv/bin/python tests/fuzz/make_corpus.py

It replaces every seed it writes and leaves other files alone. Ed25519 signing uses the openssl
command; each run makes a new key, so the DSSE seeds change every run (they carry their key).
"""

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/client/fixtures"
CORPUS = ROOT / "tests/fuzz/corpus"
WORKER_OUTPUT = ROOT / "tests/fuzz/worker_output"
SEPARATOR = b"\n--assay-fuzz-part--\n"  # tests/fuzz/fuzz.h kPartSeparator

sys.path.insert(0, str(ROOT / "tests/fixtures"))


# ---- canonical forms and digests, as common/json.h and common/identity.h define them: the
# Python client's (clients/python/assay_client/canonical.py), one implementation for both.

sys.path.insert(0, str(ROOT / "clients/python"))
from assay_client.canonical import canonical, es_number, python_canonical, sha256_id  # noqa: E402,F401


def token_ids_sha256(ids) -> str:
    return sha256_id(python_canonical(ids))


def model_content_sha256(identity) -> str:
    keys = ("id", "config_hash", "tokenizer_hash", "chat_template_hash", "weight_files")
    return sha256_id(python_canonical({k: identity[k] for k in keys}))


def load(path):
    return json.loads(Path(path).read_text())


# ---- writing


def target_dir(target: str) -> Path:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    return d


def seed(target: str, name: str, data) -> None:
    if isinstance(data, str):
        data = data.encode()
    elif not isinstance(data, bytes):
        data = (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode()
    (target_dir(target) / name).write_bytes(data)


def copy(target: str, path: Path, name: str = "") -> None:
    shutil.copyfile(path, target_dir(target) / (name or path.name))


def parts(*docs) -> bytes:
    out = []
    for d in docs:
        if isinstance(d, str):
            d = d.encode()
        elif not isinstance(d, bytes):
            d = (json.dumps(d, indent=1, ensure_ascii=False)).encode()
        out.append(d)
    return SEPARATOR.join(out)


def safetensors(tensors, metadata=None) -> bytes:
    """[(name, dtype, shape, raw bytes)] as common::serialize_safetensors lays them out."""
    header, offset, data = {}, 0, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# ---- Ed25519 with the openssl command


class Key:
    def __init__(self, tmp: Path):
        self.pem = tmp / "key.pem"
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", self.pem], check=True)
        self.public_pem = subprocess.run(["openssl", "pkey", "-in", self.pem, "-pubout"], check=True,
                                         capture_output=True).stdout
        der = subprocess.run(["openssl", "pkey", "-in", self.pem, "-pubout", "-outform", "DER"],
                             check=True, capture_output=True).stdout
        self.raw = der[-32:]
        self.key_id = sha256_id(self.raw)
        self.tmp = tmp

    def sign(self, message: bytes) -> bytes:
        (self.tmp / "message").write_bytes(message)
        return subprocess.run(["openssl", "pkeyutl", "-sign", "-inkey", self.pem, "-rawin", "-in",
                               self.tmp / "message"], check=True, capture_output=True).stdout

    def envelope(self, payload: bytes, payload_type="application/vnd.in-toto+json") -> dict:
        pae = b"DSSEv1 %d %s %d %s" % (len(payload_type), payload_type.encode(), len(payload), payload)
        return {"payload": base64.b64encode(payload).decode(), "payloadType": payload_type,
                "signatures": [{"keyid": self.key_id,
                                "sig": base64.b64encode(self.sign(pae)).decode()}]}


# ---- the documents of the tree


KILN_REQUEST = FIXTURES / "kiln-request-v1.json"
RECEIPTS = sorted((FIXTURES / "kiln/receipts").glob("*.json"))
RECORDS = sorted((FIXTURES / "kiln").glob("*.json"))
RESULT = FIXTURES / "report/result.json"
FIDELITY_RESULT = FIXTURES / "report/fidelity-result.json"


def identity(name="fixture"):
    mi = {"id": name, "config_hash": "sha256:" + "a" * 64, "tokenizer_hash": "sha256:" + "b" * 64,
          "chat_template_hash": None,
          "weight_files": [{"path": "model.safetensors", "bytes": 10,
                            "sha256": "sha256:" + "c" * 64}]}
    mi["content_sha256"] = model_content_sha256(mi)
    return mi


# tests/supervisor/request_test.cpp assay_request(), and the demo's (scripts/demo).
ASSAY_REQUEST = {"schema": "assay.next-token-request.v1", "id": "r1", "model_dir": "/models/tiny",
                 "input_token_ids": [72, 101, 108],
                 "candidates": [{"engine": "kiln", "token_id": 65, "text": "A"},
                                {"engine": "vllm", "token_id": 66, "text": "B"}]}


def kiln_request_small():
    """tests/supervisor/request_test.cpp kiln_request(): the shape of Kiln's request, shrunk."""
    message = "Write a paragraph."
    receipt = {"path": "receipts/run.kiln.json", "file_sha256": "sha256:" + "d" * 64,
               "content_sha256": "sha256:" + "e" * 64}
    return {"schema": "kiln.hf-next-token-request.v1", "id": "k1",
            "source": {"source_commit": "f" * 40, "kiln_receipt": receipt, "vllm_receipt": receipt},
            "model_identity": identity(),
            "prompt": {"generator": {"run_id": "run-1", "phase": "measure-c001-r000",
                                     "request_index": 0, "profile": "short",
                                     "template_version": "fixed-serving-profiles-v1"},
                       "messages": [{"role": "user", "content": message}],
                       "add_generation_prompt": True, "template_kwargs": {"enable_thinking": False},
                       "utf8_sha256": sha256_id(message), "token_count": 3, "token_ids": [1, 2, 3]},
            "continuation_prefix": [{"token_id": 4, "text": "To"}],
            "input_token_ids": [1, 2, 3, 4], "input_token_ids_sha256": token_ids_sha256([1, 2, 3, 4]),
            "candidates": [{"engine": "kiln", "token_id": 5, "text": "x"},
                           {"engine": "vllm", "token_id": 6, "text": "y"}]}


def fidelity_request():
    """tests/unit/fidelity_test.cpp valid()."""
    return {"schema": "assay.fidelity-request.v1", "id": "q4",
            "reference": {"model_dir": "/models/ref/"},
            "candidate": {"logits": [{"path": "/data/a.safetensors", "sha256": "sha256:" + "a" * 64},
                                     {"path": "/data/b.safetensors", "sha256": "sha256:" + "b" * 64}]},
            "panel": {"contexts": [{"id": "a", "token_ids": [1, 2, 3, 4]},
                                   {"token_ids": [5, 6, 7, 8, 9], "positions": [[0, 2], [3, 5]]}]}}


def trajectory_request(model_dir="/models/tiny"):
    return {"schema": "assay.trajectory-request.v1", "id": "traj", "model_dir": model_dir,
            "prompt_token_ids": [1, 2, 3, 4, 5, 6],
            "continuations": [{"engine": "kiln", "token_ids": [7, 8, 9]},
                              {"engine": "vllm", "token_ids": [7, 10]}],
            "block_positions": 16}


def layer_request(model_dir="/models/tiny"):
    return {"schema": "assay.layer-attribution-request.v1", "id": "layers", "model_dir": model_dir,
            "input_token_ids": [1, 2, 3, 4],
            "engine": {"name": "kiln",
                       "rows_file": {"path": "/data/kiln-rows.safetensors",
                                     "sha256": "sha256:" + "e" * 64},
                       "next_token_id": 5},
            "rows": "all", "patching": True, "tolerance": {"relative_rmse": 0.01}}


def audit_request(model_dir="/models/tiny"):
    return {"schema": "assay.engine-audit-request.v1", "id": "audit", "model_dir": model_dir,
            "engine": {"name": "kiln",
                       "logits": [{"path": "/data/c%d.safetensors" % i,
                                   "sha256": "sha256:" + "%x" % (10 + i) * 64} for i in range(2)]},
            "panel": {"contexts": [{"id": "a", "token_ids": [1, 2, 3]},
                                   {"token_ids": [4, 5, 6, 7]}]},
            "audit": {"reduction_seeds": 4, "sdpa": False, "alpha": 0.05},
            "limits": {"timeout_seconds": 600}}


def boundaries(layers: int, linear=()):
    names = ["embedding"]
    for i in range(layers):
        p = "layers.%d" % i
        names += [p + ".input_layernorm", p + (".linear_attn" if i in linear else ".self_attn"),
                  p + ".post_attention_layernorm", p + ".mlp", p]
    return names + ["norm"]


# ---- the corpora


def json_targets():
    for target in ("json", "python_canonical"):
        copy(target, KILN_REQUEST)
        for r in RECEIPTS[:1] + RECORDS[:1]:
            copy(target, r)
        seed(target, "floats.json", '{"a":300.0,"b":1e-05,"c":1e+16,"d":-0.0,"e":"\\u00e9\\ud83d\\ude00"}')


def safetensors_target():
    for name in ("logits.safetensors", "kl.safetensors"):
        copy("safetensors", FIXTURES / "report" / name)


def request_targets():
    copy("next_token_request", KILN_REQUEST)
    seed("next_token_request", "assay-request.json", ASSAY_REQUEST)
    full = dict(ASSAY_REQUEST, model_identity=identity(),
                input_token_ids_sha256=token_ids_sha256(ASSAY_REQUEST["input_token_ids"]),
                limits={"timeout_seconds": 60, "memory_bytes": 1 << 30, "memory_events": "reject"},
                oracle={"backend": "both"})
    seed("next_token_request", "assay-request-full.json", full)
    seed("next_token_request", "kiln-request-small.json", kiln_request_small())

    seed("fidelity_request", "logits-candidate.json", fidelity_request())
    demo = {"schema": "assay.fidelity-request.v1", "id": "demo-q4",
            "reference": {"model_dir": "/models/demo", "model_identity": identity("demo")},
            "candidate": {"model_dir": "/models/demo-q4", "label": "q4"},
            "panel": {"contexts": [{"id": "hello", "token_ids": list(range(1, 34))},
                                   {"id": "lorem", "token_ids": list(range(40, 79)),
                                    "positions": [[8, 39]]}]},
            "reproduction_confirmation": True, "block_positions": 64,
            "thresholds": {"max_mean_kl": 0.05, "min_top1_agreement": 0.6, "max_kl_p99": 1.5},
            "limits": {"timeout_seconds": 600}}
    seed("fidelity_request", "model-candidate.json", demo)

    seed("trajectory_request", "trajectory.json", trajectory_request())
    t = trajectory_request()
    t["model_identity"] = identity()
    t["continuations"].append({"engine": "sglang", "token_ids": [7, 8, 11, 12]})
    seed("trajectory_request", "trajectory-three.json", t)

    seed("layer_request", "patching.json", layer_request())
    last = layer_request()
    del last["patching"], last["engine"]["next_token_id"]
    last["rows"] = "last"
    last["model_identity"] = identity()
    seed("layer_request", "last.json", last)

    seed("audit_request", "audit.json", audit_request())
    plain = audit_request()
    del plain["audit"], plain["limits"], plain["panel"]["contexts"][0]["id"]
    plain["model_identity"] = identity()
    seed("audit_request", "defaults.json", plain)

    a, b = dict(ASSAY_REQUEST, id="a"), dict(ASSAY_REQUEST, id="b")
    del a["model_dir"], b["model_dir"]
    seed("batch_request", "two-states.json",
         {"schema": "assay.next-token-batch-request.v1", "id": "sweep", "model_dir": "/models/tiny",
          "limits": {"timeout_seconds": 60}, "states": [a, b]})
    seed("batch_request", "kiln-state.json",
         {"schema": "assay.next-token-batch-request.v1", "id": "kiln", "states": [load(KILN_REQUEST)]})

    lines = [json.dumps(a), "", json.dumps(b), json.dumps(kiln_request_small())]
    seed("batch_jsonl", "requests.jsonl", "\n".join(lines) + "\n")
    seed("batch_jsonl", "kiln.jsonl", json.dumps(load(KILN_REQUEST)) + "\n")


def layer_rows_target():
    # fuzz_layer_rows checks against a 2-layer model, layer 0 linear attention, hidden 8, 3 ids.
    names = boundaries(2, linear=(0,))
    f32 = lambda n: struct.pack("<%df" % n, *[0.5] * n)
    seed("layer_rows", "last.safetensors",
         safetensors([(n, "F32", [8], f32(8)) for n in names[:3]],
                     {"input_token_ids_sha256": token_ids_sha256([1, 2, 3])}))
    seed("layer_rows", "all.safetensors",
         safetensors([(n, "BF16", [3, 8], b"\x00\x3f" * 24) for n in names],
                     {"model_content_sha256": "sha256:" + "b" * 64}))


def receipt_targets():
    for r in RECEIPTS:
        copy("kiln_receipt", r)


def schema_target():
    copy("json_schema", KILN_REQUEST)
    for r in RECORDS:
        copy("json_schema", r)


def base64_target():
    receipt = load(RECEIPTS[0])
    exact = receipt["runs"][0]["output_evidence"][0]["exact_output"]
    seed("base64", "content.b64", exact["content_base64"])
    seed("base64", "padded.b64", "QUI=")
    seed("base64", "padded2.b64", "QQ==")


def signed_targets(key: Key):
    result = load(RESULT)
    result["supervisor"]["key_id"] = key.key_id
    del result["result_sha256"]
    result["result_sha256"] = sha256_id(canonical(result))
    result_bytes = canonical(result).encode()
    artifact = result["reference_artifact"]["sha256"]
    statement = {"_type": "https://in-toto.io/Statement/v1",
                 "subject": [{"name": "result.json", "digest": {"sha256": sha256_id(result_bytes)[7:]}},
                             {"name": "logits.safetensors", "digest": {"sha256": artifact[7:]}}],
                 "predicateType": "https://assay.dev/next-token-oracle/v1",
                 "predicate": {"result_sha256": result["result_sha256"]}}
    envelope = key.envelope(canonical(statement).encode())
    envelope_bytes = canonical(envelope).encode()
    seed("verify_result", "result-signed-raw-key", parts(result_bytes, envelope_bytes, key.raw))
    seed("verify_result", "result-signed-pem-key", parts(result_bytes, envelope_bytes, key.public_pem))
    copy("verify_result", RESULT, "result-unsigned.json")
    copy("verify_result", FIDELITY_RESULT, "fidelity-result-unsigned.json")
    seed("dsse", "statement-raw-key", parts(key.raw, envelope_bytes))
    seed("dsse", "statement-pem-key", parts(key.public_pem, envelope_bytes))
    two = key.envelope(b'{"a":1}', "application/json")
    two["signatures"].append({"sig": two["signatures"][0]["sig"]})
    seed("dsse", "two-signatures", parts(key.raw, canonical(two).encode()))


def kiln_record_target():
    for r in RECORDS:
        copy("kiln_record", r)
    # The next-token record made self-consistent for a 16-token vocabulary with its artifact: the
    # logits, their digests, the top tokens and candidates recomputed, and result_sha256 resealed.
    record = load(next(r for r in RECORDS if "next-token" in r.name))
    logits = [0.25 * ((7 * i) % 16) - 1.0 for i in range(16)]
    ids = [3, 1, 4, 1, 5]
    raw = struct.pack("<16f", *logits)
    artifact = safetensors([("input_ids", "I64", [5], struct.pack("<5q", *ids)),
                            ("logits", "F32", [16], raw)])
    order = sorted(range(16), key=lambda i: (-logits[i], i))
    oracle = record["oracle"]
    oracle.update(vocab=16, argmax=order[0], logits_sha256=sha256_id(raw),
                  input_token_ids_sha256=token_ids_sha256(ids), output_bytes=len(artifact),
                  top_logit_margin=logits[order[0]] - logits[order[1]],
                  top_tokens=[{"token_id": i, "logit": logits[i]} for i in order[:10]])
    for c, token in zip(oracle.get("candidate_tokens", []), (order[0], order[3])):
        c.update(token_id=token, logit=logits[token], rank=1 + sum(x > logits[token] for x in logits))
    if "reference_artifact" in record:
        record["reference_artifact"].update(sha256=sha256_id(artifact), bytes=len(artifact))
    record.pop("result_sha256", None)
    record["result_sha256"] = sha256_id(python_canonical(record))
    seed("kiln_record", "next-token-with-artifact", parts(json.dumps(record, indent=2), artifact))


def tokenizer_target():
    # The Qwen3 tokenizer shrunk to its first 400 tokens and its added tokens: the same model and
    # decoder sections, so the oracle's reader takes the same path.
    root = ROOT / "tests/fixtures/qwen3-tokenizer"
    doc = load(root / "tokenizer.json")
    vocab = dict(sorted(doc["model"]["vocab"].items(), key=lambda kv: kv[1])[:400])
    small = {"version": doc.get("version"), "added_tokens": doc["added_tokens"][:8],
             "normalizer": doc.get("normalizer"), "pre_tokenizer": doc.get("pre_tokenizer"),
             "post_processor": doc.get("post_processor"), "decoder": doc["decoder"],
             "model": dict(doc["model"], vocab=vocab, merges=doc["model"]["merges"][:50])}
    config = load(root / "tokenizer_config.json")
    config.pop("chat_template", None)
    seed("tokenizer", "qwen3-shrunk", parts(json.dumps(small, ensure_ascii=False),
                                            json.dumps(config)))
    seed("tokenizer", "qwen3-shrunk-alone.json", small)


def model_config_target():
    import arch_llama, arch_qwen2, arch_qwen3, arch_qwen3_5, arch_spark2_5  # noqa: E401
    for name, arch in (("llama", arch_llama), ("qwen2", arch_qwen2), ("qwen3", arch_qwen3),
                       ("qwen3_5", arch_qwen3_5), ("spark2_5", arch_spark2_5)):
        config = arch.make_config("tiny")
        config.update(arch_llama.sizes("tiny")) if name == "llama" else None
        seed("model_config", name + ".json", config)
    seed("model_config", "qwen3_5-flat.json", arch_qwen3_5.flat_config(arch_qwen3_5.make_config("tiny")))


def http_target():
    # As client/api.cpp make_request writes them (Host, User-Agent, Connection: close).
    def request(method, target, body=b"", extra=b"", close=True):
        head = b"%s %s HTTP/1.1\r\nHost: localhost\r\nUser-Agent: assay-client\r\n" % (
            method.encode(), target.encode())
        if close:
            head += b"Connection: close\r\n"
        if body or method == "POST":
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        return head + extra + b"\r\n" + body

    body = canonical(ASSAY_REQUEST).encode()
    seed("http_request", "health", request("GET", "/v1/health"))
    seed("http_request", "submit", request("POST", "/v1/jobs?model_dir=%2Fmodels%2Ftiny", body))
    seed("http_request", "submit-kiln",
         request("POST", "/v1/jobs?model_dir=/models/q&receipts_dir=/r", KILN_REQUEST.read_bytes()))
    seed("http_request", "list", request("GET", "/v1/jobs?state=queued"))
    seed("http_request", "events", request("GET", "/v1/jobs/j-0123456789abcdef01234567/events"))
    seed("http_request", "cancel", request("DELETE", "/v1/jobs/j-0123456789abcdef01234567"))
    seed("http_request", "head-result", request("HEAD", "/v1/jobs/j-0123456789abcdef01234567/result"))
    chunked = (b"POST /v1/jobs HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    seed("http_request", "submit-chunked", chunked)
    seed("http_request", "keep-alive",
         request("GET", "/v1/info", close=False) + request("GET", "/metrics", close=False) +
         request("POST", "/v1/fingerprint-cache/refresh?model_dir=/models/tiny"))


# ---- fuzz_worker_output: a job of each kind with its workers' outputs


def fingerprint_output(identity, files):
    return {"schema": "assay.fingerprint-output.v1", "model_dir": "/models/demo",
            "model_identity": identity,
            "stats": {"bytes": sum(f["size"] for f in files), "files": len(files), "seconds": 0.01,
                      "mib_per_second": 20.0, "threads": 2, "max_read_mib_per_second": None},
            "files": [dict(f, source="computed", job=None, at=None) for f in files],
            "cacheable": [], "implementation_sha256": "sha256:" + "1" * 64}


def oracle_configuration():
    return load(RESULT)["oracle"]["configuration"]


def with_configuration(doc):
    doc["configuration"] = oracle_configuration()
    doc["configuration_sha256"] = sha256_id(canonical(doc["configuration"]))
    return doc


# What a report leaves out of the oracle's output.json and its schema requires: the execution
# fields below, so that every seed is valid against its schema (assayd checks each worker's
# output against it before a step reads it: an invalid seed would never reach the steps).
# No libraries: the supervisor would hash each named file on every execution.
LIBRARIES = []


def with_execution(doc, runtime):
    doc = dict(doc)
    for k, v in {"deterministic_algorithms": True, "tf32_allowed": False,
                 "executable_sha256": "sha256:" + "3" * 64, "load_seconds": 0.1,
                 "forward_seconds": 0.2, "duration_seconds": 0.4, "runtime": runtime,
                 "loaded_libraries": LIBRARIES}.items():
        doc.setdefault(k, v)
    return doc


def bytes_used(identity, tokenizer=True):
    return {"weight_files": identity["weight_files"], "config_hash": identity["config_hash"],
            "tokenizer_hash": identity["tokenizer_hash"] if tokenizer else None}


def worker_output_target():
    WORKER_OUTPUT.mkdir(parents=True, exist_ok=True)
    import arch_llama  # the demo's model: the tiny llama (vocab 272) of scripts/demo
    config = arch_llama.make_config("tiny")
    config.update(arch_llama.sizes("tiny"))
    (WORKER_OUTPUT / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    artifact = sha256_id(b"artifact")  # fuzz_worker_output.cpp kArtifactBytes

    def write_request(kind, doc):
        (WORKER_OUTPUT / (kind + ".request.json")).write_text(json.dumps(doc, indent=1) + "\n")

    def job(kind, outputs, name="seed"):
        seed("worker_output", kind + "-" + name, parts(kind, *outputs))

    # next-token: the demo's result (report/result.json) taken apart into its workers' outputs.
    result = load(RESULT)
    mi = result["model_identity"]
    fingerprint = fingerprint_output(mi, result["model_fingerprint"]["files"])
    oracle = {k: v for k, v in result["oracle"].items() if k != "process"}
    runtime = oracle["runtime"]
    oracle = with_execution(oracle, runtime)
    request = {"schema": "assay.next-token-request.v1", "id": "demo-dispute-1", "model_dir": "MODEL_DIR",
               "input_token_ids": [9, 8, 7, 6, 5, 4, 3, 2, 1, 10],
               "candidates": [{"engine": c["engine"], "token_id": c["token_id"], "text": c["text"]}
                              for c in oracle["candidate_tokens"]]}
    write_request("next-token", request)
    job("next-token", [fingerprint, oracle])
    write_request("next-token-both", dict(request, oracle={"backend": "both"}))
    job("next-token-both", [fingerprint, oracle, dict(oracle, backend="transformers")])

    # next-token with the numerics envelope: the assay-hf-worker envelope run's output, its
    # members a bf16 step around the oracle's figures.
    spec = {"reduction_seeds": 2, "batch_sizes": [2], "sdpa": True, "kv_cache": True, "fp32": True}
    write_request("next-token-numerics", dict(request, numerics=spec))

    def envelope_member(name, shift):
        cands = [{"token_id": c["token_id"], "logit": c["logit"] + (shift if c["is_argmax"] else 0),
                  "rank": c["rank"]} for c in oracle["candidate_tokens"]]
        top = [{"token_id": t["token_id"], "logit": t["logit"] + (shift if i == 0 else 0)}
               for i, t in enumerate(oracle["top_tokens"][:5])]
        return {"name": name, "argmax": oracle["argmax"], "argmax_logit": top[0]["logit"],
                "top_tie": False, "margin": oracle["top_logit_margin"] + shift, "top": top,
                "candidates": cands,
                "logits_sha256": oracle["logits_sha256"] if name == "reference" else sha256_id(name)}
    names = ["reference", "reduction:0", "reduction:1", "sdpa", "kv-cache", "batched:2"]
    envelope = {"schema": "assay.numerics-output.v1", "bytes_used": bytes_used(mi, tokenizer=False),
                "member_names": names,
                "states": [{"index": 0,
                            "members": [envelope_member(n, (i % 3 - 1) * 0.0078125)
                                        for i, n in enumerate(names)],
                            "fp32": dict(envelope_member("fp32", 0.0013), name="fp32")}],
                "numerics_module_sha256": sha256_id("assay_numerics.py"), "threads": 2,
                "load_seconds": 0.1, "forward_seconds": 0.4}
    job("next-token-numerics", [fingerprint, oracle, envelope])
    differs = json.loads(json.dumps(envelope))
    differs["states"][0]["members"][0]["logits_sha256"] = sha256_id("transformers")
    job("next-token-numerics", [fingerprint, oracle, differs], "reference-differs")

    # Kiln's real request: its identity, a prompt check that matches, an oracle output as Kiln's
    # real record reports it.
    kiln = load(KILN_REQUEST)
    write_request("kiln-next-token", kiln)
    kmi = kiln["model_identity"]
    files = [{"name": w["path"], "dev": "65024", "ino": str(100 + i), "size": w["bytes"],
              "mtime_ns": "1796171699353207746", "ctime_ns": "1796171699353207746",
              "sha256": w["sha256"]} for i, w in enumerate(kmi["weight_files"])]
    prompt = {"schema": "assay.prompt-check-output.v1", "transformers_version": "5.13.1",
              "tokenizers_version": "0.22.1", "tokenizer_class": "Qwen2TokenizerFast",
              "files": {"tokenizer.json": {"sha256": kmi["tokenizer_hash"], "bytes": 1000}},
              "chat_template_sha256": kmi["chat_template_hash"],
              "rendered_text_sha256": sha256_id("rendered"), "rendered_utf8_bytes": 8,
              "token_count": kiln["prompt"]["token_count"],
              "token_ids_sha256": token_ids_sha256(kiln["prompt"]["token_ids"]), "match": True,
              "first_difference": None, "duration_seconds": 1.5}
    record = load(next(r for r in RECORDS if "next-token" in r.name))
    kargmax = record["oracle"]["argmax"]
    koracle = with_configuration(dict(oracle, bytes_used=bytes_used(kmi), argmax=kargmax,
                                      candidate_tokens=[dict(c, is_argmax=c["token_id"] == kargmax)
                                                        for c in record["oracle"]["candidate_tokens"]]))
    job("kiln-next-token", [fingerprint_output(kmi, files), prompt, koracle])
    mismatch = dict(prompt, match=False, first_difference={
        "index": 3, "request_id": 5, "rendered_id": 6, "request_text": "a", "rendered_text": "b"})
    job("kiln-next-token", [fingerprint_output(kmi, files), mismatch, koracle], "prompt-mismatch")

    # fidelity: the demo's receipt (report/fidelity-result.json) taken apart.
    fr = load(FIDELITY_RESULT)
    write_request("fidelity", {
        "schema": "assay.fidelity-request.v1", "id": "demo-q4",
        "reference": {"model_dir": "MODEL_DIR"},
        "candidate": {"model_dir": "CANDIDATE_DIR", "label": "q4"},
        "panel": {"contexts": [{"id": "hello", "token_ids": list(range(1, 34))},
                               {"id": "lorem", "token_ids": list(range(40, 79)),
                                "positions": [[8, 39]]}]},
        "reproduction_confirmation": True,
        "thresholds": {"max_mean_kl": 0.05, "min_top1_agreement": 0.6}})

    def capture(side):
        c = {k: v for k, v in fr[side]["capture"].items() if k != "process"}
        c["schema"] = "assay.oracle-capture-output.v1"
        c["peak_rss_bytes"] = 100000000
        c["captures"] = [dict(x, file="capture-%d.safetensors" % i) for i, x in enumerate(c["captures"])]
        return with_execution(c, runtime)

    def fp(side):
        return fingerprint_output(fr[side]["model_identity"], fr[side]["model_fingerprint"]["files"])

    cmp = {k: v for k, v in fr["comparison"].items() if k != "process"}
    cmp.update(schema="assay.compare-output.v1", kl_file="kl.safetensors", kl_file_sha256=artifact,
               vocab_size=fr["reference"]["capture"]["vocab_size"], kernel="avx2",
               reproduction={k: v for k, v in fr["reproduction"].items() if k != "capture"},
               # assay-compare leaves the two digest gates to the supervisor: null, incomplete.
               gates={"status": "incomplete", "failed": [],
                      "reproduction": dict(fr["gates"]["reproduction"], capture_content_digest_equal=None,
                                           weights_identity_equal=None),
                      "thresholds": fr["gates"]["thresholds"]})
    for k in ("comparison_kind", "metric", "scope", "comparator"):
        cmp[k] = fr[k]
    job("fidelity", [fp("reference"), fp("candidate"), capture("reference"),
                     dict(capture("reference")), fp("reference"), capture("candidate"), cmp])

    # trajectory: the request's two continuations captured and compared.
    t = trajectory_request("MODEL_DIR")
    write_request("trajectory", t)
    prompt_ids = t["prompt_token_ids"]
    captures, engines = [], []
    for i, c in enumerate(t["continuations"]):
        ids = prompt_ids + c["token_ids"]
        start = len(prompt_ids) - 1
        logits = sha256_id("logits-%d" % i)
        captures.append(with_configuration({
            "schema": "assay.oracle-capture-output.v1", "architecture": "LlamaForCausalLM",
            "model_type": "llama", "vocab_size": 272, "block_positions": 16,
            "captures": [{"id": c["engine"], "file": "capture-0.safetensors", "token_count": len(ids),
                          "input_token_ids_sha256": token_ids_sha256(ids),
                          "positions": [[start, start + len(c["token_ids"])]],
                          "scored_positions": len(c["token_ids"]), "logits_sha256": logits}],
            "device": "cpu", "dtype": "bfloat16", "torch_version": "2.13.0", "threads": 1,
            "bytes_used": bytes_used(mi, tokenizer=False), "peak_rss_bytes": 100000000,
            "lm_head_seconds": 0.01}))
        captures[-1] = with_execution(captures[-1], runtime)
        departure = None if i == 0 else {"index": 1, "position": 6, "argmax_token_id": 8,
                                         "engine_token_id": 10, "engine_token_rank": 3}
        engines.append({"engine": c["engine"], "continuation_length": len(c["token_ids"]),
                        "scored_positions": [[start, start + len(c["token_ids"])]],
                        "logits_sha256": logits, "tokens_matching_argmax": 1,
                        "first_departure": None if i == 0 else 1, "departure": departure})
    compare = {"schema": "assay.compare-trajectory-output.v1", "vocab_size": 272, "prompt_length": 6,
               "engines": engines, "departed_first": {"index": 1, "engines": ["vllm"]},
               "divergence": {"index": 1, "position": 6, "tokens": {"kiln": 8, "vllm": 10},
                              "reference_from": "kiln", "argmax_by_capture": {"kiln": 8, "vllm": 8},
                              "argmax_engines": ["kiln"], "argmax_candidate": "kiln",
                              "candidate_attribution_complete": True},
               "artifact_file": "trajectory.safetensors", "artifact_sha256": artifact,
               "estimator_sha256": "sha256:" + "2" * 64, "seconds": 0.01}
    job("trajectory", [fingerprint, captures[0], captures[1], compare])
    equal = dict(compare, departed_first=None, divergence=None,
                 engines=[dict(e, first_departure=None, departure=None) for e in engines])
    job("trajectory", [fingerprint, captures[0], captures[1], equal], "no-departure")

    # layer attribution: the engine's rows for some boundaries of the tiny llama, patched.
    lr = layer_request("MODEL_DIR")
    write_request("layer-attribution", lr)
    names = boundaries(config["num_hidden_layers"])
    given = [n for n in names if n.endswith("self_attn") or n == "norm"]
    (WORKER_OUTPUT / "layer-attribution.checks.json").write_text(json.dumps(
        {"engine_rows": {"given": given, "omitted": [n for n in names if n not in given],
                         "model_content_sha256": None}}, indent=1) + "\n")
    rows_sha = lr["engine"]["rows_file"]["sha256"]
    layers = with_configuration({
        "schema": "assay.oracle-layers-output.v1", "architecture": "LlamaForCausalLM", "rows": "all",
        "input_token_count": 4, "input_token_ids_sha256": token_ids_sha256(lr["input_token_ids"]),
        "hidden_size": config["hidden_size"], "vocab_size": 272, "rows_file": "layers.safetensors",
        "boundaries": [{"index": i, "name": n, "shape": [4, 64], "sha256": sha256_id("row-" + n)}
                       for i, n in enumerate(names)],
        "logits_sha256": sha256_id("logits"), "argmax_token_id": 7, "argmax_logit": 3.5,
        "patching": {"file_sha256": rows_sha, "candidate_token_id": 5, "forwards": len(given),
                     "seconds": 0.2, "search": "bisect",
                     "boundaries": [{"index": names.index(n), "name": n, "argmax_token_id": 5 if n == "norm" else 7,
                                     "becomes_candidate": n == "norm", "computed": True,
                                     "substituted": [n]} for n in given]},
        "bytes_used": bytes_used(mi, tokenizer=False), "load_seconds": 0.1, "forward_seconds": 0.1,
        "peak_rss_bytes": 100000000, "duration_seconds": 0.3})
    rows = []
    for i, n in enumerate(names):
        present = n in given
        metric = (lambda v: v if present else None)
        rows.append({"index": i, "name": n, "present": present, "bitwise_equal": False if present else None,
                     "cosine_similarity": metric(0.999), "max_abs_error": metric(0.5),
                     "mean_abs_error": metric(0.01), "root_mean_square_error": metric(0.02),
                     "reference_root_mean_square": metric(1.0),
                     "relative_root_mean_square_error": metric(0.02),
                     "relative_rmse_growth": metric(0.0) if i else None,
                     "reference_sha256": sha256_id("row-" + n),
                     "engine_sha256": sha256_id("engine-" + n) if present else None,
                     "engine_dtype": "BF16" if present else None})
    at = {"index": names.index(given[0]), "name": given[0]}
    compare = {"schema": "assay.compare-layers-output.v1", "engine_file_sha256": rows_sha,
               "engine_file_bytes": 4096, "reference_file_sha256": artifact, "boundaries": rows,
               "first_non_bitwise": at, "first_over_tolerance": dict(at, relative_root_mean_square_error=0.02),
               "largest_growth": None, "seconds": 0.05}
    job("layer-attribution", [fingerprint, layers, compare])


def dictionaries():
    """dict/json.dict: JSON's tokens, every property name and const or enum string of assay's and
    Kiln's schemas, the part separator and fuzz_worker_output's kinds; dict/http.dict: HTTP/1.1's
    tokens and assayd's routes."""
    words = {"{", "}", "[", "]", ":", ",", '""', "true", "false", "null", "-0", "1e308", "1.5",
             "9007199254740993", "\\u0000", "\\ud800", "sha256:", SEPARATOR.decode()}
    words |= {"next-token", "next-token-both", "kiln-next-token", "fidelity", "trajectory",
              "layer-attribution"}

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "properties" and isinstance(x, dict):
                    words.update(x)
                if k in ("const", "enum"):
                    for c in x if isinstance(x, list) else [x]:
                        if isinstance(c, str):
                            words.add(c)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for f in sorted((ROOT / "schemas").rglob("*.schema.json")):
        walk(load(f))
    out = ROOT / "tests/fuzz/dict"
    out.mkdir(exist_ok=True)
    quote = lambda w: '"' + "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "\\x%02x" % b
                                    for c in w for b in c.encode()) + '"'
    (out / "json.dict").write_text("# Generated by tests/fuzz/make_corpus.py.\n" +
                                   "".join(quote(w) + "\n" for w in sorted(words)))
    http = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS", " HTTP/1.1\r\n", " HTTP/1.0\r\n",
            "\r\n", "\r\n\r\n", "Host: localhost\r\n", "Content-Length: ", "Transfer-Encoding: chunked\r\n",
            "Connection: close\r\n", "Connection: keep-alive\r\n", "Expect: 100-continue\r\n",
            "Content-Type: application/json\r\n", "0\r\n\r\n", ";ext=1", "/v1/jobs", "/v1/health",
            "/v1/info", "/metrics", "/v1/fingerprint-cache/refresh", "/events", "/result", "/attestation",
            "/artifact", "?model_dir=", "&receipts_dir=", "?state=", "&retry=1", "%2F", "%00", "%ff", "+",
            "j-0123456789abcdef01234567", '{"schema":"assay.next-token-request.v1"}']
    (out / "http.dict").write_text("# Generated by tests/fuzz/make_corpus.py.\n" +
                                   "".join(quote(w) + "\n" for w in http))


def main():
    dictionaries()
    json_targets()
    safetensors_target()
    request_targets()
    layer_rows_target()
    receipt_targets()
    schema_target()
    base64_target()
    with tempfile.TemporaryDirectory() as tmp:
        signed_targets(Key(Path(tmp)))
    kiln_record_target()
    tokenizer_target()
    model_config_target()
    http_target()
    worker_output_target()
    for d in sorted(CORPUS.iterdir()):
        files = list(d.iterdir())
        print("%-20s %3d seeds, %7d bytes" % (d.name, len(files), sum(f.stat().st_size for f in files)))


if __name__ == "__main__":
    main()
