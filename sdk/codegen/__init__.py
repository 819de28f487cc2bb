"""Codegen: render `templates/` (jinja2) from each family's spec into its folder, `models/<family>/`
(a spec outside models/, `dayzero codegen --spec PATH`: the spec's own folder).

Outputs per family: `model.py` (composition of blocks), `cache.py` (cache geometry),
`README.md` (model card), `test_parity.py` (the family's parity test), `__init__.py`.
Each starts with a "generated from spec.yaml@<hash>, do not edit" line. Codegen never looks at
a family's name: everything comes from the spec and the block library.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import jinja2

from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.ngram import PREFIX as NGRAM
from dayzero.sdk.blocks.ngram import static_ngram_cache
from dayzero.sdk.codegen.hardware import needs
from dayzero.sdk.codegen.spec_doc import render as render_doc
from dayzero.sdk.codegen.support import support_matrix
from dayzero.sdk.engine.geometry import GroupDecl
from dayzero.sdk.families import FAMILIES, Family
from dayzero.sdk.spec.assemble import mtp_unbuildable, resolve
from dayzero.sdk.spec.checks import rule_blocks
from dayzero.sdk.spec.reference import spec_config
from dayzero.sdk.spec.resolver import Resolver

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
OUTPUTS = ("__init__.py", "model.py", "cache.py", "README.md", "test_parity.py")


def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
    )


def _groups(fam: Family) -> list[dict]:
    """Cache parts with equal (kind, sharing key) share a group, in order of first use."""
    loaded = fam.spec
    used = [b for _, b in rule_blocks(loaded.spec.layers.attention)]
    owners = [
        (name, BLOCKS.get(loaded.blocks[name].kind).static_cache(loaded.blocks[name]))
        for name in dict.fromkeys(used)
    ]
    if loaded.spec.embedding.ngram is not None:  # per-layer n-gram embeddings keep state too
        owners.append((NGRAM, static_ngram_cache()))
    by_key: dict[tuple[str, str], dict] = {}
    for name, static in owners:
        for part in static:
            g = by_key.setdefault(
                (part.kind, part.key), {"name": part.name, "kind": part.kind, "members": []}
            )
            g["members"].append(f"{name}.{part.part}")
    out = list(by_key.values())
    for g in out:  # several groups wanting one name: number them
        same = [h for h in out if h["name"] == g["name"]]
        if len(same) > 1:
            for i, h in enumerate(same):
                h["name"] = f"{h['name']}_{i}"
    return out


def _decls(groups: list[dict]) -> tuple[GroupDecl, ...]:
    return tuple(GroupDecl(g["name"], g["kind"], tuple(g["members"])) for g in groups)


GPUS_PER_HOST = 8  # an H200 host


def _releases(fam: Family, groups: list[dict], model_source: str) -> list[dict]:
    """The model card's launch lines for the real checkpoints, with what each needs."""
    rels = fam.spec.spec.release
    rels = [] if rels is None else rels if isinstance(rels, list) else [rels]
    return [_release(fam, rel, groups, model_source) for rel in rels]


def _release(fam: Family, rel, groups: list[dict], model_source: str) -> dict:
    cfg = resolve(
        fam.spec,
        spec_config(fam.spec.spec, dict(rel.config)),
        _decls(groups),
        "release config",
    )
    module = types.ModuleType(f"{fam.name}.model")  # the model as rendered now
    exec(compile(model_source, f"models/{fam.folder}/model.py", "exec"), module.__dict__)
    n = needs(module, cfg, rel.format, rel.packed)
    flags = ([f"--quantization {rel.format}"] if rel.format != "bf16" else []) + (
        [f"--tensor-parallel-size {n.gpus}"] if n.gpus > 1 else []
    )
    command = " ".join(["dayzero serve", rel.checkpoint, *flags])
    hosts = max(1, n.gpus // GPUS_PER_HOST)
    if hosts > 1:  # the same command on every host, host 0 serving
        rdzv = f"--nnodes {hosts} --node-rank {{i}} --master-addr HOST0 --master-port 29500"
        command = "\n".join(f"{command} {rdzv.format(i=i)}  # on host {i}" for i in range(hosts))
    status = ""
    if n.gpus > 1:
        layout = f"{hosts} hosts of {GPUS_PER_HOST}" if hosts > 1 else "one host"
        status = (
            f"served tensor-parallel on {n.gpus} ranks ({layout}, one process a GPU, rank 0 serving); "
            "checked on CPU ranks (gloo), not yet run on GPUs"
        )
    line = n.line(rel.format) + (
        " (packed as released: " + ", ".join(f"{p} {f}" for p, f in rel.packed.items()) + "; the rest bf16)"
        if rel.packed
        else ""
    )
    return {
        "checkpoint": rel.checkpoint,
        "label": rel.label,
        "command": command,
        "needs": line,
        "status": status,
    }


def _mtp_line(fam: Family, spec) -> str:
    """The card's line on drafting with the family's MTP head (speculative decoding)."""
    if spec.mtp is None:
        return ""
    if why := mtp_unbuildable(spec):
        return (
            f"MTP head ({spec.mtp.kind}): its tensors are set aside ({why}; "
            '`--speculative-config \'{"method": "ngram", ...}\'` drafts by prompt lookup).'
        )
    k = spec.mtp.draft_tokens if isinstance(spec.mtp.draft_tokens, int) else 1
    flag = f'--speculative-config \'{{"method": "mtp", "num_speculative_tokens": {k}}}\''
    line = (
        f"Speculative decoding with its MTP head ({spec.mtp.kind}; lossless: the verify pass keeps the "
        f"target's distribution): add `{flag}` (with tensor parallelism too; not with data-parallel "
        "attention yet); "
        "a head in its own folder (config.json + safetensors under the layer's checkpoint names): "
        '`"model": "DIR"` in that config.'
    )
    rels = spec.release if isinstance(spec.release, list) else [spec.release] if spec.release else []
    layers = [
        Resolver(fam.spec, spec_config(spec, dict(r.config)), "release").value(spec.mtp.layers) for r in rels
    ]
    if rels and not any(layers):
        line += (
            " The release config declares no MTP layer: drafting needs a checkpoint or head folder with one."
        )
    return line


def _residual_text(spec) -> str:
    r, ng = spec.residual, spec.embedding.ngram
    text = r.kind + (", depth-scaled" if r.depth_scaled else "")
    text += f" ({r.mixer} mixer, streams={r.streams})" if r.kind == "hyper" else ""
    text += f" (snapshots every {r.block} layers)" if r.kind == "attn_res" else ""
    if ng is not None:
        text += (
            f"; n-gram embeddings into the streams before layers {ng.layers} (counted from {ng.counted_from})"
        )
    return text


def _describe(opts) -> str:
    d = opts.model_dump(exclude_defaults=True, exclude={"kind"}, by_alias=True)
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in d.items()) or "-"


def _rule_text(rule) -> str:
    return json.dumps(rule.model_dump(exclude_defaults=True)).replace('"', "")


def _model_py(fam: Family, env: jinja2.Environment, header: str) -> str:
    """The generated model module: the spec's block kinds mapped to their modules."""
    kinds = {role: [] for role in ("attention", "mlp")}
    for _, opts in fam.spec.blocks.items():
        bdef = BLOCKS.get(opts.kind)
        if (bdef.kind, bdef.module) not in kinds[bdef.role]:
            kinds[bdef.role].append((bdef.kind, bdef.module))
    imports: dict[str, list[str]] = {"dayzero.sdk.blocks.decoder": ["Decoder"]}
    for role in kinds.values():
        for _, cls in role:
            imports.setdefault(cls.__module__, []).append(cls.__name__)
    residual = fam.spec.spec.residual
    doc = {
        "sandwich": "Each layer: x + post_norm(attn(norm(x))), then the same around the MLP",
        "prenorm": "Each layer: x + attn(norm(x)), then x + mlp(norm(x))",
        "postnorm": "Each layer: x + post_norm(attn(x)), then x + post_norm(mlp(x))",
        "hyper": "Each layer: N residual streams mixed by hyper-connections around attn, then the MLP",
        "attn_res": "Each layer: attn, then the MLP, each on its norm of a learned mix of the\n"
        "residual snapshots (attention residuals)",
    }[residual.kind] + (" (depth-scaled adds)." if residual.depth_scaled else ".")
    return env.get_template("model.py.j2").render(
        header=header,
        title=fam.spec.spec.title,
        imports=sorted((m, sorted(set(n))) for m, n in imports.items()),
        attention=[(k, c.__name__) for k, c in kinds["attention"]],
        mlp=[(k, c.__name__) for k, c in kinds["mlp"]],
        residual_doc=doc,
    )


def _variants(fam: Family, env: jinja2.Environment) -> list[dict]:
    """Families in sub-folders of this one (other architectures of the same model family)."""
    out = []
    for _, v in FAMILIES.items():
        if v.spec_path.parent.parent == fam.spec_path.parent:
            rel = _releases(v, _groups(v), _model_py(v, env, ""))
            out.append(
                {
                    "title": v.spec.spec.title,
                    "card": f"{v.spec_path.parent.name}/README.md",
                    "release": rel,
                }
            )
    return out


def render(fam: Family) -> dict[str, str]:
    loaded, env = fam.spec, _env()
    spec = loaded.spec
    header = f"# generated from spec.yaml@{loaded.hash}, do not edit"
    groups = _groups(fam)
    ctx = {
        "header": header,
        "header_md": f"<!-- generated from spec.yaml@{loaded.hash}, do not edit -->",
        "family": spec.family,
        "folder": fam.folder,
        "out_of_tree": not fam.in_tree,  # its parity test registers its spec
        "parity_test": f"models/{fam.folder}/test_parity.py" if fam.in_tree else "test_parity.py",
        "title": spec.title,
        "reference": spec.reference,
        "architectures": spec.architectures,
        "model_types": spec.model_types,
        "groups": groups,
        "shapes": repr([{}, *spec.shapes]),
        "parity": spec.parity,
        "blocks": [
            {"role": BLOCKS.get(o.kind).role, "name": n, "kind": o.kind, "options": _describe(o)}
            for n, o in loaded.blocks.items()
        ],
        "layer_types_attention": _rule_text(spec.layers.attention),
        "layer_types_mlp": _rule_text(spec.layers.mlp),
        "residual": _residual_text(spec),
        "head": f"tie={spec.head.tie}, softcap={spec.head.softcap}",
        "parity_shapes": 1 + len(spec.shapes),
        "support": support_matrix(fam, _decls(groups)),
    }
    model_py = _model_py(fam, env, header)
    ctx["releases"] = _releases(fam, groups, model_py)
    ctx["variants"] = _variants(fam, env)
    ctx["mtp"] = _mtp_line(fam, spec)
    out = {
        "__init__.py": f'{header}\n"""{spec.title} (generated; the source of truth is spec.yaml)."""\n',
        "model.py": model_py,
        "cache.py": env.get_template("cache.py.j2").render(ctx),
        "README.md": env.get_template("README.md.j2").render(ctx),
        "test_parity.py": env.get_template("test_parity.py.j2").render(ctx),
    }
    return {k: _format(k, v) for k, v in out.items()}


def _format(name: str, text: str) -> str:
    """Generated Python is ruff-formatted, so the committed files pass the repo's lint."""
    if not name.endswith(".py"):
        return text
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--quiet", "--stdin-filename", name, "-"],
        input=text,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"codegen formats {name} with ruff (pip install 'ruff==0.17.6'): {r.stderr.strip()}"
        )
    return r.stdout


SPEC_DOC = Path(__file__).resolve().parents[2] / "docs" / "spec-reference.md"


def stale_docs() -> list[Path]:
    return [] if SPEC_DOC.exists() and SPEC_DOC.read_text() == render_doc() else [SPEC_DOC]


def write_docs() -> list[Path]:
    changed = stale_docs()
    if changed:
        SPEC_DOC.write_text(render_doc())
    return changed


def stale(fam: Family) -> list[Path]:
    return [
        fam.spec.folder / name
        for name, text in render(fam).items()
        if not (fam.spec.folder / name).exists() or (fam.spec.folder / name).read_text() != text
    ]


def write(fam: Family) -> list[Path]:
    changed = stale(fam)
    for name, text in render(fam).items():
        path = fam.spec.folder / name
        if path in changed:
            path.write_text(text)
    return changed
