"""Verifying K i.i.d. drafts at once without changing the output distribution (sampling, K > 1).

Recursive rejection sampling over the drafts that share the accepted prefix (SpecInfer, Miao et al. 2024;
SpecTr, Sun et al. 2023): at block position j, with p the verifier's distribution after the accepted prefix and q
the drafters' distribution, try the surviving drafts in order; draft c's token x is accepted with probability
min(1, p(x) / q(x)); after a rejection p becomes norm(max(0, p - q)) for the next draft. If every draft is rejected
the token is drawn from the last p (the correction); if a token is accepted, the drafts that carry it survive to
position j + 1. When all γ are accepted the bonus token comes from the verifier. This is lossless when the drafts
are drawn i.i.d. from q, position by position (which one drafter pass provides): no de-duplication, no reordering
by score.
"""

from __future__ import annotations

import torch


def multidraft_accept(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                      generator: torch.Generator | None = None) -> tuple[int, int, int]:
    """drafts (K, γ) i.i.d. from q (γ, V); p (K, γ + 1, V) -> (a surviving draft's index, accepted, next token)."""
    k, gamma = drafts.shape
    alive = list(range(k))
    for j in range(gamma):
        residual = p[alive[0], j]
        token = None
        for c in alive:
            x = int(drafts[c, j])
            if float(torch.rand((), generator=generator, device=q.device)) * float(q[j, x]) <= float(residual[x]):
                token = x
                break
            residual = (residual - q[j]).clamp(min=0)
            mass = residual.sum()
            residual = residual / mass if mass > 0 else p[alive[0], j]
        if token is None:
            return alive[0], j, int(torch.multinomial(residual, 1, generator=generator))
        alive = [c for c in alive if int(drafts[c, j]) == token]
    return alive[0], gamma, int(torch.multinomial(p[alive[0], gamma], 1, generator=generator))
