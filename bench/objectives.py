"""Rank the distillation objectives at equal compute, each at its own tuned learning rate, over seeds.

    python bench/objectives.py                                          # greedy and sampled regimes, recipes/tiny.yaml
    python bench/objectives.py --recipe recipes/tiny-mdlm.yaml --regimes greedy --objectives ce,streak_ce
    python bench/objectives.py --objectives ce,margin+ce --lrs 1e-3,2e-3 --seeds 0 --steps 100   # a quick look
    python bench/objectives.py --regimes greedy --objectives ce,ce-T2,ce-T4 --lrs 2e-3 --decode-steps 1,2,4
    python bench/objectives.py --recipe recipes/smollm2-dream.yaml --regimes both --lrs 3e-4,1e-3 --steps 40 \
        --objectives ce,streak_ce,streak,first_failure,tv --extra "train.global_batch_size=8 train.warmup_steps=5" \
        --decode 0   # the real pair (docs/results.md)
    python bench/objectives.py --recipe recipes/tiny-dflash.yaml --regimes both --lrs 1e-3,2e-3,4e-3 --steps 200 \
        --objectives ce,decayed_ce,streak_ce,tv,tv+ce   # the feature-conditioned drafter (docs/dflash.md)

Protocol. Every run trains the recipe for ``--steps`` optimizer steps on the same windows in the same order (only
the objective's keys, ``train.lr`` and ``run.seed`` change). Learning rate: seed 0 is trained at every rate in
``--lrs``; the rate with the best held-out training-window metric (in the greedy regime decoded_accepted, the
held-out streaks walked as greedy decoding walks them, or the greedy streak where a run predates it; E[streak] in
the sampled one; held-out windows come from training prompts, not the evaluation suite) is kept, and seeds 1..
are trained at that rate. Each kept run is then decoded by ``eval.acceptance`` on the first ``--limit`` held-out
prompts of the tiny world (γ 16, T 1, 160 new tokens), or of ``--suite`` (``--per-category``, ``--max-new-tokens``);
``--decode 0`` ranks by the held-out metrics alone, where decoding costs more than training (a real pair on CPU). Regime ``greedy``: greedy rollouts, greedy verification;
``sampled``: rollouts at temperature 1, sampling verification at temperature 1.

Results accumulate in ``<out>/results.json`` (a rerun skips what is there) and the Markdown table is printed:
accepted_mean ± sd over seeds, held-out E[streak] and greedy streak, α_j at j = 1, 4, 8, 16, seconds per step (the
median over the logged steps after the first, the same loop for every objective; where the recipe caches the
verifier's features, the objectives that read its logits (tv, kd, sampled_streak) train with the verifier in the
loop, so their seconds include its pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from align.config import NEEDS_TEACHER  # noqa: E402 (objectives that read the verifier's logits: no feature cache)
REGIMES = {"greedy": {"rollouts": ["data.temperature=0.0"], "verify": "0", "select": "greedy_streak"},
           "sampled": {"rollouts": ["data.temperature=1.0"], "verify": "1", "select": "expected_streak"},
           # the recipe's greedy rollouts, every kept run decoded under greedy and under sampling verification
           "both": {"rollouts": ["data.temperature=0.0"], "verify": "0,1", "select": "greedy_streak"}}
# name -> recipe overrides; `X+ce` mixes cross-entropy in at weight 1, `ce-then-X` trains ce for half the steps, then X
VARIANTS = {
    "ce": ["distill.objective=ce"],
    "streak": ["distill.objective=streak"],
    "ce_streak": ["distill.objective=ce_streak"],
    "streak_ce": ["distill.objective=streak_ce"],
    "streak_ce-l1": ["distill.objective=streak_ce", "distill.smoothing=1.0"],
    "first_failure": ["distill.objective=first_failure"],
    "margin+ce": ["distill.objective=margin", "distill.ce_weight=1.0"],
    "ce-then-streak_ce": ["distill.objective=streak_ce", "distill.schedule=switch"],
    "ce-then-streak": ["distill.objective=streak", "distill.schedule=switch"],
    "kd": ["distill.objective=kd"],
    "tv": ["distill.objective=tv"],
    "sampled_streak": ["distill.objective=sampled_streak"],
    "sampled_streak+ce": ["distill.objective=sampled_streak", "distill.ce_weight=1.0"],
    "ce-then-tv": ["distill.objective=tv", "distill.schedule=switch"],
    "decayed_ce": ["distill.objective=decayed_ce"],  # the open DFlash trainers' position-decayed CE (γ' 7)
    "tv+ce": ["distill.objective=tv", "distill.ce_weight=0.111"],  # DSpark's 0.1·CE + 0.9·TV, scaled by 1/0.9
    "ce-T2": ["distill.objective=ce", "distill.denoise_steps=2"],  # trained for drafting in 2 denoising steps
    "ce-T4": ["distill.objective=ce", "distill.denoise_steps=4"],
}
DEFAULT_OBJECTIVES = {"greedy": "ce,streak,streak_ce,first_failure,margin+ce,ce-then-streak_ce",
                      "sampled": "ce,tv,kd,sampled_streak,sampled_streak+ce"}
POSITIONS = (1, 4, 8, 16)


def run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def train(recipe: str, folder: Path, regime: str, variant: str, lr: float, seed: int, steps: int,
          extra: list[str]) -> dict:
    """Train one run (or reuse a finished one); its held-out metrics at the last step and seconds per step."""
    objective = next(o.split("=", 1)[1] for o in VARIANTS[variant] if o.startswith("distill.objective="))
    online = ["data.feature_cache=false"] if objective in NEEDS_TEACHER else []  # the verifier's logits every step
    if not (folder / "final" / "meta.json").is_file():
        run([sys.executable, "align/train.py", recipe, f"run.output_dir={folder}", f"run.seed={seed}",
             f"train.lr={lr}", f"train.max_steps={steps}", f"train.save_every={steps}", "train.eval_every=100",
             "log.every=10", *REGIMES[regime]["rollouts"], *VARIANTS[variant], *online, *extra])
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    heldout = [m for m in metrics if m["split"] == "eval"][-1]
    batch = yaml.safe_load((folder / "recipe.yaml").read_text())["train"]["global_batch_size"]
    per_step = [batch / m["windows_per_s"] for m in metrics if m["split"] == "train"][1:]  # the first: warm-up
    return {"expected_streak": heldout["expected_streak"], "greedy_streak": heldout["greedy_streak"],
            "decoded_accepted": heldout.get("decoded_accepted"),
            "s_per_step": statistics.median(per_step) if per_step else None}


SUITE = {"suite": "tinyworld", "max_new_tokens": 160, "per_category": None}  # what decode() evaluates on (flags)


def decode(ckpt: str, regime: str, seed: int, out: Path, limit: int, extra: list[str], steps: str = "1") -> dict:
    if not (out / "acceptance.json").is_file():
        per_category = ["--per-category", str(SUITE["per_category"])] if SUITE["per_category"] else []
        run([sys.executable, "-m", "eval.acceptance", "--ckpt", ckpt, "--suite", SUITE["suite"], *per_category,
             "--gamma", "16", "--max-new-tokens", str(SUITE["max_new_tokens"]), "--temperature",
             REGIMES[regime]["verify"], "--seed", str(seed),
             "--steps", steps, "--baseline", "none", "--out", str(out), *(["--limit", str(limit)] if limit else []),
             *extra])
    results = json.loads((out / "acceptance.json").read_text())["results"]
    r = results[0]
    alpha = r["per_position"]
    sampled = next((x for x in results if x["temperature"] > 0 and x["steps"] == 1), None)
    return {"accepted_mean": r["accepted_mean"], "tau": r["tau"],
            "accepted_sampled": sampled["accepted_mean"] if sampled else None,
            "alpha": {str(j): alpha[j - 1] if len(alpha) >= j else None for j in POSITIONS},  # JSON's keys
            "per_category": r["per_category"],
            "accepted_by_steps": {str(x["steps"]): x["accepted_mean"] for x in results}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--regimes", default="greedy,sampled")
    p.add_argument("--objectives", default=None, help=f"comma list of {', '.join(VARIANTS)} (default per regime: "
                   f"{DEFAULT_OBJECTIVES})")
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3", help="learning rates swept on seed 0")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--extra", default="", help="more overrides for every run, space separated")
    p.add_argument("--tag", default="", help="a suffix for the runs' folders and result rows, to keep runs made with "
                   "--extra apart from the plain ones (e.g. --tag _tau0.5)")
    p.add_argument("--out", default=None, help="default runs/bench/objectives-<recipe name>")
    p.add_argument("--limit", type=int, default=96, help="held-out prompts per evaluation (0: all)")
    p.add_argument("--suite", default="tinyworld", help="the eval.acceptance suite the kept runs are decoded on")
    p.add_argument("--per-category", type=int, default=None, help="the first N prompts of each category of it")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--decode", type=int, default=1, help="1: decode every kept run with eval.acceptance; 0: rank by "
                   "the held-out metrics alone (held-out windows of greedy rollouts: the greedy streak is what greedy "
                   "verification accepts there, E[streak] what sampling verification accepts in expectation)")
    p.add_argument("--decode-steps", default="1", help="denoising steps T at decoding (comma list; other than 1: "
                   "each kept run is decoded at every T into eval-T<list>, and a table of accepted per T is printed)")
    args = p.parse_args()
    SUITE.update(suite=args.suite, max_new_tokens=args.max_new_tokens, per_category=args.per_category)
    name = Path(args.recipe).stem
    out = ROOT / (args.out or f"runs/bench/objectives-{name}")
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    extra = args.extra.split()
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]

    def save():
        results_file.write_text(json.dumps(results, indent=1, ensure_ascii=False))

    for regime in args.regimes.split(","):
        for variant in (args.objectives or DEFAULT_OBJECTIVES[regime]).split(","):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown objective variant {variant!r}; choose from {', '.join(VARIANTS)}")
            entry = results.setdefault(f"{regime}/{variant}{args.tag}", {"sweep": {}, "seeds": {}})
            for lr in lrs:  # the learning-rate sweep, seed 0
                if str(lr) not in entry["sweep"]:
                    start = time.time()
                    folder = out / f"{regime}-{variant}{args.tag}-lr{lr:g}-s{seeds[0]}"
                    entry["sweep"][str(lr)] = {**train(args.recipe, folder, regime, variant, lr, seeds[0],
                                                       args.steps, extra), "wall_s": time.time() - start}
                    save()
                    print(f"{regime} {variant} lr {lr:g}: {entry['sweep'][str(lr)]}", flush=True)
            metric = REGIMES[regime]["select"]
            if metric == "greedy_streak" and all(entry["sweep"][str(lr)].get("decoded_accepted") is not None
                                                 for lr in lrs):
                metric = "decoded_accepted"  # the held-out streaks walked as greedy decoding walks them
            best = max(lrs, key=lambda lr: entry["sweep"][str(lr)][metric])
            entry["lr"] = best
            for seed in seeds:
                folder = out / f"{regime}-{variant}{args.tag}-lr{best:g}-s{seed}"
                kept = entry["seeds"].get(str(seed))
                if kept is None or kept.get("lr") != best or (args.decode and "accepted_mean" not in kept):
                    trained = train(args.recipe, folder, regime, variant, best, seed, args.steps, extra)
                    decoded = decode(str(folder / "final"), regime, seed, folder / "eval", args.limit, []) \
                        if args.decode else {}
                    kept = entry["seeds"][str(seed)] = {"lr": best, **trained, **decoded}
                    save()
                    print(f"{regime} {variant} lr {best:g} seed {seed}: held-out greedy streak "
                          f"{trained['greedy_streak']:.3f}, E[streak] {trained['expected_streak']:.3f}"
                          + (f", accepted {decoded['accepted_mean']:.3f}" if decoded else ""), flush=True)
                if args.decode_steps != "1" and kept.get("by_steps", {}).get("steps") != args.decode_steps:
                    decoded = decode(str(folder / "final"), regime, seed, folder / f"eval-T{args.decode_steps}",
                                     args.limit, [], args.decode_steps)
                    kept["by_steps"] = {"steps": args.decode_steps, "prompts": args.limit,
                                        "accepted": decoded["accepted_by_steps"]}
                    save()
                    print(f"{regime} {variant} seed {seed}: accepted by T {decoded['accepted_by_steps']}", flush=True)
    print(table(results, args.recipe, args.steps, out))
    if args.decode_steps != "1":
        print(steps_table(results, args.decode_steps))


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.2f}{sd}"


def before(folder: Path) -> dict:
    """The held-out metrics of a run's drafter as loaded (its step-0 evaluation): each seed holds out other windows."""
    first = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    return first if first["split"] == "eval" and first["step"] == 0 else {}


def table(results: dict, recipe: str, steps: int, out: Path) -> str:
    lines = [f"{recipe}, {steps} steps per run; mean ± sd over seeds at each objective's best learning rate; "
             "gain: after / before on the same held-out windows",
             "",
             "| regime | objective | lr (swept) | accepted_mean | accepted_mean, sampling verification (T 1) | seeds | "
             "held-out E[streak] | held-out greedy streak | held-out decoded accepted | greedy streak gain | "
             "E[streak] gain | " + " | ".join(f"α_{j}" for j in POSITIONS) + " | s / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(POSITIONS) + "---|"]
    for key, entry in results.items():
        regime, variant = key.split("/", 1)
        runs = [r for r in entry["seeds"].values() if r.get("lr") == entry.get("lr")]
        if not runs:
            continue
        swept = ", ".join(f"{float(lr):g}{'*' if float(lr) == entry['lr'] else ''}" for lr in entry["sweep"])
        alphas = [_mean_sd([r["alpha"][str(j)] for r in runs if "alpha" in r]) for j in POSITIONS]
        firsts = [before(out / f"{regime}-{variant}-lr{entry['lr']:g}-s{seed}") for seed in entry["seeds"]]
        gains = {m: _mean_sd([r[m] / b[m] for r, b in zip(entry["seeds"].values(), firsts) if b.get(m)])
                 for m in ("greedy_streak", "expected_streak")}
        lines.append(f"| {regime} | {variant} | {swept} | {_mean_sd([r.get('accepted_mean') for r in runs])} | "
                     f"{_mean_sd([r.get('accepted_sampled') for r in runs])} | {len(runs)} | "
                     f"{_mean_sd([r['expected_streak'] for r in runs])} | {_mean_sd([r['greedy_streak'] for r in runs])} | "
                     f"{_mean_sd([r.get('decoded_accepted') for r in runs])} | "
                     f"{gains['greedy_streak']} | {gains['expected_streak']} | "
                     + " | ".join(alphas) + f" | {_mean_sd([r['s_per_step'] for r in runs])} |")
    return "\n".join(lines)


def steps_table(results: dict, steps: str) -> str:
    """Accepted per block when decoding in T denoising steps, mean ± sd over the kept seeds."""
    ts = steps.split(",")
    lines = ["| regime | objective | seeds | prompts | " + " | ".join(f"accepted, T = {t}" for t in ts) + " |",
             "|---|---|---|---|" + "---|" * len(ts)]
    for key, entry in results.items():
        regime, variant = key.split("/", 1)
        runs = [r["by_steps"] for r in entry["seeds"].values()
                if r.get("lr") == entry.get("lr") and r.get("by_steps", {}).get("steps") == steps]
        if runs:
            lines.append(f"| {regime} | {variant} | {len(runs)} | {runs[0]['prompts']} | "
                         + " | ".join(_mean_sd([r["accepted"][t] for r in runs]) for t in ts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
