"""Labelled text: fixed text the verifier reads in one prefill pass, its greedy token after every prefix kept as the
label — training data for a feature-conditioned drafter without autoregressive generation.

    python -m align.labels recipes/smollm2-dflash.yaml data.text=english data.text_rows=4000 [--shard I/N]

A rollout costs one verifier step per token; labelling text costs one pass over it (on 2 CPU cores, SmolLM2-135M:
about 2,500 tokens/s in bfloat16 against 110 generated tokens/s). Each row is a chat prompt and a response of fixed
text; the verifier runs over ``prompt ‖ response`` once and ``label_ids[t]`` is its argmax after ``prompt ‖
response[:t]`` — what it would say next there. A training window at offset t (``align.dflash.batch``) learns, at block
position j, the verifier's greedy continuation of ``prompt ‖ response[:t]``: ``label_ids[t + j]`` while the text so far
agrees with it (``response[t:t + j] == label_ids[t:t + j]``: the verifier's own continuation then runs through the
text), nothing after the first disagreement — so every label is exactly a token of the verifier's greedy output, and
every position has at least its first. ``data.text_labels: text`` trains on the text's own next tokens instead.

Sources (``data.text``): ``english`` — the zoo's English text (``align/zoo/text.py``: Python's documentation, the
GCIDE dictionary, fortunes, a Wikipedia sample), each document's opening sentence as the user's message after one
of :data:`INSTRUCTIONS` and the rest as the response, documents whose words overlap an evaluation prompt left out
(``align.zoo.magpie.OVERLAP``); or a JSONL file of ``{"id", "prompt", "response"}``. Stored like rollouts (chunks
renamed into place when whole, resumable, sharded) under ``<cache>/labels/<fingerprint>/``, in the source's order:
``data.text_rows`` takes the first rows, and a larger set extends a smaller one.

Where the recipe trains from a feature cache (``data.feature_cache``), the labelling pass also keeps the verifier's
features of every row at the layers the drafter reads (``features-<layers>/<chunk>.pt`` in the verifier's dtype;
``features-<layers>-bfloat16/`` where ``data.feature_dtype`` stores another): the cache then copies them instead of
running the text through the verifier a second time (``align.dflash.cache``). A chunk labelled without them (another
drafter's layers, an earlier run) is simply run again there.

Rows: ``prompt_id``, ``category`` (``text:<source>``), ``prompt_ids``, ``response_ids``, ``label_ids``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from align.config import Recipe, load_recipe
from align.errors import AlignError, run_cli
from align.families import traits
from align.files import save_tensors
from align.locks import exclusive
from align.machine import resolve_dtype
from align.prompts import encode_prompt
from align.rollouts import CHUNKS, META, _check_meta, _save_chunk
from align.zoo import cache_dir, check_model, resolve

#: what the user asks before a document's opening sentence (the response is the rest of the document)
INSTRUCTIONS = ("Continue this text:", "Tell me more about this:", "Explain the following, in a paragraph or two:",
                "Write the next part of this passage:", "Expand on this:")


def label_meta(recipe: Recipe) -> dict[str, Any]:
    """What determines the labelled rows (and names their folder). Not ``data.text_rows``: the rows are labelled in
    the source's order, chunk by chunk, and a run takes the first ``text_rows`` of them, so that a larger set
    extends a smaller one (a data curve labels each row once)."""
    d = recipe.data
    return {"verifier": recipe.verifier.path, "verifier_dtype": resolve_dtype(recipe.verifier.dtype), "text": d.text,
            "text_tokens": d.text_tokens, "chunk_size": d.batch_size, "seed": recipe.run.seed, "labels": "argmax"}


def labels_dir(recipe: Recipe) -> Path:
    digest = hashlib.sha256(json.dumps(label_meta(recipe), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "labels" / digest


def feature_layers(recipe: Recipe) -> list[int] | None:
    """The verifier layers whose features the recipe's training caches (``data.feature_cache`` with a drafter that
    reads them; its config's ``dflash_config.target_layer_ids``), or None: what the labelling pass keeps."""
    if not (recipe.data.feature_cache and traits(recipe.drafter.family).reads_features):
        return None
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(resolve(recipe.drafter.path))
    return list(config.get("dflash_config", {}).get("target_layer_ids", [])) or None


def feature_storage(recipe: Recipe) -> torch.dtype:
    """The dtype the labelling pass keeps the features in (``data.feature_dtype``: the verifier's, or bfloat16)."""
    from align.dflash.cache import stored_dtype

    return stored_dtype(recipe.data.feature_dtype, getattr(torch, resolve_dtype(recipe.verifier.dtype)))


def features_dir(recipe: Recipe, layers: list[int], stored: torch.dtype | None = None) -> Path:
    """Where the labelling pass keeps the features at ``layers`` in the dtype ``stored`` (None: the recipe's,
    :func:`feature_storage`): a folder of their own for a dtype other than the verifier's, so that a cache is never
    given features rounded to a dtype it does not store."""
    stored = stored or feature_storage(recipe)
    rounded = "" if stored == getattr(torch, resolve_dtype(recipe.verifier.dtype)) else "-" + str(stored).split(".")[1]
    return labels_dir(recipe) / ("features-" + "-".join(map(str, layers)) + rounded)


def text_features(recipe: Recipe, layers: list[int]) -> dict[str, torch.Tensor]:
    """The features the labelling pass kept at ``layers``, per row id (memory-mapped): (tokens of prompt ‖ response,
    len(layers) · hidden). Those kept in the verifier's own dtype serve a bfloat16 store too (rounded when the cache
    copies them, as the verifier's output is), so text labelled before ``data.feature_dtype`` changed is not run
    again."""
    verifiers = features_dir(recipe, layers, getattr(torch, resolve_dtype(recipe.verifier.dtype)))
    found: dict[str, torch.Tensor] = {}
    for folder in dict.fromkeys([verifiers, features_dir(recipe, layers)]):  # the recipe's dtype last: it wins
        for path in sorted(folder.glob("*.pt")):
            found.update(torch.load(path, mmap=True, weights_only=True))
    return found


def check_text(source: str | None) -> None:
    """A text source :func:`text_rows` can read, checked before anything is built or loaded."""
    if source is None or source == "english":
        return
    if not Path(source).is_file():
        raise AlignError(f"data.text: {source} is neither 'english' (the zoo's English text) nor a JSONL file of "
                         '{"id", "prompt", "response"}; check the path')


def text_rows(source: str, count: int | None, seed: int = 0) -> list[dict[str, str]]:
    """Up to ``count`` rows ``{"id", "prompt", "response", "category"}`` of ``source`` (see the module docstring)."""
    if source != "english":
        rows = []
        for n, line in enumerate(Path(source).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"id": str(row["id"]), "prompt": str(row["prompt"]), "response": str(row["response"]),
                             "category": str(row.get("category", "text"))})
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AlignError(f"{source}:{n}: not a JSON object with id, prompt and response; fix that line") from None
        return rows[:count]
    from align.zoo.build import english_text
    from align.zoo.magpie import evaluation_prompts, ngrams
    from align.zoo.text import read_text

    held = set().union(*(ngrams(p) for p in evaluation_prompts()))
    rng = random.Random(seed)
    rows = []
    for i, doc in enumerate(read_text(english_text())):
        if count is not None and len(rows) >= count:
            break
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", doc["text"].replace("\n", " ")) if s]
        if len(sentences) < 3 or ngrams(doc["text"]) & held:
            continue
        rows.append({"id": f"text-{i}", "prompt": f"{rng.choice(INSTRUCTIONS)} {sentences[0]}",
                     "response": " ".join(sentences[1:]), "category": f"text:{doc['source']}"})
    return rows


class Labeller:
    """The verifier (the recipe's dtype, on ``device``), reading rows of fixed text in batches: its argmax after every
    prefix of each response and, with ``layers``, its features there."""

    def __init__(self, recipe: Recipe, device: str | None = None):
        from align.loading import default_device, load_verifier_model

        self.model, self.tokenizer = load_verifier_model(resolve(recipe.verifier.path), recipe.verifier.dtype,
                                                         device or default_device(),
                                                         hub_kernels=recipe.run.hub_kernels)

    def label(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[int]]:
        return self.label_and_features(prompts, responses)[0]

    @torch.no_grad()
    def label_and_features(self, prompts: list[list[int]], responses: list[list[int]], layers: list[int] | None = None
                           ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """The labels of each row and, with ``layers``, its features (prompt ‖ response tokens, on the CPU) from the
        same pass."""
        from align.features import FeatureTap

        device = self.model.device
        seqs = [p + r for p, r in zip(prompts, responses)]
        width = max(map(len, seqs))
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):
            ids[i, :len(seq)] = torch.tensor(seq, device=device)
            mask[i, :len(seq)] = 1
        features = None
        with FeatureTap(self.model, layers) if layers else nullcontext() as tap:
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            if tap is not None:
                taken = tap.take().to("cpu")
                features = [taken[i, :len(seq)].clone() for i, seq in enumerate(seqs)]  # clone: not the batch's storage
        argmax = logits.argmax(-1).tolist()  # after each prefix
        labels = [argmax[i][len(p) - 1:len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]
        return labels, features


def generate_labels(recipe: Recipe, shard: int = 0, shards: int = 1, barrier=None, progress: bool = True,
                    device: str | None = None):
    """Label (or finish labelling) the first ``data.text_rows`` rows of ``data.text``; returns them as one dataset
    (None while other shards still work). Chunks of ``data.batch_size`` rows are renamed into place when whole: a
    killed run resumes, and a run asking for more rows labels only the chunks it lacks."""
    from datasets import concatenate_datasets, load_from_disk

    d = recipe.data
    out = labels_dir(recipe)
    meta = label_meta(recipe)
    _check_meta(out, meta)
    rows = text_rows(d.text, None, recipe.run.seed)  # read (and checked) before any write
    if not rows:
        raise AlignError(f"data.text: {d.text} gave no rows; check the source")
    wanted = len(rows) if d.text_rows is None else min(d.text_rows, len(rows))
    size = d.batch_size
    chunks = [list(range(i, min(len(rows), i + size))) for i in range(0, wanted, size)]
    (out / CHUNKS).mkdir(parents=True, exist_ok=True)
    if shard == 0 and not (out / META).is_file():
        (out / META).write_text(json.dumps(meta, indent=1))
    todo = [i for i in range(len(chunks)) if i % shards == shard and not (out / CHUNKS / f"{i:05d}").is_dir()]
    layers = feature_layers(recipe) if todo else None
    if layers:
        features_dir(recipe, layers).mkdir(exist_ok=True)
        stored = feature_storage(recipe)
    if todo:
        labeller = Labeller(recipe, device)
        tokenizer = labeller.tokenizer
        for i in tqdm(todo, desc=f"labelling text (shard {shard}/{shards})", disable=not progress, dynamic_ncols=True):
            with exclusive(out, f"chunk-{i:05d}", f"labelled-text chunk {i} in {out}"):
                if (out / CHUNKS / f"{i:05d}").is_dir():
                    continue
                part = [rows[j] for j in chunks[i]]
                prompts = [encode_prompt(tokenizer, r["prompt"]) for r in part]
                responses = [tokenizer(r["response"], add_special_tokens=False)["input_ids"][:d.text_tokens]
                             for r in part]
                labels, features = [], []
                for lo in range(0, len(part), 8):  # the pass in batches of 8 rows
                    y, f = labeller.label_and_features(prompts[lo:lo + 8], responses[lo:lo + 8], layers)
                    labels += y
                    features += f or []
                if layers:  # before the chunk: a chunk in place has its features, unless labelled without them
                    save_tensors({r["id"]: f.to(stored) for r, f in zip(part, features)},
                                 features_dir(recipe, layers) / f"{i:05d}.pt")
                _save_chunk(out / CHUNKS, i, [
                    {"prompt_id": r["id"], "category": r["category"], "prompt_ids": p, "response_ids": t,
                     "label_ids": y} for r, p, t, y in zip(part, prompts, responses, labels)])
    if barrier is not None:
        barrier()
    missing = [i for i in range(len(chunks)) if not (out / CHUNKS / f"{i:05d}").is_dir()]
    if missing:
        print(f"shard {shard}/{shards} finished; {len(missing)} labelled-text chunks are still to come")
        return None
    try:
        dataset = concatenate_datasets([load_from_disk(str(out / CHUNKS / f"{i:05d}")) for i in range(len(chunks))])
    except Exception as error:
        raise AlignError(f"the labelled text in {out} is corrupt ({str(error).splitlines()[0]}); delete the folder "
                         "and run again") from None
    return dataset.select(range(wanted)).filter(lambda r: len(r["response_ids"]) > 0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.labels", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--shard", default="0/1", help="I/N: this process labels every N-th chunk starting at I")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    args = parser.parse_args(argv)
    try:
        shard, shards = (int(x) for x in args.shard.split("/"))
        assert 0 <= shard < shards
    except (ValueError, AssertionError):
        raise AlignError(f"--shard must be I/N with 0 <= I < N, got {args.shard}") from None
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.data.text is None:
        raise AlignError("the recipe has no data.text to label: set data.text=english (or a JSONL file)")
    check_model(recipe.verifier.path, "verifier")
    check_text(recipe.data.text)
    resolve(recipe.verifier.path)
    dataset = generate_labels(recipe, shard, shards, device=args.device)
    if dataset is not None:
        tokens = sum(len(r) for r in dataset["response_ids"])
        print(f"{len(dataset)} rows of labelled text ({tokens} response tokens) in {labels_dir(recipe)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
