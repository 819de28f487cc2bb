"""An independent plain-torch reference for Kimi K3's text model, for tests only: written from the
fact sheet (../shared/families/kimi_k3.md, sections 1-2 and 4), sharing no code with dayzero's
blocks or kernels (its config classes are the family's: models/kimi_k3/config.py). Slow on
purpose: every recurrence is a loop over tokens, every attention a full causal softmax, no
cache (each call recomputes the whole sequence).

Tensor names are the release's, under `language_model.` (section 4). With K3's extras switched
off (attn_res_block_size null, use_full_rank_gate false, gate_lower_bound null,
mla_use_output_gate false, routed_expert_hidden_size null, hidden_act silu) it is Kimi Linear;
tests/test_kimi_k3_reference.py checks that against transformers' `kimi_linear` on the same
weights. Choices on the fact sheet's open questions, as config fields:
  - mla_norm_eps: the q_a / kv_a RMSNorm eps (null: rms_norm_eps, as TokenSpeed; kimi_linear 1e-6)
  - A_log is read for its first num_heads entries (stored [max(num_heads, head_dim)], zero padded)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from dayzero.models.kimi_k3.config import KimiK3Config, KimiK3TextConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, fp32 inside, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gated(c: KimiK3TextConfig, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU(g, u) = [b tanh(g / b) sigmoid(g)] [b_l tanh(u / b_l)] in fp32, or SwiGLU (silu)."""
    g32, u32 = g.float(), u.float()
    if c.hidden_act == "silu":
        return (F.silu(g32) * u32).to(g.dtype)
    b, bl = c.activation_situ_beta, c.activation_situ_linear_beta
    lin = u32 if bl is None else bl * torch.tanh(u32 / bl)
    return (b * torch.tanh(g32 / b) * torch.sigmoid(g32) * lin).to(g.dtype)


class MLP(nn.Module):
    def __init__(self, c: KimiK3TextConfig, hidden: int, inter: int) -> None:
        super().__init__()
        self.c = c
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.c, self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    def __init__(self, c: KimiK3TextConfig, width: int) -> None:
        super().__init__()
        self.c = c
        self.w1 = nn.Linear(width, c.moe_intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(width, c.moe_intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(c.moe_intermediate_size, width, bias=False)  # down

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.w2(gated(self.c, self.w1(u), self.w3(u)))


class Router(nn.Module):
    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(c.num_experts, dtype=torch.float32))


class MoE(nn.Module):
    """Section 2.4: sigmoid scores, top-k by score + correction bias (lower id first on ties),
    weights s_i / sum s (renormalize) x gamma; experts in the latent width between the latent
    down / norm / up projections; the shared experts (one MLP of n_s I) on x."""

    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        self.c = c
        width = c.routed_expert_hidden_size or c.hidden_size
        self.gate = Router(c)
        self.experts = nn.ModuleList(Expert(c, width) for _ in range(c.num_experts))
        latent = c.routed_expert_hidden_size is not None
        self.routed_expert_down_proj = nn.Linear(c.hidden_size, width, bias=False) if latent else None
        self.routed_expert_up_proj = nn.Linear(width, c.hidden_size, bias=False) if latent else None
        self.routed_expert_norm = Norm(width, c.rms_norm_eps) if latent and c.latent_moe_use_norm else None
        self.shared_experts = MLP(c, c.hidden_size, c.num_shared_experts * c.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H]
        c = self.c
        s = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # [N, E]
        choice = s + self.gate.e_score_correction_bias.float()
        out = torch.zeros(x.shape[0], self.experts[0].w2.out_features, dtype=torch.float32, device=x.device)
        u = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        for n in range(x.shape[0]):
            # the k largest, ties to the lowest expert id (a stable sort keeps id order among equals)
            order = torch.sort(-choice[n], stable=True).indices[: c.num_experts_per_token].tolist()
            w = s[n, order]
            if c.moe_renormalize:
                w = w / w.sum()
            for wi, e in zip(w * c.routed_scaling_factor, order, strict=True):
                out[n] += wi * self.experts[e](u[n : n + 1])[0].float()
        r = out.to(x.dtype)
        if self.routed_expert_up_proj is not None:
            r = self.routed_expert_up_proj(
                r if self.routed_expert_norm is None else self.routed_expert_norm(r)
            )
        return r + self.shared_experts(x)


class KDA(nn.Module):
    """Section 2.2, one token at a time: SiLU short convolutions, l2-normed q (/ sqrt(d)) and k,
    the decay g = lambda sigmoid(exp(A_log) (f + dt_bias)) (or -exp(A_log) softplus(f + dt_bias)
    without a bound), the delta rule on an fp32 state [h, d_k, d_v], the per-head RMSNorm of o
    times sigmoid of the (full- or low-rank) gate, then o_proj."""

    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        la = c.linear_attn_config
        self.c, self.h, self.d, self.w = c, la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        self.full_rank, self.bound = la.get("use_full_rank_gate", False), la.get("gate_lower_bound")
        p, hid = self.h * self.d, c.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hid, p, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(p, p, self.w, groups=p, bias=False) for _ in range(3)
        )
        self.f_a_proj = nn.Linear(hid, self.d, bias=False)
        self.f_b_proj = nn.Linear(self.d, p, bias=False)
        self.b_proj = nn.Linear(hid, self.h, bias=False)
        if self.full_rank:
            self.g_proj = nn.Linear(hid, p, bias=False)
        else:
            self.g_a_proj = nn.Linear(hid, self.d, bias=False)
            self.g_b_proj = nn.Linear(self.d, p, bias=False)
        self.A_log = nn.Parameter(torch.zeros(max(self.h, self.d), dtype=torch.float32))
        self.register_state_dict_post_hook(_zero_a_log_padding)  # stored as the release: zero padded
        self.dt_bias = nn.Parameter(torch.zeros(p, dtype=torch.float32))
        self.o_norm = Norm(self.d, c.rms_norm_eps)
        self.o_proj = nn.Linear(p, hid, bias=False)

    def _conv(self, conv: nn.Conv1d, z: torch.Tensor) -> torch.Tensor:  # [T, P] -> silu(causal conv)
        zp = F.pad(z.T[None], (self.w - 1, 0))
        return F.silu(F.conv1d(zp, conv.weight, groups=conv.weight.shape[0])[0].T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        t, h, d = x.shape[0], self.h, self.d
        q = self._conv(self.q_conv1d, self.q_proj(x)).float().view(t, h, d)
        k = self._conv(self.k_conv1d, self.k_proj(x)).float().view(t, h, d)
        v = self._conv(self.v_conv1d, self.v_proj(x)).float().view(t, h, d)
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6) / math.sqrt(d)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6)
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(t, h, d)
        a = torch.exp(self.A_log[:h].float())[None, :, None]
        # log decays: bounded lambda sigmoid(.) in (lambda, 0), or kimi_linear's -exp(A) softplus(.)
        g = self.bound * torch.sigmoid(a * f) if self.bound is not None else -a * F.softplus(f)
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, h]
        state = torch.zeros(h, d, d, device=x.device)
        o = torch.empty(t, h, d, device=x.device)
        for i in range(t):
            s_bar = torch.exp(g[i])[:, :, None] * state  # [h, dk, dv]
            err = v[i] - torch.einsum("hkv,hk->hv", s_bar, k[i])
            state = s_bar + k[i][:, :, None] * (beta[i][:, None, None] * err[:, None, :])
            o[i] = torch.einsum("hkv,hk->hv", state, q[i])
        gate = self.g_proj(x) if self.full_rank else self.g_b_proj(self.g_a_proj(x))
        z = rms_norm(o, self.o_norm.weight, self.o_norm.eps) * torch.sigmoid(gate.float().view(t, h, d))
        return self.o_proj(z.to(x.dtype).reshape(t, -1))


def _zero_a_log_padding(module: KDA, state: dict, prefix: str, meta) -> None:
    """Only A_log's first num_heads entries are read; the saved tensor holds zeros after them."""
    a = state[prefix + "A_log"].clone()
    a[module.h :] = 0.0
    state[prefix + "A_log"] = a


class MLA(nn.Module):
    """Section 2.3: NoPE MLA (k_r shared, never rotated), softmax scale (d_n + d_r)^-1/2, the
    optional sigmoid output gate on the flattened [n d_v] in fp32."""

    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        self.c, n = c, c.num_attention_heads
        self.dq = c.qk_nope_head_dim + c.qk_rope_head_dim
        eps = c.rms_norm_eps if c.mla_norm_eps is None else c.mla_norm_eps
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = Norm(c.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * self.dq, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, n * self.dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = Norm(c.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.g_proj = (
            nn.Linear(c.hidden_size, n * c.v_head_dim, bias=False) if c.mla_use_output_gate else None
        )
        self.o_proj = nn.Linear(n * c.v_head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        c, t, n = self.c, x.shape[0], self.c.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q = q.view(t, n, self.dq)
        ckv, k_r = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv)).view(t, n, c.qk_nope_head_dim + c.v_head_dim)
        k_n, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat((k_n, k_r[:, None, :].expand(t, n, c.qk_rope_head_dim)), dim=-1)  # [T, n, dq]
        s = torch.einsum("thd,jhd->htj", q.float(), k.float()) * self.dq**-0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        o = torch.einsum("htj,jhd->thd", torch.softmax(s, dim=-1), v.float()).reshape(t, -1)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x).float())
        return self.o_proj(o.to(x.dtype))


def attn_res_mix(
    cands: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float
) -> torch.Tensor:
    """Section 2.1's Mix: softmax over the candidates of <c_n, u> / rms(c_n), u = norm_w * proj_w[0]."""
    c = torch.stack([x.float() for x in cands])  # [m, T, H]
    u = norm_w.float() * proj_w[0].float()
    s = (c * u).sum(-1) / torch.sqrt(c.square().mean(-1) + eps)  # [m, T]
    return (torch.softmax(s, dim=0)[..., None] * c).sum(0).to(cands[0].dtype)


class Layer(nn.Module):
    def __init__(self, c: KimiK3TextConfig, i: int) -> None:
        super().__init__()
        kda = (i + 1) in c.linear_attn_config["kda_layers"]
        self.self_attn = KDA(c) if kda else MLA(c)
        moe = c.num_experts is not None and i >= c.first_k_dense_replace and i % c.moe_layer_freq == 0
        self.block_sparse_moe = MoE(c) if moe else None
        self.mlp = None if moe else MLP(c, c.hidden_size, c.intermediate_size)
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        if c.attn_res_block_size:
            h = c.hidden_size
            self.self_attention_res_norm, self.mlp_res_norm = Norm(h, c.rms_norm_eps), Norm(h, c.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(h, 1, bias=False)
            self.mlp_res_proj = nn.Linear(h, 1, bias=False)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) if self.mlp is not None else self.block_sparse_moe(x)


class Model(nn.Module):
    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        if c.attn_res_block_size:
            self.output_attn_res_norm = Norm(c.hidden_size, c.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H] after the final norm
        c, eps = self.c, self.c.rms_norm_eps
        p = self.embed_tokens(ids)
        if not c.attn_res_block_size:  # plain pre-norm residual
            for layer in self.layers:
                p = p + layer.self_attn(layer.input_layernorm(p))
                p = p + layer.ffn(layer.post_attention_layernorm(p))
            return self.norm(p)
        snaps: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            mix = attn_res_mix(
                [*snaps, p], layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps
            )
            xa = layer.input_layernorm(mix)
            if i % c.attn_res_block_size == 0:
                snaps, p = [*snaps, p], torch.zeros_like(p)
            p = p + layer.self_attn(xa)
            mix = attn_res_mix([*snaps, p], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
            p = p + layer.ffn(layer.post_attention_layernorm(mix))
        out = attn_res_mix(
            [*snaps, p], self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, eps
        )
        return self.norm(out)


class LanguageModel(nn.Module):
    def __init__(self, c: KimiK3TextConfig) -> None:
        super().__init__()
        self.model = Model(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)


class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
    """Kimi K3's text model under the release's `language_model.` prefix; vision tensors absent."""

    config_class = KimiK3Config
    base_model_prefix = "language_model"
    _supports_attention_backend = True

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.language_model = LanguageModel(config.text_config)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Random and non-trivial (tiny checkpoints keep them): matrices ~ 1 / sqrt(fan-in),
        norm weights 1 + N(0, 0.1), the decay and routing biases N(0, 0.5)."""
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            module.weight.normal_(0.0, module.weight.shape[-1] ** -0.5)
        elif isinstance(module, Norm):
            module.weight.normal_(1.0, 0.1)
        elif isinstance(module, (KDA, Router)):
            for name in ("A_log", "dt_bias", "e_score_correction_bias"):
                if hasattr(module, name):
                    getattr(module, name).normal_(0.0, 0.5)
            if isinstance(module, KDA):
                module.A_log[module.h :] = 0.0  # the storage's padding
            if isinstance(module, Router):
                module.weight.normal_(0.0, module.weight.shape[-1] ** -0.5)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.language_model.model.embed_tokens

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        """No cache: every step reads the whole sequence so far."""
        return {"input_ids": input_ids}

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> CausalLMOutput:
        lm = self.language_model
        logits = torch.stack([lm.lm_head(lm.model(row)) for row in input_ids])  # [B, T, V]
        return CausalLMOutput(logits=logits)
