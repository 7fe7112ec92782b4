"""Whether a text answers a tiny-world prompt correctly: the world's facts are known, so content can be checked.

One check per kind of document (``align/tinyworld/categories.py``), against the prompt's reference answer:

| kind | correct when |
|---|---|
| translation, facts | the text is the reference (the answer is determined by the prompt: 0 nats) |
| arithmetic | its final number is the reference's |
| json | it parses as JSON whose list has the reference's length and whose ``count`` says so |
| code | it compiles and defines the reference's function |
| summary | it names everyone the prompt names |
| poem | it has as many lines as the reference |
| explanation | nothing to check (None): any of its answers is right |

Used to measure what relaxed verification costs (``align/relaxed.py``): the share of outputs still correct, per
category, against the verifier alone's on the same prompts.
"""

from __future__ import annotations

import json
import re


def correct(row: dict, text: str) -> bool | None:
    """Whether ``text`` answers the tiny-world prompt ``row`` ({"prompt", "kind", "reference"}) correctly; None where
    nothing can be checked (a kind without a determined content, or a prompt from elsewhere)."""
    kind, reference, text = row.get("kind"), row.get("reference"), text.strip()
    if kind is None or reference is None:
        return None
    if kind in ("translation", "facts"):
        return text == reference.strip()
    if kind == "arithmetic":
        mine, theirs = re.findall(r"-?\d+", text), re.findall(r"-?\d+", reference)
        return bool(mine) and mine[-1] == theirs[-1]
    if kind == "json":
        try:
            found, expected = json.loads(text), json.loads(reference)
        except (json.JSONDecodeError, ValueError):
            return False
        lists = [v for v in found.values() if isinstance(v, list)] if isinstance(found, dict) else []
        size = expected["count"]
        return bool(lists) and len(lists[0]) == size and found.get("count") == size
    if kind == "code":
        name = re.search(r"def (\w+)", reference).group(1)
        try:
            compile(text, "<output>", "exec")
        except (SyntaxError, ValueError):
            return False
        return re.search(rf"def {re.escape(name)}\(", text) is not None
    if kind == "summary":
        names = re.findall(r"\b[A-Z][a-z]+\b", row["prompt"].replace("Give", ""))
        return all(n in text for n in names)
    if kind == "poem":
        return len([line for line in text.splitlines() if line.strip()]) == len(reference.strip().splitlines())
    return None
