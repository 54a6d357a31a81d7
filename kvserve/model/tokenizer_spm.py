"""A SentencePiece-style vocabulary from GGUF metadata (tokenizer.ggml.model "llama") as a `tokenizers`
BPE, built the way transformers builds Gemma's from the same file (its gguf_tokenizer_mapping.py), so
both split text alike: spaces become "▁", unknown bytes fall back to <0xNN> tokens, and since the file
lists no merges they are recovered from the vocabulary, ranked by the tokens' order in the file (Gemma's
scores do not follow its merge order)."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from kvserve.model.gguf import GGUFTokenizerData

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
SPACE = "\u2581"
# The SentencePiece vocabularies built this way: those whose recovered merges are known to match.
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)
# Stand-ins in the skeleton's JSON for the vocabulary and the merges, written in their place.
_VOCAB_MARK, _MERGES_MARK = "<<vocab>>", "<<merges>>"
_MERGES_PER_WRITE = 4096


def merges_from_vocab(tokens: list[str]) -> Iterator[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, earliest merged token first, longer
    left parts first: transformers' generate_merges with position scores, in its order."""
    vocab = set(tokens)
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            if token[:cut] in vocab and token[cut:] in vocab:
                yield token[:cut], token[cut:]


def _with_vocabulary(skeleton: Tokenizer, tokens: list[str]) -> Tokenizer:
    """`skeleton` (a BPE of one token) with the vocabulary `tokens` and their merges, parsed from JSON
    written a few thousand merges at a time: handing them over as Python pairs held half a million
    tuples and a million strings at once (benchmarks/RESULTS.md, "Loading Gemma 3 within the RSS budget")."""
    spec = json.loads(skeleton.to_str())
    spec["model"]["vocab"], spec["model"]["merges"] = _VOCAB_MARK, _MERGES_MARK
    head, rest = json.dumps(spec).split(json.dumps(_VOCAB_MARK))
    middle, tail = rest.split(json.dumps(_MERGES_MARK))
    text = io.StringIO()
    text.write(head)
    json.dump({token: index for index, token in enumerate(tokens)}, text)
    text.write(middle + "[")
    # Written "left right", which `tokenizers` reads with half the peak memory of [left, right] pairs (it
    # buffers each pair as a generic value first). No merge with a space is written: the normalizer spells
    # every space "▁", so none could ever apply.
    merges = (f"{left} {right}" for left, right in merges_from_vocab(tokens) if " " not in left + right)
    first = True
    while chunk := list(itertools.islice(merges, _MERGES_PER_WRITE)):  # a few thousand per write
        text.write(("" if first else ",") + json.dumps(chunk)[1:-1])
        first = False
    text.write("]" + tail)
    return Tokenizer.from_str(text.getvalue())


def sentencepiece_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    if data.architecture not in SENTENCEPIECE_ARCHITECTURES:
        raise ValueError(
            f"unsupported SentencePiece GGUF vocabulary of a {data.architecture!r} model; "
            f"supported: {list(SENTENCEPIECE_ARCHITECTURES)} (and byte-level BPE vocabularies of any family)"
        )
    # Tokens of two or more spaces are stored as spaces; the normalized text spells them with "▁".
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in data.tokens]
    unk = tokens[data.unknown_token_id] if data.unknown_token_id is not None else "<unk>"
    tok = Tokenizer(models.BPE(vocab={unk: 0}, merges=[], fuse_unk=True, unk_token=unk, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = _with_vocabulary(tok, tokens)
    # As transformers does: the file's own spelling, user-defined tokens only where the vocabulary has them.
    marked = list(zip(data.tokens, data.token_types, strict=False))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in marked if k == CONTROL_TOKEN_TYPE]
    )
    vocab = set(tokens)
    user_defined = [t for t, k in marked if k == USER_DEFINED_TOKEN_TYPE and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    return tok
