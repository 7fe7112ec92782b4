"""Adaptation pretraining: a drafter made from a verifier (``align/zoo/derive.py``) learns to be a diffusion model.

Real diffusion LMs start from autoregressive weights and are then pretrained on generic text to denoise (Dream-7B
from Qwen2.5-7B on 580B tokens). The drafters made here start the same way and are adapted the same way, at a size
two CPU cores can afford, on generic English the verifier did not write (``align/zoo/text.py``): each document,
tokenised and cut into pieces of ``seq`` tokens, trains the denoising objective of the zoo's pretraining
(``align/zoo/pretrain.py``: half the batches a prefix and a fully noised canvas of γ ∈ 4..32 positions, half a
32-position canvas noised at a rate r ~ U(0, 1)); DiffusionGemma drafters train packed (``offsets`` windows per
piece from one encoder pass) with the next-token term on that pass (``next_token``), which keeps the encoder an
autoregressive model of the text, as Gemma 3 was.

The adapted drafter is the *unaligned* drafter of every comparison: alignment is what comes after, on the verifier's
own rollouts. Training is resumable: a checkpoint (weights, optimizer, schedule, step) is written every
``save_every`` steps beside the model's folder and a rerun continues from it; batches are drawn from a generator
seeded by (seed, step), so a resumed run draws the batches an uninterrupted one would.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from align.drafters.diffusion import FAMILIES
from align.families import traits
from align.files import save_tensors
from align.zoo.pretrain import Doc, drafter_batch, packed_drafter_batch


def text_docs(texts: list[str], tokenizer: Any, seq: int, limit: int | None = None) -> list[Doc]:
    """Documents as pieces of at most ``seq`` tokens (the first token is the piece's prompt, so every canvas has
    a prefix), the shortest pieces (under 16 tokens) left out; at most ``limit`` pieces."""
    docs: list[Doc] = []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and getattr(
        tokenizer, "chat_template", None) is None else []
    for text in texts:
        ids = bos + tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), seq):
            piece = ids[start:start + seq]
            if len(piece) >= 16:
                docs.append((piece, 1))
        if limit is not None and len(docs) >= limit:
            return docs[:limit]
    return docs


def adapt(model: Any, family: str, docs: list[Doc], steps: int, batch_size: int, lr: float, vocab_size: int,
          mask_token_id: int | None, checkpoint: Path, seed: int = 0, offsets: int = 4, next_token: float = 1.0,
          save_every: int = 50, warmup: int = 10, desc: str = "adapt") -> list[float]:
    """Train ``model`` (a drafter of ``family``) for ``steps`` steps on ``docs``; returns every step's loss. Resumes
    from ``checkpoint`` when a previous run of the same settings left one there."""
    fam = FAMILIES[family]
    packed = traits(family).causal_prefix  # every window of a text from one encoder pass
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01,
                                  betas=(0.9, 0.98))

    def factor(step: int) -> float:  # linear warm-up, cosine decay to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    settings = {"family": family, "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                "offsets": offsets, "next_token": next_token, "docs": len(docs)}
    start, losses = 0, []
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if state["settings"] == settings:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            start, losses = state["step"], state["losses"]
            print(f"resuming the adaptation from {checkpoint} (step {start} of {steps})", flush=True)
        else:
            print(f"{checkpoint} holds an adaptation with other settings: starting over", flush=True)

    def batch_loss(step: int) -> torch.Tensor:
        rng = random.Random(seed * 1_000_003 + step)  # the batch of this step, however the run was interrupted
        generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
        batch = [docs[i] for i in rng.sample(range(len(docs)), min(batch_size, len(docs)))]
        if packed:
            from align.distill.packing import next_token_labels, packed_logits

            windows, denoising = packed_drafter_batch(batch, offsets, rng, vocab_size, generator)
            out = packed_logits(model, windows, next_token=bool(next_token))
            logits, following = out if next_token else (out, None)
            loss = F.cross_entropy(logits[..., :vocab_size].reshape(-1, vocab_size), windows.labels.reshape(-1),
                                   ignore_index=-100)
            if next_token:
                loss = loss + next_token * F.cross_entropy(following[..., :vocab_size],
                                                           next_token_labels(windows)[1])
            return loss
        prefix, prefix_mask, canvas, labels, _ = drafter_batch(batch, family, rng, mask_token_id, vocab_size,
                                                               generator)
        logits = fam.canvas_logits(model, prefix, prefix_mask, canvas)
        return F.cross_entropy(logits[..., :vocab_size].reshape(-1, vocab_size), labels.reshape(-1),
                               ignore_index=-100)

    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc, dynamic_ncols=True)
    for step in bar:
        loss = batch_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if (step + 1) % save_every == 0 and step + 1 < steps:
            save_tensors({"settings": settings, "step": step + 1, "losses": losses, "model": model.state_dict(),
                          "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, checkpoint)
    model.eval()
    return losses
