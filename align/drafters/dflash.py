"""The feature-conditioned drafter at decoding time, behind the diffusion drafter's interface.

:class:`DFlashDrafter` drafts a block in one pass of its few layers: the block is the prefix's last token (the
verifier's correction or bonus, which the verifier has not run yet) and γ mask tokens, at the positions after the
prefix, over a context of the verifier's own features at every earlier position (``Verifier.record``: the passes
that score the drafts hand them over). The context's keys and values are kept per layer and grow with the accepted
positions; a shorter prefix (a new sequence, or one rolled back) crops them. In one pass (T = 1) its rows are
independent given the prefix, so a draft drawn row by row from :meth:`marginals` has exactly those probabilities
(the q of lossless sampling), as self-selection's K candidates do. In T > 1 passes the block fills left to right,
each pass's rows reading the tokens drafted before them, and the loop verifies the drafter's own draft against the
rows it was drawn from, as an autoregressive drafter's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from align.dflash.batch import chunks
from align.drafters.base import DrafterKind
from align.errors import AlignError
from align.loading import int8_linears, is_int8
from align.models.dflash import ContextCache, DecodePass

FAMILY = "dflash"


class DFlashDrafter(DrafterKind):
    """Drafts from the verifier's features; ``bind(verifier)`` before each sequence (the decoder does it)."""

    family = FAMILY

    def __init__(self, model: Any, verifier_model: Any, vocab_size: int):
        self.model = model.eval()
        self.config = model.config
        self.verifier_layers = self.config.target_layer_ids
        mask = self.config.mask_token_id
        if mask is None:
            raise AlignError("the dflash drafter's config names no mask token (dflash_config.mask_token_id)")
        self.mask_token_id = int(mask)
        self.embed = verifier_model.get_input_embeddings()
        self.head = verifier_model.get_output_embeddings()
        self.vocab_size = vocab_size
        self.draft_vocab = None  # the token ids it proposes (its head: those rows of the verifier's); None: all
        if self.config.draft_vocab:
            self.draft_vocab = torch.tensor(self.config.draft_vocab, device=self.device)
        self.draft_head = self._draft_head(model)
        self.decode_pass = self._decode_pass(model)
        self.verifier = None
        self.draft: torch.Tensor | None = None  # T > 1: the block as drafted, which the loop must verify
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _draft_head(self, model: Any) -> torch.nn.Linear | None:
        """The verifier's head rows of the draft vocabulary, as a linear layer in the drafter's dtype (a bfloat16
        verifier's rows times a handful of float32 hidden states ran 5x slower in bfloat16 on this CPU: 6.7 ms a
        block against 1.3; docs/results.md), int8 beside an int8 drafter; None: the verifier's whole head."""
        if self.draft_vocab is None:
            return None
        rows = self.head.weight[self.draft_vocab].detach()
        head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=self.head.bias is not None, device=self.device,
                               dtype=self.model.dtype)
        with torch.no_grad():
            head.weight.copy_(rows)
            if self.head.bias is not None:
                head.bias.copy_(self.head.bias[self.draft_vocab])
        head.requires_grad_(False)
        return int8_linears(head) if is_int8(model) else head

    def _decode_pass(self, model: Any) -> torch.nn.Module:
        """The model's context and forward as one call per block with fused linears (:class:`DecodePass`: 15 matrix
        products a block instead of 29 for three layers), int8 beside an int8 drafter."""
        fast = DecodePass(model).eval()
        if is_int8(model):
            int8_linears(fast)  # the fused layers (the shared ones are int8 already)
        return fast

    def bind(self, verifier: Any) -> None:
        """Read the features ``verifier`` records (its ``record`` must be on the drafter's layers)."""
        self.verifier = verifier
        self.reset()

    def reset(self) -> None:
        self.context = ContextCache()  # every layer's keys and values of the context

    def needs_features(self, prefix_length: int) -> bool:
        """Whether the verifier has yet to run the prefix (but its last token): no block can be drafted before."""
        features = None if self.verifier is None else self.verifier.features
        return features is None or features.shape[0] < prefix_length - 1

    def _new_context(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The verifier's features (1, C, F) and positions (1, C) the context lacks for positions 0..length-1
        (None: none), after cropping a longer context (a rolled-back or new sequence) to ``length``."""
        cached = self.context.length = min(self.context.length, length)
        if cached == length:
            return None, None
        rows = self.verifier.features[cached:length].to(self.model.dtype)[None]
        return rows, torch.arange(cached, length, device=self.device)[None]

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (1, n, V) of hidden states (1, n, H) through the verifier's head (its draft vocabulary's
        rows only, -inf for the other tokens)."""
        if self.draft_vocab is None:
            return self.head(hidden.to(self.head.weight.dtype))[..., :self.vocab_size].float().log_softmax(-1)
        small = self.draft_head(hidden.to(self.model.dtype)).float().log_softmax(-1)
        full = torch.full((*small.shape[:-1], self.vocab_size), -torch.inf, device=small.device)
        return full.scatter_(-1, self.draft_vocab.expand(*small.shape[:-1], -1), small)

    @torch.no_grad()
    def marginals(self, prefix: torch.Tensor, gamma: int, steps: int = 1, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Log-probabilities (1, γ, V) of the γ positions after ``prefix`` (1, L), at temperature 1.

        T = ``steps`` passes fill the block left to right (:func:`align.dflash.batch.chunks`): pass c drafts its
        share of the positions, the rows before it holding the tokens drafted so far (argmax at ``temperature``
        0, else a sample at that temperature). With T > 1 the draft is kept in ``self.draft`` (1, γ) and the loop
        verifies it: row j is the distribution token j was drawn from, given the draft before it.
        """
        if steps < 1:
            raise AlignError(f"steps (T) must be a positive number of drafter passes, got {steps}")
        if prefix.shape[0] != 1:
            raise AlignError("the dflash drafter decodes one sequence at a time (batch 1)")
        length = prefix.shape[1]
        if self.needs_features(length):
            raise AlignError("the verifier has not run this prefix yet: decode through align.speculative, which "
                             "records the verifier's features and runs the prompt before the first block")
        features, feature_positions = self._new_context(length - 1)
        ids = torch.cat([prefix[0, -1:], torch.full((gamma,), self.mask_token_id, device=prefix.device)])
        positions = torch.arange(length - 1, length + gamma, device=self.device)[None]
        rows = []
        for lo, hi in chunks(gamma, steps):
            embeds = self.embed(ids[None]).to(self.model.dtype)
            hidden = self.decode_pass(features, feature_positions, embeds, positions, self.context)[:, 1 + lo:1 + hi]
            features = None
            rows.append(self._rows(hidden))
            if steps > 1:  # the rows after these read the tokens drafted here
                chunk = rows[-1][0]
                ids[1 + lo:1 + hi] = chunk.argmax(-1) if temperature <= 0 else torch.multinomial(
                    (chunk / temperature).softmax(-1), 1, generator=generator)[:, 0]
        self.draft = ids[None, 1:].clone() if steps > 1 else None
        return torch.cat(rows, 1)


def verifier_fingerprint(model: Any) -> str:
    """A fingerprint of a verifier's weights: SHA-256 over every tensor's name, shape and a fixed sample of its
    values (4,096 evenly spaced, rounded to bfloat16, so the same weights in float32 or bfloat16 agree). Two checkpoints of one architecture that differ anywhere but in a few
    isolated weights get different fingerprints; it reads a few MB whatever the model's size."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].to(torch.bfloat16).float().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def check_verifier(path: str | Path, verifier_model: Any, verifier_name: str, meta: dict | None = None) -> None:
    """Refuse a verifier other than the one a dflash drafter was trained to read (its meta.json says which; ``meta``:
    that file's contents, when already read)."""
    if meta is None:
        meta_file = Path(path) / "meta.json"
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    expected = meta.get("verifier_fingerprint")
    if expected is None:
        return  # a base drafter, never trained against any verifier
    found = verifier_fingerprint(verifier_model)
    if found != expected:
        raise AlignError(f"the dflash drafter {path} reads the hidden states of the verifier {meta.get('verifier')} "
                         f"(fingerprint {expected}), but {verifier_name} is another model (fingerprint {found}); "
                         "pass the verifier it was trained with, or train a drafter for this one")


def build(model: Any, source: Any) -> DFlashDrafter:
    """A :class:`DFlashDrafter` around a loaded feature-conditioned model, for the verifier model it reads
    (``source.verifier_model``), refused unless it was trained on that verifier and is as wide as it."""
    from align.features import check_layers

    verifier_model = source.verifier_model
    if verifier_model is None:
        raise AlignError(f"the dflash drafter {source.name} drafts from the verifier's hidden states: it needs the "
                         "verifier model itself")
    check_verifier(source.folder, verifier_model, source.verifier_name, source.meta)
    check_layers(verifier_model, model.config.target_layer_ids)
    width = verifier_model.config.get_text_config().hidden_size
    if (model.config.target_hidden_size or model.config.hidden_size) != width or model.config.hidden_size != width:
        raise AlignError(f"the dflash drafter {source.name} is {model.config.hidden_size} wide and reads features "
                         f"{model.config.target_hidden_size} wide, but the verifier is {width} wide: it shares the "
                         "verifier's embeddings and head, so both must be the verifier's width")
    return DFlashDrafter(model, verifier_model, source.vocab)
