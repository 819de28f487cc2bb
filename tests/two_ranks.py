"""Drafting on two tensor-parallel ranks (gloo) against one rank: the check the MTP tests share."""

from __future__ import annotations

from dayzero.sdk.api import LLM


def assert_drafting_on_two_ranks_answers_as_one(path, spec: dict, prompts: list[dict], params: list) -> None:
    """The answers of `prompts` under each of `params`, and the acceptance counts, of an LLM on 2
    ranks equal those of one rank, both drafting with `spec`; the ranks verified drafts."""
    one = LLM(str(path), device="cpu", dtype="float32", speculative_config=spec, progress=False)
    want = [c.outputs[0].token_ids for p in params for c in one.generate(prompts, p)]
    many = LLM(str(path), device="cpu", dtype="float32", speculative_config=spec, progress=False,
               tensor_parallel_size=2)  # fmt: skip
    try:
        got = [c.outputs[0].token_ids for p in params for c in many.generate(prompts, p)]
        stats = dict(many.engine.stats)
    finally:
        many.close()
    assert got == want
    assert stats["verify_rows"] > 0 and stats["accepted_at"] == one.engine.stats["accepted_at"]
