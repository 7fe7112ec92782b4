"""What an output is worth against the verifier alone's: the measures a relaxed (lossy) rule is judged by.

- ``identical``: the share of outputs token for token the verifier's greedy output (``generate``'s);
- ``first_divergence``: where the others part from it (the mean index of the first differing token);
- ``nll_per_token``: the verifier's own negative log-likelihood of the output, per token (teacher-forced, temperature
  1), beside that of its greedy output on the same prompts (``reference_nll_per_token``): how much less likely the
  verifier finds what was accepted;
- ``correct``: where the facts are known (the tiny world, ``align/tinyworld/check.py``), the share of outputs whose
  content is right, beside the verifier alone's share on the same prompts, per category.
"""

from __future__ import annotations

from typing import Any

import torch

from align.tinyworld.check import correct


@torch.no_grad()
def nll_per_token(model: Any, prompts: list[list[int]], outputs: list[list[int]]) -> float | None:
    """The verifier's mean negative log-likelihood of the output tokens, teacher-forced after each prompt."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for prompt, output in zip(prompts, outputs):
        if not output:
            continue
        ids = torch.tensor([prompt + output], device=device)
        logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        total -= float(logp.gather(-1, torch.tensor(output, device=device)[:, None]).sum())
        count += len(output)
    return total / count if count else None


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """The index of the first token where ``output`` parts from ``reference`` (None when they are the same)."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def quality(model: Any, tokenizer: Any, rows: list[dict], prompts: list[list[int]], outputs: list[list[int]],
            references: list[list[int]], reference_nll: float | None = None) -> dict[str, Any]:
    """Every measure above for ``outputs`` against ``references`` (the verifier alone's) on the same prompts;
    ``reference_nll``: the references' NLL per token where already computed (one run compares many settings with
    the same references)."""
    parts = [first_divergence(o, r) for o, r in zip(outputs, references)]
    differing = [p for p in parts if p is not None]
    out = {"identical": sum(p is None for p in parts) / max(1, len(parts)),
           "first_divergence": sum(differing) / len(differing) if differing else None,
           "nll_per_token": nll_per_token(model, prompts, outputs),
           "reference_nll_per_token": (nll_per_token(model, prompts, references) if reference_nll is None
                                       else reference_nll)}
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    checks = [(row.get("category", "all"), correct(row, text(o)), correct(row, text(r)))
              for row, o, r in zip(rows, outputs, references)]
    checks = [c for c in checks if c[1] is not None]
    if checks:
        by_category: dict[str, list[tuple[bool, bool]]] = {}
        for category, mine, theirs in checks:
            by_category.setdefault(category, []).append((mine, theirs))
        out["correct"] = sum(m for _, m, _ in checks) / len(checks)
        out["reference_correct"] = sum(t for _, _, t in checks) / len(checks)
        out["correct_per_category"] = {c: {"correct": sum(m for m, _ in v) / len(v),
                                           "reference_correct": sum(t for _, t in v) / len(v), "prompts": len(v)}
                                       for c, v in sorted(by_category.items())}
    return out
