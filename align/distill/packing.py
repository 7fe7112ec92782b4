"""Packed windows: every offset of a rollout trained from one encoder pass (DiffusionGemma).

DiffusionGemma's encoder is causal: the keys and values its layers write for token i depend on tokens ≤ i only. So
encoding ``prompt ‖ response`` once gives every window's prefix cache at once, and the decoder can read the canvases
of many offsets in one call, each through an attention mask that shows it exactly what a window of its own would see:

    canvas of offset t (prefix length L = len(prompt) + t) attends to
        encoder keys s < L                 on full-attention layers
        encoder keys L − W < s < L         on sliding layers (the W − 1 tokens a sliding cache keeps)
        its own γ canvas positions         (never another offset's)

with position ids L … L + γ − 1, as in decoding. Loss and gradient equal the per-window path's
(``tests/test_packing.py``: 1e-5 in fp32) when no window's prefix is cut by ``data.max_prefix_len``; packed, only
the prompt is cut, and each window sees the whole response before it, as decoding does.

A batch holds G rollouts; the decoder runs ⌈offsets / C⌉ times, call j over the C·γ canvas positions of the j-th
chunk of C offsets of every rollout that has one, reading the same encoder keys: the attention costs
(C·γ) × (S + C·γ) per chunk instead of one dense (all offsets)² matrix. C is 256 / γ, or the most windows any
rollout of the batch has when that is fewer (``data.group_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from align.distill.windows import window_canvas
from align.models.diffusiongemma_pass import lm_logits
from align.errors import AlignError

QUERIES_PER_CALL = 256  # canvas positions per decoder call and rollout, at most: C ≤ max(1, 256 // γ)


@dataclass
class PackedBatch:
    seq: torch.Tensor  # (G, S) prompt ‖ response, right-padded
    seq_mask: torch.Tensor  # (G, S) 1 for real tokens
    prompt_len: torch.Tensor  # (G,)
    offsets: torch.Tensor  # (G, J, C) window offsets t, -1 for an empty slot
    canvas: torch.Tensor  # (G, J, C, γ)
    labels: torch.Tensor  # (N, γ) in the order of the pairs given, -100 past the end
    slots: torch.Tensor  # (N,) each window's flat index into (G, J, C)

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in (self.seq, self.seq_mask, self.prompt_len, self.offsets,
                                                   self.canvas, self.labels, self.slots)))

    def window_canvases(self) -> torch.Tensor:
        """The canvases (N, γ), in the order of ``labels``."""
        return self.canvas.view(-1, self.canvas.shape[-1])[self.slots]

    def with_canvases(self, canvas: torch.Tensor) -> "PackedBatch":
        """The same windows with other canvases (N, γ, in the order of ``labels``) in their slots."""
        slots = self.canvas.clone()
        slots.view(-1, slots.shape[-1])[self.slots] = canvas
        return replace(self, canvas=slots)


def make_packed(rollouts, pairs: torch.Tensor, gamma: int, max_prefix_len: int, family: str,
                mask_token_id: int | None, vocab_size: int, seed: int, pad_token_id: int = 0,
                canvas_seed: int | None = None) -> PackedBatch:
    """Group windows ``pairs`` (rows of (rollout row, offset)) by rollout: one sequence per rollout, the offsets
    in slots of C per decoder call. Canvases and labels are those :func:`make_windows` gives the same windows."""
    groups: dict[int, list[int]] = {}
    for row, t in pairs.tolist():
        groups.setdefault(row, []).append(t)
    most = max(len(ts) for ts in groups.values())
    per_call = min(offsets_per_call(gamma), most)  # no slot every rollout leaves empty
    calls = math.ceil(most / per_call)
    seqs = []
    for row in groups:
        item = rollouts[row]
        seqs.append((item["prompt_ids"][-max_prefix_len:], item["response_ids"]))
    width = max(len(p) + len(r) for p, r in seqs)
    g = len(groups)
    seq = torch.full((g, width), pad_token_id, dtype=torch.long, device="cpu")
    seq_mask = torch.zeros_like(seq)
    offsets = torch.full((g, calls, per_call), -1, dtype=torch.long, device="cpu")
    canvas = torch.zeros((g, calls, per_call, gamma), dtype=torch.long, device="cpu")
    labels = torch.full((len(pairs), gamma), -100, dtype=torch.long, device="cpu")
    slot_of: dict[tuple[int, int], int] = {}
    for i, ((row, ts), (prompt, response)) in enumerate(zip(groups.items(), seqs)):
        tokens = prompt + response
        seq[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long, device="cpu")
        seq_mask[i, :len(tokens)] = 1
        for k, t in enumerate(ts):
            j, c = divmod(k, per_call)
            offsets[i, j, c] = t
            canvas[i, j, c] = window_canvas(family, row, t, gamma, mask_token_id, vocab_size, seed, canvas_seed)
            slot_of[(row, t)] = (i * calls + j) * per_call + c
    slots = torch.empty(len(pairs), dtype=torch.long, device="cpu")
    for n, (row, t) in enumerate(pairs.tolist()):
        target = rollouts[row]["response_ids"][t:t + gamma]
        labels[n, :len(target)] = torch.tensor(target, dtype=torch.long, device="cpu")
        slots[n] = slot_of[(row, t)]
    prompt_len = torch.tensor([len(p) for p, _ in seqs], dtype=torch.long, device="cpu")
    return PackedBatch(seq, seq_mask, prompt_len, offsets, canvas, labels, slots)


def offsets_per_call(gamma: int) -> int:
    """C: window offsets per decoder call and rollout."""
    return max(1, QUERIES_PER_CALL // gamma)


def block_diffusion_model(model: Any) -> Any:
    """The ``DiffusionGemmaForBlockDiffusion`` inside ``model`` (itself, or wrapped by DeepSpeed and/or PEFT)."""
    for module in model.modules():
        children = module._modules  # its own children: a DeepSpeed engine forwards attribute look-ups to its module
        if "lm_head" in children and "decoder" in getattr(children.get("model"), "_modules", {}):
            return module
    raise AlignError("data.packing needs a DiffusionGemma drafter (an encoder and a decoder); set data.packing: false")


def packed_logits(model: Any, batch: PackedBatch, self_conditioning: torch.Tensor | None = None,
                  next_token: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits (N, γ, V) of every window in ``batch``, in the order of ``batch.labels``; with
    ``self_conditioning`` (N, γ, V: a previous step's logits, same order) the decoder conditions on it.

    ``next_token``: also return the encoder's own logits (P, V) at the positions :func:`next_token_labels` names,
    the prefix pass read as a next-token predictor (the trunk it shares with the decoder learns from every response
    token, as an autoregressive drafter's does)."""
    core = block_diffusion_model(model)
    text = core.config.text_config
    attention = _attention_kind(text)
    g, width = batch.seq.shape
    _, calls, per_call, gamma = batch.canvas.shape
    device = batch.seq.device
    windows = {kind: text.sliding_window if kind == "sliding_attention" else None for kind in set(text.layer_types)}

    positions = torch.arange(width, device=device)
    causal = positions[None, :] <= positions[:, None]  # (S, S) query, key
    real = batch.seq_mask.bool()[:, None, None, :]  # (G, 1, 1, S)
    encoder_masks = {}
    for kind, window in windows.items():
        allowed = causal if window is None else causal & (positions[None, :] > positions[:, None] - window)
        encoder_masks[kind] = _as_mask(allowed[None, None] & (real | positions[None, None, :, None].eq(
            positions[None, None, None, :])), attention)
    cache = DynamicCache()  # keeps every layer's keys whole; the masks below apply each window's view
    encoded = core.model.encoder(input_ids=batch.seq, attention_mask=encoder_masks,
                                 position_ids=positions[None].expand(g, -1), cache=cache).last_hidden_state

    own = torch.arange(per_call, device=device).repeat_interleave(gamma)  # canvas position -> its slot in the call
    same_window = own[:, None] == own[None, :]  # (C·γ, C·γ)
    step = torch.arange(gamma, device=device).repeat(per_call)  # position within the window
    if self_conditioning is not None:  # into the slots' layout (empty slots: zero logits, a flat signal)
        sc = self_conditioning.new_zeros((g * calls * per_call, gamma, self_conditioning.shape[-1]))
        sc[batch.slots] = self_conditioning
        sc = sc.view(g, calls, per_call * gamma, -1)
    out, where = [], torch.full((g, calls, per_call), -1, dtype=torch.long, device=device)
    for j in range(calls):
        rows = (batch.offsets[:, j, 0] >= 0).nonzero()[:, 0]  # the rollouts with a j-th chunk of offsets
        offsets = batch.offsets[rows, j]  # (R, C)
        length = (batch.prompt_len[rows, None] + offsets).repeat_interleave(gamma, dim=1)  # (R, C·γ) prefix length L
        empty = offsets.repeat_interleave(gamma, dim=1) < 0
        decoder_masks = {}
        for kind, window in windows.items():
            keys = positions[None, None, :] < length[..., None]  # (R, C·γ, S)
            if window is not None:
                keys &= positions[None, None, :] > length[..., None] - window
            keys &= ~empty[..., None]
            full = torch.cat([keys, same_window[None].expand(len(rows), -1, -1)], dim=-1)
            decoder_masks[kind] = _as_mask(full[:, None], attention)
        hidden = core.model.decoder(
            decoder_input_ids=batch.canvas[rows, j].reshape(len(rows), per_call * gamma),
            cache=cache if len(rows) == g else _rows(cache, rows), decoder_attention_mask=decoder_masks,
            decoder_position_ids=torch.where(empty, 0, length + step[None]),
            self_conditioning_logits=None if self_conditioning is None else sc[rows, j],
        ).last_hidden_state
        where[rows, j] = sum(len(h) for h in out) + torch.arange(len(rows) * per_call, device=device).view(-1, per_call)
        out.append(hidden.reshape(len(rows) * per_call, gamma, -1))
    logits = lm_logits(core, torch.cat(out)[where.view(-1)[batch.slots]])
    if not next_token:
        return logits
    return logits, lm_logits(core, encoded[next_token_labels(batch)[0]])


def next_token_labels(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(where (G, S): the encoder positions whose next token is a response token, labels (P,): those tokens)."""
    positions = torch.arange(batch.seq.shape[1], device=batch.seq.device)
    after = positions[None, :] + 1
    where = (after >= batch.prompt_len[:, None]) & (after < batch.seq_mask.sum(1, keepdim=True))
    return where, batch.seq.roll(-1, dims=1)[where]


@torch.no_grad()
def packed_teacher_logits(verifier: Any, batch: PackedBatch, vocab: int) -> torch.Tensor:
    """The verifier's logits at each window's block positions, from one teacher-forced pass per rollout: (N, γ, V)."""
    g, width = batch.seq.shape
    logits = verifier(input_ids=batch.seq, attention_mask=batch.seq_mask).logits[..., :vocab]  # (G, S, V)
    _, calls, per_call, gamma = batch.canvas.shape
    rows = torch.arange(g, device=batch.seq.device).repeat_interleave(calls * per_call)[batch.slots]
    offsets = batch.offsets.reshape(-1)[batch.slots]
    first = batch.prompt_len[rows] + offsets - 1  # the logit that predicts the window's first token
    index = (first[:, None] + torch.arange(gamma, device=first.device)).clamp(max=width - 1)
    return logits[rows[:, None], index]


def _rows(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """The encoder keys and values of some rollouts only (gradients flow back through the selection)."""
    part = DynamicCache()
    for index, layer in enumerate(cache.layers):
        part.update(layer.keys[rows], layer.values[rows], index)
    return part


def _attention_kind(config: Any) -> str:
    kind = getattr(config, "_attn_implementation", None) or "eager"
    if kind not in ("sdpa", "eager"):
        raise AlignError(f"data.packing needs sdpa or eager attention (masks of any shape); the drafter uses {kind}: "
                         "set data.packing: false or load the drafter with attn_implementation='sdpa'")
    return kind


def _as_mask(allowed: torch.Tensor, attention: str) -> torch.Tensor:
    """A boolean mask (True: attend) in the form the attention kernel takes."""
    if attention == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
