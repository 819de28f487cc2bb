"""A GGUF file's HF config from its metadata (sdk/loader/gguf_io.py `hf_config`), as
docs/serving.md and the spec reference (WeightFormat) state it: a file without
`{arch}.vocab_size` gets its vocabulary from `len:tokenizer.ggml.tokens`, the token list's
length, which is the embedding's row count; `{arch}.vocab_size` then leaves the field unset."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from dayzero.sdk.loader.gguf_io import hf_config


def _gguf(out: Path, vocab: int, hidden: int) -> Path:
    """A llama GGUF as llama.cpp may write it: a token list, no `llama.vocab_size`."""
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_embedding_length(hidden)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("vocab", [37, 512])
def test_vocab_size_from_the_token_list_of_a_file_without_it(tmp_path, vocab: int) -> None:
    path = _gguf(tmp_path / "m.gguf", vocab, 16)
    mapping = {"vocab_size": "len:tokenizer.ggml.tokens", "hidden_size": "{arch}.embedding_length"}
    cfg, _ = hf_config(path, mapping)
    rows = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    assert cfg["vocab_size"] == vocab == max(int(n) for n in rows.shape)
    assert cfg["hidden_size"] == 16
    cfg, _ = hf_config(path, {"vocab_size": "{arch}.vocab_size"})
    assert "vocab_size" not in cfg  # the key is absent: the field stays unset
