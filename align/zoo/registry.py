"""The zoo's registry: every zoo model's name and description, and where a built one lives in the cache."""

from __future__ import annotations

from pathlib import Path

from align.paths import cache_dir, packages_dir  # noqa: F401 (the zoo's callers find them here)
from align.paths import zoo_built as is_built, zoo_folder as model_dir  # noqa: F401 (where a built model lives)
from align.zoo.pairs import REAL_MODELS

#: zoo name -> what it is (the build order follows this order)
MODELS = {
    "tiny-verifier": "causal Llama verifier (4.5M parameters)",
    "tiny-diffusiongemma": "DiffusionGemmaForBlockDiffusion drafter, uniform-noise canvas (1.4M parameters)",
    "tiny-mdlm": "BERT masked-diffusion drafter, same-position logits (0.9M parameters)",
    "tiny-dflash": "feature-conditioned block drafter reading tiny-verifier's layers 1 and 2 (0.82M parameters)",
    # real pretrained verifiers and what is made from them (their pairs' records, align/zoo/pairs.py); not built by
    # default
    **REAL_MODELS,
    # random-weight replicas of the shipped recipes' models, shrunk (align/zoo/replicas.py); not built by default
    "replica-gemma4-verifier": "Gemma4ForConditionalGeneration replica of gemma-4-26B-A4B-it (random weights)",
    "replica-diffusiongemma": "DiffusionGemmaForBlockDiffusion replica of diffusiongemma-26B-A4B-it (random weights)",
    "replica-qwen2.5-verifier": "Qwen2ForCausalLM replica of Qwen2.5-7B-Instruct (random weights)",
    "replica-diffucoder": "Dream-style replica of DiffuCoder-7B-Instruct, remote code (random weights)",
}
#: what `python -m align.zoo build` builds when no name is given
DEFAULT_BUILD = ("tiny-verifier", "tiny-diffusiongemma", "tiny-mdlm")
#: the real models (align/zoo/pairs.py, real.py, derive.py, adapt.py): they need no tiny world
REAL = tuple(REAL_MODELS)


def world_dir() -> Path:
    return cache_dir() / "tinyworld"

