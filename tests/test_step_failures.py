"""A failed engine step (a fault injected by a test backend, tests/faulty_kernels.py, registered
like any kernel and chosen through DAYZERO_KERNEL_ADD_RMS_NORM) aborts only the requests of the
plans in flight, with the error; every block comes back, the prefix cache keeps no block whose KV
the failed step was to write (the same prompt afterwards decodes as on a fresh engine), waiting
requests go on; through the real server: a 500 naming the fault, the next request served, and
/health 503 after repeated failures, 200 again after a good step."""

from __future__ import annotations

import faulty_kernels  # noqa: F401  (registers the "faulty" backend)
import httpx
import numpy as np
import pytest
from server_fixture import Server

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.parity.tiny import write_tiny

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("llama") / "ckpt", seed=6)


def _engine(path, monkeypatch, fault, overlap: str = "off", batch: int = 4):
    monkeypatch.setenv("DAYZERO_KERNEL_ADD_RMS_NORM", "faulty")
    monkeypatch.setenv("DAYZERO_FAULT_FILE", str(fault))
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=batch, overlap=overlap)
    return LLM(path, device="cpu", progress=False, engine=cfg).engine


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_failed_step_aborts_its_requests_and_poisons_nothing(
    checkpoint, monkeypatch, tmp_path, overlap
) -> None:
    fault = tmp_path / "fault"
    eng = _engine(checkpoint, monkeypatch, fault, overlap, batch=1)
    assert eng.ops.chosen()["add_rms_norm"] == "faulty"
    free = eng.scheduler.free_blocks(0)
    prompt = np.random.default_rng(0).integers(1, 200, 23).tolist()  # 5 full blocks of 4, and more
    want = _engine(checkpoint, monkeypatch, fault, overlap).generate([prompt], GREEDY)[0]  # no fault yet

    a = eng.add(prompt, GREEDY)
    b = eng.add([5, 6, 7], GREEDY)  # waits: one row a step
    fault.touch()
    outs = eng.step()  # admits a and prefills it: fails
    fault.unlink()
    failed = {o.id: o for o in outs}
    assert failed[a].finish_reason == "abort" and "injected fault" in failed[a].error
    assert b not in failed and eng.failures == 1 and eng.stats["failed_steps"] == 1
    assert eng.scheduler.plans_in_flight == 0
    eng.scheduler.check_invariants()

    while not eng.requests[b].finished:  # the waiting request is served as usual
        eng.step()
    assert eng.failures == 0 and len(eng.requests[b].token_ids) == GREEDY.max_tokens
    again = eng.generate([prompt], GREEDY)[0]  # no poisoned prefix hit: as on a fresh engine
    assert again.token_ids == want.token_ids
    assert max(abs(x - y) for x, y in zip(again.logprobs, want.logprobs, strict=True)) < 1e-5
    for rid in (a, b):
        eng.release(rid)
    while eng.has_work():
        eng.step()
    eng.scheduler.flush_prefix_cache()
    assert eng.scheduler.free_blocks(0) == free  # every block back


def test_a_failure_while_decoding_aborts_the_rows_in_flight(checkpoint, monkeypatch, tmp_path) -> None:
    """With overlap, two plans are in flight when a decode step fails: both plans' requests are
    aborted with what they had; a request submitted afterwards runs normally."""
    fault = tmp_path / "fault"
    eng = _engine(checkpoint, monkeypatch, fault, "on")
    ids = [
        eng.add([3 + i, 9, 11, 4], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        for i in range(3)
    ]
    for _ in range(5):
        eng.step()
    had = {i: len(eng.requests[i].token_ids) for i in ids}
    fault.touch()
    outs = {o.id: o for o in eng.step()}
    fault.unlink()
    assert set(outs) == set(ids) and all(o.finish_reason == "abort" and o.error for o in outs.values())
    assert all(len(eng.requests[i].token_ids) == had[i] for i in ids)
    c = eng.add([8, 8, 8], GREEDY)
    while not eng.requests[c].finished:
        eng.step()
    assert len(eng.requests[c].token_ids) == GREEDY.max_tokens and eng.requests[c].error is None
    eng.scheduler.check_invariants()


def test_the_server_survives_failed_steps(tmp_path) -> None:
    fault = tmp_path / "fault"
    env = {
        "DAYZERO_KERNEL_MODULES": "faulty_kernels",
        "DAYZERO_KERNEL_ADD_RMS_NORM": "faulty",
        "DAYZERO_FAULT_FILE": str(fault),
        "PYTHONPATH": str(__import__("pathlib").Path(__file__).parent),
    }
    srv = Server(env=env)
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    try:
        ok = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        fault.touch()
        for i in range(3):
            r = httpx.post(f"{srv.url}/v1/completions", json=body | {"prompt": f"{i} apples"}, timeout=60)
            assert r.status_code == 500, r.text
            assert "injected fault" in r.json()["error"]["message"]
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failing", health.text
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body | {"stream": True}, timeout=60) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "injected fault" in lines[-2], lines
        assert '"finish_reason": "abort"' in lines[-3]
        fault.unlink()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ok  # same text: cache clean
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        used = sum(
            float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("dayzero_kv_blocks_used{")
        )
        assert used == srv.metric("dayzero_prefix_cache_blocks")  # no request holds a block
        assert srv.metric("dayzero_requests_running") == 0
        assert srv.metric("dayzero_requests_total", '{outcome="error_500"}') == 4
    finally:
        srv.stop()
