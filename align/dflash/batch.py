"""Training batches of the feature-conditioned drafter: every window of a rollout in one drafter pass.

A window (row, t) is decoding's block after the prefix ``prompt ‖ response[:t]`` of length L: its first row is the
prefix's last token at position s = L − 1, its γ mask rows are positions s + 1 .. s + γ and their labels
``response[t:t+γ]`` (-100 past the end); its context is the verifier's features at positions 0 .. s − 1. Per
micro-batch: one teacher-forced verifier pass over each rollout's ``prompt ‖ response`` (no gradient) gives the
features of every position — and, for objectives that need them, the verifier's logits at each block position
(the distribution it verifies against) — then one drafter pass per rollout runs all of its windows' rows at once,
behind a mask that shows each block exactly what decoding shows it: the context before s, and its own rows
(bidirectionally). The prompt is never cut: the verifier reads all of it at decoding, and so does the drafter.

Drafting in T > 1 passes (``distill.denoise_steps``) fills the block left to right: pass c drafts its share of the
positions (:func:`chunks`) with the rows before it holding the tokens drafted so far. A window trains one such pass:
its first ``given`` mask rows hold their labels (the tokens decoding holds there whenever the block gets this far)
and the loss reads the rows after them (:func:`uncommitted`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from align.features import FeatureTap


@dataclass
class DFlashBatch:
    ids: torch.Tensor  # (R, S) each rollout's prompt ‖ response, right-padded with 0
    attention: torch.Tensor  # (R, S) 1 on the rollout's tokens
    starts: torch.Tensor  # (R, W) position s of each window's first row; -1 pads
    labels: torch.Tensor  # (N, γ) per window, in the order the windows were given; -100 past the end
    slots: torch.Tensor  # (N,) index r · W + w of window n in the (R, W) layout
    rollouts: torch.Tensor  # (R,) which rollout each row is (its index in the rollouts given)
    given: torch.Tensor | None = None  # (N,) mask rows that hold their label instead (a later pass of T); None: 0
    teacher: torch.Tensor | None = None  # (N, γ, V) the verifier's logits, once its pass has run (training)

    def to(self, device) -> "DFlashBatch":
        return DFlashBatch(*(None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self) if f.name != "teacher"))

    def holding(self, given: torch.Tensor | int) -> "DFlashBatch":
        """The same windows with their first ``given`` mask rows holding their labels (int: every window)."""
        if isinstance(given, int):
            given = torch.full((len(self.labels),), given, dtype=torch.long, device=self.labels.device)
        return replace(self, given=given)

    @property
    def gamma(self) -> int:
        return self.labels.shape[1]


def pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, longest), right-padded with 0, and the attention mask (1 on each sequence's tokens)."""
    ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long, device="cpu")
    attention = torch.zeros_like(ids)
    for r, seq in enumerate(seqs):
        ids[r, :len(seq)] = torch.tensor(seq, device="cpu")
        attention[r, :len(seq)] = 1
    return ids, attention


def chunks(gamma: int, steps: int) -> list[tuple[int, int]]:
    """The block positions [lo, hi) that each of T = ``steps`` passes drafts, left to right: an even share of
    what remains per pass left (γ 16, T 4: 0-4, 4-8, 8-12, 12-16; γ 5, T 2: 0-3, 3-5)."""
    bounds, lo = [], 0
    for c in range(steps):
        hi = lo + -(-(gamma - lo) // (steps - c))
        if hi > lo:
            bounds.append((lo, hi))
        lo = hi
    return bounds


def training_given(lengths: torch.Tensor, gamma: int, steps: int, generator: torch.Generator) -> torch.Tensor:
    """Per window, the rows a training pass holds: the start of a chunk drawn uniformly from the T passes', short of
    the window's ``lengths`` (its labels: at least one is left to learn)."""
    starts = torch.tensor([lo for lo, _ in chunks(gamma, steps)], dtype=torch.long, device="cpu")
    drawn = starts[torch.randint(0, len(starts), (len(lengths),), generator=generator, device=generator.device).cpu()]
    return torch.minimum(drawn.to(lengths.device), (lengths - 1).clamp(min=0))


def uncommitted(given: torch.Tensor | None, labels: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The labels (N, γ) and per-row tensors (N, γ, ...: logits, the verifier's) of the rows a pass drafts,
    shifted to the front: row j of each is mask row ``given`` + j (label -100 where that runs past the block), so
    every objective reads them as a block of its own that starts there."""
    if given is None or not bool(given.any()):
        return (labels, *rows)
    gamma = labels.shape[1]
    index = given[:, None] + torch.arange(gamma, device=labels.device)  # (N, γ)
    inside = index < gamma
    index = index.clamp(max=gamma - 1)
    shifted = [None if x is None else x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand_as(x))
               for x in rows]
    return (torch.where(inside, labels.gather(1, index), -100), *shifted)


def window_labels(row: dict, t: int, gamma: int, text_labels: str = "greedy") -> list[int]:
    """The labels of window (row, t): the response's next γ tokens (a greedy rollout: the verifier's own); for a row
    of labelled text (``label_ids``, align/labels.py) with ``text_labels`` greedy, the verifier's greedy
    continuation of ``prompt ‖ response[:t]`` as far as it is known — ``label_ids[t + j]`` while the text before it
    agrees with the verifier (``response[t + i] == label_ids[t + i]`` for i < j), ending after the first
    disagreement."""
    response = row["response_ids"]
    if text_labels == "text" or row.get("label_ids") is None:
        return response[t:t + gamma]
    labels = row["label_ids"]
    out = []
    for i in range(t, min(t + gamma, len(response))):
        out.append(labels[i])
        if labels[i] != response[i]:  # the verifier's own continuation leaves the text here
            break
    return out


def make_batch(rollouts, pairs: torch.Tensor, gamma: int, given: torch.Tensor | None = None,
               text_labels: str = "greedy") -> DFlashBatch:
    """Collate windows ``pairs`` (rows of (rollout row, offset t)) of ``rollouts`` (rows with prompt_ids and
    response_ids, and label_ids for labelled text: :func:`window_labels`), grouped by rollout; ``given`` (N,): mask
    rows that hold their label (a later pass of T)."""
    groups: dict[int, list[int]] = {}
    for row, t in pairs.tolist():
        groups.setdefault(row, []).append(t)
    seqs = [rollouts[row]["prompt_ids"] + rollouts[row]["response_ids"] for row in groups]
    most = max(map(len, groups.values()))
    ids, attention = pad(seqs)
    starts = torch.full((len(seqs), most), -1, dtype=torch.long, device="cpu")
    slot_of = {}
    for r, (row, ts) in enumerate(groups.items()):
        prompt = len(rollouts[row]["prompt_ids"])
        for w, t in enumerate(ts):
            starts[r, w] = prompt + t - 1
            slot_of[(row, t)] = r * most + w
    labels = torch.full((len(pairs), gamma), -100, dtype=torch.long, device="cpu")
    slots = torch.empty(len(pairs), dtype=torch.long, device="cpu")
    for n, (row, t) in enumerate(pairs.tolist()):
        target = window_labels(rollouts[row], t, gamma, text_labels)
        labels[n, :len(target)] = torch.tensor(target, dtype=torch.long, device="cpu")
        slots[n] = slot_of[(row, t)]
    rows = torch.tensor(list(groups), dtype=torch.long, device="cpu")
    return DFlashBatch(ids, attention, starts, labels, slots, rows, given)


@torch.no_grad()
def verifier_pass(verifier, layers: list[int], batch: DFlashBatch, vocab: int,
                  teacher: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The verifier over every rollout once: its features (R, S, F) and, with ``teacher``, its logits (N, γ, V) at
    each window's block positions s .. s + γ − 1 (those that predict the labels). Without ``teacher`` the pass stops
    after the deepest layer read: the layers above it and the LM head (most of a large-vocabulary model's pass) do not
    run."""
    inputs = dict(input_ids=batch.ids, attention_mask=batch.attention, use_cache=False)
    if not teacher:  # the features alone: the verifier runs no deeper than the deepest layer read
        with FeatureTap(verifier, layers, stop=True) as tap:
            return tap.run(verifier, **inputs), None
    with FeatureTap(verifier, layers) as tap:
        out = verifier(**inputs)
        features = tap.take()
    g = batch.gamma
    starts = batch.starts.reshape(-1)[batch.slots]  # (N,)
    rows = torch.div(batch.slots, batch.starts.shape[1], rounding_mode="floor")
    at = (starts[:, None] + torch.arange(g, device=starts.device)).clamp(max=batch.ids.shape[1] - 1)
    return features, out.logits[rows[:, None], at][..., :vocab].float()


def block_layout(batch: DFlashBatch, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter pass's inputs for every rollout: block token ids and positions (R, W · (γ + 1)), and the mask
    (R, 1, W · (γ + 1), S + W · (γ + 1)), True where a row may look. A window's first ``batch.given`` mask rows
    hold their labels."""
    r, w = batch.starts.shape
    g1, width = batch.gamma + 1, batch.ids.shape[1]
    device = batch.ids.device
    starts = batch.starts.clamp(min=0)
    offsets = torch.arange(g1, device=device)
    positions = (starts[..., None] + offsets).reshape(r, w * g1)
    first = batch.ids.gather(1, starts)  # (R, W): the token at s
    ids = torch.full((r, w, g1), mask_token_id, dtype=torch.long, device=device)
    ids[..., 0] = first
    if batch.given is not None:  # a later pass: the first `given` mask rows hold their labels
        rows = ids.view(r * w, g1)
        held = (torch.arange(batch.gamma, device=device) < batch.given[:, None]) & (batch.labels >= 0)
        rows[batch.slots, 1:] = torch.where(held, batch.labels, rows[batch.slots, 1:])
    window = torch.arange(w, device=device).repeat_interleave(g1)  # each row's window
    row_start = starts.repeat_interleave(g1, dim=1)  # (R, Q)
    context = (torch.arange(width, device=device)[None, None] < row_start[..., None]) & batch.attention.bool()[:, None]
    own = (window[:, None] == window[None, :])[None].expand(r, -1, -1)
    return ids.reshape(r, w * g1), positions, torch.cat([context, own], dim=-1)[:, None]


def drafter_logits(model, embed, head, batch: DFlashBatch, features: torch.Tensor, mask_token_id: int,
                   vocab: int, draft_vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's logits (N, γ, V) of every window of ``batch``, in the order of ``batch.labels``: one pass per
    micro-batch over all rollouts' blocks. ``embed`` and ``head`` are the verifier's (frozen; the gradient passes
    through the head to the drafter); with ``draft_vocab`` (K token ids), only those rows of the head: (N, γ, K)."""
    ids, positions, mask = block_layout(batch, mask_token_id)
    dtype = next(model.parameters()).dtype
    feature_positions = torch.arange(batch.ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    hidden = model(embed(ids).to(dtype), positions, mask=mask, features=features.to(dtype),
                   feature_positions=feature_positions)
    r, w = batch.starts.shape
    g = batch.gamma
    rows = hidden.reshape(r * w, g + 1, -1)[batch.slots, 1:]  # (N, γ, H): the mask rows
    if draft_vocab is not None:
        bias = None if head.bias is None else head.bias[draft_vocab]
        return torch.nn.functional.linear(rows.to(head.weight.dtype), head.weight[draft_vocab], bias)
    return head(rows.to(head.weight.dtype))[..., :vocab]


def drafted_logits(forward, batch: DFlashBatch, steps: int) -> torch.Tensor:
    """What decoding in T = ``steps`` passes drafts for each window when every pass before the last reached holds
    the window's own labels (the only case in which its later rows can be accepted): pass c's rows of chunk c,
    ``forward(batch)`` giving a pass's logits (N, γ, V)."""
    if steps <= 1:
        return forward(batch)
    out = None
    for lo, hi in chunks(batch.gamma, steps):
        logits = forward(batch.holding(lo))
        out = logits if out is None else torch.cat([out[:, :lo], logits[:, lo:]], 1)
    return out
