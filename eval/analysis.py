"""What the published probe could not measure, from per-prompt decoding records (pure functions).

- per category: accepted per block, the verifier's mean entropy over the generated tokens, and for rejected draft
  tokens the fraction the verifier ranked in its top 5 (the probe's "a synonym, not an error");
- the rank correlation (Spearman) between verifier entropy and acceptance across categories;
- the τ that the measured α_j imply, beside the empirical τ;
- mean and standard deviation over repeats with different seeds.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from align.metrics import Block, DecodeStats, expected_tau


@dataclass
class PromptRecord:
    """One prompt decoded once: its blocks and timings, and the token ids in and out."""

    id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    stats: DecodeStats = field(default_factory=DecodeStats)


def summarize(records: list[PromptRecord], gamma: int) -> dict[str, Any]:
    """Pooled statistics of one decoding setting over a suite (see the README for every field)."""
    total = DecodeStats()
    for r in records:
        total = total + r.stats
    out = total.summary(gamma)
    out["n_prompts"] = len(records)
    nodes = [b.nodes for r in records for b in r.stats.blocks if b.nodes]
    out["tree_nodes_mean"] = sum(nodes) / len(nodes) if nodes else None  # a token tree's candidates per block
    out["acceptance_length"] = 1.0 + out["accepted_mean"]  # vLLM's / SGLang's mean acceptance length (docs/metrics.md)
    out["expected_tau"] = expected_tau(out["per_position"])
    by_category: dict[str, list[Block]] = defaultdict(list)
    for r in records:
        by_category[r.category] += r.stats.blocks
    # the same pooling as accepted_mean: over the blocks that offered a draft (γ > 0); a block with room for one token
    # only (γ 0 at the length limit) accepts nothing because nothing was drafted
    out["per_category"] = {c: _mean([b.accepted for b in bs if b.gamma > 0]) for c, bs in sorted(by_category.items())}
    out["rejected_in_top5"] = {c: _mean([b.rejected_rank < 5 for b in bs if b.rejected_rank is not None])
                               for c, bs in sorted(by_category.items())}
    out["verifier_entropy"] = {c: _weighted([(b.entropy, b.produced) for b in bs])
                               for c, bs in sorted(by_category.items())}
    cats = [c for c in out["per_category"] if out["per_category"][c] is not None]
    out["entropy_acceptance_spearman"] = spearman([out["verifier_entropy"][c] for c in cats],
                                                  [out["per_category"][c] for c in cats])
    out["per_prompt"] = [{"id": r.id, "category": r.category, "blocks": len(r.stats.blocks),
                          "accepted_mean": _mean([b.accepted for b in r.stats.blocks if b.gamma > 0]),
                          "first_block": ([r.stats.blocks[0].accepted, r.stats.blocks[0].gamma]
                                          if r.stats.blocks else None),
                          "first_drafted": _first_drafted(r.stats.blocks)}
                         for r in records]
    return out


def _first_drafted(blocks: list[Block]) -> list[int] | None:
    """[accepted, γ] of the first block that offered a draft (a feature-conditioned drafter's first block is the
    verifier's pass over the prompt, with nothing drafted), None when none did."""
    return next(([b.accepted, b.gamma] for b in blocks if b.gamma > 0), None)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than 3 points or no spread."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


SPREAD = ("accepted_mean", "tau", "acceptance_rate", "expected_tau", "tokens_per_s", "ar_tokens_per_s", "speedup")


def combine_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeats with different seeds: the first run's details, headline figures as mean ± std."""
    out = dict(runs[0])
    out["seeds"] = [r["seed"] for r in runs]
    for key in SPREAD:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.fmean(values)
            out[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    if all("lossless" in r for r in runs):
        flags = [r["lossless"] for r in runs]
        if any(isinstance(f, str) for f in flags):  # "not applicable: lossy rule"
            out["lossless"] = next(f for f in flags if isinstance(f, str))
        else:
            out["lossless"] = None if any(f is None for f in flags) else all(flags)
    if all(r.get("lossless_counts") for r in runs):
        out["lossless_counts"] = {k: sum(r["lossless_counts"][k] for r in runs) for k in runs[0]["lossless_counts"]}
    return out


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _weighted(pairs: list[tuple[float, int]]) -> float | None:
    weight = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / weight if weight else None
