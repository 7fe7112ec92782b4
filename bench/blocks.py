"""Where each drafter setting's time goes, block by block: the blocks ``eval.acceptance --save-blocks`` wrote.

    python -m eval.acceptance ... --interleave --save-blocks --out runs/bench/headline
    python bench/blocks.py runs/bench/headline/blocks.jsonl --context 0,300,600,1000

Four tables, in markdown: per setting, what a block costs (drafter and verifier milliseconds) and earns (tokens);
for a drafter that looks the context up (``ngram...``), its blocks with a match (and by the length of the n-gram the
match followed) and without one apart, and how far their drafts were accepted; for such a drafter, its blocks
without a match by the block before them (what a gate that skips the drafter's pass could know beforehand); per
setting and context length, the verifier's milliseconds a block fitted as a + b · positions scored by least squares
(what a tree's node costs where decoding stands, against the cost probe's curve).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def setting_of(row: dict) -> str:
    """A row's label and setting as one name: ``mixed γ=8 tree 16x4/auto`` (temperature shown when not greedy)."""
    s = row["setting"]
    name = f"{row['label']} γ={s['gamma']}" + (f" tree {s['tree']}" if s.get("tree") else "")
    return name + (f" temp={s['temperature']}" if s.get("temperature") else "")


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = a + b · x over (x, y) points: (a, b); None where x takes fewer than two values."""
    n = len(points)
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def scored(row: dict) -> int:
    """The positions a block's pass scored after its root: a tree's nodes, a chain's draft tokens (0: a plain step)."""
    return row["gamma"] if row["nodes"] is None else row["nodes"]


def cost(rows: list[dict]) -> dict:
    """What the blocks cost and earned: their count, tokens per block, accepted draft tokens per block, positions
    scored per block (``nodes``: :func:`scored`), drafter and verifier milliseconds per block, tokens per second over
    their whole time."""
    n = len(rows)
    total = sum(r["total_s"] for r in rows)
    return {"blocks": n, "tokens": sum(r["produced"] for r in rows) / n,
            "accepted": sum(r["accepted"] for r in rows) / n,
            "nodes": sum(map(scored, rows)) / n,
            "drafter_ms": 1000 * sum(r["drafter_s"] for r in rows) / n,
            "verifier_ms": 1000 * sum(r["verifier_s"] for r in rows) / n,
            "tokens_per_s": sum(r["produced"] for r in rows) / total if total else 0.0}


def after(rows: list[dict]) -> dict[str, dict[str, list[float]]]:
    """What a gate before the drafter's pass could read: a lookup drafter's blocks without a match (where the pass
    is all the block drafts from), grouped by the block before them in the same output — its accepted tokens
    (``0``, ``1``, ``2+``) and the verifier's mean entropy over its tokens (``entropy < 1``, ``1–2``, ``≥ 2``
    nats) — as [blocks, accepted a block]."""
    groups: dict[str, dict[str, list[float]]] = {"accepted before": {}, "entropy before": {}}
    for before, block in zip(rows, rows[1:]):
        if block["index"] != before["index"] + 1 or block.get("matched") is None or block["matched"]:
            continue
        keys = {"accepted before": "2+" if before["accepted"] >= 2 else str(before["accepted"]),
                "entropy before": "< 1" if before["entropy"] < 1 else "1–2" if before["entropy"] < 2 else "≥ 2"}
        for kind, key in keys.items():
            count, total = groups[kind].get(key, [0, 0.0])
            groups[kind][key] = [count + 1, total + block["accepted"]]
    return {kind: {key: [n, total / n] for key, (n, total) in sorted(g.items())} for kind, g in groups.items()}


def summarise(rows: list[dict], edges: list[int]) -> dict:
    """Per setting: ``all`` (:func:`cost` of its blocks), ``match``, ``no match`` and ``match after N`` (a lookup
    drafter's blocks with a match, without one, and with a match after a suffix n-gram of N tokens, each with
    ``accepted_counts``), ``by_context`` (per context bin [lo, hi): its block count
    and the fit verifier ms = a + b · positions scored (:func:`scored`), None where they took one value; the
    prompt's pass, a prefill, left out) and, for a lookup drafter, ``after`` (:func:`after`)."""
    settings: dict[str, list[dict]] = {}
    for r in rows:
        settings.setdefault(setting_of(r), []).append(r)
    out: dict[str, dict] = {}
    for name, mine in settings.items():
        entry = {"all": cost(mine)}
        drafted = [r for r in mine if r.get("matched") is not None]
        lengths = sorted({r["matched"] for r in drafted if r["matched"]})
        for part, chosen in (("match", [r for r in drafted if r["matched"]]),
                             ("no match", [r for r in drafted if not r["matched"]]),
                             *((f"match after {n}", [r for r in drafted if r["matched"] == n]) for n in lengths)):
            if chosen:
                entry[part] = cost(chosen) | {"accepted_counts": dict(sorted(Counter(r["accepted"] for r in chosen)
                                                                              .items()))}
        bins = []
        for lo, hi in zip(edges, edges[1:] + [None]):
            inside = [r for r in mine if r["index"] and r.get("context") is not None  # not the prompt's pass
                      and r["context"] >= lo and (hi is None or r["context"] < hi)]
            if inside:
                bins.append({"context": [lo, hi], "blocks": len(inside),
                             "fit": fit([(scored(r), 1000 * r["verifier_s"]) for r in inside])})
        entry["by_context"] = bins
        if "no match" in entry:
            entry["after"] = after(mine)
        out[name] = entry
    return out


def tables(summary: dict) -> str:
    """:func:`summarise`'s result as markdown tables."""
    lines = ["| setting | blocks | tokens a block | positions scored a block | drafter ms | verifier ms | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in summary.items():
        c = entry["all"]
        lines.append(f"| {name} | {c['blocks']} | {c['tokens']:.2f} | {c['nodes']:.1f} | {c['drafter_ms']:.1f} | "
                     f"{c['verifier_ms']:.1f} | {c['tokens_per_s']:.1f} |")
    looked = [(name, part, c) for name, entry in summary.items() for part, c in entry.items()
              if part.startswith(("match", "no match"))]
    if looked:
        lines += ["", "| setting | blocks | share | accepted a block | accepted: blocks | positions scored | "
                      "drafter ms | verifier ms | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
        for name, part, c in looked:
            share = c["blocks"] / sum(summary[name][p]["blocks"] for p in ("match", "no match") if p in summary[name])
            counts = " ".join(f"{k}:{v}" for k, v in c["accepted_counts"].items())
            lines.append(f"| {name}, {part} | {c['blocks']} | {share:.0%} | {c['accepted']:.2f} | {counts} | "
                         f"{c['nodes']:.1f} | {c['drafter_ms']:.1f} | {c['verifier_ms']:.1f} | "
                         f"{c['tokens_per_s']:.1f} |")
    gated = [(name, entry["after"]) for name, entry in summary.items() if "after" in entry]
    if gated:
        lines += ["", "| setting: blocks without a match, after a block of | blocks | accepted a block |",
                  "|---|---|---|"]
        for name, groups in gated:
            for kind, group in groups.items():
                for key, (n, mean) in group.items():
                    lines.append(f"| {name}: {kind.split()[0]} {key} | {n} | {mean:.2f} |")
    lines += ["", "| setting | context | blocks | verifier ms = a + b · positions scored |", "|---|---|---|---|"]
    for name, entry in summary.items():
        for b in entry["by_context"]:
            lo, hi = b["context"]
            f = b["fit"]
            lines.append(f"| {name} | {lo}–{'' if hi is None else hi - 1} | {b['blocks']} | "
                         + ("one size only" if f is None else f"{f[0]:.1f} + {f[1]:.2f} · n") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("blocks", help="blocks.jsonl from python -m eval.acceptance --save-blocks")
    p.add_argument("--context", default="0,300,600,1000",
                   help="context lengths where the bins of the cost fit start (comma list, increasing)")
    p.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = p.parse_args(argv)
    from align.errors import AlignError

    try:
        edges = [int(x) for x in args.context.split(",")]
    except ValueError:
        edges = []
    if not edges or edges != sorted(set(edges)) or edges[0] < 0:
        raise AlignError(f"--context takes increasing lengths from 0 up (e.g. 0,300,600,1000), got '{args.context}'")
    path = Path(args.blocks)
    if not path.is_file():
        raise AlignError(f"{path} is not a file: run python -m eval.acceptance with --save-blocks first")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise AlignError(f"{path} holds no blocks")
    summary = summarise(rows, edges)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(tables(summary), end="")
    return 0


if __name__ == "__main__":
    from align.errors import run_cli

    run_cli(main)
