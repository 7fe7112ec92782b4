"""Where things live: the cache the toolkit fills (``$ALIGN_CACHE``), the shared data it reads (``$ALIGN_DATA``), the
downloaded packages the real models' adaptation text comes from (``$ALIGN_PACKAGES``), and the built zoo models that
``zoo:NAME`` paths name (:func:`model_path`: the one place a zoo name becomes a folder; building is the zoo's, above
everything that loads). Below every other module: it imports nothing of align but its error class."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache: the zoo, the tiny world, rollouts, locks (``$ALIGN_CACHE``, default ``~/.cache/align``)."""
    return Path(os.environ.get("ALIGN_CACHE", Path.home() / ".cache" / "align")).expanduser()


def data_dir() -> Path:
    """The shared data folder (the probe's prompts, Spec-Bench's questions): ``$ALIGN_DATA``, default
    ``../shared/data`` beside the project."""
    return Path(os.environ.get("ALIGN_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def packages_dir() -> Path:
    """Where ``make real-install`` downloads the packages the real models' adaptation text comes from."""
    return Path(os.environ.get("ALIGN_PACKAGES", cache_dir() / "packages")).expanduser()


def zoo_folder(name: str) -> Path:
    """Where the zoo model ``name`` lives once built (``python -m align.zoo build NAME``)."""
    return cache_dir() / "zoo" / name


def zoo_built(name: str) -> bool:
    """Whether the zoo model ``name`` is built: its folder holds ``zoo.json``, written last."""
    return (zoo_folder(name) / "zoo.json").is_file()


def model_path(path: str) -> str:
    """A model path as the loaders take it: ``zoo:NAME`` becomes the folder of that built zoo model; folders and hub
    names pass through. Nothing is built here: the commands build the zoo models they name (``align.zoo.resolve``)
    before loading them, so a name that is not built yet is one line naming the command that builds it."""
    if not path.startswith("zoo:"):
        return path
    name = path[len("zoo:"):]
    if not zoo_built(name):
        from align.errors import AlignError

        raise AlignError(f"the zoo model {path} is not built (no {zoo_folder(name) / 'zoo.json'}); build it first: "
                         f"python -m align.zoo build {name}")
    return str(zoo_folder(name))
