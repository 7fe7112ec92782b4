"""Pretraining the tiny zoo: a causal LM objective for the verifier, a denoising objective for the drafters.

Drafters learn in the setting they are used in, half the time: a prefix of a document, then a canvas of γ fully
noised positions (γ drawn from 4..32) to fill with the next γ tokens. The other half is generic block denoising: a
32-position canvas noised at a rate r ~ U(0, 1) (masked families: the loss is on the masked positions; uniform
families: on every position, since any token may be noise). DiffusionGemma also learns self-conditioning: in a
quarter of the denoising batches a first pass, without gradient, supplies the logits it conditions on.

DiffusionGemma pretrains packed (``align/distill/packing.py``): each document is encoded once and ``offsets``
windows of it (distinct offsets, drawn at random) are denoised from that one encoder pass. With ``next_token`` > 0
that encoder pass is also read as a next-token predictor over the document's response (the encoder and the decoder
share their weights): the trunk learns from every token, as the autoregressive model a real DiffusionGemma starts
from did.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from align.distill.packing import make_packed, next_token_labels, packed_logits
from align.drafters.diffusion import FAMILIES, canvas_for
from align.families import traits

Doc = tuple[list[int], int]  # token ids of prompt ‖ response ‖ eos, and the prompt's length


def _schedule(optimizer: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _batches(docs: list[Doc], batch_size: int, rng: random.Random) -> Iterator[list[Doc]]:
    """Endless batches; each epoch shuffles, then groups documents of similar length to limit padding."""
    while True:
        order = list(range(len(docs)))
        rng.shuffle(order)
        chunks = [order[i:i + 50 * batch_size] for i in range(0, len(order), 50 * batch_size)]
        batches = []
        for chunk in chunks:
            chunk.sort(key=lambda i: len(docs[i][0]))
            batches += [[docs[i] for i in chunk[j:j + batch_size]] for j in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        yield from batches


def _train(model: Any, steps: int, lr: float, seed: int, desc: str, batch_loss) -> list[float]:
    """AdamW with warm-up and cosine decay; ``batch_loss()`` gives the next batch's loss. Returns the losses."""
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    scheduler = _schedule(optimizer, steps, warmup=min(200, steps // 10 + 1))
    losses = []
    for _ in (bar := tqdm(range(steps), desc=desc, dynamic_ncols=True)):
        loss = batch_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


def pretrain_verifier(model: Any, docs: list[Doc], steps: int, batch_size: int = 32, lr: float = 1e-3,
                      seed: int = 0, desc: str = "verifier") -> list[float]:
    """Causal-LM pretraining on whole documents (right-padded). Returns the loss per step."""
    batches = _batches(docs, batch_size, random.Random(seed))

    def batch_loss() -> torch.Tensor:
        batch = next(batches)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long, device="cpu")
        mask = torch.zeros_like(ids)
        for row, (tokens, _) in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens, device="cpu")
            mask[row, :len(tokens)] = 1
        return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    return _train(model, steps, lr, seed, desc, batch_loss)


def drafter_batch(batch: list[Doc], family: str, rng: random.Random, mask_token_id: int | None, vocab_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """One pretraining batch: (prefix, prefix_mask, canvas, labels, is_denoising) with prefixes left-padded."""
    denoising = rng.random() < 0.5
    gamma = 32 if denoising else rng.randint(4, 32)
    starts = [rng.randint(prompt_len, len(ids) - 1) for ids, prompt_len in batch]
    width = max(starts)
    prefix = torch.zeros((len(batch), width), dtype=torch.long, device="cpu")
    prefix_mask = torch.zeros_like(prefix)
    labels = torch.full((len(batch), gamma), -100, dtype=torch.long, device="cpu")
    for row, ((ids, _), t) in enumerate(zip(batch, starts)):
        prefix[row, width - t:] = torch.tensor(ids[:t], device="cpu")
        prefix_mask[row, width - t:] = 1
        target = ids[t:t + gamma]
        labels[row, :len(target)] = torch.tensor(target, device="cpu")
    rate = torch.rand((len(batch), 1), generator=generator, device=generator.device) if denoising else 1.0
    noise = torch.rand(labels.shape, generator=generator, device=generator.device)
    canvas = canvas_for(FAMILIES[family], labels, noise, rate, mask_token_id, vocab_size, generator)
    if FAMILIES[family].masked:  # the loss is on what was masked
        labels = labels.masked_fill(canvas != mask_token_id, -100)
    return prefix, prefix_mask, canvas, labels, denoising


def packed_drafter_batch(batch: list[Doc], offsets: int, rng: random.Random, vocab_size: int,
                         generator: torch.Generator):
    """One packed DiffusionGemma pretraining batch: ``offsets`` windows per document; returns (batch, denoising)."""
    denoising = rng.random() < 0.5
    gamma = 32 if denoising else rng.randint(4, 32)
    rows = [{"prompt_ids": ids[:prompt_len], "response_ids": ids[prompt_len:]} for ids, prompt_len in batch]
    pairs = [(i, t) for i, row in enumerate(rows)
             for t in sorted(rng.sample(range(len(row["response_ids"])), min(offsets, len(row["response_ids"]))))]
    packed = make_packed(rows, torch.tensor(pairs, device="cpu"), gamma, 1 << 30, "diffusiongemma", None, vocab_size,
                         rng.randrange(1 << 30))
    if denoising:  # partly noised canvases: a rate per window
        rate = torch.rand((len(pairs), 1), generator=generator, device=generator.device)
        noise = torch.rand(packed.labels.shape, generator=generator, device=generator.device)
        canvas = canvas_for(FAMILIES["diffusiongemma"], packed.labels, noise, rate, None, vocab_size, generator)
        packed.canvas.view(-1, gamma)[packed.slots] = canvas
    return packed, denoising


def pretrain_drafter(model: Any, family: str, docs: list[Doc], steps: int, mask_token_id: int | None,
                     vocab_size: int, batch_size: int = 32, lr: float = 1e-3, seed: int = 0,
                     desc: str = "drafter", offsets: int = 1, next_token: float = 0.0) -> list[float]:
    """Denoising pretraining of a diffusion drafter (see the module docstring). Returns the loss per step.
    ``offsets`` > 1: windows per document (DiffusionGemma, packed); ``next_token``: weight of a next-token
    cross-entropy on the packed encoder pass over each whole document."""
    rng = random.Random(seed)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    fam = FAMILIES[family]
    batches = _batches(docs, batch_size, rng)

    def packed_loss() -> torch.Tensor:
        batch, denoising = packed_drafter_batch(next(batches), offsets, rng, vocab_size, generator)
        self_conditioning = None
        if denoising and rng.random() < 0.5:
            with torch.no_grad():
                self_conditioning = packed_logits(model, batch)
        out = packed_logits(model, batch, self_conditioning, next_token=bool(next_token))
        logits, next_logits = out if next_token else (out, None)
        loss = F.cross_entropy(logits[..., :vocab_size].reshape(-1, vocab_size), batch.labels.reshape(-1),
                               ignore_index=-100)
        if not next_token:
            return loss
        return loss + next_token * F.cross_entropy(next_logits[..., :vocab_size], next_token_labels(batch)[1])

    def batch_loss() -> torch.Tensor:
        prefix, prefix_mask, canvas, labels, denoising = drafter_batch(next(batches), family, rng, mask_token_id,
                                                                       vocab_size, generator)
        self_conditioning = None
        if traits(family).self_conditioning and denoising and rng.random() < 0.5:
            with torch.no_grad():
                self_conditioning = fam.canvas_logits(model, prefix, prefix_mask, canvas)
        logits = fam.canvas_logits(model, prefix, prefix_mask, canvas, self_conditioning)
        return F.cross_entropy(logits[..., :vocab_size].reshape(-1, vocab_size), labels.reshape(-1), ignore_index=-100)

    packed = traits(family).causal_prefix and offsets > 1
    return _train(model, steps, lr, seed, desc, packed_loss if packed else batch_loss)
