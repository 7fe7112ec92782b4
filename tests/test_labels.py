"""Labelled text (align/labels.py): fixed text read by the verifier in one pass, whose windows learn exactly the
verifier's greedy continuation — checked against generation itself — and trained on beside the rollouts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from align.dflash.batch import window_labels
from align.errors import AlignError
from conftest import VOCAB, tiny_verifier
from test_train import overrides, run_main


def test_a_window_learns_the_verifiers_continuation_as_far_as_the_text_agrees():
    row = {"response_ids": [5, 6, 7, 8, 9], "label_ids": [5, 6, 2, 8, 3]}  # the verifier leaves the text at 2 and 3
    assert window_labels(row, 0, 4) == [5, 6, 2]  # 5 and 6 agree; 2 is its token where the text says 7: then unknown
    assert window_labels(row, 2, 4) == [2]
    assert window_labels(row, 3, 4) == [8, 3]
    assert window_labels(row, 0, 4, "text") == [5, 6, 7, 8]
    assert window_labels({"response_ids": [5, 6, 7]}, 1, 4) == [6, 7]  # a rollout: its own tokens


def test_the_labels_are_exactly_the_verifiers_greedy_continuation():
    """For random text and every offset, the window's labels are what generate (greedy) continues ``prompt ‖
    response[:t]`` with — the property that makes text without generation exact data."""
    from align.labels import Labeller
    from align.verifier import ar_generate

    model = tiny_verifier(0, dtype=torch.float32)
    labeller = Labeller.__new__(Labeller)
    labeller.model = model
    rng = random.Random(0)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(3)]
    responses = []
    for prompt in prompts:  # text that follows the verifier for a while, then not: both cases occur
        greedy = ar_generate(model, prompt, 12, eos_token_ids=[])
        responses.append([t if rng.random() < 0.7 else rng.randrange(4, VOCAB) for t in greedy])
    labels = labeller.label(prompts, responses)
    lengths = []
    for prompt, response, label in zip(prompts, responses, labels):
        row = {"response_ids": response, "label_ids": label}
        for t in range(len(response)):
            window = window_labels(row, t, 6)
            assert window == ar_generate(model, prompt + response[:t], len(window), eos_token_ids=[]), (prompt, t)
            lengths.append(len(window))
    assert min(lengths) >= 1 and max(lengths) >= 3  # some windows stop at once, some run on


def test_labelled_text_is_made_in_chunks_and_trains_a_dflash_drafter_beside_the_rollouts(model_dirs, world_prompts,
                                                                                         tmp_path):
    """From a JSONL of text: the labelled rows (resumed from their chunks, not made twice), then a few training
    steps with them; the held-out windows stay the rollouts' and the run's data fingerprint names the text."""
    from align.config import load_recipe
    from align.labels import generate_labels, labels_dir

    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Tell me about item {i}.",
                                          "response": "the capital of the kingdom is a city by the river " * (1 + i % 3)})
                              + "\n" for i in range(10)))
    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, "dflash", **{"data.text": source, "data.text_rows": 9,
                                                                  "data.text_tokens": 20, "train.max_steps": 2})
    recipe = load_recipe("recipes/tiny.yaml", args)
    made = generate_labels(recipe)
    assert len(made) == 9 and set(made.column_names) >= {"prompt_ids", "response_ids", "label_ids"}
    assert all(len(r) == len(y) <= 20 for r, y in zip(made["response_ids"], made["label_ids"]))
    chunks = sorted((labels_dir(recipe) / "chunks").iterdir())
    assert len(chunks) == 2  # data.batch_size 8: two chunks, each renamed into place whole
    assert len(generate_labels(load_recipe("recipes/tiny.yaml", [*args, "data.text_rows=4"]))) == 4  # a prefix
    stamp = chunks[0].stat().st_mtime
    assert generate_labels(recipe)["label_ids"] == made["label_ids"] and chunks[0].stat().st_mtime == stamp
    assert run_main(args) == 0
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert meta["data_fingerprint"]["text"]["rows"] == 9
    assert meta["data_fingerprint"]["windows"] > 16 * 20  # the rollouts' windows and the text's


def test_a_bad_text_source_is_one_line_before_anything_is_built(model_dirs, world_prompts, tmp_path):
    from align.config import RecipeError, load_recipe
    from align.labels import text_rows

    with pytest.raises(AlignError, match="neither 'english'"):
        run_main(overrides(model_dirs, world_prompts, tmp_path / "a", "dflash", **{"data.text": tmp_path / "none"}))
    assert not (tmp_path / "a").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "p", "response": "r"}\n{"id": 2, "prompt": "p"}\n')
    with pytest.raises(AlignError, match="bad.jsonl:2"):
        text_rows(str(bad), None)
    with pytest.raises(RecipeError, match="a mdlm drafter reads none"):
        load_recipe("recipes/tiny.yaml", overrides(model_dirs, world_prompts, tmp_path, "mdlm",
                                                   **{"data.text": bad}))
