"""Training windows: every offset t of a verifier rollout x gives one draft block to learn.

    prefix = (prompt ‖ x[:t])[-max_prefix_len:]     canvas = γ positions     labels = x[t:t+γ]  (-100 past the end)

The canvas follows the drafter family's convention (all [MASK], or uniform random tokens drawn from a generator
seeded by the window's identity, so a window looks the same whatever the batch, the process count or a resume).
Shifted versus same-position logits is the family's business (``Family.canvas_logits``), not the window's.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch

from align.drafters.diffusion import FAMILIES, fixed_canvas


@dataclass
class WindowBatch:
    prefix: torch.Tensor  # (B, L) left-padded
    prefix_mask: torch.Tensor  # (B, L) 1 for real tokens
    canvas: torch.Tensor  # (B, γ)
    labels: torch.Tensor  # (B, γ), -100 past the end of the rollout

    def to(self, device) -> "WindowBatch":
        return WindowBatch(*(t.to(device) for t in (self.prefix, self.prefix_mask, self.canvas, self.labels)))

    def window_canvases(self) -> torch.Tensor:
        """The canvases (N, γ), in the order of ``labels``."""
        return self.canvas

    def with_canvases(self, canvas: torch.Tensor) -> "WindowBatch":
        """The same windows with other canvases (N, γ, in the order of ``labels``)."""
        return replace(self, canvas=canvas)


def window_index(lengths: list[int], rows: list[int], stride: int = 1) -> torch.Tensor:
    """(N, 2) tensor of (rollout row, offset) for the given rollout rows; offsets 0, stride, ... < length."""
    pairs = [(row, t) for row in rows for t in range(0, lengths[row], stride)]
    return torch.tensor(pairs, dtype=torch.long, device="cpu").view(-1, 2)


def by_prefix_length(rollouts, pairs: torch.Tensor, max_prefix_len: int) -> torch.Tensor:
    """The windows ``pairs`` reordered by prefix length (stable), so that micro-batches cut from them in order each
    pad to a near length rather than to the longest of a random draw. A global batch's loss and gradient are sums
    over its windows, and left padding changes no window's logits (``tests/test_train.py``), so neither changes."""
    length = torch.tensor([min(len(rollouts[row]["prompt_ids"]) + t, max_prefix_len) for row, t in pairs.tolist()],
                          device="cpu")
    return pairs[torch.sort(length, stable=True).indices]


def make_windows(rollouts, pairs: torch.Tensor, gamma: int, max_prefix_len: int, family: str,
                 mask_token_id: int | None, vocab_size: int, seed: int, pad_token_id: int = 0,
                 canvas_seed: int | None = None) -> WindowBatch:
    """Collate windows ``pairs`` (rows of (rollout row, offset)) of ``rollouts`` (rows with prompt_ids and
    response_ids) into a left-padded batch; ``canvas_seed``: every window's canvas is that fixed one."""
    prefixes, labels = [], torch.full((len(pairs), gamma), -100, dtype=torch.long, device="cpu")
    for i, (row, t) in enumerate(pairs.tolist()):
        item = rollouts[row]
        response = item["response_ids"]
        prefixes.append((item["prompt_ids"] + response[:t])[-max_prefix_len:])
        target = response[t:t + gamma]
        labels[i, :len(target)] = torch.tensor(target, dtype=torch.long, device="cpu")
    width = max(map(len, prefixes))
    prefix = torch.full((len(pairs), width), pad_token_id, dtype=torch.long, device="cpu")
    prefix_mask = torch.zeros_like(prefix)
    for i, p in enumerate(prefixes):
        prefix[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device="cpu")
        prefix_mask[i, width - len(p):] = 1
    canvases = [window_canvas(family, row, t, gamma, mask_token_id, vocab_size, seed, canvas_seed)
                for row, t in pairs.tolist()]
    return WindowBatch(prefix, prefix_mask, torch.stack(canvases), labels)


def window_canvas(family: str, row: int, t: int, gamma: int, mask_token_id: int | None, vocab_size: int,
                  seed: int, canvas_seed: int | None = None) -> torch.Tensor:
    """The canvas (γ,) of window (row, t): all [MASK], or uniform tokens from a generator seeded by the window
    (``canvas_seed``: the drafter's one fixed canvas, :func:`align.drafters.diffusion.fixed_canvas`)."""
    if canvas_seed is None:  # the window's own draw
        canvas_seed = zlib.crc32(f"{seed}/{row}/{t}".encode())
    return fixed_canvas(FAMILIES[family], gamma, mask_token_id, vocab_size, canvas_seed)


@torch.no_grad()
def teacher_logits(verifier, batch: WindowBatch, vocab: int) -> torch.Tensor:
    """The verifier's logits at each block position, teacher-forced on the rollout tokens: (B, γ, V)."""
    labels = batch.labels.clamp(min=0)
    ids = torch.cat([batch.prefix, labels[:, :-1]], dim=1)
    mask = torch.cat([batch.prefix_mask, torch.ones_like(labels[:, :-1])], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = verifier(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return logits[:, batch.prefix.shape[1] - 1:, :vocab]
