"""Qwen3.5 text forward, written from Hugging Face transformers' eager code.

Sources: transformers `models/qwen3_5/modeling_qwen3_5.py` (Qwen3_5TextModel, Qwen3_5Attention,
Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm, Qwen3_5RMSNormGated, Qwen3_5TextRotaryEmbedding) and
`models/qwen3_next/modeling_qwen3_next.py`. Each op is the one transformers runs, in the same
order, dtype and shape ([1, T, ...]), so logits match bit for bit on the same ATen build.

Two Gated DeltaNet variants, because transformers releases differ visibly (transformers
PR #47625, "Make gated delta rule more explicit", changed the torch fallback kernels):
  * "current": q/k repeated to the value heads, cast to fp32, then l2-normalised; the chunk's
    UT system solved with `torch.linalg.solve_triangular`; decays folded into q/k before the
    chunk loop; the recurrence scales q by division.
  * "legacy" (the code Qwen3.5 and Qwen3-Next shipped with): l2norm on the bf16 q/k before the
    fp32 cast; the UT system inverted by forward substitution; decays applied inside the loop.
`gdn_mode` "chunk" (what transformers runs on a prompt) or "recurrent" (the token-by-token
rule transformers runs when decoding) selects the kernel.
"""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def text_config(config: dict) -> dict:
    return config["text_config"] if config.get("model_type") == "qwen3_5" else config


def weight_prefix(config: dict) -> str:
    return "model.language_model." if config.get("model_type") == "qwen3_5" else "model."


def tie_word_embeddings(config: dict) -> bool:
    c = text_config(config)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(c.get("tie_word_embeddings", False))


def rms_norm(x, weight, eps):
    # Qwen3_5RMSNorm: zero-centred weight, (x * w) in fp32 then cast.
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def rms_norm_gated(x, gate, weight, eps):
    # Qwen3_5RMSNormGated: norm before gate, plain weight.
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(input_dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(input_dtype)


def rotary(c, seq_len, dtype):
    rope = c["rope_parameters"]
    base = rope["rope_theta"]
    head_dim = c["head_dim"]
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    # Text-only input: the three M-RoPE position rows are equal, so the interleave is the identity.
    position_ids = torch.arange(seq_len).view(1, 1, -1).expand(3, 1, -1)
    inv_freq_expanded = inv_freq[None, None, :, None].float().expand(3, 1, -1, 1)
    position_ids_expanded = position_ids[:, :, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(2, 3)
    freqs = freqs[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * 1.0
    sin = emb.sin() * 1.0
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def repeat_kv(x, n_rep):
    batch, kv_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, kv_heads, n_rep, slen, head_dim)
    return x.reshape(batch, kv_heads * n_rep, slen, head_dim)


def causal_mask(seq_len, dtype):
    # Eager additive mask: 0 where key <= query, the dtype's lowest value elsewhere.
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    min_dtype = torch.finfo(dtype).min
    mask = torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.tensor(min_dtype, dtype=dtype))
    return mask[None, None, :, :]


def attention(c, w, p, h, cos, sin, mask):
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    bias = c.get("attention_bias", False)

    def lin(x, name):
        return F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"] if bias else None)

    input_shape = h.shape[:-1]
    hidden_shape = (*input_shape, -1, hd)
    query, gate = torch.chunk(lin(h, "q_proj").view(*input_shape, -1, hd * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = rms_norm(query.view(hidden_shape), w[p + "q_norm.weight"], eps).transpose(1, 2)
    key = rms_norm(lin(h, "k_proj").view(hidden_shape), w[p + "k_norm.weight"], eps).transpose(1, 2)
    value = lin(h, "v_proj").view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)

    key = repeat_kv(key, heads // kv)
    value = repeat_kv(value, heads // kv)
    scores = torch.matmul(query, key.transpose(2, 3)) * hd**-0.5
    scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    out = out.reshape(*input_shape, -1).contiguous()
    out = out * torch.sigmoid(gate)
    return lin(out, "o_proj")


def l2norm(x, dim=-1, eps=1e-6):
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def chunk_rule_current(query, key, value, g, beta, chunk_size=CHUNK_SIZE):
    initial_dtype = query.dtype
    _, sequence_length, _, _ = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if key.shape[2] != num_v_heads:
        query, key = (x.repeat_interleave(num_v_heads // x.shape[2], dim=2) for x in (query, key))
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    ]
    query = l2norm(query)
    key = l2norm(key)
    query = query * query.shape[-1] ** -0.5

    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    num_chunks = (sequence_length + pad_size) // chunk_size

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise = pairwise.masked_fill(strictly_upper, float("-inf")).exp()

    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    state = torch.zeros(query.shape[0], num_v_heads, query.shape[-1], v_head_dim, dtype=new_values.dtype)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        inter = query[:, :, i] @ state
        out[:, :, i] = inter + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

    out = out.reshape(out.shape[0], num_v_heads, -1, v_head_dim)[:, :, :sequence_length]
    return out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)


def recurrent_rule_current(query, key, value, g, beta):
    initial_dtype = query.dtype
    _, sequence_length, _, _ = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if key.shape[2] != num_v_heads:
        query, key = (x.repeat_interleave(num_v_heads // x.shape[2], dim=2) for x in (query, key))
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    ]
    query = l2norm(query)
    key = l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    state = torch.zeros(query.shape[0], num_v_heads, query.shape[-1], v_head_dim, dtype=value.dtype)
    out = torch.zeros_like(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * decay[:, :, i].exp()[..., None, None]
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(initial_dtype)


def chunk_rule_legacy(query, key, value, g, beta, chunk_size=CHUNK_SIZE):
    initial_dtype = query.dtype
    query = l2norm(query)
    key = l2norm(key)
    query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)]
    batch_size, num_heads, sequence_length, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query = F.pad(query, (0, 0, 0, pad_size))
    key = F.pad(key, (0, 0, 0, pad_size))
    value = F.pad(value, (0, 0, 0, pad_size))
    beta = F.pad(beta, (0, pad_size))
    g = F.pad(g, (0, pad_size))
    total_sequence_length = sequence_length + pad_size
    query = query * (1 / (query.shape[-1] ** 0.5))

    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, value, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, value, k_beta, v_beta)
    ]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=0)
    g = g.cumsum(dim=-1)
    decay_mask = ((g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().float()).tril()
    attn = -((k_beta @ key.transpose(-1, -2)) * decay_mask).masked_fill(mask, 0)
    for i in range(1, chunk_size):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=attn.dtype)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp().unsqueeze(-1))
    state = torch.zeros(batch_size, num_heads, k_head_dim, v_head_dim).to(value)
    out = torch.zeros_like(value)
    for i in range(0, total_sequence_length // chunk_size):
        q_i, k_i, v_i = query[:, :, i], key[:, :, i], value[:, :, i]
        # transformers 5.13.1 masks nothing here: decay_mask is zero above the diagonal already
        attn = q_i @ k_i.transpose(-1, -2) * decay_mask[:, :, i]
        v_prime = (k_cumdecay[:, :, i]) @ state
        v_new = v_i - v_prime
        attn_inter = (q_i * g[:, :, i, :, None].exp()) @ state
        out[:, :, i] = attn_inter + attn @ v_new
        state = (
            state * g[:, :, i, -1, None, None].exp()
            + (k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :sequence_length]
    return out.transpose(1, 2).contiguous().to(initial_dtype)


def recurrent_rule_legacy(query, key, value, g, beta):
    initial_dtype = query.dtype
    query = l2norm(query)
    key = l2norm(key)
    query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)]
    batch_size, num_heads, sequence_length, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    query = query * (1 / (query.shape[-1] ** 0.5))
    out = torch.zeros(batch_size, num_heads, sequence_length, v_head_dim).to(value)
    state = torch.zeros(batch_size, num_heads, k_head_dim, v_head_dim).to(value)
    for i in range(sequence_length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        g_t = g[:, :, i].exp().unsqueeze(-1).unsqueeze(-1)
        beta_t = beta[:, :, i].unsqueeze(-1)
        state = state * g_t
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(initial_dtype)


GDN_RULES = {
    ("current", "chunk"): chunk_rule_current,
    ("current", "recurrent"): recurrent_rule_current,
    ("legacy", "chunk"): chunk_rule_legacy,
    ("legacy", "recurrent"): recurrent_rule_legacy,
}


def gated_delta_net(c, w, p, h, variant, mode):
    kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    key_dim, value_dim = kh * kd, vh * vd
    batch_size, seq_len, _ = h.shape

    mixed_qkv = F.linear(h, w[p + "in_proj_qkv.weight"]).transpose(1, 2)
    z = F.linear(h, w[p + "in_proj_z.weight"]).reshape(batch_size, seq_len, -1, vd)
    b = F.linear(h, w[p + "in_proj_b.weight"])
    a = F.linear(h, w[p + "in_proj_a.weight"])

    conv_weight = w[p + "conv1d.weight"]  # [conv_dim, 1, kernel]
    mixed_qkv = F.conv1d(
        mixed_qkv.to(conv_weight.dtype),
        weight=conv_weight.squeeze(1).unsqueeze(1),
        bias=None,
        padding=conv_weight.shape[-1] - 1,
        groups=mixed_qkv.shape[1],
    )[:, :, :seq_len]
    mixed_qkv = F.silu(mixed_qkv).to(h.dtype)
    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, kd)
    key = key.reshape(batch_size, seq_len, -1, kd)
    value = value.reshape(batch_size, seq_len, -1, vd)

    beta = b.sigmoid()
    g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"])
    if variant == "legacy" and vh // kh > 1:
        query = query.repeat_interleave(vh // kh, dim=2)
        key = key.repeat_interleave(vh // kh, dim=2)
    out = GDN_RULES[(variant, mode)](query, key, value, g, beta)

    out = out.reshape(-1, vd)
    z = z.reshape(-1, vd)
    out = rms_norm_gated(out, z, w[p + "norm.weight"], c["rms_norm_eps"])
    out = out.reshape(batch_size, seq_len, -1)
    return F.linear(out, w[p + "out_proj.weight"])


def mlp(w, p, x):
    return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"]),
                    w[p + "down_proj.weight"])


@torch.no_grad()
def forward(config: dict, weights: dict, input_ids: torch.LongTensor, gdn_variant: str = None,
            gdn_mode: str = "chunk") -> torch.Tensor:
    """Logits [1, T, V] in the model dtype. The GDN variant defaults to config["_gdn_variant"]
    (set by reference.py --gdn-variant), else "legacy" (transformers 5.13.1)."""
    if gdn_variant is None:
        gdn_variant = config.get("_gdn_variant", "legacy")
    if (gdn_variant, gdn_mode) not in GDN_RULES:
        raise ValueError(f"ref_qwen3_5: unknown gdn variant/mode {gdn_variant!r}/{gdn_mode!r}")
    c = text_config(config)
    prefix = weight_prefix(config)
    eps = c["rms_norm_eps"]
    embed = weights[prefix + "embed_tokens.weight"]
    dtype = embed.dtype
    seq_len = input_ids.shape[1]

    h = F.embedding(input_ids, embed)
    cos, sin = rotary(c, seq_len, dtype)
    mask = causal_mask(seq_len, dtype)
    for i, kind in enumerate(c["layer_types"]):
        lp = f"{prefix}layers.{i}."
        residual = h
        x = rms_norm(h, weights[lp + "input_layernorm.weight"], eps)
        if kind == "linear_attention":
            x = gated_delta_net(c, weights, lp + "linear_attn.", x, gdn_variant, gdn_mode)
        else:
            x = attention(c, weights, lp + "self_attn.", x, cos, sin, mask)
        h = residual + x
        residual = h
        x = rms_norm(h, weights[lp + "post_attention_layernorm.weight"], eps)
        h = residual + mlp(weights, lp + "mlp.", x)
    h = rms_norm(h, weights[prefix + "norm.weight"], eps)
    lm_head = embed if tie_word_embeddings(config) else weights["lm_head.weight"]
    return F.linear(h, lm_head)
