"""Structured output: a grammar (xgrammar, vLLM's and SGLang's default) holds each constrained
request to the tokens its grammar allows next.

`GrammarCompiler` (made once per tokenizer by the caller that has one: the API, the server)
turns a JSON schema, or "any JSON object", into a compiled grammar that travels in
`SamplingParams.grammar`. The engine keeps one matcher a constrained request: before a step it
fills the rows' bitmasks of allowed tokens ([S, ceil(V / 32)] int32, bit v of word v // 32),
which the sampler applies as -inf; after the step each matcher accepts the token drawn. Once
the grammar is complete only the stop tokens remain allowed, and min_tokens does not ban them
then (sampling.py `only_among`): a complete grammar ends its request, ignore_eos or not (the
engine finishes a request whose matcher terminated).
"""

from __future__ import annotations

import json

import torch

try:  # an optional dependency: without it, constrained requests are refused by name
    import xgrammar
except ImportError:  # pragma: no cover (CI installs it)
    xgrammar = None

ALL_ALLOWED = -1  # an int32 word with every bit set


class GrammarError(ValueError):
    """A response format the grammar compiler refused (a bad schema): the client's error."""


class GrammarCompiler:
    """Compiled grammars for one tokenizer and model vocabulary, cached by their source."""

    def __init__(self, tokenizer, vocab: int, stop_ids: tuple[int, ...]) -> None:
        if xgrammar is None:
            raise GrammarError("structured output needs the package xgrammar (pip install xgrammar)")
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=list(stop_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info)
        self._cache: dict[str, object] = {}

    def json(self, schema: dict | None = None, strict: bool = False):
        """A JSON value valid under `schema`; schema None: any JSON object (OpenAI's json_object).
        strict (OpenAI's json_schema.strict): no properties beyond the schema's."""
        text = json.dumps({"type": "object"} if schema is None else schema, sort_keys=True)
        key = f"{int(strict)}{text}"
        if key not in self._cache:
            try:
                self._cache[key] = self._compiler.compile_json_schema(text, strict_mode=strict)
            except Exception as e:  # xgrammar raises RuntimeError / ValueError on bad schemas
                raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
        return self._cache[key]


class Matchers:
    """One grammar matcher a constrained request, by request id."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._by_id: dict[int, object] = {}

    def add(self, rid: int, grammar) -> None:
        self._by_id[rid] = xgrammar.GrammarMatcher(grammar)

    def drop(self, rid: int) -> None:
        self._by_id.pop(rid, None)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def constrains(self, rids: list[int]) -> bool:
        return any(r in self._by_id for r in rids)

    def bitmask(self, rids: list[int]) -> torch.Tensor:
        """[S, ceil(V / 32)] int32 on the host: the allowed tokens of each row (all for rows
        without a grammar)."""
        mask = torch.full((len(rids), (self.vocab + 31) // 32), ALL_ALLOWED, dtype=torch.int32)
        for s, rid in enumerate(rids):
            if (m := self._by_id.get(rid)) is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, s)
        return mask

    def terminated(self, rid: int) -> bool:
        """The request's grammar has accepted its end (a stop token once the value is complete)."""
        m = self._by_id.get(rid)
        return m is not None and m.is_terminated()

    def accept(self, rid: int, token: int) -> None:
        m = self._by_id.get(rid)
        if m is not None and not m.is_terminated() and not m.accept_token(token):
            raise RuntimeError(f"request {rid}: token {token} was sampled outside its grammar")
