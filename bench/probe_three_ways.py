"""The probe three ways: the seed probe's eight prompts under exact greedy verification, speculative sampling
(lossless in distribution) and a relaxed (LOSSY) rule at its measured quality cost, beside the seed's figures.

    python bench/probe_three_ways.py --ckpt runs/smollm2-dflash/final --rule ratio:0.5 \\
        --out runs/bench/probe-smollm2
    python bench/probe_three_ways.py --ckpt zoo:gemma3-diffusiongemma --unaligned --verifier zoo:gemma3-270m \\
        --rule ratio:0.5 --max-new-tokens 32 --out runs/bench/probe-gemma3

One ``eval.acceptance`` run on ``--suite probe8`` (the export's base drafter as the unaligned one, γ ``--gamma``,
temperatures 0 and 1, ``--relaxed RULE``); then the table (``--out``/probe.md): per prompt and drafter, the accepted
draft tokens of the first block that offered a draft (k/γ, the seed's measure) and the mean per block, three ways;
under it, what the relaxed rule cost over the eight outputs (identical to the verifier's greedy output, the
verifier's NLL per token against its greedy output's). The seed drafted each response as one block of its own length
(9 to 48 tokens); ours are blocks of γ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = (("exact greedy", 0.0, False), ("speculative sampling (T 1)", 1.0, False), ("relaxed", 0.0, True))


def pick(results: list[dict], label: str, temperature: float, relaxed: bool) -> dict | None:
    """The K-1 result of ``label`` at ``temperature``, the relaxed rule's or the exact one's."""
    return next((r for r in results if r["label"] == label and r["temperature"] == temperature and r["k"] == 1
                 and bool(r.get("relaxed")) == relaxed and not r.get("stop_below")), None)


def table(document: dict, rule: str, unaligned: bool = False, prompts: list[dict] | None = None) -> str:
    """The per-prompt table, three ways per drafter, beside the seed's figures, and the relaxed rule's cost
    (``unaligned``: the only drafter measured, under eval.acceptance's label 'aligned', is an unaligned one;
    ``prompts``: the probe's rows, default the probe8 suite's)."""
    if prompts is None:
        from eval.suites import load_suite

        prompts = load_suite("probe8")
    labels = [label for label in ("baseline", "aligned") if pick(document["results"], label, 0.0, False)]
    names = {"baseline": "unaligned", "aligned": "unaligned" if unaligned else "aligned"}
    ways = [(way.replace("relaxed", f"LOSSY {rule}"), t, relaxed) for way, t, relaxed in WAYS]
    head = ["prompt", "category", "seed: DiffusionGemma → Gemma"]
    head += [f"{names[label]}: {way}" for label in labels for way, _, _ in ways]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = {(label, i): {p["id"]: p for p in (pick(document["results"], label, t, relaxed) or {}).get("per_prompt", [])}
            for label in labels for i, (_, t, relaxed) in enumerate(ways)}

    def cell(record: dict | None) -> str:
        if not record or not record.get("first_drafted"):
            return "-"
        k, gamma = record["first_drafted"]
        mean = record["accepted_mean"]
        return f"{k}/{gamma} ({mean:.2f})" if mean is not None else f"{k}/{gamma}"

    for p in prompts:
        cells = [p["prompt"], p["category"], f"{p.get('reported_accepted')}/{p.get('reported_block')}"]
        cells += [cell(rows[(label, i)].get(p["id"])) for label in labels for i in range(len(ways))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each cell: the first drafted block's accepted/γ (the mean accepted per block over the whole output).",
              ""]
    for label in labels:
        parts = []
        for way, t, relaxed in ways:
            r = pick(document["results"], label, t, relaxed)
            if r is None:
                continue
            part = f"{way} {r['accepted_mean']:.2f} per block, τ {r['tau']:.2f}"
            if relaxed and r.get("quality"):
                q = r["quality"]
                part += (f" — outputs identical to the verifier's {q['identical']:.0%}, the verifier's NLL per token "
                         f"{q['nll_per_token']:.3f} against its greedy output's {q['reference_nll_per_token']:.3f}")
            parts.append(part)
        lines.append(f"- {names[label]}: " + "; ".join(parts))
    seed = [p["reported_accepted"] for p in prompts if p.get("reported_accepted") is not None]
    lines.append(f"- seed: {sum(seed) / len(seed):.1f} accepted per (whole-response) block")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="the aligned drafter (its meta.json's base drafter is the unaligned)")
    p.add_argument("--unaligned", action="store_true", help="--ckpt is an unaligned drafter (e.g. a zoo drafter), "
                   "measured alone; give --verifier")
    p.add_argument("--verifier", default=None, help="the verifier (default: the drafter's meta.json's)")
    p.add_argument("--rule", default="ratio:0.3", help="the relaxed rule (align/relaxed.py), chosen on a frontier")
    p.add_argument("--gamma", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="runs/bench/probe")
    p.add_argument("--table-only", action="store_true", help="rewrite the table from the existing acceptance.json")
    args = p.parse_args()
    from align.errors import AlignError
    from align.relaxed import parse

    try:
        parse(args.rule)  # a malformed rule is refused before any model loads
    except AlignError as error:
        raise SystemExit(f"error: {error}") from None
    out = ROOT / args.out
    if not args.table_only:
        command = [sys.executable, "-m", "eval.acceptance", "--ckpt", args.ckpt, "--suite", "probe8", "--gamma",
                   str(args.gamma), "--k", "1", "--temperature", "0,1", "--stop-below", "0",
                   "--max-new-tokens", str(args.max_new_tokens), f"--relaxed={args.rule}", "--out", str(out)]
        command += ["--baseline", "none"] if args.unaligned else []
        command += ["--verifier", args.verifier] if args.verifier else []
        if subprocess.run(command, cwd=ROOT).returncode:
            raise SystemExit("eval.acceptance failed")
    text = table(json.loads((out / "acceptance.json").read_text()), args.rule, args.unaligned)
    (out / "probe.md").write_text(f"# The probe three ways (γ {args.gamma})\n\n{text}\n")
    print(text)
    print(f"\n{out / 'probe.md'}")


if __name__ == "__main__":
    main()
