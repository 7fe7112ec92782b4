"""Scorers: how likely is each candidate draft to be accepted? Pure functions over tensors.

All three estimate the accepted streak of each of K drafts x (K, γ); the selector keeps the highest score, ties
going to the lowest index (candidate 0 is the argmax draft).
"""

from __future__ import annotations

import torch

from align.metrics import expected_streak


def verifier_score(drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """score(x) = Σ_j Π_{i≤j} P(x_i | s, x_<i), with P the verifier's probabilities.

    Cost: the verifier scores all K drafts in one pass of K·γ tokens (a tree over the shared prefix); the chosen
    draft's logits are then reused for its verification, so no further verifier call is needed.
    drafts (K, γ), logits (K, γ + 1, V) -> (K,).
    """
    p = logits[:, :-1].softmax(-1).gather(-1, drafts[..., None])[..., 0]
    return expected_streak(p)


def drafter_score(drafts: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """score(x) = Σ_j Π_{i≤j} q_j(x_j), with q the drafter's own marginals (γ, V).

    Cost: K·γ lookups, no model call; only the chosen draft goes to the verifier (a γ-token pass).
    """
    q = logq.exp()[torch.arange(drafts.shape[1], device=drafts.device), drafts]  # (K, γ)
    return expected_streak(q)


def oracle_score(drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The realised greedy accepted length of each draft (analysis only: it reads the verifier's answer).

    Cost: the same K·γ-token verifier pass as ``verifier_score``.
    """
    return (drafts == logits[:, :-1].argmax(-1)).long().cumprod(-1).sum(-1).float()


def select(scores: torch.Tensor) -> int:
    """Index of the best score; ties go to the lowest index."""
    return int(torch.nonzero(scores == scores.max())[0, 0])
