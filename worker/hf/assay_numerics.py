"""The numerics envelope of a state: its last-position logits under named legitimate executions.

A legitimate execution (schemas/numerics-output.schema.json says the same) computes the same
model with the same weights and the same math as transformers' eager module, every op's result
rounded to the same dtype at the same points as the eager reference (or kept in higher
precision), and differs only in reduction order, blocking, kernel choice, batch composition,
cache use or accumulation precision (never below float32). The members:

  reference        the eager forward itself (its logits are the oracle's, bit for bit)
  reduction:<seed> every matmul (the linear layers, attention's two products) split along its
                   inner dimension at seeded points, the float32 partial products added in a
                   seeded order before the one rounding to the activation dtype; softmax's and
                   RMSNorm's float32 sums split and added the same way
  sdpa             transformers' scaled-dot-product attention instead of eager
  kv-cache         prefill of all but the last id with a KV cache, then one decode step
  batched:<B>      the state as row 0 of a right-padded batch of B (the other rows: the other
                   states given, else shorter prefixes of its own ids)
  fp32             every activation in float32 from the same bf16 weights: a fact about the
                   stored model, not a member of the bf16 envelope

Used by assay_hf_worker.py's `envelope` mode; tests/numerics imports it as well.
"""
import contextlib
import hashlib
import random

TOP_K = 5


def sha256_id(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def member_names(spec):
    """The bf16 members a request's numerics spec asks for, in the order they run."""
    names = ["reference"]
    names += [f"reduction:{s}" for s in range(int(spec.get("reduction_seeds", 16)))]
    if spec.get("sdpa", True):
        names.append("sdpa")
    if spec.get("kv_cache", True):
        names.append("kv-cache")
    names += [f"batched:{b}" for b in spec.get("batch_sizes", [4])]
    return names


def _segments(k, rng):
    """Seeded split of range(k) into 2..8 contiguous segments (one when k < 2)."""
    if k < 2:
        return [(0, k)]
    count = rng.randint(2, min(8, k))
    cuts = sorted(rng.sample(range(1, k), count - 1))
    bounds = [0] + cuts + [k]
    return list(zip(bounds[:-1], bounds[1:]))


def _seeded_sum(parts, rng):
    """The float32 parts added one by one in a seeded order."""
    order = list(range(len(parts)))
    rng.shuffle(order)
    total = parts[order[0]]
    for i in order[1:]:
        total = total + parts[i]
    return total


@contextlib.contextmanager
def reduction_order(torch, seed):
    """While active, torch.matmul, F.linear, F.softmax and Tensor.mean over the last dimension
    compute their sums in a seeded split and order (float32 partials, one final rounding)."""
    F = torch.nn.functional
    matmul, linear, softmax, mean = torch.matmul, F.linear, F.softmax, torch.Tensor.mean
    rng = random.Random(seed * 1_000_003 + 17)

    def split_f32(a, b):
        parts = [matmul(a[..., lo:hi].float(), b[..., lo:hi, :].float())
                 for lo, hi in _segments(a.shape[-1], rng)]
        return _seeded_sum(parts, rng)

    def split_matmul(a, b):
        if a.dim() < 2 or b.dim() < 2 or a.shape[-1] < 2:
            return matmul(a, b)
        return split_f32(a, b).to(torch.promote_types(a.dtype, b.dtype))

    def split_linear(x, weight, bias=None):
        if x.shape[-1] < 2:
            return linear(x, weight, bias)
        y = split_f32(x, weight.t())
        # The bias joins the float32 sum before the rounding, as a GEMM epilogue adds it.
        if bias is not None:
            y = y + bias.float()
        return y.to(torch.promote_types(x.dtype, weight.dtype))

    def last_dim_sum(x):
        n = x.shape[-1]
        parts = [x[..., lo:hi].sum(-1, keepdim=True) for lo, hi in _segments(n, rng)]
        return _seeded_sum(parts, rng)

    def split_softmax(x, dim=None, _stacklevel=3, dtype=None):
        if dim not in (-1, x.dim() - 1):
            return softmax(x, dim=dim, dtype=dtype)
        x32 = x.float()
        e = torch.exp(x32 - x32.amax(-1, keepdim=True))
        out = e / last_dim_sum(e)
        return out.to(dtype if dtype is not None else x.dtype)

    def split_mean(x, dim=None, keepdim=False, dtype=None):
        last = dim in (-1, x.dim() - 1) or dim in ((-1,), (x.dim() - 1,), [-1], [x.dim() - 1])
        if not last or x.dtype != torch.float32 or dtype is not None:
            return mean(x, dim=dim, keepdim=keepdim, dtype=dtype) if dim is not None else \
                mean(x)
        out = last_dim_sum(x) / x.shape[-1]
        return out if keepdim else out.squeeze(-1)

    own_mean = "mean" in vars(torch.Tensor)  # else inherited from the C base class
    torch.matmul, F.linear, F.softmax, torch.Tensor.mean = (
        split_matmul, split_linear, split_softmax, split_mean)
    try:
        yield
    finally:
        torch.matmul, F.linear, F.softmax = matmul, linear, softmax
        if own_mean:
            torch.Tensor.mean = mean
        else:
            del torch.Tensor.mean


@contextlib.contextmanager
def attention(model, implementation):
    """The model's attention implementation switched for the block."""
    before = getattr(model.config, "_attn_implementation", "eager")
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def last_logits(torch, model, ids, device):
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    return out.logits[0, -1]


def kv_cache_logits(torch, model, ids, device):
    if len(ids) < 2:
        return last_logits(torch, model, ids, device)
    prefill = model(input_ids=torch.tensor([ids[:-1]], device=device), use_cache=True)
    step = model(input_ids=torch.tensor([ids[-1:]], device=device),
                 past_key_values=prefill.past_key_values, use_cache=True)
    return step.logits[0, -1]


def batched_logits(torch, model, ids, others, size, device):
    """Row 0 of a right-padded batch of `size`: the state, then `others` (each a list of ids),
    else its own shorter prefixes."""
    rows = [list(ids)]
    pool = [o for o in others if o] or [ids[:max(1, len(ids) - j)] for j in range(1, size)]
    while len(rows) < size:
        rows.append(list(pool[(len(rows) - 1) % len(pool)]))
    width = max(len(r) for r in rows)
    input_ids = torch.zeros((size, width), dtype=torch.int64)
    mask = torch.zeros((size, width), dtype=torch.int64)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False)
    return out.logits[0, len(ids) - 1]


def member_logits(torch, model, name, ids, others, device):
    """Float32 last-position logits of member `name` (the model in its bf16 dtype)."""
    if name == "reference":
        logits = last_logits(torch, model, ids, device)
    elif name.startswith("reduction:"):
        with reduction_order(torch, int(name.split(":")[1])):
            logits = last_logits(torch, model, ids, device)
    elif name == "sdpa":
        with attention(model, "sdpa"):
            logits = last_logits(torch, model, ids, device)
    elif name == "kv-cache":
        logits = kv_cache_logits(torch, model, ids, device)
    elif name.startswith("batched:"):
        logits = batched_logits(torch, model, ids, others, int(name.split(":")[1]), device)
    else:
        raise ValueError(f"unknown numerics member {name!r}")
    return logits.float().cpu().contiguous()


def figures(name, logits, candidate_ids):
    """What the verdict needs of one member: its argmax (first index of the maximum), whether
    the top is tied, the top-two margin, the top tokens, each candidate's logit and rank."""
    values = logits.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    top = order[:TOP_K]
    rank = lambda v: 1 + sum(1 for x in values if x > v)  # noqa: E731
    return {
        "name": name,
        "argmax": top[0],
        "argmax_logit": values[top[0]],
        "top_tie": values[top[0]] == values[top[1]],
        "margin": values[top[0]] - values[top[1]],
        "top": [{"token_id": t, "logit": values[t]} for t in top],
        "candidates": [{"token_id": c, "logit": values[c], "rank": rank(values[c])}
                       for c in candidate_ids],
        "logits_sha256": sha256_id(logits.numpy().tobytes()),
    }


def envelope(torch, model, states, spec, device):
    """For each state {index, input_token_ids, candidate_tokens}: every bf16 member's figures,
    then (after all states, the model made float32) the fp32 fact. Returns the states' documents
    and the seconds spent in forwards."""
    import time

    names = member_names(spec)
    all_ids = [[int(i) for i in s["input_token_ids"]] for s in states]
    out, seconds = [], 0.0
    with torch.inference_mode():
        for n, state in enumerate(states):
            ids = all_ids[n]
            others = [o for j, o in enumerate(all_ids) if j != n]
            candidates = sorted({int(c["token_id"]) for c in state["candidate_tokens"]})
            members = []
            for name in names:
                start = time.monotonic()
                logits = member_logits(torch, model, name, ids, others, device)
                seconds += time.monotonic() - start
                if not torch.isfinite(logits).all():
                    raise ValueError(f"member {name} has non-finite logits")
                members.append(figures(name, logits, candidates))
            out.append({"index": state["index"], "members": members})
        if spec.get("fp32", True):
            model.to(torch.float32)
            for n, state in enumerate(states):
                candidates = sorted({int(c["token_id"]) for c in state["candidate_tokens"]})
                start = time.monotonic()
                logits = last_logits(torch, model, all_ids[n], device).float().cpu()
                seconds += time.monotonic() - start
                out[n]["fp32"] = figures("fp32", logits, candidates)
    return out, seconds


# --- the engine audit: an engine's distance to the model's float32 answer over a panel ----------

def audit_member_names(spec):
    """The bf16 members an audit measures, in order: the reference, reduction:<seed>, sdpa."""
    names = ["reference"]
    names += [f"reduction:{s}" for s in range(int(spec.get("reduction_seeds", 8)))]
    if spec.get("sdpa", True):
        names.append("sdpa")
    return names


def all_logits(torch, model, name, ids, device):
    """Member `name`'s logits at every position of `ids`: [positions, vocab], float32."""
    def forward():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        return out.logits[0]

    if name == "reference":
        logits = forward()
    elif name.startswith("reduction:"):
        with reduction_order(torch, int(name.split(":")[1])):
            logits = forward()
    elif name == "sdpa":
        with attention(model, "sdpa"):
            logits = forward()
    else:
        raise ValueError(f"unknown audit member {name!r}")
    return logits.float().cpu()


def squared_distance(torch, logits, anchor):
    """Per position: the mean over the vocabulary of the squared difference of the two
    log-softmaxes, in float64 (a constant shift of an engine's logits changes nothing)."""
    x = torch.log_softmax(logits.double(), -1)
    return ((x - anchor) ** 2).mean(-1)


def audit(torch, model, contexts, spec, device):
    """For each context {id, token_ids, engine_logits: [positions, vocab] tensor}: per position
    the engine's and every member's squared distance to the float32 model's log-softmax, and how
    many positions the engine's argmax differs from the reference's. Returns the contexts'
    documents and the seconds spent in forwards."""
    import copy
    import time

    names = audit_member_names(spec)
    out, seconds = [], 0.0
    with torch.inference_mode():
        anchor_model = copy.deepcopy(model).to(torch.float32)
        for ctx in contexts:
            ids = [int(i) for i in ctx["token_ids"]]
            start = time.monotonic()
            anchor = torch.log_softmax(
                all_logits(torch, anchor_model, "reference", ids, device).double(), -1)
            members, reference_argmax = [], None
            for name in names:
                logits = all_logits(torch, model, name, ids, device)
                if not torch.isfinite(logits).all():
                    raise ValueError(f"member {name} has non-finite logits")
                if name == "reference":
                    reference_argmax = logits.argmax(-1)
                members.append(squared_distance(torch, logits, anchor).tolist())
            seconds += time.monotonic() - start
            engine = ctx["engine_logits"].float()
            out.append({
                "id": ctx["id"],
                "positions": len(ids),
                "engine": squared_distance(torch, engine, anchor).tolist(),
                "members": members,
                "argmax_differs": int((engine.argmax(-1) != reference_argmax).sum()),
            })
        del anchor_model
    return out, seconds
