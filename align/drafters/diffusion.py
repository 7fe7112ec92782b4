"""The diffusion drafter: a model that fills a canvas of γ positions after a prefix, in T denoising steps.

Three families read a canvas differently (their traits: ``align.families``); each is a small class with the same two
methods, chosen by the recipe's ``drafter.family``:

| family           | canvas                | logits for canvas position j            | prefix                      |
|------------------|-----------------------|-----------------------------------------|-----------------------------|
| ``diffusiongemma`` | uniform random tokens | decoder output j (self-conditioned)     | encoded once into a KV cache |
| ``mdlm``           | ``[MASK]``            | same position, L + j                    | re-read every step           |
| ``dream``          | ``[MASK]``            | shifted: position L + j - 1 predicts L + j | re-read every step        |

:meth:`Drafter.marginals` runs T denoising steps and returns the draft distribution as log-probabilities
(B, γ, V). For T > 1 the usual confidence schedule commits the most confident positions first (uniform-noise
canvases re-noise the rest; masked canvases keep them masked); positions committed before the last step are
returned as one-hot rows. Given those commitments every row is independent, so a draft drawn row by row from
these marginals has exactly these probabilities: the q that lossless sampling verification needs.

``first_token="encoder"`` (DiffusionGemma, ``distill.first_token``): the block's first row is the encoder's own
next-token distribution at the last prefix token, read from the same pass (the encoder is causal: an
autoregressive model over the prefix, which ``distill.next_token_weight`` trains); rows 2..γ stay the canvas's. Rows
are still independent given the prefix, so the draft is still drawn from exactly these marginals.

Decoding a DiffusionGemma drafter (batch 1, prefix cache kept) goes through :class:`DiffusionGemmaPass` by default:
the model's own computation from its parts, in one pass per denoising step, without what decoding does not need
(equal to the model's forward within float tolerance; checked against it on its first call). ``Drafter(lean=False)``
or ``ALIGN_LEAN=0`` selects the model's own forward, as before.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from align.drafters.base import DrafterKind
from align.errors import AlignError
from align.families import FIRST_TOKEN, Traits, traits
from align.inference import PrefixState, forward_accepts, grad_free, lean_default
from align.loading import logit_rows
from align.models.diffusiongemma_pass import DiffusionGemmaPass, lm_logits, with_cache


# ------------------------------------------------------------------------------------------------ families


class Family:
    """How one kind of diffusion model reads ``prefix ‖ canvas``; what it is: :attr:`traits`."""

    traits: Traits

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def masked(self) -> bool:
        """A canvas of [MASK] (True) or of uniform random tokens (False)."""
        return self.traits.masked

    def canvas_logits(self, model: Any, prefix: torch.Tensor, prefix_mask: torch.Tensor | None,
                      canvas: torch.Tensor, self_conditioning: torch.Tensor | None = None,
                      state: "PrefixState | None" = None, next_token: bool = False) -> Any:
        """Logits (B, γ, V) for the canvas (B, γ) after a left-padded prefix (B, L) with its 0/1 mask; with
        ``next_token`` (families with a causal prefix pass), also that pass's logits (B, V) at the last prefix
        token: ``(canvas logits, next-token logits)``."""
        raise NotImplementedError

    def canvas_logits_many(self, model: Any, prefixes: list[torch.Tensor], canvas: torch.Tensor,
                           self_conditioning: torch.Tensor | None, states: "list[PrefixState]",
                           next_token: bool = False) -> Any:
        """Logits (B, γ, V) for canvas row b after prefix b (1, L_b), prefixes of different lengths, in one call:
        left-padded to the longest (``states``, one per row, are what a family that caches the prefix keeps)."""
        no_prefix_pass(self, next_token)
        longest = max(p.shape[1] for p in prefixes)
        padded = torch.stack([F.pad(p[0], (longest - p.shape[1], 0)) for p in prefixes])
        mask = torch.stack([F.pad(torch.ones_like(p[0]), (longest - p.shape[1], 0)) for p in prefixes])
        return self.canvas_logits(model, padded, mask, canvas, self_conditioning)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token (pads get 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class DiffusionGemmaFamily(Family):
    """``DiffusionGemmaForBlockDiffusion``: an AR encoder writes the prefix KV cache, a bidirectional decoder reads it."""

    traits = traits("diffusiongemma")

    def canvas_logits(self, model, prefix, prefix_mask, canvas, self_conditioning=None, state=None, next_token=False):
        gamma = canvas.shape[1]
        if state is not None:  # decoding, batch 1, no padding: encode only what the cache has not seen
            lean = state.lean if state.lean is not None and state.lean.usable else None
            start, new = self._advance(state, prefix, model.config)
            if lean is not None:  # one pass through the model's parts
                out = lean.logits(state.cache, start, new, canvas, self_conditioning, next_token)
                logits, after = out if next_token else (out, None)
                if not lean.checked:  # once per model: against the model's own forward
                    logits, after = lean.check(prefix, canvas, self_conditioning, state, logits, after)
            else:
                after = None
                if new is not None:
                    encoded = model.model.encoder(
                        input_ids=new, **with_cache(state.cache),
                        position_ids=torch.arange(start, start + new.shape[1], device=new.device)[None])
                    if next_token:
                        after = lm_logits(model, encoded.last_hidden_state[:, -1])
                logits = model(**with_cache(state.cache), decoder_input_ids=canvas,
                               self_conditioning_logits=self_conditioning).logits
            if not next_token:
                return logits
            return logits, self._remember(state, after)
        mask = torch.ones_like(prefix) if prefix_mask is None else prefix_mask
        length = mask.sum(-1, keepdim=True)
        config = getattr(model, "module", model).config  # through a DeepSpeed engine too
        out = model(
            input_ids=prefix, attention_mask=mask, position_ids=positions(mask),
            **with_cache(DynamicCache(config=config)),
            decoder_input_ids=canvas, decoder_attention_mask=torch.cat([mask, torch.ones_like(canvas)], -1),
            decoder_position_ids=length + torch.arange(gamma, device=canvas.device),
            self_conditioning_logits=self_conditioning,
        )
        if not next_token:
            return out.logits
        return out.logits, lm_logits(model, out.encoder_last_hidden_state[:, -1])  # left-padded: last = last real

    def canvas_logits_many(self, model, prefixes, canvas, self_conditioning, states, next_token=False):
        """Each row keeps its own encoder cache: through the lean pass, every row's new tokens and canvas in one pass
        (attention per row, against its cache); otherwise (no lean pass, or before its first check) row by row."""
        lean = states[0].lean
        if lean is None or not lean.usable or not lean.checked or any(s.lean is not lean for s in states):
            rows = [self.canvas_logits(model, prefix, None, canvas[b:b + 1],
                                       None if self_conditioning is None else self_conditioning[b:b + 1],
                                       state, next_token)
                    for b, (prefix, state) in enumerate(zip(prefixes, states))]
            if not next_token:
                return torch.cat(rows)
            return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        parts = []
        for prefix, state in zip(prefixes, states):
            start, new = self._advance(state, prefix, model.config)  # may give the state a new cache
            parts.append((state.cache, start, new))
        if not next_token:
            return lean.logits_many(parts, canvas, self_conditioning)
        logits, after = lean.logits_many(parts, canvas, self_conditioning, True)
        return logits, torch.cat([self._remember(state, row) for state, row in zip(states, after)])

    @staticmethod
    def _remember(state: PrefixState, after: torch.Tensor | None) -> torch.Tensor:
        """The encoder's next-token logits after the state's prefix: ``after`` when this pass computed them (new
        tokens), else those kept from the pass that did."""
        if after is not None:
            state.next_logits = after
        if state.next_logits is None:
            raise AlignError("no next-token logits for this prefix: the drafter was first asked without them")
        return state.next_logits

    @staticmethod
    def _advance(state: PrefixState, prefix: torch.Tensor, config: Any) -> tuple[int, torch.Tensor | None]:
        """Bring ``state`` to ``prefix`` (1, L): a new cache unless the cached tokens begin the prefix. Returns where
        the tokens the cache has not seen start, and those tokens (1, n), or None when there are none."""
        ids = prefix[0].tolist()
        if state.cache is None or ids[:len(state.ids)] != state.ids:
            state.cache, state.ids = DynamicCache(config=config), []
        if len(ids) > len(state.ids):
            state.next_logits = None  # it was the previous prefix's
        start = len(state.ids)
        state.ids = ids
        return start, (prefix[:, start:] if len(ids) > start else None)


class MaskedFamily(Family):
    """Bidirectional masked LM, same-position logits (MDLM / LLaDA style; any ``*ForMaskedLM``)."""

    traits = traits("mdlm")

    def canvas_logits(self, model, prefix, prefix_mask, canvas, self_conditioning=None, state=None, next_token=False):
        no_prefix_pass(self, next_token)
        ids = torch.cat([prefix, canvas], -1)
        mask = torch.ones_like(ids) if prefix_mask is None else torch.cat([prefix_mask, torch.ones_like(canvas)], -1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        return logits[:, prefix.shape[1]:]


class ShiftedMaskedFamily(Family):
    """Bidirectional masked LM whose position i predicts token i + 1 (Dream / DiffuCoder, ``trust_remote_code``)."""

    traits = traits("dream")

    def canvas_logits(self, model, prefix, prefix_mask, canvas, self_conditioning=None, state=None, next_token=False):
        no_prefix_pass(self, next_token)
        ids = torch.cat([prefix, canvas], -1)
        attention = None
        if prefix_mask is not None and not bool(prefix_mask.all()):
            keys = torch.cat([prefix_mask, torch.ones_like(canvas)], -1).bool()
            attention = keys[:, None, None, :].expand(-1, 1, ids.shape[1], -1)  # every query sees the real keys
            pos = positions(torch.cat([prefix_mask, torch.ones_like(canvas)], -1))
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        gamma = canvas.shape[1]
        if _keeps_logits(model):  # the LM head over the rows read only: the last prefix position and the canvas's
            logits = model(input_ids=ids, attention_mask=attention, position_ids=pos, logits_to_keep=gamma + 1).logits
            return logits[:, :gamma]
        logits = model(input_ids=ids, attention_mask=attention, position_ids=pos).logits
        start = prefix.shape[1] - 1
        return logits[:, start:start + gamma]


def _keeps_logits(model: Any) -> bool:
    """Whether ``model`` (or the model inside a DeepSpeed engine) takes ``logits_to_keep`` (align's Dream classes
    do; Dream's and DiffuCoder's own code does not)."""
    return "logits_to_keep" in forward_accepts(getattr(model, "module", model))


def no_prefix_pass(family: Family, next_token: bool) -> None:
    if next_token:
        raise AlignError(f"the {family.name} family reads its prefix bidirectionally: it has no next-token prediction "
                         "to draft a first token from (first_token 'encoder' needs a diffusiongemma drafter)")


#: the diffusion families' canvas readers, by name
FAMILIES: dict[str, Family] = {f.name: f for f in (DiffusionGemmaFamily(), MaskedFamily(), ShiftedMaskedFamily())}


def canvas_for(family: Family, labels: torch.Tensor, noise: torch.Tensor, rate: torch.Tensor | float,
               mask_token_id: int | None, vocab_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Corrupt ``labels`` (B, γ; -100 past the end) at ``rate``: where ``noise < rate`` the token becomes [MASK]
    (masked families) or a uniform random token (uniform families). ``noise`` is U(0, 1) of the same shape."""
    corrupt = (noise < rate) | (labels < 0)
    if family.masked:
        filler = torch.full_like(labels, mask_token_id)
    else:
        filler = torch.randint(0, vocab_size, labels.shape, generator=generator, device=labels.device)
    return torch.where(corrupt, filler, labels.clamp(min=0))


def fixed_canvas(family: Family, gamma: int, mask_token_id: int | None, vocab_size: int, canvas_seed: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A fully noised canvas (γ,): γ uniform tokens drawn from a generator seeded by ``canvas_seed`` (all [MASK] for
    masked families). A training window's own draw, or, for a drafter trained with ``distill.canvas_seed``, the one
    canvas of every window and block: drafting in one step reads nothing from a fully noised canvas but its
    positions, so a fixed one turns them into markers the drafter can learn, where a fresh draw per block is noise
    it must ignore."""
    generator = torch.Generator(device="cpu").manual_seed(canvas_seed)
    empty = torch.full((1, gamma), -100, dtype=torch.long, device="cpu")
    noise = torch.zeros(1, gamma, device="cpu")
    return canvas_for(family, empty, noise, 1.0, mask_token_id, vocab_size, generator)[0].to(device)


def commit_step(logq: torch.Tensor, canvas: torch.Tensor, committed: torch.Tensor, step: int, steps: int,
                masked: bool, vocab_size: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step`` (0-based) of T = ``steps`` of the confidence schedule, after the drafter gave ``logq`` (B, γ, V)
    for ``canvas`` (B, γ): commit the most confident uncommitted positions, an even share of what remains per step
    left, to their argmax (``temperature`` 0) or a sample at ``temperature``; uniform-noise canvases (``masked``
    False) re-noise the rest, masked ones keep them masked. Returns the new canvas and committed mask."""
    batch, gamma = canvas.shape
    remaining = (~committed).sum(-1)
    share = torch.ceil(remaining / (steps - step)).long()
    if temperature > 0:
        tokens = torch.multinomial((logq / temperature).softmax(-1).view(-1, logq.shape[-1]), 1,
                                   generator=generator).view(batch, gamma)
    else:
        tokens = logq.argmax(-1)
    confidence = logq.gather(-1, tokens[..., None])[..., 0].masked_fill(committed, -math.inf)
    rank = confidence.argsort(-1, descending=True).argsort(-1)
    new = (rank < share[:, None]) & ~committed
    committed = committed | new
    canvas = torch.where(committed, torch.where(new, tokens, canvas), canvas)
    if not masked:  # uniform-noise canvases re-noise what is not committed
        noise = torch.randint(0, vocab_size, canvas.shape, generator=generator, device=canvas.device)
        canvas = torch.where(committed, canvas, noise)
    return canvas, committed


# ------------------------------------------------------------------------------------------------ the drafter


class Drafter(DrafterKind):
    """A diffusion model behind the loop's interface: marginals of a γ-block after a prefix, in T denoising steps.

    ``lean`` (default: on unless ``ALIGN_LEAN=0``): decode through :class:`DiffusionGemmaPass` where the model
    supports it, in inference mode; off: the model's own forward under ``no_grad``, as before.
    """

    def __init__(self, model: Any, family: str, vocab_size: int, mask_token_id: int | None = None,
                 lean: bool | None = None, canvas_seed: int | None = None, first_token: str = "canvas",
                 context: int | None = None):
        if family not in FAMILIES:
            raise AlignError(f"'{family}' is not a diffusion drafter family; choose one of {', '.join(FAMILIES)}")
        if first_token not in FIRST_TOKEN:
            raise AlignError(f"unknown first_token '{first_token}'; choose one of {', '.join(FIRST_TOKEN)}")
        self.reader = FAMILIES[family]
        no_prefix_pass(self.reader, first_token == "encoder" and not self.reader.traits.causal_prefix)
        self.model = model.eval()
        self.family = family
        self.vocab_size = vocab_size  # the shared vocabulary: logits beyond it are sliced away
        if self.reader.masked and mask_token_id is None:
            raise AlignError(f"the {family} family needs a mask token: the drafter's tokenizer has none; "
                             "set drafter.mask_token_id")
        self.mask_token_id = mask_token_id
        self.canvas_seed = canvas_seed  # the fixed first canvas the drafter was trained with (None: a fresh draw)
        self._fixed: dict[tuple[int, str], torch.Tensor] = {}  # that canvas per (γ, device)
        self.first_token = first_token  # "encoder": the block's first row is the encoder's next-token distribution
        # bidirectional families re-read the prefix every block: at most its last `context` tokens, as in training
        # (the export's data.max_prefix_len); a causal prefix pass (DiffusionGemma) caches the whole prefix and reads it all
        self.context = None if self.reader.traits.causal_prefix else context
        # decoding through the model's parts (DiffusionGemmaPass) or, lean=False / ALIGN_LEAN=0, its own forward
        self.lean = lean_default() if lean is None else lean
        self.lean_pass = None
        if DiffusionGemmaPass.supported(model) is None:
            self.lean_pass = DiffusionGemmaPass(model)
        self.state = PrefixState()
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        """Forget the cached prefix (start of a new sequence); ``lean`` takes effect here."""
        self.state = self.new_state()

    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Log-probabilities (B, γ, V) of the draft after ``steps`` denoising steps.

        ``temperature`` is how positions are committed at intermediate steps (0: argmax, else a sample at that
        temperature); the returned rows are at temperature 1 (apply the draft temperature when sampling).
        """
        state = self.state if prefix.shape[0] == 1 else None
        if self.context is not None:
            prefix = prefix[:, -self.context:]

        def logits_of(canvas, self_conditioning, next_token):
            return self.reader.canvas_logits(self.model, prefix, None, canvas, self_conditioning, state, next_token)

        with grad_free(self.lean):
            return self._denoise(logits_of, prefix.shape[0], gamma, steps, temperature, generator, prefix.device)

    def marginals_many(self, prefixes: list[torch.Tensor], states: list[PrefixState], gamma: int, steps: int = 1,
                       temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """:meth:`marginals` for several sequences of different lengths at once, each prefix (1, L_b) with its own
        state (:meth:`new_state`; kept up to date as ``self.state`` is by :meth:`marginals`): one drafter pass per
        denoising step for the whole batch (DiffusionGemma through the lean pass: each row's new tokens and canvas;
        bidirectional families: the prefixes left-padded). Returns (B, γ, V)."""
        if self.context is not None:
            prefixes = [p[:, -self.context:] for p in prefixes]

        def logits_of(canvas, self_conditioning, next_token):
            return self.reader.canvas_logits_many(self.model, prefixes, canvas, self_conditioning, states, next_token)

        with grad_free(self.lean):
            return self._denoise(logits_of, len(prefixes), gamma, steps, temperature, generator, prefixes[0].device)

    def new_state(self) -> PrefixState:
        """The state of a sequence not seen yet."""
        return PrefixState(lean=self.lean_pass if self.lean else None)

    def _denoise(self, logits_of, batch, gamma, steps, temperature, generator, device) -> torch.Tensor:
        """T denoising steps from a fully noised canvas; ``logits_of(canvas, self_conditioning, next_token)`` is the
        drafter (with ``next_token``: also the encoder's next-token logits)."""
        if gamma <= 0 or steps <= 0:
            raise AlignError(f"gamma and steps must be positive, got gamma={gamma}, steps={steps}")
        if self.canvas_seed is None:  # a fresh draw per block
            uniform = torch.rand((batch, gamma), generator=generator, device=device)
            empty = torch.full((batch, gamma), -100, dtype=torch.long, device=device)
            canvas = canvas_for(self.reader, empty, uniform, 1.0, self.mask_token_id, self.vocab_size, generator)
        else:  # the one canvas it was trained on, drawn once per (γ, device)
            key = (gamma, str(device))
            if key not in self._fixed:
                self._fixed[key] = fixed_canvas(self.reader, gamma, self.mask_token_id, self.vocab_size,
                                                self.canvas_seed, device)
            canvas = self._fixed[key].expand(batch, gamma)
        committed = torch.zeros((batch, gamma), dtype=torch.bool, device=device)
        self_conditioning, first = None, None
        for step in range(steps):
            if self.first_token == "encoder" and step == 0:  # the encoder runs over the new prefix tokens now
                logits, first = logits_of(canvas, self_conditioning, True)
                first = first[:, None, :self.vocab_size].float().log_softmax(-1)
            else:
                logits = logits_of(canvas, self_conditioning, False)
            logq = logits[..., :self.vocab_size].float().log_softmax(-1)
            if first is not None and not committed[:, 0].all():  # the first row is the encoder's: commit from it
                logq = torch.cat([first, logq[:, 1:]], dim=1)
            if step == steps - 1:
                break
            canvas, committed = commit_step(logq, canvas, committed, step, steps, self.reader.masked,
                                            self.vocab_size, temperature, generator)
            self_conditioning = logits
        return as_drawn(logq, canvas, committed)


def as_drawn(logq: torch.Tensor, canvas: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
    """The draft distribution after T steps: committed rows one-hot at the token committed there (the first too,
    when it was committed from the encoder), the others the last step's marginals. The later steps read the
    committed tokens, so only with these rows is a draft drawn row by row distributed as the rows say (the q of
    sampling verification)."""
    if not committed.any():
        return logq
    onehot = torch.full_like(logq, -math.inf).scatter_(-1, canvas[..., None], 0.0)
    return torch.where(committed[..., None], onehot, logq)


def drafting(meta: dict[str, Any]) -> dict[str, Any]:
    """How an exported drafter drafts, as its training set it (its meta.json; defaults for a folder that is not an
    export): ``canvas_seed``, the fixed canvas it was trained on (None: a fresh draw per block), ``first_token``, what
    drafts a block's first token, and ``context``, the prefix tokens a bidirectional drafter reads (its training's
    ``data.max_prefix_len``; None: all). Keyword arguments of :class:`Drafter`."""
    seed, first, context = meta.get("canvas_seed"), meta.get("first_token"), meta.get("context")
    return {"canvas_seed": seed if isinstance(seed, int) else None,
            "first_token": first if first in FIRST_TOKEN else "canvas",
            "context": context if isinstance(context, int) and context > 0 else None}


def build(model: Any, source: Any) -> Drafter:
    """A :class:`Drafter` around a loaded diffusion model (``source``: :class:`align.drafters.Source`), drafting as
    its training set it."""
    head = model.get_output_embeddings()
    rows = logit_rows(head, source.vocab)
    if rows < source.vocab:
        raise AlignError(f"the drafter '{source.name}' has {rows} logit rows, fewer than the {source.vocab} tokens of "
                         "the shared vocabulary")
    mask = source.mask_token_id if source.mask_token_id is not None else source.tokenizer.mask_token_id
    return Drafter(model, source.family, source.vocab, mask, **drafting(source.meta))
