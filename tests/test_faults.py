"""Faults: kill -9 at random moments during training (saves included), export and evaluation, of one rank of a
two-process run, and a file size limit during a save (one process, and one rank of two); then the same command
again. Each trial must end with a complete, correct result; on CPU with a fixed seed a resumed run's final weights
equal an uninterrupted run's.

Every kill waits for the work it interrupts to have begun (a file the process writes: a partial checkpoint, the
training's first checkpoint, the export's partial folder, the evaluation's progress line) and each trial asserts that
the interrupted state was reached (a process killed before it finished, with its work half done), so that no trial
passes by killing an import or a finished process.

``make test`` runs one trial of the export kill; the others are marked ``slow`` (``make test-all`` runs one trial of
each, ``make test-faults`` runs ``ALIGN_FAULT_TRIALS``, default there 5, and prints the table of outcomes when the
module ends).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train import DEEPSPEED, ROOT, env, overrides, run_cli, run_main

TRIALS = int(os.environ.get("ALIGN_FAULT_TRIALS", "1"))
OUTCOMES: list[tuple[str, str, int, str]] = []  # (fault, stage, trial, outcome)


def _kill_at_random(cmd: list[str], rng: random.Random, lo: float, hi: float, ready, poll: float = 0.01
                    ) -> tuple[bool, str]:
    """Start ``cmd``; once ``ready(output so far)`` holds (its work has begun), kill -9 it after U(lo, hi) seconds.
    Returns whether the kill landed (the process was still running and had begun) and its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []  # what it printed so far (progress bars redraw with \r, so chunks, not lines)
    reader = threading.Thread(target=lambda: lines.extend(
        chunk.decode(errors="replace") for chunk in iter(lambda: os.read(proc.stdout.fileno(), 4096), b"")),
        daemon=True)
    reader.start()
    deadline = time.time() + 300
    begun = False
    while proc.poll() is None and time.time() < deadline:
        if ready("".join(lines)):
            begun = True
            break
        time.sleep(poll)
    time.sleep(rng.uniform(lo, hi))
    landed = begun and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    return landed, "".join(lines)


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    """After the module: the table of outcomes ``make test-faults`` prints (a report, not a test: every outcome is
    recorded only after its trial's assertions passed)."""
    yield
    if not OUTCOMES:
        return
    rows: dict[tuple[str, str], list[str]] = {}
    for fault, stage, _, outcome in OUTCOMES:
        rows.setdefault((fault, stage), []).append(outcome)
    lines = ["", "| fault | stage | trials | complete and correct | clear error | other |", "|---|---|---|---|---|---|"]
    for (fault, stage), outcomes in rows.items():
        ok, error = outcomes.count("complete and correct"), outcomes.count("clear error")
        lines.append(f"| {fault} | {stage} | {len(outcomes)} | {ok} | {error} | {len(outcomes) - ok - error} |")
    print("\n".join(lines), file=sys.__stdout__, flush=True)


@pytest.fixture(scope="module")
def straight(model_dirs, world_prompts, tmp_path_factory):
    """The uninterrupted run every killed one must reproduce."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert run_main(overrides(model_dirs, world_prompts, out, **{"train.max_steps": 6, "train.save_every": 1,
                                                                 "train.keep_checkpoints": 2})) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_during_training_and_its_saves_then_rerun(straight, model_dirs, world_prompts, tmp_path, trial):
    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, **{"train.max_steps": 6, "train.save_every": 1,
                                                        "train.keep_checkpoints": 2})
    cmd = [sys.executable, str(ROOT / "align" / "train.py"), "recipes/tiny.yaml", *args]
    rng = random.Random(trial)
    saving = lambda _: (out / "checkpoints").is_dir() and any((out / "checkpoints").glob(".step-*.partial"))  # noqa: E731
    training = lambda _: (out / "checkpoints" / "step-1").is_dir()  # noqa: E731 (the loop has run a step)
    # even trials: within 50 ms of a save starting; odd ones: at a random moment of the loop, after its first save
    landed, _ = _kill_at_random(cmd, rng, 0.0, 0.05 if trial % 2 == 0 else 1.5,
                                ready=saving if trial % 2 == 0 else training, poll=0.002)
    assert landed and not (out / "final").exists()  # killed in the loop: the run was interrupted, not finished
    finished = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert _same_weights(straight / "final", out / "final")
    assert not list((out / "checkpoints").glob(".step-*"))  # what the kill left half-written is gone
    assert json.loads((out / "final" / "meta.json").read_text())["steps"] == 6
    OUTCOMES.append(("kill -9", "training (saves every step)", trial, "complete and correct"))


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_during_export_then_rerun(straight, tmp_path, trial):
    target = tmp_path / "exported"
    partial = target.with_name(target.name + ".partial")
    cmd = [sys.executable, "-m", "align.export", str(straight / "checkpoints" / "step-6"), str(target)]
    rng = random.Random(100 + trial)
    for attempt in range(20):  # until a kill lands while the export writes (its partial folder exists)
        landed, _ = _kill_at_random(cmd, rng, 0.0, 0.02, ready=lambda _: partial.is_dir(), poll=0.0005)
        if landed and partial.is_dir() and not target.exists():
            break
        shutil.rmtree(target, ignore_errors=True)
    else:
        pytest.fail("no kill landed while the export was writing")
    assert not target.exists()  # the interrupted write left no export behind, only its partial folder
    finished = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _same_weights(straight / "final", target)
    OUTCOMES.append(("kill -9", "export", trial, "complete and correct"))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_during_evaluation_then_rerun(exported, world_prompts, tmp_path, trial):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "eval.acceptance", "--ckpt", str(exported), "--prompts", str(world_prompts),
           "--limit", "6", "--gamma", "4", "--max-new-tokens", "16", "--out", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    before = json.loads((out / "acceptance.json").read_text())
    stamp = (out / "acceptance.json").stat().st_mtime_ns
    decoding = lambda output: "aligned" in output and "%" in output  # noqa: E731 (the jobs' progress bar is up)
    landed, _ = _kill_at_random(cmd, random.Random(200 + trial), 0.0, 1.0, ready=decoding)
    assert landed and (out / "acceptance.json").stat().st_mtime_ns == stamp  # killed while decoding: nothing written
    assert json.loads((out / "acceptance.json").read_text())["results"]  # the old report, whole
    again = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((out / "acceptance.json").read_text())
    key = lambda d: [(r["label"], r["accepted_mean"], r["n_blocks"], r["lossless"]) for r in d["results"]]  # noqa: E731
    assert key(after) == key(before) and not list(out.glob(".*.tmp-*"))
    OUTCOMES.append(("kill -9", "evaluation", trial, "complete and correct"))


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_then_a_rerun_completes(straight, model_dirs, world_prompts, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) stands in for a full disk: the first checkpoint's files do not fit."""
    import resource

    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, **{"train.max_steps": 6, "train.save_every": 1,
                                                        "train.keep_checkpoints": 2})
    cmd = [sys.executable, str(ROOT / "align" / "train.py"), "recipes/tiny.yaml", *args]
    limit = 64 * 1024  # bytes per file: the rollouts and logs fit, a checkpoint's optimizer state does not

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600, preexec_fn=small_disk)
    errors = [line for line in full.stderr.splitlines() if "error" in line]
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert len([e for e in errors if e.startswith("error: ")]) == 1, full.stderr[-3000:]
    line = next(e for e in errors if e.startswith("error: "))
    assert line.startswith("error: could not write checkpoint step-1") and "free space" in line, line
    assert not list((out / "checkpoints").glob(".step-*")) and not (out / "final").exists()
    finished = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert _same_weights(straight / "final", out / "final")
    OUTCOMES.append(("disk full (file size limit)", "training save", 0, "clear error"))


# ---------------------------------------------------------------------------------------- two processes

# micro-batch 8 x 2 processes > 8: the trainer splits the batch, 4 per process (a one-process recipe, unchanged)
TWO_RANKS = {"train.max_steps": 6, "train.save_every": 2, "train.micro_batch_size": 8, "train.global_batch_size": 8}


def _rank_pid(launcher: subprocess.Popen, rank: int, deadline: float) -> int:
    """The pid of local rank ``rank`` under a deepspeed launcher, once it has started."""
    import psutil

    while time.time() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if f"--local_rank={rank}" in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never started")


@pytest.fixture(scope="module")
def straight_two(model_dirs, world_prompts, tmp_path_factory):
    """An uninterrupted two-process run."""
    out = tmp_path_factory.mktemp("straight_two") / "run"
    proc = run_cli(overrides(model_dirs, world_prompts, out, **TWO_RANKS),
                   launcher=DEEPSPEED + ["--master_port", "29741"])
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_one_rank_killed_stops_the_run_then_a_rerun_completes(straight_two, model_dirs, world_prompts, tmp_path,
                                                              trial):
    """kill -9 of rank 1 at a random moment after the first checkpoint: the launcher stops rank 0 (no process left
    waiting at a collective), exits non-zero, and the same command then finishes with the uninterrupted weights."""
    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, **TWO_RANKS)
    launcher = DEEPSPEED + ["--master_port", str(29750 + trial)]
    proc = run_cli(args, launcher=launcher)
    victim = _rank_pid(proc, 1, time.time() + 300)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-2").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(random.Random(trial).uniform(0.0, 1.5))
    killed = proc.poll() is None
    if killed:
        os.kill(victim, signal.SIGKILL)
    log, _ = proc.communicate(timeout=120)  # rank 0 must not hang at a collective
    if killed:
        assert proc.returncode != 0, log
    rerun = run_cli(args, launcher=launcher)
    log, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, log
    assert _same_weights(out / "final", straight_two / "final")
    OUTCOMES.append(("kill -9 of one rank", "two-process training", trial, "complete and correct"))


@pytest.mark.slow
def test_a_failed_save_on_one_rank_is_one_line_and_nobody_hangs(straight_two, model_dirs, world_prompts, tmp_path):
    """The lead's file size limit drops below a checkpoint after the first save: the save fails with one line naming
    the checkpoint, the other rank is stopped instead of waiting at the save's barrier, and a rerun completes."""
    import resource

    out = tmp_path / "run"
    args = overrides(model_dirs, world_prompts, out, **TWO_RANKS)
    launcher = DEEPSPEED + ["--master_port", "29761"]
    proc = run_cli(args, launcher=launcher)
    lead = _rank_pid(proc, 0, time.time() + 300)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-2").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    resource.prlimit(lead, resource.RLIMIT_FSIZE, (16384, 16384))
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors and "could not write checkpoint step-4" in errors[0] and "resumes from step-2" in errors[0], log
    assert "Traceback" not in log, log
    rerun = run_cli(args, launcher=launcher)
    log, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, log
    assert _same_weights(out / "final", straight_two / "final")
    OUTCOMES.append(("file size limit on one rank", "two-process save", 0, "clear error"))
