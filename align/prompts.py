"""Prompts: reading prompt files and turning a prompt into the token ids a model is conditioned on (the zoo's prompt
sources, ``tinyworld:`` and ``zoo:``, are read by ``align.zoo.load_prompts``).

One formatting rule everywhere (pretraining, rollouts, decoding, evaluation): a tokenizer with a chat template gets
the user turn plus the generation prompt; one without gets ``bos`` (when it has one) plus the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.errors import AlignError
from align.paths import data_dir


def data_file(relative: str, reader: str) -> Path:
    """``data_dir() / relative``, or an error naming ``reader`` (what reads it) and ALIGN_DATA."""
    path = data_dir() / relative
    if not path.is_file():
        raise AlignError(f"{reader} reads {path}, which is not there; set ALIGN_DATA to the folder holding "
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


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt, ready for the model to continue."""
    if not text.strip():
        raise AlignError("the prompt is empty: give some text to continue")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def jsonl_lines(path: str | Path, expected: str):
    """(line number, object) for each non-empty line; invalid JSON is an error naming the line and ``expected``."""
    path = Path(path)
    if not path.is_file():
        raise AlignError(f"prompts file not found: {path}")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise AlignError(f"{path}:{number}: not UTF-8 text (byte {error.start + 1} of the line); save the file "
                                 "as UTF-8") from None
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise AlignError(f"{path}:{number}: not valid JSON ({error.msg}); each line must be {expected}") from None


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """Read ``{"id", "prompt", "category"?}`` JSONL; a malformed line is an error that names its line number."""
    path = Path(path)
    rows = []
    for number, row in jsonl_lines(path, '{"id": ..., "prompt": ..., "category": ...}'):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise AlignError(f'{path}:{number}: each line needs a non-empty "prompt" string')
        row.setdefault("id", f"{path.stem}-{number}")
        row["id"] = str(row["id"])
        row.setdefault("category", "all")
        rows.append(row)
    if not rows:
        raise AlignError(f"prompts file {path} holds no prompts")
    return rows
