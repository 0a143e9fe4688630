"""assay-capture: an engine's activations at assay's boundaries, as the rows file a
layer-attribution job takes.

    from assay_capture import Capture
    cap = Capture(model, layout="vllm", config=hf_config)     # hooks on the engine's modules
    model(...)                                                 # the engine's own prefill
    digest = cap.write("rows.safetensors", token_ids)          # F32 [T, width] per boundary
    cap.close()

Boundaries are named as assay names them (docs/operators.md): "embedding", per layer N
"layers.N.input_layernorm", the operators of self_attn ("q_proj", "q_norm", "k_proj", "k_norm",
"v_proj", "q_rotary", "k_rotary", "attention", "o_proj"), "layers.N.self_attn",
"layers.N.post_attention_layernorm", the operators of mlp ("gate_proj", "act_fn", "up_proj",
"product", "down_proj"), "layers.N.mlp", "layers.N", then "norm". Each value is kept as rows
[T, width], position-major (heads then head_dim within a position).

A layout maps those names to the engine's modules (Tap): "transformers" (the module names of
transformers' Llama/Qwen2/Qwen3), "vllm" and "sglang" (their fused qkv_proj and gate_up_proj,
split by the config's sizes; rotary_emb's (q, k); the attention layer's output; SiluAndMul's
output as the product; a decoder layer's (hidden, residual) summed), or a dict of your own.
Each captured tensor is cloned at the hook: fused kernels overwrite activations in place after a
hook has seen them (vLLM's rotary embedding rotates q and k inside the qkv buffer).

Dependencies: torch and safetensors.
"""
import dataclasses
import hashlib
import os
import sys

__all__ = ["Capture", "Tap", "layout", "CaptureError"]
__version__ = "0.1.0"


class CaptureError(Exception):
    """A layout that does not fit the model, or a capture that cannot be written."""


@dataclasses.dataclass(frozen=True)
class Tap:
    """Where one boundary's value is in the engine.

    module: the module's name in model.named_modules().
    where: "output" (a forward hook), "input" (a forward pre-hook: the first positional
        argument), "function" (calls of the function `function`, a dotted name looked up in the
        module's Python module, e.g. "apply_rotary_pos_emb" or "F.silu", while the module runs)
        or "attribute" (calls of the module's own attribute `function`, e.g. a Gated DeltaNet's
        chunk_gated_delta_rule).
    index: the element of a tuple result (None: the tensor itself, or a tuple's first element).
    argument: for "attribute" and "function", a keyword argument of the call instead of its
        result.
    call: for "function", keep the n-th call (1-based) in each run of the module only.
    combine: "sum" adds every tensor element of a tuple output (vLLM's (hidden, residual)).
    split: (start, stop) of the last dimension, after flattening a position's values.
    shape: how positions sit in the value: "positions" ([T, ...] or [1, T, ...]),
        "heads_first" ([1, heads, T, dim]: transformers' rotary q and k), "channels_first"
        ([1, channels, T]: a convolution's) or "flat" (any shape whose rows are the positions in
        order, e.g. [T * heads, dim]).
    """
    module: str
    where: str = "output"
    index: int = None
    argument: str = None
    call: int = None
    combine: str = None
    split: tuple = None
    shape: str = "positions"
    function: str = None


def _sizes(config):
    c = config.get("text_config", config) if isinstance(config, dict) else (
        getattr(config, "text_config", None) or config)
    get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (
        lambda k, d=None: getattr(c, k, d))
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim", None) or hidden // heads)
    kv = int(get("num_key_value_heads", None) or heads) * head_dim
    model_type = str(get("model_type", ""))
    layers = int(get("num_hidden_layers"))
    return {"layers": layers, "q": heads * head_dim, "kv": kv,
            "intermediate": int(get("intermediate_size")),
            "qk_norm": model_type in ("qwen3", "qwen3_5", "qwen3_5_text"),
            "gated": model_type in ("qwen3_5", "qwen3_5_text"),
            "layer_types": list(get("layer_types", None) or ["full_attention"] * layers)}


def layout(name, config, prefix="model."):
    """{boundary: Tap} of a built-in layout: "transformers", "vllm" or "sglang"."""
    s = _sizes(config)
    q, kv, inter = s["q"], s["kv"], s["intermediate"]
    taps = {"embedding": Tap(prefix + "embed_tokens"), "norm": Tap(prefix + "norm", index=0)}
    for n in range(s["layers"]):
        L, a, m = f"layers.{n}", f"{prefix}layers.{n}.self_attn", f"{prefix}layers.{n}.mlp"
        t = {f"{L}.input_layernorm": Tap(f"{prefix}layers.{n}.input_layernorm", index=0),
             f"{L}.self_attn": Tap(a, index=0),
             f"{L}.self_attn.o_proj": Tap(f"{a}.o_proj", index=0),
             f"{L}.post_attention_layernorm":
                 Tap(f"{prefix}layers.{n}.post_attention_layernorm", index=0),
             f"{L}.mlp.down_proj": Tap(f"{m}.down_proj", index=0),
             f"{L}.mlp": Tap(m, index=0)}
        if s["qk_norm"]:
            t[f"{L}.self_attn.q_norm"] = Tap(f"{a}.q_norm", index=0)
            t[f"{L}.self_attn.k_norm"] = Tap(f"{a}.k_norm", index=0)
        if name == "transformers" and s["layer_types"][n] == "linear_attention":
            # Qwen3.5's Gated DeltaNet (transformers' torch fallbacks) instead of self_attn.
            g = f"{prefix}layers.{n}.linear_attn"
            t = {k: v for k, v in t.items() if ".self_attn" not in k}
            t[f"{L}.linear_attn"] = Tap(g)
            for op in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                t[f"{L}.linear_attn.{op}"] = Tap(f"{g}.{op}")
            t[f"{L}.linear_attn.conv"] = Tap(g, where="function", function="F.silu", call=1,
                                             shape="channels_first")
            for arg in ("beta", "g"):
                t[f"{L}.linear_attn.{arg}"] = Tap(g, where="attribute",
                                                  function="chunk_gated_delta_rule", argument=arg)
            t[f"{L}.linear_attn.recurrent"] = Tap(g, where="attribute", index=0,
                                                  function="chunk_gated_delta_rule")
            t[f"{L}.linear_attn.norm"] = Tap(f"{g}.norm", shape="flat")
        if name == "transformers" and s["layer_types"][n] != "linear_attention" and s["gated"]:
            # Qwen3.5's gated attention: the gate multiplies eager attention's output.
            t[f"{L}.self_attn.q_proj"] = Tap(f"{a}.q_proj")
            for op in ("k_proj", "v_proj"):
                t[f"{L}.self_attn.{op}"] = Tap(f"{a}.{op}")
            for i, op in enumerate(("q_rotary", "k_rotary")):
                t[f"{L}.self_attn.{op}"] = Tap(a, where="function", index=i, shape="heads_first",
                                               function="apply_rotary_pos_emb")
            t[f"{L}.self_attn.attention"] = Tap(a, where="function", index=0,
                                                function="eager_attention_forward")
            t[f"{L}.self_attn.output_gate"] = Tap(f"{a}.o_proj", where="input")
        elif name == "transformers" and s["layer_types"][n] != "linear_attention":
            for op in ("q_proj", "k_proj", "v_proj"):
                t[f"{L}.self_attn.{op}"] = Tap(f"{a}.{op}")
            for i, op in enumerate(("q_rotary", "k_rotary")):
                t[f"{L}.self_attn.{op}"] = Tap(a, where="function", index=i, shape="heads_first",
                                               function="apply_rotary_pos_emb")
            t[f"{L}.self_attn.attention"] = Tap(f"{a}.o_proj", where="input")
        if name == "transformers":
            for op in ("gate_proj", "act_fn", "up_proj"):
                t[f"{L}.mlp.{op}"] = Tap(f"{m}.{op}")
            t[f"{L}.mlp.product"] = Tap(f"{m}.down_proj", where="input")
            t[L] = Tap(f"{prefix}layers.{n}", index=0)
        elif name in ("vllm", "sglang"):
            for op, part in (("q_proj", (0, q)), ("k_proj", (q, q + kv)),
                             ("v_proj", (q + kv, q + 2 * kv))):
                t[f"{L}.self_attn.{op}"] = Tap(f"{a}.qkv_proj", index=0, split=part)
            t[f"{L}.self_attn.q_rotary"] = Tap(f"{a}.rotary_emb", index=0)
            t[f"{L}.self_attn.k_rotary"] = Tap(f"{a}.rotary_emb", index=1)
            t[f"{L}.self_attn.attention"] = Tap(f"{a}.attn", index=0)
            t[f"{L}.mlp.gate_proj"] = Tap(f"{m}.gate_up_proj", index=0, split=(0, inter))
            t[f"{L}.mlp.up_proj"] = Tap(f"{m}.gate_up_proj", index=0, split=(inter, 2 * inter))
            t[f"{L}.mlp.product"] = Tap(f"{m}.act_fn", index=0)  # SiluAndMul: act and product
            t[L] = Tap(f"{prefix}layers.{n}", combine="sum")
        else:
            raise CaptureError(f"layout {name!r} is not \"transformers\", \"vllm\" or \"sglang\"")
        taps.update(t)
    return taps


class Capture:
    """Hooks that keep each boundary's value from the engine's forwards (the last one wins)."""

    def __init__(self, model, layout="transformers", config=None, boundaries=None, prefix="model."):
        """layout: a built-in name (needs config: the model's transformers config, or its
        config.json as a dict) or {boundary: Tap}; boundaries: the names to keep (default all
        of the layout's)."""
        self._taps = (globals()["layout"](layout, config if config is not None else
                                          getattr(model, "config", None), prefix)
                      if isinstance(layout, str) else dict(layout))
        if boundaries is not None:
            unknown = sorted(set(boundaries) - set(self._taps))
            if unknown:
                raise CaptureError(f"no tap for boundaries {unknown[:5]}")
            self._taps = {b: self._taps[b] for b in boundaries}
        self.values = {}
        self._undo = []
        modules = dict(model.named_modules())
        by_module = {}
        for boundary, tap in self._taps.items():
            if tap.module not in modules:
                raise CaptureError(f"boundary {boundary!r}: the model has no module {tap.module!r}")
            by_module.setdefault((tap.module, tap.where, tap.function), []).append((boundary, tap))
        for (name, where, function), taps in by_module.items():
            module = modules[name]
            if where == "output":
                hook = module.register_forward_hook(
                    lambda m, args, out, taps=taps: self._keep(taps, out))
            elif where == "input":
                hook = module.register_forward_pre_hook(
                    lambda m, args, taps=taps: self._keep(taps, args[0]))
            elif where == "function":
                hook = self._wrap_function(module, function, taps)
            elif where == "attribute":
                hook = self._wrap_attribute(module, function, taps)
            else:
                raise CaptureError(f"boundary {taps[0][0]!r}: where {where!r} is not "
                                   "\"output\", \"input\" or \"function\"")
            self._undo.append(hook.remove)

    def _wrap_function(self, module, function, taps):
        owner = sys.modules[type(module).__module__]
        *path, attr = function.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None:
            raise CaptureError(f"{type(module).__module__} has no function {function!r}")
        state = {"inside": 0, "calls": 0}

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if state["inside"]:
                state["calls"] += 1
                self._keep([(b, t) for b, t in taps if t.call in (None, state["calls"])],
                           result, kwargs)
            return result

        def enter(m, a):
            state["inside"] += 1
            state["calls"] = 0

        setattr(owner, attr, wrapped)
        enter = module.register_forward_pre_hook(enter)
        leave = module.register_forward_hook(
            lambda m, a, o: state.__setitem__("inside", state["inside"] - 1))

        class Undo:
            @staticmethod
            def remove():
                setattr(owner, attr, original)
                enter.remove()
                leave.remove()
        return Undo

    def _wrap_attribute(self, module, function, taps):
        original = getattr(module, function, None)
        if not callable(original):
            raise CaptureError(f"{type(module).__name__} has no callable attribute {function!r}")

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            self._keep(taps, result, kwargs)
            return result

        setattr(module, function, wrapped)

        class Undo:
            @staticmethod
            def remove():
                setattr(module, function, original)
        return Undo

    def _keep(self, taps, value, kwargs=None):
        import torch

        for boundary, tap in taps:
            v = value
            if tap.argument is not None:
                v = (kwargs or {}).get(tap.argument)
            elif tap.combine == "sum":
                parts = [p for p in (v if isinstance(v, (tuple, list)) else (v,))
                         if isinstance(p, torch.Tensor)]
                v = parts[0]
                for p in parts[1:]:
                    v = v + p
            elif isinstance(v, (tuple, list)):
                v = v[tap.index or 0]
            if not isinstance(v, torch.Tensor):
                raise CaptureError(f"boundary {boundary!r}: {tap.module} gave {type(v).__name__}")
            # Cloned now: a fused kernel may overwrite this memory once the hook returns.
            self.values[boundary] = (v.detach().clone(), tap)
        return None

    def rows(self, token_count, rows="all"):
        """{boundary: F32 CPU tensor [R, width]} of the last forward, R = T or 1."""
        import torch

        out = {}
        for boundary, (v, tap) in self.values.items():
            if tap.shape == "heads_first":
                v = v.transpose(-3, -2)  # [.., heads, T, dim] -> [.., T, heads, dim]
            elif tap.shape == "channels_first":
                v = v.transpose(-2, -1)  # [.., channels, T] -> [.., T, channels]
            elif tap.shape == "flat":
                v = v.reshape(token_count, -1)
            if v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == token_count:
                v = v[0]  # transformers' batch of one: [1, T, ...]
            if v.dim() < 1 or v.shape[0] != token_count:
                raise CaptureError(f"boundary {boundary!r}: shape {list(v.shape)} does not hold "
                                   f"{token_count} positions first")
            v = v.reshape(token_count, -1)
            if tap.split:
                v = v[:, tap.split[0]:tap.split[1]]
            if rows == "last":
                v = v[-1:]
            out[boundary] = v.to("cpu", torch.float32, copy=True).contiguous()
        return out

    def write(self, path, token_ids, rows="all", model_content_sha256=None):
        """Writes the rows file (tensors F32, __metadata__ input_token_ids_sha256 as assay
        hashes the ids) atomically; returns "sha256:<hex>" of the file, the digest the request
        names."""
        import json

        import safetensors.torch

        if rows not in ("all", "last"):
            raise CaptureError(f"rows {rows!r} is not \"all\" or \"last\"")
        ids = [int(i) for i in token_ids]
        if not ids:
            raise CaptureError("token_ids is empty")
        if not self.values:
            raise CaptureError("nothing was captured: run the model's forward after attaching")
        canonical = json.dumps(ids, separators=(",", ":")).encode()
        metadata = {"input_token_ids_sha256": "sha256:" + hashlib.sha256(canonical).hexdigest()}
        if model_content_sha256:
            metadata["model_content_sha256"] = model_content_sha256
        tmp = f"{path}.tmp{os.getpid()}"
        safetensors.torch.save_file(self.rows(len(ids), rows), tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            digest = "sha256:" + hashlib.sha256(f.read()).hexdigest()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return digest

    def close(self):
        """Removes every hook and restores every wrapped function."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
