"""Reference linear-attention ops: the short causal convolution, Kimi delta attention (KDA) and
the gated delta rule (Gated DeltaNet, Qwen3-Next's `qwen3_next`).

Each continues each row's fixed-size state from its slot (zeros when the row starts at position
0) and leave the state after the row's last token in the slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.kernels.registry import register


def _rows(meta):
    qs = meta.query_start_cpu
    for r in range(len(qs) - 1):
        if qs[r + 1] > qs[r]:
            yield meta.slots_cpu[r], meta.has_initial_state_cpu[r], qs[r], qs[r + 1]


@register("short_conv", "reference")
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, meta) -> torch.Tensor:
    """y[t, c] = silu(sum_{i < K} w[c, i] * x[t - K + 1 + i, c]), continuing the row's state.

    x [T, C]; weight [C, 1, K] (computed in its dtype, fp32 in practice); state [slots, C, K - 1]
    holds each row's last K - 1 inputs. Returns [T, C] in x's dtype.
    """
    out = torch.empty_like(x)
    k = weight.shape[-1]
    for slot, has_init, a, b in _rows(meta):
        prev = state[slot] if has_init else torch.zeros_like(state[slot])  # [C, K - 1]
        seq = torch.cat((prev.to(x.dtype), x[a:b].t()), dim=1)  # [C, K - 1 + n]
        y = F.conv1d(seq[None].to(weight.dtype), weight, groups=seq.shape[0])[0]  # [C, n]
        out[a:b] = F.silu(y).t().to(x.dtype)
        state[slot] = seq[:, seq.shape[1] - (k - 1) :].to(state.dtype)
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dim (the delta rules' q / k normalisation)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_step(q, k, v, decay, beta, s):
    """One token of the gated delta rule over any leading dims [...] (heads, or rows x heads):
    q, k [..., Dk] (q scaled), v [..., Dv], decay [..., Dk] (KDA: per key channel) or [..., 1]
    (one per head), beta [...], s [..., Dk, Dv] (all fp32):
        s' = decay s;  s = s' + k (beta (v - s'^T k))^T;  o = s^T q     -> (o [..., Dv], s)"""
    s = s * decay[..., None]
    delta = (v - torch.einsum("...k,...kv->...v", k, s)) * beta[..., None]  # [..., Dv]
    s = s + k[..., None] * delta[..., None, :]
    return torch.einsum("...k,...kv->...v", q, s), s


def kda_steps(q, k, v, g, beta, s):
    """Token by token. q, k [H, n, Dk] (q scaled), v [H, n, Dv], g [H, n, Dk], beta [H, n],
    s [H, Dk, Dv] (all fp32) -> (o [H, n, Dv], final s)."""
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        out[:, i], s = delta_step(q[:, i], k[:, i], v[:, i], g[:, i].exp(), beta[:, i], s)
    return out, s


def kda_chunks(q, k, v, g, beta, s, chunk: int = 64, budget: int = 1 << 28):
    """The same recurrence, `chunk` tokens at a time (WY form). Within a chunk, with cumulative
    log decays G_i = sum_{l <= i} g_l and D_ij = exp(G_i - G_j) (per key channel):
        T = (I - A)^-1, A_ij = -beta_i <k_i, D_ij k_j> for j < i
        u = T (beta v),  w = T (beta k exp(G))
        v'_i = u_i - w_i s,   o_i = (q_i exp(G_i)) s + sum_{j <= i} <q_i, D_ij k_j> v'_j
        s <- exp(G_last) s + sum_j (k_j exp(G_last - G_j))^T v'_j
    Same arguments and result as `kda_steps`. D is [H, C, C, Dk] a chunk: the chunks are taken in
    groups whose D fits in `budget` bytes, so memory does not grow with the tokens (an 8,192-token
    prefill of 64 heads of 128 would otherwise hold 17 GB of D)."""
    h, n, dk = k.shape
    pad = (-n) % chunk
    if pad:  # zero k, beta and g: padded tokens neither decay nor update the state
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    nc = (n + pad) // chunk
    q, k, v, g = (x.reshape(h, nc, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(h, nc, chunk, 1)
    gc = g.cumsum(2)  # [H, N, C, Dk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    eye = torch.eye(chunk, device=q.device)
    group = max(1, budget // (h * chunk * chunk * dk * 4))  # chunks whose D is held at once
    out = torch.empty_like(v)
    for c0 in range(0, nc, group):
        qg, kg, vg, gg, bg = (x[:, c0 : c0 + group] for x in (q, k, v, gc, beta))
        decay = (gg[:, :, :, None, :] - gg[:, :, None, :, :]).masked_fill(~lower[..., None], float("-inf"))
        decay = decay.exp()  # [H, n, C, C, Dk]
        a = -(bg * torch.einsum("hnik,hnjk,hnijk->hnij", kg, kg, decay)).masked_fill(~strict, 0)
        t = torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False)  # [H, n, C, C]
        u = t @ (bg * vg)
        w = t @ (bg * kg * gg.exp())
        qk = torch.einsum("hnik,hnjk,hnijk->hnij", qg, kg, decay).masked_fill(~lower, 0)
        del decay
        for c in range(u.shape[1]):
            vp = u[:, c] - w[:, c] @ s  # [H, C, Dv]
            out[:, c0 + c] = (qg[:, c] * gg[:, c].exp()) @ s + qk[:, c] @ vp
            last = gg[:, c, -1]  # [H, Dk]
            s = s * last.exp()[..., None] + (kg[:, c] * (last[:, None] - gg[:, c]).exp()).transpose(1, 2) @ vp
    return out.reshape(h, nc * chunk, -1)[:, :n], s


@register("kda_recurrence", "reference")
def kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta,
    chunked: bool = True,
) -> torch.Tensor:
    """Kimi delta attention (the gated delta rule with a per-channel forget gate), in fp32.

    q_t, k_t <- l2norm(q_t), l2norm(k_t); q_t <- q_t / sqrt(Dk)
    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = q_t^T S_t
    q, k [T, H, Dk], v [T, H, Dv], g [T, H, Dk] (log decays), beta [T, H]; state [slots, H, Dk, Dv]
    fp32. Rows with more than one token use the chunked form when `chunked`. -> [T, H, Dv] in v's dtype.
    """
    out = torch.empty_like(v)
    scale = q.shape[-1] ** -0.5
    for slot, has_init, a, b in _rows(meta):
        qr, kr = l2norm(q[a:b].float()) * scale, l2norm(k[a:b].float())
        args = [x.transpose(0, 1) for x in (qr, kr, v[a:b].float(), g[a:b].float(), beta[a:b].float())]
        s0 = state[slot] if has_init else torch.zeros_like(state[slot])
        o, s = (kda_chunks if chunked and b - a > 1 else kda_steps)(*args, s0)
        out[a:b] = o.transpose(0, 1).to(v.dtype)
        state[slot] = s
    return out


def gdr_steps(q, k, v, g, beta, s):
    """Token by token. q, k [H, n, Dk] (q scaled), v [H, n, Dv], g [H, n] (log decays), beta [H, n],
    s [H, Dk, Dv] (all fp32) -> (o [H, n, Dv], final s)."""
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        out[:, i], s = delta_step(q[:, i], k[:, i], v[:, i], g[:, i, None].exp(), beta[:, i], s)
    return out, s


def gdr_chunks(q, k, v, g, beta, s, chunk: int = 64):
    """The same recurrence, `chunk` tokens at a time (WY form). Within a chunk, with cumulative
    log decays G_i = sum_{l <= i} g_l (one per head) and D_ij = exp(G_i - G_j):
        T = (I - A)^-1, A_ij = -beta_i D_ij <k_i, k_j> for j < i
        u = T (beta v),  w = T (beta exp(G) k)
        v'_i = u_i - w_i s,   o_i = exp(G_i) q_i s + sum_{j <= i} D_ij <q_i, k_j> v'_j
        s <- exp(G_last) s + sum_j exp(G_last - G_j) k_j^T v'_j
    Same arguments and result as `gdr_steps`."""
    h, n, _ = k.shape
    pad = (-n) % chunk
    if pad:  # zero k, beta and g: padded tokens neither decay nor update the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    nc = (n + pad) // chunk
    q, k, v = (x.reshape(h, nc, chunk, x.shape[-1]) for x in (q, k, v))
    gc = g.reshape(h, nc, chunk).cumsum(2)  # [H, N, C]
    beta = beta.reshape(h, nc, chunk, 1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, N, C, C]
    a = -(beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, device=q.device)
    t = torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False)  # [H, N, C, C]
    u = t @ (beta * v)  # [H, N, C, Dv]
    w = t @ (beta * k * gc[..., None].exp())  # [H, N, C, Dk]
    qk = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], zero above the diagonal
    out = torch.empty_like(v)
    for c in range(nc):
        vp = u[:, c] - w[:, c] @ s  # [H, C, Dv]
        out[:, c] = (q[:, c] * gc[:, c, :, None].exp()) @ s + qk[:, c] @ vp
        last = gc[:, c, -1]  # [H]
        kd = k[:, c] * (last[:, None] - gc[:, c]).exp()[..., None]  # [H, C, Dk]
        s = s * last.exp()[:, None, None] + kd.transpose(1, 2) @ vp
    return out.reshape(h, nc * chunk, -1)[:, :n], s


@register("kda_gates", "reference", graphs=True)
def kda_gates(
    f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """f [T, H D] (the low-rank gate projection), b [T, H] in the model's dtype, A_log [H], dt_bias
    [H D] -> (g [T, H, D] fp32, beta [T, H] in b's dtype): with f' = f + dt_bias in fp32, g =
    lower_bound sigmoid(exp(A_log) f') (Kimi K3's bounded decay) or, with no bound,
    -exp(A_log) softplus(f') (softplus linear past 20); beta = sigmoid(b)."""
    t, h = b.shape
    f = (f.float() + dt_bias.float()).view(t, h, f.shape[1] // h)
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(a_log.float().exp()[None, :, None] * f)
    else:
        g = -a_log.float().exp()[None, :, None] * F.softplus(f, threshold=20.0)
    return g, torch.sigmoid(b)


@register("gdn_gates", "reference", graphs=True)
def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [T, HV] in the model's dtype, A_log, dt_bias [HV] -> (g [T, HV] fp32, beta [T, HV] in
    b's dtype): g = -exp(A_log) softplus(a + dt_bias) (the log decay, fp32; softplus linear past
    20), beta = sigmoid(b)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float(), threshold=20.0), torch.sigmoid(b)


@register("gated_delta_rule", "reference")
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta,
    chunked: bool = True,
) -> torch.Tensor:
    """Gated DeltaNet (the delta rule with one scalar forget gate per head and token), in fp32.

    q_t, k_t <- l2norm(q_t), l2norm(k_t); q_t <- q_t / sqrt(Dk)
    S'_t = exp(g_t) S_{t-1};  S_t = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T;  o_t = S_t^T q_t
    (S [Dk, Dv] per value head; per token and value head g_t, beta_t scalars.)
    q, k [T, H, Dk]; v [T, HV, Dv]; g [T, HV] (log decays, <= 0); beta [T, HV]; state
    [slots, HV, Dk, Dv] fp32. HV a multiple of H: value head j reads query / key head j // (HV / H)
    (transformers' repeat_interleave, fla's GVA). Rows with more than one token use the chunked
    form when `chunked`. -> [T, HV, Dv] in v's dtype.
    """
    hv = v.shape[1]
    if hv % q.shape[1] or k.shape[1] != q.shape[1]:
        raise ValueError(
            f"gated_delta_rule: value heads ({hv}) must be a multiple of query / key heads "
            f"({q.shape[1]} / {k.shape[1]}, which must agree)"
        )
    out = torch.empty_like(v)
    scale, rep = q.shape[-1] ** -0.5, hv // q.shape[1]
    for slot, has_init, a, b in _rows(meta):
        qr, kr = (l2norm(x[a:b].float()).repeat_interleave(rep, dim=1) for x in (q, k))
        rest = (v[a:b].float(), g[a:b].float(), beta[a:b].float())
        args = [x.transpose(0, 1) for x in (qr * scale, kr, *rest)]
        s0 = state[slot] if has_init else torch.zeros_like(state[slot])
        o, s = (gdr_chunks if chunked and b - a > 1 else gdr_steps)(*args, s0)
        out[a:b] = o.transpose(0, 1).to(v.dtype)
        state[slot] = s
    return out
