"""Candidate drafts from one drafter pass: whatever K is, the drafter runs once per block.

``iid``: K drafts drawn position by position from the marginals at a drafter temperature. For greedy decoding
duplicates are removed and the argmax draft is always candidate 0 (so selection never does worse than K = 1 on the
scorer's own terms); for sampling the K draws are kept exactly as drawn (recursive rejection sampling needs them
i.i.d.). ``swap``: the argmax draft and K - 1 variants of it, each with one of its least confident positions
replaced by that position's second-best token.
"""

from __future__ import annotations

import torch


def iid_candidates(logq: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None = None,
                   greedy: bool = True) -> torch.Tensor:
    """(K', γ) drafts sampled from ``softmax(logq / temperature)`` (γ, V); K' ≤ K after de-duplication (greedy)."""
    probs = (logq / temperature).softmax(-1)
    samples = torch.multinomial(probs, k, replacement=True, generator=generator).T  # (K, γ)
    if not greedy:
        return samples
    return unique_rows(torch.cat([logq.argmax(-1)[None], samples[:-1]]))


def swap_candidates(logq: torch.Tensor, k: int) -> torch.Tensor:
    """The argmax draft plus K - 1 one-token swaps at its least confident positions (by top-1 probability)."""
    top2 = logq.topk(2, dim=-1)
    best = top2.indices[:, 0]
    order = top2.values[:, 0].argsort()  # least confident first
    drafts = [best]
    for position in order[: k - 1]:
        draft = best.clone()
        draft[position] = top2.indices[position, 1]
        drafts.append(draft)
    return unique_rows(torch.stack(drafts))


def unique_rows(drafts: torch.Tensor) -> torch.Tensor:
    """Drop repeated drafts, keeping the first occurrence of each (order preserved)."""
    seen: dict[tuple[int, ...], int] = {}
    for i, row in enumerate(drafts.tolist()):
        seen.setdefault(tuple(row), i)
    return drafts[sorted(seen.values())]
