"""What decoding needs of any model, whatever drafts or verifies: the mode it runs in, the name a forward takes its
cache by, and what a drafter keeps of the prefix between blocks.

``ALIGN_LEAN=0`` selects the models' own forwards everywhere, in place of the lean passes
(``align.models.diffusiongemma_pass``, the verifier's trimmed calls); ``bench/throughput.py --decode`` measures both.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefixState:
    """What a drafter remembers of the prefix between calls (DiffusionGemma: its encoder KV cache), and the lean
    decoding pass to use (None: the model's own forward)."""

    ids: list[int] = field(default_factory=list)
    cache: Any = None
    lean: Any = None  # the lean pass (align.models.diffusiongemma_pass.DiffusionGemmaPass), or None
    next_logits: torch.Tensor | None = None  # (1, V) the encoder's next-token logits after ``ids``, once asked for


def forward_accepts(model: Any) -> set[str]:
    """The keyword arguments ``model.forward`` names (empty when its signature cannot be read)."""
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_keyword(model: Any) -> str:
    """The name ``model.forward`` (a model or its class) takes its KV cache by: ``cache`` in transformers 5 (which
    deprecates ``past_key_values``, with a warning, until it removes it), ``past_key_values`` before and in
    wrappers."""
    return "cache" if "cache" in forward_accepts(model) else "past_key_values"


def lean_default() -> bool:
    """Whether decoding takes the lean passes (``ALIGN_LEAN=0`` selects the models' own forwards, for comparison)."""
    return os.environ.get("ALIGN_LEAN", "1").strip().lower() not in ("0", "false", "no", "off")


def grad_free(lean: bool):
    """The mode decoding runs in: ``torch.inference_mode`` on the lean path (no autograd bookkeeping at all: no
    version counters, no view tracking, per operation), ``torch.no_grad`` on the models' own (as before). Outputs
    and caches made under inference mode can be read, sliced and concatenated anywhere, not changed in place."""
    return torch.inference_mode() if lean else torch.no_grad()
