"""Where things live: the cache the toolkit fills (``$ALIGN_CACHE``), the shared data it reads (``$ALIGN_DATA``) and
the downloaded packages the real models' adaptation text comes from (``$ALIGN_PACKAGES``). Below every other module:
it imports nothing of align."""

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
