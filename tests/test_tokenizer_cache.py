"""A GGUF file's tokenizer is converted once and then read from the cache (sdk/loader/tokenizer.py):
the same encodings, decodings, special tokens and chat template as the conversion and as the
tokenizer the file was written from; a changed file converts again; a damaged entry is replaced;
a cache that cannot be written is skipped. The file: the parity suite's tiny byte-level BPE
written as llama.cpp writes a GPT-2-style vocabulary (tokens, merges, token types)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from transformers import AutoTokenizer

from dayzero.sdk.loader.tokenizer import gguf_tokenizer_cache, load_tokenizer
from dayzero.sdk.parity.tiny import CHAT_TEMPLATE, write_tokenizer

TEXTS = ["The quick brown fox <s> jumps </s> over 12 dogs", "  ünïcödé 日本語\n\ttabs", "a" * 40, ""]


def _gguf(folder: Path) -> Path:
    ids = write_tokenizer(folder / "source", 512)
    tj = json.loads((folder / "source" / "tokenizer.json").read_text())
    vocab = [t for t, _ in sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"]}
    w = gguf.GGUFWriter(str(folder / "m.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_token_types([3 if t in special else 1 for t in vocab])  # 3: control
    w.add_bos_token_id(ids["bos_token_id"])
    w.add_eos_token_id(ids["eos_token_id"])
    w.add_unk_token_id(vocab.index("<unk>"))
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", np.ones((len(vocab), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return folder / "m.gguf"


@pytest.fixture
def conversions(monkeypatch) -> list[bool]:
    """One entry a tokenizer load: True when transformers converted a GGUF file."""
    seen: list[bool] = []
    real = AutoTokenizer.from_pretrained.__func__

    def recording(cls, *args, **kw):
        seen.append("gguf_file" in kw)
        return real(cls, *args, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(recording))
    return seen


def _same(a, b, whole: bool = True) -> None:
    """whole: the same added tokens too (transformers' conversion adds GPT-2's <|endoftext|>,
    which the source tokenizer does not have)."""
    for text in TEXTS:
        ids = a(text).input_ids
        assert ids == b(text).input_ids, text
        assert a.decode(ids) == b.decode(ids), text
    assert a.special_tokens_map == b.special_tokens_map and a.chat_template == b.chat_template
    assert not whole or a.get_added_vocab() == b.get_added_vocab()


def test_converted_once_then_read_from_the_cache(tmp_path, monkeypatch, conversions) -> None:
    monkeypatch.setenv("DAYZERO_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(tmp_path)
    first = load_tokenizer(path, "gguf")
    second = load_tokenizer(path, "gguf")
    assert conversions == [True, False]
    entry = gguf_tokenizer_cache(path)
    assert entry.parent == tmp_path / "cache" / "tokenizers" and (entry / "tokenizer.json").exists()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".partial-")]
    _same(first, second)
    _same(second, AutoTokenizer.from_pretrained(str(tmp_path / "source")), whole=False)

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: another key
    assert gguf_tokenizer_cache(path) != entry
    _same(load_tokenizer(path, "gguf"), first)
    assert conversions[-1] is True


def test_a_damaged_entry_is_converted_again_and_replaced(tmp_path, monkeypatch, conversions) -> None:
    monkeypatch.setenv("DAYZERO_CACHE_DIR", str(tmp_path / "cache"))
    path = _gguf(tmp_path)
    good = load_tokenizer(path, "gguf")
    (gguf_tokenizer_cache(path) / "tokenizer.json").write_text("{not json")
    _same(load_tokenizer(path, "gguf"), good)
    assert conversions == [True, False, True]  # converted, the damaged entry, converted again
    _same(load_tokenizer(path, "gguf"), good)
    assert conversions[-1] is False  # the replaced entry reads


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch, conversions) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DAYZERO_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # no folder can go there
    path = _gguf(tmp_path)
    _same(load_tokenizer(path, "gguf"), AutoTokenizer.from_pretrained(str(tmp_path / "source")), whole=False)
    load_tokenizer(path, "gguf")
    assert conversions == [True, False, True]  # converted, the source, converted again: nothing cached
