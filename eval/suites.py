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

import os
from pathlib import Path
from typing import Any

from align.errors import AlignError
from align.prompts import jsonl_lines, load_prompts, read_prompt_file

SUITES = ("tinyworld", "tinyworld-probe", "probe8", "specbench")


def data_dir() -> Path:
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return Path(os.environ.get("ALIGN_DATA", default))


def load_suite(name: str) -> list[dict[str, Any]]:
    """The prompts of suite ``name``."""
    if name == "tinyworld":
        return load_prompts("tinyworld:test")
    if name == "tinyworld-probe":
        return load_prompts("tinyworld:probe")
    if name == "probe8":
        return read_prompt_file(_data_file("probe8.jsonl", name))
    if name == "specbench":
        return read_specbench(_data_file("spec_bench/question.jsonl", name))
    raise AlignError(f"unknown suite '{name}'; choose one of {', '.join(SUITES)} or pass --prompts FILE.jsonl")


def _data_file(relative: str, suite: str) -> Path:
    path = data_dir() / relative
    if not path.is_file():
        raise AlignError(f"suite {suite} reads {path}, which is not there; set ALIGN_DATA to the folder holding "
                         f"{relative}, or pass --prompts FILE.jsonl")
    return path


def read_specbench(path: Path) -> list[dict[str, Any]]:
    """Spec-Bench's question file: ``{"question_id", "category", "turns": [...]}``; the first turn is the prompt."""
    rows = []
    for number, row in jsonl_lines(path, '{"question_id", "category", "turns": [...]}'):
        try:
            rows.append({"id": str(row["question_id"]), "prompt": row["turns"][0], "category": row["category"]})
        except (KeyError, IndexError, TypeError):
            raise AlignError(f"{path}:{number}: not a Spec-Bench question (needs question_id, category and "
                             "turns)") from None
    return rows
