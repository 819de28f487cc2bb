"""Tokenizers: from tokenizer.json / tokenizer_config.json, or from GGUF metadata (via transformers).

A GGUF file's tokenizer is converted by transformers from the file's vocabulary and merges (~15 s
for a 49k vocabulary, on every start); the converted tokenizer is kept as tokenizer.json (+ its
config and chat template) in a cache folder keyed by the file (path, size, modification time,
inode) and transformers' version, and read from there (~0.4 s) while that key holds. Cache:
$DAYZERO_CACHE_DIR, else $XDG_CACHE_HOME/dayzero, else ~/.cache/dayzero; a cache that cannot be
written is skipped (logged), never an error.

A BPE or Unigram model keeps a cache of the words it has split (HF tokenizers: 10,000 words, a
few hundred bytes of C heap each), filled by the first distinct words it meets and never evicted,
one cache a thread (measured: words new to a worker thread grow the heap after the loading
thread's cache is full). Filled by requests, it grows the server's heap for each tokenizer
thread's first ~10,000 distinct words. `fill_word_cache` fills the calling thread's at once with
the vocabulary's first entries (most of the common words and word pieces): `load_tokenizer` on
the loading thread, the server's work pool on each of its threads at start-up, so that the
memory is taken before the first request and stays flat after.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers.models import BPE, Unigram

from dayzero.sdk.errors import CheckpointError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    if root := os.environ.get("DAYZERO_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dayzero"


def gguf_tokenizer_cache(path: Path) -> Path:
    """The cache folder of `path`'s converted tokenizer (it may not exist yet)."""
    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _from_gguf(path: Path):
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache(path)
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError) as e:  # a damaged entry: convert again, replace it
            log.warning("tokenizer cache %s unreadable (%s); converting %s again", cached, e, path.name)
            shutil.rmtree(cached, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:  # written whole in a temporary folder, then renamed: readers never see a partial entry
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".partial-")
        try:
            tok.save_pretrained(tmp)
            os.rename(tmp, cached)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cached / "tokenizer.json").exists():  # else another process's entry came first
                raise
    except OSError as e:
        log.info("tokenizer of %s not cached in %s: %s", path.name, cached.parent, e)
    return tok


# more than HF tokenizers' word cache holds (10,000), so that the fill leaves it full
WORD_CACHE_FILL = 16_384


def fill_word_cache(tok, words: int = WORD_CACHE_FILL) -> int:
    """Split the vocabulary's first `words` entries (lowest ids: the earliest merges, the most
    common pieces) through the tokenizer's model, which caches each; returns how many were
    split (0 for a model without a word cache, or a tokenizer without a fast backend)."""
    backend = getattr(tok, "backend_tokenizer", None)  # a transformers tokenizer at the boundary
    if backend is None or not isinstance(backend.model, BPE | Unigram):
        return 0
    model = backend.model
    vocab = sorted(backend.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
    for piece, _ in vocab[:words]:
        model.tokenize(piece)
    return min(words, len(vocab))


def load_tokenizer(path: Path, fmt: str):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if fmt == "gguf":
            tok = _from_gguf(path)
        else:
            from transformers import AutoTokenizer

            if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
                raise CheckpointError(f"{path}: no tokenizer.json or tokenizer_config.json")
            tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({e})") from None
    fill_word_cache(tok)
    return tok


def chat_ids(tok, text: str) -> list[int]:
    """The ids of one user message under the tokenizer's chat template, ready for the answer
    (a tokenizer without a template: the bare text)."""
    if tok.chat_template is None:
        return tok.encode(text)
    return list(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    )
