"""The trainer: a few steps of the real CLI with tiny models, resumption after kill -9, two processes, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from align.errors import AlignError

ROOT = Path(__file__).resolve().parents[1]
# two processes under DeepSpeed's launcher, found however the package was installed (pip install --target leaves no
# `deepspeed` script next to the interpreter)
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]


def env() -> dict[str, str]:
    """The environment of a subprocess run: read at call time (after the fixtures set ALIGN_CACHE), without the
    process-group variables an in-process run left behind (its MASTER_PORT may still be bound)."""
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1"}


def overrides(model_dirs, prompts, out, family="diffusiongemma", **extra) -> list[str]:
    base = {
        "verifier.path": model_dirs["verifier"], "drafter.path": model_dirs[family], "drafter.family": family,
        "data.prompts": prompts, "data.num_prompts": 16, "data.max_new_tokens": 24, "data.batch_size": 8,
        "data.heldout_fraction": 0.25, "distill.gamma": 8, "train.max_steps": 4, "train.micro_batch_size": 4,
        "train.global_batch_size": 8, "train.save_every": 2, "train.eval_every": 2, "train.eval_windows": 16,
        "train.warmup_steps": 1, "run.output_dir": out, "log.every": 1,
    }
    if family == "dream":
        base["drafter.trust_remote_code"] = "true"
    if family != "diffusiongemma":  # recipes/tiny.yaml's next-token term and first token read DiffusionGemma's
        base["distill.next_token_weight"] = 0  # causal prefix pass
        base["distill.first_token"] = "canvas"
    if family == "dflash":  # no canvas of its own
        base["distill.canvas_seed"] = "null"
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run_main(args: list[str]) -> int:
    from conftest import train_main as main

    threads = torch.get_num_threads()  # the trainer sizes its threads for the machine; this worker shares it
    try:
        return main(["recipes/tiny.yaml", *args])
    finally:
        torch.set_num_threads(threads)


def run_cli(args: list[str], launcher: list[str] | None = None, **kwargs) -> subprocess.Popen:
    command = (launcher or [sys.executable]) + [str(ROOT / "align" / "train.py"), "recipes/tiny.yaml", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def losses(out: Path) -> list[float]:
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [l["loss"] for l in lines if l["split"] == "train"]


def test_cli_trains_evaluates_and_exports(model_dirs, world_prompts, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(overrides(model_dirs, world_prompts, out))
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "recipe.yaml", "meta.json"):
        assert (out / "final" / name).is_file(), name
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert meta["steps"] == 4 and meta["objective"] == "ce" and meta["family"] == "diffusiongemma"
    assert {"before", "after"} <= set(meta["heldout"])
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(out / "final", use_kernels=False)  # offline: no Hub kernels
    assert isinstance(model, DiffusionGemmaForBlockDiffusion)
    trained = load_file(out / "final" / "model.safetensors")
    base = load_file(Path(model_dirs["diffusiongemma"]) / "model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base if k in trained)  # training changed the weights
    assert len(losses(out)) == 4


def test_kill_during_training_then_resume_gives_the_same_weights(model_dirs, world_prompts, tmp_path):
    args = dict(model_dirs=model_dirs, prompts=world_prompts)
    straight = tmp_path / "straight"
    assert run_main(overrides(out=straight, **args, **{"train.max_steps": 6})) == 0
    killed = tmp_path / "killed"
    proc = run_cli(overrides(out=killed, **args, **{"train.max_steps": 6}))
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step-2").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "step-2").is_dir() and not (killed / "final").exists(), proc.stdout.read()[-3000:]
    resumed = run_cli(overrides(out=killed, **args, **{"train.max_steps": 6}))
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log
    assert "resuming from" in log
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(killed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((killed / "final" / "meta.json").read_text())["steps"] == 6
    assert [round(x, 6) for x in losses(killed)] == [round(x, 6) for x in losses(straight)]


def test_kill_during_rollouts_then_resume_loses_and_duplicates_nothing(model_dirs, world_prompts, tmp_path):
    from align.config import load_recipe
    from align.rollouts import generate_rollouts

    common = overrides(model_dirs, world_prompts, tmp_path / "unused", **{"data.num_prompts": 48, "data.batch_size": 4,
                                                                           "data.max_new_tokens": 48})
    reference = generate_rollouts(load_recipe("recipes/tiny.yaml", common + [f"data.rollouts_dir={tmp_path / 'a'}"]),
                                  progress=False)
    target = tmp_path / "b"
    cmd = [sys.executable, "-m", "align.rollouts", "recipes/tiny.yaml", *common, f"data.rollouts_dir={target}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((target / "chunks").glob("0*"))) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list((target / "chunks").glob("0*")))
    assert 3 <= done < 12, "the kill should land while rollouts are being made"
    finished = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    again = generate_rollouts(load_recipe("recipes/tiny.yaml", common + [f"data.rollouts_dir={target}"]), progress=False)
    assert again.to_list() == reference.to_list()
    assert len({(r["prompt_index"], r["sample"]) for r in again}) == len(again) == 48
    meta = json.loads(again.info.description)
    assert meta["verifier"] == str(model_dirs["verifier"]) and meta["temperature"] == 0.0


@pytest.mark.parametrize("family", ["diffusiongemma", pytest.param("dflash", marks=pytest.mark.slow)])
def test_two_processes_follow_the_one_process_loss_curve(model_dirs, world_prompts, tmp_path, family):
    args = dict(model_dirs=model_dirs, prompts=world_prompts, family=family)
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_main(overrides(out=one, **args, **{"train.max_steps": 5, "train.micro_batch_size": 2})) == 0
    proc = run_cli(overrides(out=two, **args, **{"train.max_steps": 5, "train.micro_batch_size": 2}),
                   launcher=DEEPSPEED + ["--master_port", "29731"])
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 5
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)


def test_cached_features_follow_the_online_loss_curve(model_dirs, world_prompts, tmp_path):
    """data.feature_cache: the verifier's features computed once into the cache give the online run's losses (the
    same features, from other batches), a second run reuses the cache, and one that stores them in bfloat16 builds
    its own, half the size."""
    from align.paths import cache_dir

    args = dict(model_dirs=model_dirs, prompts=world_prompts, family="dflash")
    steps = {"train.max_steps": 3, "distill.objective": "streak_ce"}
    assert run_main(overrides(out=tmp_path / "online", **args, **steps)) == 0
    before = set((cache_dir() / "features").glob("*/features.bin"))
    assert run_main(overrides(out=tmp_path / "cached", **args, **steps, **{"data.feature_cache": "true"})) == 0
    built = set((cache_dir() / "features").glob("*/features.bin")) - before
    assert len(built) == 1
    a, b = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert len(a) == len(b) == 3
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)
    stamp = next(iter(built)).stat().st_mtime_ns
    assert run_main(overrides(out=tmp_path / "again", **args, **steps, **{"data.feature_cache": "true"})) == 0
    assert next(iter(built)).stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert losses(tmp_path / "again") == b
    # stored in bfloat16: a cache of its own in half the bytes, and nearly the same losses
    assert run_main(overrides(out=tmp_path / "half", **args, **steps, **{"data.feature_cache": "true",
                                                                          "data.feature_dtype": "bfloat16"})) == 0
    (half,) = set((cache_dir() / "features").glob("*/features.bin")) - before - built
    assert half.stat().st_size * 2 == next(iter(built)).stat().st_size
    c = losses(tmp_path / "half")
    assert c != b and all(abs(x - y) <= 1e-2 * max(1.0, abs(x)) for x, y in zip(b, c)), (b, c)


@pytest.mark.parametrize("family, extra", [
    ("mdlm", {"distill.objective": "kd", "lora.r": 4, "lora.target_modules": "[query,value]"}),
    ("dream", {"distill.objective": "ce_streak", "distill.ce_weight": 0.5}),
    ("diffusiongemma", {"distill.objective": "tv", "distill.temperature": 0.7}),
    # the teacher must not be partitioned with the drafter (before: "'weight' must be 2-D" in its first forward)
    ("diffusiongemma", {"distill.objective": "kd", "deepspeed.zero_stage": 3, "lora.r": 4}),
    ("diffusiongemma", {"distill.objective": "margin", "distill.ce_weight": 1.0, "distill.schedule": "anneal"}),
    ("mdlm", {"distill.objective": "sampled_streak", "distill.schedule": "switch"}),
    ("dflash", {"distill.objective": "tv"}),  # its teacher logits come from the pass that gives the features
    ("dflash", {"distill.objective": "streak_ce", "deepspeed.zero_stage": 2}),
    ("dflash", {"distill.objective": "tv", "distill.denoise_steps": 2}),  # the teacher's rows shift with the labels
])
def test_every_family_and_objective_trains(model_dirs, world_prompts, tmp_path, family, extra):
    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, family, **{"train.max_steps": 2, **extra})) == 0
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert meta["family"] == family and meta["steps"] == 2
    from align.loading import load_drafter_model

    model, _ = load_drafter_model(str(out / "final"), family, trust_remote_code=family == "dream")
    assert not any("lora" in name for name, _ in model.named_parameters())  # adapters merged at export


def test_the_next_token_term_is_added_with_its_weight(model_dirs, world_prompts, tmp_path):
    """distill.next_token_weight w adds w times one term to step 1's loss (two micro-batches, the drafter as loaded),
    and that term is a cross-entropy of the order of an untrained model's, ln V. (The canvas drafts the first token:
    w = 0 with the encoder drafting it is refused.)"""
    first = {}
    for w in (0.0, 1.0, 2.0):
        out = tmp_path / f"w{w}"
        assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 1, "distill.first_token": "canvas",
                                                                     "distill.next_token_weight": w})) == 0
        first[w] = losses(out)[0]
    term = first[1.0] - first[0.0]
    assert abs((first[2.0] - first[0.0]) - 2 * term) < 1e-4 * first[2.0]
    vocab = len(json.loads((Path(model_dirs["diffusiongemma"]) / "tokenizer.json").read_text())["model"]["vocab"])
    assert 0.5 * math.log(vocab) < term < 2 * math.log(vocab), (term, vocab)


def test_how_the_drafter_drafts_travels_with_the_export(model_dirs, world_prompts, tmp_path):
    """distill.canvas_seed and distill.first_token reach the export's meta.json, and every loader drafts so; the
    held-out metrics are those of the first token decoding drafts (the encoder's: they differ from the canvas's)."""
    from align.drafters import load_pair
    from align.drafters import drafting_of

    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 1, "distill.canvas_seed": 5,
                                                                 "distill.first_token": "encoder",
                                                                 "distill.next_token_weight": 1.0})) == 0
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert (meta["canvas_seed"], meta["first_token"]) == (5, "encoder")
    drafter, _, _ = load_pair(str(out / "final"), str(model_dirs["verifier"]), "diffusiongemma")
    assert (drafter.canvas_seed, drafter.first_token) == (5, "encoder")
    assert drafting_of(model_dirs["diffusiongemma"]) == {"canvas_seed": None, "first_token": "canvas", "context": None}
    canvas = tmp_path / "canvas"
    assert run_main(overrides(model_dirs, world_prompts, canvas, **{"train.max_steps": 1, "distill.canvas_seed": 5,
                                                                    "distill.first_token": "canvas",
                                                                    "distill.next_token_weight": 1.0})) == 0
    before = [json.loads((run / "final" / "meta.json").read_text())["heldout"]["before"] for run in (out, canvas)]
    assert before[0]["q_per_position"][1:] == before[1]["q_per_position"][1:]  # the same model: rows 2.. agree
    assert before[0]["expected_streak"] != before[1]["expected_streak"]  # the first row is another one


def test_a_bidirectional_drafter_reads_at_decoding_the_context_it_trained_on(model_dirs, world_prompts, tmp_path):
    """Per-window families cut each training window's prefix to data.max_prefix_len; the export's meta.json says
    so, and decoding cuts the prefix the drafter re-reads every block to the same last tokens (DiffusionGemma caches
    the whole prefix: no cut)."""
    from align.drafters.diffusion import Drafter
    from align.drafters import drafting_of
    from align.loading import load_drafter_model

    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, family="mdlm",
                              **{"train.max_steps": 1, "data.max_prefix_len": 6})) == 0
    assert drafting_of(str(out / "final"))["context"] == 6
    model, tokenizer = load_drafter_model(str(out / "final"), "mdlm")
    vocab = len(tokenizer)
    cut = Drafter(model, "mdlm", vocab, tokenizer.mask_token_id, **drafting_of(str(out / "final")))
    whole = Drafter(model, "mdlm", vocab, tokenizer.mask_token_id)
    prefix = torch.randint(4, vocab, (1, 15))
    assert torch.equal(cut.marginals(prefix, 4), whole.marginals(prefix[:, -6:], 4))
    assert not torch.equal(cut.marginals(prefix, 4), whole.marginals(prefix, 4))
    assert Drafter(tiny_drafter_of(model_dirs), "diffusiongemma", vocab, context=6).context is None


def tiny_drafter_of(model_dirs):
    from align.loading import load_drafter_model

    return load_drafter_model(str(model_dirs["diffusiongemma"]), "diffusiongemma")[0]


def test_export_cli_matches_the_final_export(model_dirs, world_prompts, tmp_path):
    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2})) == 0
    result = subprocess.run([sys.executable, "-m", "align.export", str(out / "checkpoints" / "step-2"),
                             str(tmp_path / "exported")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    a, b = load_file(out / "final" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_export_that_finds_no_room_is_one_line_and_a_rerun_completes(model_dirs, world_prompts, tmp_path):
    """safetensors reports a write that found no room as its own error ("... (os error 27)"), not an OSError: the
    export still ends with the one-line disk message and exit 2, leaves no export, and a rerun writes it whole. A
    file-size limit (RLIMIT_FSIZE) stands in for a full disk: the weights do not fit, the config does."""
    import resource

    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2})) == 0
    cmd = [sys.executable, "-m", "align.export", str(out / "checkpoints" / "step-2"), str(tmp_path / "exported")]
    limit = 16 * 1024

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert full.stderr.strip().splitlines()[-1].startswith("error: no room on the disk (File too large)"), full.stderr
    assert not (tmp_path / "exported").exists()
    again = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    a, b = load_file(out / "final" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_refused_with_one_line(model_dirs, world_prompts, tmp_path):
    good = overrides(model_dirs, world_prompts, tmp_path / "run")
    cases = [
        (["distill.objective=magic"], "distill.objective"),
        (["distill.gamma=200"], "longer than any rollout can be"),
        ([f"drafter.path={model_dirs['verifier']}"], "is a llama model, not a diffusiongemma drafter"),
        ([f"drafter.path={model_dirs['verifier']}", "drafter.family=mdlm", "distill.next_token_weight=0",
          "distill.first_token=canvas"], "causal language model.*not a diffusion"),
    ]
    for extra, words in cases:
        with pytest.raises(AlignError, match=words):
            run_main(good + extra)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(model_dirs, world_prompts, tmp_path, monkeypatch):
    from align.distill.losses import OBJECTIVES, Objective

    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2})
    assert run_main(args) == 0
    before = load_file(out / "final" / "model.safetensors")
    calls = {"n": 0}
    ce = OBJECTIVES["ce"].fn

    def failing(*a, **k):  # a fault injected in the third step after resuming (two micro-batches a step)
        calls["n"] += 1
        term = ce(*a, **k)
        return term if calls["n"] < 5 else type(term)(term.num * float("nan"), term.den)

    monkeypatch.setitem(OBJECTIVES, "ce", Objective(failing))
    with pytest.raises(AlignError, match="not finite at step 5.*last good checkpoint is .*step-3"):
        run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 8, "train.save_every": 1,
                                                             "train.keep_checkpoints": 5}))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-2", "step-3", "step-4.nonfinite"]
    after = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the exported drafter is untouched


def test_a_folder_holding_another_recipes_run_is_not_touched(model_dirs, world_prompts, tmp_path):
    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2})) == 0
    stamp = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(AlignError, match="different recipe.*distill.objective"):
        run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2, "distill.objective": "streak"}))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamp


def test_empty_or_corrupt_rollouts_are_refused(model_dirs, world_prompts, tmp_path):
    from datasets import Dataset

    from align.config import load_recipe
    from align.rollouts import DATASET, META, rollout_meta

    folder = tmp_path / "rollouts"
    args = overrides(model_dirs, world_prompts, tmp_path / "run", **{"data.rollouts_dir": folder})
    (folder / DATASET).mkdir(parents=True)
    (folder / META).write_text(json.dumps(rollout_meta(load_recipe("recipes/tiny.yaml", args))))
    Dataset.from_list([{"prompt_ids": [1], "response_ids": [1]}]).select([]).save_to_disk(str(folder / DATASET))
    with pytest.raises(AlignError, match="empty"):
        run_main(args)
    (folder / DATASET / "dataset_info.json").write_text("{broken")
    with pytest.raises(AlignError, match="corrupt"):
        run_main(args)


def test_schedules_move_from_cross_entropy_to_the_objective():
    from align.config import build_recipe
    from align.distill.strategy import objective_share

    def shares(schedule):
        recipe = build_recipe({"train": {"max_steps": 10}, "distill": {"objective": "streak_ce",
                                                                        "schedule": schedule, "schedule_fraction": 0.4}})
        return [objective_share(recipe, step) for step in range(10)]

    assert shares("constant") == [1.0] * 10
    assert shares("switch") == [0.0] * 4 + [1.0] * 6
    assert shares("anneal") == [0.0, 0.25, 0.5, 0.75] + [1.0] * 6
    with pytest.raises(AlignError, match="distill.schedule"):
        build_recipe({"distill": {"objective": "ce", "schedule": "switch"}})


def test_a_one_process_batch_is_split_over_processes_and_a_bad_one_refused_up_front(capsys):
    from align.config import build_recipe
    from align.distill.run import fit_micro_batch

    recipe = build_recipe({"train": {"micro_batch_size": 64, "global_batch_size": 64}})
    assert fit_micro_batch(recipe, 1, True).train.micro_batch_size == 64
    fitted = fit_micro_batch(recipe, 2, True)
    assert fitted.train.micro_batch_size == 32 and fitted.train.global_batch_size == 64
    assert "32 windows per process" in capsys.readouterr().out
    with pytest.raises(AlignError, match="multiple of train.micro_batch_size x processes"):
        fit_micro_batch(build_recipe({"train": {"micro_batch_size": 16, "global_batch_size": 48}}), 2, True)
    with pytest.raises(AlignError, match="multiple of train.micro_batch_size x processes"):
        fit_micro_batch(build_recipe({"train": {"micro_batch_size": 64, "global_batch_size": 64}}), 3, True)


@pytest.mark.parametrize("family", ["diffusiongemma", "mdlm", "dream"])
def test_micro_batches_by_prefix_length_pad_less_and_leave_every_window_its_logits(family):
    """Per-window training reorders each global batch by prefix length before cutting it into micro-batches: the
    order is a permutation, micro-batches pad less, and each window's logits are those it has alone (no padding),
    so the batch's loss and gradient, sums over its windows, are unchanged."""
    import random

    from conftest import MASK, VOCAB, tiny_drafter
    from align.distill.windows import by_prefix_length, make_windows, window_index
    from align.drafters.diffusion import FAMILIES

    rng = random.Random(5)
    rows = [{"prompt_ids": [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 9))],
             "response_ids": [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 23))]} for _ in range(6)]
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    pairs = pairs[torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0))[:24]]
    cut, gamma, micro = 20, 4, 6
    ordered = by_prefix_length(rows, pairs, cut)
    assert sorted(map(tuple, ordered.tolist())) == sorted(map(tuple, pairs.tolist()))
    lengths = [min(len(rows[r]["prompt_ids"]) + t, cut) for r, t in ordered.tolist()]
    assert lengths == sorted(lengths)

    model, mask = tiny_drafter(family), MASK if FAMILIES[family].masked else None

    @torch.no_grad()
    def logits_by_window(order: torch.Tensor, size: int) -> tuple[dict, int]:
        out, positions = {}, 0
        for lo in range(0, len(order), size):
            chunk = order[lo:lo + size]
            batch = make_windows(rows, chunk, gamma, cut, family, mask, VOCAB, 0)
            positions += batch.prefix.numel()
            logits = FAMILIES[family].canvas_logits(model, batch.prefix, batch.prefix_mask, batch.canvas)
            out.update({tuple(w): l for w, l in zip(chunk.tolist(), logits)})
        return out, positions

    alone, _ = logits_by_window(pairs, 1)
    (shuffled, padded), (grouped, less) = logits_by_window(pairs, micro), logits_by_window(ordered, micro)
    assert less < padded
    for window, expected in alone.items():
        assert (shuffled[window] - expected).abs().max() < 1e-5, window
        assert (grouped[window] - expected).abs().max() < 1e-5, window


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused(model_dirs, world_prompts, tmp_path, stage):
    """A checkpoint this toolkit wrote passes the weights-only check at every ZeRO stage; one whose model-states pickle
    carries an object that runs code when unpickled (here: it would write a marker file) is refused by the export and
    by resumption with one line, and the code never runs."""
    import pickle

    from align.distill.backend import check_pickles
    from align.errors import AlignError
    from align.export import export_checkpoint

    out = tmp_path / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 1,
                                                                 "deepspeed.zero_stage": stage})) == 0
    checkpoint = out / "checkpoints" / "step-1"
    check_pickles(checkpoint)
    if stage:
        return
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    states = checkpoint / "ds" / "mp_rank_00_model_states.pt"
    data = torch.load(states, map_location="cpu", weights_only=True)
    data["trap"] = Payload()
    torch.save(data, states, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(AlignError, match="unpickling it could run code, so it is refused"):
        export_checkpoint(checkpoint, tmp_path / "exported")
    with pytest.raises(AlignError, match="unpickling it could run code"):  # resuming reads the same file
        run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2}))
    assert not marker.exists()


def test_greedy_rollouts_are_shared_by_every_seed_and_sampled_ones_are_not():
    """run.seed names the rollout folder only where it draws something: greedy rollouts of seeds 0, 1 and 2 are one
    set (generating it again would give the same tokens); sampled ones are three."""
    from align.config import load_recipe
    from align.rollouts import rollouts_dir

    def folders(temperature: float) -> set:
        return {rollouts_dir(load_recipe("recipes/tiny.yaml", [f"run.seed={seed}", f"data.temperature={temperature}"]))
                for seed in (0, 1, 2)}

    assert len(folders(0.0)) == 1
    assert len(folders(1.0)) == 3


def test_every_seed_is_measured_on_the_same_heldout_windows(model_dirs, world_prompts, tmp_path):
    """run.seed varies the training, not what it is measured on: runs of seeds 0, 1 and 2 over the same rollouts
    walk the same held-out windows (their digest in the export's data fingerprint), so the drafter as loaded scores
    the same before training in each — a spread over seeds is the training's, not the held-out set's."""
    runs = {}
    for seed in (0, 1, 2):
        out = tmp_path / f"seed{seed}"
        assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 1, "run.seed": seed,
                                                                     "train.eval_windows": 24})) == 0
        runs[seed] = json.loads((out / "final" / "meta.json").read_text())
    digests = {meta["data_fingerprint"]["heldout_digest"] for meta in runs.values()}
    assert len(digests) == 1, digests
    before = [meta["heldout"]["before"] for meta in runs.values()]
    assert before[0] == before[1] == before[2]


def test_a_copy_of_a_run_resumed_with_other_heldout_windows_is_measured_on_them(model_dirs, world_prompts, tmp_path):
    """train.eval_windows changed on a resume, here of a copy of a finished run in another folder (how a drafter is
    measured on all its held-out windows, its run untouched): the drafter as resumed is measured on the new windows
    with no step taken, and the export carries those figures and their digest; the first windows' figures, which no
    longer compare, are not left beside them."""
    out, copy = tmp_path / "run", tmp_path / "copy"
    args = overrides(model_dirs, world_prompts, out, **{"train.max_steps": 2, "train.eval_windows": 1})
    assert run_main(args) == 0
    first = json.loads((out / "final" / "meta.json").read_text())
    shutil.copytree(out, copy)
    assert run_main([*args, f"run.output_dir={copy}", "train.eval_windows=100000"]) == 0
    again = json.loads((copy / "final" / "meta.json").read_text())
    seen, now = first["data_fingerprint"], again["data_fingerprint"]
    assert seen["heldout_windows"] < now["heldout_windows"] and seen["heldout_digest"] != now["heldout_digest"]
    assert set(again["heldout"]) == {"after"} and again["heldout"]["after"]["windows"] == now["heldout_windows"]
    last = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and last["split"] == "eval" and last["windows"] == now["heldout_windows"]
    weights, again_weights = (load_file(run / "final" / "model.safetensors") for run in (out, copy))
    assert all(torch.equal(weights[name], again_weights[name]) for name in weights)  # measured, not trained
    assert json.loads((out / "final" / "meta.json").read_text()) == first  # the run itself untouched


def test_train_rollouts_takes_nested_subsets_and_leaves_the_heldout_alone():
    from align.distill.data import heldout_rows, subset

    rows = [{"prompt_id": f"p{i}"} for i in range(200)]
    held = heldout_rows(rows, 0.1)
    train = [i for i in range(len(rows)) if not held[i]]
    small, large = subset(rows, train, 20), subset(rows, train, 80)
    assert len(small) == 20 and len(large) == 80 and set(small) <= set(large) <= set(train)
    assert small == sorted(small) and subset(rows, train, None) == train and subset(rows, train, 10_000) == train
    assert set(small) != set(train[:20])  # a hash's choice, not the first rows (the prompts' file order is by kind)
