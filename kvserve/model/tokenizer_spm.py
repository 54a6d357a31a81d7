"""A SentencePiece-style vocabulary from GGUF metadata (tokenizer.ggml.model "llama") as a `tokenizers`
BPE, built the way transformers builds Gemma's from the same file (its gguf_tokenizer_mapping.py), so
both split text alike: spaces become "▁", unknown bytes fall back to <0xNN> tokens, and since the file
lists no merges they are recovered from the vocabulary, ranked by the tokens' order in the file (Gemma's
scores do not follow its merge order)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from kvserve.model.gguf import GGUFTokenizerData

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
SPACE = "\u2581"
# The SentencePiece vocabularies built this way: those whose recovered merges are known to match.
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)


def merges_from_vocab(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, earliest merged token first (then
    longer left parts, then longer right parts): transformers' generate_merges with position scores."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[int, tuple[str, str]]] = []
    for index, token in enumerate(tokens):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((index, pair) for pair in splits)
    merges.sort(key=lambda item: (-item[0], len(item[1][0]), len(item[1][1])), reverse=True)
    return [pair for _, pair in merges]


def sentencepiece_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    if data.architecture not in SENTENCEPIECE_ARCHITECTURES:
        raise ValueError(
            f"unsupported SentencePiece GGUF vocabulary of a {data.architecture!r} model; "
            f"supported: {list(SENTENCEPIECE_ARCHITECTURES)} (and byte-level BPE vocabularies of any family)"
        )
    # Tokens of two or more spaces are stored as spaces; the normalized text spells them with "▁".
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in data.tokens]
    unk = tokens[data.unknown_token_id] if data.unknown_token_id is not None else "<unk>"
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges_from_vocab(tokens), fuse_unk=True, unk_token=unk, byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # As transformers does: the file's own spelling, user-defined tokens only where the vocabulary has them.
    marked = list(zip(data.tokens, data.token_types, strict=False))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in marked if k == CONTROL_TOKEN_TYPE]
    )
    user_defined = [t for t, k in marked if k == USER_DEFINED_TOKEN_TYPE and t in vocab]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    return tok
