"""The verifier: any Hugging Face causal LM, with a KV cache that grows block by block.

``score`` runs the tokens the cache has not seen yet plus one draft (or K drafts) in one forward pass and returns,
for every draft, the verifier's logits after each of its prefixes (γ + 1 rows: the last one gives the bonus
token). K drafts share the cached prefix: they are laid side by side in one sequence with a tree-shaped attention
mask (each draft sees the prefix and its own earlier tokens), so the prefix's KV cache is never copied. ``commit``
rolls the cache back to what was accepted.

``record(layers)`` keeps, beside the cache, the hidden states of those layers at every kept position
(``features``, one row per position of the sequence the verifier has run): a feature-conditioned drafter
(``align.dflash``) reads them, handed over by the passes that score its drafts.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from align.inference import cache_keyword, forward_accepts, grad_free, lean_default
from align.errors import AlignError
from align.features import FeatureTap
from align.metrics import now
from align.trees import CostCurve, Tree


GQA_SDPA = "align_sdpa"  # the verifier's attention where transformers' would be "sdpa" (gqa_sdpa)


def gqa_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except on the CPU with grouped-query heads:

    - inside the verifier's own passes in bfloat16 or float16 (:func:`folds`): :func:`folded_sdpa`, each key/value
      head's group of query heads folded into the rows of one head. PyTorch's CPU kernel runs a one-position pass in
      bfloat16 at a fraction of its speed: SmolLM2's attention, 9 query heads over 1,000 keys, 553 µs a layer
      against 98 folded, so that a plain step after a long prompt cost more than a pass over 2 positions
      (docs/results.md);
    - for a pass over several positions under a mask (float32 too): each key/value head serves its group of query
      heads in place (``enable_gqa``), where transformers first copies the keys and values once per group
      (``repeat_kv``: it reads heads in place only without a mask or for one position, since masked grouped-query
      attention falls back to the math kernel on CUDA). The same attention, bit for bit: a SmolLM2 pass over 12
      positions after 300 costs 47.4 ms against 50.4 (docs/results.md)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = (query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
               and all(kwargs.get(name) is None for name in ("position_bias", "softcap")))
    if grouped and folds(query, key, attention_mask):
        return folded_sdpa(query, key, value, attention_mask, dropout, scaling), None
    if not grouped or query.shape[2] == 1 or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


#: the verifier's passes over several positions fold grouped query heads into rows (:func:`folds`) after at least
#: this many keys, and over at most FOLD_ROWS positions (SmolLM2 in bfloat16 on an AVX-512 CPU, passes over 2 to 16
#: positions: 1–4% dearer folded after 300–450 keys, even after 700–830, 2–8% cheaper after 1,000–1,600)
FOLD_KEYS = 1024
FOLD_ROWS = 32
_FOLD = ContextVar("align_fold_heads", default=False)  # set inside the verifier's own passes only
_FOLDED_MASK = ContextVar("align_folded_mask", default=None)  # one pass's (mask, groups, folded mask)


def folds(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`gqa_sdpa` folds this attention: inside the verifier's own passes, in bfloat16 or float16
    (float32's one-position kernel is fast, and its passes stay transformers' bit for bit), over one position, or
    over 2 to FOLD_ROWS under a mask shared by the heads after FOLD_KEYS keys or more."""
    if not _FOLD.get() or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        return False
    positions = query.shape[2]
    return positions == 1 or (mask is not None and positions <= FOLD_ROWS and key.shape[2] >= FOLD_KEYS)


def folded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Grouped-query attention as plain attention over ``key``/``value``'s own heads: query (B, H, S, D) with H = G
    × the H_kv key/value heads (head h reads key/value head h // G, as ``repeat_kv`` lays them), run as (B, H_kv,
    G·S, D) — each group's query heads stacked as rows, which see the same keys and values — the mask (B, 1, S, T)
    repeated for each group's rows (no mask: every row sees every key, as a one-position step's does). Returns (B,
    S, H, D), transformers' attention output layout."""
    b, heads, s, d = query.shape
    groups = heads // key.shape[1]
    rows = query.reshape(b, key.shape[1], groups * s, d)
    if mask is not None:  # each row once per query head of its group, group-major as the rows
        made = _FOLDED_MASK.get()  # every layer of a pass is handed the same mask: folded once per pass
        if made and made[0] is mask and made[1] == groups:
            mask = made[2]
        else:
            folded = mask.expand(b, 1, s, mask.shape[-1]).unsqueeze(2).expand(b, 1, groups, s, mask.shape[-1])
            folded = folded.reshape(b, 1, groups * s, -1)
            if made is not None:  # None outside the verifier's passes (a direct call)
                made[:] = [mask, groups, folded]
            mask = folded
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, s, d).transpose(1, 2).contiguous()


def use_gqa_sdpa(model: Any) -> None:
    """Run ``model``'s sdpa attention layers through :func:`gqa_sdpa` (with sdpa's masks); other kinds are left."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)


#: passes over at most this many positions take :func:`skinny_linear` (past it ``nn.Linear``'s product is as fast or
#: faster: SmolLM2 on an AVX2 CPU, 20 positions 2.19 steps against 2.02; docs/results.md)
SKINNY_ROWS = 16
_SKINNY = ContextVar("align_skinny_linears", default=False)  # set inside the verifier's own passes only


def skinny_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s forward, except inside the verifier's passes on the CPU over 2 to :data:`SKINNY_ROWS`
    positions in float32: there ``W x^T`` (the weight as the product's tall left factor, the few rows as its thin
    right one) in place of ``x W^T``. The math library packs the right factor before a product; ``x W^T`` makes that
    the whole weight, read and written once more per pass, while ``W x^T`` packs a few rows and streams the weight
    once, as a one-position step does.

    Three details carry the speed: the rows are handed over contiguous (``x^T`` then the column-major panel the
    library packs in a moment; row-major, SmolLM2's down projection costs 3.5 times as much), the result is handed on
    contiguous (left transposed, every later product and elementwise op of the pass reads it strided), and the rows
    are padded with zeros to a power of two (the library's kernels take columns in fours, eights and sixteens: on an
    AVX2 CPU a SmolLM2 pass over 14 positions cost 2.36 steps of one unpadded, 1.67 padded to 16). A SmolLM2 pass
    over 2 positions then costs 0.91 steps of the one-position step (whose matrix-vector product is the slower
    kernel), over 4 0.96, over 8 1.36, over 16 1.65, where ``nn.Linear``'s cost 1.55, 1.60, 1.60 and 1.85
    (``bench/verify_cost.py --linear align,transformers``, docs/results.md). The same products summed in another
    order: logits within float32 rounding (|Δ| ≤ 1.1e-3 on SmolLM2's logits, every argmax equal over 200 passes) of
    ``x W^T``'s, as any two kernels' are."""
    weight = module.weight
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if not (_SKINNY.get() and 1 < rows <= SKINNY_ROWS and weight.dtype == torch.float32 and x.device.type == "cpu"):
        return torch.nn.functional.linear(x, weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    width = 1 << (rows - 1).bit_length()
    flat = torch.cat([flat, flat.new_zeros(width - rows, flat.shape[1])]) if width > rows else flat.contiguous()
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()
    if module.bias is not None:
        out = out + module.bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def use_skinny_linears(model: Any) -> bool:
    """Give ``model``'s float32 ``nn.Linear`` layers on the CPU :func:`skinny_linear` as their forward (plain
    ``nn.Linear`` outside the verifier's passes: the same model under ``generate`` is transformers' own); whether any
    layer took it."""
    found = False
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            if getattr(module.__dict__.get("forward"), "func", None) is not skinny_linear:
                module.forward = partial(skinny_linear, module)
            found = True
    return found


@contextmanager
def own_passes(skinny: bool, fold: bool):
    """Within: the verifier's own passes — those of a model given :func:`use_skinny_linears` take the skinny
    product (``skinny``) or not, those of a model given :func:`use_gqa_sdpa` fold grouped query heads (``fold``) or
    not; outside (``generate``, a direct call) the model is transformers' own."""
    tokens = _SKINNY.set(skinny), _FOLD.set(fold), _FOLDED_MASK.set([])
    try:
        yield
    finally:
        for var, token in zip((_SKINNY, _FOLD, _FOLDED_MASK), tokens):
            var.reset(token)


def context_length(config: Any) -> int | None:
    """The model's longest sequence, when its config says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


class Verifier:
    """A causal LM that scores drafts in one pass per block."""

    def __init__(self, model: Any, lean: bool | None = None):
        self.model = model.eval()
        use_gqa_sdpa(model)
        # lean (default; ALIGN_LEAN=0 or lean=False: the call as before): inference mode, the cache under the
        # forward's current name (transformers 5 deprecates past_key_values, with a warning per call), and logits
        # only for the positions scoring reads (logits_to_keep: the pass over the prompt skips the LM head on it)
        self.lean = lean_default() if lean is None else lean
        # the skinny product for passes over a few positions on the CPU in float32 (lean only: ALIGN_LEAN=0 keeps
        # transformers' own layers; bench/verify_cost.py --linear compares them)
        self.skinny = self.lean and use_skinny_linears(model)
        # grouped query heads folded into rows in its bfloat16/float16 passes on the CPU (gqa_sdpa; lean only)
        self.fold = self.lean
        self._cache_name = cache_keyword(model)
        self._keep = "logits_to_keep" in forward_accepts(model)
        self.max_length = context_length(model.config)
        text = model.config.get_text_config()
        sliding = getattr(text, "sliding_window", None) and any(
            t == "sliding_attention" for t in (getattr(text, "layer_types", None) or []))
        # a custom tree mask replaces the model's own masks; sliding-window layers would lose their window
        self.tree_attention = model.config._attn_implementation in ("eager", "sdpa", GQA_SDPA) and not sliding
        self.cache: DynamicCache | None = None
        self.pending: list[int] = []  # tokens of the sequence whose keys/values are not cached yet
        self.cached = 0  # tokens in the cache
        self._last: tuple[int, torch.Tensor] | None = None  # (pending length, drafts) of the last score call
        self.tap: FeatureTap | None = None  # record(): the layers whose hidden states are kept
        self.features: torch.Tensor | None = None  # (positions run and kept, F) while recording
        self._feature_buffer: torch.Tensor | None = None  # the storage features is the first rows of
        self._rows: tuple[int, torch.Tensor] | None = None  # (first position, features) of the last score call
        self._costs: dict[tuple[int, int], CostCurve] = {}  # tree_cost's measurements

    def record(self, layers: list[int] | None) -> None:
        """Keep the hidden states after ``layers`` (0-based) at every kept position from now on (None: stop)."""
        if self.tap is not None:
            self.tap.close()
        self.tap = FeatureTap(self.model, layers) if layers else None
        self.features = None if self.tap is None else self._no_features()

    def _no_features(self) -> torch.Tensor:
        self._feature_buffer = None
        width = len(self.tap.layers) * self.model.config.get_text_config().hidden_size
        return torch.zeros((0, width), dtype=self.model.dtype, device=self.device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def start(self, prompt: list[int]) -> None:
        """Begin a new sequence with ``prompt`` (nothing is computed until the first ``score``)."""
        if self.max_length is not None and len(prompt) >= self.max_length:
            raise AlignError(f"the prompt has {len(prompt)} tokens but the verifier's context is {self.max_length}; "
                             "shorten the prompt")
        self.cache = DynamicCache(config=self.model.config)
        if any(getattr(layer, "is_sliding", False) for layer in self.cache.layers):
            self.cache.activate_past_recording()  # sliding layers can then roll back
        self.pending, self.cached = list(prompt), 0
        if self.tap is not None:
            self.features = self._no_features()

    @property
    def length(self) -> int:
        """Tokens of the sequence so far (cached and pending)."""
        return self.cached + len(self.pending)

    def score(self, drafts: torch.Tensor) -> torch.Tensor:
        """Logits (K, γ + 1, V) after each prefix of each draft in ``drafts`` (K, γ) (γ may be 0)."""
        with grad_free(self.lean):
            return self._score(drafts)

    def _score(self, drafts: torch.Tensor) -> torch.Tensor:
        k, gamma = drafts.shape
        pending = torch.tensor(self.pending, device=self.device)
        n = len(self.pending)
        if k == 1 or gamma == 0:
            ids = torch.cat([pending, drafts[0]])[None]
            logits = self._forward(ids, gamma + 1)[0]
            logits = logits[None].expand(k, -1, -1) if gamma == 0 else logits[None]
        elif self.tree_attention:
            ids = torch.cat([pending, drafts.reshape(-1)])[None]
            mask, pos = self._tree(n, k, gamma)
            out = self._forward(ids, k * gamma + 1, attention_mask=mask, position_ids=pos)[0]
            logits = torch.cat([out[0].expand(k, 1, -1), out[1:].view(k, gamma, -1)], dim=1)
        else:  # fall back to a batch of K copies of the cache
            self.cache.batch_repeat_interleave(k)
            ids = torch.cat([pending.expand(k, -1), drafts], dim=1)
            logits = self._forward(ids, gamma + 1)
        self._last = (n, drafts)
        if self.tap is not None:
            self._rows = (self.cached, self.tap.take())
        return logits.float()

    def score_tree(self, tree: Any) -> torch.Tensor:
        """Logits (N + 1, V) of the pending tokens and a token tree (:class:`align.trees.Tree`) in one pass: row 0
        after the last pending token (the root), row i + 1 after node i, each node seeing the cache, the pending
        tokens and its own ancestors, at the position its depth gives it."""
        if not self.tree_attention:
            raise AlignError("token trees need a verifier whose attention takes a custom mask (eager or sdpa, no "
                             "sliding-window layers); decode without --tree")
        with grad_free(self.lean):
            n, size = len(self.pending), len(tree)
            pending = torch.tensor(self.pending, device=self.device)
            ids = torch.cat([pending, tree.tokens])[None]
            # one path (a chain): the model's own causal mask and positions are the tree's; no mask to build or apply
            chain = tree.parents.tolist() == list(range(-1, size - 1))
            logits = self._forward(ids, size + 1, **({} if chain else self._tree_mask(n, tree)))[0]
            self._last = (n, tree)
            if self.tap is not None:
                self._rows = (self.cached, self.tap.take())
            return logits.float()

    def tree_cost(self, nodes: int, rounds: int = 9) -> CostCurve:
        """What a pass over a token tree of 0..``nodes`` nodes costs here (:class:`align.trees.CostCurve`): timed at
        a few sizes from the current state, which is left as it was — ``rounds`` rounds after a warm-up, each round
        one pass at every size, the fastest pass of each size kept. Round by round, so that a machine whose speed
        drifts over the seconds the probe takes moves every size alike: timed size after size (five passes each),
        the curve's slope read up to twice what decoding meets, and the sizer kept too few nodes (docs/results.md).
        Measured once per verifier and size, after the prompt's pass (the sizes cost what they cost at a decoding
        step, not at a prefill)."""
        if not self.cached:
            raise AlignError("a tree's cost is measured at a decoding step: score the prompt first")
        key = (nodes, len(self.pending))
        if key in self._costs:
            return self._costs[key]
        # where the positions (pending + nodes) reach a power of two and just pass it: a product's cost steps there
        # (skinny_linear pads to them), and between two such sizes it is flat or straight
        steps = {(1 << k) - len(self.pending) + extra for k in range(1, nodes.bit_length() + 2) for extra in (0, 1)}
        sizes = sorted({0, 1, nodes} | {n for n in steps if 0 < n < nodes})
        token = self.pending[-1]
        stars = {n: Tree(torch.full((n,), token, device=self.device), torch.full((n,), -1, device=self.device),
                         torch.ones(n, dtype=torch.long, device=self.device))  # a bush, as a tree's mask makes it
                 for n in sizes}
        best = {n: math.inf for n in sizes}
        for round_ in range(rounds + 1):  # the first: a warm-up
            for n in (sizes if round_ % 2 else sizes[::-1]):
                t0 = now(self.device)
                self.score_tree(stars[n])
                if round_:
                    best[n] = min(best[n], now(self.device) - t0)
                self.cache.crop(-(len(self.pending) + n))
        self._last = self._rows = None
        self._costs[key] = CostCurve(sizes, [best[n] for n in sizes])
        return self._costs[key]

    def _tree_mask(self, n: int, tree: Any) -> dict[str, torch.Tensor]:
        """The additive mask (1, 1, n + N, cached + n + N) and position ids of ``n`` pending tokens and ``tree``: each
        node sees the cache, the pending tokens and its ancestors, at the position its depth gives it."""
        size = len(tree)
        allowed = torch.zeros((n + size, self.cached + n + size), dtype=torch.bool, device=self.device)
        allowed[:, :self.cached + n] = True
        allowed[:n, self.cached:self.cached + n] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        allowed[n:, self.cached + n:] = tree.ancestors()
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)
        positions = self.cached + torch.cat([torch.arange(n, device=self.device), n - 1 + tree.depth])
        return {"attention_mask": mask[None, None], "position_ids": positions[None]}

    def commit_tree(self, path: list[int], next_token: int) -> None:
        """Keep the pending tokens and the tree nodes of ``path`` (their keys and values stay in the cache, as a
        sequential pass would have made them: each saw exactly its ancestors); ``next_token`` is pending."""
        n, tree = self._last
        base = self.cached + n
        if path != list(range(len(path))):  # the path's nodes move up behind the pending tokens (a spine is there)
            source = base + torch.tensor(path, dtype=torch.long, device=self.device)
            target = torch.arange(base, base + len(path), device=self.device)
            with grad_free(self.lean):  # the cache's tensors were made in inference mode
                for layer in self.cache.layers:
                    layer.keys[..., target, :] = layer.keys[..., source, :]
                    layer.values[..., target, :] = layer.values[..., source, :]
        if len(tree) > len(path):
            self.cache.crop(-(len(tree) - len(path)))
        if self.tap is not None:
            start, rows = self._rows
            kept = torch.cat([rows[0, :n], rows[0, n + torch.tensor(path, dtype=torch.long, device=rows.device)]])
            self._keep_rows(start, kept)
        self.cached += n + len(path)
        self.pending = [next_token]

    def _forward(self, ids: torch.Tensor, keep: int, **kwargs) -> torch.Tensor:
        """The model over ``ids`` after the cache: logits (B, keep, V) of the last ``keep`` positions."""
        if self.lean:
            kwargs[self._cache_name] = self.cache
            if self._keep:
                kwargs["logits_to_keep"] = keep
        else:
            kwargs["past_key_values"] = self.cache
        with own_passes(self.skinny, self.fold):
            return self.model(input_ids=ids, use_cache=True, **kwargs).logits[:, -keep:]

    def _tree(self, n: int, k: int, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive mask (1, 1, n + kγ, cached + n + kγ) and position ids for pending ‖ draft_1 ‖ ... ‖ draft_k."""
        q = n + k * gamma
        allowed = torch.zeros((q, self.cached + q), dtype=torch.bool, device=self.device)
        allowed[:, :self.cached + n] = True  # everything sees the cache and the pending tokens...
        allowed[:n, self.cached:self.cached + n] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        block = torch.ones(gamma, gamma, dtype=torch.bool, device=self.device).tril()
        for i in range(k):  # ...and each draft its own earlier tokens
            rows = slice(n + i * gamma, n + (i + 1) * gamma)
            allowed[rows, self.cached + n + i * gamma:self.cached + n + (i + 1) * gamma] = block
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, torch.finfo(dtype).min)
        offsets = torch.cat([torch.arange(n, device=self.device),
                             n + torch.arange(gamma, device=self.device).repeat(k)])
        return mask[None, None], (self.cached + offsets)[None]

    def commit(self, index: int, accepted: int, next_token: int) -> None:
        """Keep the pending tokens and the first ``accepted`` tokens of draft ``index``; ``next_token`` is pending."""
        n, drafts = self._last
        k, gamma = drafts.shape
        if self.tap is not None:
            self._keep_features(n, index, accepted, k, gamma)
        if k == 1 or gamma == 0:
            self.cache.crop(-(gamma - accepted))
            self.cached += n + accepted
            self.pending = [next_token]
            return
        if not self.tree_attention:
            self.cache.batch_select_indices(torch.tensor([index], device=self.device))
        self.cache.crop(-(k * gamma) if self.tree_attention else -gamma)
        self.cached += n
        self.pending = drafts[index, :accepted].tolist() + [next_token]

    def _keep_features(self, n: int, index: int, accepted: int, k: int, gamma: int) -> None:
        """The last pass's features of the positions kept (its pending tokens, the accepted draft tokens) replace
        whatever ``features`` held from that first position on (a tree pass's accepted tokens run again next)."""
        start, rows = self._rows
        if k == 1 or gamma == 0:
            kept = rows[0, :n + accepted]
        elif self.tree_attention:
            kept = torch.cat([rows[0, :n], rows[0, n + index * gamma:n + index * gamma + accepted]])
        else:
            kept = rows[index, :n + accepted]
        self._keep_rows(start, kept)

    def _keep_rows(self, start: int, kept: torch.Tensor) -> None:
        """``features`` becomes its first ``start`` rows followed by ``kept``, written into a buffer that grows by
        doubling (``features`` is a view of it): a block copies its own rows, not the whole sequence's."""
        end = start + kept.shape[0]
        buffer = self._feature_buffer
        if buffer is None or buffer.shape[0] < end:
            grown = torch.empty((max(end, 256, 2 * (0 if buffer is None else buffer.shape[0])), kept.shape[1]),
                                dtype=kept.dtype, device=kept.device)
            grown[:start] = self.features[:start]
            self._feature_buffer = buffer = grown
        buffer[start:end] = kept
        self.features = buffer[:end]


@dataclass
class AloneRun:
    """The verifier alone through the minimal cached loop: its tokens and the time each took."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds per token; the first includes the prompt's pass

    @property
    def prefill_s(self) -> float:
        return self.times[0] if self.times else 0.0

    @property
    def step_times(self) -> list[float]:
        """Seconds of each one-token step after the prompt's pass."""
        return self.times[1:]

    @property
    def total_s(self) -> float:
        return sum(self.times)


def verifier_alone(verifier: Verifier, prompt: list[int], max_new_tokens: int, eos_token_ids=None,
                   temperature: float = 0.0, seed: int = 0) -> AloneRun:
    """The verifier alone, as speculative decoding runs it: the same ``Verifier`` object and path (``score`` with an
    empty draft, ``commit``), the prompt in one pass, then one token per step from the KV cache, stopping where
    speculative decoding stops (first EOS included, ``max_new_tokens``, the context). Greedy at temperature 0 (the
    tokens are ``generate``'s), else a sample at that temperature. Timed with :func:`align.metrics.now`.

    The reference for speed: what a cached decoding loop costs at the least, rather than ``generate``, whose
    per-step bookkeeping (logits processors, stopping criteria, input preparation) is no part of verifying a draft."""
    with grad_free(verifier.lean):
        return _alone(verifier, prompt, max_new_tokens, eos_token_ids, temperature, seed)


def _alone(verifier, prompt, max_new_tokens, eos_token_ids, temperature, seed) -> AloneRun:
    eos = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids or [])
    device = verifier.device
    generator = torch.Generator(device=device).manual_seed(seed)
    empty = torch.zeros((1, 0), dtype=torch.long, device=device)
    run = AloneRun()
    verifier.start(prompt)
    mark = now(device)
    while len(run.tokens) < max_new_tokens:
        if verifier.max_length is not None and verifier.length >= verifier.max_length:
            break
        logits = verifier.score(empty)[0, -1]
        if temperature > 0:
            token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
        else:
            token = int(logits.argmax())
        verifier.commit(0, 0, token)
        run.tokens.append(token)
        previous, mark = mark, now(device)
        run.times.append(mark - previous)
        if token in eos:
            break
    return run


def sampling_config(max_new_tokens: int, temperature: float, top_p: float, eos: list[int] | int | None,
                    pad: int | None, n: int = 1) -> Any:
    """Every logits processor ``generate`` would apply, set explicitly: greedy at temperature 0, else plain
    temperature (and nucleus) sampling — no repetition penalty, no n-gram ban, no top-k."""
    from transformers import GenerationConfig

    sampling = temperature > 0
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling, temperature=temperature or 1.0,
                            top_k=0 if sampling else None, top_p=top_p if sampling else 1.0, repetition_penalty=1.0,
                            no_repeat_ngram_size=0, num_return_sequences=n, eos_token_id=eos, pad_token_id=pad)


@contextmanager
def plain_generation(model: Any):
    """Set aside the model's own ``generation_config`` while ``generate`` runs: transformers fills every field the
    caller left unset from it (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k 20, top_p 0.8), so the
    verifier alone would not be the distribution speculative decoding reproduces."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id,
                                               pad_token_id=saved.pad_token_id)
    try:
        yield
    finally:
        model.generation_config = saved


@torch.no_grad()
def ar_generate(model: Any, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                eos_token_ids: list[int] | int | None = None, seed: int = 0, **options: Any) -> list[int]:
    """The verifier alone (``generate``): greedy at temperature 0, else plain temperature sampling, with nothing
    taken from the model's own generation config. ``options`` go to ``generate`` as they are: what a user of
    transformers has besides, e.g. ``prompt_lookup_num_tokens`` (prompt-lookup decoding) or ``assistant_model``
    (assisted generation)."""
    pad = model.generation_config.pad_token_id
    config = sampling_config(max_new_tokens, temperature, 1.0, eos_token_ids, pad)
    torch.manual_seed(seed)
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with plain_generation(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **options)
    return out[0, len(prompt):].tolist()


@contextmanager
def counted_calls(model: Any):
    """Count ``model``'s forward calls while the block runs: ``with counted_calls(model) as calls: ...; calls[0]``.
    A call of the verifier yields at least one token, so tokens / calls is τ for any decoding method."""
    calls = [0]

    def count(module, args, kwargs):
        calls[0] += 1

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def counted_generate(model: Any, prompt: list[int], **kwargs: Any) -> tuple[list[int], int]:
    """:func:`ar_generate` and the verifier's forward calls it took."""
    with counted_calls(model) as calls:
        tokens = ar_generate(model, prompt, **kwargs)
    return tokens, calls[0]


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end the verifier's generation: its generation config's EOS ids, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
