"""Training for drafting in T > 1 denoising steps: windows at a later step of the schedule decoding uses.

Decoding in T steps (``Drafter.marginals``) starts from a fully noised canvas and, after each drafter pass but the
last, commits the most confident positions to the drafter's own tokens (``align.drafters.diffusion.commit_step``; uniform-noise
canvases re-noise the rest), the next pass self-conditioning on the last pass's logits. A drafter trained on fully
noised canvases only never sees those later canvases. With ``distill.denoise_steps`` T > 1, each micro-batch draws a
step k from 0..T-1 (seeded by run, step and micro-batch, so a resume draws the same); for k > 0 the drafter runs k
passes without gradient from the windows' canvases, as decoding would, and the loss is taken at step k: the
canvas then, the logits of pass k - 1 as self-conditioning, every position of the block against its label (committed
positions learn to keep a right token and to correct a wrong one).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import torch

from align.drafters.diffusion import commit_step


def denoise_step(steps: int, seed: int, step: int, micro: int) -> int:
    """The schedule step k in 0..T-1 a micro-batch trains at (0 when T = 1)."""
    if steps <= 1:
        return 0
    return zlib.crc32(f"denoise/{seed}/{step}/{micro}".encode()) % steps


@torch.no_grad()
def advance(forward: Callable[[Any, torch.Tensor | None], torch.Tensor], batch: Any, k: int, steps: int,
            masked: bool, vocab_size: int, generator: torch.Generator | None = None) -> tuple[Any, torch.Tensor | None]:
    """The windows of ``batch`` as decoding sees them at step ``k`` of ``steps``: k drafter passes
    (``forward(batch, self_conditioning)`` -> logits (N, γ, V_model) in the order of the labels), each followed by
    :func:`~align.drafters.diffusion.commit_step` at temperature 0. Returns the batch with those canvases and the logits of pass
    k - 1 (what pass k self-conditions on; None for k = 0)."""
    canvas = batch.window_canvases()
    committed = torch.zeros(canvas.shape, dtype=torch.bool, device=canvas.device)
    self_conditioning = None
    for s in range(k):
        logits = forward(batch, self_conditioning)
        logq = logits[..., :vocab_size].float().log_softmax(-1)
        canvas, committed = commit_step(logq, canvas, committed, s, steps, masked, vocab_size, 0.0, generator)
        batch, self_conditioning = batch.with_canvases(canvas), logits
    return batch, self_conditioning
