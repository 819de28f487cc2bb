"""Config keys read in more than one way (issue 14): GLM's `index_topk_pattern` and its
`index_topk_freq` / `index_skip_topk_offset` schedule, and two keys for one spec symbol.

`index_topk_pattern` ("FSS...": layer i runs its own DSA / KPool indexer on F, reuses the
previous layer's top-k on S) is what a hand-written GLM config carries; GlmMoeDsaConfig and
Glm5NextTextConfig turn it into `indexer_types`. The specs read it through their layer rule
(`letters`), and refuse what transformers cannot run (a letter other than F / S, a pattern
shorter than the layers, a shared first layer; for glm5_next a shared layer not right after
an indexed full one: Glm5NextText hands a selection on one layer only). The test draws patterns
(and glm5_next layer types) from the recorded seeds and compares with transformers itself: its
config class and a forward pass of the tiny reference model decide what is valid and which
layers own an indexer.

Without indexer_types and index_topk_pattern, both config classes derive the indexers from
`index_topk_freq` / `index_skip_topk_offset` (layer i full when max(i - offset + 1, 0) %
max(freq, 1) == 0; freq 1, offset 2 by default: all full). The specs read it as their indexer
column's default (a `rule: every` with an offset); present beside indexer_types or a pattern
(transformers' own config.json keeps all of them) it must agree, else it is refused naming the
keys and values. Drawn (freq, offset) schedules are compared with transformers as above.

Two HF keys a spec names for one symbol (`[text_config.vocab_size, vocab_size]`,
`[rope_parameters.rope_theta, rope_theta]`) or for one per-layer column
(`indexer_types|index_topk_pattern`) that are both present must agree: different values are
refused naming both keys and values, equal ones resolve as one key alone does.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from conftest import SEEDS

from dayzero.sdk.errors import SpecError
from dayzero.sdk.families import FAMILIES
from dayzero.sdk.spec.reference import reference_class, reference_config
from dayzero.sdk.spec.resolver import MISSING, field
from dayzero.sdk.spec.schema import Symbol

GLM = ["glm53", "glm53_flash"]
PATTERNS_PER_SEED = 6


def _text(cfg: dict) -> dict:
    """The text config (flash nests it under text_config; GLM-5.3 is flat)."""
    return cfg.get("text_config", cfg)


def _tiny(family: str) -> dict:
    """The spec's tiny overrides without any per-layer indexer field."""
    tiny = copy.deepcopy(dict(FAMILIES.get(family).spec.spec.tiny))
    for k in ("index_topk_pattern", "indexer_types", "layer_types"):
        _text(tiny).pop(k, None)
    return tiny


def _draw(rng: random.Random, n: int, flash: bool) -> tuple[str, list[str] | None]:
    """A pattern (mostly F / S, at times a bad letter or one layer short) and, for glm5_next,
    layer types (None: the config class's default, every 4th layer indexed)."""
    k = rng.choice([n, n, n, n + 1, n - 1])
    pattern = "".join(rng.choice("FFS") for _ in range(k))
    if rng.random() < 0.15:
        i = rng.randrange(k)
        pattern = pattern[:i] + rng.choice("sX1") + pattern[i + 1 :]
    layers = None
    if flash and rng.random() < 0.8:
        layers = [rng.choice(["linear_attention", "full_attention", "full_attention"]) for _ in range(n)]
    return pattern, layers


def _transformers(family: str, tiny: dict, pattern: str, layers: list[str] | None):
    """What transformers makes of the pattern (`_reference_run`)."""
    over = copy.deepcopy(tiny)
    _text(over)["index_topk_pattern"] = pattern
    if layers is not None:
        _text(over)["layer_types"] = layers
    return _reference_run(family, over)


def _reference_run(family: str, over: dict):
    """What transformers makes of a config: per layer (attention kind, runs its own indexer;
    None for KDA) from the model it builds and runs, or the exception it raises."""
    cls = reference_class(FAMILIES.get(family).spec.spec.reference)
    try:
        cfg = cls.config_class(**over)
        torch.manual_seed(0)
        model = cls(cfg).eval()
        with torch.no_grad():
            model(torch.arange(7)[None])
    except (KeyError, IndexError, ValueError) as e:
        return e
    text = cfg.get_text_config()
    stack = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [
        ("kda", None)
        if text.layer_types[i] == "linear_attention"
        else ("mla", layer.self_attn.indexer is not None)
        for i, layer in enumerate(stack.layers)
    ]


def _hand_written(family: str, tiny: dict, pattern: str, layers: list[str] | None) -> dict:
    """The reference config's keys as a lab would write them: the pattern, no indexer_types
    (and no layer_types unless drawn)."""
    fam = FAMILIES.get(family)
    hf = reference_config(fam.spec.spec.reference, tiny)
    text = _text(hf)
    text.pop("indexer_types")
    text.pop("layer_types")
    text["index_topk_pattern"] = pattern
    if layers is not None:
        text["layer_types"] = layers
    return hf


def _kinds(cfg) -> list[tuple[str, bool | None]]:
    return [
        (layer.attn_kind, None if layer.attn_kind == "kda" else not layer.attn.indexer.reuse)
        for layer in cfg.layers
    ]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", GLM)
def test_index_topk_pattern_alone_reads_as_transformers_reads_it(family: str, seed: int) -> None:
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    n = int(_text(tiny)["num_hidden_layers"])
    rng = random.Random(seed)
    valid = refused = 0
    for _ in range(PATTERNS_PER_SEED):
        pattern, layers = _draw(rng, n, family == "glm53_flash")
        want = _transformers(family, tiny, pattern, layers)
        hf = _hand_written(family, tiny, pattern, layers)
        if isinstance(want, Exception):
            with pytest.raises(SpecError) as e:
                fam.config(hf)
            assert "index_topk_pattern" in str(e.value) and repr(pattern) in str(e.value), (pattern, e.value)
            refused += 1
            continue
        got = fam.config(hf)
        assert _kinds(got) == want, (pattern, layers)
        # transformers' own config.json (the pattern and the indexer_types it derived) resolves
        # to the same model
        over = copy.deepcopy(tiny)
        _text(over)["index_topk_pattern"] = pattern
        if layers is not None:
            _text(over)["layer_types"] = layers
        saved = reference_config(fam.spec.spec.reference, over)
        assert _text(saved)["indexer_types"] and _text(saved)["index_topk_pattern"] == pattern
        assert fam.config(saved) == got
        valid += 1
    assert valid + refused == PATTERNS_PER_SEED


@pytest.mark.parametrize("family", GLM)
def test_named_patterns(family: str) -> None:
    """Fixed cases each side of the rules, against transformers as above (the seeded draws may
    miss one): a shared layer after a shared one (valid in GLM-5.3 only), a shared first layer,
    a bad letter, a pattern longer than the layers (the rest unused)."""
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    layers = ["full_attention"] * 4 if family == "glm53_flash" else None
    cases = {"FSSF": family == "glm53", "SFFF": False, "FsFF": False, "FSFSF": True, "FSF": False}
    for pattern, ok in cases.items():
        want = _transformers(family, tiny, pattern, layers)
        assert isinstance(want, list) == ok, (pattern, want)
        hf = _hand_written(family, tiny, pattern, layers)
        if ok:
            assert _kinds(fam.config(hf)) == want
        else:
            with pytest.raises(SpecError, match="index_topk_pattern"):
                fam.config(hf)


@pytest.mark.parametrize("family", GLM)
def test_indexer_types_and_a_pattern_that_disagree_are_refused(family: str) -> None:
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    hf = reference_config(fam.spec.spec.reference, tiny)  # indexer_types: all full
    text = _text(hf)
    n = len(text["indexer_types"])
    text["index_topk_pattern"] = "F" * n
    fam.config(hf)  # the same per-layer kinds: accepted
    text["index_topk_pattern"] = "F" * (n - 1) + "S"
    with pytest.raises(SpecError) as e:
        fam.config(hf)
    msg = str(e.value)
    assert "indexer_types" in msg and "index_topk_pattern" in msg and repr("F" * (n - 1) + "S") in msg


# ---- two keys for one symbol -------------------------------------------------------------------


def _get(cfg: dict, dotted: str) -> Any:
    v = field(cfg, dotted)
    return None if v is MISSING else v


def _put(cfg: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    cur = cfg
    for part in parents:
        cur = cur.setdefault(part, {})
    cur[last] = value


def _other(v: Any, rng: random.Random) -> Any:
    """A value of the same type that differs from v."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.randint(1, 9)
    if isinstance(v, float):
        return v * rng.uniform(1.5, 3.0) + 1.0
    if isinstance(v, str):
        return v + "_other"
    if isinstance(v, list):
        return [*v, rng.randint(0, 9)]
    if isinstance(v, dict):  # one of its keys changed (a key the other mapping also has)
        k = rng.choice(sorted(v))
        return {**v, k: _other(v[k], rng)}
    raise AssertionError(f"no other value for {v!r}")


def _alternatives(family: str) -> list[tuple[str, list[str]]]:
    out = []
    for name, sym in FAMILIES.get(family).spec.spec.symbols.items():
        sym = Symbol(field=sym) if isinstance(sym, str) else sym
        if isinstance(sym.field, list) and len(sym.field) > 1:
            out.append((name, sym.field))
    return out


def test_every_glm_spec_declares_alternatives() -> None:
    assert len(_alternatives("glm53_flash")) > 20 and _alternatives("glm53")  # the test below runs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", ["llama", "beam", "glm53", "glm53_flash"])
def test_two_keys_for_one_symbol_must_agree(family: str, seed: int) -> None:
    """For each symbol a spec reads from several keys: with the value it is read as also under
    another of its keys, the config resolves to the same model; with a different value there,
    it is refused, naming both keys and both values."""
    fam = FAMILIES.get(family)
    spec = fam.spec.spec
    base = reference_config(spec.reference, dict(spec.tiny))
    want = fam.config(base)
    read = dict(want.symbols)
    rng = random.Random(seed)
    checked = 0
    for name, fields in _alternatives(family):
        present = [f for f in fields if _get(base, f) is not None]
        if not present:
            continue  # the symbol takes its default: nothing to disagree with
        first = present[0]
        value = _get(base, first)
        assert read[name] == value
        for other in fields:
            if other == first:
                continue
            same = copy.deepcopy(base)
            _put(same, other, copy.deepcopy(value))
            assert fam.config(same) == want, (name, other)
            differ = copy.deepcopy(base)
            bad = _other(value, rng)
            _put(differ, other, bad)
            with pytest.raises(SpecError) as e:
                fam.config(differ)
            msg, path = str(e.value), e.value.path
            if path != f"{first} / {other}":
                # refused by a symbol reading the mappings around both keys (llama's rope_params:
                # rope_parameters / rope_scaling, around rope_kind's rope_type keys)
                a, b = path.split(" / ")
                assert first.startswith(a + ".") and other.startswith(b + "."), (name, msg)
                assert repr(bad) in msg, (name, msg)
            else:
                for part in (repr(value)[:60], repr(bad)[:60]):
                    assert part in msg, (name, part, msg)
            checked += 1
    if _alternatives(family):
        assert checked > 0


# ---- the freq / offset schedule ----------------------------------------------------------------

SCHEDULE_KEYS = ("index_topk_freq", "index_skip_topk_offset")
SCHEDULES_PER_SEED = 6


def _draw_schedule(rng: random.Random, flash: bool) -> tuple[int, dict, list[str] | None]:
    """Layers, the schedule keys present (at least one; a period of 0 or below reads as 1 in
    transformers, an offset may be negative or past the last layer) and, for glm5_next, layer
    types (None: the config class's default)."""
    n = rng.choice([4, 5, 6, 8])
    keys: dict[str, int] = {}
    if rng.random() < 0.85:
        keys["index_topk_freq"] = rng.choice([-1, 0, 1, 2, 2, 3, 3, 4, 5])
    if rng.random() < 0.7 or not keys:
        keys["index_skip_topk_offset"] = rng.choice([-2, -1, 0, 1, 2, 2, 3, n])
    layers = None
    if flash and rng.random() < 0.6:
        layers = [rng.choice(["linear_attention", "full_attention", "full_attention"]) for _ in range(n)]
    return n, keys, layers


def _schedule_over(tiny: dict, n: int, keys: dict, layers: list[str] | None) -> dict:
    over = copy.deepcopy(tiny)
    _text(over)["num_hidden_layers"] = n
    _text(over).update(keys)
    if layers is not None:
        _text(over)["layer_types"] = layers
    return over


def _without_indexer_types(family: str, over: dict, keys: dict, layers: list[str] | None) -> dict:
    """The reference config as a lab would write it: the schedule keys, no indexer_types (and no
    layer_types unless drawn)."""
    hf = reference_config(FAMILIES.get(family).spec.spec.reference, {**over})
    text = _text(hf)
    text.pop("indexer_types")
    text.pop("layer_types")
    for k in SCHEDULE_KEYS:
        text.pop(k, None)
    text.update(keys)
    if layers is not None:
        text["layer_types"] = layers
    return hf


def _named_keys(msg: str, keys: dict) -> bool:
    return all(f"{k}={v!r}" in msg for k, v in keys.items())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", GLM)
def test_index_topk_freq_and_offset_read_as_transformers_reads_them(family: str, seed: int) -> None:
    """Drawn (freq, offset) schedules against transformers' config class and a forward pass of
    its tiny model: the same layers own an indexer, and what transformers cannot run is refused
    naming the schedule's keys and values, written without indexer_types (a hand-written config)
    or with the indexer_types the config class derived beside them (its config.json)."""
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    rng = random.Random(seed)
    valid = refused = 0
    for _ in range(SCHEDULES_PER_SEED):
        n, keys, layers = _draw_schedule(rng, family == "glm53_flash")
        over = _schedule_over(tiny, n, keys, layers)
        want = _reference_run(family, over)
        hand = _without_indexer_types(family, over, keys, layers)
        saved = reference_config(fam.spec.spec.reference, over)
        assert all(_text(saved)[k] == v for k, v in keys.items()) and _text(saved)["indexer_types"]
        if isinstance(want, Exception):
            with pytest.raises(SpecError) as e:
                fam.config(hand)
            assert _named_keys(str(e.value), keys), (keys, layers, e.value)
            with pytest.raises(SpecError) as e:
                fam.config(saved)
            assert "indexer_types" in str(e.value) and _named_keys(str(e.value), keys), (keys, e.value)
            refused += 1
            continue
        got = fam.config(hand)
        assert _kinds(got) == want, (n, keys, layers)
        assert fam.config(saved) == got, (n, keys, layers)
        valid += 1
    assert valid + refused == SCHEDULES_PER_SEED


@pytest.mark.parametrize("family", GLM)
def test_named_schedules(family: str) -> None:
    """Fixed cases each side of the rules, against transformers as above: all full by default and
    for a period of 1 or below, a shared first layer (offset 0), shared runs (valid in GLM-5.3
    only), an offset past the last layer."""
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    flash = family == "glm53_flash"
    layers = ["full_attention"] * 6 if flash else None
    cases = [
        ({"index_topk_freq": 1}, True),
        ({"index_topk_freq": 0, "index_skip_topk_offset": 0}, True),
        ({"index_topk_freq": -3}, True),
        ({"index_skip_topk_offset": 5}, True),
        ({"index_topk_freq": 2}, True),  # F F S F S F
        ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, False),  # S F S F ...
        ({"index_topk_freq": 3, "index_skip_topk_offset": 1}, not flash),  # F S S F S S
        ({"index_topk_freq": 4, "index_skip_topk_offset": 6}, True),  # all six before the offset
    ]
    for keys, ok in cases:
        over = _schedule_over(tiny, 6, keys, layers)
        want = _reference_run(family, over)
        assert isinstance(want, list) == ok, (keys, want)
        hf = _without_indexer_types(family, over, keys, layers)
        if ok:
            assert _kinds(fam.config(hf)) == want, keys
        else:
            with pytest.raises(SpecError) as e:
                fam.config(hf)
            assert _named_keys(str(e.value), keys), (keys, e.value)


def _prefixed(family: str, keys: dict) -> dict:
    """Schedule keys as the spec names them in messages (flash's under text_config)."""
    pre = "text_config." if family == "glm53_flash" else ""
    return {pre + k: v for k, v in keys.items()}


@pytest.mark.parametrize("family", GLM)
def test_a_schedule_beside_indexer_types_or_a_pattern_must_agree(family: str) -> None:
    """indexer_types > index_topk_pattern > freq / offset: present together, they must say the
    same (the model is then the one each alone gives); else the config is refused naming the
    keys and values of both sides."""
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    layers = ["full_attention"] * 6 if family == "glm53_flash" else None
    keys = {"index_topk_freq": 2, "index_skip_topk_offset": 1}  # F S F S F S
    over = _schedule_over(tiny, 6, keys, layers)
    alone = fam.config(_without_indexer_types(family, over, keys, layers))
    saved = reference_config(fam.spec.spec.reference, over)
    assert _text(saved)["indexer_types"] == ["full", "shared"] * 3
    assert fam.config(saved) == alone
    pattern = copy.deepcopy(saved)
    _text(pattern)["index_topk_pattern"] = "FSFSFS"
    assert fam.config(pattern) == alone  # all three agree
    _text(pattern).pop("indexer_types")
    assert fam.config(pattern) == alone
    shown = _prefixed(family, keys)
    # the pattern says otherwise
    _text(pattern)["index_topk_pattern"] = "FSFSFF"
    with pytest.raises(SpecError) as e:
        fam.config(pattern)
    msg = str(e.value)
    assert "index_topk_pattern='FSFSFF'" in msg and _named_keys(msg, shown), msg
    # indexer_types says otherwise (a hand-edited config.json)
    for k, v in [("indexer_types", ["full"] * 6), ("index_topk_freq", 3), ("index_skip_topk_offset", 2)]:
        edited = copy.deepcopy(saved)
        _text(edited)[k] = v
        with pytest.raises(SpecError) as e:
            fam.config(edited)
        msg = str(e.value)
        now = _prefixed(family, {**keys, **({k: v} if k in keys else {})})
        assert "indexer_types=" in msg and repr(_text(edited)["indexer_types"])[:60] in msg, msg
        assert _named_keys(msg, now), (k, msg)


@pytest.mark.parametrize("family", GLM)
def test_a_schedule_is_whole_numbers(family: str) -> None:
    """2 and 2.0 read the same; 2.5, "2" and true are refused naming the key."""
    fam = FAMILIES.get(family)
    tiny = _tiny(family)
    layers = ["full_attention"] * 4 if family == "glm53_flash" else None
    want = fam.config(
        _without_indexer_types(family, _schedule_over(tiny, 4, {}, layers), {"index_topk_freq": 2}, layers)
    )
    hf = _without_indexer_types(family, _schedule_over(tiny, 4, {}, layers), {"index_topk_freq": 2.0}, layers)
    assert _kinds(fam.config(hf)) == _kinds(want)
    for bad in (2.5, "2", True):
        hf = _without_indexer_types(
            family, _schedule_over(tiny, 4, {}, layers), {"index_topk_freq": bad}, layers
        )
        with pytest.raises(SpecError, match="index_topk_freq"):
            fam.config(hf)


def test_expressions_take_max_and_min_only() -> None:
    """`= max(freq, 1)` (the clamp of transformers' schedule): max / min of positional
    arguments, no other call."""
    from dayzero.sdk.spec.expr import evaluate, names

    values = {"freq": -3, "b": 5}
    assert names("max(freq, 1) + min(b, 2)") == {"freq", "b"}
    assert evaluate("max(freq, 1) + min(b, 2)", values.__getitem__) == 3
    for bad in ("print(freq)", "max(*freq)", "max(freq, key=b)", "max()", "freq.real", "max(freq)(1)"):
        with pytest.raises(ValueError, match="only numbers"):
            names(bad)
