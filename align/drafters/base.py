"""What the decoding loop may ask of a drafter, whatever its kind: :class:`DrafterKind`.

Every kind subclasses it and overrides what it does differently; the defaults are what a kind that needs nothing
more does (a drafter that reads no verifier features binds nothing and never waits for features; one whose rows
are independent given the prefix keeps no draft of its own).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class DrafterKind(Protocol):
    """A drafter behind the loop (``align.speculative``): the marginals of a block of γ positions after a prefix.

    ``marginals(prefix (1, L), γ, T, temperature, generator)`` returns log-probabilities (1, γ, V) at temperature 1.
    Unless :attr:`draft` is set after the call, the rows are independent given the prefix and the loop draws its
    draft from them (argmax, a sample, or K candidates); with :attr:`draft` set, row j is the distribution draft
    token j was drawn from given the draft before it, and the loop verifies that draft (an autoregressive drafter's,
    or one drafted in T passes left to right).
    """

    family: str
    vocab_size: int  # the vocabulary shared with the verifier: the rows' width
    #: the verifier layers whose hidden states it drafts from (None: it reads none); the loop has the verifier record
    #: them while a generation runs
    verifier_layers: list[int] | None = None
    #: the last block's draft (1, γ), when the drafter drew it itself; None: the loop draws one from the rows
    draft: torch.Tensor | None = None
    #: a drafter that looks the context up: the length of the suffix n-gram its last draft followed (0: none
    #: matched); None: it looks nothing up
    matched: int | None = None

    @property
    def device(self) -> torch.device: ...

    def reset(self) -> None:
        """Forget the prefix: a new sequence starts."""

    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor: ...

    def bind(self, verifier: Any) -> None:
        """Before a sequence: the verifier whose passes hand over the features this drafter reads (default: none
        read, nothing to bind)."""

    def needs_features(self, prefix_length: int) -> bool:
        """Whether the verifier has yet to run this prefix before a block can be drafted (default: never)."""
        return False
