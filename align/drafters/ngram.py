"""Prompt lookup inside align's own loop: drafts copied from the context, no model at all.

:class:`NGramDrafter` looks for the last ``n`` tokens of the prefix (n = ``max_ngram`` down to ``min_ngram``) earlier
in the prefix and proposes the tokens that followed the most recent earlier occurrence, up to γ of them: transformers'
prompt-lookup decoding (``generate(prompt_lookup_num_tokens=...)``, which takes the first occurrence), as a drafter of
the loop, so that it runs beside the trained drafters in the same loop and can combine with one
(:class:`FallbackDrafter`). Where nothing matches it drafts nothing: the block is one plain verifier step.

Its rows are one-hot at the drafted tokens: the draft is deterministic given the prefix, so speculative sampling
accepts token x with probability p(x) and resamples from p without x at a rejection, which is exactly the
verifier's distribution.

With a trained drafter beside it (:class:`FallbackDrafter`), ``ngram+PATH`` drafts the match where there is one and
asks the drafter elsewhere; ``ngram@W+PATH`` asks the drafter every block and mixes the two: where the context
matches, row j is W·onehot(match_j) + (1 − W)·q_j, so a token tree keeps the match as its spine and grows the
drafter's likeliest tokens beside it where the match may be wrong (W between 0 and 1: how far the match is
trusted; W 1 is ``ngram+PATH``). ``ngram@W/S+PATH`` drafts a match after a suffix n-gram of S tokens or more
alone, as ``ngram+PATH`` does, and mixes only the shorter ones: the drafter's pass is spent where the match is
least sure.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from align.drafters.base import DrafterKind
from align.errors import AlignError

FAMILY = "ngram"


def lookup(ids: list[int], gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The up to ``gamma`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram of
    ``ids`` (n from ``max_ngram`` down to ``min_ngram``); [] when no suffix n-gram occurs earlier with a
    continuation."""
    return match(ids, gamma, max_ngram, min_ngram)[0]


def match(ids: list[int], gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """:func:`lookup`'s tokens and the length n of the suffix n-gram they follow (0 where nothing matches)."""
    length = len(ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n:]
        for start in range(length - n - 1, -1, -1):  # the most recent occurrence with a token after it
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + gamma], n
    return [], 0


class NGramDrafter(DrafterKind):
    """Drafts by prompt lookup; ``spec`` ``ngram``, ``ngram:MAX`` or ``ngram:MIN-MAX`` (the n-grams looked up,
    default 1 to 3)."""

    family = FAMILY

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, device: Any = "cpu"):
        if not 1 <= min_ngram <= max_ngram:
            raise AlignError(f"the n-gram drafter looks up n-grams of {min_ngram} to {max_ngram} tokens: give "
                             "1 <= min <= max")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        self._device = torch.device(device)
        self.draft: torch.Tensor | None = None
        self.matched = 0  # the length of the suffix n-gram the last draft followed (0: none)

    @property
    def device(self) -> torch.device:
        return self._device

    def reset(self) -> None:
        self.draft = None
        self.matched = 0

    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """One-hot rows (1, n, V) at the n ≤ γ looked-up tokens (n = 0 where nothing matches); the draft is kept in
        :attr:`draft`."""
        if prefix.shape[0] != 1:
            raise AlignError("the n-gram drafter decodes one sequence at a time (batch 1)")
        found, self.matched = match(prefix[0].tolist(), gamma, self.max_ngram, self.min_ngram)
        found = [t for t in found if t < self.vocab_size]
        draft = torch.tensor([found], dtype=torch.long, device=prefix.device).view(1, len(found))
        rows = torch.full((1, len(found), self.vocab_size), -torch.inf, device=prefix.device)
        rows.scatter_(-1, draft[..., None], 0.0)
        self.draft = draft
        return rows


class FallbackDrafter(DrafterKind):
    """Prompt lookup where the context holds a match, the trained drafter elsewhere (``ngram[:MIN-MAX]+PATH``); with
    ``trust`` W < 1 (``ngram@W+PATH``) the drafter drafts every block and a match is mixed into its rows:

        log q'_j = log(W · 1[x = match_j] + (1 − W) · q_j(x))   for j < len(match),   log q_j elsewhere.

    With ``sure`` S (``ngram@W/S+PATH``), a match after a suffix n-gram of at least S tokens is drafted alone, as
    with W 1. Each q'_j is a distribution, so a draft drawn from q' (or a tree grown from it) is verified exactly as
    any drafter's; the drafter's rows must be independent given the prefix (one pass: steps 1)."""

    def __init__(self, lookup_drafter: NGramDrafter, drafter: DrafterKind, trust: float = 1.0,
                 sure: int | None = None):
        self.lookup, self.drafter, self.trust = lookup_drafter, drafter, trust
        self.sure = sure  # a match after a suffix n-gram of at least this many tokens is drafted alone
        self.family = f"{FAMILY}+{drafter.family}"
        self.vocab_size = drafter.vocab_size
        self.verifier_layers = drafter.verifier_layers
        self.draft: torch.Tensor | None = None
        self.looked_up = 0  # blocks drafted by lookup, for the report

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def matched(self) -> int:
        return self.lookup.matched

    def reset(self) -> None:
        self.lookup.reset()
        self.drafter.reset()
        self.draft = None

    def bind(self, verifier: Any) -> None:
        self.drafter.bind(verifier)

    def needs_features(self, prefix_length: int) -> bool:
        return self.drafter.needs_features(prefix_length)

    def marginals(self, prefix, gamma, steps=1, temperature=0.0, generator=None):
        rows = self.lookup.marginals(prefix, gamma, steps, temperature, generator)
        found = rows.shape[1]
        self.looked_up += bool(found)
        if found and (self.trust == 1 or (self.sure is not None and self.lookup.matched >= self.sure)):
            self.draft = self.lookup.draft
            return rows
        logq = self.drafter.marginals(prefix, gamma, steps, temperature, generator)
        self.draft = self.drafter.draft
        if not found:
            return logq
        if self.draft is not None:
            raise AlignError("ngram@W+PATH mixes the match into the drafter's rows, which must be independent given "
                             "the prefix: decode with steps 1 (or use ngram+PATH)")
        mixed = logq.clone()
        mixed[:, :found] += math.log1p(-self.trust)  # (1 - W) q everywhere, then W more at the match
        at = self.lookup.draft[..., None]
        there = mixed[:, :found].gather(-1, at)
        mixed[:, :found].scatter_(-1, at, torch.logaddexp(there, torch.full_like(there, math.log(self.trust))))
        return mixed


class Spec(NamedTuple):
    """What ``ngram[:[MIN-]MAX][@W[/S]][+PATH]`` names."""

    min_ngram: int  # the shortest n-gram looked up
    max_ngram: int  # the longest
    path: str | None  # the trained drafter beside the lookup (None: lookup alone)
    trust: float = 1.0  # W: 1 drafts a match alone, below 1 mixes it into the drafter's rows (FallbackDrafter)
    sure: int | None = None  # S: a match after an n-gram of at least S tokens is drafted alone (None: none is)


def parse(spec: str) -> Spec:
    """``ngram[:[MIN-]MAX][@W[/S]][+PATH]`` -> :class:`Spec`. ``ngram:2-3`` drafts only where the prefix's last 2 or
    3 tokens occur earlier (a one-token match is often a poor draft: with a drafter to fall back on, it may draft
    better); ``ngram:3@0.5+PATH`` mixes the match into PATH's rows at weight 0.5 instead of drafting it alone;
    ``ngram:3@0.7/2+PATH`` mixes only a match after a one-token n-gram, and drafts longer ones alone."""
    head, _, path = spec.partition("+")
    head, at, weight = head.partition("@")
    name, _, size = head.partition(":")
    if name != FAMILY:
        raise AlignError(f"'{spec}' is not an n-gram drafter; write ngram, ngram:MAX, ngram:MIN-MAX or "
                         "ngram[:MIN-MAX][@W]+PATH")
    low, _, high = size.rpartition("-")
    try:
        max_ngram = int(high) if high else 3
        min_ngram = int(low) if low else 1
    except ValueError:
        raise AlignError(f"'{spec}': the n-gram lengths must be whole numbers (e.g. ngram:3 or ngram:2-3)") from None
    if not 1 <= min_ngram <= max_ngram:
        raise AlignError(f"'{spec}': the n-gram lengths need 1 <= MIN <= MAX (e.g. ngram:2-3)")
    weight, slash, sure = weight.partition("/")
    try:
        trust = float(weight) if at else 1.0
    except ValueError:
        trust = -1.0
    if not 0 < trust <= 1 or (at and not path):  # W and S are checked here, before any drafter loads
        raise AlignError(f"'{spec}': @W is the weight of the match mixed into a trained drafter's rows, a number in "
                         "(0, 1] followed by +PATH (e.g. ngram:3@0.5+runs/x/final)")
    if slash and not (sure.isdigit() and min_ngram < int(sure) <= max_ngram):
        raise AlignError(f"'{spec}': @W/S drafts a match after an n-gram of at least S tokens alone and mixes shorter "
                         f"ones, so S is a whole number above MIN and at most MAX (here {min_ngram + 1} to "
                         f"{max_ngram}; e.g. ngram:3@0.7/2+runs/x/final)")
    return Spec(min_ngram, max_ngram, path or None, trust, int(sure) if slash else None)


def is_spec(path: str) -> bool:
    """Whether a drafter path names the n-gram drafter (``ngram``, ``ngram:MAX``, ``ngram:MIN-MAX``,
    ``ngram...+PATH``)."""
    return path == FAMILY or path.startswith((f"{FAMILY}:", f"{FAMILY}+", f"{FAMILY}@"))
