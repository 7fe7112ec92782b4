"""Compare the distillation objectives at the same steps and windows, in two regimes, over seeds.

    python bench/objectives.py                                  # the full comparison (about 90 minutes on 2 cores)
    python bench/objectives.py --objectives ce,streak --seeds 0 --steps 200
    python bench/objectives.py --regimes greedy --objectives streak --extra "distill.temperature=0.5" --tag _tau0.5
    python bench/objectives.py --regimes greedy --objectives streak,ce --seeds 0 --tag _after_ce300 \
        --extra "drafter.path=runs/bench/objectives/greedy-ce-s0/final"    # a ce warm-up, then streak (or more ce)

regime ``greedy``: greedy verifier rollouts, greedy verification; regime ``sampled``: rollouts sampled at
temperature 1, sampling verification at temperature 1. Every run trains ``recipes/tiny.yaml`` with the given
overrides, then ``eval.acceptance`` measures accepted_mean on the tiny world's held-out prompts (γ = 16, T = 1).
Results go to ``runs/bench/objectives/results.json`` and a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGIMES = {"greedy": {"rollouts": ["data.temperature=0.0"], "verify": "0"},
           "sampled": {"rollouts": ["data.temperature=1.0"], "verify": "1"}}


def run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def evaluate(ckpt: str, temperature: str, seed: int, out: Path, limit: int, extra: list[str]) -> dict:
    run([sys.executable, "-m", "eval.acceptance", "--ckpt", ckpt, "--suite", "tinyworld", "--gamma", "16",
         "--max-new-tokens", "160", "--temperature", temperature, "--seed", str(seed), "--baseline", "none",
         "--out", str(out), *(["--limit", str(limit)] if limit else []), *extra])
    return json.loads((out / "acceptance.json").read_text())["results"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default="streak,ce_streak,ce,kd,tv")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--regimes", default="greedy,sampled")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--extra", default="", help="more overrides for every run, space separated")
    p.add_argument("--tag", default="", help="suffix of the run folders")
    p.add_argument("--out", default="runs/bench/objectives")
    p.add_argument("--limit", type=int, default=96, help="held-out prompts per evaluation (0: all)")
    args = p.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    for regime in args.regimes.split(","):
        spec = REGIMES[regime]
        key = f"{regime}/unaligned"
        if key not in results:
            r = evaluate("zoo:tiny-diffusiongemma", spec["verify"], 0, out / f"{regime}-unaligned",
                         args.limit, ["--verifier", "zoo:tiny-verifier"])
            results[key] = {"accepted_mean": r["accepted_mean"], "per_category": r["per_category"]}
            results_file.write_text(json.dumps(results, indent=1))
        for objective in args.objectives.split(","):
            for seed in map(int, args.seeds.split(",")):
                key = f"{regime}/{objective}{args.tag}/{seed}"
                if key in results:
                    continue
                folder = out / f"{regime}-{objective}{args.tag}-s{seed}"
                start = time.time()
                run([sys.executable, "align/train.py", "recipes/tiny.yaml", f"run.output_dir={folder}",
                     f"run.seed={seed}", f"distill.objective={objective}", f"train.max_steps={args.steps}",
                     f"train.save_every={args.steps}", "train.eval_every=100", *spec["rollouts"],
                     *args.extra.split()])
                seconds = time.time() - start
                metrics = [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines()]
                heldout = [m for m in metrics if m["split"] == "eval"][-1]
                r = evaluate(str(folder / "final"), spec["verify"], seed, folder / "eval", args.limit, [])
                results[key] = {"accepted_mean": r["accepted_mean"], "per_category": r["per_category"],
                                "expected_streak": heldout["expected_streak"], "greedy_streak": heldout["greedy_streak"],
                                "train_seconds": seconds}
                results_file.write_text(json.dumps(results, indent=1))
                print(key, round(r["accepted_mean"], 3), round(heldout["expected_streak"], 3), flush=True)
    print(table(results))


def table(results: dict) -> str:
    lines = ["| regime | objective | accepted_mean (mean ± sd over seeds) | held-out E[streak] | held-out greedy streak |",
             "|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for key, r in results.items():
        parts = key.split("/")
        groups.setdefault((parts[0], parts[1]), []).append(r)
    for (regime, objective), rows in sorted(groups.items()):
        acc = [r["accepted_mean"] for r in rows]
        sd = f" ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else ""
        es = [r["expected_streak"] for r in rows if "expected_streak" in r]
        gs = [r["greedy_streak"] for r in rows if "greedy_streak" in r]
        lines.append(f"| {regime} | {objective} | {statistics.fmean(acc):.2f}{sd} (n={len(acc)}) | "
                     f"{statistics.fmean(es):.2f} | {statistics.fmean(gs):.2f} |" if es else
                     f"| {regime} | {objective} | {statistics.fmean(acc):.2f} | - | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
