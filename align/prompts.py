"""Prompts: reading prompt files and turning a prompt into the token ids a model is conditioned on.

One formatting rule everywhere (pretraining, rollouts, decoding, evaluation): a tokenizer with a chat template gets
the user turn plus the generation prompt; one without gets ``bos`` (when it has one) plus the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.errors import AlignError


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


def load_prompts(source: str) -> list[dict[str, Any]]:
    """Prompts from ``tinyworld:train`` / ``tinyworld:test`` / ``tinyworld:probe`` or a JSONL file."""
    if source.startswith("tinyworld:"):
        split = source.split(":", 1)[1]
        files = {"train": "train_prompts.jsonl", "test": "test_prompts.jsonl", "probe": "probe.jsonl"}
        if split not in files:
            raise AlignError(f"unknown tiny-world split '{split}' in '{source}'; use one of "
                             + ", ".join(f"tinyworld:{s}" for s in files))
        from align.zoo import world_dir

        path = world_dir() / files[split]
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
    return read_prompt_file(source)
