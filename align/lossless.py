"""Greedy losslessness that means something in low precision: exact, near-tie or mismatch.

Speculative decoding scores a block in one pass (γ + 1 positions, or K drafts in a tree); the verifier alone runs
one position at a time. In float32 both give the same argmax. In bfloat16 the different kernel shapes round
differently, and where the verifier's two best tokens are nearly tied the argmax can flip: the outputs then part
ways without any bug. So each output is compared with the verifier's own greedy output, and at the first
difference the verifier is asked (teacher-forced on the common prefix) how close the two diverging tokens are to
its best logit:

- ``exact``: the outputs are equal;
- ``near-tie``: both diverging tokens are within the dtype's resolution of the verifier's top logit. The resolution
  is the larger of ``NEAR_TIE_ULPS`` units in the last place of that logit and twice the spread measured right
  there between three kernel shapes (the whole prefix in one pass; the prompt then one token at a time on a KV
  cache, as ``generate`` runs; the prefix followed by the next draft tokens, as a block is scored): in
  float32 that is about 1e-6, in bfloat16 it is what rounding through every layer really moves a logit;
- ``mismatch``: anything else — a token the verifier would not have chosen; a failure.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from transformers import DynamicCache

from align.inference import cache_keyword

#: how many units in the last place of the top logit count as a tie (the spread of one rounding per layer pass)
NEAR_TIE_ULPS = 4
#: draft tokens appended to the prefix when the block-scoring kernel shape is measured
BLOCK = 16

VERDICTS = ("exact", "near-tie", "mismatch")


def chi_square_p(counts: Counter, probs: dict, n: int) -> float:
    """Sampling losslessness: the p-value of ``n`` samples' ``counts`` against the exact distribution ``probs``
    (outcome -> probability), by a chi-square test with the cells of expected count < 5 merged (the
    Wilson-Hilferty approximation of its tail)."""
    cells, merged_obs, merged_exp = [], 0.0, 0.0
    for key, p in probs.items():
        if n * p < 5:
            merged_obs, merged_exp = merged_obs + counts.get(key, 0), merged_exp + n * p
        else:
            cells.append((counts.get(key, 0), n * p))
    cells.append((merged_obs, merged_exp))
    return _upper_tail(sum((o - e) ** 2 / e for o, e in cells if e > 0), len(cells) - 1)


def homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Sampling losslessness between two samplers whose exact distribution is out of reach (vLLM with and without
    speculation): the p-value that the outcome counts ``a`` and ``b`` come from one distribution, by a chi-square
    test of homogeneity on the 2 × k table, Σ_cells Σ_s (O_s − E_s)² / E_s with E_s = (a + b) · n_s / (n_a + n_b),
    the outcomes whose smaller expected count is under 5 merged into one cell; and the number of cells k (1: the
    samples are too few to say anything)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    if not n_a or not n_b:
        raise ValueError("homogeneity needs samples on both sides")
    share = min(n_a, n_b) / (n_a + n_b)
    cells, rest = [], [0, 0]
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        if (x + y) * share < 5:
            rest = [rest[0] + x, rest[1] + y]
        else:
            cells.append((x, y))
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        for observed, n in ((x, n_a), (y, n_b)):
            expected = (x + y) * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return _upper_tail(stat, len(cells) - 1), len(cells)


def _upper_tail(stat: float, df: int) -> float:
    """P(χ²_df ≥ stat), by the Wilson-Hilferty approximation (df at least 1)."""
    df = max(1, df)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers around ``value``."""
    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (or where the shorter ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def classify(model: Any, prompt: list[int], output: list[int], reference: list[int]) -> tuple[str, float | None]:
    """(verdict, gap) of a speculative ``output`` against the verifier's greedy ``reference`` for ``prompt``; the
    gap is how far below the top logit the lower of the two diverging tokens is, at the first difference."""
    index = first_difference(output, reference)
    if index is None:
        return "exact", None
    if index >= len(output) or index >= len(reference):  # one stopped where the other went on: not a tie
        return "mismatch", None
    param = next(model.parameters())
    ids = torch.tensor([prompt + reference[:index]], device=param.device)
    logits = model(input_ids=ids).logits[0, -1].float()
    cache = DynamicCache(config=model.config)  # generate's own path: the prompt at once, then one token at a time
    with_cache = {cache_keyword(model): cache}
    stepped = model(input_ids=ids[:, :len(prompt)], **with_cache, use_cache=True).logits[0, -1]
    for i in range(len(prompt), ids.shape[1]):
        stepped = model(input_ids=ids[:, i:i + 1], **with_cache, use_cache=True).logits[0, -1]
    stepped = stepped.float()
    block = torch.tensor([output[index:index + BLOCK]], device=param.device)  # scored with the prefix, as a block is
    blocked = model(input_ids=torch.cat([ids, block], 1)).logits[0, ids.shape[1] - 1].float()
    spread = max(float((logits - stepped).abs().max()), float((logits - blocked).abs().max()))
    top = float(logits.max())
    resolution = max(NEAR_TIE_ULPS * ulp(top, param.dtype), 2 * spread)
    gap = top - float(logits[[output[index], reference[index]]].min())
    return ("near-tie" if gap <= resolution else "mismatch"), gap


def lossless_counts(model: Any, prompts: list[list[int]], outputs: list[list[int]],
                    references: list[list[int]]) -> dict[str, int]:
    """How many outputs are exact, near-tie and mismatch (the keys of ``VERDICTS``, with ``_`` for ``-``)."""
    counts = Counter(classify(model, p, o, r)[0] for p, o, r in zip(prompts, outputs, references))
    return {v.replace("-", "_"): counts.get(v, 0) for v in VERDICTS}
