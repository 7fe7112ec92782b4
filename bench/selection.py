"""Self-selection sweep: accepted_mean and speed for K drafts × scorer × candidate generator × drafter temperature.

    python bench/selection.py --ckpt runs/tiny/final                 # aligned and its base drafter, 32 prompts
    python bench/selection.py --ckpt runs/tiny/final --limit 176 --k 1,8

Runs one ``eval.acceptance`` sweep (greedy, γ = 16, T = 1, held-out tiny-world prompts) and prints, per drafter and
candidate setting, accepted_mean for every K, the gain of K = 8 over K = 1, the verifier scorer's share of the
oracle's gain, CPU tokens/s, and a GPU projection.

GPU projection (a cost model, not a measurement): on a GPU the verifier call is memory-bound, so checking K·γ
tokens costs about what γ tokens cost. The projection keeps the measured drafter time per block (one pass, plus
candidate sampling and scoring) and replaces the verifier time per block at K by the measured one at K = 1:
projected speed(K) / speed(1) = (τ_K / τ_1) · (d_1 + v_1) / (d_K + v_1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--k", default="1,2,4,8,16")
    p.add_argument("--scorer", default="verifier,drafter,oracle")
    p.add_argument("--candidates", default="iid,swap")
    p.add_argument("--drafter-temperature", default="1.0,1.5,2.0")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--out", default="runs/bench/selection")
    p.add_argument("--report-only", action="store_true", help="only print the table of an earlier sweep")
    args = p.parse_args()
    out = ROOT / args.out
    if not args.report_only:
        subprocess.run([sys.executable, "-m", "eval.acceptance", "--ckpt", args.ckpt, "--suite", "tinyworld",
                        "--gamma", "16", "--temperature", "0", "--k", args.k, "--scorer", args.scorer,
                        "--candidates", args.candidates, "--drafter-temperature", args.drafter_temperature,
                        "--limit", str(args.limit), "--out", str(out)], cwd=ROOT, check=True)
    results = json.loads((out / "acceptance.json").read_text())["results"]
    print(table(results))


def table(results: list[dict]) -> str:
    ks = sorted({r["k"] for r in results})
    lines = ["| drafter | candidates | scorer | " + " | ".join(f"K={k}" for k in ks) +
             " | K=8 / K=1 | share of oracle gain at K=8 | CPU tokens/s K=1 → K=8 | GPU projection K=8 / K=1 |",
             "|---|---|---|" + "---|" * len(ks) + "---|---|---|---|"]
    for label in ("baseline", "aligned"):
        base = next((r for r in results if r["label"] == label and r["k"] == 1), None)
        if base is None:
            continue
        groups: dict[tuple, dict[int, dict]] = {}
        for r in results:
            if r["label"] == label and r["k"] > 1:
                cand = r["candidates"] if r["candidates"] == "swap" else f"iid@{r['drafter_temperature']:g}"
                groups.setdefault((cand, r["scorer"]), {1: base})[r["k"]] = r
        for (cand, scorer), by_k in sorted(groups.items()):
            oracle = groups.get((cand, "oracle"), {}).get(8)
            at8 = by_k.get(8)
            gain = at8["accepted_mean"] - base["accepted_mean"] if at8 else None
            oracle_gain = oracle["accepted_mean"] - base["accepted_mean"] if oracle else None
            share = f"{gain / oracle_gain:.0%}" if gain is not None and oracle_gain and oracle_gain > 0 else "-"
            cells = " | ".join(f"{by_k[k]['accepted_mean']:.2f}" if k in by_k else "-" for k in ks)
            ratio = f"{at8['accepted_mean'] / base['accepted_mean']:.2f}×" if at8 else "-"
            speed = f"{base['tokens_per_s']:.0f} → {at8['tokens_per_s']:.0f}" if at8 else "-"
            lines.append(f"| {label} | {cand} | {scorer} | {cells} | {ratio} | {share} | {speed} | "
                         f"{gpu_projection(base, at8) if at8 else '-'} |")
    return "\n".join(lines)


def gpu_projection(base: dict, r: dict) -> str:
    """Relative speed at K if checking K·γ tokens cost what γ tokens cost (see the module docstring)."""
    d1, v1 = base["drafter_s"] / base["n_blocks"], base["verifier_s"] / base["n_blocks"]
    dk = r["drafter_s"] / r["n_blocks"]
    return f"{(r['tau'] / base['tau']) * (d1 + v1) / (dk + v1):.2f}×"


if __name__ == "__main__":
    main()
