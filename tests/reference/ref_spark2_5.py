"""Spark2.5 as its Hugging Face remote code (modeling_spark.py / configuration_spark.py, written
for transformers 4.57) computes it, written here from reading that code: fp32 residual
stream; RMSNorm in fp32 returning fp32, cast to the weights' dtype by the decoder layer; fused
q_k_v_proj (+ bias with attention_bias); RoPE per layer type (rope_parameters[layer_type]:
rope_theta 10000 and partial_rotary_factor 1.0 by default) with cos/sin and the rotation in
fp32, cast back once; sliding-window mask (q - window < k <= q) on sliding layers, built in the
embeddings' dtype; eager attention that subtracts the row max in the model dtype before the
fp32 softmax; with headwise_attn_output_gate one gate per head, sigmoid or silu of the fp32
score cast back; out_proj; GELU (erf) gated MLP (+ bias with mlp_bias); logits from
model.embedding.weight when tie_word_embeddings, else lm_head.weight. Defaults are
Spark2_5Config's: untied, no gate, no biases, every layer full attention."""

import math

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def cos_sin(theta, head_dim, factor, t):
    rot = int(head_dim * factor)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()  # fp32 [T, rot]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x, cos, sin):
    rot = cos.shape[-1]
    x32 = x.float()
    c, s = cos[None, None], sin[None, None]
    if x32.shape[-1] > rot:
        out = torch.cat((x32[..., :rot] * c + rotate_half(x32[..., :rot]) * s, x32[..., rot:]),
                        dim=-1)
    else:
        out = x32 * c + rotate_half(x32) * s
    return out.to(x.dtype)


def mask_for(sliding, t, window, dtype):
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    visible = k <= q
    if sliding:
        visible = visible & (k > q - window)
    return torch.where(visible, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)


def linear(x, weights, name, bias):
    return F.linear(x, weights[name + ".weight"], weights[name + ".bias"] if bias else None)


def forward(config, weights, input_ids):
    heads = config.get("num_attention_heads", 32)
    kv_heads = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config.get("hidden_size", 4096) // heads
    eps = config.get("rms_norm_eps", 1e-6)
    attn_bias = config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    gated = config.get("headwise_attn_output_gate", False)
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    t = input_ids.shape[1]
    emb_w = weights["model.embedding.weight"]
    dtype = emb_w.dtype

    tables = {}
    for layer_type in set(layer_types):
        params = config["rope_parameters"].get(layer_type, {})
        cos, sin = cos_sin(params.get("rope_theta", 10000), hd,
                           params.get("partial_rotary_factor", 1.0), t)
        sliding = layer_type == "sliding_attention"
        tables[layer_type] = (cos, sin, mask_for(sliding, t, config.get("sliding_window"), dtype))

    h = F.embedding(input_ids, emb_w).float()
    for layer, layer_type in enumerate(layer_types):
        p = "model.layers.%d." % layer
        cos, sin, mask = tables[layer_type]
        x = rms_norm(h, weights[p + "input_layernorm.weight"], eps).to(dtype)
        qkv = linear(x, weights, p + "self_attn.q_k_v_proj", attn_bias)
        q = qkv[..., : heads * hd].view(1, t, heads, hd).transpose(1, 2)
        k = qkv[..., heads * hd : (heads + kv_heads) * hd].view(1, t, kv_heads, hd).transpose(1, 2)
        v = qkv[..., (heads + kv_heads) * hd :].view(1, t, kv_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = heads // kv_heads
        k = k[:, :, None].expand(1, kv_heads, rep, t, hd).reshape(1, heads, t, hd)
        v = v[:, :, None].expand(1, kv_heads, rep, t, hd).reshape(1, heads, t, hd)
        scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(hd)) + mask
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, v)  # [1, H, T, hd]
        if gated:
            act = {"sigmoid": torch.sigmoid, "silu": F.silu}[config.get("gate_attn_act_mode",
                                                                           "sigmoid")]
            g = linear(x, weights, p + "self_attn.g_proj", attn_bias)
            g = g.view(1, t, heads, 1).transpose(1, 2)
            o = o * act(g.float()).to(o.dtype)
        o = o.transpose(1, 2).contiguous().view(1, t, heads * hd)
        h = h + linear(o, weights, p + "self_attn.out_proj", attn_bias)

        x = rms_norm(h, weights[p + "post_attention_layernorm.weight"], eps).to(dtype)
        gate = F.gelu(linear(x, weights, p + "mlp.gate_proj", mlp_bias))
        up = linear(x, weights, p + "mlp.up_proj", mlp_bias)
        h = h + linear(gate * up, weights, p + "mlp.down_proj", mlp_bias)

    x = rms_norm(h, weights["model.norm.weight"], eps).to(dtype)
    tied = config.get("tie_word_embeddings", False)
    return F.linear(x, emb_w if tied else weights["lm_head.weight"])
