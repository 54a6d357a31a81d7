"""Per-request changes to a batch of logits before sampling: logit_bias, min_tokens, penalties, grammar.

Order (vLLM's): logit_bias, min_tokens, repetition / frequency / presence penalties, then the grammar
mask (last, so no bias or penalty can bring back a token the grammar forbids); temperature,
min_p, top-k and top-p follow in sampler.policy_probs. Each row depends only on its own request's
parameters and tokens, never on the rest of the batch (the seeded-output property).
Logprobs stay those of the raw model distribution (vLLM's default), so they are computed elsewhere.

Penalties follow the OpenAI / vLLM definitions: with c[t] the count of token t in the output so far,
logit[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0); and for every token t in the
prompt or the output, logit[t] /= repetition_penalty when positive, *= it when negative.
"""

from __future__ import annotations

import torch

from kvserve.engine.sequence import Sequence
from kvserve.structured.masks import apply_grammar_masks, compute_masks


def process_logits(
    logits: torch.Tensor,
    seqs: list[Sequence],
    stop_ids: list[list[int]],
    grammar_masks: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The logits each row samples from, float32; `logits` itself is returned untouched when no row
    needs a change. stop_ids[i] are the tokens min_tokens bans for row i (EOS unless ignored, stop ids).
    grammar_masks: packed masks by seq_id, computed ahead (masks.start_masks); the others are computed
    here."""
    if not any(s.params.processes_logits for s in seqs):
        return logits
    out = logits.float().clone()
    _apply_logit_bias(out, seqs)
    _apply_min_tokens(out, seqs, stop_ids)
    _apply_penalties(out, seqs)
    constrained = [(row, seq) for row, seq in enumerate(seqs) if seq.matcher is not None]
    masks = dict(grammar_masks or {})
    missing = [seq for _, seq in constrained if seq.seq_id not in masks]
    if missing:
        computed = compute_masks([seq.matcher for seq in missing if seq.matcher is not None], out.shape[1])
        masks.update(zip([seq.seq_id for seq in missing], computed, strict=True))
    apply_grammar_masks(out, [(row, masks[seq.seq_id]) for row, seq in constrained])
    return out


def _apply_logit_bias(out: torch.Tensor, seqs: list[Sequence]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, seq in enumerate(seqs):
        for token, bias in seq.params.logit_bias.items():
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=out.device), torch.tensor(tokens, device=out.device))
        out.index_put_(index, torch.tensor(biases, dtype=out.dtype, device=out.device), accumulate=True)


def _apply_min_tokens(out: torch.Tensor, seqs: list[Sequence], stop_ids: list[list[int]]) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = {*stop_ids[row], *seq.params.stop_token_ids}
            rows.extend([row] * len(banned))
            tokens.extend(banned)
    if rows:
        out[torch.tensor(rows, device=out.device), torch.tensor(tokens, device=out.device)] = float("-inf")


def _apply_penalties(out: torch.Tensor, seqs: list[Sequence]) -> None:
    params = [s.params for s in seqs]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params):
        return
    device = out.device
    counts = _token_counts([s.output_token_ids for s in seqs], out.shape[1], device)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((repetition != 1).any()):
        seen = counts > 0
        seen |= _token_counts([s.token_ids[: s.num_prompt_tokens] for s in seqs], out.shape[1], device) > 0
        penalized = torch.where(out > 0, out / repetition, out * repetition)
        out.copy_(torch.where(seen, penalized, out))
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    out -= frequency * counts + presence * (counts > 0)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    width = max((len(t) for t in token_lists), default=0)
    if width == 0:
        return counts
    # Pad with token 0 at weight 0, so one scatter_add covers every row.
    ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    weights = torch.zeros(len(token_lists), width)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        weights[row, : len(tokens)] = 1.0
    return counts.scatter_add_(1, ids.to(device), weights.to(device))
