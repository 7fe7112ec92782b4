"""The AR drafter: γ tokens one at a time on a KV cache kept across blocks, behind the diffusion drafter's interface."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from align.drafters.base import DrafterKind
from align.errors import AlignError
from align.inference import PrefixState, cache_keyword
from align.loading import logit_rows

FAMILY = "ar"


class ARDrafter(DrafterKind):
    """An autoregressive drafter behind the loop's interface (:class:`align.drafters.base.DrafterKind`).

    ``marginals(prefix, γ, steps, temperature, generator)`` drafts γ tokens one at a time (argmax at temperature 0,
    else a sample from ``softmax(logq_j / temperature)`` with ``generator``) and returns the rows they were drawn
    from, as temperature-1 log-probabilities (B, γ, V): row j is the drafter's distribution after the prefix and
    draft tokens 0..j-1. The draft itself is kept in ``self.draft`` (B, γ): at temperature 0 it is the rows'
    argmax, which is what the loop takes; at temperature > 0 the loop verifies this draft rather than redraw one
    from the rows. Redrawing from the rows (``expose_draft=False``) is still lossless — the rows are fixed before
    the draw — but accepts less. ``steps`` is accepted and ignored (no denoising).

    Batch 1 (decoding) keeps the prefix's KV cache in ``self.state`` (:class:`PrefixState`) across blocks: a new
    prefix that extends the cached ids reuses the cache; otherwise the cache is cropped to the longest common
    prefix (the rejected draft tokens go) and only the rest is run.
    """

    family = FAMILY

    def __init__(self, model: Any, vocab_size: int, expose_draft: bool = True):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        rows = logit_rows(head, model.config.vocab_size)
        if rows < vocab_size:
            raise AlignError(f"the AR drafter has {rows} logit rows, fewer than the {vocab_size} tokens of the shared "
                             "vocabulary")
        self.model = model.eval()
        self._cache_name = cache_keyword(model)
        self.vocab_size = vocab_size
        self.state = PrefixState()
        self.expose_draft = expose_draft  # False: leave self.draft None, so the loop redraws from the rows
        self.draft: torch.Tensor | None = None
        self.forward_calls = 0  # model calls made, for tests and profiling

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        """Forget the cached prefix (start of a new sequence)."""
        self.state = PrefixState()
        self.draft = None

    def _step(self, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Run ``ids`` (B, n) on ``cache``; the log-probabilities (B, V) after the last one."""
        self.forward_calls += 1
        logits = self.model(input_ids=ids, **{self._cache_name: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits[..., :self.vocab_size].float().log_softmax(-1)

    def _start(self, prefix: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
        """A cache holding all of ``prefix`` but what still has to run, and that rest (at least one token)."""
        if prefix.shape[0] != 1:  # batches: no state, the whole prefix
            return DynamicCache(config=self.model.config), prefix
        ids = prefix[0].tolist()
        state = self.state
        common = 0
        if state.cache is not None:
            limit = min(len(ids), len(state.ids))
            while common < limit and ids[common] == state.ids[common]:
                common += 1
        common = min(common, len(ids) - 1)  # the last prefix token must run: its logits give draft token 0
        if common == 0:
            state.cache, state.ids = DynamicCache(config=self.model.config), []
        elif common < state.cache.get_seq_length():
            state.cache.crop(common - state.cache.get_seq_length())  # a negative count: the tokens to remove
        state.ids = ids[:common]
        return state.cache, prefix[:, common:]

    @torch.no_grad()
    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Log-probabilities (B, γ, V) of the γ draft positions, each conditioned on the draft before it."""
        if gamma <= 0 or steps <= 0:
            raise AlignError(f"gamma and steps must be positive, got gamma={gamma}, steps={steps}")
        if prefix.shape[1] == 0:
            raise AlignError("the AR drafter needs a non-empty prefix")
        cache, new = self._start(prefix)
        rows, draft = [], []
        for j in range(gamma):
            logq = self._step(new, cache)
            rows.append(logq)
            if temperature > 0:
                token = torch.multinomial((logq / temperature).softmax(-1), 1, generator=generator)[:, 0]
            else:
                token = logq.argmax(-1)
            draft.append(token)
            if j < gamma - 1:
                new = token[:, None]
        if prefix.shape[0] == 1:  # the cache now holds prefix ‖ draft[:γ-1]
            self.state.ids = prefix[0].tolist() + [int(t) for t in draft[:-1]]
        self.draft = torch.stack(draft, 1) if self.expose_draft else None
        return torch.stack(rows, 1)


def build(model: Any, source: Any) -> ARDrafter:
    """An :class:`ARDrafter` around a loaded causal LM (``python -m align.baseline train`` writes one; any causal LM
    with the verifier's tokenizer serves)."""
    return ARDrafter(model, source.vocab)
