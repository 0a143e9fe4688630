"""Spark2.5, written from the architecture description in issue 5 (there is no public
transformers code): fp32 residual stream; RMSNorm computed in fp32 with a plain weight, cast
to the model dtype; fused q_k_v_proj; one sigmoid gate per head (g_proj); per-layer-type RoPE
(rope_parameters[layer_type]: rope_theta, partial_rotary_factor) on the leading rotary dims;
sliding-window mask (q - window < k <= q) on sliding layers; eager attention that subtracts
the row max in the model dtype before the fp32 softmax; GELU (erf) gated MLP; logits from the
tied model.embedding.weight."""

import torch
import torch.nn.functional as F


def rms_norm(x32, weight, eps, dtype):
    variance = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(dtype)


def rope(theta, rot_dim, t, dtype):
    freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    pos = torch.arange(t).float()
    freqs = torch.outer(pos, freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # [T, rot_dim]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rope(x, cos, sin):
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def mask_for(layer_type, t, window, dtype):
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    visible = k <= q
    if layer_type == "sliding_attention":
        visible = visible & (k > q - window)
    return torch.where(visible, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)


def forward(config, weights, input_ids):
    hidden = config["hidden_size"]
    nh = config["num_attention_heads"]
    nkv = config["num_key_value_heads"]
    hd = config["head_dim"]
    eps = config["rms_norm_eps"]
    t = input_ids.shape[1]
    emb_w = weights["model.embedding.weight"]
    dtype = emb_w.dtype

    h = F.embedding(input_ids, emb_w).float()
    tables = {}
    for layer_type, params in config["rope_parameters"].items():
        rot = int(hd * params.get("partial_rotary_factor", 1.0))
        cos, sin = rope(params["rope_theta"], rot, t, dtype)
        tables[layer_type] = (cos, sin, mask_for(layer_type, t, config["sliding_window"], dtype))

    for layer, layer_type in enumerate(config["layer_types"]):
        p = "model.layers.%d." % layer
        cos, sin, mask = tables[layer_type]
        x = rms_norm(h, weights[p + "attn_norm.weight"], eps, dtype)
        qkv = F.linear(x, weights[p + "attention.q_k_v_proj.weight"])
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.reshape(1, t, nh, hd).transpose(1, 2)
        k = k.reshape(1, t, nkv, hd).transpose(1, 2)
        v = v.reshape(1, t, nkv, hd).transpose(1, 2)
        gate = torch.sigmoid(F.linear(x, weights[p + "attention.g_proj.weight"]))  # [1, T, H]
        q = apply_partial_rope(q, cos, sin)
        k = apply_partial_rope(k, cos, sin)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * hd ** -0.5
        scores = scores + mask
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        o = torch.matmul(probs, v).transpose(1, 2)  # [1, T, H, hd]
        o = o * gate.unsqueeze(-1)
        o = F.linear(o.reshape(1, t, nh * hd), weights[p + "attention.o_proj.weight"])
        h = h + o.float()

        x = rms_norm(h, weights[p + "mlp_norm.weight"], eps, dtype)
        g = F.gelu(F.linear(x, weights[p + "mlp.gate_proj.weight"]))
        u = F.linear(x, weights[p + "mlp.up_proj.weight"])
        h = h + F.linear(g * u, weights[p + "mlp.down_proj.weight"]).float()

    x = rms_norm(h, weights["model.norm.weight"], eps, dtype)
    return F.linear(x, emb_w)
