"""Byte-level BPE vocabularies from GGUF metadata split text as each family's pre-tokenizer does:
kvserve's tokenizer against transformers' own GGUF tokenizer on a small vocabulary written with GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.model.gguf import open_gguf, read_tokenizer_data
from kvserve.model.tokenizer import TokenizerWrapper

TEXTS = ["x 1234567 ab\n\n  ab's 12 3", "ab1ab 999999\tab  \n ab", "1,234.5678 and'LL"]


def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_vocabulary(path: Path, pre: str) -> None:
    from gguf import GGUFWriter

    merges = ["1 2", "12 3", "a b", "Ġ ab", "Ġ 1", "Ġ1 2", "9 9", "99 9"]
    tokens = _byte_alphabet() + [m.replace(" ", "") for m in merges]
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_gguf_byte_level_vocabulary_splits_like_transformers(tmp_path, pre):
    from transformers import AutoTokenizer

    path = tmp_path / "vocab.gguf"
    write_vocabulary(path, pre)
    ours = TokenizerWrapper.from_gguf(read_tokenizer_data(open_gguf(path)))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text
