"""The tiny zoo: a world, a tokenizer, a verifier and two drafters, built here from nothing and cached.

Recipes name zoo models as ``zoo:NAME``; :func:`resolve` turns that into a folder, building what is missing.
The cache is ``$ALIGN_CACHE`` (default ``~/.cache/align``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from align.errors import AlignError

#: zoo name -> what it is (the build order follows this order)
MODELS = {
    "tiny-verifier": "causal Llama verifier (4.5M parameters)",
    "tiny-diffusiongemma": "DiffusionGemmaForBlockDiffusion drafter, uniform-noise canvas (1.4M parameters)",
    "tiny-mdlm": "BERT masked-diffusion drafter, same-position logits (0.9M parameters)",
    # random-weight replicas of the shipped recipes' models, shrunk (align/zoo/replicas.py); not built by default
    "replica-gemma4-verifier": "Gemma4ForConditionalGeneration replica of gemma-4-26B-A4B-it (random weights)",
    "replica-diffusiongemma": "DiffusionGemmaForBlockDiffusion replica of diffusiongemma-26B-A4B-it (random weights)",
    "replica-qwen2.5-verifier": "Qwen2ForCausalLM replica of Qwen2.5-7B-Instruct (random weights)",
    "replica-diffucoder": "Dream-style replica of DiffuCoder-7B-Instruct, remote code (random weights)",
}
#: what `python -m align.zoo build` builds when no name is given
DEFAULT_BUILD = ("tiny-verifier", "tiny-diffusiongemma", "tiny-mdlm")


def cache_dir() -> Path:
    return Path(os.environ.get("ALIGN_CACHE", Path.home() / ".cache" / "align")).expanduser()


def world_dir() -> Path:
    return cache_dir() / "tinyworld"


def model_dir(name: str) -> Path:
    return cache_dir() / "zoo" / name


def is_built(name: str) -> bool:
    return (model_dir(name) / "zoo.json").is_file()


def resolve(path: str) -> str:
    """A model path from a recipe: ``zoo:NAME`` becomes its folder (built first if missing); others pass through."""
    if not path.startswith("zoo:"):
        return path
    name = path[len("zoo:"):]
    if name not in MODELS:
        raise AlignError(f"unknown zoo model '{name}'; the tiny zoo has: {', '.join(MODELS)}")
    if not is_built(name) and _launched_rank() > 0:  # save_pretrained writes no weights on these: rank 0 builds
        print(f"zoo:{name} is not built yet: waiting for rank 0 to build it into {model_dir(name)}", flush=True)
        while not is_built(name):
            time.sleep(2.0)
    if not is_built(name):  # build() takes the cache's lock and builds only what is still missing then
        from align.zoo.build import build

        print(f"zoo:{name} is not built yet: building it into {model_dir(name)}", flush=True)
        build([name])
    return str(model_dir(name))


def _launched_rank() -> int:
    """This process's rank in a multi-process launch (deepspeed, torchrun), else 0."""
    try:
        return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    except ValueError:
        return 0
