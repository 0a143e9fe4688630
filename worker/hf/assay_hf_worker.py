"""assay-hf-worker: the work assay does with Hugging Face transformers itself, as a worker.

Usage: assay-hf-worker render-prompt|next-token|layers|envelope|audit|serve --input input.json --workdir DIR

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
remote code) without random initialisation, and its weights are the bytes of the descriptors
(never a path), each file read once into a private copy, hashed while read (bytes_used) and then
made read-only, its tensors assigned as views of that copy (transformers initialises only what
the files do not hold, as from_pretrained does); one forward with use_cache=False under
deterministic algorithms, no TF32, inference mode; DIR/logits.safetensors and DIR/output.json
(assay.oracle-output.v1, with "backend": "transformers" and the transformers version and the
sha256 of the modeling and configuration source files it imported).

serve (assay.oracle-serve-input.v1, as `assay-oracle serve` reads it): a resident worker. The
model is built once, as for next-token, from the descriptors; DIR/loaded.json
(assay.oracle-serve-loaded.v1, with its bytes_used) is written and "loaded" sent on control_fd
(a SOCK_SEQPACKET socket); then each "run NAME" runs the next-token job of DIR/NAME/input.json
(the worker's own model_dir and execution, no descriptors) on that model and is answered
"done NAME" or "failed NAME" (DIR/NAME/error.json); the worker exits 0 when the socket closes.

layers (assay.oracle-layers-input.v1): the same model and forward with forward hooks on the
modules named as boundaries (embedding, per layer input_layernorm, self_attn or linear_attn,
post_attention_layernorm, mlp and the layer, then norm; and the operators the input names,
docs/operators.md) keeping their rows widened to float32; DIR/layers.safetensors (one F32 tensor per boundary, in forward order) and
DIR/output.json (assay.oracle-layers-output.v1). With `patch`, one more forward per named
boundary whose hook returns the engine's rows (read through patch.fd) in place of the module's
output, recording the last position's argmax.

envelope (assay.numerics-input.v1): the same model, and for each of the input's states its
last-position logits under the numerics envelope's members (assay_numerics.py: the reference,
seeded reduction orders, SDPA attention, a KV cache, batches; then the float32 fact), each
reduced to the figures the verdict needs; DIR/output.json (assay.numerics-output.v1).

audit (assay.audit-input.v1): an engine audit (common/audit.h). Each context's engine logits
file (its descriptor, its sha256 checked against the input's before the model is built; a tensor
"logits" or the only one, F32 or BF16, [positions, vocab]); the same model, its float32 copy as
the anchor, and at every position of every context the engine's and each member's (the
reference, seeded reduction orders, SDPA) squared log-softmax distance to the anchor;
DIR/output.json (assay.audit-output.v1), which assayd keeps as the job's artifact.

Exit 0 on success; on an error one line "assay-hf-worker: error [CODE]: MESSAGE" on stderr and
exit 2.
"""
import dataclasses
import hashlib
import json
import os
import sys
import time

# protocol::kMaxSmallModelFileBytes (common/protocol.h), which admission applies first.
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


def read_fd_private(fd, name):
    """The whole file behind an inherited descriptor in one private anonymous mapping, by pread
    (no path is opened), its sha256 computed as it is read; then the mapping is made read-only,
    so that nothing (a kernel writing in place, an initialiser) can change the bytes after they
    were hashed: the bytes computed with are the bytes hashed. Returns (mapping, "sha256:...",
    the file's size); the mapping is at least one byte long."""
    import mmap

    try:
        size = os.fstat(fd).st_size
    except OSError as e:
        raise WorkerError("model.bad_fd", f"{name} (fd {fd}): {e.strerror}") from e
    buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view, digest, offset = memoryview(buf), hashlib.sha256(), 0
    try:
        while offset < size:
            n = os.preadv(fd, [view[offset:offset + min(64 << 20, size - offset)]], offset)
            if n == 0:
                raise WorkerError("model.file_changed", f"{name} shrank while it was read")
            digest.update(view[offset:offset + n])
            offset += n
    finally:
        view.release()
    protect_read_only(buf)
    return buf, "sha256:" + digest.hexdigest(), size


def protect_read_only(buf):
    """mprotect(PROT_READ) over an anonymous mapping: a later write faults instead of changing
    hashed bytes."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mprotect(address, len(buf), mmap.PROT_READ) != 0:
        raise WorkerError("model.bad_fd", "mprotect of a weight file's copy failed: "
                          + os.strerror(ctypes.get_errno()))


def safetensors_views(torch, buf, size, name):
    """The tensors of a safetensors image (the first `size` bytes of `buf`) as views of `buf`,
    without a copy, checked as the safetensors library checks a file: a JSON header object, each
    tensor's shape and byte range agreeing, the ranges tiling the data exactly. A tensor whose
    start is not a multiple of its element size is copied. None when a dtype is one this reader
    does not map (the caller then uses safetensors' own loader)."""
    import math

    def bad(why):
        raise WorkerError("model.invalid_safetensors", f"{name}: {why}")

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    if size < 8:
        bad(f"{size} bytes cannot hold the header length")
    n = int.from_bytes(buf[:8], "little")
    if n > size - 8:
        bad(f"header length {n} exceeds the {size - 8} bytes after it")
    try:
        header = json.loads(buf[8:8 + n].decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        bad(f"the header is not JSON: {e}")
    if not isinstance(header, dict):
        bad("the header is not a JSON object")
    base, data = 8 + n, size - 8 - n
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            bad(f"tensor {key!r} is not {{dtype, shape, data_offsets}}")
        dtype = dtypes.get(entry["dtype"])
        if dtype is None:
            return None
        shape, offsets = entry["shape"], entry["data_offsets"]
        def ints(v):
            return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)
        if not ints(shape) or not ints(offsets) or len(offsets) != 2:
            bad(f"tensor {key!r}: shape {shape!r} or data_offsets {offsets!r} malformed")
        begin, end = offsets
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        if not begin <= end <= data or end - begin != numel * itemsize:
            bad(f"tensor {key!r}: data_offsets {offsets!r} do not hold {shape!r} {entry['dtype']} "
                f"within {data} data bytes")
        entries.append((begin, end, key, dtype, shape, numel, itemsize))
    entries.sort(key=lambda e: (e[0], e[1]))
    at = 0
    for begin, end, key, *_ in entries:
        if begin != at:
            bad(f"tensor {key!r} starts at {begin}, not at {at} where the one before ends")
        at = end
    if at != data:
        bad(f"the tensors end at {at}, not at the end of the {data} data bytes")
    out = {}
    for begin, end, key, dtype, shape, numel, itemsize in entries:
        start = base + begin
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        elif start % itemsize == 0:
            t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=start).view(shape)
        else:
            t = torch.frombuffer(bytearray(buf[start:base + end]), dtype=dtype).view(shape)
        out[key] = t
    return out


def model_files(doc, wanted=None):
    """(name, fd) of each model file whose name passes `wanted` (None: every file): the
    descriptors assayd passed, else (on a Slurm node, where descriptors do not reach) the
    directory's files opened by path, without following a link."""
    keep = (lambda name: True) if wanted is None else wanted
    if "model_fds" in doc:
        return [(e["name"], e["fd"]) for e in doc["model_fds"] if keep(e["name"])]
    folder = doc["model_dir"]
    # O_NONBLOCK: a FIFO in the folder does not hang the open (reading it then fails).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    return [(name, os.open(os.path.join(folder, name), flags))
            for name in sorted(os.listdir(folder)) if keep(name)]


def offline_home(workdir):
    """No hub, no network, caches inside the workspace: set before transformers is imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HOME"] = os.path.join(workdir, "hf-home")


def copy_tokenizer(doc, workdir):
    """Copies the tokenizer files out of their descriptors; returns {name: {sha256, bytes}}."""
    folder = os.path.join(workdir, "tokenizer")
    os.mkdir(folder, 0o700)
    files = {}
    for name, fd in model_files(doc, lambda name: name in TOKENIZER_FILES):
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
    offline_home(workdir)
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


def linear_attention_implementation(model):
    """What the model's linear-attention layers run, read from the layers themselves: Kiln's
    "transformers_torch_fallback" when every Gated DeltaNet layer binds transformers' own torch
    gated delta rule and its plain Conv1d (no causal-conv1d kernel); the bound kernels' names
    otherwise; "none" for a model without linear-attention layers."""
    kernels = set()
    for module in model.modules():
        rule = getattr(module, "chunk_gated_delta_rule", None)
        if rule is None:
            continue
        conv = getattr(module, "causal_conv1d_fn", None)
        kernels.add((getattr(rule, "__name__", repr(rule)),
                     None if conv is None else getattr(conv, "__name__", repr(conv))))
    if not kernels:
        return "none"
    if all(rule.startswith("torch_") and conv is None for rule, conv in kernels):
        return "transformers_torch_fallback"
    return ",".join(sorted(rule + "+" + (conv or "conv1d") for rule, conv in kernels))


def configuration(torch, device, dtype, attention, linear="none"):
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
        "linear_attention_implementation": linear,
    }


def source_sha256(module):
    path = getattr(module, "__file__", None)
    with open(path, "rb") as f:
        return os.path.basename(path), sha256_id(f.read())


def deterministic_torch(torch, threads):
    """The settings every forward of this worker runs under (tests/layers/engine_rows.py too)."""
    torch.set_num_threads(int(threads))
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("highest")


@dataclasses.dataclass
class Built:
    """A model built from the bytes of its descriptors, in eval mode on its device."""
    model: object
    config: object
    config_dict: dict
    device: str
    dtype_name: str
    bytes_used: dict
    start: float  # when the worker began: duration_seconds counts from here


def text_model_state(model, state):
    """The weights of a multimodal checkpoint (model.language_model.*, as Qwen publishes
    Qwen3.5) under the names of the text-only class from_config builds from its config, less
    what that class ignores on load (vision tower, multi-token prediction): the renaming
    transformers' from_pretrained does."""
    import re

    prefix = "model.language_model."
    if not any(k.startswith(prefix) for k in state) or \
            any(k.startswith(prefix) for k in model.state_dict()):
        return state
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None)
               or []]
    return {("model." + k[len(prefix):] if k.startswith(prefix) else k): t
            for k, t in state.items() if not any(p.search(k) for p in ignored)}


def build_model(doc, workdir):
    """AutoModelForCausalLM.from_config (eager, no remote code) with the weights of the
    descriptors (safetensors from bytes, hashed as read), under deterministic settings."""
    offline_home(workdir)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    start = time.monotonic()
    import safetensors.torch
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    execution = doc["execution"]
    device, dtype_name = execution["device"], execution["dtype"]
    if device != "cpu" and not torch.cuda.is_available():
        raise WorkerError("oracle.device_unavailable", f"{device}: torch sees no GPU")
    deterministic_torch(torch, execution["threads"])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]

    # Every file once, from its descriptor, hashed as read: the bytes computed with.
    files = dict(model_files(doc))
    if "config.json" not in files:
        raise WorkerError("model.missing_fd", "the model has no config.json")
    config_bytes = read_fd(files["config.json"], "config.json", SMALL_FILE_LIMIT)
    tokenizer_hash = (sha256_id(read_fd(files["tokenizer.json"], "tokenizer.json",
                                        SMALL_FILE_LIMIT))
                      if "tokenizer.json" in files else None)
    # Each weight file once, into a private read-only copy, hashed as read; its tensors are views
    # of that copy (no second allocation), which the model's parameters then become.
    weights, state = [], {}
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        buf, digest, size = read_fd_private(files[name], name)
        weights.append({"path": name, "bytes": size, "sha256": digest})
        views = safetensors_views(torch, buf, size, name)
        state.update(views if views is not None else safetensors.torch.load(bytes(buf[:size])))
    if not weights:
        raise WorkerError("model.no_weights", "the model has no .safetensors file")

    config_dict = json.loads(config_bytes)
    model_type = config_dict.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(**config_dict)
        # No random initialisation of parameters the weights replace: the allocations stay
        # untouched (no page is faulted in) and are dropped when the file's views are assigned.
        with no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="eager", dtype=dtype, trust_remote_code=False)
    except (KeyError, ValueError) as e:
        raise WorkerError("model.unsupported",
                          f"transformers {transformers.__version__} cannot build "
                          f"{config_dict.get('architectures')} ({model_type}): {e}") from e
    state = text_model_state(model, state)
    # As load_state_dict's copy would: each tensor in the dtype of the model's own (a cast copies;
    # a tensor already in that dtype is used as it is), then assigned instead of copied.
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    state = {k: (t.to(own[k].dtype) if k in own and t.dtype != own[k].dtype else t)
             for k, t in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # What from_pretrained does after loading: what was loaded is marked initialised, and
    # transformers' initialisation sets the rest (non-persistent buffers such as RoPE's
    # inv_freq, a tied head before it is tied). It cannot change a loaded tensor: those are
    # read-only pages (read_fd_private), and a write would fault, not pass silently.
    for key in set(state) - set(unexpected):
        model.get_parameter_or_buffer(key)._is_hf_initialized = True
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise WorkerError("model.missing_tensor" if missing else "model.unexpected_tensor",
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        # A multimodal config's text part (what from_config built) may not say it is tied.
        model.config.tie_word_embeddings = True
        model.tie_weights()
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight.data_ptr() != embed.weight.data_ptr():
            raise WorkerError("model.untied", f"{type(model).__name__}: tie_word_embeddings is "
                              "set but lm_head is not the embedding")
    # After tying, so that a tied head is the loaded embedding and is not initialised first.
    model.initialize_weights()
    # The parameters are already in dtype (from_config); .to(dtype) would also cast float32
    # buffers such as RoPE's inv_freq, which from_pretrained keeps in float32.
    model = model.to(device=device).eval()
    return Built(model=model, config=config, config_dict=config_dict, device=device,
                 dtype_name=dtype_name, start=start,
                 bytes_used={"weight_files": weights, "config_hash": sha256_id(config_bytes),
                             "tokenizer_hash": tokenizer_hash})


KILN_FULL_LOGITS_SCHEMA = "kiln.qwen35-hf-full-logits.v1"


def logits_metadata(built, execution, ids):
    """The logits file's __metadata__: assay's keys and Kiln's (its reference writer's), each
    what this run was; the schema names Kiln's layout (input_ids I64 [1, N], logits F32 [vocab])."""
    import torch
    return {"architecture": (built.config_dict.get("architectures") or [""])[0],
            "device": built.device, "dtype": built.dtype_name,
            "attention_implementation": execution["attention_implementation"],
            "linear_attention_implementation": execution["linear_attention_implementation"],
            "device_name": execution["device_name"],
            "input_token_ids": json.dumps(list(ids), separators=(",", ":")),
            "schema": KILN_FULL_LOGITS_SCHEMA,
            "torch_commit": torch.version.git_version,
            "torch_hip_version": str(torch.version.hip),
            "torch_version": torch.__version__,
            "transformers_version": execution["transformers"]["version"]}


def execution_fields(built):
    """What ran the forward: the fields of oracle-output.schema.json every mode writes."""
    import torch
    import transformers

    model = built.model
    attention = getattr(model.config, "_attn_implementation", "eager")
    linear = linear_attention_implementation(model)
    conf = configuration(torch, built.device, built.dtype_name, attention, linear)
    modeling_file, modeling_sha = source_sha256(sys.modules[type(model).__module__])
    config_file, config_sha = source_sha256(sys.modules[type(built.config).__module__])
    return {
        "backend": "transformers",
        "transformers": {"version": transformers.__version__, "model_class": type(model).__name__,
                         "modeling_file": modeling_file, "modeling_sha256": modeling_sha,
                         "configuration_file": config_file,
                         "configuration_sha256": config_sha,
                         "python": python_identity()},
        "architecture": type(model).__name__,
        "model_type": built.config_dict.get("model_type"),
        "bytes_used": built.bytes_used,
        "device": built.device,
        "device_name": (torch.cuda.get_device_name(torch.device(built.device))
                        if built.device.startswith("cuda") else cpu_facts()["model"] or "cpu"),
        "dtype": built.dtype_name,
        "torch_version": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "tf32_allowed": False,
        "attention_implementation": attention,
        "linear_attention_implementation": linear,
        "executable_sha256": sha256_id(open(__file__, "rb").read()),
        "configuration": conf,
        "configuration_sha256": canonical_sha256(conf),
        "runtime": runtime_facts(torch),
        "loaded_libraries": loaded_libraries(),
    }


def python_identity():
    """The interpreter that ran this worker: its path as exec resolved it and the sha256 of
    that file (Kiln's python_sha256)."""
    path = os.path.realpath(sys.executable)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": path, "sha256": "sha256:" + digest.hexdigest(),
            "version": sys.version.split()[0]}


def peak_rss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_token_ids(ids, vocab, field):
    for i, t in enumerate(ids):
        if t >= vocab:
            raise WorkerError("request.invalid_token_id",
                              f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab})")


def load_tokenizer(doc, workdir):
    import transformers

    folder, _ = copy_tokenizer(doc, workdir)
    return transformers.AutoTokenizer.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False)


def next_token(doc, workdir):
    built = build_model(doc, workdir)
    tokenizer = load_tokenizer(doc, workdir)
    return next_token_on(built, tokenizer, doc, workdir, time.monotonic() - built.start,
                         built.start)


def next_token_on(built, tokenizer, doc, workdir, load_seconds, start):
    """The next-token job of `doc` on a built model: DIR/logits.safetensors and the output."""
    import safetensors.torch
    import torch

    model, device = built.model, built.device
    ids = [int(i) for i in doc["input_token_ids"]]
    vocab = int(model.config.vocab_size)
    check_token_ids(ids, vocab, "input_token_ids")
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
    execution = execution_fields(built)
    safetensors.torch.save_file(
        {"input_ids": torch.tensor([ids], dtype=torch.int64), "logits": logits},
        os.path.join(workdir, "logits.safetensors"),
        metadata=logits_metadata(built, execution, ids))
    return {
        **execution,
        "schema": "assay.oracle-output.v1",
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
        "load_seconds": load_seconds,
        "forward_seconds": forward_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "duration_seconds": time.monotonic() - start,
    }


# --- serve: a resident transformers worker (the protocol of `assay-oracle serve`) ---------------

SERVE_INPUT, SERVE_LOADED = "assay.oracle-serve-input.v1", "assay.oracle-serve-loaded.v1"


def write_json_atomic(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def plain_name(name):
    return 0 < len(name) <= 200 and name not in (".", "..") and "/" not in name and "\0" not in name


def serve(doc, workdir):
    """Loads the model once through the descriptors (its bytes_used fixed from then), writes
    DIR/loaded.json and says "loaded" on the control socket; then, for each "run NAME", runs the
    next-token job of DIR/NAME/input.json on that model and answers "done NAME" (output.json and
    logits.safetensors written) or "failed NAME" (error.json {code, message}); returns when the
    supervisor closes the socket, or with an error on a message it cannot read."""
    import socket

    for key in ("model_dir", "model_fds", "execution", "control_fd"):
        if key not in doc:
            raise WorkerError("input.invalid", f"input.json: {key} is missing")
    unknown = set(doc) - {"schema", "model_dir", "model_fds", "execution", "control_fd"}
    if unknown:
        raise WorkerError("input.invalid", f"input.json: unknown field {sorted(unknown)[0]!r}")
    fd = doc["control_fd"]
    if type(fd) is not int or not 3 <= fd <= 65535:
        raise WorkerError("input.invalid", f"input.json: control_fd {fd!r} is not a descriptor >= 3")
    control = socket.socket(fileno=fd)
    built = build_model(doc, workdir)
    tokenizer = load_tokenizer(doc, workdir)
    load_seconds = time.monotonic() - built.start
    loaded_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    model_dir, execution = doc["model_dir"], doc["execution"]
    write_json_atomic(os.path.join(workdir, "loaded.json"), {
        "schema": SERVE_LOADED, "model_dir": model_dir,
        "architecture": type(built.model).__name__, "model_type": built.config_dict.get("model_type"),
        "bytes_used": built.bytes_used, "loaded_at": loaded_at, "load_seconds": load_seconds,
        "peak_rss_bytes": peak_rss_bytes()})
    control.send(b"loaded")
    jobs = 0
    while True:
        message = control.recv(4096)
        if not message:
            return None
        text = message.decode("utf-8", "replace")
        if not text.startswith("run ") or not plain_name(text[4:]):
            raise WorkerError("serve.control", f"unknown control message {text[:80]!r}")
        name = text[4:]
        job = os.path.join(workdir, name)
        try:
            with open(os.path.join(job, "input.json"), "rb") as f:
                job_doc = json.loads(f.read())
            if job_doc.get("schema") != "assay.oracle-input.v1":
                raise WorkerError("input.invalid", f"schema {job_doc.get('schema')!r} is not "
                                  "assay.oracle-input.v1 (a resident transformers worker runs "
                                  "next-token jobs)")
            if "model_fds" in job_doc or job_doc.get("unchanged_files"):
                raise WorkerError("input.invalid", "a resident worker's job input names no "
                                  "model_fds and no unchanged_files (it read its model at load)")
            if job_doc.get("model_dir") != model_dir:
                raise WorkerError("input.invalid", f"job model_dir {job_doc.get('model_dir')!r} is "
                                  f"not the resident worker's {model_dir!r}")
            if job_doc.get("execution") != execution:
                raise WorkerError("input.invalid", f"job execution {job_doc.get('execution')!r} is "
                                  "not the resident worker's")
            out = next_token_on(built, tokenizer, job_doc, job, 0.0, time.monotonic())
            out["bytes_used"] = built.bytes_used
            out["resident"] = {"loaded_at": loaded_at, "load_seconds": load_seconds,
                               "jobs_before": jobs}
            write_json_atomic(os.path.join(job, "output.json"), out)
            reply = "done " + name
        except Exception as e:  # the job fails; the worker and its model serve the next one
            code = e.code if isinstance(e, WorkerError) else f"hf.{type(e).__name__}"
            print(f"assay-hf-worker serve: {name}: error [{code}]: {middle_cut(str(e))}",
                  file=sys.stderr, flush=True)
            write_json_atomic(os.path.join(job, "error.json"),
                              {"code": code, "message": middle_cut(str(e))})
            reply = "failed " + name
        jobs += 1
        control.send(reply.encode())


# --- envelope: the numerics envelope of a state (assay_numerics.py) ---------------------------

def numerics_module():
    """assay_numerics.py beside this file (python -I leaves this folder off sys.path)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import assay_numerics

    return assay_numerics


def envelope(doc, workdir):
    built = build_model(doc, workdir)
    import torch

    numerics = numerics_module()
    vocab = int(built.model.config.vocab_size)
    for n, state in enumerate(doc["states"]):
        check_token_ids([int(i) for i in state["input_token_ids"]], vocab,
                        f"states[{n}].input_token_ids")
        check_token_ids([int(c["token_id"]) for c in state["candidate_tokens"]], vocab,
                        f"states[{n}].candidate_tokens")
    load_seconds = time.monotonic() - built.start
    fields = execution_fields(built)  # before the fp32 member makes the model float32
    states, forward_seconds = numerics.envelope(torch, built.model, doc["states"],
                                                doc["numerics"], built.device)
    with open(numerics.__file__, "rb") as f:
        module_sha256 = sha256_id(f.read())
    return {
        **fields,
        "schema": "assay.numerics-output.v1",
        "numerics_module_sha256": module_sha256,
        "member_names": numerics.member_names(doc["numerics"]),
        "vocab_size": vocab,
        "states": states,
        "load_seconds": load_seconds,
        "forward_seconds": forward_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "duration_seconds": time.monotonic() - built.start,
    }


# --- audit: an engine's logits over a panel against the envelope's members ----------------------

def read_engine_file_bytes(ctx, n):
    """Context n's engine logits file (its fd), checked against the request's digest."""
    where = f"contexts[{n}] ({ctx['id']})"
    spec = ctx["engine_logits"]
    data = read_fd(spec["fd"], f"the engine's logits file of {where}")
    got = sha256_id(data)
    if got != spec["sha256"]:
        raise WorkerError("job.bytes_mismatch", f"the engine's logits file of {where} has {got}, "
                          f"not the request's {spec['sha256']}: it changed after submission; "
                          "nothing was computed")
    return data, got


def engine_logits(data, ctx, n, vocab):
    """The tensor "logits" (or the only tensor) of an engine file: F32 or BF16,
    [positions, vocab], every value finite. Returns (tensor, dtype name)."""
    import safetensors.torch
    import torch

    where = f"contexts[{n}] ({ctx['id']})"
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # the library's own error, named
        raise WorkerError("request.bad_logits_file",
                          f"the engine's logits file of {where}: {e}") from e
    if "logits" in tensors:
        t = tensors["logits"]
    elif len(tensors) == 1:
        t = next(iter(tensors.values()))
    else:
        raise WorkerError("request.bad_logits_file", f"the engine's logits file of {where} has "
                          f"{len(tensors)} tensors and none named \"logits\"")
    dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}.get(t.dtype)
    want = [len(ctx["token_ids"]), vocab]
    if dtype is None or list(t.shape) != want:
        raise WorkerError("request.bad_logits_file", f"the engine's logits of {where} are "
                          f"{t.dtype} {list(t.shape)}, not F32 or BF16 {want}")
    if not torch.isfinite(t).all():
        raise WorkerError("request.bad_logits_file",
                          f"the engine's logits of {where} hold a non-finite value")
    return t, dtype


def audit(doc, workdir):
    # Every engine file is read and its digest checked before the model is built: a file that
    # changed after submission fails the job at once.
    files = [read_engine_file_bytes(ctx, n) for n, ctx in enumerate(doc["contexts"])]
    built = build_model(doc, workdir)
    import torch

    numerics = numerics_module()
    vocab = int(built.model.config.vocab_size)
    contexts = []
    for n, (ctx, (data, digest)) in enumerate(zip(doc["contexts"], files)):
        check_token_ids([int(i) for i in ctx["token_ids"]], vocab, f"contexts[{n}].token_ids")
        tensor, dtype = engine_logits(data, ctx, n, vocab)
        contexts.append({"id": ctx["id"], "token_ids": ctx["token_ids"], "engine_logits": tensor,
                         "dtype": dtype, "digest": digest})
    del files
    load_seconds = time.monotonic() - built.start
    fields = execution_fields(built)
    measured, forward_seconds = numerics.audit(torch, built.model, contexts, doc["audit"],
                                               built.device)
    for m, c in zip(measured, contexts):
        m["engine_dtype"], m["engine_file_sha256"] = c["dtype"], c["digest"]
    with open(numerics.__file__, "rb") as f:
        module_sha256 = sha256_id(f.read())
    return {
        **fields,
        "schema": "assay.audit-output.v1",
        "numerics_module_sha256": module_sha256,
        "member_names": numerics.audit_member_names(doc["audit"]),
        "vocab_size": vocab,
        "contexts": measured,
        "load_seconds": load_seconds,
        "forward_seconds": forward_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "duration_seconds": time.monotonic() - built.start,
    }


# --- layers: hidden states at named boundaries, and activation patching ------------------------

LAYERS_FILE = "layers.safetensors"


def decoder_stack(model):
    """The text model holding embed_tokens, layers and norm: model.model, or deeper
    (model.model.language_model) in a multimodal checkpoint."""
    import torch

    for _, module in model.named_modules():
        if all(hasattr(module, a) for a in ("embed_tokens", "layers", "norm")) and \
                isinstance(module.layers, torch.nn.ModuleList):
            return module
    raise WorkerError("layers.unsupported",
                      f"{type(model).__name__} has no module with embed_tokens, layers and norm")


def boundary_modules(model):
    """[(name, module)] in forward order, named as transformers' modules under `model.`:
    embedding, per layer N input_layernorm, self_attn or linear_attn, post_attention_layernorm,
    mlp and the layer itself, then norm."""
    stack = decoder_stack(model)
    out = [("embedding", stack.embed_tokens)]
    for n, layer in enumerate(stack.layers):
        mixer = "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
        parts = ["input_layernorm", mixer, "post_attention_layernorm", "mlp"]
        absent = [p for p in parts if not hasattr(layer, p)]
        if absent:
            raise WorkerError("layers.unsupported",
                              f"layers.{n} ({type(layer).__name__}) has no {', '.join(absent)}")
        out += [(f"layers.{n}.{p}", getattr(layer, p)) for p in parts]
        out.append((f"layers.{n}", layer))
    out.append(("norm", stack.norm))
    return out


def first_output(output):
    """The hidden state a module returns: attention blocks return (output, weights)."""
    return output[0] if isinstance(output, tuple) else output


def capture_hooks(modules, rows, store):
    """Forward hooks keeping each boundary's rows, widened to float32 (never rounded), in store;
    rows "last" keeps [1, hidden], "all" [T, hidden]. Returns the handles to remove."""
    import torch

    def hook_for(name):
        def hook(module, args, output):
            hidden = first_output(output)[0]
            kept = hidden[-1:] if rows == "last" else hidden
            store[name] = kept.detach().to("cpu", torch.float32, copy=True).contiguous()
        return hook

    return [module.register_forward_hook(hook_for(name)) for name, module in modules]


def substitute_hook(rows, counts):
    """A forward hook returning rows ([T, hidden], any float dtype) in place of the module's
    output, converted to that output's dtype; counts["rounded"] is how many elements the
    conversion changed."""
    def hook(module, args, output):
        hidden = first_output(output)
        new = rows.to(device=hidden.device, dtype=hidden.dtype).reshape(hidden.shape)
        counts["rounded"] = int((new.to(rows.device, rows.dtype) != rows).sum())
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new
    return hook


OPERATOR_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text")  # model_boundaries


def is_operator(name):
    """layers.N.<block>.<operator> (docs/operators.md), as opposed to a layer-level boundary."""
    return name.startswith("layers.") and name.count(".") >= 3


def operator_names(model, layer, n):
    """(self_attn's, mlp's) operator boundaries of decoder layer n, in forward order, for the
    architectures whose operators are named; ([], []) for the others."""
    config = getattr(model.config, "text_config", None) or model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in OPERATOR_TYPES:
        return [], []
    mlp = [f"layers.{n}.mlp.{o}" for o in
           ("gate_proj", "act_fn", "up_proj", "product", "down_proj")]
    if hasattr(layer, "linear_attn"):
        ops = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv", "beta", "g",
               "recurrent", "norm", "out_proj")
        return [f"layers.{n}.linear_attn.{o}" for o in ops], mlp
    norms = hasattr(layer.self_attn, "q_norm")
    attn = ["q_proj"] + (["q_norm"] if norms else []) + ["k_proj"] + (["k_norm"] if norms else [])
    attn += ["v_proj", "q_rotary", "k_rotary", "attention"]
    attn += (["output_gate"] if model_type.startswith("qwen3_5") else []) + ["o_proj"]
    return [f"layers.{n}.self_attn.{o}" for o in attn], mlp


def all_boundary_names(model):
    """Every boundary in forward order, operators inside their blocks (model_boundaries)."""
    stack, out = decoder_stack(model), []
    for name, _ in boundary_modules(model):
        if name.startswith("layers.") and name.count(".") == 2:
            n = int(name.split(".")[1])
            attn, mlp = operator_names(model, stack.layers[n], n)
            out += (attn if name.endswith((".self_attn", ".linear_attn")) else
                    mlp if name.endswith(".mlp") else [])
        out.append(name)
    return out


def attach_points(model, wanted, on_value):
    """Calls on_value(name, value) at every boundary in `wanted` as the forward passes it, value
    [1, T, ...] (a view; q_rotary and k_rotary as [1, T, heads, head_dim]); a tensor it returns
    (of value's shape) replaces the value there. Layer-level boundaries and most operators are
    module outputs, "attention" and "product" the inputs of o_proj and down_proj, q_rotary and
    k_rotary apply_rotary_pos_emb's results. Returns the callables that detach it."""
    import sys

    stack, undo = decoder_stack(model), []

    def output_hook(name):
        def hook(module, args, output):
            value = first_output(output)
            new = on_value(name, value)
            if new is None:
                return None
            return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new
        return hook

    def input_hook(name):
        def hook(module, args):
            new = on_value(name, args[0])
            return None if new is None else (new,) + tuple(args[1:])
        return hook

    for name, module in boundary_modules(model):
        if name in wanted:
            undo.append(module.register_forward_hook(output_hook(name)).remove)
    rotary = {}  # per modeling module: which layer's attention is running
    eager = {}  # per modeling module: the layers whose eager attention output is wanted
    for n, layer in enumerate(stack.layers):
        attn_ops, mlp_ops = operator_names(model, layer, n)
        gated = any(o.endswith(".output_gate") for o in attn_ops)
        for name in attn_ops + mlp_ops:
            if name not in wanted:
                continue
            block, op = name.split(".")[2:4]
            parent = getattr(layer, block)
            if op == "attention" and not gated:
                undo.append(parent.o_proj.register_forward_pre_hook(input_hook(name)).remove)
            elif op == "attention":
                eager.setdefault(sys.modules[type(parent).__module__], set()).add(n)
            elif op in ("output_gate", "product"):
                target = parent.o_proj if op == "output_gate" else parent.down_proj
                undo.append(target.register_forward_pre_hook(input_hook(name)).remove)
            elif op in ("q_rotary", "k_rotary"):
                rotary.setdefault(sys.modules[type(parent).__module__], set()).add(n)
            elif block == "linear_attn" and op in ("conv", "beta", "g", "recurrent", "norm"):
                pass  # below, once per layer
            else:
                undo.append(getattr(parent, op).register_forward_hook(output_hook(name)).remove)
        if hasattr(layer, "linear_attn") and any(
                f"layers.{n}.linear_attn.{o}" in wanted
                for o in ("conv", "beta", "g", "recurrent", "norm")):
            undo += gated_delta_points(layer.linear_attn, f"layers.{n}.linear_attn.", wanted,
                                       on_value)
    running = [None]
    for n, layer in enumerate(stack.layers):
        if any(n in layers for layers in list(rotary.values()) + list(eager.values())):
            undo.append(layer.self_attn.register_forward_pre_hook(
                lambda m, a, n=n: running.__setitem__(0, n)).remove)
    for modeling, layers in rotary.items():
        original = modeling.apply_rotary_pos_emb

        def wrapped(q, k, *args, original=original, layers=layers, **kwargs):
            q, k = original(q, k, *args, **kwargs)
            n = running[0]
            if n in layers:
                out = []
                for part, value in (("q_rotary", q), ("k_rotary", k)):
                    name = f"layers.{n}.self_attn.{part}"
                    new = on_value(name, value.transpose(1, 2)) if name in wanted else None
                    out.append(value if new is None else new.transpose(1, 2))
                q, k = out
            return q, k

        modeling.apply_rotary_pos_emb = wrapped
        undo.append(lambda modeling=modeling, original=original:
                    setattr(modeling, "apply_rotary_pos_emb", original))
    for modeling, layers in eager.items():
        # transformers looks eager_attention_forward up in the modeling module at each call.
        original = modeling.eager_attention_forward

        def attention(*args, original=original, layers=layers, **kwargs):
            out, weights = original(*args, **kwargs)
            n = running[0]
            if n in layers:
                new = on_value(f"layers.{n}.self_attn.attention", out)
                out = out if new is None else new
            return out, weights

        modeling.eager_attention_forward = attention
        undo.append(lambda modeling=modeling, original=original:
                    setattr(modeling, "eager_attention_forward", original))
    # Reversed: wrappers of one function (torch.nn.functional.silu per Gated DeltaNet layer)
    # nest, and come off innermost first.
    return undo[::-1]


def gated_delta_points(module, prefix, wanted, on_value):
    """A Gated DeltaNet's inner operators (transformers' torch fallbacks): "conv", the first
    F.silu inside the module (the causal convolution's activation, [1, C, T], seen as [1, T, C]);
    "beta", "g" and "recurrent", the gates passed to and the output returned by its
    chunk_gated_delta_rule; "norm", its gated RMSNorm's output [T * heads, dim], seen as
    [1, T, heads * dim]. Returns the callables that undo them."""
    import torch

    state = {"inside": False, "silu": 0, "t": 0}

    def enter(m, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        state.update(inside=True, silu=0, t=hidden.shape[1])

    def leave(m, args, kwargs, out):
        state["inside"] = False

    silu = torch.nn.functional.silu

    def conv_silu(x, *args, **kwargs):
        y = silu(x, *args, **kwargs)
        if state["inside"]:
            state["silu"] += 1
            if state["silu"] == 1 and prefix + "conv" in wanted:
                new = on_value(prefix + "conv", y.transpose(1, 2))
                y = y if new is None else new.transpose(1, 2)
        return y

    rule = module.chunk_gated_delta_rule

    def chunk_rule(query, key, value, *args, **kwargs):
        for name in ("beta", "g"):
            if prefix + name in wanted and name in kwargs:
                new = on_value(prefix + name, kwargs[name])
                kwargs[name] = kwargs[name] if new is None else new
        out = rule(query, key, value, *args, **kwargs)
        if prefix + "recurrent" in wanted:
            new = on_value(prefix + "recurrent", out[0])
            out = out if new is None else (new,) + tuple(out[1:])
        return out

    def norm_hook(m, args, out):
        if prefix + "norm" not in wanted:
            return None
        value = out.reshape(1, state["t"], -1)
        new = on_value(prefix + "norm", value)
        return None if new is None else new.reshape(out.shape)

    undo = [module.register_forward_pre_hook(enter, with_kwargs=True).remove,
            module.register_forward_hook(leave, with_kwargs=True).remove,
            module.norm.register_forward_hook(norm_hook).remove]
    torch.nn.functional.silu = conv_silu
    module.chunk_gated_delta_rule = chunk_rule
    undo.append(lambda: setattr(torch.nn.functional, "silu", silu))
    undo.append(lambda: setattr(module, "chunk_gated_delta_rule", rule))
    return undo


def rows_of(value, rows):
    """A boundary's value [1, T, ...] as float32 rows [R, width] (widened, never rounded)."""
    import torch

    kept = value[0].reshape(value.shape[1], -1)
    kept = kept[-1:] if rows == "last" else kept
    return kept.detach().to("cpu", torch.float32, copy=True).contiguous()


def substitute(value, rows, counts):
    """rows [T, width] in value's dtype, shape and strides; counts["rounded"]: how many
    elements the conversion changed."""
    import torch

    converted = rows.to(device=value.device, dtype=value.dtype)
    counts["rounded"] = counts.get("rounded", 0) + int(
        (converted.to(rows.device, rows.dtype) != rows).sum())
    out = torch.empty_like(value)
    out.copy_(converted.reshape(value.shape))
    return out


def last_argmax(logits):
    """The lowest id among the largest of a last-position logits row (torch.argmax's rule)."""
    import torch

    return int(torch.argmax(logits))


def write_safetensors(path, tensors, metadata):
    """tensors: [(name, dtype "F32"/"BF16", shape, raw bytes)], laid out in the order given (the
    safetensors package sorts by name, which would put layers.10 before layers.2)."""
    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def tensor_bytes(t):
    """Raw little-endian bytes of a CPU tensor (bfloat16 through its int16 view)."""
    import torch

    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def safetensors_metadata(data, name):
    """The __metadata__ of a safetensors file's bytes ({} when it has none)."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
    except (ValueError, UnicodeDecodeError) as e:
        raise WorkerError("request.bad_layer_rows", f"{name} has no safetensors header: {e}") from e
    return header.get("__metadata__") or {}


def read_engine_file(patch):
    """The engine's rows file's bytes (patch.fd), checked against the request's digest
    (patch.sha256) before anything is built: a file changed since submission fails the job at
    once, not after the reference forward and every patched one."""
    data = read_fd(patch["fd"], "the engine's rows file")
    want, got = patch.get("sha256"), sha256_id(data)
    if want is not None and got != want:
        raise WorkerError("job.bytes_mismatch", f"the engine's rows file has {got}, not the "
                          f"request's {want}: it changed after submission; nothing was computed")
    return data


def boundary_widths(model, names):
    """{boundary: values per position}: hidden_size, or the operator's output width (common/
    layers.h model_boundaries)."""
    c = getattr(model.config, "text_config", None) or model.config
    hidden = int(decoder_stack(model).embed_tokens.embedding_dim)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    q = heads * head_dim
    kv = int(getattr(c, "num_key_value_heads", None) or heads) * head_dim
    inter = int(getattr(c, "intermediate_size", 0) or 0)
    v_heads = int(getattr(c, "linear_num_value_heads", 0) or 0)
    key = int(getattr(c, "linear_num_key_heads", 0) or 0) * int(
        getattr(c, "linear_key_head_dim", 0) or 0)
    value = v_heads * int(getattr(c, "linear_value_head_dim", 0) or 0)
    gated = str(getattr(c, "model_type", "")).startswith("qwen3_5")
    widths = {"q_proj": 2 * q if gated else q, "q_norm": q, "k_proj": kv, "k_norm": kv,
              "v_proj": kv, "q_rotary": q, "k_rotary": kv, "attention": q, "output_gate": q,
              "o_proj": hidden, "in_proj_qkv": 2 * key + value, "in_proj_z": value,
              "in_proj_b": v_heads, "in_proj_a": v_heads, "conv": 2 * key + value,
              "beta": v_heads, "g": v_heads, "recurrent": value, "norm": value,
              "out_proj": hidden, "gate_proj": inter, "act_fn": inter, "up_proj": inter,
              "product": inter, "down_proj": hidden}
    return {name: widths[name.split(".")[3]] if is_operator(name) else hidden for name in names}


def read_engine_rows(data, widths, ids):
    """The engine's rows file's bytes: every tensor named by a boundary (widths: {name: values
    per position}), F32 or BF16, shape [T, width] (or [width] for T = 1), finite. Returns
    ({name: tensor}, the file's sha256)."""
    import safetensors.torch
    import torch

    expected_ids = canonical_ids_sha256(ids)
    given_ids = safetensors_metadata(data, "the engine's rows file").get("input_token_ids_sha256")
    if given_ids is not None and given_ids != expected_ids:
        raise WorkerError("request.bad_layer_rows",
                          f"the engine's rows file's __metadata__ input_token_ids_sha256 is "
                          f"{given_ids}, not the input's {expected_ids}")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors' own error types differ across versions
        raise WorkerError("request.bad_layer_rows", f"the engine's rows file: {e}") from e
    t = len(ids)
    for name, tensor in tensors.items():
        if name not in widths:
            raise WorkerError("request.bad_layer_rows", f"tensor {name!r} is not a boundary of the model")
        if tensor.dtype not in (torch.float32, torch.bfloat16):
            raise WorkerError("request.bad_layer_rows",
                              f"tensor {name!r} has dtype {tensor.dtype}, not F32 or BF16")
        width = widths[name]
        if list(tensor.shape) not in ([t, width],) + (([width],) if t == 1 else ()):
            raise WorkerError("request.bad_layer_rows",
                              f"tensor {name!r} has shape {list(tensor.shape)}; patching "
                              f"substitutes all {t} positions and needs [{t}, {width}]")
        if not torch.isfinite(tensor).all():
            raise WorkerError("request.bad_layer_rows", f"tensor {name!r} has a non-finite element")
    return tensors, sha256_id(data)


def patch_boundaries(patch, names, tensors):
    """The boundaries to patch, checked: known, in forward order, each in the engine's file."""
    order = {name: i for i, name in enumerate(names)}
    wanted = patch["boundaries"]
    for name in wanted:
        if name not in order:
            raise WorkerError("request.bad_layer_rows",
                              f"patch.boundaries names {name!r}, not a boundary of the model")
        if name not in tensors:
            raise WorkerError("request.bad_layer_rows",
                              f"patch.boundaries names {name!r}; the engine's rows file has no "
                              "tensor of that name")
    if [order[n] for n in wanted] != sorted({order[n] for n in wanted}):
        raise WorkerError("input.invalid",
                          "patch.boundaries are not distinct boundaries in forward order")
    return [(order[n], n) for n in wanted]


def patch_group(name, layers):
    """-1 for embedding, N for layers.N[...], layers for norm (assay-oracle's group_of)."""
    if name == "embedding":
        return -1
    if name == "norm":
        return layers
    return int(name.split(".")[1])


def patch_set(given, k, layers):
    """What a forward patched at given[k] substitutes (indices into given): the engine's output
    of the previous layer, its rows at every boundary of the patched layer up to given[k], and
    given[k]'s siblings (q_rotary with k_rotary), as assay-oracle's patch_set."""
    group = patch_group(given[k], layers)
    previous = None if group == -1 else "embedding" if group == 0 else f"layers.{group - 1}"
    name = given[k]
    sibling = (name.replace(".q_rotary", ".k_rotary") if name.endswith(".self_attn.q_rotary") else
               name.replace(".k_rotary", ".q_rotary") if name.endswith(".self_attn.k_rotary") else
               None)
    return [j for j, g in enumerate(given)
            if (patch_group(g, layers) == group and j <= k) or g == previous or g == sibling]


def run_patching(model, names, ids_tensor, patch, tensors, file_sha256, reference):
    """Forwards patched at one named boundary each, substituting the engine's state there
    (patch_set); first_flip and last_hold are the job's to derive, as from assay-oracle's.
    search "every": one per named boundary; "bisect": none where every substituted row is the
    reference's bit for bit (that forward is the reference's), then the last departed boundary
    and a binary search for the first that gives the candidate, as assay-oracle searches
    (worker/attribution.h)."""
    import torch

    candidate = int(patch["candidate_token_id"])
    search = patch.get("search", "every")
    if search not in ("every", "bisect"):
        raise WorkerError("input.invalid", f"patch.search {search!r} is not \"every\" or \"bisect\"")
    targets = patch_boundaries(patch, names, tensors)
    given = [name for _, name in targets]
    layers = len(decoder_stack(model).layers)
    done, start = {}, time.monotonic()

    def patched(k):
        index, name = targets[k]
        counts = {"rounded": 0}
        substituted = [given[j] for j in patch_set(given, k, layers)]
        undo = attach_points(model, set(substituted),
                             lambda n, v: substitute(v, tensors[n], counts))
        began = time.monotonic()
        try:
            with torch.inference_mode():
                out = model(input_ids=ids_tensor, use_cache=False)
        finally:
            for u in undo:
                u()
        last = out.logits[0, -1].float().contiguous()
        argmax = last_argmax(last)
        done[k] = {"index": index, "name": name, "computed": True, "substituted": substituted,
                   "argmax_token_id": argmax,
                   "becomes_candidate": argmax == candidate,
                   "logits_sha256": sha256_id(last.numpy().tobytes()),
                   "seconds": time.monotonic() - began, "rounded_elements": counts["rounded"]}
        return argmax == candidate

    if search == "every":
        for k in range(len(targets)):
            patched(k)
    else:
        bitwise = [torch.equal(tensors[n].to(torch.float32).reshape(reference["rows"][n].shape),
                               reference["rows"][n]) for n in given]
        departed = []
        for k, (index, name) in enumerate(targets):
            substituted = [given[j] for j in patch_set(given, k, layers)]
            if all(bitwise[j] for j in patch_set(given, k, layers)):
                done[k] = {"index": index, "name": name, "computed": False,
                           "substituted": substituted,
                           "argmax_token_id": reference["argmax"],
                           "becomes_candidate": reference["argmax"] == candidate,
                           "logits_sha256": reference["logits_sha256"], "seconds": 0.0,
                           "rounded_elements": 0}
            else:
                departed.append(k)
        if departed and patched(departed[-1]):
            lo, hi = 0, len(departed) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if patched(departed[mid]):
                    hi = mid
                else:
                    lo = mid + 1
    rows = [done[k] for k in sorted(done)]
    return {"candidate_token_id": candidate, "file_sha256": file_sha256, "search": search,
            "forwards": sum(r["computed"] for r in rows),
            "seconds": time.monotonic() - start, "boundaries": rows}


def layers(doc, workdir):
    patch = doc.get("patch")
    engine_file = read_engine_file(patch) if patch else None
    built = build_model(doc, workdir)
    import torch

    model = built.model
    load_seconds = time.monotonic() - built.start
    rows = doc["rows"]
    if rows not in ("last", "all"):
        raise WorkerError("input.invalid", f"rows {rows!r} is not \"last\" or \"all\"")
    every = all_boundary_names(model)
    operators = doc.get("operators", [])
    if not isinstance(operators, list):
        raise WorkerError("input.invalid", "operators must be an array")
    for name in operators:
        if not isinstance(name, str) or not is_operator(name) or name not in every:
            raise WorkerError("request.bad_layer_rows",
                              f"operator {name!r} is not a boundary of this {type(model).__name__} "
                              "forward (docs/operators.md lists each architecture's operators)")
    names = [n for n in every if not is_operator(n) or n in operators]
    embed = decoder_stack(model).embed_tokens
    vocab, hidden = int(embed.num_embeddings), int(embed.embedding_dim)
    ids = [int(i) for i in doc["token_ids"]]
    check_token_ids(ids, vocab, "token_ids")
    tensors, file_sha256 = (read_engine_rows(engine_file, boundary_widths(model, names), ids)
                            if patch else (None, None))
    if patch and not 0 <= int(patch["candidate_token_id"]) < vocab:
        raise WorkerError("request.invalid_token_id",
                          f"patch.candidate_token_id = {patch['candidate_token_id']} is outside "
                          f"the vocabulary [0, {vocab})")

    ids_tensor = torch.tensor([ids], device=built.device)
    store = {}
    undo = attach_points(model, set(names),
                         lambda name, value: store.__setitem__(name, rows_of(value, rows)))
    forward_start = time.monotonic()
    try:
        with torch.inference_mode():
            out = model(input_ids=ids_tensor, use_cache=False)
    finally:
        for u in undo:
            u()
    logits = out.logits[0, -1].float().cpu().contiguous()
    forward_seconds = time.monotonic() - forward_start
    if not torch.isfinite(logits).all():
        raise WorkerError("oracle.non_finite_logits", "the last position has non-finite logits")
    argmax = last_argmax(logits)

    entries, boundaries = [], []
    for index, name in enumerate(names):
        data = tensor_bytes(store[name])
        entries.append((name, "F32", store[name].shape, data))
        boundaries.append({"index": index, "name": name, "shape": list(store[name].shape),
                           "sha256": sha256_id(data)})
    write_safetensors(os.path.join(workdir, LAYERS_FILE), entries,
                      {"input_token_ids_sha256": canonical_ids_sha256(ids), "rows": rows})
    del entries
    reference = {"rows": store, "argmax": argmax,
                 "logits_sha256": sha256_id(logits.numpy().tobytes())}
    patching = (run_patching(model, names, ids_tensor, patch, tensors, file_sha256, reference)
                if patch else None)
    del store
    return {
        **execution_fields(built),
        "schema": "assay.oracle-layers-output.v1",
        "rows": rows,
        "input_token_count": len(ids),
        "input_token_ids_sha256": canonical_ids_sha256(ids),
        "hidden_size": hidden,
        "vocab_size": int(logits.numel()),
        "rows_file": LAYERS_FILE,
        "boundaries": boundaries,
        "logits_sha256": sha256_id(logits.numpy().tobytes()),
        "argmax_token_id": argmax,
        "argmax_logit": float(logits[argmax]),
        "patching": patching,
        "load_seconds": load_seconds,
        "forward_seconds": forward_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "duration_seconds": time.monotonic() - built.start,
    }


def main(argv):
    modes = {"render-prompt": ("assay.prompt-check-input.v1", render_prompt),
             "next-token": ("assay.oracle-input.v1", next_token),
             "layers": ("assay.oracle-layers-input.v1", layers),
             "envelope": ("assay.numerics-input.v1", envelope),
             "audit": ("assay.audit-input.v1", audit),
             "serve": (SERVE_INPUT, serve)}
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
        if out is not None:
            write_json_atomic(os.path.join(workdir, "output.json"), out)
        return 0
    except WorkerError as e:
        print(f"assay-hf-worker: error [{e.code}]: {middle_cut(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # transformers' own errors: named by class, never swallowed
        print(f"assay-hf-worker: error [hf.{type(e).__name__}]: {middle_cut(str(e))}",
              file=sys.stderr)
        return 2


ERROR_HEAD, ERROR_TAIL = 1000, 400


def middle_cut(message):
    """A message short enough for assayd's excerpt of a worker's stderr (its last 2000 bytes),
    cut in the middle: the head names the value (transformers' list of every model type follows
    it), the tail keeps the end."""
    if len(message) <= ERROR_HEAD + ERROR_TAIL + 64:
        return message
    cut = len(message) - ERROR_HEAD - ERROR_TAIL
    return f"{message[:ERROR_HEAD]} [... {cut} characters cut ...] {message[-ERROR_TAIL:]}"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
