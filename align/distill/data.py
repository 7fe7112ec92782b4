"""The training data's order and split: rollouts cut to the shared vocabulary, held-out prompts, the seeded window
order (resumable to the window), and whole held-out rollouts to walk as decoding walks them."""

from __future__ import annotations

import zlib

import torch


def within_vocab(rows: list[dict], vocab: int) -> tuple[list[dict], int]:
    """Rollouts cut before their first token id >= ``vocab`` (one the drafter's distribution cannot hold), in the
    response and, for labelled text, its labels; returns the rows and how many were cut. Random-weight verifiers
    emit such ids; trained ones practically never do."""
    cut = 0
    for row in rows:
        labels = row.get("label_ids") or []
        stop = next((i for i, t in enumerate(row["response_ids"]) if t >= vocab or
                     (i < len(labels) and labels[i] >= vocab)), None)
        if stop is not None:
            row["response_ids"] = row["response_ids"][:stop]
            if labels:
                row["label_ids"] = labels[:stop]
            cut += 1
    return rows, cut


def heldout_rows(rows: list[dict], fraction: float) -> list[bool]:
    """Which rollout rows are held out: a fixed fraction of prompts, chosen by a hash of the prompt id."""
    return [zlib.crc32(str(r["prompt_id"]).encode()) % 10_000 < int(fraction * 10_000) for r in rows]


def subset(rows: list[dict], indices: list[int], limit: int | None) -> list[int]:
    """At most ``limit`` of ``indices`` (rows of ``rows``), chosen by a hash of their prompt ids, so that a smaller
    subset lies inside every larger one; in their given order. ``None``: all."""
    if limit is None or limit >= len(indices):
        return indices
    keep = set(sorted(indices, key=lambda i: zlib.crc32(f"subset|{rows[i]['prompt_id']}".encode()))[:limit])
    return [i for i in indices if i in keep]


class WindowOrder:
    """The data order: epoch e is a seeded permutation of all windows; step s takes the next global batch.

    With ``spans`` (packed training: (start, length) of each rollout's windows) epoch e cuts each rollout's windows,
    shuffled, into groups of ``group`` and permutes the groups: every window once per epoch as before, each group
    sharing one encoder pass, and a micro-batch still drawing on many rollouts.
    """

    def __init__(self, count: int, seed: int, spans: list[tuple[int, int]] | None = None, group: int = 1):
        self.count, self.seed, self.spans, self.group, self.cache = count, seed, spans, group, {}

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self.cache:
            generator = torch.Generator(device="cpu").manual_seed(self.seed + epoch)
            if self.spans is None:
                order = torch.randperm(self.count, generator=generator, device="cpu")
            else:
                groups = [chunk for start, length in self.spans for chunk in
                          (start + torch.randperm(length, generator=generator, device="cpu")).split(self.group)]
                order = torch.cat([groups[i] for i in torch.randperm(len(groups), generator=generator, device="cpu")])
            self.cache = {epoch: order}
        return self.cache[epoch]

    def take(self, start: int, size: int) -> torch.Tensor:
        out = []
        while size:
            epoch, offset = divmod(start, self.count)
            chunk = self._epoch(epoch)[offset:offset + size]
            out.append(chunk)
            start, size = start + len(chunk), size - len(chunk)
        return torch.cat(out)


#: the seed of the held-out rollouts' order (:func:`whole_rollouts`); 0: the windows every seed-0 run was measured on
HELDOUT_ORDER = 0


def whole_rollouts(pairs: torch.Tensor, limit: int) -> torch.Tensor:
    """The windows of whole rollouts of ``pairs`` (grouped by rollout, as window_index gives), as many rollouts as
    fit in ``limit`` windows (at least one), in an order fixed once (:data:`HELDOUT_ORDER`), not by the run's seed:
    seeds vary the training, never the windows it is measured on. Every offset of a rollout is there to walk."""
    spans = rollout_spans(pairs)
    taken, total = [], 0
    generator = torch.Generator(device="cpu").manual_seed(HELDOUT_ORDER)
    for i in torch.randperm(len(spans), generator=generator, device="cpu").tolist():
        start, length = spans[i]
        if taken and total + length > limit:
            continue
        taken.append(pairs[start:start + length])
        total += length
    return torch.cat(taken) if taken else pairs[:0]


def streaks_by_rollout(pairs: torch.Tensor, streaks: torch.Tensor) -> list[list[int]]:
    """Per rollout of ``pairs`` (rows of (rollout row, offset), any order), its windows' ``streaks`` by offset."""
    by_row: dict[int, dict[int, int]] = {}
    for (row, t), a in zip(pairs.tolist(), streaks.tolist()):
        by_row.setdefault(row, {})[t] = int(a)
    return [[offsets[t] for t in sorted(offsets)] for offsets in by_row.values()]


def rollout_spans(pairs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each rollout's run of windows in ``pairs`` (grouped by rollout, as window_index gives)."""
    rows = pairs[:, 0].tolist()
    starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1]]
    return [(start, end - start) for start, end in zip(starts, starts[1:] + [len(rows)])]
