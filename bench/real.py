"""``make real``: the real pairs from nothing to a report, every stage through the project's own commands.

    make real                                  # install, then this script (what a user runs): the SmolLM2 headline
    python bench/real.py [--pairs smollm2,gemma3] [--eval-only] [--adapted] [--dflash]

Stages, each timed (``runs/real/stages.json``: per stage the seconds of every invocation that ran it, so a rerun
that resumes adds its cache hits beside the first run's times instead of over them):

1. the zoo: what the recipes read, built by ``python -m align.zoo build`` (verifiers converted from their packages'
   GGUF files, training prompts, drafters made from the verifier);
2. the headline of each pair that has one (its record's ``headline``, align/zoo/pairs.py; SmolLM2's): rollouts of
   its recipe (in ``.venv-vllm`` where the recipe rolls out with vLLM), its labelled text where the recipe has
   ``data.text`` (``python -m align.labels``), the shipped drafter trained on them, an
   autoregressive assistant trained on the same rollouts (``python -m align.baseline train``; for the time its
   record's ``assistant_args`` give, SmolLM2's 15 minutes, else the drafter's training time),
   and one interleaved ``eval.acceptance`` run on Spec-Bench (``--headline-per-category`` questions of each
   category, ``--headline-tokens`` new tokens, greedy) of the drafters against transformers' ``generate``, prompt
   lookup and assisted generation with that assistant;
3. with ``--adapted`` (always, for a pair without a headline: Gemma 3's): rollouts and alignment of the pair's
   adapted drafter (``recipe``), then ``eval.acceptance`` of the adapted and the aligned drafter against the
   verifier on the probe's eight prompts and on Spec-Bench (the first ``--per-category`` of each category, first
   turns; each pair's ``grids``, a part of the whole grid that 2 CPU cores run in about 40 minutes, ``--full``
   all of it: greedy and sampled, γ 8 and 16, K 1 and 4), greedy losslessness in bfloat16 (exact / near-tie /
   mismatch) and sampling losslessness at a small scale (the first two generated tokens of speculative sampling
   against the verifier's exact distribution);
4. ``runs/real/report.md``: the tables (``eval/report.py``) of every evaluation, the probe beside the seed's figures.

With ``--dflash`` (and ``--adapted``), a pair with further drafters (its record's ``more``) builds, trains and
measures them beside the adapted drafter too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from align.config import load_recipe  # noqa: E402
from align.zoo.pairs import PAIRS, zoo_names  # noqa: E402 (one record per real pair: its models, recipes, grids)

OUT = ROOT / "runs" / "real"
FULL = ["--gamma", "16,8", "--k", "1,4", "--temperature", "0,1"]  # greedy and sampled, γ 8 and 16, K 1 and 4:
# the grid a machine with more time runs (python bench/real.py --full)


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # rollouts with data.backend: vllm run there (make vllm-env)


def read_stages(path: Path) -> dict[str, list[float]]:
    """The stages' times so far (per stage, one entry per invocation that ran it; a single number, as earlier
    versions wrote, is one invocation's)."""
    found = json.loads(path.read_text()) if path.is_file() else {}
    return {stage: seconds if isinstance(seconds, list) else [seconds] for stage, seconds in found.items()}


def run(stage: str, command: list[str], times: dict, env: dict | None = None) -> None:
    """Run one stage's command (stdout and stderr pass through), time it, stop on failure."""
    print(f"\n=== {stage}: {' '.join(command)}", flush=True)
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, env=None if env is None else {**os.environ, **env})
    times.setdefault(stage, []).append(round(time.time() - start, 1))
    (OUT / "stages.json").write_text(json.dumps(times, indent=1))
    if done.returncode:
        raise SystemExit(f"stage {stage} failed (exit status {done.returncode}); rerun make real: it resumes")


def evaluate(pair: str, suite: str, per_category: int | None, tokens: int, times: dict, full: bool = False,
             more: bool = False) -> None:
    extra = ["--per-category", str(per_category)] if per_category and suite == "specbench" else []
    if more:
        for label, recipe in PAIRS[pair].more.items():
            extra += ["--drafter", f"{label}=runs/{Path(recipe).stem}/final"]
    run(f"eval {pair} {suite}",
        [sys.executable, "-m", "eval.acceptance", "--ckpt", final(pair), "--suite", suite, *extra,
         *(FULL if full else PAIRS[pair].grids[suite]), "--max-new-tokens", str(tokens),
         "--out", str(OUT / "eval" / f"{pair}-{suite}")], times)


def lossless_bf16(pair: str, tokens: int, times: dict) -> None:
    run(f"lossless bf16 {pair}",
        [sys.executable, "-m", "eval.acceptance", "--ckpt", final(pair), "--suite", "probe8", "--gamma", "16",
         "--k", "1", "--temperature", "0", "--dtype", "bfloat16", "--baseline", "none",
         "--max-new-tokens", str(tokens), "--out", str(OUT / "eval" / f"{pair}-bf16")], times)


def final(pair: str) -> str:
    return f"runs/{Path(PAIRS[pair].recipe).stem}/final"


def rollouts(stage: str, recipe: str, times: dict) -> None:
    """``python -m align.rollouts`` for ``recipe``, in .venv-vllm when it rolls out with vLLM."""
    import yaml

    backend = (yaml.safe_load(open(ROOT / recipe)).get("data") or {}).get("backend", "hf")
    if backend != "vllm":
        run(stage, [sys.executable, "-m", "align.rollouts", recipe], times)
        return
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{recipe} rolls out with vLLM, which runs in .venv-vllm: make vllm-env first")
    run(stage, [str(VLLM_PYTHON), "-m", "align.rollouts", recipe], times,
        env={"PYTHONPATH": str(ROOT), "ALIGN_VLLM_KV_GIB": os.environ.get("ALIGN_VLLM_KV_GIB", "3"),
             "VLLM_LOGGING_LEVEL": "ERROR"})


def assistant_done(h, run_dir: str) -> bool:
    """Whether the headline's assistant is already trained (a rerun of make real resumes): its meta.json records
    the start, learning rate, batch and time budget of ``h.assistant_args`` and is newer than the drafter's last
    checkpoint (a drafter trained again, on new rollouts, trains its assistant again)."""
    meta_path = ROOT / h.assistant_out / "meta.json"
    last = max((p.stat().st_mtime for p in (ROOT / run_dir / "checkpoints").glob("step-*")), default=None)
    if not meta_path.is_file() or last is None or meta_path.stat().st_mtime < last:
        return False
    meta, args = json.loads(meta_path.read_text()), dict(zip(h.assistant_args[::2], h.assistant_args[1::2]))
    wanted = {"init": h.assistant_init, "lr": float(args.get("--lr", "nan")),
              "batch_size": int(args.get("--batch-size", "0")), "budget_seconds": float(args.get("--seconds", "nan"))}
    return all(meta.get(key) == value for key, value in wanted.items())


def headline(pair: str, per_category: int, tokens: int, times: dict, train: bool) -> None:
    """The pair's headline: its shipped drafter trained on its rollouts, the autoregressive assistant trained on the
    same rollouts (for the record's ``--seconds``, else the drafter's training time), and one interleaved Spec-Bench
    run of both against generate, prompt lookup and assisted generation (eval.acceptance --interleave)."""
    h = PAIRS[pair].headline
    run_dir = f"runs/{Path(h.recipe).stem}"
    if train:
        rollouts(f"rollouts {pair} headline", h.recipe, times)
        if load_recipe(str(ROOT / h.recipe)).data.text:  # labelled text: its own stage
            run(f"labels {pair} headline", [sys.executable, "-m", "align.labels", h.recipe], times)
        run(f"align {pair} headline", [sys.executable, "align/train.py", h.recipe], times)
        # without --seconds in the record's arguments: for the drafter's training time (its optimizer steps, from the
        # run's metrics.jsonl: align.baseline's default), so that a rerun that resumes a finished run cannot shrink
        # the assistant's budget
        if assistant_done(h, run_dir):
            print(f"\n=== assistant {pair}: {h.assistant_out} is trained, as these settings ask, after the drafter's "
                  "last checkpoint (delete it to train it again)", flush=True)
        else:
            run(f"assistant {pair}", [sys.executable, "-m", "align.baseline", "train", "--run", run_dir,
                                      "--out", h.assistant_out, "--init", h.assistant_init, *h.assistant_args], times)
    run(f"eval {pair} headline",
        [sys.executable, "-m", "eval.acceptance", "--ckpt", f"{run_dir}/final", "--baseline", "none", "--suite",
         "specbench", "--per-category", str(per_category), "--max-new-tokens", str(tokens), "--temperature", "0",
         "--interleave", *h.args, "--assistant", h.assistant_out, "--drafter", f"ar={h.assistant_out}",
         "--out", str(OUT / "eval" / f"{pair}-headline")], times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default="smollm2", help="comma list of: " + ", ".join(PAIRS))
    p.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category (13 categories)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--headline-per-category", type=int, default=3, help="the headline's Spec-Bench questions per "
                   "category")
    p.add_argument("--headline-tokens", type=int, default=64, help="the headline's new tokens per question")
    p.add_argument("--samples", type=int, default=300, help="speculative samples of the sampling check")
    p.add_argument("--eval-only", action="store_true", help="skip the zoo and training stages (already done)")
    p.add_argument("--adapted", action="store_true", help="also, for pairs with a headline, the adapted and aligned "
                   "drafter of the pair's recipe (SmolLM2's Dream drafter: its rollouts, alignment, probe and "
                   "Spec-Bench evaluations, bfloat16 and sampling checks); a pair without a headline always runs them")
    p.add_argument("--dflash", action="store_true", help="also the further drafters of the pairs that have them (their "
                   "records' `more`, align/zoo/pairs.py: " + ", ".join(f"{p.name}: {', '.join(p.more)}" for p in
                                                                       PAIRS.values() if p.more) +
                   "): their zoo models, their training, their evaluation beside the others")
    p.add_argument("--full", action="store_true", help="every suite of every pair at the whole grid (greedy and "
                   "sampled, γ 8 and 16, K 1 and 4): about two hours on 2 CPU cores")
    args = p.parse_args()
    pairs = [x for x in args.pairs.split(",") if x]
    unknown = [x for x in pairs if x not in PAIRS]
    if unknown:
        raise SystemExit(f"unknown pair '{unknown[0]}'; choose from {', '.join(PAIRS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    times = read_stages(OUT / "stages.json")
    adapted = {pair: args.adapted or PAIRS[pair].headline is None for pair in pairs}
    if not args.eval_only:
        recipes = {pair: ([PAIRS[pair].recipe] if adapted[pair] else []) +
                   (list(PAIRS[pair].more.values()) if args.dflash else []) +
                   ([PAIRS[pair].headline.recipe] if PAIRS[pair].headline else []) for pair in pairs}
        names = list(dict.fromkeys(n for pair in pairs for recipe in recipes[pair] for n in zoo_names(recipe)))
        names += [PAIRS[p].headline.assistant_init[4:] for p in pairs if PAIRS[p].headline]
        for name in dict.fromkeys(names):  # what each recipe reads, in build order
            run(f"zoo {name}", [sys.executable, "-m", "align.zoo", "build", name], times)
        for pair in pairs:
            if adapted[pair]:
                recipe = PAIRS[pair].recipe
                rollouts(f"rollouts {pair}", recipe, times)
                run(f"align {pair}", [sys.executable, "align/train.py", recipe], times)
            if args.dflash:
                for label, more in PAIRS[pair].more.items():
                    if not (PAIRS[pair].headline and PAIRS[pair].headline.recipe == more):
                        run(f"align {pair} {label}", [sys.executable, "align/train.py", more], times)
    for pair in pairs:
        if PAIRS[pair].headline:
            headline(pair, args.headline_per_category, args.headline_tokens, times, not args.eval_only)
        if not adapted[pair]:
            continue
        evaluate(pair, "probe8", None, args.max_new_tokens, times, args.full, args.dflash)
        evaluate(pair, "specbench", args.per_category, args.max_new_tokens, times, args.full, args.dflash)
        lossless_bf16(pair, args.max_new_tokens, times)
        run(f"sampling check {pair}", [sys.executable, "bench/sampling_check.py", "--ckpt", final(pair),
                                       "--samples", str(round(args.samples * PAIRS[pair].samples)),
                                       "--out", str(OUT / f"{pair}-sampling.json")],
            times)
    from bench.real_report import write_real_report

    path = write_real_report(OUT, pairs, times)
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()
