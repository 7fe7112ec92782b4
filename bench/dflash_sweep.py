"""Which feature-conditioned drafter for a real verifier: the verifier layers it reads, its depth, how its layers
start and its objective, each at tuned learning rates, at one training budget.

    python bench/dflash_sweep.py --recipe recipes/smollm2-dflash.yaml --steps 300 --lrs 5e-4,1e-3,2e-3
    python bench/dflash_sweep.py --recipe recipes/smollm2-dflash.yaml --only layers-5,depth-2 --seeds 0,1,2

Each variant is a base drafter built here (``align/zoo/models.py`` ``dflash_model``; with ``init``, its layers start as
the verifier's own, ``align/zoo/derive.py`` ``dflash_layers_from``) into ``<out>/<variant>/base`` and trained by
``align/train.py`` on the recipe's rollouts with the variant's overrides, at every ``--lrs`` rate for ``--steps``
steps (seed 0); the rate with the best held-out ``decoded_accepted`` (the held-out windows walked as greedy decoding
walks them) is kept and trained at the other ``--seeds``. Results accumulate in ``<out>/results.json`` (a rerun
skips what is there) and the table is printed: held-out decoded accepted (mean ± sd over seeds), E[streak], training
seconds per step, the drafter's parameters.
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
sys.path.insert(0, str(ROOT))

#: variant -> (drafter shape: layers read, depth, layers it starts as (None: random), recipe overrides)
VARIANTS = {
    "base": ([1, 14, 27], 3, None, []),  # zoo:smollm2-dflash as it was: 3 layers read, 3 deep, random
    "layers-5": ([1, 7, 14, 21, 27], 3, None, []),  # DFlash spreads five
    "depth-2": ([1, 7, 14, 21, 27], 2, None, []),
    "depth-5": ([1, 7, 14, 21, 27], 5, None, []),
    "init-verifier": ([1, 7, 14, 21, 27], 3, [26, 27, 28], []),  # starting as the verifier's last layers
    "decayed-ce": ([1, 7, 14, 21, 27], 3, None, ["distill.objective=decayed_ce", "distill.decay=4"]),
    "ce": ([1, 7, 14, 21, 27], 3, None, ["distill.objective=ce"]),
    "tv-ce": ([1, 7, 14, 21, 27], 3, None, ["distill.objective=tv", "distill.ce_weight=0.1",
                                             "data.feature_cache=false"]),
}


def base_drafter(verifier_path: str, target_layers: list[int], depth: int, init: list[int] | None, mask_token: str,
                 out: Path) -> Path:
    """Build (once) the variant's untrained drafter into ``out``."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from align.loading import pretrained
    from align.zoo import resolve
    from align.zoo.derive import dflash_layers_from
    from align.zoo.models import dflash_model

    source = resolve(verifier_path)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = AutoConfig.from_pretrained(source)
    text = config.get_text_config()
    model = dflash_model(config, target_layers, tokenizer.convert_tokens_to_ids(mask_token), depth,
                         text.intermediate_size, kv_heads=text.num_key_value_heads,
                         head_dim=getattr(text, "head_dim", None), seed=0)
    if init:
        dflash_layers_from(model, pretrained(AutoModelForCausalLM, source, dtype=torch.float32), init)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def train(recipe: str, base: Path, folder: Path, lr: float, seed: int, steps: int, extra: list[str]) -> dict:
    """One run (or a finished one): held-out metrics at its last step and seconds per step."""
    if not (folder / "final" / "meta.json").is_file():
        command = [sys.executable, "align/train.py", recipe, f"drafter.path={base}", f"run.output_dir={folder}",
                   f"run.seed={seed}", f"train.lr={lr}", f"train.max_steps={steps}", f"train.eval_every={steps}",
                   f"train.save_every={steps}", *extra]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    heldout = [m for m in metrics if m["split"] == "eval"][-1]
    rates = [m["windows_per_s"] for m in metrics if m["split"] == "train"]
    batch = json.loads((folder / "final" / "meta.json").read_text())
    return {"decoded_accepted": heldout.get("decoded_accepted"), "expected_streak": heldout["expected_streak"],
            "greedy_streak": heldout["greedy_streak"], "windows_per_s": statistics.fmean(rates) if rates else None,
            "steps": batch["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/smollm2-dflash.yaml")
    p.add_argument("--only", default=None, help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--lrs", default="5e-4,1e-3,2e-3")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--extra", default="", help="more overrides for every run, space separated")
    p.add_argument("--out", default="runs/bench/dflash-sweep")
    args = p.parse_args()
    import yaml

    recipe = yaml.safe_load(open(args.recipe))
    verifier, mask = recipe["verifier"]["path"], "<empty_output>"
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    lrs, seeds = [float(x) for x in args.lrs.split(",")], [int(x) for x in args.seeds.split(",")]
    names = args.only.split(",") if args.only else list(VARIANTS)
    for name in names:
        layers, depth, init, extra = VARIANTS[name]
        extra = extra + args.extra.split()
        base = base_drafter(verifier, layers, depth, init, mask, out / name / "base")
        entry = results.setdefault(name, {"sweep": {}, "seeds": {}})
        for lr in lrs:
            if str(lr) not in entry["sweep"]:
                start = time.time()
                entry["sweep"][str(lr)] = {**train(args.recipe, base, out / name / f"lr{lr:g}-s{seeds[0]}", lr,
                                                   seeds[0], args.steps, extra), "wall_s": time.time() - start}
                results_file.write_text(json.dumps(results, indent=1))
                print(name, lr, entry["sweep"][str(lr)], flush=True)
        best = max(lrs, key=lambda lr: entry["sweep"][str(lr)]["decoded_accepted"] or 0)
        entry["lr"] = best
        for seed in seeds:
            if str(seed) not in entry["seeds"] or entry["seeds"][str(seed)].get("lr") != best:
                run = entry["sweep"][str(best)] if seed == seeds[0] else train(
                    args.recipe, base, out / name / f"lr{best:g}-s{seed}", best, seed, args.steps, extra)
                entry["seeds"][str(seed)] = {"lr": best, **run}
                results_file.write_text(json.dumps(results, indent=1))
    print(f"\n{args.recipe}, {args.steps} steps; held-out windows of the recipe's rollouts\n")
    print("| variant | layers read | depth | starts as | extra | best lr | held-out decoded accepted | E[streak] | "
          "windows/s |\n|---|---|---|---|---|---|---|---|---|")
    for name in names:
        layers, depth, init, extra = VARIANTS[name]
        runs = list(results[name]["seeds"].values())
        accepted = [r["decoded_accepted"] for r in runs]
        spread = f" ± {statistics.stdev(accepted):.3f}" if len(accepted) > 1 else ""
        print(f"| {name} | {layers} | {depth} | {init or 'random'} | {' '.join(extra) or '-'} | "
              f"{results[name]['lr']:g} | {statistics.fmean(accepted):.3f}{spread} | "
              f"{statistics.fmean(r['expected_streak'] for r in runs):.3f} | "
              f"{statistics.fmean(r['windows_per_s'] or 0 for r in runs):.0f} |")


if __name__ == "__main__":
    main()
