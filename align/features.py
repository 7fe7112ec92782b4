"""The verifier's hidden states at chosen layers, read off its own forward passes: what a feature-conditioned drafter
(``align.dflash``) drafts from.

A layer's feature is the residual stream after that decoder layer (0-based ``layers``; vLLM's ``target_layer_ids``
name the same tensors), taken by a forward hook, so the verification pass that scores a draft also hands over the
features of the positions it scored: no second verifier call. The features of ``layers`` are concatenated per
position, in the order given.
"""

from __future__ import annotations

from typing import Any

import torch

from align.errors import AlignError


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a causal LM (``model.model.layers`` for Llama, Qwen, Gemma and their kin)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise AlignError(f"cannot find the decoder layers of the verifier ({type(model).__name__}): a feature-"
                         "conditioned drafter needs a decoder-only transformer with .model.layers")
    return layers


def check_layers(model: Any, layers: list[int]) -> None:
    """Refuse layer ids the verifier does not have, or its last layer (whose output vLLM does not hand over)."""
    count = len(decoder_layers(model))
    bad = [i for i in layers if not 0 <= i < count - 1]
    if not layers or bad:
        raise AlignError(f"the drafter reads verifier layers {layers}, but the verifier has {count} layers (ids 0.."
                         f"{count - 2} can be read: the last layer's output is not handed over); check the drafter's "
                         "dflash_config.target_layer_ids")


class _Deep(Exception):
    """Raised by a stopping tap once the deepest layer it reads has run: the rest of the forward is not needed."""


class FeatureTap:
    """Forward hooks on the verifier's layers ``layers``: after each verifier forward, :meth:`take` returns the
    features of the positions it ran, (B, S, len(layers) · H). Close it (or use it as a context manager) to remove
    the hooks. With ``stop``, the forward ends after the deepest of ``layers`` (the layers above it and the LM head
    never run): call the model through :meth:`run`."""

    def __init__(self, model: Any, layers: list[int], stop: bool = False):
        check_layers(model, layers)
        self.layers = list(layers)
        self.stop = stop
        self.captured: dict[int, torch.Tensor] = {}
        blocks = decoder_layers(model)
        self.handles = [blocks[i].register_forward_hook(self._hook(i)) for i in self.layers]

    def _hook(self, index: int):
        deepest = max(self.layers)

        def hook(module, args, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output
            if self.stop and index == deepest:
                raise _Deep
        return hook

    def run(self, model: Any, **inputs) -> torch.Tensor:
        """``model(**inputs)`` (stopped early with ``stop``), then its features."""
        try:
            model(**inputs)
        except _Deep:
            pass
        return self.take()

    def take(self) -> torch.Tensor:
        missing = [i for i in self.layers if i not in self.captured]
        if missing:
            raise AlignError(f"the verifier's forward did not run layers {missing}")
        out = torch.cat([self.captured[i] for i in self.layers], dim=-1)
        self.captured = {}
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.captured = [], {}

    def __enter__(self) -> "FeatureTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
