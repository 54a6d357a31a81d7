"""Text <-> token ids, the chat template, and incremental detokenization for streaming.

Built on the `tokenizers` library either from a tokenizer.json (HF directories) or from a GGUF's
vocabulary: byte-level BPE with its merges (gpt2), or a SentencePiece-style vocabulary (Gemma's; see
tokenizer_spm.py). Every token maps to fixed bytes (byte fallback included), so decoding a suffix of
the ids gives exactly the suffix of the text once the bytes form complete UTF-8 characters.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvserve.model.gguf import GGUFTokenizerData
from kvserve.model.tokenizer_spm import CONTROL_TOKEN_TYPE, sentencepiece_tokenizer

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose regex differs from GPT-2's, with the regex
# their merges were learned on (as transformers' GGUF loader splits them): Llama 3's and Qwen2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FAMILY_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
# The families' end-of-turn tokens besides EOS (ChatML's, Llama 3's, Gemma's): generation stops at any
# of them that the vocabulary has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
# llama.cpp's pre-tokenizer names whose split differs from GPT-2's: digits are split one by one.
_DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "deepseek-coder"}


class TokenizerWrapper:
    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None,
        bos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Tokens that end a turn besides EOS (e.g. <|im_end|> for ChatML templates).
        self.stop_token_ids = sorted({t for t in (eos_token_id, *extra_stop_token_ids) if t is not None})
        # The same tokenizer with special-token parsing off: "<|im_start|>" in user text is plain text.
        self._tok_plain = same_tokenizer(tokenizer)
        self._tok_plain.encode_special_tokens = True
        added = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
        self._added_token_pattern = re.compile("|".join(map(re.escape, added))) if added else None
        self._max_token_bytes: int | None = None

    # ---- construction ----
    @classmethod
    def from_gguf(cls, data: GGUFTokenizerData) -> TokenizerWrapper:
        tok = sentencepiece_tokenizer(data) if data.model == "llama" else cls._byte_level_bpe(data)
        return cls(
            tok,
            eos_token_id=data.eos_token_id,
            bos_token_id=data.bos_token_id,
            add_bos_token=data.add_bos_token,
            chat_template=data.chat_template,
            extra_stop_token_ids=_end_of_turn_ids(tok),
        )

    @staticmethod
    def _byte_level_bpe(data: GGUFTokenizerData) -> Tokenizer:
        vocab = {token: index for index, token in enumerate(data.tokens)}
        merges = [(left, right) for left, right in (m.split(" ", 1) for m in data.merges)]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        split = FAMILY_SPLITS.get(data.pre_tokenizer or "")
        if split is not None:  # the family's own split, then bytes to the byte-level alphabet
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif data.pre_tokenizer in _DIGIT_SPLITTING_PRE_TOKENIZERS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        control = [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(data.tokens, data.token_types, strict=False)
            if kind == CONTROL_TOKEN_TYPE
        ]
        tok.add_special_tokens(control)
        return tok

    @classmethod
    def from_hf_dir(cls, directory: Path, config: dict[str, Any]) -> TokenizerWrapper:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{directory} has no tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        tok_config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            import json

            tok_config = json.loads(config_path.read_text())

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        eos = config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos]
        eos_id = eos_ids[0] if eos_ids and eos_ids[0] is not None else token_id(tok_config.get("eos_token"))
        return cls(
            tok,
            eos_token_id=eos_id,
            bos_token_id=config.get("bos_token_id"),
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            chat_template=tok_config.get("chat_template"),
            extra_stop_token_ids=[t for t in (*eos_ids[1:], *_end_of_turn_ids(tok)) if t is not None],
        )

    # ---- text ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text then stalls no other thread.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def backend_json(self) -> str:
        """The `tokenizers` definition as JSON (grammar engines rebuild the vocabulary from it)."""
        return self._tok.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (else server/tools.py's default prompt)."""
        if not self.chat_template:
            return False
        env = ImmutableSandboxedEnvironment()
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        special_tokens_in_content: bool = False,
    ) -> list[int]:
        """The rendered conversation's ids. The template writes any special tokens itself, so none are added
        on top. Control strings inside message content stay plain text unless special_tokens_in_content:
        otherwise one user message could forge a system or assistant turn.

        Each content string is rendered between random sentinels; the rendered text is then split at the
        added tokens found outside the sentinels only, and the text between two such tokens is encoded
        with special-token parsing off. For content without control strings the ids are exactly those of
        encoding the whole rendered text (the tokenizer, too, encodes the text between added tokens on its own).
        """
        if special_tokens_in_content:
            return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)
        nonce = secrets.token_hex(16)
        start, end = f"\x00{nonce}[", f"]{nonce}\x00"
        wrapped = [
            {**m, "content": f"{start}{m['content']}{end}"} if isinstance(m.get("content"), str) else m
            for m in messages
        ]
        rendered = self.apply_chat_template(wrapped, tools=tools)
        texts: list[str] = []  # text runs between the template's added tokens
        ids_between: list[list[int]] = []  # ids of the added tokens after each run
        run: list[str] = []
        pos = 0
        while pos < len(rendered):
            open_at = rendered.find(start, pos)
            template_end = len(rendered) if open_at < 0 else open_at
            for piece, token_id in self._split_added_tokens(rendered[pos:template_end]):
                run.append(piece)
                if token_id is not None:
                    texts.append("".join(run))
                    ids_between.append([token_id])
                    run = []
            if open_at < 0:
                break
            close_at = rendered.find(end, open_at)
            if close_at < 0:
                raise ValueError("the chat template cut a message's content; it cannot be tokenized safely")
            run.append(rendered[open_at + len(start) : close_at])
            pos = close_at + len(end)
        texts.append("".join(run))
        ids_between.append([])
        encoded = self._tok_plain.encode_batch(texts, add_special_tokens=False)
        return [token for enc, after in zip(encoded, ids_between, strict=True) for token in (*enc.ids, *after)]

    def _split_added_tokens(self, text: str) -> list[tuple[str, int | None]]:
        """text as (plain text, id of the added token that follows it, or None for the tail)."""
        if self._added_token_pattern is None:
            return [(text, None)]
        pieces: list[tuple[str, int | None]] = []
        pos = 0
        for match in self._added_token_pattern.finditer(text):
            pieces.append((text[pos : match.start()], self._tok.token_to_id(match.group())))
            pos = match.end()
        pieces.append((text[pos:], None))
        return pieces

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to: a text longer than n times this cannot be n tokens."""
        if self._max_token_bytes is None:
            singles = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            self._max_token_bytes = max(len(text.encode("utf-8", "surrogatepass")) for text in singles)
        return self._max_token_bytes

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


def same_tokenizer(tok: Tokenizer) -> Tokenizer:
    """A second tokenizer with `tok`'s definition (its to_str() JSON) that shares `tok`'s model, the
    vocabulary and merges (read-only while encoding), instead of a copy: parsing a copy out of the JSON
    costs hundreds of MB for a 262k vocabulary (benchmarks/RESULTS.md, lean loading). Added tokens are
    added in id order, so each gets its id again, in runs of one kind (each call rebuilds the matcher of
    all added tokens: one call per token takes seconds for Gemma's thousands)."""
    same = Tokenizer(tok.model)
    same.normalizer = tok.normalizer
    same.pre_tokenizer = tok.pre_tokenizer
    same.post_processor = tok.post_processor
    same.decoder = tok.decoder
    in_order = [added for _, added in sorted(tok.get_added_tokens_decoder().items())]
    for special, run in itertools.groupby(in_order, key=lambda added: added.special):
        (same.add_special_tokens if special else same.add_tokens)(list(run))
    if tok.truncation is not None:
        same.enable_truncation(**tok.truncation)
    if tok.padding is not None:
        same.enable_padding(**tok.padding)
    return same


def _end_of_turn_ids(tok: Tokenizer) -> list[int]:
    return [i for i in (tok.token_to_id(t) for t in END_OF_TURN_TOKENS) if i is not None]


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


_template_cache: dict[str, Any] = {}


def _compile_template(source: str) -> Any:
    if source not in _template_cache:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        _template_cache[source] = env.from_string(source)
    return _template_cache[source]


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding the whole output each step.

    Invariant: text == decode(ids[:read_offset]) as far as complete characters go; a delta is held
    back while the newest bytes end in an incomplete UTF-8 sequence (decoded as U+FFFD).
    """

    tokenizer: TokenizerWrapper
    skip_special_tokens: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def add(self, ids: Sequence[int]) -> str:
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            # Keep a few tokens of left context so merges across the boundary decode correctly.
            self.prefix_offset = max(self.read_offset - 4, 0)
            self.read_offset = len(ids)
            self.text += delta
            return delta
        return ""
