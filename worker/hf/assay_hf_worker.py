"""assay-hf-worker: the work assay does with Hugging Face transformers itself, as a worker.

Usage: assay-hf-worker render-prompt|next-token --input input.json --workdir DIR

render-prompt (assay.prompt-check-input.v1, schemas/prompt-check-input.schema.json): Kiln's
prompt check. The model's own tokenizer files, read through the descriptors assayd opened
(model_fds, never a path), are copied into DIR/tokenizer/ and loaded with transformers'
AutoTokenizer (local files only, no remote code); the chat template renders the request's
messages with add_generation_prompt and template_kwargs through apply_chat_template, as Kiln
does, and the ids are compared with the request's. DIR/output.json
(assay.prompt-check-output.v1) says what was rendered and where the ids first differ; a mismatch
is a fact of the output, not an error (assayd refuses the job).

next-token (assay.oracle-input.v1, as assay-oracle reads it): the transformers backend. The
model is built with AutoModelForCausalLM.from_config (eager attention, bfloat16 or float32, no
remote code) and its weights loaded from the bytes of the descriptors (safetensors from bytes,
never a path), hashed while read (bytes_used); one forward with use_cache=False under
deterministic algorithms, no TF32, inference mode; DIR/logits.safetensors and DIR/output.json
(assay.oracle-output.v1, with "backend": "transformers" and the transformers version and the
sha256 of the modeling and configuration source files it imported).

Exit 0 on success; on an error one line "assay-hf-worker: error [CODE]: MESSAGE" on stderr and
exit 2.
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


def read_fd(fd, name, limit=None):
    """The whole file behind an inherited descriptor, by pread: no path is opened."""
    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        raise WorkerError("model.bad_fd", f"{name} (fd {fd}): {e.strerror}") from e
    if limit is not None and size > limit:
        raise WorkerError("model.bad_fd", f"{name} has {size} bytes, more than {limit}")
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(64 << 20, size - offset), offset)
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
        data = read_fd(fd, name, SMALL_FILE_LIMIT)
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


# --- next-token: the transformers backend ------------------------------------------------------

KERNEL_FLAGS = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm"]


def canonical_sha256(obj):
    """RFC 8785 for what this worker hashes: objects of ASCII keys, strings, ints, bools."""
    return sha256_id(json.dumps(obj, sort_keys=True, separators=(",", ":"),
                                ensure_ascii=False).encode())


def cpu_facts():
    model, flags = None, set()
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    return {"model": model, "logical_cpus": os.cpu_count() or 0,
            "kernel_flags": [f for f in KERNEL_FLAGS if f in flags]}


def runtime_facts(torch):
    show = torch.__config__.show()

    def setting(name):
        for part in show.replace("\n", ",").split(","):
            key, _, value = part.strip().partition("=")
            if key == name:
                return value.strip() or None
        return None

    def line_with(prefix):
        for line in show.splitlines():
            if prefix in line:
                return line.strip(" -")
        return None

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    base = torch.__version__.split("+")[0]
    capability = torch.backends.cpu.get_cpu_capability()
    return {
        "torch_version": base,
        "torch": {"version": setting("TORCH_VERSION") or base, "version_label": torch.__version__,
                  "git_commit": torch.version.git_version, "cuda_version": torch.version.cuda,
                  "hip_version": torch.version.hip, "compiled_against": base,
                  "library_dir": lib},
        "show_config": show,
        "parallel_info": torch.__config__.parallel_info(),
        "blas": setting("BLAS_INFO"),
        "lapack": setting("LAPACK_INFO"),
        "mkl_version": line_with("Math Kernel Library"),
        "onednn_version": line_with("MKL-DNN") or line_with("oneDNN"),
        "openmp_version": line_with("OpenMP"),
        "cpu_capability": capability if capability in ("DEFAULT", "AVX2", "AVX512") else "OTHER",
        "cpu": cpu_facts(),
        "gpu": None,
    }


# The shared objects the supervisor hashes into a result (supervisor/pipelines/steps.cpp
# is_runtime_library keeps only these names, so a worker cannot make it read other files).
RUNTIME_LIBRARIES = (
    "libtorch", "libc10", "libcaffe2", "libshm", "libgomp", "libiomp", "libomp", "libmkl",
    "libdnnl", "libmkldnn", "libblas", "libopenblas", "liblapack", "libsleef", "libcudnn",
    "libcublas", "libcudart", "libnvrtc", "libcufft", "libcurand", "libcusparse", "libcusolver",
    "libnccl", "libamdhip64", "libMIOpen", "librocblas", "libhipblas", "libhipblaslt", "librccl",
    "libroctx64")


def loaded_libraries():
    """torch's runtime shared objects mapped in this process (its Python
    sources are named by their sha256 in the output: executable_sha256, transformers)."""
    seen = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            path = fields[5].strip() if len(fields) == 6 else ""
            name = os.path.basename(path)
            if path.startswith("/") and ".so" in name and name.startswith(RUNTIME_LIBRARIES):
                seen.add(path)
    return sorted(seen)[:128]


def configuration(torch, device, dtype, attention):
    return {
        "dtype": dtype, "device": device,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms_warn_only":
            torch.is_deterministic_algorithms_warn_only_enabled(),
        "tf32_cublas": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduction_cublas": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduction_cublas": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "inference_mode": True,
        "attention_implementation": attention,
        "linear_attention_implementation": "none",
    }


def source_sha256(module):
    path = getattr(module, "__file__", None)
    with open(path, "rb") as f:
        return os.path.basename(path), sha256_id(f.read())


def next_token(doc, workdir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(workdir, "hf-home")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    start = time.monotonic()
    import resource

    import safetensors.torch
    import torch
    import transformers

    execution = doc["execution"]
    device, dtype_name = execution["device"], execution["dtype"]
    if device != "cpu" and not torch.cuda.is_available():
        raise WorkerError("oracle.device_unavailable", f"{device}: torch sees no GPU")
    torch.set_num_threads(int(execution["threads"]))
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("highest")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]

    # Every file once, from its descriptor, hashed as read: the bytes computed with.
    files = {name: fd for name, fd in
             ([(e["name"], e["fd"]) for e in doc["model_fds"]] if "model_fds" in doc else
              [(n, os.open(os.path.join(doc["model_dir"], n), os.O_RDONLY | os.O_NOFOLLOW))
               for n in os.listdir(doc["model_dir"])])}
    if "config.json" not in files:
        raise WorkerError("model.missing_fd", "the model has no config.json")
    config_bytes = read_fd(files["config.json"], "config.json", SMALL_FILE_LIMIT)
    weights, state = [], {}
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        data = read_fd(files[name], name)
        weights.append({"path": name, "bytes": len(data), "sha256": sha256_id(data)})
        state.update(safetensors.torch.load(data))
    if not weights:
        raise WorkerError("model.no_weights", "the model has no .safetensors file")
    folder, tok_files = copy_tokenizer(doc, workdir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False)

    config_dict = json.loads(config_bytes)
    model_type = config_dict.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(**config_dict)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=dtype, trust_remote_code=False)
    except (KeyError, ValueError) as e:
        raise WorkerError("model.unsupported",
                          f"transformers {transformers.__version__} cannot build "
                          f"{config_dict.get('architectures')} ({model_type}): {e}") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise WorkerError("model.missing_tensor" if missing else "model.unexpected_tensor",
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    # The parameters are already in dtype (from_config); .to(dtype) would also cast float32
    # buffers such as RoPE's inv_freq, which from_pretrained keeps in float32.
    model = model.to(device=device).eval()
    load_seconds = time.monotonic() - start

    ids = [int(i) for i in doc["input_token_ids"]]
    vocab = int(model.config.vocab_size)
    for i, t in enumerate(ids):
        if t >= vocab:
            raise WorkerError("request.invalid_token_id",
                              f"input_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab})")
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    for i, p in enumerate(doc.get("continuation_prefix", [])):
        if text(p["token_id"]) != p["text"]:
            raise WorkerError("request.token_text_mismatch",
                              f"continuation_prefix[{i}]: token_id {p['token_id']} claims text "
                              f"{json.dumps(p['text'])} but decodes to "
                              f"{json.dumps(text(p['token_id']))}")
    for i, c in enumerate(doc["candidate_tokens"]):
        if c["token_id"] >= vocab or text(c["token_id"]) != c["text"]:
            raise WorkerError("request.candidate_text_mismatch",
                              f"candidate_tokens[{i}] ({c['engine']}): text "
                              f"{json.dumps(c['text'])} is not the decoding of token_id "
                              f"{c['token_id']}")

    forward_start = time.monotonic()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    logits = out.logits[0, -1].float().cpu().contiguous()
    forward_seconds = time.monotonic() - forward_start
    if not torch.isfinite(logits).all():
        raise WorkerError("oracle.non_finite_logits", "the last position has non-finite logits")
    values = logits.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    top = order[:10]
    above = lambda v: sum(1 for x in values if x > v)  # noqa: E731
    margin = float(torch.tensor(values[top[0]]) - torch.tensor(values[top[1]]))
    logits_bytes = logits.numpy().tobytes()
    safetensors.torch.save_file(
        {"input_ids": torch.tensor([ids], dtype=torch.int64), "logits": logits},
        os.path.join(workdir, "logits.safetensors"),
        metadata={"architecture": (config_dict.get("architectures") or [""])[0],
                  "device": device, "dtype": dtype_name, "torch_version": torch.__version__})
    attention = getattr(model.config, "_attn_implementation", "eager")
    conf = configuration(torch, device, dtype_name, attention)
    modeling = sys.modules[type(model).__module__]
    configuration_module = sys.modules[type(config).__module__]
    modeling_file, modeling_sha = source_sha256(modeling)
    config_file, config_sha = source_sha256(configuration_module)
    return {
        "schema": "assay.oracle-output.v1",
        "backend": "transformers",
        "transformers": {"version": transformers.__version__, "model_class": type(model).__name__,
                         "modeling_file": modeling_file, "modeling_sha256": modeling_sha,
                         "configuration_file": config_file,
                         "configuration_sha256": config_sha},
        "architecture": type(model).__name__,
        "model_type": model_type,
        "vocab_size": vocab,
        "argmax": top[0],
        "argmax_text": text(top[0]),
        "top_tokens": [{"token_id": t, "text": text(t), "logit": values[t]} for t in top],
        "candidate_tokens": [{"engine": c["engine"], "token_id": c["token_id"],
                              "text": c["text"], "logit": values[c["token_id"]],
                              "rank": 1 + above(values[c["token_id"]]),
                              "is_argmax": c["token_id"] == top[0]}
                             for c in doc["candidate_tokens"]],
        "top_logit_margin": margin,
        "top_logit_tie": values[top[0]] == values[top[1]],
        "logits_file": "logits.safetensors",
        "logits_sha256": sha256_id(logits_bytes),
        "input_token_count": len(ids),
        "input_token_ids_sha256": canonical_ids_sha256(ids),
        "bytes_used": {"weight_files": weights, "config_hash": sha256_id(config_bytes),
                       "tokenizer_hash": tok_files.get("tokenizer.json", {}).get("sha256")},
        "device": device,
        "device_name": cpu_facts()["model"] or "cpu",
        "dtype": dtype_name,
        "torch_version": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "tf32_allowed": False,
        "attention_implementation": attention,
        "linear_attention_implementation": "none",
        "executable_sha256": sha256_id(open(__file__, "rb").read()),
        "load_seconds": load_seconds,
        "forward_seconds": forward_seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "duration_seconds": time.monotonic() - start,
        "configuration": conf,
        "configuration_sha256": canonical_sha256(conf),
        "runtime": runtime_facts(torch),
        "loaded_libraries": loaded_libraries(),
    }


def main(argv):
    modes = {"render-prompt": ("assay.prompt-check-input.v1", render_prompt),
             "next-token": ("assay.oracle-input.v1", next_token)}
    if len(argv) != 6 or argv[1] not in modes or argv[2] != "--input" or \
            argv[4] != "--workdir":
        print(__doc__.strip(), file=sys.stderr)
        return 2 if argv[1:2] not in (["-h"], ["--help"]) else 0
    workdir = argv[5]
    try:
        with open(argv[3], "rb") as f:
            doc = json.loads(f.read())
        schema, run = modes[argv[1]]
        if doc.get("schema") != schema:
            raise WorkerError("input.invalid", f"schema {doc.get('schema')!r} is not {schema}")
        out = run(doc, workdir)
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
