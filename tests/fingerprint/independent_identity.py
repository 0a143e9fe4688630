#!/usr/bin/python3
"""Kiln's model identity of a directory, computed without any assay code: coreutils sha256sum
for every hash and json.dumps(sort_keys, compact separators, ensure_ascii) for the canonical
form. Usage: independent_identity.py MODEL_DIR ID  (prints the identity as JSON)."""
import json
import os
import subprocess
import sys


def sha256sum(path=None, data=None):
    cmd = ["sha256sum", "-b"] + ([path] if path else [])
    out = subprocess.run(cmd, input=data, capture_output=True, check=True).stdout
    return "sha256:" + out.split()[0].decode()


def canonical(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def main(model_dir, model_id):
    def p(name):
        return os.path.join(model_dir, name)

    if os.path.exists(p("model.safetensors.index.json")):
        with open(p("model.safetensors.index.json"), "rb") as f:
            weight_map = json.load(f)["weight_map"]
        shards = list(dict.fromkeys(weight_map.values()))
    elif os.path.exists(p("model.safetensors")):
        shards = ["model.safetensors"]
    else:
        shards = sorted((n for n in os.listdir(model_dir) if n.endswith(".safetensors")),
                        key=lambda n: n.encode())
    if os.path.exists(p("chat_template.jinja")):
        chat = sha256sum(p("chat_template.jinja"))
    elif os.path.exists(p("tokenizer_config.json")):
        with open(p("tokenizer_config.json"), "rb") as f:
            template = json.load(f).get("chat_template")
        chat = sha256sum(data=template.encode("utf-8")) if template is not None else None
    else:
        chat = None
    files = sorted(({"path": s, "bytes": os.path.getsize(p(s)), "sha256": sha256sum(p(s))}
                    for s in shards), key=lambda w: w["path"].encode())
    identity = {
        "id": model_id,
        "config_hash": sha256sum(p("config.json")),
        "tokenizer_hash": sha256sum(p("tokenizer.json")),
        "chat_template_hash": chat,
        "weight_files": files,
    }
    identity["content_sha256"] = sha256sum(data=canonical(identity))
    print(json.dumps(identity))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
