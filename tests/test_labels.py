"""Labelled text (align/labels.py): fixed text read by the verifier in one pass, whose windows learn exactly the
verifier's greedy continuation — checked against generation itself — and trained on beside the rollouts."""

from __future__ import annotations

import json
import random
from pathlib import Path

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


def test_the_labelling_pass_keeps_the_texts_features_and_the_feature_cache_copies_them(model_dirs, world_prompts,
                                                                                        tmp_path):
    """With data.feature_cache, labelling keeps each row's features at the drafter's layers — the verifier's own
    features of prompt ‖ response — and the cache copies them instead of running the text again (a marker written
    into one chunk's features turns up in the cache; the other chunk's equal the verifier's)."""
    from align.config import load_recipe
    from align.dflash.cache import FeatureCache
    from align.features import FeatureTap
    from align.labels import Labeller, features_dir, feature_layers, generate_labels, text_features
    from align.paths import cache_dir

    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Say something about item {i}.",
                                          "response": "a river runs by the city and the city sleeps " * (1 + i % 2)})
                              + "\n" for i in range(10)))
    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, "dflash", **{
        "data.text": source, "data.text_rows": 9, "data.text_tokens": 16, "data.feature_cache": "true",
        "train.max_steps": 1, "distill.objective": "streak_ce"})
    recipe = load_recipe("recipes/tiny.yaml", args)
    made = generate_labels(recipe)
    layers = feature_layers(recipe)
    assert layers == json.loads((Path(model_dirs["dflash"]) / "config.json").read_text())["dflash_config"][
        "target_layer_ids"]
    stored = text_features(recipe, layers)
    assert set(made["prompt_id"]) <= set(stored)  # the chunk of rows 8-9 is labelled whole
    verifier = Labeller(recipe, "cpu").model
    with FeatureTap(verifier, layers, stop=True) as tap:
        for row in made:
            seq = row["prompt_ids"] + row["response_ids"]
            alone = tap.run(verifier, input_ids=torch.tensor([seq]), use_cache=False)[0]
            assert stored[row["prompt_id"]].shape == alone.shape
            torch.testing.assert_close(stored[row["prompt_id"]], alone, atol=1e-5, rtol=1e-5)

    first = features_dir(recipe, layers) / "00000.pt"  # the first chunk's 8 rows: a marker
    torch.save({k: torch.full_like(v, 7.0) for k, v in torch.load(first, weights_only=True).items()}, first)
    before = set((cache_dir() / "features").glob("*/index.json"))
    assert run_main(args) == 0
    built = set((cache_dir() / "features").glob("*/index.json")) - before
    assert len(built) == 1
    cache = FeatureCache(next(iter(built)).parent.name)
    rows = len(cache.offsets) - 1  # the rollouts, then the 9 rows of text
    marked = cache.take(list(range(rows - 9, rows - 1)), 64)
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in made]
    assert all((marked[k, :n] == 7.0).all() for k, n in enumerate(lengths[:8]))
    last = cache.take([rows - 1], lengths[8])[0]
    torch.testing.assert_close(last, stored[made[8]["prompt_id"]], atol=1e-5, rtol=1e-5)
    assert not (cache.take([0], cache.offsets[1]) == 7.0).any()  # a rollout: run through the verifier


def test_a_bfloat16_store_keeps_the_texts_features_rounded_and_takes_those_kept_in_float32(model_dirs, world_prompts,
                                                                                          tmp_path):
    """data.feature_dtype: bfloat16: labelling keeps the verifier's features of each row rounded to bfloat16, in a
    folder of their own; text labelled earlier with float32 features gives those to a bfloat16 store (the cache
    rounds them as it copies) instead of being run again."""
    from align.config import load_recipe
    from align.features import FeatureTap
    from align.labels import Labeller, features_dir, feature_layers, generate_labels, text_features

    def recipe(name, *more):
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Tell me about {name} {i}.",
                                              "response": "the tide comes in and the boats rise " * (1 + i % 2)})
                                  + "\n" for i in range(6)))
        return load_recipe("recipes/tiny.yaml", overrides(model_dirs, world_prompts, tmp_path / name, "dflash", **{
            "data.text": source, "data.text_tokens": 16, "data.feature_cache": "true"}) + list(more))

    half = recipe("a", "data.feature_dtype=bfloat16")
    made, layers = generate_labels(half), feature_layers(half)
    assert features_dir(half, layers).name.endswith("-bfloat16") and list(features_dir(half, layers).glob("*.pt"))
    stored = text_features(half, layers)
    verifier = Labeller(half, "cpu").model
    with FeatureTap(verifier, layers, stop=True) as tap:
        for row in made:
            alone = tap.run(verifier, input_ids=torch.tensor([row["prompt_ids"] + row["response_ids"]]),
                            use_cache=False)[0]
            assert stored[row["prompt_id"]].dtype == torch.bfloat16
            torch.testing.assert_close(stored[row["prompt_id"]].float(), alone, rtol=2 ** -8, atol=1e-5)

    exact = recipe("b")
    generate_labels(exact)
    kept = text_features(exact, layers)
    assert {v.dtype for v in kept.values()} == {torch.float32}
    later = recipe("b", "data.feature_dtype=bfloat16")  # the same text, labelled already
    assert features_dir(later, layers) != features_dir(exact, layers)
    taken = text_features(later, layers)
    assert taken.keys() == kept.keys() and all(torch.equal(taken[k], kept[k]) for k in kept)


def test_rows_of_text_sharing_an_id_are_run_again_rather_than_given_each_others_features(monkeypatch):
    import align.labels
    from align.distill.strategy import labelled_features

    stored = {"a": torch.zeros(3, 2), "b": torch.ones(3, 2), "c": torch.ones(4, 2)}
    monkeypatch.setattr(align.labels, "text_features", lambda recipe, layers: stored)
    rows = [{"prompt_id": "a"}, {"prompt_id": "a", "label_ids": [1]}, {"prompt_id": "b", "label_ids": [1]},
            {"prompt_id": "b", "label_ids": [2]}, {"prompt_id": "c", "label_ids": [1]}, {"prompt_id": "d", "label_ids": []}]
    assert labelled_features(None, [0], rows) == {1: stored["a"], 4: stored["c"]}  # a rollout "a" is not text
    assert labelled_features(None, [0], rows[:1]) == {}


def test_labelling_on_a_full_disk_ends_in_one_line_and_a_rerun_finishes_it(model_dirs, world_prompts, tmp_path,
                                                                          monkeypatch, capsys):
    """torch.save reports a full disk as a RuntimeError of its zip writer: labelling ends with the command's one line
    on the disk (exit 2) instead of a traceback, leaves no half-written features, and a rerun labels what is
    missing."""
    from align import labels
    from align.config import load_recipe
    from align.errors import run_cli

    source = tmp_path / "text.jsonl"
    source.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Say something about item {i}.",
                                          "response": "a river runs by the city"}) + "\n" for i in range(10)))
    args = overrides(model_dirs, world_prompts, tmp_path / "run", "dflash", **{
        "data.text": source, "data.text_rows": 9, "data.text_tokens": 16, "data.feature_cache": "true"})
    real, saved = torch.save, []

    def full_disk(obj, path, *rest, **kwargs):  # the first chunk's features fit, the second's do not
        if saved:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        saved.append(path)
        return real(obj, path, *rest, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as stop:
        run_cli(labels.main, ["recipes/tiny.yaml", *args])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress bar
    assert stop.value.code == 2 and "Traceback" not in err and "enforce fail" not in err, err
    assert last.startswith("error: no room on the disk writing ") and "00001.pt (No space left on device)" in last
    recipe = load_recipe("recipes/tiny.yaml", args)
    folder = labels.features_dir(recipe, labels.feature_layers(recipe))
    assert sorted(p.name for p in folder.iterdir()) == ["00000.pt"]  # nothing half-written beside it

    monkeypatch.setattr(torch, "save", real)
    with pytest.raises(SystemExit) as stop:
        run_cli(labels.main, ["recipes/tiny.yaml", *args])
    assert stop.value.code == 0 and sorted(p.name for p in folder.iterdir()) == ["00000.pt", "00001.pt"]
    assert len(labels.text_features(recipe, labels.feature_layers(recipe))) == 10  # two whole chunks of 8
