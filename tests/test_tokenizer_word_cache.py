"""The tokenizer's word cache is full once `load_tokenizer` returns (sdk/loader/tokenizer.py), so
words the server meets later take no C heap, however busy it is; the same tokenizer read without
the fill grows by a few hundred bytes a new word (HF tokenizers' BPE cache of 10,000 words). The
fill changes no encoding. The tokenizer: the embedded default's (SmolLM2, a 49,152-entry BPE)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from dayzero.sdk.api import embedded_default
from dayzero.sdk.loader.tokenizer import fill_word_cache, gguf_tokenizer_cache, load_tokenizer
from dayzero.sdk.server.workers import heap_bytes

pytestmark = pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")
WORDS = 3000  # new words a measurement: ~1 MiB of cache entries when they are cached


@pytest.fixture(scope="module")
def filled():
    return load_tokenizer(embedded_default(), "gguf")


def _unfilled():
    """The same tokenizer (the converted file load_tokenizer cached) with its cache empty."""
    return AutoTokenizer.from_pretrained(str(gguf_tokenizer_cache(embedded_default())))


def _heap_per_word(tok, seed: int) -> float:
    """C heap bytes in use gained per prompt, each bringing one word not seen before."""
    rng = random.Random(seed)
    numbers = rng.sample(range(10**6, 10**9), WORDS)
    tok("Tell me about 0", add_special_tokens=False)  # the prompt's other words and buffers
    before = heap_bytes()[0]
    for n in numbers:
        tok(f"Tell me about {n}", add_special_tokens=False)
    return (heap_bytes()[0] - before) / WORDS


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_filled_cache_takes_no_heap_for_new_words(filled, seed):
    grown = _heap_per_word(filled, seed)
    control = _heap_per_word(_unfilled(), seed)
    assert control > 200, f"the control cached nothing ({control:.0f} B a word): the test sees nothing"
    assert grown < 16, f"{grown:.0f} bytes of C heap a new word after the fill (control {control:.0f})"


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
