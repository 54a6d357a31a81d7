"""Decides after each appended token whether a sequence is done, and how much text may be shown.

Stop strings are matched incrementally (stop_matcher.py): each token costs the same whatever the length
of the output so far, and the text held back from the client is the matcher's state.
"""

from __future__ import annotations

from kvserve.engine.sequence import Sequence


def append_token(seq: Sequence, token_id: int, eos_token_ids: list[int], max_model_len: int) -> bool:
    """Append one accepted token, update text and stop state; returns True when the sequence finished."""
    params = seq.params
    seq.token_ids.append(token_id)
    old_len = len(seq.detokenizer.text)
    seq.detokenizer.add(seq.token_ids)
    text = seq.detokenizer.text

    if params.stop:
        matcher = seq.stop_matcher or seq.request.new_stop_matcher()
        seq.stop_matcher = matcher
        hit = matcher.feed(text, old_len)
        if hit is not None:
            pos, index = hit
            stop = params.stop[index]
            end = pos + len(stop) if params.include_stop_str_in_output else pos
            seq.detokenizer.text = text[:end]
            seq.visible_text_len = end
            return _finish(seq, "stop", stop)
        seq.visible_text_len = len(text) - matcher.held_back
    else:
        seq.visible_text_len = len(text)

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
