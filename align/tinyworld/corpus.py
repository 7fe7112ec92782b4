"""Write the tiny world to disk: train documents, train prompts, held-out test prompts and the probe suite.

Files (JSONL, one object per line):

- ``train_docs.jsonl``: ``{"id", "prompt", "response", "category", "kind", "nats"}`` (``nats``: the response's
  entropy given its prompt, from the generator's own choices);
- ``train_prompts.jsonl``: the distinct prompts of the train documents, ``{"id", "prompt", "category", "kind"}``;
- ``test_prompts.jsonl``: held-out prompts never seen in training, with one reference response each;
- ``probe.jsonl``: eight prompts, one per category of the published probe, worded as in that probe.

Everything is a pure function of the seed.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from align.tinyworld.categories import KINDS, PROBE, Chooser

FILES = ("train_docs.jsonl", "train_prompts.jsonl", "test_prompts.jsonl", "probe.jsonl")

#: documents per kind, relative to ``docs_per_kind``: more facts to memorise, fewer poems (noise by design)
SHARE = {"facts": 1.5, "poem": 0.5}


def sample_doc(kind: str, rng: random.Random, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """One document of ``kind``: prompt, response, probe category and the response's entropy in nats."""
    category, generate = KINDS[kind]
    chooser = Chooser(rng, fixed)
    prompt, response = generate(chooser)
    return {"prompt": prompt, "response": response, "category": category, "kind": kind, "nats": chooser.nats}


def probe_docs(seed: int = 0) -> list[dict[str, Any]]:
    """The probe suite: one fixed prompt per probe category (the reference response is drawn with ``seed``)."""
    docs = []
    for probe_id, kind, fixed in PROBE:
        doc = sample_doc(kind, random.Random(f"{seed}/probe/{probe_id}"), fixed)
        docs.append({"id": probe_id, **doc})
    return docs


def build_world(docs_per_kind: int = 3000, test_per_kind: int = 25, seed: int = 0) -> dict[str, list[dict]]:
    """Sample the whole world: held-out test prompts first, then train documents that never use them."""
    probe = probe_docs(seed)
    reserved = {d["prompt"] for d in probe}
    splits: dict[str, list[dict]] = {"train_docs": [], "train_prompts": [], "test_prompts": [], "probe": probe}
    for kind in KINDS:
        # a kind with few distinct prompts keeps at least four fifths of them for training
        space = {sample_doc(kind, random.Random(f"{seed}/{kind}/space/{i}"))["prompt"] for i in range(2000)}
        n_test = min(test_per_kind, len(space) // 5)
        rng = random.Random(f"{seed}/{kind}/test")
        test: dict[str, dict] = {}
        for _ in range(100 * max(n_test, 1)):
            if len(test) >= n_test:
                break
            doc = sample_doc(kind, rng)
            if doc["prompt"] not in reserved and doc["prompt"] not in test:
                test[doc["prompt"]] = doc
        reserved |= set(test)
        splits["test_prompts"] += [{"id": f"test-{kind}-{i}", "prompt": d["prompt"], "category": d["category"],
                                    "kind": kind, "reference": d["response"], "nats": d["nats"]}
                                   for i, d in enumerate(test.values())]
        rng = random.Random(f"{seed}/{kind}/train")
        docs: list[dict] = []
        while len(docs) < int(docs_per_kind * SHARE.get(kind, 1.0)):
            doc = sample_doc(kind, rng)
            if doc["prompt"] not in reserved:
                docs.append({"id": f"train-{kind}-{len(docs)}", **doc})
        splits["train_docs"] += docs
        seen: dict[str, dict] = {}
        for d in docs:
            seen.setdefault(d["prompt"], {"id": f"prompt-{kind}-{len(seen)}", "prompt": d["prompt"],
                                          "category": d["category"], "kind": kind})
        splits["train_prompts"] += list(seen.values())
    # any prefix of the files is a balanced sample: documents shuffled, prompts dealt round-robin by kind
    random.Random(f"{seed}/train_docs/order").shuffle(splits["train_docs"])
    for name in ("train_prompts", "test_prompts"):
        by_kind: dict[str, list[dict]] = defaultdict(list)
        for p in splits[name]:
            by_kind[p["kind"]].append(p)
        for kind, rows in by_kind.items():
            random.Random(f"{seed}/{kind}/{name}-order").shuffle(rows)
        splits[name] = [row for group in itertools.zip_longest(*by_kind.values()) for row in group if row]
    return splits


def write_world(out_dir: str | Path, docs_per_kind: int = 3000, test_per_kind: int = 25, seed: int = 0) -> Path:
    """Build the world and write its four JSONL files into ``out_dir`` (atomically: all or nothing)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    splits = build_world(docs_per_kind, test_per_kind, seed)
    for name, rows in splits.items():
        with open(tmp / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    (tmp / "world.json").write_text(json.dumps({"seed": seed, "docs_per_kind": docs_per_kind,
                                                "test_per_kind": test_per_kind, **summarize(splits)}, indent=1))
    tmp.rename(out)
    return out


def summarize(splits: dict[str, list[dict]]) -> dict[str, Any]:
    """Counts per split and category."""
    return {name: dict(Counter(r["category"] for r in rows)) for name, rows in splits.items()}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def entropy_table(docs: list[dict[str, Any]], count_tokens) -> dict[str, dict[str, float]]:
    """Per category: mean response length in tokens and the design entropy in nats per response token."""
    nats: dict[str, float] = defaultdict(float)
    tokens: dict[str, int] = defaultdict(int)
    n: dict[str, int] = defaultdict(int)
    for d in docs:
        nats[d["category"]] += d["nats"]
        tokens[d["category"]] += count_tokens(d["response"])
        n[d["category"]] += 1
    return {c: {"docs": n[c], "mean_tokens": tokens[c] / n[c], "nats_per_token": nats[c] / tokens[c]} for c in n}
