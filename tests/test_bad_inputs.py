"""The bad-input corpus: every malformed input a user can hand a command is refused with exit status 2 and one line
on stderr that names the problem — no traceback — and no file outside the run's own folder changes.

Each case is (command, arguments, words the line must hold). The commands run in-process through ``run_cli``, as
``python -m ...`` runs them; inputs are written into a scratch folder per case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from align.errors import run_cli
from test_train import overrides


def _main(command: str):
    if command == "train":
        from conftest import train_main as main
    elif command == "rollouts":
        from align.rollouts import main
    elif command == "eval":
        from eval.acceptance import main
    elif command == "decode":
        from align.decode import main
    else:
        from align.export import main
    return main


RECIPE_TEXT = {  # recipe files (train reads them before anything else)
    "yaml-syntax": ("run:\n  name: [unclosed\n", "not valid YAML"),
    "yaml-tab-indent": ("run:\n\tname: x\n", "not valid YAML"),
    "not-a-mapping": ("- run\n- train\n", "must be a mapping of sections"),
    "section-not-mapping": ("train: 5\n", "recipe section 'train' must be a mapping"),
    "unknown-section": ("trainer:\n  lr: 1\n", "unknown recipe section 'trainer'"),
    "unknown-key": ("train:\n  learning_rate: 0.1\n", "unknown recipe key 'train.learning_rate'"),
    "binary-file": (b"\xff\xfe\x00garbage\x00", "recipe"),
}
RECIPE_OVERRIDES = {  # (overrides on top of a good recipe, words)
    "wrong-type-lr": (["train.lr=fast"], "train.lr"),
    "wrong-type-steps": (["train.max_steps=ten"], "train.max_steps"),
    "negative-steps": (["train.max_steps=-1"], "train.max_steps"),
    "zero-micro-batch": (["train.micro_batch_size=0"], "train.micro_batch_size"),
    "zero-gamma": (["distill.gamma=0"], "distill.gamma"),
    "negative-temperature": (["data.temperature=-0.5"], "data.temperature"),
    "heldout-over-one": (["data.heldout_fraction=1.5"], "data.heldout_fraction"),
    "zero-stage-5": (["deepspeed.zero_stage=5"], "deepspeed.zero_stage"),
    "negative-lora-rank": (["lora.r=-4"], "lora.r"),
    "unknown-objective": (["distill.objective=magic"], "distill.objective"),
    "unknown-family": (["drafter.family=gpt"], "drafter.family"),
    "batch-not-multiple": (["train.micro_batch_size=3", "train.global_batch_size=8"], "global_batch_size"),
    "packing-with-mdlm": (["drafter.family=mdlm", "data.packing=true"], "data.packing"),
    "next-token-per-window": (["data.packing=false", "distill.next_token_weight=1"], "distill.next_token_weight"),
    "first-token-from-mdlm": (["drafter.family=mdlm", "distill.next_token_weight=0", "distill.first_token=encoder"],
                              "distill.first_token"),
    "unknown-first-token": (["distill.first_token=decoder"], "distill.first_token"),
    "first-token-untrained": (["distill.next_token_weight=0"], "nothing would train that prediction"),
    "offload-without-zero3": (["deepspeed.offload_params=true"], "zero_stage"),
    "bad-override-syntax": (["train.max_steps"], "bad override"),
    "unknown-override-key": (["train.speed=3"], "unknown recipe key 'train.speed'"),
    "top-p-zero": (["data.top_p=0"], "data.top_p"),
    "unknown-zoo-model": (["drafter.path=zoo:tiny-gpt"], "unknown zoo model 'tiny-gpt'"),
    "missing-drafter-folder": (["drafter.path=/nonexistent/drafter"], "/nonexistent/drafter"),
    "gamma-longer-than-rollouts": (["distill.gamma=200"], "longer than any rollout can be"),
}
PROMPT_FILES = {  # data.prompts files (train and rollouts) and --prompts (eval)
    "bad-json-line": ('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": \n', "not valid JSON"),
    "missing-prompt-field": ('{"id": 1, "text": "hi"}\n', "prompt"),
    "empty-file": ("", "no prompts"),
    "blank-lines-only": ("\n\n  \n", "no prompts"),
    "non-utf8": (b'{"id": 1, "prompt": "caf\xe9"}\n', "UTF-8"),
    "prompt-not-text": ('{"id": 1, "prompt": 42}\n', "prompt"),
    "json-array-line": ('[1, 2, 3]\n', "prompt"),
    "huge-line": ('{"id": 1, "prompt": "' + "word " * 400_000 + '"}\n', "verifier's context"),
}


def _world(tmp_path: Path) -> Path:
    """A scratch folder for a case's inputs, with a user's file beside them (nothing there may change)."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "precious.txt").write_text("a user's file next to the inputs")
    return inputs


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def _refused(capsys, command: str, argv: list[str], words: str, inputs: Path) -> str:
    before = _snapshot(inputs)
    threads = torch.get_num_threads()  # the trainer sizes its threads for the machine; this worker shares it
    try:
        with pytest.raises(SystemExit) as stop:
            run_cli(_main(command), argv)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, (stop.value.code, err[-3000:])
    lines = err.splitlines()  # progress bars of work done before the problem showed may come first
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err[-3000:]
    assert "Traceback" not in err and words.lower() in lines[-1].lower(), err[-3000:]
    assert _snapshot(inputs) == before  # nothing outside the run's folder changed
    return lines[-1]


@pytest.mark.parametrize("case", sorted(RECIPE_TEXT))
def test_malformed_recipe_files(case, tmp_path, capsys):
    inputs = _world(tmp_path)
    text, words = RECIPE_TEXT[case]
    recipe = inputs / "recipe.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    _refused(capsys, "train", [str(recipe)], words, inputs)
    _refused(capsys, "rollouts", [str(recipe)], words, inputs)


@pytest.mark.parametrize("case", sorted(RECIPE_OVERRIDES))
def test_wrong_recipe_values(case, model_dirs, world_prompts, tmp_path, capsys):
    inputs = _world(tmp_path)
    extra, words = RECIPE_OVERRIDES[case]
    _refused(capsys, "train", ["recipes/tiny.yaml", *overrides(model_dirs, world_prompts, tmp_path / "run"), *extra],
             words, inputs)


@pytest.mark.parametrize("case", sorted(PROMPT_FILES))
def test_malformed_prompt_files(case, model_dirs, tmp_path, capsys, exported):
    inputs = _world(tmp_path)
    text, words = PROMPT_FILES[case]
    prompts = inputs / "prompts.jsonl"
    prompts.write_bytes(text if isinstance(text, bytes) else text.encode())
    if case != "huge-line":  # read before any rollout is made
        _refused(capsys, "rollouts", ["recipes/tiny.yaml", *overrides(model_dirs, prompts, tmp_path / "run"),
                                      f"data.rollouts_dir={tmp_path / 'rollouts'}"], words, inputs)
    _refused(capsys, "eval", ["--ckpt", str(exported), "--prompts", str(prompts), "--out", str(tmp_path / "eval")],
             words, inputs)


def test_malformed_rollout_datasets(model_dirs, world_prompts, tmp_path, capsys):
    from datasets import Dataset

    from align.config import load_recipe
    from align.rollouts import DATASET, META, rollout_meta

    inputs = _world(tmp_path)
    cases = {
        "missing-columns": ([{"prompt_ids": [5, 6]}], "response_ids"),
        "wrong-dtypes": ([{"prompt_ids": "abc", "response_ids": "def", "prompt_id": "1"}], "not lists of token ids"),
        "empty": (None, "empty"),
    }
    for name, (rows, words) in cases.items():
        folder = inputs / name
        args = overrides(model_dirs, world_prompts, tmp_path / f"run-{name}", **{"data.rollouts_dir": folder})
        (folder / DATASET).mkdir(parents=True)
        (folder / META).write_text(json.dumps(rollout_meta(load_recipe("recipes/tiny.yaml", args))))
        data = Dataset.from_list(rows) if rows else Dataset.from_list([{"prompt_ids": [1], "response_ids": [1]}]).select([])
        data.save_to_disk(str(folder / DATASET))
        _refused(capsys, "train", ["recipes/tiny.yaml", *args], words, inputs)


def test_malformed_checkpoints_and_models(model_dirs, world_prompts, exported, tmp_path, capsys):
    inputs = _world(tmp_path)
    no_config = inputs / "no-config"
    shutil.copytree(exported, no_config)
    (no_config / "config.json").unlink()
    truncated = inputs / "truncated"
    shutil.copytree(exported, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    bad_meta = inputs / "bad-meta"
    shutil.copytree(exported, bad_meta)
    (bad_meta / "meta.json").write_text("{not json")
    empty_weights = inputs / "empty-weights"
    shutil.copytree(exported, empty_weights)
    save_file({}, str(empty_weights / "model.safetensors"))
    other_vocab = inputs / "other-vocab"  # the same verifier with two tokens' ids swapped in its tokenizer
    shutil.copytree(model_dirs["verifier"], other_vocab)
    tokenizer = json.loads((other_vocab / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]
    (other_vocab / "tokenizer.json").write_text(json.dumps(tokenizer))
    other_shapes = inputs / "other-shapes"  # a config that does not match the weights beside it
    shutil.copytree(model_dirs["verifier"], other_shapes)
    config = json.loads((other_shapes / "config.json").read_text())
    (other_shapes / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    verifier = str(model_dirs["verifier"])
    few = ["--prompts", str(world_prompts), "--limit", "2", "--max-new-tokens", "8"]
    cases = [
        ("eval", ["--ckpt", str(inputs / "missing")], "does not exist"),
        ("eval", ["--ckpt", str(no_config), "--verifier", verifier, *few], "config.json"),
        ("eval", ["--ckpt", str(truncated), "--verifier", verifier, *few], "model.safetensors"),
        ("eval", ["--ckpt", str(bad_meta), *few], "meta.json"),
        ("eval", ["--ckpt", str(empty_weights), "--verifier", verifier, "--baseline", "none", *few], "lack"),
        ("decode", ["--drafter", verifier, "--verifier", verifier, "--prompt", "hi", "--family", "mdlm"],
         "not a diffusion"),
        ("decode", ["--drafter", str(model_dirs["diffusiongemma"]), "--verifier", str(other_vocab), "--prompt", "hi"],
         "do not share a tokenizer"),
        ("eval", ["--ckpt", str(exported), "--verifier", str(other_shapes), *few], "weights"),
        ("export", [str(inputs / "no-such-step"), str(tmp_path / "out")], "no-such-step"),
        ("train", ["recipes/tiny.yaml", *overrides(model_dirs, world_prompts, tmp_path / "run"),
                   f"drafter.path={truncated}"], "model.safetensors"),
    ]
    for command, argv, words in cases:
        _refused(capsys, command, argv, words, inputs)


EMPTY_CACHE = {  # (command, arguments, words) that name zoo models the empty cache does not hold
    "train-missing-verifier": ("train", ["recipes/tiny.yaml", "verifier.path=/no/such/model"], "/no/such/model"),
    "train-missing-drafter": ("train", ["recipes/tiny.yaml", "drafter.path=/no/such/drafter"], "/no/such/drafter"),
    "train-missing-prompts": ("train", ["recipes/tiny.yaml", "data.prompts=/no/such/prompts.jsonl"],
                              "/no/such/prompts.jsonl"),
    "train-unknown-zoo-verifier": ("train", ["recipes/tiny.yaml", "verifier.path=zoo:tiny-gpt"], "tiny-gpt"),
    "rollouts-missing-verifier": ("rollouts", ["recipes/tiny.yaml", "verifier.path=/no/such/model"], "/no/such/model"),
    "real-recipe-missing-drafter": ("train", ["recipes/smollm2-dream.yaml", "drafter.path=/no/such/drafter"],
                                    "/no/such/drafter"),
    # its drafter is made from Gemma 3, whose GGUF package (or the adaptation text's) make real-install fetches
    "gemma-recipe-before-real-install": ("train", ["recipes/gemma3-diffusiongemma.yaml", "verifier.path=/no/such/model"],
                                         "make real-install"),
    "eval-missing-checkpoint": ("eval", ["--ckpt", "/no/such/ckpt"], "/no/such/ckpt"),
    "decode-missing-verifier": ("decode", ["--drafter", "zoo:tiny-diffusiongemma", "--verifier", "/no/such/model",
                                           "--prompt", "hi"], "/no/such/model"),
    "decode-unknown-zoo-drafter": ("decode", ["--drafter", "zoo:tiny-gpt", "--verifier", "zoo:tiny-verifier",
                                              "--prompt", "hi"], "tiny-gpt"),
    "export-not-a-checkpoint": ("export", ["/no/such/checkpoint", "/no/such/out"], "/no/such/checkpoint"),
}


@pytest.mark.parametrize("case", sorted(EMPTY_CACHE))
def test_on_an_empty_cache_a_mistake_is_refused_before_anything_is_built(case, tmp_path, capsys, monkeypatch):
    """A new user's machine: the cache holds no zoo model. A wrong path beside zoo names that would need building (the
    tiny world's models take minutes, a real pair's an hour) is refused first, with one line, and the cache is left
    as empty as it was found: nothing was built, converted, locked or generated."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    monkeypatch.setenv("ALIGN_CACHE", str(cache))
    command, argv, words = EMPTY_CACHE[case]
    _refused(capsys, command, argv, words, _world(tmp_path))
    assert not any(cache.iterdir()), sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


@pytest.mark.parametrize("case", ["train-verifier-as-drafter", "train-drafter-as-verifier", "eval-verifier-as-drafter",
                                  "decode-verifier-as-drafter", "decode-drafter-as-verifier"])
def test_on_an_empty_cache_a_model_of_the_wrong_kind_is_refused_before_anything_is_built(case, model_dirs, tmp_path,
                                                                                         capsys, monkeypatch):
    """A causal LM given as the drafter, or a diffusion drafter as the verifier, beside zoo models the empty cache
    would have to build: what each folder's config says is read first, so the mistake costs no build."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    monkeypatch.setenv("ALIGN_CACHE", str(cache))
    causal, diffusion = str(model_dirs["verifier"]), str(model_dirs["diffusiongemma"])
    command, argv, words = {
        "train-verifier-as-drafter": ("train", ["recipes/tiny.yaml", f"drafter.path={causal}"],
                                      "not a diffusiongemma drafter"),
        "train-drafter-as-verifier": ("train", ["recipes/tiny.yaml", f"verifier.path={diffusion}"],
                                      "not a causal language model"),
        "eval-verifier-as-drafter": ("eval", ["--ckpt", causal, "--verifier", "zoo:tiny-verifier"],
                                     "causal language model"),
        "decode-verifier-as-drafter": ("decode", ["--drafter", causal, "--verifier", "zoo:tiny-verifier", "--prompt",
                                                  "hi"], "causal language model"),
        "decode-drafter-as-verifier": ("decode", ["--drafter", "zoo:tiny-diffusiongemma", "--verifier", diffusion,
                                                  "--prompt", "hi"], "not a causal language model"),
    }[case]
    _refused(capsys, command, argv, words, _world(tmp_path))
    assert not any(cache.iterdir()), sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
