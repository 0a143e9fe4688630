"""Engines whose fault is known, for calibrating the bug-or-numerics verdict.

Each engine computes a model's last-position logits its own way. The legitimate ones change only
what a correct implementation may change (and none of them is a member of the envelope in
worker/hf/assay_numerics.py, which this file never imports); the buggy ones change the math.

Legitimate (held out of the envelope):
  flash        attention as online softmax over key blocks of 16, scores, weights and the
               running sums kept in float32, the output rounded once (FlashAttention's scheme)
  compiled     torch.compile (inductor) of the same module
  tiled        every linear layer as a K-tiled matmul (tiles of 32) accumulating in float32 in
               tile order, rounded once
  threads-2    the reference forward on two intra-op threads (the reference uses one)
Buggy:
  rope-theta   RoPE's theta 1% too large
  rms-eps      RMSNorm's epsilon 1e-6 where the model says 1e-5
  rms-bf16     RMSNorm computed in bfloat16 (no float32 upcast)
  softmax-bf16 attention's softmax with every step rounded to bfloat16
  position     the last token's position id one too large (gross)
"""
import contextlib
import copy

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

LEGITIMATE = ["flash", "compiled", "tiled", "threads-2"]
BUGGY = ["rope-theta", "rms-eps", "rms-bf16", "softmax-bf16", "position"]


def _repeat_kv(x, groups):
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def _keep_mask(attention_mask, q_len, k_len, device):
    """Which keys each query may see, as a bool [.., q, k]: from an additive float mask, a bool
    mask (True: keep), or causal when none is given."""
    if attention_mask is None:
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask == 0


def flash_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    k = _repeat_kv(key, groups).float()
    v = _repeat_kv(value, groups).float()
    q = query.float()
    keep = _keep_mask(attention_mask, q.shape[2], k.shape[2], q.device)
    block = 16
    m = torch.full(q.shape[:3] + (1,), float("-inf"), device=q.device)
    lsum = torch.zeros_like(m)
    acc = torch.zeros(q.shape[:3] + (v.shape[-1],), device=q.device)
    for start in range(0, k.shape[2], block):
        s = (q @ k[:, :, start:start + block].transpose(-1, -2)) * scaling
        s = s.masked_fill(~keep[..., start:start + block], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row whose keys so far are all masked keeps m at -inf: no contribution yet.
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe)
        scale = torch.exp(m - safe)
        acc = acc * scale + p @ v[:, :, start:start + block]
        lsum = lsum * scale + p.sum(-1, keepdim=True)
        m = m_new
    out = (acc / lsum).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def softmax_bf16_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                           **kwargs):
    """transformers' eager attention, but with softmax's exponentials, sum and division each
    rounded to the activation dtype (torch's own bf16 softmax upcasts internally, which is
    legitimate; this is not)."""
    groups = query.shape[1] // key.shape[1]
    k = _repeat_kv(key, groups)
    v = _repeat_kv(value, groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, :k.shape[-2]]
    e = torch.exp(w - w.amax(-1, keepdim=True))
    w = e / e.sum(-1, keepdim=True)
    out = torch.matmul(w, v)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("calibration_online_softmax", flash_attention)
AttentionMaskInterface.register("calibration_online_softmax", sdpa_mask)
AttentionInterface.register("calibration_softmax_bf16", softmax_bf16_attention)
AttentionMaskInterface.register("calibration_softmax_bf16", eager_mask)


def tiled_linear(x, weight, bias=None):
    tile = 32
    acc = None
    for start in range(0, x.shape[-1], tile):
        part = x[..., start:start + tile].float() @ weight[:, start:start + tile].float().t()
        acc = part if acc is None else acc + part
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def rms_norm_bf16(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def norm_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


class Engine:
    """An engine over its own copy of the reference model."""

    def __init__(self, name, model, threads):
        self.name, self.threads = name, threads
        self.legitimate = name in LEGITIMATE
        self.model = copy.deepcopy(model)
        self.compiled = None
        if name == "flash":
            self.model.set_attn_implementation("calibration_online_softmax")
        elif name == "softmax-bf16":
            self.model.set_attn_implementation("calibration_softmax_bf16")
        elif name == "rope-theta":
            rotary = self.model.model.rotary_emb
            theta = self.model.config.rope_parameters["rope_theta"] * 1.01
            dim = rotary.inv_freq.shape[0] * 2
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            rotary.inv_freq = inv
            rotary.original_inv_freq = inv
        elif name == "rms-eps":
            for m in norm_modules(self.model):
                m.variance_epsilon = 1e-6
        elif name == "rms-bf16":
            for m in norm_modules(self.model):
                m.forward = rms_norm_bf16.__get__(m)
        elif name == "compiled":
            self.compiled = torch.compile(self.model, backend="inductor", dynamic=False)

    @contextlib.contextmanager
    def _context(self):
        threads = torch.get_num_threads()
        torch.set_num_threads(2 if self.name == "threads-2" else self.threads)
        linear = torch.nn.functional.linear
        if self.name == "tiled":
            torch.nn.functional.linear = tiled_linear
        try:
            yield
        finally:
            torch.nn.functional.linear = linear
            torch.set_num_threads(threads)

    def last_logits(self, ids):
        return self.last_logits_rows([ids])[0]

    def all_logits(self, ids):
        """Logits at every position of one sequence: [positions, vocab] float32 (what an engine
        exposes over a panel; the position bug moves the last token's position id only)."""
        x = torch.tensor([ids])
        with self._context(), torch.inference_mode():
            if self.name == "position":
                positions = torch.arange(x.shape[1])[None]
                positions[:, -1] += 1
                out = self.model(input_ids=x, position_ids=positions, use_cache=False)
            elif self.compiled is not None:
                out = self.compiled(input_ids=x, use_cache=False)
            else:
                out = self.model(input_ids=x, use_cache=False)
        return out.logits[0].float()

    def last_logits_rows(self, rows):
        """Rows of equal length as one batch: [rows, vocab] float32 (a batch's numerics may
        differ from one row's; calibration.py screens with it and decides on single rows)."""
        x = torch.tensor(rows)
        with self._context(), torch.inference_mode():
            if self.name == "position":
                positions = torch.arange(x.shape[1])[None].repeat(x.shape[0], 1)
                positions[:, -1] += 1
                out = self.model(input_ids=x, position_ids=positions, use_cache=False)
            elif self.compiled is not None:
                out = self.compiled(input_ids=x, use_cache=False)
            else:
                out = self.model(input_ids=x, use_cache=False)
        return out.logits[:, -1].float()


def reference_logits(model, ids, threads):
    return reference_logits_rows(model, [ids], threads)[0]


def reference_logits_rows(model, rows, threads):
    torch.set_num_threads(threads)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor(rows), use_cache=False)
    return out.logits[:, -1].float()


def make_model(arch, seed, logit_std=3.0):
    """A tiny random model of transformers' own class (Llama or Qwen3) in bfloat16, eager, its
    LM head scaled so that logits have about `logit_std`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=False)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)
    else:
        raise ValueError(arch)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.bfloat16).eval()
    probe = torch.randint(0, 1024, (8, 16), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        std = model(input_ids=probe, use_cache=False).logits.float().std().item()
        head = model.get_output_embeddings()
        head.weight.copy_((head.weight.float() * (logit_std / std)).to(torch.bfloat16))
    return model
