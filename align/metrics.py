"""Acceptance statistics, shared by decoding, training logs and evaluation.

Words (see the README): per block, ``accepted`` is the number of draft tokens the verifier kept (0..γ);
``tau`` is tokens produced per verifier call, ``accepted + 1`` except where an accepted EOS ends the text (no
verifier token follows it) — not vLLM's "mean acceptance length", 1 + accepted_mean, which counts drafting calls
only and always adds the bonus token (docs/metrics.md); both are pooled over blocks (sum over blocks / number of
blocks), never averaged per request. Blocks with no room for a draft (γ = 0, the last token before the length
limit) are verifier calls for τ and speed, but offer nothing to accept: ``accepted_mean``, the acceptance rate and
α_j count only blocks that drafted. ``alpha_j`` is the acceptance rate at block position j among blocks that
reached position j.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (CUDA runs kernels asynchronously, so
    an unsynchronised timer measures the launch, not the work)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def expected_streak(q: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """E[streak] = Σ_{m=1..γ} Π_{j≤m} q_j, over the last dimension (γ).

    ``q`` holds per-position acceptance probabilities (the drafter's probability of the verifier's token, or α_j);
    positions where ``valid`` is False end the block (they contribute nothing and stop the product).
    """
    if valid is not None:
        q = q * valid
    return torch.cumprod(q, dim=-1).sum(-1)


@dataclass
class Block:
    """One verifier call: the draft length offered, how many draft tokens were accepted, and for analysis the
    verifier's rank of the first rejected draft token (0 = its top choice; None when nothing was rejected) and its
    mean entropy (nats) over the positions this block produced."""

    gamma: int
    accepted: int
    rejected_rank: int | None = None
    entropy: float = 0.0
    produced: int | None = None  # tokens this verifier call added: accepted + 1, or accepted when EOS ended the text
    # wall time of this block (synchronised): the drafter's pass(es), the verifier's scoring pass, the whole block
    # (the rest is the loop's own work: building the prefix, picking the draft, the acceptance rule, bookkeeping)
    drafter_s: float = 0.0
    verifier_s: float = 0.0
    total_s: float = 0.0
    nodes: int | None = None  # a token tree's candidates scored (None: one draft of ``gamma`` tokens, or K of them)
    context: int | None = None  # the tokens before the block (prompt and output so far): what its attention reads
    matched: int | None = None  # a lookup drafter's suffix n-gram the draft followed (0: none; None: no lookup)

    def __post_init__(self):
        if self.produced is None:
            self.produced = self.accepted + 1


@dataclass
class DecodeStats:
    """Blocks and wall time of one or more speculative generations (merge with ``+``)."""

    blocks: list[Block] = field(default_factory=list)
    new_tokens: int = 0
    drafter_s: float = 0.0
    verifier_s: float = 0.0
    total_s: float = 0.0
    nodes: int | None = None  # a token tree's candidates scored (None: one draft of ``gamma`` tokens, or K of them)

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        return DecodeStats(self.blocks + other.blocks, self.new_tokens + other.new_tokens,
                           self.drafter_s + other.drafter_s, self.verifier_s + other.verifier_s,
                           self.total_s + other.total_s)

    def summary(self, gamma: int | None = None) -> dict:
        """The pooled figures: accepted_mean, tau, acceptance_rate, per_position (α_1..α_γ), speeds."""
        n = len(self.blocks)
        drafted = [b for b in self.blocks if b.gamma > 0]
        accepted = sum(b.accepted for b in drafted)
        offered = sum(b.gamma for b in drafted)
        gamma = gamma or max((b.gamma for b in self.blocks), default=0)
        return {
            "n_blocks": n,
            "n_drafted": len(drafted),
            "accepted_mean": accepted / len(drafted) if drafted else 0.0,
            "tau": sum(b.produced for b in self.blocks) / n if n else 0.0,
            "acceptance_rate": accepted / offered if offered else 0.0,
            "per_position": per_position(drafted, gamma),
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.new_tokens / self.total_s if self.total_s else 0.0,
            "drafter_s": self.drafter_s,
            "verifier_s": self.verifier_s,
            "total_s": self.total_s,
        }


def per_position(blocks: list[Block], gamma: int) -> list[float | None]:
    """α_j for j = 1..γ: P(position j accepted | positions < j accepted and the block offered position j)."""
    alphas: list[float | None] = []
    for j in range(1, gamma + 1):
        reached = [b for b in blocks if b.gamma >= j and b.accepted >= j - 1]
        alphas.append(sum(b.accepted >= j for b in reached) / len(reached) if reached else None)
    return alphas


def expected_tau(alphas: list[float | None]) -> float:
    """τ implied by per-position rates: 1 + Σ_m Π_{j≤m} α_j (positions never reached count as 0)."""
    q = torch.tensor([a if a is not None else 0.0 for a in alphas], dtype=torch.float64, device="cpu")
    return 1.0 + float(expected_streak(q)) if len(alphas) else 1.0


def walk_blocks(streaks: list[int], start: int = 0, limit: int | None = None) -> tuple[int, int]:
    """(blocks, accepted) of greedy decoding along a text the verifier wrote, from the drafter's greedy streak
    ``streaks[t]`` of the block drafted after its first t tokens: the first block at ``start`` (1 where the
    verifier runs the prompt alone first, as for the dflash drafter), the block at t keeps its streak a_t, the
    verifier adds its own token, and the next block starts at t + a_t + 1. With ``limit`` (max_new_tokens) the
    decoder drafts at most limit − t − 1 tokens at t, and nothing before the last token.

    This is the greedy decoder's accepted per block where the drafter's block depends on its prefix alone and the
    verifier reproduces the text. Blocks start where the last one failed, so hard offsets weigh far more here than
    in the mean streak over every offset (which counts an easy run of 30 tokens 30 times, and decoding once).
    """
    t, blocks, accepted = start, 0, 0
    while t < len(streaks):
        room = len(streaks) if limit is None else limit - t - 1
        if room <= 0:
            break
        a = min(streaks[t], room)
        blocks, accepted = blocks + 1, accepted + a
        t += a + 1
    return blocks, accepted
