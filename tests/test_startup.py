"""`dayzero serve` fails fast: flags, files, the port and the chat template are checked before
the weights load; an open bind without a key warns; checkpoints and specs that cannot be served
are named."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest
from server_fixture import Server

LOADING = "opening the checkpoint"  # the first thing `dayzero serve` logs once it loads a model
BUILDING = "building the model"  # logged after the tokenizer and chat template, before the weights
WEIGHTS = "loading weights"  # the weight bar


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dayzero.sdk.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from dayzero.sdk.parity.tiny import write_tiny

    return str(write_tiny("llama", tmp_path_factory.mktemp("tiny") / "ckpt", seed=3))


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("serve", "--port", str(port), "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on http://127.0.0.1:{port}: the port is in use" in r.stderr
    assert LOADING not in r.stderr and WEIGHTS not in r.stderr and "serving" not in r.stderr


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (
            ["--chat-template", "/missing/template.jinja"],
            "--chat-template /missing/template.jinja: no such file",
        ),
        (["--max-num-seqs", "0"], "--max-num-seqs 0: must be at least 1"),
        (["--max-model-len", "-5"], "--max-model-len -5: must be at least 1"),
        (["--port", "70000"], "--port 70000: a port is at most 65535"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory lots: not a size"),
        (["--swap-space", "-1"], "--swap-space -1: must not be negative"),
        (["--max-request-bytes", "0"], "--max-request-bytes 0: must be at least 1"),
        (["--max-request-bytes", "big"], "--max-request-bytes big: not a size"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: a fraction in (0, 1]"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0: seconds, at least 0"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: cannot be resolved"),
        (["--tool-call-parser", "nope"], "--tool-call-parser nope: no such parser; known: glm45"),
        (["--family", "nope"], "--family nope: no such family; known: arcee, beam, "),
        (["--device", "tpu"], "--device tpu: not a device"),
        (["--dtype", "float8"], "--dtype: unknown dtype 'float8'"),
        (["/no/such/checkpoint"], "/no/such/checkpoint: no such checkpoint folder or file"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(flags: list[str], why: str) -> None:
    r = run("serve", "--port", "0", "--device", "cpu", *flags)
    assert r.returncode == 2 and why in r.stderr, r.stderr
    assert LOADING not in r.stderr and WEIGHTS not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{% for m in messages %}{{ m['content'] }}", "TemplateSyntaxError"),  # no endfor
        ("{{ raise_exception('this template takes no user turns') }}", "this template takes no user turns"),
    ],
)
def test_a_chat_template_that_cannot_render_fails_start_up(
    tmp_path, tiny: str, template: str, why: str
) -> None:
    """Rendered once on a probe conversation after the tokenizer is read, before any weight."""
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    r = run("serve", tiny, "--port", "0", "--device", "cpu", "--chat-template", str(path))
    assert r.returncode == 2, r.stderr
    assert "--chat-template cannot render a one-message probe conversation" in r.stderr and why in r.stderr
    assert LOADING in r.stderr and BUILDING not in r.stderr and WEIGHTS not in r.stderr


def test_max_model_len_past_the_model_fails_before_the_weights(tiny: str) -> None:
    r = run("serve", tiny, "--port", "0", "--device", "cpu", "--max-model-len", "100000")
    assert r.returncode == 2 and "--max-model-len 100000 exceeds the model's 512" in r.stderr, r.stderr
    assert BUILDING not in r.stderr and WEIGHTS not in r.stderr


def test_an_open_bind_without_an_api_key_warns_once(tiny: str) -> None:
    srv = Server(tiny, "--host", "0.0.0.0")
    try:
        log = srv.output()
    finally:
        srv.stop()
    warnings = [ln for ln in log.splitlines() if "without an API key" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "anyone who can reach" in warnings[0], log
    serving = [ln for ln in log.splitlines() if "serving " in ln]
    assert len(serving) == 1 and f"on http://0.0.0.0:{srv.port} " in serving[0], log


def test_which_binds_count_as_open(caplog) -> None:
    from dayzero.sdk.server.startup import is_loopback, warn_if_open

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.4", "example.org"))
    with caplog.at_level(logging.WARNING, "dayzero.server"):
        warn_if_open("0.0.0.0", ("a-key",))
        warn_if_open("127.0.0.2", ())
    assert not caplog.records


def test_architectures_disagreeing_with_model_type_is_refused(tiny: str, tmp_path) -> None:
    import shutil

    ckpt = tmp_path / "foobar"
    shutil.copytree(tiny, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"architectures": ["FooBarForCausalLM"]}))
    r = run("generate", str(ckpt), "--prompt", "x", "--max-tokens", "2", "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert "FooBarForCausalLM (no family's) and model_type 'llama' (family llama's) disagree" in r.stderr
    assert "--family llama" in r.stderr
    r = run(
        "generate", str(ckpt), "--prompt", "x", "--max-tokens", "2", "--device", "cpu", "--family", "llama"
    )
    assert r.returncode == 0, r.stderr


def test_an_architecture_of_one_family_with_the_model_type_of_another_is_refused() -> None:
    from dayzero.sdk.errors import SpecError
    from dayzero.sdk.families import family_for

    assert family_for({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).name == "llama"
    assert family_for({"model_type": "beam"}).name == "beam"  # GGUF: model_type alone
    with pytest.raises(SpecError, match=r"LlamaForCausalLM \(family llama's\) and model_type 'beam'"):
        family_for({"architectures": ["LlamaForCausalLM"], "model_type": "beam"})


def test_specs_lists_the_valid_families_when_one_spec_is_invalid(tmp_path) -> None:
    """One more family registered the way models/ discovery adds them, its spec naming a block
    that does not exist: the others are listed, it is reported with its error, exit status 1."""
    from dayzero.sdk.families import MODELS_DIR

    spec = tmp_path / "broken" / "spec.yaml"
    spec.parent.mkdir()
    text = (MODELS_DIR / "llama" / "spec.yaml").read_text()
    spec.write_text(text.replace("family: llama", "family: broken").replace("kind: gqa", "kind: nosuch", 1))
    code = (
        "import sys; from dayzero.sdk.families import FAMILIES, Family; from dayzero.sdk.cli import main; "
        f"FAMILIES.add('broken', Family('broken', __import__('pathlib').Path({str(spec)!r}))); "
        "sys.exit(main(['specs']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    rows = {ln.split()[0] for ln in r.stdout.splitlines()[1:]}
    assert rows >= {"beam", "glm53", "llama"} and "broken" not in rows
    assert "dayzero specs: broken: left out, invalid:" in r.stderr
    assert "blocks.attn.kind: unknown block kind 'nosuch'" in r.stderr
