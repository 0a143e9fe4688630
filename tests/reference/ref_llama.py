"""Llama / Qwen2 / Qwen3, written from transformers' eager modeling_llama.py,
modeling_qwen2.py and modeling_qwen3.py (LlamaRMSNorm, LlamaRotaryEmbedding with the
default / linear / llama3 inv_freq, apply_rotary_pos_emb, repeat_kv, eager_attention_forward,
LlamaMLP, LlamaDecoderLayer): same ops, same dtypes, same [1, T, ...] shapes."""

import math

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rope_config(config):
    """(theta, scaling dict or None) from either rope_parameters or rope_theta/rope_scaling."""
    params = config.get("rope_parameters")
    if params is not None:
        return params["rope_theta"], params
    return config.get("rope_theta", 10000.0), config.get("rope_scaling")


def inv_freq(config, dim):
    theta, scaling = rope_config(config)
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return freq
    if rope_type == "linear":
        freq /= scaling["factor"]
        return freq
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / freq
        freq_llama = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * freq_llama / factor + smooth_factor * freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, freq_llama)
    raise ValueError("unsupported rope_type %r" % rope_type)


def rotary_cos_sin(freq, position_ids, dtype, attention_scaling=1.0):
    inv_freq_expanded = freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x, n_rep):
    b, kvh, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, kvh, n_rep, t, d).reshape(b, kvh * n_rep, t, d)


def causal_mask(t, dtype):
    """transformers' eager mask: 0 where visible, finfo(dtype).min where not, [1, 1, T, T]."""
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    visible = k <= q
    return torch.where(visible, torch.tensor(0.0, dtype=dtype),
                       torch.finfo(dtype).min)[None, None]


def eager_attention(q, k, v, mask, scaling, n_rep):
    k = repeat_kv(k, n_rep)
    v = repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    w = w + mask[:, :, :, : k.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(w, v)
    return out.transpose(1, 2).contiguous()


def forward(config, weights, input_ids):
    model_type = config["model_type"]
    hidden = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_heads)
    head_dim = config.get("head_dim") or hidden // n_heads
    eps = config["rms_norm_eps"]
    qk_norm = model_type == "qwen3"

    def w(name):
        return weights[name]

    def b(name):
        return weights.get(name)

    h = F.embedding(input_ids, w("model.embed_tokens.weight"))
    dtype = h.dtype
    t = input_ids.shape[1]
    position_ids = torch.arange(t).unsqueeze(0)
    cos, sin = rotary_cos_sin(inv_freq(config, head_dim), position_ids, dtype)
    mask = causal_mask(t, dtype)

    for layer in range(config["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        residual = h
        x = rms_norm(h, w(p + "input_layernorm.weight"), eps)
        shape = (1, t, -1, head_dim)
        q = F.linear(x, w(p + "self_attn.q_proj.weight"), b(p + "self_attn.q_proj.bias")).view(shape)
        k = F.linear(x, w(p + "self_attn.k_proj.weight"), b(p + "self_attn.k_proj.bias")).view(shape)
        v = F.linear(x, w(p + "self_attn.v_proj.weight"), b(p + "self_attn.v_proj.bias")).view(shape)
        if qk_norm:
            q = rms_norm(q, w(p + "self_attn.q_norm.weight"), eps)
            k = rms_norm(k, w(p + "self_attn.k_norm.weight"), eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = eager_attention(q, k, v, mask, head_dim ** -0.5, n_heads // n_kv)
        o = o.reshape(1, t, -1).contiguous()
        o = F.linear(o, w(p + "self_attn.o_proj.weight"), b(p + "self_attn.o_proj.bias"))
        h = residual + o

        residual = h
        x = rms_norm(h, w(p + "post_attention_layernorm.weight"), eps)
        gate = F.linear(x, w(p + "mlp.gate_proj.weight"), b(p + "mlp.gate_proj.bias"))
        up = F.linear(x, w(p + "mlp.up_proj.weight"), b(p + "mlp.up_proj.bias"))
        m = F.linear(F.silu(gate) * up, w(p + "mlp.down_proj.weight"), b(p + "mlp.down_proj.bias"))
        h = residual + m

    h = rms_norm(h, w("model.norm.weight"), eps)
    lm_head = weights.get("lm_head.weight")
    if lm_head is None or config.get("tie_word_embeddings", False):
        lm_head = w("model.embed_tokens.weight")
    return F.linear(h, lm_head)
