"""Held-out accepted against the data trained on, at one training budget per token: the curve a user reads to plan
their own run.

    python bench/data_curve.py --recipe recipes/smollm2-dflash.yaml --rollouts 240,480,950,1900 \
        --reuse runs/smollm2-dflash
    python bench/data_curve.py --recipe recipes/smollm2-dflash.yaml --plot-only
    python bench/data_curve.py --recipe recipes/smollm2-dflash.yaml --text-rows 0,1600,4000,8000 --epochs 0.5 \
        --out runs/bench/text-curve       # all the rollouts plus labelled text (align/labels.py)

With ``--text-rows`` the points add the first N rows of labelled text (``data.text``, default english) to all the
training rollouts, and each trains ``--epochs`` × its training windows (one per token) / the global batch steps: the
same steps per token at every point. Each point records its tokens and what they cost: the labelling (the verifier's
prefill over the rows, once), the feature cache (built once, over the largest point's rows) and the training, in
seconds. ``--labels text`` (a point apart, suffix ``-text``) trains on the text's own tokens instead of the verifier's.

Each point trains the recipe on a subset of its training rollouts (``data.train_rollouts``: nested subsets chosen by
a hash of the prompt id, the held-out rollouts the same for every point). The largest point is the recipe as it is
(all its training rollouts, ``train.max_steps``; ``--reuse`` names a finished run of it instead of training it
again); a point of n rollouts trains ``train.max_steps`` × n / largest steps, so each point spends the same compute
per training token, and evaluates the held-out rollouts ``--evals`` times along the way (the recipe's learning
rate, warm-up and schedule). Results accumulate in ``<out>/results.json`` (a rerun skips finished points); the table is printed and
``<out>/data-curve.png`` plots held-out decoded accepted (the held-out rollouts walked as greedy decoding walks them)
against training rollouts, one line per point's steps, so the same figure reads as accepted against steps too.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def heldout_curve(folder: Path) -> list[dict]:
    """A run's held-out evaluations, by step."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": m["step"], "decoded_accepted": m.get("decoded_accepted"), "expected_streak": m["expected_streak"]}
            for m in lines if m["split"] == "eval"]


def train_point(recipe: str, folder: Path, rollouts: int | None, steps: int, evals: int, seed: int,
                extra: list[str]) -> None:
    """Train one point of the curve into ``folder`` (nothing to do when it finished); ``rollouts`` None: all. It saves
    at every held-out evaluation: a point cut short resumes from its last one when the curve runs again."""
    if (folder / "final" / "meta.json").is_file():
        return
    every = max(1, steps // evals)
    command = [sys.executable, "align/train.py", recipe, f"run.output_dir={folder}", f"run.seed={seed}",
               f"data.train_rollouts={'null' if rollouts is None else rollouts}", f"train.max_steps={steps}",
               f"train.eval_every={every}",
               f"train.save_every={every}", *extra]
    print("\n$ " + " ".join(command), flush=True)
    if subprocess.run(command, cwd=ROOT).returncode:
        raise SystemExit(f"failed: {' '.join(command)}")


def text_point(recipe_path: str, out: Path, rows: int, largest: int, labels: str, epochs: float, evals: int,
               seed: int, extra: list[str]) -> dict:
    """One point of the text axis: all training rollouts and the first ``rows`` rows of labelled text, trained for
    ``epochs`` of its windows; returns its record (tokens, steps, seconds by stage, the held-out curve). Every point
    with text loads the ``largest`` point's rows (the feature cache is built once, by the first) and trains on its
    own first ``rows``."""
    import time

    from align.config import load_recipe
    from align.distill.data import heldout_rows
    from align.labels import generate_labels
    from align.rollouts import load_rollouts

    more = [*extra, f"data.text_labels={labels}"] + (["data.text=null"] if rows == 0 else
                                                      [f"data.text_rows={largest}", f"data.train_text_rows={rows}"])
    recipe = load_recipe(recipe_path, more)
    dataset = load_rollouts(recipe)
    rollout_rows = dataset.select_columns(["prompt_id", "response_ids"]).to_list()
    held = heldout_rows(rollout_rows, recipe.data.heldout_fraction)
    tokens = {"rollouts": sum(len(r["response_ids"]) for r, h in zip(rollout_rows, held) if not h), "text": 0}
    seconds = {}
    if rows:
        start = time.perf_counter()
        text = generate_labels(recipe)
        seconds["labels"] = time.perf_counter() - start  # 0 where another point labelled these rows already
        tokens["text"] = sum(len(r) for r in text["response_ids"][:rows])
    windows = tokens["rollouts"] + tokens["text"]
    steps = max(1, math.ceil(epochs * windows / recipe.train.global_batch_size))
    folder = out / f"text-{rows}" if labels == "greedy" else out / f"text-{rows}-{labels}"
    start = time.perf_counter()
    train_point(recipe_path, folder, None, steps, evals, seed, more)
    seconds["train"] = time.perf_counter() - start
    meta = json.loads((folder / "final" / "meta.json").read_text())
    return {"text_rows": rows, "labels": labels, "tokens": tokens, "steps": meta["steps"], "folder": str(folder),
            "seconds": seconds, "curve": heldout_curve(folder)}


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    points = sorted(results.values(), key=lambda r: r["rollouts"])
    left.plot([r["rollouts"] for r in points], [r["curve"][-1]["decoded_accepted"] for r in points], "o-")
    left.set_xscale("log")
    left.set_xlabel("training rollouts")
    left.set_ylabel("held-out decoded accepted per block")
    left.set_title("at one budget per token")
    for r in points:
        right.plot([c["step"] for c in r["curve"]], [c["decoded_accepted"] for c in r["curve"]], ".-",
                   label=f"{r['rollouts']} rollouts")
    right.set_xlabel("training step")
    right.set_title("along training")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/smollm2-dflash.yaml")
    p.add_argument("--rollouts", default="240,480,950,1900", help="training rollouts of each point, comma list; the "
                   "largest is all of them (the recipe's own run)")
    p.add_argument("--evals", type=int, default=4, help="held-out evaluations along each point's training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", default=None, help="a finished run of the recipe over all its rollouts at the same "
                   "steps (e.g. runs/smollm2-dflash): the largest point, not trained again")
    p.add_argument("--extra", default="", help="more overrides for every run, space separated")
    p.add_argument("--out", default="runs/bench/data-curve")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--text-rows", default=None, help="the text axis: rows of labelled text added to all the rollouts, "
                   "comma list (0: the rollouts alone)")
    p.add_argument("--text", default="english", help="the text axis's data.text")
    p.add_argument("--epochs", type=float, default=0.5, help="the text axis: training windows per token")
    p.add_argument("--labels", default="greedy", choices=("greedy", "text"), help="the text axis: data.text_labels")
    p.add_argument("--largest", type=int, default=None, help="the text axis: rows every point loads (and caches), "
                   "when a later run adds larger points; default: this run's largest")
    args = p.parse_args()
    if args.text_rows is not None:
        return text_main(args)
    from align.config import load_recipe

    recipe = load_recipe(args.recipe, args.extra.split())  # refused here, before any training, when it is wrong
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    points = sorted(int(x) for x in args.rollouts.split(","))
    for n in ([] if args.plot_only else points):
        steps = math.ceil(recipe.train.max_steps * n / points[-1])
        folder = out / f"rollouts-{n}"
        if args.reuse and n == points[-1]:
            folder = ROOT / args.reuse
        else:
            train_point(args.recipe, folder, n if n < points[-1] else None, steps, args.evals, args.seed,
                        args.extra.split())
        meta = json.loads((folder / "final" / "meta.json").read_text())
        results[str(n)] = {"rollouts": n, "steps": meta["steps"], "folder": str(folder), "curve": heldout_curve(folder)}
        results_file.write_text(json.dumps(results, indent=1))
    print(f"\n{args.recipe}, train.max_steps × rollouts / {points[-1]} steps a point, seed {args.seed}\n")
    print("| training rollouts | steps | held-out decoded accepted | E[streak] |\n|---|---|---|---|")
    for r in sorted(results.values(), key=lambda r: r["rollouts"]):
        last = r["curve"][-1]
        print(f"| {r['rollouts']} | {r['steps']} | {last['decoded_accepted']:.3f} | {last['expected_streak']:.3f} |")
    plot(results, out / "data-curve.png", f"{Path(args.recipe).stem}: held-out accepted against data")
    print(f"\nplot: {out / 'data-curve.png'}")


def text_main(args: argparse.Namespace) -> None:
    from align.config import load_recipe

    extra = [f"data.text={args.text}", *args.extra.split()]
    load_recipe(args.recipe, extra)  # refused here, before any labelling or training, when it is wrong
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    points = sorted(int(x) for x in args.text_rows.split(","))
    for rows in ([] if args.plot_only else points):
        key = f"{rows}" if args.labels == "greedy" else f"{rows}-{args.labels}"
        if key in results:
            continue
        results[key] = text_point(args.recipe, out, rows, max(points + [args.largest or 0]), args.labels,
                                  args.epochs, args.evals, args.seed, extra)
        results_file.write_text(json.dumps(results, indent=1))
    print(f"\n{args.recipe}: all training rollouts plus N rows of {args.text}, {args.epochs:g} epoch of windows a "
          f"point, seed {args.seed}\n")
    print("| text rows | labels | training tokens (rollouts + text) | steps | labelling s | training s (with its "
          "feature cache) | held-out decoded accepted | E[streak] |\n|---|---|---|---|---|---|---|---|")
    for r in sorted(results.values(), key=lambda r: (r["labels"], r["text_rows"])):
        last = r["curve"][-1]
        t = r["tokens"]
        print(f"| {r['text_rows']} | {r['labels']} | {t['rollouts'] + t['text']:,} ({t['rollouts']:,} + "
              f"{t['text']:,}) | {r['steps']} | {r['seconds'].get('labels', 0):.0f} | {r['seconds']['train']:.0f} | "
              f"{last['decoded_accepted']:.3f} | {last['expected_streak']:.3f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for labels in sorted({r["labels"] for r in results.values()}):
        points = sorted((r for r in results.values() if r["labels"] == labels), key=lambda r: r["text_rows"])
        ax.plot([r["tokens"]["rollouts"] + r["tokens"]["text"] for r in points],
                [r["curve"][-1]["decoded_accepted"] for r in points], "o-", label=f"{labels} labels")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (rollouts + labelled text)")
    ax.set_ylabel("held-out decoded accepted per block")
    ax.set_title(f"{Path(args.recipe).stem}: {args.epochs:g} epoch a point")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "text-curve.png", dpi=120)
    print(f"\nplot: {out / 'text-curve.png'}")


if __name__ == "__main__":
    main()
