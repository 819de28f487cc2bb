"""Tokenizers: from tokenizer.json / tokenizer_config.json, or from GGUF metadata (via transformers)."""

from __future__ import annotations

import logging
from pathlib import Path

from dayzero.sdk.errors import CheckpointError


def load_tokenizer(path: Path, fmt: str):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if fmt == "gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise CheckpointError(f"{path}: no tokenizer.json or tokenizer_config.json")
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({e})") from None
