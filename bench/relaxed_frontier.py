"""The relaxed (lossy) frontier: accepted per block and speed against output quality, every rule at several
settings, for the unaligned and the aligned drafter of a pair.

    python bench/relaxed_frontier.py --ckpt runs/tiny/final --suite tinyworld --limit 88 --out runs/bench/relaxed
    python bench/relaxed_frontier.py --ckpt runs/smollm2-dream/final --suite specbench --per-category 3 \\
        --max-new-tokens 48 --out runs/bench/relaxed-smollm2

One ``eval.acceptance`` run (greedy, the export's base drafter as the unaligned one, ``--save-outputs``) with every
rule of ``RULES`` (align/relaxed.py) beside exact verification; then the table (``--out``/frontier.md) and the plot
(``--out``/frontier.png): per drafter and rule setting, accepted per block, tokens/s over ``generate``'s, the share of
outputs identical to the verifier's, the verifier's NLL per token of the outputs against that of its greedy output,
and, where facts are known (the tiny world), the share of outputs still correct against the verifier alone's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: rule -> its settings, from nearly exact to loose (at least four each)
RULES = {
    "topk": ["topk:2", "topk:3", "topk:5", "topk:10"],
    "ratio": ["ratio:0.8", "ratio:0.5", "ratio:0.3", "ratio:0.1"],
    "typical": ["typical:0.3,0.09", "typical:0.2,0.2", "typical:0.1,0.3", "typical:0.05,0.5"],
}


def quality_axis(r: dict) -> tuple[str, float]:
    """What the plot puts on its quality axis: the correct share where facts are known, else the identical share."""
    q = r["quality"]
    return ("correct share", q["correct"]) if "correct" in q else ("identical to the verifier's", q["identical"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--suite", default="tinyworld")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--gamma", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="runs/bench/relaxed")
    p.add_argument("--plot-only", action="store_true", help="redraw from the existing acceptance.json")
    args = p.parse_args()
    out = ROOT / args.out
    if not args.plot_only:
        command = [sys.executable, "-m", "eval.acceptance", "--ckpt", args.ckpt, "--suite", args.suite, "--gamma",
                   str(args.gamma), "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0",
                   "--save-outputs", "--out", str(out), *[f"--relaxed={r}" for rs in RULES.values() for r in rs]]
        command += ["--limit", str(args.limit)] if args.limit else []
        command += ["--per-category", str(args.per_category)] if args.per_category else []
        if subprocess.run(command, cwd=ROOT).returncode:
            raise SystemExit("eval.acceptance failed")
    results = [r for r in json.loads((out / "acceptance.json").read_text())["results"] if r.get("quality")]
    lines = [f"# Relaxed acceptance: the frontier ({args.suite}, γ {args.gamma}, greedy)", "",
             "| drafter | rule | accepted_mean | speedup vs generate | identical | NLL per token (greedy's) | correct "
             "(the verifier alone's) | correct per category |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["label"], r.get("relaxed") or "")):
        q = r["quality"]
        per = "; ".join(f"{c} {v['correct']:.2f} ({v['reference_correct']:.2f})"
                        for c, v in q.get("correct_per_category", {}).items())
        lines.append(f"| {r['label']} | {r.get('lossy_label') or 'exact'} | {r['accepted_mean']:.2f} | "
                     f"{r['speedup_vs_generate']:.2f} | {q['identical']:.3f} | {q['nll_per_token']:.3f} "
                     f"({q['reference_nll_per_token']:.3f}) | "
                     + (f"{q['correct']:.3f} ({q['reference_correct']:.3f})" if "correct" in q else "-")
                     + f" | {per or '-'} |")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"topk": "o", "ratio": "s", "typical": "^", None: "*"}
    for label, style in (("baseline", "--"), ("aligned", "-")):
        for rule, marker in markers.items():
            rows = [r for r in results if r["label"] == label and ((r.get("lossy") or {}).get("rule") == rule)]
            exact = [r for r in results if r["label"] == label and not r.get("lossy")]
            rows = sorted(exact + rows, key=lambda r: -quality_axis(r)[1]) if rule else exact
            if not rows:
                continue
            name = f"{label}: {rule or 'exact'}"
            for ax, key in zip(axes, ("accepted_mean", "speedup_vs_generate")):
                ax.plot([quality_axis(r)[1] for r in rows], [r[key] for r in rows], style, marker=marker, label=name)
    axis = quality_axis(results[0])[0]
    axes[0].set(xlabel=f"quality: {axis}", ylabel="accepted per block", title="Accepted against quality")
    axes[1].set(xlabel=f"quality: {axis}", ylabel="tokens/s ÷ generate's", title="Speed against quality")
    for ax in axes:
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("Relaxed (LOSSY) acceptance: outputs are no longer the verifier's")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    print(f"\n{out / 'frontier.md'}, {out / 'frontier.png'}")


if __name__ == "__main__":
    main()
