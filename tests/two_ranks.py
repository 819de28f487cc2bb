"""Drafting on two tensor-parallel ranks (gloo) against one rank: the check the MTP tests share."""

from __future__ import annotations

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig


def assert_drafting_on_two_ranks_answers_as_one(
    path, spec: dict, prompts: list[dict], params: list, graphs: str = "auto"
) -> None:
    """The answers of `prompts` under each of `params`, and the acceptance counts, of an LLM on 2
    ranks equal those of one rank, both drafting with `spec`; the ranks verified drafts. graphs:
    the engines' decode_graphs ("buffers": the head's passes in its graphs' buffers, checked)."""
    engine = EngineConfig(decode_graphs=graphs)
    one = LLM(
        str(path), device="cpu", dtype="float32", speculative_config=spec, progress=False, engine=engine
    )
    want = [c.outputs[0].token_ids for p in params for c in one.generate(prompts, p)]
    many = LLM(str(path), device="cpu", dtype="float32", speculative_config=spec, progress=False,
               tensor_parallel_size=2, engine=engine)  # fmt: skip
    try:
        got = [c.outputs[0].token_ids for p in params for c in many.generate(prompts, p)]
        stats = dict(many.engine.stats)
    finally:
        many.close()
    assert got == want
    assert stats["verify_rows"] > 0 and stats["accepted_at"] == one.engine.stats["accepted_at"]
    if graphs == "buffers":
        assert stats["head_graph_passes"] > 0
