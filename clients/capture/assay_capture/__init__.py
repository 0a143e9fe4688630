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

    module: the module's name in model.named_modules() ("{n}" is the layer index).
    where: "output" (a forward hook), "input" (a forward pre-hook: the first positional
        argument) or "function" (calls of the Python function `function` of the module's
        Python module while the module runs: transformers' apply_rotary_pos_emb).
    index: the element of a tuple output (None: the tensor itself, or a tuple's first element).
    combine: "sum" adds every tensor element of a tuple output (vLLM's (hidden, residual)).
    split: (start, stop) of the last dimension, after flattening a position's values.
    heads_first: the value is [.., heads, T, head_dim] (transformers' rotary q and k).
    """
    module: str
    where: str = "output"
    index: int = None
    combine: str = None
    split: tuple = None
    heads_first: bool = False
    function: str = None


def _sizes(config):
    c = getattr(config, "text_config", None) or config
    get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (
        lambda k, d=None: getattr(c, k, d))
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim", None) or hidden // heads)
    kv = int(get("num_key_value_heads", None) or heads) * head_dim
    return {"layers": int(get("num_hidden_layers")), "q": heads * head_dim, "kv": kv,
            "intermediate": int(get("intermediate_size")), "qk_norm": get("model_type") == "qwen3"}


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
        if name == "transformers":
            for op in ("q_proj", "k_proj", "v_proj"):
                t[f"{L}.self_attn.{op}"] = Tap(f"{a}.{op}")
            for i, op in enumerate(("q_rotary", "k_rotary")):
                t[f"{L}.self_attn.{op}"] = Tap(a, where="function", index=i, heads_first=True,
                                               function="apply_rotary_pos_emb")
            t[f"{L}.self_attn.attention"] = Tap(f"{a}.o_proj", where="input")
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
            else:
                raise CaptureError(f"boundary {taps[0][0]!r}: where {where!r} is not "
                                   "\"output\", \"input\" or \"function\"")
            self._undo.append(hook.remove)

    def _wrap_function(self, module, function, taps):
        python_module = sys.modules[type(module).__module__]
        original = getattr(python_module, function, None)
        if original is None:
            raise CaptureError(f"{python_module.__name__} has no function {function!r}")
        inside = [0]

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            if inside[0]:
                self._keep(taps, result)
            return result

        setattr(python_module, function, wrapped)
        enter = module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, inside[0] + 1))
        leave = module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1))

        class Undo:
            @staticmethod
            def remove():
                setattr(python_module, function, original)
                enter.remove()
                leave.remove()
        return Undo

    def _keep(self, taps, value):
        import torch

        for boundary, tap in taps:
            v = value
            if tap.combine == "sum":
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
            if tap.heads_first:
                v = v.transpose(-3, -2)  # [.., heads, T, dim] -> [.., T, heads, dim]
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
