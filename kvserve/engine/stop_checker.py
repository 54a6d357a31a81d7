"""Decides after each appended token whether a sequence is done, and how much text may be shown."""

from __future__ import annotations

from kvserve.engine.sequence import Sequence


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def append_token(seq: Sequence, token_id: int, eos_token_ids: list[int], max_model_len: int) -> bool:
    """Append one accepted token, update text and stop state; returns True when the sequence finished."""
    params = seq.params
    seq.token_ids.append(token_id)
    old_len = len(seq.detokenizer.text)
    seq.detokenizer.add(seq.token_ids)
    text = seq.detokenizer.text

    if params.stop:
        # Only a window around the new text can contain a newly completed stop string.
        window_start = max(0, old_len - max(len(s) for s in params.stop) + 1)
        hits = [(text.find(s, window_start), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            end = pos + len(stop) if params.include_stop_str_in_output else pos
            seq.detokenizer.text = text[:end]
            seq.visible_text_len = end
            return _finish(seq, "stop", stop)
    seq.visible_text_len = len(text) - (_held_back(text, params.stop) if params.stop else 0)

    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return _finish(seq, "stop", token_id)
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return _finish(seq, "length", None)
    return False


def _finish(seq: Sequence, reason: str, stop_reason: str | int | None) -> bool:
    seq.finish_reason = reason
    seq.stop_reason = stop_reason
    if reason != "stop" or isinstance(stop_reason, int):
        seq.visible_text_len = len(seq.detokenizer.text)
    return True
