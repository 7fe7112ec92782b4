"""The tiny world: deterministic, disjoint splits, designed entropies, and a tokenizer that round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align.prompts import encode_prompt
from align.tinyworld.categories import KINDS
from align.tinyworld.corpus import build_world, entropy_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world():
    return build_world(docs_per_kind=60, test_per_kind=8, seed=0)


def test_same_seed_same_world_other_seed_other_world(world):
    assert build_world(docs_per_kind=60, test_per_kind=8, seed=0) == world
    other = build_world(docs_per_kind=60, test_per_kind=8, seed=1)
    assert [d["response"] for d in other["train_docs"]] != [d["response"] for d in world["train_docs"]]


def test_splits_are_disjoint(world):
    train = {d["prompt"] for d in world["train_docs"]}
    test = {d["prompt"] for d in world["test_prompts"]}
    probe = {d["prompt"] for d in world["probe"]}
    assert test and probe and not (train & test) and not (train & probe) and not (test & probe)
    assert {d["prompt"] for d in world["train_prompts"]} == train


def test_every_kind_and_category_is_present(world):
    assert {d["kind"] for d in world["train_docs"]} == set(KINDS)
    assert {d["category"] for d in world["test_prompts"]} == {c for c, _ in KINDS.values()}


def test_the_worlds_probe_has_eight_prompts_of_the_probes_kinds(world):
    assert len(world["probe"]) == 8 and len({p["prompt"] for p in world["probe"]}) == 8
    assert {p["category"] for p in world["probe"]} <= {c for c, _ in KINDS.values()}


def test_probe_suite_mirrors_the_published_probe(world):
    probe8 = ROOT.parent / "shared" / "data" / "probe8.jsonl"
    if not probe8.is_file():
        pytest.skip("../shared/data/probe8.jsonl is not here")
    published = [json.loads(line) for line in probe8.read_text().splitlines() if line.strip()]
    assert [(p["prompt"], p["category"]) for p in world["probe"]] == [(p["prompt"], p["category"]) for p in published]


def test_design_entropy_orders_as_intended(world):
    table = entropy_table(world["train_docs"], lambda text: len(text.split()))
    nats = {c: v["nats_per_token"] for c, v in table.items()}
    assert nats["formulaic"] == 0.0 and nats["factual"] == 0.0
    assert max(nats["formulaic"], nats["factual"], nats["reasoning"]) < min(nats["open"], nats["creative"])
    assert nats["creative"] == max(nats.values())


def test_the_answer_depends_on_the_prompt(world):
    facts = [d for d in world["train_docs"] if d["kind"] == "facts"]
    by_prompt = {}
    for d in facts:
        by_prompt.setdefault(d["prompt"], set()).add(d["response"])
    assert all(len(responses) == 1 for responses in by_prompt.values())  # determined by the prompt...
    by_country = {}
    for d in facts:
        country = d["response"].split("Facts about ")[1].split(":")[0]
        assert country in d["prompt"]
        by_country.setdefault(country, set()).add(d["response"][d["response"].index("Facts about"):])
    tables = [t for ts in by_country.values() for t in ts]
    assert len(set(tables)) == len(tables) == len(by_country)  # ...and each country has its own answer
    summaries = [d for d in world["train_docs"] if d["kind"] == "summary"]
    assert all(d["prompt"].split()[-3] in d["response"] or d["prompt"].split()[-1] in d["response"]
               for d in summaries)  # names in the prompt appear in the answer


def test_tokenizer_round_trips_and_has_the_special_tokens(world, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.mask_token_id) == (0, 1, 2, 3)
    assert len(tok) <= 512
    for doc in world["train_docs"][:200] + world["probe"]:
        for text in (doc["prompt"], doc["response"]):
            assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    ids = encode_prompt(tok, "The capital of France is")
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("<|assistant|>\n")
