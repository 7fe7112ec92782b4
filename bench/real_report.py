"""The report of ``make real`` (``runs/real/report.md``), from the stage times and the evaluations' acceptance.json.

Per pair: the headline (Spec-Bench, greedy, γ 16, T 1, K 1: adapted against aligned, with τ, α_1..α_4, tokens/s and
the speedup over the verifier alone in the same loop), every setting of every suite, per Spec-Bench category, the
probe's own table beside the seed's figures, the block's time split, and losslessness (bf16 verdict counts; the
sampling check's p-values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.zoo.pairs import PAIRS
from eval.report import (alternatives_table, category_speed_table, category_table, cost_table, setting_name,
                         summary_table)


def _document(folder: Path) -> dict[str, Any] | None:
    path = folder / "acceptance.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _pick(results: list[dict], label: str, gamma: int = 16, temperature: float = 0.0, k: int = 1) -> dict | None:
    return next((r for r in results if r["label"] == label and r["gamma"] == gamma and r["temperature"] == temperature
                 and r["k"] == k and r["steps"] == 1), None)


def headline(results: list[dict]) -> str:
    lines = ["| drafter | accepted_mean | τ (tokens per verifier call) | 1 + accepted_mean (vLLM's mean acceptance "
             "length) | α_1 | α_2 | α_3 | α_4 | tokens/s | verifier alone tokens/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, name in (("baseline", "adapted (unaligned)"), ("aligned", "aligned")):
        r = _pick(results, label)
        if r is None:
            continue
        alphas = [f"{a:.3f}" if a is not None else "-" for a in (r["per_position"] + [None] * 4)[:4]]
        lines.append(f"| {name} | {r['accepted_mean']:.2f} | {r['tau']:.2f} | {1 + r['accepted_mean']:.2f} | "
                     + " | ".join(alphas) + f" | {r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f} | {'yes' if r['lossless'] else 'NO'} |")
    before, after = _pick(results, "baseline"), _pick(results, "aligned")
    if before and after and before["accepted_mean"] > 0:
        lines.append(f"\nAligned / adapted accepted_mean: **{after['accepted_mean'] / before['accepted_mean']:.2f}×**")
    return "\n".join(lines)


def probe_vs_seed(document: dict[str, Any], gamma: int = 16) -> str:
    """The published probe's eight prompts: its reported accepted/block beside ours (first block k/γ, and the mean
    per block), adapted → aligned, greedy, K 1."""
    from eval.suites import load_suite

    prompts = {p["id"]: p for p in load_suite("probe8")}
    rows = {label: {p["id"]: p for p in (_pick(document["results"], label, gamma) or {}).get("per_prompt", [])}
            for label in ("baseline", "aligned")}
    lines = ["| prompt | category | seed: DiffusionGemma → Gemma (accepted/block) | ours, first block k/γ: adapted → "
             "aligned | ours, accepted per block: adapted → aligned |", "|---|---|---|---|---|"]
    for pid, p in prompts.items():
        b, a = rows["baseline"].get(pid), rows["aligned"].get(pid)
        first = lambda r: f"{r['first_block'][0]}/{r['first_block'][1]}" if r and r["first_block"] else "-"
        mean = lambda r: f"{r['accepted_mean']:.2f}" if r and r["accepted_mean"] is not None else "-"
        seed = f"{p.get('reported_accepted')}/{p.get('reported_block')}"
        lines.append(f"| {p['prompt']} | {p['category']} | {seed} | {first(b)} → {first(a)} | {mean(b)} → {mean(a)} |")
    reported = [p.get("reported_accepted") for p in prompts.values() if p.get("reported_accepted") is not None]
    lines.append(f"\nSeed's mean: {sum(reported) / len(reported):.1f} accepted per (variable-length) block. Ours are "
                 f"blocks of γ = {gamma}: the seed's block was the whole response, drafted as one canvas.")
    return "\n".join(lines)


def bf16_counts(document: dict[str, Any]) -> str:
    r = document["results"][0]
    c = r.get("lossless_counts") or {}
    return (f"bfloat16, greedy, γ {r['gamma']}, {document['n_prompts']} prompts: {c.get('exact')} exact, "
            f"{c.get('near_tie')} near-tie, {c.get('mismatch')} mismatch (accepted_mean {r['accepted_mean']:.2f})")


def greedy_counts(documents: list[dict[str, Any]]) -> str:
    """The verdicts of every greedy generation of the pair's evaluations (each drafter, every setting), in the
    verifier's dtype of each."""
    totals = {"exact": 0, "near_tie": 0, "mismatch": 0}
    for document in documents:
        for r in document["results"]:
            for key in totals:
                totals[key] += (r.get("lossless_counts") or {}).get(key) or 0
    dtypes = "/".join(sorted({d["environment"].get("dtype", "float32") for d in documents}))
    return (f"{dtypes}, greedy, every drafter and setting of the evaluations above: {totals['exact']} exact, "
            f"{totals['near_tie']} near-tie, {totals['mismatch']} mismatch")


def write_real_report(out: Path, pairs: list[str], times: dict[str, list[float]]) -> Path:
    """``runs/real/report.md`` from the evaluations under ``out`` and the stage times (``bench/real.py``'s
    ``stages.json``: per stage, the seconds of every invocation that ran it, first to last)."""
    sections = ["# make real: the real pairs", "", "## Stages (seconds, 2 CPU cores; a stage run again by a resumed "
                "invocation shows each invocation's time, first to last)", "", "| stage | seconds |", "|---|---|"]
    sections += [f"| {stage} | {' + '.join(f'{s:.0f}' for s in seconds)} |" for stage, seconds in times.items()]
    sections.append(f"| **all** | **{sum(map(sum, times.values())):.0f}** |")
    for pair in pairs:
        top = _document(out / "eval" / f"{pair}-headline")
        if top:
            h = PAIRS[pair].headline
            sections += ["", f"## {pair}: the shipped drafter against what a user already has", "",
                         f"`{h.recipe}`'s drafter, on Spec-Bench ({top['n_prompts']} questions, first turns, "
                         f"{top['max_new_tokens']} new tokens, greedy), each question through every method in turn "
                         "(interleaved); `generate` is transformers' own, prompt lookup and assisted generation its "
                         f"`prompt_lookup_num_tokens` and `assistant_model` (the assistant: `{h.assistant_out}`, "
                         f"from `{h.assistant_init}`, trained on the same rollouts for the same time).", "",
                         alternatives_table(top), "", "Per category, tokens/s over `generate`'s:", "",
                         category_speed_table(top), "", "Every setting:", "", summary_table(top["results"]), "",
                         "The block's time split:", "", cost_table(top["results"]), ""]
        spec = _document(out / "eval" / f"{pair}-specbench")
        probe = _document(out / "eval" / f"{pair}-probe8")
        bf16 = _document(out / "eval" / f"{pair}-bf16")
        if spec or probe:
            sections += ["", f"## {PAIRS[pair].title}", ""]
        if spec:
            sections += [f"### Spec-Bench ({spec['n_prompts']} questions, first turns; greedy, γ 16, T 1, K 1)", "",
                         headline(spec["results"]), "", "### Spec-Bench, every setting", "",
                         summary_table(spec["results"]), "", "### Spec-Bench per category "
                         f"({setting_name(_pick(spec['results'], 'aligned') or spec['results'][0])})", "",
                         category_table({r["label"]: r for r in (_pick(spec["results"], "baseline"),
                                                                 _pick(spec["results"], "aligned")) if r}), "",
                         "### The block's time split (Spec-Bench)", "", cost_table(spec["results"]), ""]
        if probe:
            sections += ["### The probe's eight prompts beside the seed's figures", "", probe_vs_seed(probe), "",
                         "### The probe, every setting", "", summary_table(probe["results"]), ""]
        evaluated = [d for d in (top, probe, spec) if d]
        lossless = ([greedy_counts(evaluated)] if evaluated else []) + ([bf16_counts(bf16)] if bf16 else [])
        if lossless:
            sections += [f"### {pair}: lossless", ""] + [line for verdict in lossless for line in (verdict, "")]
        check = out / f"{pair}-sampling.json"
        if check.is_file():
            sections += [_sampling(json.loads(check.read_text())), ""]
    path = out / "report.md"
    path.write_text("\n".join(sections) + "\n")
    return path


def _sampling(result: dict[str, Any]) -> str:
    return (f"Sampling (temperature {result['temperature']}, {result['samples']} samples, γ {result['gamma']}): "
            f"first token chi-square p = {result['p_first']:.3f}, second token given the first's mode p = "
            f"{result['p_second']:.3f}; TV {result['tv_first']:.3f} / {result['tv_second']:.3f}")
