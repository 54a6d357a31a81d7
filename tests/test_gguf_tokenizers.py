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


# Gemma 3's SentencePiece vocabulary (262k tokens, merges recovered from the vocabulary): spaces in runs,
# newlines, digits, code, accents, CJK, an emoji and a control character (byte fallback), special tokens.
GEMMA_TEXTS = [
    "The capital of France is Paris.",
    "  two   spaces\tand a tab\n\n\nnewlines",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Crème brûlée, naïve café; 東京は日本の首都です。",
    "emoji 🦙🚀 and a control \x07 byte, 1234567890 ½",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
]


def test_gemma3_sentencepiece_vocabulary_encodes_like_transformers():
    from transformers import AutoTokenizer

    from kvserve.model.registry import GEMMA3_270M, bundled_gguf_path

    path = bundled_gguf_path(GEMMA3_270M)
    ours = TokenizerWrapper.from_gguf(read_tokenizer_data(open_gguf(path)))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in GEMMA_TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == theirs.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False).removeprefix("<bos>") == text
