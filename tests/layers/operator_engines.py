"""Engines for operator-level attribution tests, built apart from assay's classifier: each is
transformers' own forward with one deliberate change inside one operator, or a model with fused
modules as vLLM builds Qwen3. Nothing here imports assay's workers; rows are captured with the
capture kit (clients/capture), the way an engine's developers would.

Changes (CHANGES, each applied to one decoder layer):
  bf16-rope     the rotary tables from angles computed in bfloat16 (positions x inv_freq rounded
                to bfloat16 before cos and sin) instead of float32
  bf16-softmax  the attention's softmax in bfloat16 (exponentials, sum and quotient each rounded)
  q_norm-eps    q_norm's epsilon ten times the config's
  tanh-gelu     the MLP's activation as tanh-approximated GELU instead of exact GELU
  bf16-decay    a Gated DeltaNet's decay g = -exp(A_log) softplus(a + dt_bias) with the softplus
                rounded to bfloat16 (the rest in float32, as the reference)

screen() finds ids on which a change flips the next token by one fixed rule: the first of the
sequences seeded 0, 1, ..., N-1 (L ids each, drawn uniformly by random.Random(seed)) whose argmax
with the change differs from the argmax without it, each sequence run alone.
"""
import contextlib
import random
import sys

import torch
import transformers

CHANGES = ("bf16-rope", "bf16-softmax", "q_norm-eps", "tanh-gelu", "bf16-decay")
# The layer each change is made in and the operator it is inside: what a correct attribution
# names.
CHANGED_LAYER = {"bf16-rope": 1, "bf16-softmax": 1, "q_norm-eps": 1, "tanh-gelu": 1,
                 "bf16-decay": 0}
CHANGED_OPERATOR = {"bf16-rope": "self_attn.q_rotary", "bf16-softmax": "self_attn.attention",
                    "q_norm-eps": "self_attn.q_norm", "tanh-gelu": "mlp.act_fn",
                    "bf16-decay": "linear_attn.g"}


def load(model_dir, threads=2):
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@contextlib.contextmanager
def changed(model, kind, layer):
    """The model with one deliberate change in decoder layer `layer`, undone on exit."""
    if kind is None:
        yield
        return
    block = model.model.layers[layer]
    attn = getattr(block, "self_attn", None)
    undo = []
    if kind == "bf16-rope":
        modeling = sys.modules[type(attn).__module__]
        original, inside = modeling.apply_rotary_pos_emb, [False]
        inv_freq = model.model.rotary_emb.inv_freq

        def rope(q, k, cos, sin, *args, **kwargs):
            if not inside[0]:
                return original(q, k, cos, sin, *args, **kwargs)
            t = q.shape[-2]
            angles = torch.arange(t, dtype=torch.bfloat16)[:, None] * inv_freq.to(torch.bfloat16)
            emb = torch.cat((angles, angles), dim=-1)
            c, s = emb.cos()[None, None], emb.sin()[None, None]
            return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

        modeling.apply_rotary_pos_emb = rope
        undo.append(lambda: setattr(modeling, "apply_rotary_pos_emb", original))
        undo.append(attn.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)).remove)
        undo.append(attn.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)).remove)
    elif kind == "bf16-softmax":
        original, inside = torch.nn.functional.softmax, [False]

        def softmax(x, dim=None, dtype=None, **kwargs):
            if not inside[0]:
                return original(x, dim=dim, dtype=dtype, **kwargs)
            x = x.to(torch.bfloat16)
            e = torch.exp(x - x.amax(dim, keepdim=True))
            return e / e.sum(dim, keepdim=True)

        torch.nn.functional.softmax = softmax
        undo.append(lambda: setattr(torch.nn.functional, "softmax", original))
        undo.append(attn.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)).remove)
        undo.append(attn.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)).remove)
    elif kind == "q_norm-eps":
        norm = attn.q_norm
        eps = norm.variance_epsilon
        norm.variance_epsilon = eps * 10
        undo.append(lambda: setattr(norm, "variance_epsilon", eps))
    elif kind == "bf16-decay":
        gdn = block.linear_attn
        original, inside = torch.nn.functional.softplus, [False]

        def softplus(x, *args, **kwargs):
            y = original(x, *args, **kwargs)
            return y.to(torch.bfloat16).to(y.dtype) if inside[0] else y

        torch.nn.functional.softplus = softplus
        undo.append(lambda: setattr(torch.nn.functional, "softplus", original))
        undo.append(gdn.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)).remove)
        undo.append(gdn.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)).remove)
    elif kind == "tanh-gelu":
        act = block.mlp.act_fn
        act.forward = lambda x: torch.nn.functional.gelu(x, approximate="tanh")
        undo.append(lambda: act.__dict__.pop("forward"))
    else:
        raise ValueError(f"unknown change {kind!r}")
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def next_token(model, ids, kind=None, layer=1):
    with changed(model, kind, layer), torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    return int(torch.argmax(logits.float()))


def screen(model, kind, layer=1, count=2000, length=16):
    """(ids, reference token, changed token) of the first seeded sequence the change flips;
    None when none of `count` does. One batched forward each way proposes; each proposal is
    confirmed alone."""
    vocab = model.config.vocab_size
    seqs = []
    for seed in range(count):
        rng = random.Random(seed)
        seqs.append([rng.randrange(vocab) for _ in range(length)])
    argmaxes = []
    for k in (None, kind):
        with changed(model, k, layer), torch.inference_mode():
            logits = model(input_ids=torch.tensor(seqs), use_cache=False).logits[:, -1]
        argmaxes.append(logits.float().argmax(-1))
    for seed in torch.nonzero(argmaxes[0] != argmaxes[1]).flatten().tolist():
        a, b = next_token(model, seqs[seed]), next_token(model, seqs[seed], kind, layer)
        if a != b:
            return seqs[seed], a, b
    return None


# --- a Qwen3 with fused modules, named and shaped as vLLM's -------------------------------------


class FusedLinear(torch.nn.Module):
    """vLLM's QKVParallelLinear / MergedColumnParallelLinear: one module, one output holding
    its parts side by side, returned as (output, bias)."""

    def __init__(self, *linears):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(l.weight.detach().clone(), requires_grad=False) for l in linears])

    def forward(self, x):
        return torch.cat([torch.nn.functional.linear(x, w) for w in self.weights], dim=-1), None


class RowLinear(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().clone(), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class RMSNorm(torch.nn.Module):
    """vLLM's RMSNorm: with a residual, adds it first and returns (normed, sum)."""

    def __init__(self, norm):
        super().__init__()
        self.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
        self.eps = norm.variance_epsilon

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(torch.nn.Module):
    """vLLM's rotary embedding: rotates q and k [T, heads * head_dim] in place."""

    def __init__(self, hf_rotary, head_dim):
        super().__init__()
        self.hf_rotary, self.head_dim = hf_rotary, head_dim

    def forward(self, positions, q, k):
        x = q.new_zeros(1)
        cos, sin = self.hf_rotary(x, positions[None])
        cos, sin = cos[0][:, None], sin[0][:, None]  # [T, 1, D]
        for t in (q, k):
            v = t.view(t.shape[0], -1, self.head_dim)
            v.copy_(v * cos + rotate_half(v) * sin)
        return q, k


class Attention(torch.nn.Module):
    """vLLM's Attention layer: q, k, v [T, heads * head_dim] in, [T, heads * head_dim] out."""

    def __init__(self, hf_attn):
        super().__init__()
        self.hf_attn = [hf_attn]  # not a submodule
        self.heads = hf_attn.config.num_attention_heads
        self.head_dim = hf_attn.head_dim

    def forward(self, q, k, v):
        modeling = sys.modules[type(self.hf_attn[0]).__module__]
        t = q.shape[0]
        q, k, v = (x.contiguous().view(1, t, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
        mask = torch.full((t, t), torch.finfo(torch.bfloat16).min).triu(1)[None, None]
        out, _ = modeling.eager_attention_forward(self.hf_attn[0], q, k, v,
                                                  mask.to(torch.bfloat16), dropout=0.0,
                                                  scaling=self.hf_attn[0].scaling)
        return out.reshape(t, -1).contiguous()


class SelfAttention(torch.nn.Module):
    def __init__(self, hf_attn, hf_rotary):
        super().__init__()
        self.q_size = hf_attn.q_proj.out_features
        self.kv_size = hf_attn.k_proj.out_features
        self.head_dim = hf_attn.head_dim
        self.qkv_proj = FusedLinear(hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj)
        self.q_norm, self.k_norm = RMSNorm(hf_attn.q_norm), RMSNorm(hf_attn.k_norm)
        self.rotary_emb = RotaryEmbedding(hf_rotary, self.head_dim)
        self.attn = Attention(hf_attn)
        self.o_proj = RowLinear(hf_attn.o_proj)

    def forward(self, positions, hidden):
        qkv, _ = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(q.shape[0], -1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(k.shape[0], -1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class SiluAndMul(torch.nn.Module):
    def forward(self, x):
        half = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


class MLP(torch.nn.Module):
    def __init__(self, hf_mlp):
        super().__init__()
        self.gate_up_proj = FusedLinear(hf_mlp.gate_proj, hf_mlp.up_proj)
        self.act_fn = SiluAndMul()
        self.down_proj = RowLinear(hf_mlp.down_proj)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class DecoderLayer(torch.nn.Module):
    def __init__(self, hf_layer, hf_rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm)
        self.self_attn = SelfAttention(hf_layer.self_attn, hf_rotary)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm)
        self.mlp = MLP(hf_layer.mlp)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Decoder(torch.nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        inner = hf_model.model
        self.embed_tokens = torch.nn.Embedding.from_pretrained(inner.embed_tokens.weight.detach())
        self.layers = torch.nn.ModuleList(DecoderLayer(l, inner.rotary_emb) for l in inner.layers)
        self.norm = RMSNorm(inner.norm)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class FusedQwen3(torch.nn.Module):
    """Qwen3 as vLLM lays it out (model.layers.N.self_attn.qkv_proj, .rotary_emb, .attn,
    .mlp.gate_up_proj, .mlp.act_fn = SiluAndMul; no batch dimension; RMSNorm fused with the
    residual add), with transformers' weights and arithmetic: its activations are the
    reference's bit for bit, while the modules that hold them are not transformers'."""

    def __init__(self, hf_model):
        super().__init__()
        self.config = hf_model.config
        self.model = Decoder(hf_model)
        self.lm_head = torch.nn.Parameter(hf_model.lm_head.weight.detach().clone(),
                                          requires_grad=False)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[0])
        return torch.nn.functional.linear(self.model(input_ids, positions), self.lm_head)
