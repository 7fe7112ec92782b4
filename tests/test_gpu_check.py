"""The GPU machine's one command (bench/gpu_check.py, ``make gpu-check``), rehearsed at CPU scale: every stage runs,
its report holds every table, and the measures are what they say (FLOPs counted, MFU a fraction, greedy lossless)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import script_module

ROOT = Path(__file__).resolve().parents[1]


def test_flops_are_counted_op_by_op_forward_and_backward():
    check = script_module("bench/gpu_check.py")
    a = torch.ones(4, 8, device="cpu", requires_grad=True)
    b = torch.ones(8, 16, device="cpu")
    assert check.step_flops(lambda: a @ b) == 2 * 4 * 8 * 16
    assert check.step_flops(lambda: (a @ b).sum().backward()) == 2 * (2 * 4 * 8 * 16)  # the input's gradient too


def test_stages_that_do_not_fit_the_budget_are_named_not_run(tmp_path):
    check = script_module("bench/gpu_check.py")
    cache = os.environ["ALIGN_CACHE"]
    try:
        assert check.main(["--budget", "0", "--out", str(tmp_path)]) == 0
    finally:
        os.environ["ALIGN_CACHE"] = cache
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["skipped"]) == set(check.STAGES) and "env" not in report
    assert "Stage pairs: not run (0 s of the budget left)" in (tmp_path / "report.md").read_text()


def test_the_gpu_check_runs_every_stage_at_cpu_scale(tmp_path):
    """The whole command at CPU scale (the suite stage on one test file: the suite itself is what runs this):
    the suite's counts, make demo's pipeline lossless for every drafter kind, the gemma pair's packed step under
    ZeRO-2 and ZeRO-3, LoRA and full, with its FLOPs, MFU, peak memory and a profile, pass latency and decoding."""
    command = [sys.executable, "bench/gpu_check.py", "--scale", "cpu", "--out", str(tmp_path), "--budget", "600",
               "--suite-args", "tests/test_structure.py", "--workers", "1", "--demo-steps", "4", "--demo-prompts",
               "3", "--demo-tokens", "12", "--pairs", "gemma", "--steps", "1", "--micro-batch", "1", "--prefix", "16",
               "--response", "8", "--gammas", "8", "--ks", "1,2", "--repeats", "1", "--prompts", "2",
               "--max-new-tokens", "8"]
    launched = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}  # a trainer
    env = {k: v for k, v in os.environ.items() if k not in launched}  # test in this process may have set them
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["skipped"] == {}
    assert report["env"]["matmul_bf16_flops"] > 0 and report["env"]["matmul_f32_flops"] > 0
    assert report["suite"]["exit"] == 0 and report["suite"]["counts"]["passed"] > 0
    rows = report["demo"]["rows"]
    assert {r["label"] for r in rows} >= {"aligned", "ar", "dflash", "lookup"}
    greedy = [r for r in rows if r["temperature"] == 0]
    assert greedy and all(r["lossless"] is True and r["lossless_counts"]["mismatch"] == 0 for r in greedy)
    assert {r["temperature"] for r in rows} == {0.0, 1.0}
    gemma = report["pairs"]["gemma"]
    trained = {(t["zero"], t["lora"]) for t in gemma["train"]}
    assert trained == {(2, True), (2, False), (3, True), (3, False)}
    for t in gemma["train"]:
        assert t["strategy"] == "packed" and t["windows_per_s"] > 0 and t["flops_per_step"] > 0
        assert 0 < t["mfu"] < 1 and t["peak_gib"] > 0
    profiled = [t["profile"] for t in gemma["train"] if "profile" in t]
    assert len(profiled) == 1 and {"align.forward", "align.backward", "align.step"} <= set(profiled[0]["phases_s"])
    assert profiled[0]["top"] and 0 < sum(o["share"] for o in profiled[0]["top"]) <= 1 + 1e-9
    assert [(x["gamma"], x["k"]) for x in gemma["latency"]] == [(8, 1), (8, 2)]
    decoded = {d["temperature"]: d for d in gemma["decoding"]}
    assert decoded[0.0]["lossless"]["mismatch"] == 0 and sum(decoded[0.0]["lossless"].values()) == 2
    assert decoded[1.0]["tokens_per_s"] > 0 and decoded[0.0]["alone_tokens_per_s"] > 0
    text = (tmp_path / "report.md").read_text()
    for heading in ("## The suite", "## make demo's pipeline", "## The gemma pair", "Profile of one step",
                    "| γ | K |", "| decoding"):
        assert heading in text, heading
