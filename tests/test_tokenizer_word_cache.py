"""The tokenizer's word cache is full once `load_tokenizer` returns (sdk/loader/tokenizer.py), so
words the loading thread meets later take no C heap; the same tokenizer read without the fill
grows by a few hundred bytes a new word (HF tokenizers' BPE cache of 10,000 words). The cache is
kept a thread: the server's work pool fills each worker's at start-up, and words new to its
workers then take no heap either, where a pool that does not grows. The fill changes no
encoding. The tokenizer: the embedded default's (SmolLM2, a 49,152-entry BPE)."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from transformers import AutoTokenizer

from dayzero.sdk.api import embedded_default
from dayzero.sdk.loader.tokenizer import fill_word_cache, gguf_tokenizer_cache, load_tokenizer
from dayzero.sdk.server.workers import WorkPool, heap_bytes

pytestmark = pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")
WORDS = 3000  # new words a measurement: ~1 MiB of cache entries when they are cached


@pytest.fixture(scope="module")
def filled():
    return load_tokenizer(embedded_default(), "gguf")


def _unfilled():
    """The same tokenizer (the converted file load_tokenizer cached) with its cache empty."""
    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_cache(embedded_default())))


def _heap_per_word(tok, seed: int, pool: WorkPool | None = None) -> float:
    """C heap bytes in use gained per prompt, each bringing one word not seen before, tokenized
    on this thread or on the pool's workers."""
    numbers = random.Random(seed).sample(range(10**6, 10**9), WORDS)
    texts = ["Tell me about 0"] * 8 + [f"Tell me about {n}" for n in numbers]  # the other words first

    async def on_pool(texts: list[str]) -> None:
        for t in texts:
            await pool.run(tok, t, add_special_tokens=False)

    def encode(texts: list[str]) -> None:
        if pool is None:
            for t in texts:
                tok(t, add_special_tokens=False)
        else:
            asyncio.run(on_pool(texts))

    encode(texts[:8])
    before = heap_bytes()[0]
    encode(texts[8:])
    return (heap_bytes()[0] - before) / WORDS


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_filled_cache_takes_no_heap_for_new_words(filled, seed):
    grown = _heap_per_word(filled, seed)
    control = _heap_per_word(_unfilled(), seed)
    assert control > 200, f"the control cached nothing ({control:.0f} B a word): the test sees nothing"
    assert grown < 16, f"{grown:.0f} bytes of C heap a new word after the fill (control {control:.0f})"


@pytest.mark.parametrize("seed", [4, 13])
def test_a_work_pool_fills_each_workers_cache(filled, seed):
    """Two workers: with the fill as their start, new words take no heap on them; without it, a
    few hundred bytes a word (the loading thread's full cache does not serve them)."""
    started = WorkPool(2, 8, functools.partial(fill_word_cache, filled))
    plain = WorkPool(2, 8)
    try:
        grown = _heap_per_word(filled, seed, started)
        control = _heap_per_word(filled, seed + 1, plain)
    finally:
        started.shutdown()
        plain.shutdown()
    assert control > 200, f"the control cached nothing ({control:.0f} B a word): the test sees nothing"
    # measured 10.6-11.2 bytes a word on filled workers (the pool's futures), ~500 without the fill
    assert grown < 32, f"{grown:.0f} bytes of C heap a new word on filled workers (control {control:.0f})"


@pytest.mark.parametrize("seed", [5, 17])
def test_fill_changes_no_encoding(filled, seed):
    rng = random.Random(seed)
    vocab = list(filled.get_vocab())
    texts = [filled.convert_tokens_to_string(rng.sample(vocab, 40)) for _ in range(20)]
    texts += ["The quick brown fox jumps over 12 lazy dogs.", "  ünïcödé 日本語\n\ttabs", "a" * 300]
    plain = _unfilled()
    for text in texts:
        assert filled.encode(text) == plain.encode(text), text


def test_fill_reports_the_words_split(filled):
    assert fill_word_cache(filled) == 16_384
    assert fill_word_cache(filled, words=100) == 100
