"""Tokenizers: from tokenizer.json / tokenizer_config.json, or from GGUF metadata (via transformers).

A GGUF file's tokenizer is converted by transformers from the file's vocabulary and merges (~15 s
for a 49k vocabulary, on every start); the converted tokenizer is kept as tokenizer.json (+ its
config and chat template) in a cache folder keyed by the file (path, size, modification time,
inode) and transformers' version, and read from there (~0.4 s) while that key holds. Cache:
$DAYZERO_CACHE_DIR, else $XDG_CACHE_HOME/dayzero, else ~/.cache/dayzero; a cache that cannot be
written is skipped (logged), never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

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


def load_tokenizer(path: Path, fmt: str):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if fmt == "gguf":
            return _from_gguf(path)
        from transformers import AutoTokenizer

        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise CheckpointError(f"{path}: no tokenizer.json or tokenizer_config.json")
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({e})") from None


def chat_ids(tok, text: str) -> list[int]:
    """The ids of one user message under the tokenizer's chat template, ready for the answer
    (a tokenizer without a template: the bare text)."""
    if tok.chat_template is None:
        return tok.encode(text)
    return list(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    )
