"""Rollouts per second of a recipe's verifier, with transformers (hf) and with vLLM (vllm), on the same prompts.

    python bench/rollout_speed.py --recipe recipes/smollm2-dflash.yaml --prompts 64 --batch-size 32,64
    python bench/rollout_speed.py --recipe recipes/smollm2-dflash.yaml --backends hf --prompts 16   # quick

Each backend generates the recipe's first ``--prompts`` prompts in chunks of ``--batch-size`` with the recipe's
sampling settings (``data.*``), after one untimed chunk, exactly as ``python -m align.rollouts`` does (the backends
of ``align/rollouts.py``); vLLM runs in its own environment (``.venv-vllm``, ``make vllm-env``) in a child process.
Printed: a table of prompts/s and new tokens/s per backend and chunk size; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def measure(recipe_path: str, overrides: list[str], count: int, batch_size: int, backend: str) -> dict:
    """Time ``backend`` on the recipe's first ``count`` prompts in chunks of ``batch_size`` (one chunk of warm-up)."""
    from align.config import load_recipe
    from align.prompts import encode_prompt
    from align.rollouts import make_backend
    from align.zoo import load_prompts

    recipe = load_recipe(recipe_path, overrides)
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, backend=backend, batch_size=batch_size))
    engine = make_backend(recipe)
    prompts = load_prompts(recipe.data.prompts)[:count + batch_size]
    ids = [encode_prompt(engine.tokenizer, p["prompt"]) for p in prompts]
    engine.generate(ids[:batch_size], 0)  # warm-up, untimed
    timed = ids[batch_size:batch_size + count]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(timed), batch_size):
        tokens += sum(len(r) for rows in engine.generate(timed[i:i + batch_size], i) for r in rows)
    seconds = time.perf_counter() - start
    return {"backend": backend, "batch_size": batch_size, "prompts": len(timed), "seconds": seconds,
            "prompts_per_s": len(timed) / seconds, "tokens_per_s": tokens / seconds,
            "prompt_tokens": sum(map(len, timed)) / len(timed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--override", action="append", default=[], help="section.key=value (repeatable)")
    p.add_argument("--prompts", type=int, default=64, help="prompts timed per backend and chunk size")
    p.add_argument("--batch-size", default="64", help="chunk sizes (comma list)")
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # inside .venv-vllm: one measurement, as JSON on the last line
        print(json.dumps(measure(args.recipe, args.override, args.prompts, int(args.batch_size), "vllm")))
        return
    rows = []
    for batch_size in [int(x) for x in args.batch_size.split(",")]:
        for backend in args.backends.split(","):
            if backend == "hf":
                rows.append(measure(args.recipe, args.override, args.prompts, batch_size, "hf"))
            else:
                if not VLLM_PYTHON.is_file():
                    raise SystemExit("the vllm backend runs in .venv-vllm: make vllm-env first")
                done = subprocess.run([str(VLLM_PYTHON), __file__, "--child", "--recipe", args.recipe,
                                       "--prompts", str(args.prompts), "--batch-size", str(batch_size),
                                       *[f"--override={o}" for o in args.override]], cwd=ROOT, capture_output=True,
                                      text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                if done.returncode:
                    raise SystemExit(f"vllm failed: {done.stderr[-3000:]}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print("\n| backend | chunk | prompts | prompt tokens (mean) | prompts/s | new tokens/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['batch_size']} | {r['prompts']} | {r['prompt_tokens']:.0f} | "
              f"{r['prompts_per_s']:.2f} | {r['tokens_per_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
