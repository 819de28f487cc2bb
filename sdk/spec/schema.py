"""The spec schema (pydantic v2): what a model lab writes in `models/<family>/spec.yaml`.

A spec is data. Numbers and flags in block options are literals or `$symbol` references; a
symbol is read from the HF config (`symbols:`), so one spec serves every size of a family.
Block kinds come from the block library (`dayzero.sdk.blocks`); the union of their option
schemas is built from that registry, so a new block is usable by any spec once registered.

Every key of the HF config is accounted for (default-deny, `sdk/spec/config_keys.py`): read by
a symbol or layer rule, listed in `implements` (the value(s) the blocks implement, checked) or in
`ignores` (with the reason it does not change the math), or on the global no-effect list (ids
and names, dtype, token ids, outputs, dropout and init). Any other key is refused, naming the key
and its value; so is a key inside a rope mapping read whole that `rope.py` does not read for its type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, field_validator, model_validator

from dayzero.sdk.blocks.ngram import NgramOpts
from dayzero.sdk.config.options import BoolV, FloatV, Formula, IntV, Ref, Strict

QUANT_FORMATS = ("fp8_block", "mxfp4", "nvfp4")
BUILTINS = (
    "hidden",
    "norm_eps",
    "norm_weight_in_fp32",
    "max_position",
)  # symbols every spec has (see Resolver)
MTP_KINDS = ("nextn", "qwen_mtp")


class Symbol(Strict):
    """A spec symbol read from the HF config: the first present field wins, else `default`
    (a literal, a list of literals, a `$symbol`, or `= expression`: arithmetic over symbols
    with max / min, list values with len() and indexing, e.g. `= hidden // heads`,
    `= max(freq, 1)`, `= len(mlp_only_layers)`).
    A required symbol whose field is absent or null and that has no default is an error."""

    field: str | list[str] | None = None
    default: int | float | bool | str | list[int | float | bool | str] | None = None
    required: bool = True


class RuleAll(Strict):
    rule: Literal["all"]
    block: str


class RuleField(Strict):
    """Per-layer kinds from a list field of the HF config, each value mapped to a block. With
    several fields, layer i's key joins their i-th values with `+` (`indexed_attention+shared`).
    A field `a|b` reads the first of the alternatives present (`text_config.layer_types|layer_types`);
    alternatives present together must agree (else the config is refused, naming both).

    letters: an alternative written as a string of one letter per layer, each letter the list
    value it stands for (`index_topk_pattern: {F: full, S: shared}` reads "FSS" as [full, shared,
    shared]); any other letter is refused. defaults: the values of a field (by the name it is
    written under in `field`) when none of its alternatives is present, from a rule whose
    `block` / `other` name the field's values; a field missing without a default takes `fallback`
    for the whole rule. A default whose numbers are `$symbols` read from keys present in the
    config (a schedule the config class derives the field from: `index_topk_freq`) is a source
    of its own: the field, when present, wins (as in transformers) and must agree with it (else
    the config is refused, naming the keys and values). follows: a block -> the blocks the layer
    right before it may map to (a layer reusing the previous layer's work); a layer breaking it,
    or the first, is refused."""

    rule: Literal["field"]
    field: str | list[str]
    map: dict[str, str]
    letters: dict[str, dict[Annotated[str, StringConstraints(min_length=1, max_length=1)], str]] = {}
    defaults: dict[str, Annotated[RuleEvery | RuleFirst | RuleAll, Field(discriminator="rule")]] = {}
    follows: dict[str, list[str]] = {}
    fallback: RuleEvery | RuleFirst | RuleAll | RuleIndices | None = Field(default=None, discriminator="rule")

    @model_validator(mode="after")
    def _names_known(self) -> RuleField:
        fields = [self.field] if isinstance(self.field, str) else self.field
        alts = {a for f in fields for a in f.split("|")}
        if bad := sorted(set(self.letters) - alts):
            raise ValueError(f"letters names {', '.join(bad)}, not an alternative of {fields}")
        if bad := sorted(set(self.defaults) - set(fields)):
            raise ValueError(f"defaults names {', '.join(bad)}, not one of {fields}")
        blocks = set(self.map.values())
        if bad := sorted((set(self.follows) | {b for v in self.follows.values() for b in v}) - blocks):
            raise ValueError(
                f"follows names {', '.join(bad)}, not a block of the map ({', '.join(sorted(blocks))})"
            )
        return self


class RuleEvery(Strict):
    """Layer i gets `block` when max(i + 1 - offset, 0) % n == 0 (and the last layer when
    `last`), else `other`. With offset 0 (the default): every n-th layer (layers n-1, 2n-1, ...);
    with offset k: the first k layers, then every n-th after layer k-1 (transformers' periodic
    schedules: GLM's `index_topk_freq` / `index_skip_topk_offset` is n / offset). n and offset
    are whole numbers (`$symbols` read from the config; n must be > 0: a schedule that clamps
    it says so in an `= max(..., 1)` symbol)."""

    rule: Literal["every"]
    n: IntV
    offset: IntV = 0
    block: str
    other: str
    last: bool = False


class RuleFirst(Strict):
    """The first k layers get `block`, the rest `other`."""

    rule: Literal["first"]
    k: IntV
    block: str
    other: str


class RuleIndices(Strict):
    """The layers whose indices are listed in `layers` get `block`; the others get `other`: a
    block, or the block a nested rule (`all`, `every`, `first`) gives them. `layers` is a list
    of whole numbers >= 0, written in the spec or a `$symbol` / `= expression` read from the
    config (Qwen2-MoE's `mlp_only_layers`, with `other: {rule: every, n: $decoder_sparse_step,
    block: moe, other: dense}`); an index past the last layer names no layer (as in transformers).
    `base`: the number the list gives the first layer (1: Kimi K3's 1-based `kda_layers`)."""

    rule: Literal["indices"]
    layers: list[int] | Ref | Formula
    base: Literal[0, 1] = 0
    block: str
    other: str | Annotated[RuleEvery | RuleFirst | RuleAll, Field(discriminator="rule")]


LayerRule = Annotated[RuleAll | RuleField | RuleEvery | RuleFirst | RuleIndices, Field(discriminator="rule")]
RuleField.model_rebuild()  # its defaults and fallback name rules defined after it


class Layers(Strict):
    count: IntV
    attention: LayerRule
    mlp: LayerRule


class Residual(Strict):
    """prenorm: x + f(norm(x)). sandwich: x + post_norm(f(norm(x))). postnorm: x + post_norm(f(x)),
    no norm before the block (OLMo 2's order). depth_scaled: the k-th
    residual add (k = 2, 3, ... counting both adds of every layer) is r * sqrt((k-1)/k) + f / sqrt(k).
    hyper: manifold-constrained hyper-connections over `streams` residual streams (see
    `dayzero.sdk.blocks.norm.HyperResidual`); the embedding is copied into every stream and the
    streams are averaged before the final norm; with `mixer: lowrank` Qwen4-Exp's low-rank
    dynamic mixer of rank `rank` (`LowRankHyperResidual`), whose collapse replaces the average
    and the final norm. branch_scale m: each add is x + m f (Granite's residual_multiplier; not
    with hyper). attn_res: attention residuals over snapshots of the residual stream taken every
    `block` layers (Kimi K3, `dayzero.sdk.blocks.norm.AttnResidual`): each block's input and the
    final norm's are learned softmax mixes of the snapshots and the partial sum."""

    kind: Literal["prenorm", "sandwich", "postnorm", "hyper", "attn_res"]
    depth_scaled: bool = False
    branch_scale: FloatV = 1.0
    streams: IntV = 1  # hyper
    sinkhorn_iters: IntV = 20  # hyper
    eps: FloatV = 1e-6  # hyper: floor added to the pre and comb weights and Sinkhorn sums
    mixer: Literal["sinkhorn", "lowrank"] = "sinkhorn"  # hyper: how the streams are mixed
    rank: IntV | None = None  # hyper, lowrank: the mixer's rank
    block: IntV | None = None  # attn_res: layers a block spans (Kimi K3's attn_res_block_size)


class Norm(Strict):
    """The residual and final RMSNorms. weight_in_fp32: the weight multiplies the fp32 normed
    value before it is rounded (Gemma / OLMo2 order; else rounded first, Llama order);
    zero_centred: the weight is applied as (1 + w), formed in fp32 (Gemma; needs weight_in_fp32)."""

    kind: Literal["rms"] = "rms"
    eps: FloatV
    weight_in_fp32: bool = False
    zero_centred: BoolV = False

    @model_validator(mode="after")
    def _fp32_product(self) -> Norm:
        if self.zero_centred is True and not self.weight_in_fp32:
            raise ValueError("zero_centred multiplies by (1 + w) in fp32: set weight_in_fp32: true")
        return self


class Embedding(Strict):
    """x = W[ids], times `scale` when given (Gemma: `= hidden ** 0.5`), the scale rounded to the
    model dtype before the product as transformers rounds its fp32 `embed_scale`. `ngram`:
    per-layer hashed n-gram embeddings injected into the residual streams before the listed
    layers (Qwen4-Exp's PLE, `dayzero.sdk.blocks.ngram.NgramInjection`; needs residual kind
    hyper with mixer lowrank)."""

    vocab: IntV
    dim: IntV  # the model width; blocks read it as $hidden
    scale: FloatV | None = None
    ngram: NgramOpts | None = None


class Head(Strict):
    """The LM head: logits = h W^T (W the embedding's when tied), times `scale` (Granite's
    = 1 / logits_scaling, Cohere's logit_scale), then cap tanh(logits / cap) with a softcap."""

    tie: BoolV = False
    softcap: FloatV | None = None
    scale: FloatV = 1.0


class Transform(Strict):
    """One weight transform (see Weight transforms below): its `kind` and `args` (literals,
    `$symbol`s or `= expressions`), checked against the kind's arguments when the spec loads."""

    kind: str
    args: dict[str, Any] = {}


class WeightRule(Strict):
    """`from` a checkpoint name pattern to a parameter target.

    Patterns may hold `{i}` (layer) and `{e}` (expert). A target is a parameter name followed by
    selectors: `[{e}]` picks an expert along the leading dim, `[part]` a named part of a fused
    parameter (e.g. `layers.{i}.attn.in_proj.weight[q]`). `transform`: one transform or a list,
    applied in order; a list `to` takes the pieces of a splitting transform (`split_heads`,
    `split`), one target each. `block`: the rule applies only to the layers whose attention or
    mlp is one of these blocks (the same checkpoint name maps to different parameters per
    layer kind); a tensor of a layer that no rule maps is an error naming it."""

    src: str = Field(alias="from")
    to: str | list[str] = Field(union_mode="left_to_right")
    transform: Transform | list[Transform] | None = None
    unless: Ref | None = None  # skip (ignore the tensor) when this boolean symbol is true
    block: str | list[str] | None = None

    @property
    def transforms(self) -> list[Transform]:
        t = self.transform
        return [] if t is None else [t] if isinstance(t, Transform) else list(t)

    @property
    def targets(self) -> list[str]:
        return [self.to] if isinstance(self.to, str) else list(self.to)

    @property
    def blocks(self) -> list[str]:
        return [] if self.block is None else [self.block] if isinstance(self.block, str) else list(self.block)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class MtpLayerNames(Strict):
    prefix: str
    to: str


class WeightFormat(Strict):
    """One checkpoint format's weight rules. gguf's `config` reads the HF config from the file's
    metadata, per HF field: `{arch}.key` (a metadata key, `{arch}` the file's architecture),
    `len:key` (the length of a tokenizer array: `vocab_size: "len:tokenizer.ggml.tokens"` for a
    file without `{arch}.vocab_size`, as llama.cpp counts the vocabulary) or `tensor_absent:name`
    (true when the file has no such tensor, e.g. a tied head); a missing key leaves the field unset."""

    format: Literal["safetensors", "gguf"]
    rules: list[WeightRule]
    ignore: list[str] = []
    # tensors of the MTP (NextN) layers, set aside for the MTP runtime: globs in which `{mtp}`
    # stands for each MTP layer index (count .. count + mtp.layers - 1); counted, never loaded
    mtp: list[str] = []
    # of those, the ones the NextN layer does not use when it is built (speculative decoding with
    # method mtp): copies of the shared embedding or head, parameters its pre-norm residual has
    # no use for; the same globs, set aside and counted
    mtp_unused: list[str] = []
    # the MTP layer's tensors under their own prefix (Qwen: mtp.layers.0.) are read as decoder
    # layer L's (`to`, with {i}: L), so that the layers' rules map them
    mtp_layer: MtpLayerNames | None = None
    config: dict[str, str] = {}  # gguf: HF field -> metadata key ({arch} expands)
    # gguf: the files' general.architecture values this section reads, when llama.cpp names the
    # architecture other than the spec's model_types (Gemma 3's text decoder is `gemma3`, the
    # image-text model_type): a file of one is detected as this family
    general_architecture: list[str] = []
    # gguf: the HF config path the file's RoPE scaling ({arch}.rope.scaling.*, rope_freqs) is
    # written to; a per-layer-type entry for a model that scales some layers only (Gemma 3's
    # full-attention layers: rope_parameters.full_attention)
    rope_parameters: str = "rope_parameters"

    @model_validator(mode="after")
    def _gguf_only(self) -> WeightFormat:
        if self.format != "gguf" and (
            self.config or self.general_architecture or self.rope_parameters != "rope_parameters"
        ):
            raise ValueError(
                "config, general_architecture and rope_parameters read GGUF metadata: format gguf only"
            )
        if self.rope_parameters.split(".")[0] not in ("rope_parameters", "rope_scaling"):
            raise ValueError(
                f"rope_parameters {self.rope_parameters!r}: a path under rope_parameters or rope_scaling"
            )
        return self


class ReferenceModules(Strict):
    """Where `dayzero parity`'s layer diff hooks the reference model (`{i}`: the layer index); a
    role left out is not compared (the embedding needs no path: `get_input_embeddings()`).
    `attention` / `mlp`: one path for every layer, or a path per block of that role, by the
    spec's block names (a hybrid keeps its linear-attention layers under `linear_attn`, its
    attention layers under `self_attn`); such a mapping names every block the layer rules use."""

    layer: str | None = None
    attention: str | dict[str, str] | None = None
    mlp: str | dict[str, str] | None = None

    def path(self, role: str, block: str, i: int) -> str | None:
        """The reference module of layer i's `role` ("layer", "attention", "mlp"), whose block
        (of that role) is `block`; None: not compared."""
        p = getattr(self, role)
        p = p.get(block) if isinstance(p, dict) else p
        return None if p is None else p.replace("{i}", str(i))


class Release(Strict):
    """The real checkpoint a model card's launch command serves: its hub id, the HF-config
    fields that differ from the reference config class's defaults, its weight format, and which
    of dayzero's parameters it holds packed (`packed`: fnmatch patterns over the model's
    parameter names -> format; empty: every matrix but the embedding in `format`)."""

    checkpoint: str
    # the card's heading for it where it is not the family's own release (e.g. the architecture's
    # checkpoint that the reference config's defaults describe); else "The release checkpoint"
    label: str | None = None
    config: dict[str, Any] = {}
    format: Literal["bf16", "fp8_block", "mxfp4", "nvfp4"] = "bf16"
    packed: dict[str, Literal["fp8_block", "mxfp4", "nvfp4"]] = {}


class Parity(Strict):
    """What the generated parity test runs: `seeds` per shape (1..4; shape i takes them from the
    recorded list at i, in turn, so that one seed a shape still runs several seeds), the quantized layouts
    (true: every ModelOpt format and convention; `formats`: every format in ModelOpt's own
    convention, the other conventions being the same numbers renamed; false: none; a mapping:
    the release's layouts,
    `format/convention` -> the reference's modules they quantize as fnmatch patterns, the others
    left unquantized, e.g. `{mxfp4/compressed_tensors: ["*.experts.*"]}`), and `new_tokens`
    greedy tokens per prompt. The float shapes run every check of `run_parity`, the quantized
    layouts those that read weights (the cache checks see no difference between formats); a light
    test (`quantized: false`, no `shapes`) keeps a coverage family's CI time to seconds."""

    seeds: Annotated[int, Field(ge=1, le=4)] = 1
    quantized: bool | Literal["formats"] | dict[str, list[str]] = True
    new_tokens: Annotated[int, Field(ge=1)] = 32

    @field_validator("quantized")
    @classmethod
    def _layouts(cls, v: bool | str | dict[str, list[str]]) -> bool | str | dict[str, list[str]]:
        for key, modules in v.items() if isinstance(v, dict) else ():
            if key.count("/") != 1 or not all(key.split("/")) or not modules:
                raise ValueError(f"quantized layout {key!r}: want 'format/convention': [module patterns]")
        return v


class Mtp(Strict):
    """The multi-token-prediction head (sdk/config/model.py MtpCfg), one layer after the
    decoder's L: nextn, DeepSeek / GLM / Kimi's NextN (a chained draft feeds the layer's output
    back); qwen_mtp, Qwen3.5's mtp.* (the same math, the output normed before it is fed back).
    Its blocks are those the layer rules give layer L, or `attention` / `mlp` (block names)
    where the rules cannot place a layer L (per-layer config lists of length L). `implements`:
    config values the head is built for, checked when it is (as the spec's `implements`)."""

    kind: Literal["nextn", "qwen_mtp"]
    layers: IntV = 1
    draft_tokens: IntV = 1
    attention: str | None = None
    mlp: str | None = None
    implements: dict[str, Any] = {}


class Spec(Strict):
    family: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$")]
    title: str
    architectures: list[str] = Field(min_length=1)
    model_types: list[str] = Field(min_length=1)
    reference: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")]
    # the config class, where the reference's is not importable wherever the spec is read (a
    # family transformers lacks: its reference lives with the tests, its config in the package)
    config_class: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")] | None = None
    reference_modules: ReferenceModules = ReferenceModules()  # for the layer diff
    tiny: dict[str, Any]
    shapes: list[dict[str, Any]] = []  # extra HF-config overrides the parity test also runs
    parity: Parity = Parity()  # what the generated parity test runs
    symbols: dict[str, str | Symbol]
    layers: Layers
    blocks: dict[str, Any]  # validated against the block library (`dayzero.sdk.blocks`)
    residual: Residual
    norm: Norm
    embedding: Embedding
    head: Head = Head()
    weights: list[WeightFormat] = Field(min_length=1)
    mtp: Mtp | None = None
    release: Release | list[Release] | None = None  # a list: several release checkpoints
    # `dayzero bench decode`: HF-config overrides scaling the real model to one GPU
    bench: dict[str, Any] = {}
    max_position: IntV | None = None
    eos_token_ids: Ref | None = None
    # HF-config fields that change the math but that the blocks implement one way only: the
    # value(s) they implement (a literal, a list of them, a `$symbol` or an `= expression` for a
    # field derived from others). A checkpoint whose config sets another value is refused, naming
    # the field and its value (absent or null fields take transformers' default and pass).
    implements: dict[str, Any] = {}
    # HF-config fields of the reference config class that do not change the served math (training
    # knobs, fields the config class derives and overwrites, a vision tower not served): field ->
    # the reason. Every config key must be read by a symbol, listed in `implements` or here, or be
    # on the global no-effect list (sdk/spec/config_keys.py); any other is refused by name and value.
    ignores: dict[str, Annotated[str, StringConstraints(min_length=3)]] = {}
    # how the family's models write tool calls (sdk/server/tools.py: hermes, glm45, kimi_k2)
    tool_parser: str | None = None

    @field_validator("weights")
    @classmethod
    def _one_rule_set_per_format(cls, weights: list[WeightFormat]) -> list[WeightFormat]:
        formats = [w.format for w in weights]
        if len(set(formats)) != len(formats):
            raise ValueError(f"each format may appear once, got {formats}")
        return weights
