"""The MTP layer (sdk/blocks/decoder.py NextN: nextn and qwen_mtp) built from a spec, loaded strictly, against
an independent composition of its math, fp32 on CPU; then speculative decoding with it.

Tiny Kimi K3 and GLM-5.3 checkpoints get the NextN tensors the releases ship under layer L
(and a Qwen3.8 one Qwen3.5's mtp.*: fc, the pre-fc norms, norm, mtp.layers.0 a gated-attention
layer, the output normed before the head and the next draft):
enorm, hnorm, eh_proj, shared_head.norm, the decoder layer (K3: gated NoPE MLA + latent MoE, by
its layer rule; GLM-5.3: MLA with its own DSA indexer + MoE, named in the spec's mtp section),
and the tensors the built layer leaves unused (shared_head.head, an embed_tokens copy; K3's
attention-residual parameters). The reference: the family's reference model's final hidden z
(K3: the independent reference, after the output mix and norm; GLM-5.3: transformers'), then
    x_0 = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(z_i)],  y = layer_L(x_0) pre-norm,
    logits = lm_head(rmsnorm_s(y))
with the reference's own decoder-layer class at index L. Tolerance: 1e-4 of the largest |logit|
(parity's fp32 bound); 2 recorded seeds. Speculative decoding with method mtp: greedy tokens
equal a run without drafts, and the first verify step's drafts are the NextN chain by hand.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from kimi_k3_reference import KimiK3ForCausalLM, Layer, Norm
from one_row import nextn_logits
from safetensors.torch import load_file, save_file
from two_ranks import assert_drafting_on_two_ranks_answers_as_one

from dayzero.models.kimi_k3.config import KimiK3TextConfig
from dayzero.sdk.api import LLM
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.speculative import DeviceDrafts
from dayzero.sdk.errors import CheckpointError, WeightError
from dayzero.sdk.families import FAMILIES, build
from dayzero.sdk.loader import load_weights, open_checkpoint, open_mtp_head
from dayzero.sdk.parity.runner import RETRACTION, Tolerance, retraction_budget
from dayzero.sdk.parity.tiny import write_tiny

T = 19


@dataclass
class Kit:
    """A family's NextN checkpoint and its reference: z(ids) -> [T, H] final hidden (or [T, N, H]
    streams), layer(x) -> the reference decoder layer L as a pre-norm layer over a sequence
    [M, H] (composed: the whole composition f of `_nextn`), embed, lm_head; final(z): the
    hidden the model's own head reads."""

    path: object
    own: dict[str, torch.Tensor]
    z: Callable
    layer: Callable
    embed: torch.nn.Module
    lm_head: torch.nn.Module
    eps: float
    vocab: int
    composed: bool = False
    final: Callable = lambda z: z


def _random(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def _own(h: int, vocab: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "shared_head.head.weight": torch.randn(vocab, h, generator=g),  # unused: lm_head is shared
        "embed_tokens.weight": torch.randn(vocab, h, generator=g),  # unused: the main one is
    }


def _write(path, prefix: str, layer: dict[str, torch.Tensor], own: dict, drop: str | None) -> None:
    """Add layer L's tensors (checkpoint names after the prefix) and the NextN's own."""
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1
    extra = {f"{prefix}{k}": v.clone() for k, v in layer.items()}
    extra |= {f"{prefix}{k}": v for k, v in own.items()}
    if drop is not None:
        extra.pop(f"{prefix}{drop}")
    save_file(load_file(files[0]) | extra, files[0], metadata={"format": "pt"})


def _kimi(folder, seed: int, drop: str | None = None) -> Kit:
    path = write_tiny(
        "kimi_k3", folder, seed=seed, overrides={"text_config": {"num_nextn_predict_layers": 1}}
    )
    text = KimiK3TextConfig(**json.loads((path / "config.json").read_text())["text_config"])
    n, g = text.num_hidden_layers, torch.Generator().manual_seed(100 + seed)
    layer = Layer(text, n)  # MLA + MoE at index L, as the release's NextN layer
    _random(layer, g)
    own = _own(text.hidden_size, text.vocab_size, g)
    _write(path, f"language_model.model.layers.{n}.", layer.state_dict(), own, drop)
    lm = KimiK3ForCausalLM.from_pretrained(path).eval().language_model

    def pre_norm(x: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn(layer.input_layernorm(x))
        return x + layer.ffn(layer.post_attention_layernorm(x))

    return Kit(
        path, own, lm.model, pre_norm, lm.model.embed_tokens, lm.lm_head, text.rms_norm_eps, text.vocab_size
    )


def _glm(folder, seed: int, drop: str | None = None) -> Kit:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaDecoderLayer,
        GlmMoeDsaRotaryEmbedding,
    )

    path = write_tiny("glm53", folder, seed=seed)
    c = json.loads((path / "config.json").read_text())
    n = c["num_hidden_layers"]
    ext = {k: v + v[-1:] for k, v in c.items() if isinstance(v, list) and len(v) == n}
    ext |= {
        "indexer_types": c["indexer_types"] + ["full"],
        "mlp_layer_types": c["mlp_layer_types"] + ["sparse"],
    }
    if c.get("index_topk_pattern"):
        ext["index_topk_pattern"] = c["index_topk_pattern"] + "F"
    longer = GlmMoeDsaConfig(**{**c, **ext, "num_hidden_layers": n + 1})
    longer._attn_implementation = "eager"
    g = torch.Generator().manual_seed(100 + seed)
    layer = GlmMoeDsaDecoderLayer(longer, n).eval()  # its own indexer (full) and MoE, as the spec says
    _random(layer, g)
    own = _own(c["hidden_size"], c["vocab_size"], g)
    longer_model = GlmMoeDsaForCausalLM(longer)  # saved for layer L's checkpoint names (experts unfused)
    longer_model.model.layers[n] = layer
    longer_model.save_pretrained(folder / "longer")
    prefix = f"model.layers.{n}."
    saved = load_file(next((folder / "longer").glob("*.safetensors")))
    _write(path, prefix, {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}, own, drop)
    ref = GlmMoeDsaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    rotary = GlmMoeDsaRotaryEmbedding(longer)

    def z(ids: torch.Tensor) -> torch.Tensor:
        return ref.model(input_ids=ids[None]).last_hidden_state[0]

    def decoder_layer(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), torch.finfo(x.dtype).min).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos))
        return (out[0] if isinstance(out, tuple) else out)[0]

    return Kit(
        path, own, z, decoder_layer, ref.model.embed_tokens, ref.lm_head, c["rms_norm_eps"], c["vocab_size"]
    )


def _qwen(folder, seed: int, drop: str | None = None) -> Kit:
    """Qwen3.8 (Qwen3.5's MoE hybrid): mtp.* names, its layer a full (gated) attention layer under
    mtp.layers.0., its norms zero-centred (1 + w) as the model's, its output normed before the
    head and the next draft."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    path = write_tiny("qwen38", folder, seed=seed)
    c = json.loads((path / "config.json").read_text())
    n = c["num_hidden_layers"]
    longer = Qwen3_5MoeTextConfig(
        **{**c, "num_hidden_layers": n + 1, "layer_types": c["layer_types"] + ["full_attention"]}
    )
    longer._attn_implementation = "eager"
    g = torch.Generator().manual_seed(100 + seed)
    layer = Qwen3_5MoeDecoderLayer(longer, n).eval()
    _random(layer, g)
    longer_model = Qwen3_5MoeForCausalLM(longer)  # saved for the layer's checkpoint names
    longer_model.model.layers[n] = layer
    longer_model.save_pretrained(folder / "longer")
    prefix = f"model.layers.{n}."
    saved = load_file(next((folder / "longer").glob("*.safetensors")))
    tensors = {f"mtp.layers.0.{k[len(prefix) :]}": v for k, v in saved.items() if k.startswith(prefix)}
    h = c["hidden_size"]
    own = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(h, generator=g),  # zero-centred: 1 + w
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(h, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(h, generator=g),
    }
    files = sorted(path.glob("*.safetensors"))
    extra = tensors | own
    if drop is not None:
        extra.pop({"eh_proj.weight": "mtp.fc.weight"}.get(drop, drop))
    save_file(load_file(files[0]) | extra, files[0], metadata={"format": "pt"})
    ref = Qwen3_5MoeForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    norm = {}
    for k, name in (("e", "pre_fc_norm_embedding"), ("h", "pre_fc_norm_hidden"), ("s", "norm")):
        norm[k] = Qwen3_5MoeRMSNorm(h, c["rms_norm_eps"])
        norm[k].weight.data.copy_(own[f"mtp.{name}.weight"])

    def z(ids: torch.Tensor) -> torch.Tensor:
        return ref.model(input_ids=ids[None]).last_hidden_state[0]

    def decoder_layer(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pos = torch.arange(m).view(1, 1, -1)
        mask = torch.full((m, m), torch.finfo(x.dtype).min).triu(1)[None, None]
        rope = ref.model.rotary_emb(x[None], pos.expand(3, 1, -1))
        return layer(x[None], position_embeddings=rope, attention_mask=mask, position_ids=pos[0])[0]

    def f(hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (
            torch.cat((norm["e"](ref.model.embed_tokens(ids)), norm["h"](hidden)), -1)
            @ own["mtp.fc.weight"].T
        )
        y = norm["s"](decoder_layer(x))  # normed: the head's input and the next draft's hidden
        return ref.lm_head(y), y

    return Kit(
        path,
        own,
        z,
        f,
        ref.model.embed_tokens,
        ref.lm_head,
        c["rms_norm_eps"],
        c["vocab_size"],
        composed=True,
    )


def _glm_flash(folder, seed: int, drop: str | None = None) -> Kit:
    """GLM-5.3-Flash (hyper-connections over N streams): the NextN layer at index L is an indexed
    MLA + MoE layer with hyper-connections of its own; the reference reads the target's streams
    before their collapse (a hook on transformers' hc_head) and composes DeepSeek-V4's MTP:
        X_0[:, n] = W_eh [enorm(e) ; hnorm(Z[:, n])],  Y = layer_L(X_0),
        logits = lm_head(shared_head.norm(mean_n Y[:, n])),  Y fed back."""
    from transformers import AutoConfig, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer, Glm5NextTextRMSNorm

    path = write_tiny("glm53_flash", folder, seed=seed)
    cfg = AutoConfig.from_pretrained(path)
    t = cfg.text_config
    n, h = t.num_hidden_layers, t.hidden_size
    longer = AutoConfig.from_pretrained(path)
    lt = longer.text_config
    lt.num_hidden_layers = n + 1
    lt.layer_types = [*t.layer_types, "indexed_attention"]
    lt.indexer_types = [*t.indexer_types, "full"]
    lt.mlp_layer_types = [*t.mlp_layer_types, "sparse"]
    g = torch.Generator().manual_seed(100 + seed)
    layer = Glm5NextTextDecoderLayer(lt, n).eval()
    _random(layer, g)
    own = _own(h, t.vocab_size, g)
    longer_model = Glm5NextForConditionalGeneration(longer)  # saved for layer L's checkpoint names
    longer_model.model.language_model.layers[n] = layer
    longer_model.save_pretrained(folder / "longer")
    prefix = f"model.language_model.layers.{n}."
    saved = load_file(next((folder / "longer").glob("*.safetensors")))
    _write(path, prefix, {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}, own, drop)
    ref = Glm5NextForConditionalGeneration.from_pretrained(path).eval()
    lm = ref.model.language_model
    streams: list[torch.Tensor] = []
    lm.hc_head.register_forward_hook(lambda mod, args, out: streams.append(args[0][0]))
    norm = {}
    for k, name in (("e", "enorm"), ("h", "hnorm"), ("s", "shared_head.norm")):
        norm[k] = Glm5NextTextRMSNorm(h, t.rms_norm_eps)
        norm[k].weight.data.copy_(own[f"{name}.weight"])

    def z(ids: torch.Tensor) -> torch.Tensor:  # [T, N, H]: the streams before the collapse
        streams.clear()
        lm(input_ids=ids[None])
        return streams[-1]

    def f(hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, n_streams, _ = hidden.shape
        e = norm["e"](lm.embed_tokens(ids))[:, None, :].expand(m, n_streams, h)
        x = torch.cat((e, norm["h"](hidden)), -1) @ own["eh_proj.weight"].T  # [M, N, H]
        mask = torch.ones(1, m, dtype=torch.bool)
        y = layer(x[None], attention_mask=mask, position_ids=torch.arange(m)[None], position_embeddings=None)
        y = (y[0] if isinstance(y, tuple) else y)[0]  # [M, N, H]
        return ref.lm_head(norm["s"](y.mean(1))), y

    return Kit(
        path,
        own,
        z,
        f,
        lm.embed_tokens,
        ref.lm_head,
        t.rms_norm_eps,
        t.vocab_size,
        composed=True,
        final=lambda x: lm.norm(lm.hc_head(x[None]))[0],
    )


KITS = {"kimi_k3": _kimi, "glm53": _glm, "qwen38": _qwen, "glm53_flash": _glm_flash}


def _nextn(kit: Kit) -> Callable:
    """f(hidden [M, H], next ids [M]) -> (logits [M, V], what the next draft feeds back [M, H]):
    the NextN composition over a sequence (the reference layer attends causally over all of it);
    a `composed` kit gives the whole composition as its `layer`."""
    if kit.composed:
        return kit.layer
    h = kit.own["eh_proj.weight"].shape[0]
    norm = {k: Norm(h, kit.eps) for k in ("e", "h", "s")}
    for k, name in (("e", "enorm"), ("h", "hnorm"), ("s", "shared_head.norm")):
        norm[k].weight.data.copy_(kit.own[f"{name}.weight"])

    def f(hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat((norm["e"](kit.embed(ids)), norm["h"](hidden)), -1) @ kit.own["eh_proj.weight"].T
        y = kit.layer(x)  # [M, H]
        return kit.lm_head(norm["s"](y)), y

    return f


def record_drafts(engine: Engine) -> list[list[list[int]]]:
    """Each verify step's drafts, as the engine's drafter proposes them (read from the device)."""
    seen: list[list[list[int]]] = []
    inner = engine.drafter.draft

    def draft(*a):
        out = inner(*a)
        seen.append(out.tokens.tolist() if isinstance(out, DeviceDrafts) else out)
        return out

    engine.drafter.draft = draft
    return seen


def _ours(family: str, path):
    ckpt = open_checkpoint(path)
    fam = FAMILIES.get(family)
    cfg = fam.config(ckpt.hf, str(path), mtp=True)
    model, ops = build(fam, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    aside = load_weights(model, ckpt, progress=False)
    return model, cfg, ops, aside


@pytest.mark.parametrize("family", sorted(KITS))
@pytest.mark.parametrize("seed", [0, 7])
def test_nextn_layer_matches_an_independent_composition(tmp_path, family: str, seed: int) -> None:
    kit = KITS[family](tmp_path, seed)
    model, cfg, _, aside = _ours(family, kit.path)
    # set aside: shared_head.head and embed_tokens (and K3's four attention-residual tensors)
    assert aside == {"kimi_k3": 6, "glm53": 2, "qwen38": 0, "glm53_flash": 2}[family]
    assert cfg.mtp is not None and cfg.mtp.layer.index == len(cfg.layers)
    assert (
        cfg.mtp.layer.attn_kind == ("gqa" if family == "qwen38" else "mla")
        and cfg.mtp.layer.mlp_kind == "moe"
    )
    ids = torch.randint(0, kit.vocab, (T + 1,), generator=torch.Generator().manual_seed(seed))
    logits, z, got = nextn_logits(model, cfg, ids)
    with torch.no_grad():
        z_ref = kit.z(ids[:T])  # [T, H] the final hidden, normed
        want, _ = _nextn(kit)(z_ref, ids[1:])
    scale = want.abs().max().item()
    assert (z - z_ref).abs().max().item() < Tolerance().logits * scale
    assert (logits - kit.lm_head(kit.final(z_ref))).abs().max().item() < Tolerance().logits * scale
    assert (got - want).abs().max().item() < Tolerance().logits * scale, (got - want).abs().max().item()


@pytest.mark.parametrize("family", sorted(KITS))
def test_a_missing_nextn_tensor_fails_the_load_naming_it(tmp_path, family: str) -> None:
    kit = KITS[family](tmp_path, 0, drop="eh_proj.weight")
    with pytest.raises(WeightError, match=r"mtp\.eh_proj"):
        _ours(family, kit.path)


def test_without_the_mtp_runtime_the_nextn_tensors_are_set_aside(tmp_path) -> None:
    kit = _kimi(tmp_path, 0)
    ckpt = open_checkpoint(kit.path)
    fam = FAMILIES.get("kimi_k3")
    cfg = fam.config(ckpt.hf, str(kit.path))
    assert cfg.mtp is None
    model, _ = build(fam, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    aside = load_weights(model, ckpt, progress=False)
    assert aside > 6 and model.mtp is None  # every tensor of layer L


@pytest.mark.parametrize("family", sorted(KITS))
def test_mtp_drafts_are_the_nextn_layers_chain_and_lossless(tmp_path, family: str) -> None:
    """Speculative decoding with method mtp (3 drafts): the greedy tokens of two requests equal a
    run without drafts, and the first verify step's drafts are the NextN chain computed by hand
    with the reference: d_1 from the target's z over the prompt and the first token, then each
    d_{j+1} from the previous output fed back as the hidden."""
    k = 3
    kit = KITS[family](tmp_path, 0)
    model, cfg, ops, _ = _ours(family, kit.path)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, kit.vocab, (n,), generator=g).tolist() for n in (9, 14)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    base = Engine(model, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, greedy)
    eng = Engine(model, cfg, ops, EngineConfig(decode_graphs="off", speculative=SpeculativeConfig("mtp", k)))
    seen = record_drafts(eng)
    outs = eng.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert eng.stats["verify_rows"] > 0
    f = _nextn(kit)
    with torch.no_grad():
        for p, out, drafts in zip(prompts, base, seen[0], strict=True):
            ids = torch.tensor(p + out.token_ids[:1])
            hidden, nxt = kit.z(ids[:-1]), ids[1:]  # z over the prompt, each position's next token
            want = []
            for _ in range(k):
                logits, y = f(hidden, nxt)
                want.append(int(logits[-1].argmax()))
                hidden, nxt = torch.cat((hidden, y[-1:])), torch.cat((nxt, torch.tensor(want[-1:])))
            assert len(drafts) == k and drafts == want


@pytest.mark.parametrize("family", sorted(KITS))
def test_mtp_drafting_is_lossless_with_chunks_prefix_hits_and_retraction(tmp_path, family: str) -> None:
    """Method mtp (2 drafts) under chunked prefill (chunks of 8 on blocks of 4; the head observes
    each chunk), the prompts twice (prefix hits), then KV memory for the longest request alone
    (retraction; parity's chunks and blocks): the greedy tokens of one roomy engine without drafts."""
    k = 2
    kit = KITS[family](tmp_path, 0)
    model, cfg, ops, _ = _ours(family, kit.path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, kit.vocab, (n,), generator=g).tolist() for n in (5, 19, 30)]
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    base = [
        o.token_ids
        for o in Engine(model, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, greedy)
    ]
    spec = SpeculativeConfig("mtp", k)
    chunked = EngineConfig(
        decode_graphs="off", speculative=spec, block_size=4, chunk_size=8, max_tokens_per_step=24
    )
    eng = Engine(model, cfg, ops, chunked)
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == base
    hits = eng.scheduler.prefix_stats()["hit_tokens"]
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == base
    assert eng.scheduler.prefix_stats()["hit_tokens"] > hits and eng.stats["verify_rows"] > 0
    kv = retraction_budget(eng.groups, [len(p) + greedy.max_tokens + k for p in prompts], len(prompts))
    fields = dict(RETRACTION, kv_cache_bytes=kv, max_batch_size=len(prompts))
    small = Engine(model, cfg, ops, EngineConfig(decode_graphs="off", speculative=spec, **fields))
    assert [o.token_ids for o in small.generate(prompts, greedy)] == base
    assert small.stats["retracted"] > 0
    # the decode graphs' buffers (run eagerly): verify steps as single-token rows (recurrent
    # states kept after each token, the kept one copied back), and the head's drafts from their
    # z the same as from the varlen pass's
    drafts = {}
    for mode in ("off", "buffers"):
        e = Engine(model, cfg, ops, EngineConfig(decode_graphs=mode, speculative=spec))
        seen = record_drafts(e)
        assert [o.token_ids for o in e.generate(prompts, greedy)] == base
        drafts[mode] = seen
    assert e.stats["graph_steps"] > 0  # with recurrent state: each token's state checkpointed
    head = [g for g, _ in (*cfg.mtp.layer.caches, *cfg.mtp.layer.ngram_caches)]
    head_stateless = not any(cfg.cache_groups[g].kind == "state" for g in head)
    assert (e.stats["head_graph_passes"] > 0) == head_stateless, (family, e.stats["head_graph_passes"])
    assert drafts["buffers"] == drafts["off"] and len(drafts["off"]) > 3


def test_an_mtp_layer_with_recurrent_state_keeps_its_passes_out_of_graphs(tmp_path, caplog) -> None:
    """The head's graphs run its kept tokens as rows of their own; a head layer that keeps
    recurrent state (here Qwen3.8's layer rules pointed at its state group) would have them share
    a slot, so its passes stay eager, said so; with a paged layer they run in the graphs."""
    kit = KITS["qwen38"](tmp_path, 0)
    model, cfg, ops, _ = _ours("qwen38", kit.path)
    config = EngineConfig(decode_graphs="buffers", speculative=SpeculativeConfig("mtp", 2))
    assert Engine(model, cfg, ops, config).head_graphs is not None
    state = next(g for g, c in enumerate(cfg.cache_groups) if c.kind == "state")
    stateful = replace(cfg, mtp=replace(cfg.mtp, layer=replace(cfg.mtp.layer, caches=((state, 0),))))
    with caplog.at_level(logging.INFO, logger="dayzero.sdk.engine.engine"):
        eng = Engine(model, stateful, ops, config)
    assert eng.head_graphs is None and eng.graphs is not None  # the verify steps' graphs stay
    assert "MTP head runs eagerly (no CUDA graphs): the MTP layer keeps recurrent state" in caplog.text


def test_mtp_drafting_over_streams_on_two_ranks_answers_as_one_rank(tmp_path) -> None:
    """GLM-5.3-Flash's head over the hyper-connection streams on tensor-parallel ranks (gloo),
    its passes in the head graphs' buffers on every rank: greedy and seeded answers, and the
    acceptance counts, equal one rank's."""
    kit = _glm_flash(tmp_path, 1)
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(0, kit.vocab, (n,), generator=g).tolist()} for n in (6, 21)]
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    ]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    assert_drafting_on_two_ranks_answers_as_one(kit.path, spec, prompts, params, graphs="buffers")


def test_a_head_folder_with_a_nested_config_drafts_as_the_checkpoint_with_the_layer(tmp_path) -> None:
    """Kimi K3's config nests its fields under text_config: the kit's checkpoint split into one
    without the NextN layer (text_config.num_nextn_predict_layers 0) and a head folder holding
    the layer and {"text_config": {"num_nextn_predict_layers": 1}} drafts the same greedy tokens
    and acceptance as the whole checkpoint; a nested field that disagrees is refused by its
    dotted name."""
    kit = _kimi(tmp_path / "whole", 0)
    whole = kit.path
    n = json.loads((whole / "config.json").read_text())["text_config"]["num_hidden_layers"]
    (file,) = whole.glob("*.safetensors")
    tensors, layer = load_file(file), f"language_model.model.layers.{n}."
    base, head = tmp_path / "base", tmp_path / "head"
    shutil.copytree(whole, base)
    save_file({k: v for k, v in tensors.items() if not k.startswith(layer)}, base / file.name)
    cfg = json.loads((whole / "config.json").read_text())
    cfg["text_config"]["num_nextn_predict_layers"] = 0
    (base / "config.json").write_text(json.dumps(cfg))
    head.mkdir()
    save_file({k: v for k, v in tensors.items() if k.startswith(layer)}, head / "model.safetensors")
    (head / "config.json").write_text(json.dumps({"text_config": {"num_nextn_predict_layers": 1}}))
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(0, kit.vocab, (m,), generator=g).tolist()} for m in (7, 19)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    runs = []
    for path, config in ((whole, spec), (base, spec | {"model": str(head)})):
        llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=config, progress=False)
        runs.append(([c.outputs[0].token_ids for c in llm.generate(prompts, greedy)], llm.engine.stats))
    (want, want_stats), (got, got_stats) = runs
    assert got == want and got_stats["accepted_at"] == want_stats["accepted_at"]
    assert got_stats["verify_rows"] == want_stats["verify_rows"] > 0
    (head / "config.json").write_text(
        json.dumps({"text_config": {"num_nextn_predict_layers": 1, "hidden_size": 8}})
    )
    with pytest.raises(
        CheckpointError, match=r"another model: text_config.hidden_size is 8 in its config.json"
    ):
        open_mtp_head(head, open_checkpoint(base))


def test_an_mtp_config_value_the_head_does_not_implement_is_refused_by_name(tmp_path) -> None:
    """Qwen3.8 with mtp_use_dedicated_embeddings (an MTP embedding of its own): served without
    the head (set aside), refused by name when the head is built."""
    from dayzero.sdk.errors import SpecError

    path = write_tiny("qwen38", tmp_path, seed=0, overrides={"mtp_use_dedicated_embeddings": True})
    ckpt = open_checkpoint(path)
    fam = FAMILIES.get("qwen38")
    assert fam.config(ckpt.hf, str(path)).mtp is None
    with pytest.raises(SpecError, match=r"mtp_use_dedicated_embeddings.*True is not implemented"):
        fam.config(ckpt.hf, str(path), mtp=True)


def test_the_mtp_head_over_a_learned_stream_collapse_is_refused_by_name(tmp_path) -> None:
    """Qwen3.8-Flash-Next: low-rank hyper-connections, whose collapse is learned; which one the
    head's output takes has no reference, so the head is refused when built (served without)."""
    from dayzero.sdk.errors import SpecError

    ckpt = open_checkpoint(write_tiny("qwen38_flash_next", tmp_path, seed=0))
    assert ckpt.family.config(ckpt.hf, str(ckpt.path)).mtp is None
    with pytest.raises(SpecError, match=r"mtp.*learned low-rank mixer is not implemented"):
        ckpt.family.config(ckpt.hf, str(ckpt.path), mtp=True)


def test_a_quantized_checkpoints_mtp_head_loads_packed_and_drafts(tmp_path) -> None:
    """K3 with W4A16 NVFP4 routed experts (ModelOpt's layout), the NextN layer's among them: built
    for drafting, the head's experts load packed, and its logits equal those of the same
    checkpoint with every packed weight dequantized into a float checkpoint (the packed reference
    kernel dequantizes, then multiplies: within fp32 rounding, 1e-5 of the largest |logit|);
    drafting with it keeps the greedy tokens of a run without drafts."""
    from dayzero.kernels.packed import DEQUANT, PackedWeight
    from dayzero.sdk.bench.quantize import quantize

    kit = _kimi(tmp_path / "float", 0)
    tensors = load_file(next(kit.path.glob("*.safetensors")))
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if ".experts." not in name:
            packed[name] = dequantized[name] = t
            continue
        c = quantize(t.float(), "nvfp4")
        packed |= {name: c["codes"], f"{name}_scale": c["scale"], f"{name}_scale_2": c["global"][0]}
        dequantized[name] = DEQUANT["nvfp4"](c).float()
    for folder, out in (("packed", packed), ("dequantized", dequantized)):
        (tmp_path / folder).mkdir()
        for f in kit.path.iterdir():
            if f.suffix != ".safetensors":
                (tmp_path / folder / f.name).write_bytes(f.read_bytes())
        save_file(out, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
    side = {"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": []}}
    (tmp_path / "packed" / "hf_quant_config.json").write_text(json.dumps(side))
    quant, cfg, ops, _ = _ours_packed(tmp_path / "packed")
    assert any(isinstance(m, PackedWeight) for m in quant.mtp.modules())  # the head's experts
    flt, _, _, _ = _ours("kimi_k3", tmp_path / "dequantized")
    ids = torch.randint(0, kit.vocab, (T + 1,), generator=torch.Generator().manual_seed(3))
    got, want = nextn_logits(quant, cfg, ids)[2], nextn_logits(flt, cfg, ids)[2]
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    prompts = [
        torch.randint(0, kit.vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (7, 12)
    ]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base = Engine(quant, cfg, ops, EngineConfig(decode_graphs="off")).generate(prompts, greedy)
    eng = Engine(quant, cfg, ops, EngineConfig(decode_graphs="off", speculative=SpeculativeConfig("mtp", 2)))
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == [o.token_ids for o in base]
    assert eng.stats["verify_rows"] > 0


def _ours_packed(path):
    """`_ours` for a quantized checkpoint: the model built with its packing, the head's too."""
    ckpt = open_checkpoint(path)
    cfg = ckpt.family.config(ckpt.hf, str(path), mtp=True)
    model, ops = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32, ckpt.mtp_packing.params)
    aside = load_weights(model, ckpt, progress=False)
    return model, cfg, ops, aside
