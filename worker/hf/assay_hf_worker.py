"""assay-hf-worker: the work assay does with Hugging Face transformers itself, as a worker.

Usage: assay-hf-worker render-prompt --input input.json --workdir DIR

render-prompt (assay.prompt-check-input.v1, schemas/prompt-check-input.schema.json): Kiln's
prompt check. The model's own tokenizer files, read through the descriptors assayd opened
(model_fds, never a path), are copied into DIR/tokenizer/ and loaded with transformers'
AutoTokenizer (local files only, no remote code); the chat template renders the request's
messages with add_generation_prompt and template_kwargs through apply_chat_template, as Kiln
does, and the ids are compared with the request's. DIR/output.json
(assay.prompt-check-output.v1) says what was rendered and where the ids first differ; a mismatch
is a fact of the output, not an error (assayd refuses the job). Exit 0 on success; on an error
one line "assay-hf-worker: error [CODE]: MESSAGE" on stderr and exit 2.
"""
import hashlib
import json
import os
import sys
import time

SMALL_FILE_LIMIT = 64 << 20
# Files of a model directory that say how text becomes ids (the weights never do).
TOKENIZER_FILES = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
    "config.json", "generation_config.json",
}


class WorkerError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def sha256_id(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_ids_sha256(ids):
    return sha256_id(("[" + ",".join(str(i) for i in ids) + "]").encode())


def read_fd(fd, name):
    """The whole file behind an inherited descriptor, by pread: no path is opened."""
    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        raise WorkerError("model.bad_fd", f"{name} (fd {fd}): {e.strerror}") from e
    if size > SMALL_FILE_LIMIT:
        raise WorkerError("model.bad_fd", f"{name} has {size} bytes, more than a tokenizer file")
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(1 << 20, size - offset), offset)
        if not chunk:
            raise WorkerError("model.file_changed", f"{name} shrank while it was read")
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def model_files(doc):
    """(name, fd) of each model file: the descriptors assayd passed, else (on a Slurm node, where
    descriptors do not reach) the directory's files opened by path."""
    if "model_fds" in doc:
        return [(e["name"], e["fd"]) for e in doc["model_fds"]]
    folder = doc["model_dir"]
    return [(name, os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW))
            for name in sorted(os.listdir(folder)) if name in TOKENIZER_FILES]


def copy_tokenizer(doc, workdir):
    """Copies the tokenizer files out of their descriptors; returns {name: {sha256, bytes}}."""
    folder = os.path.join(workdir, "tokenizer")
    os.mkdir(folder, 0o700)
    files = {}
    for name, fd in model_files(doc):
        if name not in TOKENIZER_FILES:
            continue
        data = read_fd(fd, name)
        with open(os.path.join(folder, name), "xb") as f:
            f.write(data)
        files[name] = {"sha256": sha256_id(data), "bytes": len(data)}
    if "tokenizer.json" not in files and "tokenizer.model" not in files:
        raise WorkerError("model.missing_fd", "the model has no tokenizer.json to render with")
    return folder, files


def chat_template_sha256(folder, files):
    """The template's identity as the fingerprint computes it: chat_template.jinja's bytes, else
    tokenizer_config.json's chat_template string."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"]["sha256"]
    if "tokenizer_config.json" in files:
        with open(os.path.join(folder, "tokenizer_config.json"), "rb") as f:
            template = json.loads(f.read()).get("chat_template")
        if isinstance(template, str):
            return sha256_id(template.encode())
    return None


def ids_of(encoded):
    """apply_chat_template's ids: a BatchEncoding (transformers 5) or a list."""
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def first_difference(tokenizer, expected, rendered):
    for i in range(max(len(expected), len(rendered))):
        a = expected[i] if i < len(expected) else None
        b = rendered[i] if i < len(rendered) else None
        if a != b:
            def text(token):
                return None if token is None else tokenizer.decode([token])
            return {"index": i, "request_id": a, "rendered_id": b,
                    "request_text": text(a), "rendered_text": text(b)}
    return None


def render_prompt(doc, workdir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(workdir, "hf-home")
    start = time.monotonic()
    import tokenizers
    import transformers
    folder, files = copy_tokenizer(doc, workdir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False)
    if not getattr(tokenizer, "chat_template", None):
        raise WorkerError("model.no_chat_template", "the model's tokenizer has no chat template")
    kwargs = dict(doc["template_kwargs"])
    text = tokenizer.apply_chat_template(
        doc["messages"], add_generation_prompt=doc["add_generation_prompt"], tokenize=False,
        **kwargs)
    rendered = ids_of(tokenizer.apply_chat_template(
        doc["messages"], add_generation_prompt=doc["add_generation_prompt"], **kwargs))
    expected = [int(i) for i in doc["token_ids"]]
    return {
        "schema": "assay.prompt-check-output.v1",
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "tokenizer_class": type(tokenizer).__name__,
        "files": files,
        "chat_template_sha256": chat_template_sha256(folder, files),
        "rendered_text_sha256": sha256_id(text.encode()),
        "rendered_utf8_bytes": len(text.encode()),
        "token_count": len(rendered),
        "token_ids_sha256": canonical_ids_sha256(rendered),
        "match": rendered == expected,
        "first_difference": first_difference(tokenizer, expected, rendered),
        "duration_seconds": time.monotonic() - start,
    }


def main(argv):
    if len(argv) != 6 or argv[1] != "render-prompt" or argv[2] != "--input" or \
            argv[4] != "--workdir":
        print(__doc__.strip(), file=sys.stderr)
        return 2 if argv[1:2] not in (["-h"], ["--help"]) else 0
    workdir = argv[5]
    try:
        with open(argv[3], "rb") as f:
            doc = json.loads(f.read())
        if doc.get("schema") != "assay.prompt-check-input.v1":
            raise WorkerError("input.invalid", f"schema {doc.get('schema')!r} is not "
                                               "assay.prompt-check-input.v1")
        out = render_prompt(doc, workdir)
        tmp = os.path.join(workdir, "output.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, sort_keys=True, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(workdir, "output.json"))
        return 0
    except WorkerError as e:
        print(f"assay-hf-worker: error [{e.code}]: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # transformers' own errors: named by class, never swallowed
        print(f"assay-hf-worker: error [hf.{type(e).__name__}]: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
