"""The drafters, one file per kind, behind one interface (:class:`~align.drafters.base.DrafterKind`) and one loader.

| kind | file | drafts |
|---|---|---|
| ``diffusiongemma``, ``mdlm``, ``dream`` | ``diffusion.py`` | a block in T denoising steps of a diffusion model |
| ``dflash`` | ``dflash.py`` | a block in one pass of a few layers over the verifier's hidden states |
| ``ar`` | ``ar.py`` | one token at a time (standard speculative decoding) |
| ``ngram`` | ``ngram.py`` | tokens copied from the context (prompt lookup), no model; ``ngram+PATH``: lookup where the context matches, the drafter at PATH elsewhere; ``ngram@W+PATH``: the match mixed into its rows |

:func:`load_drafter` builds any of them from a folder (an export names its family in meta.json; others are detected),
for a verifier: every caller (decoding, evaluation, serving, the benchmarks) loads drafters through it. It loads the
weights as the family's record says (``align.families``), checks the vocabulary against the verifier's, and hands
the model to the kind's ``build(model, source)``. A new kind is its file here with a ``build`` function, its record
in ``align.families``, and its line in :data:`BUILDERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from align.drafters import ar, dflash, diffusion, ngram
from align.drafters.base import DrafterKind
from align.families import traits
from align.loading import export_meta, infer_family, load_drafter_model, load_tokenizer, shared_vocab_size
from align.paths import model_path

#: family -> the function that builds its drafter from the loaded model and a :class:`Source`
BUILDERS: dict[str, Callable[[Any, "Source"], DrafterKind]] = {
    "diffusiongemma": diffusion.build, "mdlm": diffusion.build, "dream": diffusion.build,
    "dflash": dflash.build, "ar": ar.build,
}


@dataclass
class Source:
    """What a kind's ``build`` reads beside the model: where it came from and the verifier it drafts for."""

    folder: str  # the drafter's local folder (a zoo name resolved)
    name: str  # the drafter as the caller named it, for messages
    family: str
    meta: dict  # its meta.json ({} when it is not an export)
    tokenizer: Any  # the drafter's tokenizer
    vocab: int  # the vocabulary shared with the verifier (every verifier token has the same id in both)
    verifier_name: str
    verifier_model: Any = None  # the loaded verifier, for kinds that share its layers (dflash)
    mask_token_id: int | None = None  # a masked family's mask token (None: the tokenizer's)


def load_drafter(path: str, verifier: str, verifier_model: Any = None, *, family: str | None = None,
                 dtype: str = "float32", device: Any = None, trust_remote_code: bool = False,
                 mask_token_id: int | None = None, verifier_tokenizer: Any = None,
                 hub_kernels: bool = False) -> DrafterKind:
    """The drafter at ``path`` (a folder, a hub name or ``zoo:NAME`` of a built zoo model) for the verifier
    ``verifier``, on ``device`` (default: the verifier model's, else the CPU); ``hub_kernels``:
    :func:`align.loading.pretrained`.

    ``family`` defaults to what the folder says (an export's meta.json, else its config); the drafter's tokenizer
    must agree with the verifier's (``verifier_tokenizer``, loaded from ``verifier`` when not given) on every
    verifier token. ``verifier_model`` is the loaded verifier, which a dflash drafter reads. ``ngram`` (or
    ``ngram:MAX``, ``ngram:MIN-MAX``) is prompt lookup, no model; ``ngram[:MIN-MAX]+PATH`` looks up first and falls
    back to PATH's drafter; ``ngram[:MIN-MAX]@W+PATH`` mixes the match into PATH's rows at weight W (``@W/S``: only a
    match after an n-gram shorter than S tokens).
    """
    if device is None:
        device = next(verifier_model.parameters()).device if verifier_model is not None else "cpu"
    if ngram.is_spec(path):
        min_ngram, max_ngram, rest, trust, sure = ngram.parse(path)
        if verifier_tokenizer is None:
            verifier_tokenizer = load_tokenizer(model_path(verifier), "verifier")
        vocab = shared_vocab_size(verifier_tokenizer, verifier_tokenizer, verifier, verifier)
        lookup = ngram.NGramDrafter(vocab, max_ngram, min_ngram, device=device)
        if rest is None:
            return lookup
        return ngram.FallbackDrafter(lookup, load_drafter(
            rest, verifier, verifier_model, family=family, dtype=dtype, device=device,
            trust_remote_code=trust_remote_code, mask_token_id=mask_token_id, verifier_tokenizer=verifier_tokenizer,
            hub_kernels=hub_kernels), trust, sure)
    folder = model_path(path)
    family = family or infer_family(folder, trust_remote_code)
    traits(family)  # an unknown family is refused by name
    if verifier_tokenizer is None:
        verifier_tokenizer = load_tokenizer(model_path(verifier), "verifier")
    model, tokenizer = load_drafter_model(folder, family, dtype, trust_remote_code, device, hub_kernels)
    vocab = shared_vocab_size(tokenizer, verifier_tokenizer, path, verifier)
    source = Source(folder, path, family, export_meta(folder), tokenizer, vocab, verifier, verifier_model,
                    mask_token_id)
    return BUILDERS[family](model, source)


def load_pair(drafter_path: str, verifier_path: str, family: str | None = None, dtype: str = "float32",
              trust_remote_code: bool = False, mask_token_id: int | None = None,
              drafter_dtype: str | None = None, device: str | None = None,
              hub_kernels: bool = False) -> tuple[DrafterKind, Any, Any]:
    """(drafter, :class:`~align.verifier.Verifier`, tokenizer) on ``device`` (default: the accelerator when
    present), the vocabulary checked."""
    from align.loading import load_verifier_model
    from align.machine import default_device
    from align.verifier import Verifier

    device = device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, dtype, device, hub_kernels=hub_kernels)
    drafter = load_drafter(drafter_path, verifier_path, verifier_model, family=family, dtype=drafter_dtype or dtype,
                           device=device, trust_remote_code=trust_remote_code, mask_token_id=mask_token_id,
                           verifier_tokenizer=tokenizer, hub_kernels=hub_kernels)
    return drafter, Verifier(verifier_model), tokenizer


def drafting_of(path: str) -> dict[str, Any]:
    """How an exported drafter drafts, as its training set it (:func:`align.drafters.diffusion.drafting` of its
    meta.json): keyword arguments of :class:`align.drafters.diffusion.Drafter`."""
    return diffusion.drafting(export_meta(path))


__all__ = ["BUILDERS", "DrafterKind", "Source", "drafting_of", "load_drafter", "load_pair"]
