"""Prompt suites for the acceptance evaluation; each is a list of ``{"id", "prompt", "category"}``.

| suite             | prompts                                                                                  |
|-------------------|------------------------------------------------------------------------------------------|
| ``tinyworld``       | the tiny world's held-out prompts (never seen in pretraining or rollouts)                |
| ``tinyworld-probe`` | eight tiny-world prompts worded as the published probe's, one per probe category         |
| ``probe8``          | the published probe's eight prompts (``probe8.jsonl``): for real model pairs             |
| ``specbench``       | Spec-Bench's 480 questions (``spec_bench/question.jsonl``), first turn, with categories  |

``probe8`` and ``specbench`` are read from ``$ALIGN_DATA`` (default: ``../shared/data`` beside the project).
"""

from __future__ import annotations

from typing import Any

from align.errors import AlignError
from align.prompts import data_file, read_prompt_file, read_specbench
from align.zoo import load_prompts

SUITES = ("tinyworld", "tinyworld-probe", "probe8", "specbench")


def load_suite(name: str) -> list[dict[str, Any]]:
    """The prompts of suite ``name``."""
    if name == "tinyworld":
        return load_prompts("tinyworld:test")
    if name == "tinyworld-probe":
        return load_prompts("tinyworld:probe")
    if name == "probe8":
        return read_prompt_file(data_file("probe8.jsonl", f"suite {name}"))
    if name == "specbench":
        return read_specbench(data_file("spec_bench/question.jsonl", f"suite {name}"))
    raise AlignError(f"unknown suite '{name}'; choose one of {', '.join(SUITES)} or pass --prompts FILE.jsonl")
