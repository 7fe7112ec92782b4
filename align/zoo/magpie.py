"""Training prompts an instruct model writes itself (Magpie): given only its chat template up to the user's turn, it
samples what a user would ask.

No prompt dataset can be downloaded here, and the evaluation prompts (the probe's eight, Spec-Bench's 480) must never
be trained on. So the real recipes' prompts come from SmolLM2-135M-Instruct itself: its chat template's system turn
and the opening of a user turn, then a sample at temperature 1 (top-p 0.95) up to its end-of-turn token. What it
writes is kept when it ended its turn within ``max_new_tokens``, has 3 to 80 words, is not a duplicate, and shares
no run of ``OVERLAP`` words with any evaluation prompt (nor equals one) — the counts of what was dropped, and why, go
into ``zoo.json``. Prompts are plain text: the Gemma 3 pair (a base model, no chat template) reads them too.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from tqdm.auto import tqdm

from align.prompts import data_file, read_prompt_file, read_specbench

OVERLAP = 8  # words in a row that an evaluation prompt and a training prompt may not share


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = OVERLAP) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i:i + n]) for i in range(max(1, len(tokens) - n + 1))}


def evaluation_prompts() -> list[str]:
    """Every prompt an evaluation reads: the probe's eight and Spec-Bench's (every turn)."""
    import json

    probe = [p["prompt"] for p in read_prompt_file(data_file("probe8.jsonl", "the prompt overlap check"))]
    path = data_file("spec_bench/question.jsonl", "the prompt overlap check")
    turns = [t for line in path.read_text().splitlines() if line.strip()
             for t in json.loads(line).get("turns", [])]
    read_specbench(path)  # the file's shape is checked as the suite checks it
    return probe + turns


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """The chat template's tokens up to where a user's message would begin."""
    marker = "\x00MAGPIE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def magpie_prompts(model: Any, tokenizer: Any, count: int, seed: int = 0, batch_size: int = 64,
                   max_new_tokens: int = 64) -> tuple[list[dict[str, str]], dict[str, int]]:
    """``count`` prompts ``model`` writes as a user would, and the counts of what was dropped."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Magpie prompts need a chat template")
    prefix = torch.tensor([user_turn_prefix(tokenizer)], device=model.device)
    end = tokenizer.eos_token_id
    held = set().union(*(ngrams(p) for p in evaluation_prompts()))
    exact = {" ".join(words(p)) for p in evaluation_prompts()}
    taken: set[str] = set()
    rows: list[dict[str, str]] = []
    dropped = {"unfinished": 0, "length": 0, "duplicate": 0, "overlaps_evaluation": 0}
    torch.manual_seed(seed)
    bar = tqdm(total=count, desc="magpie prompts", dynamic_ncols=True)
    rounds = 0
    while len(rows) < count:
        rounds += 1
        if rounds > 4 * count // batch_size + 20:
            raise RuntimeError(f"the model wrote only {len(rows)} usable prompts in {rounds} rounds: {dropped}")
        out = model.generate(prefix.expand(batch_size, -1), attention_mask=torch.ones(batch_size, prefix.shape[1],
                                                                                      dtype=torch.long,
                                                                                      device=model.device),
                             do_sample=True, temperature=1.0, top_p=0.95, max_new_tokens=max_new_tokens,
                             eos_token_id=end, pad_token_id=end)
        for row in out[:, prefix.shape[1]:].tolist():
            if end not in row:
                dropped["unfinished"] += 1
                continue
            text = tokenizer.decode(row[:row.index(end)], skip_special_tokens=True).strip()
            key = " ".join(words(text))
            if not 3 <= len(key.split()) <= 80:
                dropped["length"] += 1
            elif key in taken:
                dropped["duplicate"] += 1
            elif key in exact or ngrams(text) & held:
                dropped["overlaps_evaluation"] += 1
            elif len(rows) < count:
                taken.add(key)
                rows.append({"id": f"magpie-{len(rows)}", "prompt": text, "category": "magpie"})
                bar.update(1)
    bar.close()
    return rows, dropped
