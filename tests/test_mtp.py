"""The NextN MTP layer (sdk/blocks/decoder.py NextN) built from a spec, loaded strictly, against
an independent composition of its math, fp32 on CPU.

A tiny Kimi K3 checkpoint with num_nextn_predict_layers 1 gets the NextN tensors the release
ships under layer L (4): enorm, hnorm, eh_proj, shared_head.norm, an MLA + MoE decoder layer,
and the tensors the built layer leaves unused (shared_head.head, an embed_tokens copy, the
attention-residual parameters). The reference: the independent K3 reference's final hidden z
(after the output mix and norm), then x_0 = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(z_i)], its
own `Layer(c, L)` as a pre-norm layer, the shared head over rmsnorm_s. Tolerance: 1e-4 of the
largest |logit| (parity's fp32 bound); 2 recorded seeds. Then speculative decoding with method
mtp: lossless, and its drafts the NextN chain computed by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from kimi_k3_reference import Layer, Norm
from one_row import context
from safetensors.torch import load_file, save_file

from dayzero.models.kimi_k3.config import KimiK3TextConfig
from dayzero.sdk.errors import WeightError
from dayzero.sdk.families import FAMILIES, build
from dayzero.sdk.loader import load_weights, open_checkpoint
from dayzero.sdk.parity.runner import Tolerance
from dayzero.sdk.parity.tiny import write_tiny

T = 19
PREFIX = "language_model.model.layers."


def _nextn_checkpoint(folder, seed: int, drop: str | None = None):
    """A tiny K3 checkpoint with a NextN layer at index L; drop: leave that tensor out."""
    path = write_tiny(
        "kimi_k3", folder, seed=seed, overrides={"text_config": {"num_nextn_predict_layers": 1}}
    )
    text = KimiK3TextConfig(**json.loads((path / "config.json").read_text())["text_config"])
    n, h = text.num_hidden_layers, text.hidden_size
    g = torch.Generator().manual_seed(100 + seed)
    torch.manual_seed(100 + seed)
    layer = Layer(text, n)  # MLA + MoE at index L, as the release's NextN layer
    for name, p in layer.named_parameters():
        with torch.no_grad():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name else p.normal_(0, 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    extra = {f"{PREFIX}{n}.{k}": v.clone() for k, v in layer.state_dict().items()}
    own = {
        "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "shared_head.head.weight": torch.randn(text.vocab_size, h, generator=g),  # unused: lm_head is
        "embed_tokens.weight": torch.randn(text.vocab_size, h, generator=g),  # unused: the main one
    }
    extra |= {f"{PREFIX}{n}.{k}": v for k, v in own.items()}
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0]) | extra
    if drop is not None:
        tensors.pop(f"{PREFIX}{n}.{drop}")
    save_file(tensors, files[0], metadata={"format": "pt"})
    return path, text, layer, {k: v for k, v in own.items()}


def _ours(path):
    ckpt = open_checkpoint(path)
    fam = FAMILIES.get("kimi_k3")
    cfg = fam.config(ckpt.hf, str(path), mtp=True)
    model, _ = build(fam, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    aside = load_weights(model, ckpt, progress=False)
    return model, cfg, aside


@pytest.mark.parametrize("seed", [0, 7])
def test_nextn_layer_matches_an_independent_composition(tmp_path, seed: int) -> None:
    path, text, layer, own = _nextn_checkpoint(tmp_path, seed)
    model, cfg, aside = _ours(path)
    assert aside == 6  # shared_head.head, embed_tokens and the four attention-residual tensors
    assert cfg.mtp is not None and cfg.mtp.layer.index == text.num_hidden_layers
    assert cfg.mtp.layer.attn_kind == "mla" and cfg.mtp.layer.mlp_kind == "moe"
    from kimi_k3_reference import KimiK3ForCausalLM

    ref = KimiK3ForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, text.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(seed))
    ctx = context(T, cfg.cache_groups)
    ctx.input_ids = ids[:T].clone()
    ctx.sample_index = torch.arange(T)
    with torch.no_grad():
        logits, z = model(ctx, hidden=True)
        got, _ = model.mtp(ids[1:], z, ctx, model.embed, model.head)  # [T, V]
        lm = ref.language_model
        z_ref = lm.model(ids[:T])  # [T, H] after the output mix and the final norm
        want, _ = _reference_nextn(lm, layer, own, text)(z_ref, ids[1:])
    scale = want.abs().max().item()
    assert (z - z_ref).abs().max().item() < Tolerance().logits * scale
    assert (logits - lm.lm_head(z_ref)).abs().max().item() < Tolerance().logits * scale
    assert (got - want).abs().max().item() < Tolerance().logits * scale, (got - want).abs().max().item()


def test_a_missing_nextn_tensor_fails_the_load_naming_it(tmp_path) -> None:
    path, *_ = _nextn_checkpoint(tmp_path, 0, drop="eh_proj.weight")
    with pytest.raises(WeightError, match=r"mtp\.eh_proj"):
        _ours(path)


def test_without_the_mtp_runtime_the_nextn_tensors_are_set_aside(tmp_path) -> None:
    path, *_ = _nextn_checkpoint(tmp_path, 0)
    ckpt = open_checkpoint(path)
    fam = FAMILIES.get("kimi_k3")
    cfg = fam.config(ckpt.hf, str(path))
    assert cfg.mtp is None
    model, _ = build(fam, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    n_layer = len(load_file(next(path.glob("*.safetensors"))))
    aside = load_weights(model, ckpt, progress=False)
    assert 0 < aside < n_layer and model.mtp is None


def _reference_nextn(lm, layer, own, text):
    """f(hidden [M, H], next ids [M]) -> (logits [M, V], y [M, H]): the NextN composition over a
    sequence, causal (the K3 reference's layer attends over the whole sequence)."""
    eps = text.rms_norm_eps
    norm = {k: Norm(text.hidden_size, eps) for k in ("e", "h", "s")}
    for k, name in (("e", "enorm"), ("h", "hnorm"), ("s", "shared_head.norm")):
        norm[k].weight.data.copy_(own[f"{name}.weight"])

    def f(hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (
            torch.cat((norm["e"](lm.model.embed_tokens(ids)), norm["h"](hidden)), -1)
            @ own["eh_proj.weight"].T
        )
        x = x + layer.self_attn(layer.input_layernorm(x))
        y = x + layer.ffn(layer.post_attention_layernorm(x))
        return lm.lm_head(norm["s"](y)), y

    return f


def test_mtp_drafts_are_the_nextn_layers_chain_and_lossless(tmp_path) -> None:
    """Speculative decoding with method mtp (3 drafts) on the K3 NextN checkpoint: the greedy
    tokens of two requests equal a run without drafts, and the first verify step's drafts are
    the NextN chain computed by hand with the reference composition: d_1 from the target's z over
    the prompt and the first token, then each d_{j+1} from the previous output fed back."""
    from kimi_k3_reference import KimiK3ForCausalLM

    from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
    from dayzero.sdk.engine.speculative import SpeculativeConfig

    k = 3
    path, text, layer, own = _nextn_checkpoint(tmp_path, 0)
    model, cfg, _ = _ours(path)
    ops = next(m.ops for m in model.modules() if hasattr(m, "ops"))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, text.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    base = Engine(model, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, greedy)
    eng = Engine(model, cfg, ops, EngineConfig(decode_graphs="off", speculative=SpeculativeConfig("mtp", k)))
    seen: list[list[list[int]]] = []
    inner = eng.drafter.draft
    eng.drafter.draft = lambda *a: seen.append(inner(*a)) or seen[-1]
    outs = eng.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert eng.stats["verify_rows"] > 0
    ref = KimiK3ForCausalLM.from_pretrained(path).eval()
    f = _reference_nextn(ref.language_model, layer, own, text)
    with torch.no_grad():
        for p, out, drafts in zip(prompts, base, seen[0], strict=True):
            ids = torch.tensor(p + out.token_ids[:1])
            hidden, nxt = ref.language_model.model(ids[:-1]), ids[1:]  # z over the prompt, next tokens
            want = []
            for _ in range(k):
                logits, y = f(hidden, nxt)
                want.append(int(logits[-1].argmax()))
                hidden, nxt = torch.cat((hidden, y[-1:])), torch.cat((nxt, torch.tensor(want[-1:])))
            assert len(drafts) == k and drafts == want
