"""What each kind of drafter is, in one record: every other module reads these traits instead of comparing names.

| family | drafter | canvas | prefix pass | trained by |
|---|---|---|---|---|
| ``diffusiongemma`` | DiffusionGemma block diffusion (``align.drafters.diffusion``) | uniform random tokens | causal encoder, cached | ``align/train.py``, packed |
| ``mdlm`` | any bidirectional masked LM | ``[MASK]``, same position | re-read every block | ``align/train.py``, per window |
| ``dream`` | Dream, DiffuCoder (position i predicts i + 1) | ``[MASK]``, shifted | re-read every block | ``align/train.py``, per window |
| ``dflash`` | a few layers over the verifier's hidden states (``align.drafters.dflash``) | ``[MASK]`` rows | the verifier's own passes | ``align/train.py``, every window of a rollout at once |
| ``ar`` | a causal LM, one token at a time (``align.drafters.ar``) | none | its own KV cache | ``python -m align.baseline train`` |

A new kind of drafter is its class (one file in ``align/drafters/``) and one record here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    name: str
    #: the canvas is [MASK] tokens (False: uniform random tokens, or no canvas)
    masked: bool = False
    #: the prefix pass is causal: every window of a rollout can share it (packing), and it predicts the next token
    causal_prefix: bool = False
    #: its denoising passes read the previous pass's logits (self-conditioning)
    self_conditioning: bool = False
    #: drafts from the verifier's hidden states: the verifier runs (or its features are cached) at every training batch
    reads_features: bool = False
    #: ships its own modelling code (``trust_remote_code``)
    remote_code: bool = False
    #: drafts one token at a time on its own cache (a causal LM: standard speculative decoding)
    autoregressive: bool = False
    #: a diffusion drafter that ``align/train.py`` aligns (``drafter.family`` of a recipe)
    trained_here: bool = True
    #: what a folder's config says when it holds this family (its ``architectures`` entry or ``model_type``): how a
    #: folder's family is detected, and how a model of another family is refused
    architecture: str | None = None
    model_type: str | None = None
    #: the class its weights load into, ``module:name`` (a function of the config that returns the class also serves)
    model_class: str = "transformers:AutoModel"


FAMILIES: dict[str, Traits] = {t.name: t for t in (
    Traits("diffusiongemma", causal_prefix=True, self_conditioning=True, model_type="diffusion_gemma",
           model_class="align.models.diffusiongemma:drafter_class"),
    Traits("mdlm", masked=True, model_class="transformers:AutoModelForMaskedLM"),
    Traits("dream", masked=True, remote_code=True),
    Traits("dflash", masked=True, reads_features=True, architecture="DFlashDraftModel",
           model_class="align.models.dflash:DFlashDraftModel"),
    Traits("ar", autoregressive=True, trained_here=False, model_class="transformers:AutoModelForCausalLM"),
)}

#: the families a recipe's ``drafter.family`` may name
TRAINED = tuple(name for name, t in FAMILIES.items() if t.trained_here)
#: what drafts a block's first token: the canvas, or (a causal prefix pass) the encoder's next-token prediction
FIRST_TOKEN = ("canvas", "encoder")


def traits(family: str) -> Traits:
    """The record of ``family``, or one error naming the families there are."""
    from align.errors import AlignError

    if family not in FAMILIES:
        raise AlignError(f"unknown drafter family '{family}'; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[family]
