"""Turns logits into tokens: greedy, temperature, min-p, top-k, top-p, per-request seeded generators.

`policy_probs` is the one definition of "the distribution a request samples from"; speculative
decoding uses it for both the draft and the target so the same policy applies in both (§31.5).
"""

from __future__ import annotations

import torch

from kvserve.engine.outputs import TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kernels import cpu


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax: the first maximal index (a NaN counts as the maximum), in any float dtype.
    On the CPU the compiled kernel (kernels/cpu/argmax_rows.cpp) reads the rows as they are, without
    widening them first. Elsewhere max() over a dim, which is also first-maximal and faster than argmax()
    (figures: benchmarks/RESULTS.md, "Figures behind the code's rules")."""
    kernels = cpu.load() if logits.device.type == "cpu" else None
    if kernels is not None:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def policy_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [R, V] (float32) after temperature, min-p, top-k and top-p; greedy rows are one-hot."""
    logits = logits.float()
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=logits.device)
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    scaled = logits / temps[:, None]
    min_ps = torch.tensor([p.min_p for p in params], device=logits.device)
    if bool((min_ps > 0).any()):
        # p(t) < min_p * p(top)  <=>  scaled(t) < scaled(top) + log(min_p), with no softmax needed.
        floor = scaled.max(dim=-1, keepdim=True).values + min_ps.log()[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        max_k = max(top_ks)
        kth = scaled.topk(min(max_k, scaled.shape[1]), dim=-1).values
        index = torch.tensor([max(min(k, scaled.shape[1]), 1) - 1 for k in top_ks], device=logits.device)
        threshold = kth.gather(1, index[:, None])
        active = torch.tensor([k > 0 for k in top_ks], device=logits.device)[:, None]
        scaled = scaled.masked_fill(active & (scaled < threshold), float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
    if bool((top_ps < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps[:, None]
        drop_sorted[:, 0] = False  # a top_p that rounds to 0 in float32 would otherwise drop every token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_tokens(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row; each row draws only from its own generator."""
    if all(p.greedy for p in params):
        return greedy_tokens(logits).tolist()
    probs = policy_probs(logits, params)
    tokens = probs.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = int(torch.multinomial(probs[row].cpu(), 1, generator=gen).item())
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Log-probabilities of the chosen tokens under the model's raw distribution, plus top alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (None, None)
    result = []
    for row, token in enumerate(tokens):
        top = []
        if num_top[row] and top_ids is not None and top_values is not None:
            top = list(
                zip(
                    top_ids[row, : num_top[row]].tolist(),
                    top_values[row, : num_top[row]].tolist(),
                    strict=True,
                )
            )
        result.append(TokenLogprob(token, chosen[row], top))
    return result
