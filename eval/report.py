"""The acceptance report: Markdown tables and PNG plots a reader can understand without the JSON.

Plots: acceptance by block position before/after, accepted per block by category before/after (with the
verifier's entropy), accepted_mean and speedup against γ (when several γ were run), and the K sweep of
self-selection (when several K were run). The main setting is the first value of every swept flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from align.files import atomic_path, write_text  # noqa: E402

COLORS = {"baseline": "#9a9a9a", "aligned": "#1f6fb4", "ar": "#d62728", "dflash": "#2ca02c"}
PALETTE = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")  # for labels of other drafters
#: what a drafter of each family is, in the report's first paragraph
KINDS = {"ar": "autoregressive: standard speculative decoding", "dflash": "reads the verifier's hidden states"}


def labels_of(results: list[dict[str, Any]]) -> list[str]:
    """The drafters' labels in the order tables and plots show them: baseline, aligned, then the others as given."""
    seen = list(dict.fromkeys(r["label"] for r in results))
    return [x for x in ("baseline", "aligned") if x in seen] + [x for x in seen if x not in ("baseline", "aligned")]


def color(label: str, results: list[dict[str, Any]]) -> str:
    if label in COLORS:
        return COLORS[label]
    others = [x for x in labels_of(results) if x not in COLORS]
    return PALETTE[others.index(label) % len(PALETTE)] if label in others else "#333333"


def _block_rule(r: dict[str, Any]) -> str:
    """How a block ends or branches, where the setting says: the stop rule, the tree."""
    stop = f" stop<{r['stop_below']:g}" if r.get("stop_below") else ""
    return stop + (f" tree {r['tree']}" if r.get("tree") else "")


def setting_name(r: dict[str, Any]) -> str:
    name = f"γ={r['gamma']} T={r['steps']} temp={r['temperature']:g} k={r['k']}" + _block_rule(r)
    if r.get("lossy_label"):
        name += f" {r['lossy_label']}"
    if r["k"] > 1:
        name += f" {r['scorer']}/{r['candidates']}@{r['drafter_temperature']:g}"
    return name


def _pm(r: dict[str, Any], key: str, fmt: str = "{:.2f}") -> str:
    value = fmt.format(r[key])
    if r.get(key + "_std") and len(r.get("seeds", [])) > 1:
        value += " ± " + fmt.format(r[key + "_std"])
    return value


def summary_table(results: list[dict[str, Any]]) -> str:
    """One row per drafter and setting: accepted_mean and τ (never confused), speed and losslessness."""
    lines = ["| setting | drafter | accepted_mean | τ (tokens per verifier call) | 1 + accepted_mean (vLLM's mean "
             "acceptance length) | acceptance rate | expected τ (from α) | tokens/s | verifier alone tokens/s (cached "
             "loop) | speedup | HF generate tokens/s | speedup vs generate | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (setting_name(r), r["label"] != "baseline")):
        lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}.get(r["lossless"], "n/a: LOSSY rule")
        counts = r.get("lossless_counts")
        if counts and (counts["near_tie"] or counts["mismatch"]):  # bf16 and friends: say what kind of difference
            lossless += f" ({counts['exact']} exact, {counts['near_tie']} near-tie, {counts['mismatch']} mismatch)"
        lines.append(f"| {setting_name(r)} | {r['label']} | {_pm(r, 'accepted_mean')} | {_pm(r, 'tau')} | "
                     f"{1 + r['accepted_mean']:.2f} | {r['acceptance_rate']:.3f} | {r['expected_tau']:.2f} | {_pm(r, 'tokens_per_s', '{:.1f}')} | "
                     f"{r['ar_tokens_per_s']:.1f} | {_pm(r, 'speedup')} | "
                     f"{_fmt(r.get('generate_tokens_per_s'), '{:.1f}')} | {_fmt(r.get('speedup_vs_generate'))} | "
                     f"{lossless} |")
    return "\n".join(lines)


def alternatives_table(document: dict[str, Any]) -> str:
    """Every method of the run against HF generate: the alternatives a user already has (prompt lookup, an
    assistant model, through generate) and the drafters through align's loop (each at every setting it ran, greedy
    and sampled apart), with τ where it can be counted and the outputs against generate's."""
    lines = ["| method | temperature | tokens/s | speedup vs generate | speedup vs the cached loop | τ (tokens per "
             "verifier call) | outputs equal to generate's |", "|---|---|---|---|---|---|---|"]
    rows = list(document.get("alternatives") or [])
    rows += [dict(r, label=f"{r['label']} ({setting_name(r)})") for r in _per_setting(document["results"])]
    generate = {}
    for r in rows:
        generate.setdefault(r["temperature"], r["generate_tokens_per_s"])
    for temperature, rate in generate.items():
        lines.append(f"| generate (the verifier alone) | {temperature:g} | {rate:.1f} | 1.00 | - | 1.00 | - |")
    for r in sorted(rows, key=lambda r: (r["temperature"], -r["speedup_vs_generate"])):
        lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}.get(r["lossless"], "n/a: LOSSY rule")
        lines.append(f"| {r['label']} | {r['temperature']:g} | {_pm(r, 'tokens_per_s', '{:.1f}')} | "
                     f"{r['speedup_vs_generate']:.2f} | {_pm(r, 'speedup')} | {_pm(r, 'tau')} | {lossless} |")
    return "\n".join(lines)


def category_speed_table(document: dict[str, Any]) -> str:
    """Per category, each method's tokens/s over generate's on the same prompts, at the run's lowest temperature:
    where each one wins."""
    temperature = min(r["temperature"] for r in document["results"])
    rows = [r for r in document.get("alternatives") or [] if r["temperature"] == temperature]
    settings = _per_setting([r for r in document["results"] if r["temperature"] == temperature])
    several = len(settings) > len({r["label"] for r in settings})  # a label at several settings: name each
    rows += [dict(r, label=f"{r['label']} ({_short(r)})" if several else r["label"]) for r in settings]
    rows = [r for r in rows if r.get("per_category_speedup_vs_generate")]
    if not rows:
        return "(no per-category speeds)"
    cats = list(rows[0]["per_category_speedup_vs_generate"])
    lines = ["| category | " + " | ".join(r["label"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for cat in cats:
        values = [r["per_category_speedup_vs_generate"].get(cat) for r in rows]
        best = max((v for v in values if v is not None), default=None)
        lines.append(f"| {cat} | " + " | ".join("-" if v is None else (f"**{v:.2f}**" if v == best else f"{v:.2f}")
                                                  for v in values) + " |")
    lines.append("| **all** | " + " | ".join(f"{r['speedup_vs_generate']:.2f}" for r in rows) + " |")
    return "\n".join(lines)


def relaxed_table(results: list[dict[str, Any]]) -> str:
    """Every greedy result that was measured for quality, exact and LOSSY side by side: what a relaxed rule gains in
    acceptance and speed, and what it costs (eval/quality.py)."""
    rows = [r for r in results if r.get("quality")]
    lines = ["| drafter | rule | accepted_mean | tokens/s | speedup vs generate | outputs identical to the verifier's | "
             "first divergence (token) | verifier NLL per token (its greedy output's) | correct (the verifier "
             "alone's) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["label"], r.get("lossy_label") or "")):
        q = r["quality"]
        nll = f"{q['nll_per_token']:.3f} ({q['reference_nll_per_token']:.3f})" if q["nll_per_token"] is not None else "-"
        right = f"{q['correct']:.3f} ({q['reference_correct']:.3f})" if "correct" in q else "-"
        lines.append(f"| {r['label']} | {r.get('lossy_label') or 'exact'} | {r['accepted_mean']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f} | {q['identical']:.3f} | "
                     f"{_fmt(q['first_divergence'], '{:.1f}')} | {nll} | {right} |")
    return "\n".join(lines)


def cost_table(results: list[dict[str, Any]]) -> str:
    """Where a block's time goes, in steps of the verifier-alone loop (1 step = 1 / its tokens/s), and the cost
    model's speedup beside the measured one:

        cost = c_draft + c_verify + c_loop   (per block, in verifier-alone steps)     speedup ≈ τ / cost

    ``bound``: τ / c_verify, the speedup if drafting and the loop were free."""
    lines = ["| setting | drafter | block (ms) | drafter pass (ms) | verifier pass (ms) | block cost (verifier-alone "
             "steps) | cost model τ / cost | measured speedup | bound τ / c_verify |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (setting_name(r), r["label"])):
        if not r.get("n_blocks") or not r.get("ar_tokens_per_s"):
            continue
        step_ms = 1000.0 / r["ar_tokens_per_s"]
        block, draft, verify = (1000.0 * r[k] / r["n_blocks"] for k in ("total_s", "drafter_s", "verifier_s"))
        lines.append(f"| {setting_name(r)} | {r['label']} | {block:.2f} | {draft:.2f} | {verify:.2f} | "
                     f"{block / step_ms:.2f} | {r['tau'] * step_ms / block:.2f} | {r['speedup']:.2f} | "
                     f"{r['tau'] * step_ms / verify:.2f} |")
    return "\n".join(lines)


def _per_setting(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each label's results at each setting (mean over seeds where there are several: the first found), in order."""
    keys = ("gamma", "steps", "temperature", "k", "scorer", "candidates", "drafter_temperature", "stop_below",
            "relaxed", "tree")
    seen: dict[tuple, dict[str, Any]] = {}
    for r in results:
        seen.setdefault((r["label"], *(str(r.get(k)) for k in keys)), r)
    return list(seen.values())


def _short(r: dict[str, Any]) -> str:
    """The setting in few words: γ, and the stop rule or tree where there is one."""
    return f"γ {r['gamma']}" + _block_rule(r)


def _main(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The main setting's result for each label (each drafter at its first T: drafters may draft in different T)."""
    first = results[0]
    keys = ("gamma", "temperature", "k", "scorer", "candidates", "drafter_temperature", "stop_below", "relaxed", "tree")
    main: dict[str, dict[str, Any]] = {}
    for r in results:
        if all(r.get(k) == first.get(k) for k in keys):
            main.setdefault(r["label"], r)
    return main


def category_table(main: dict[str, dict[str, Any]]) -> str:
    labels = labels_of(list(main.values()))
    any_result = next(iter(main.values()))
    head = "| category | verifier entropy (nats) | " + " | ".join(f"accepted ({l})" for l in labels) + " | " + \
        " | ".join(f"rejected in verifier top-5 ({l})" for l in labels) + " |"
    lines = [head, "|---|---|" + "---|" * (2 * len(labels))]
    for cat in any_result["per_category"]:
        entropy = any_result["verifier_entropy"].get(cat)
        accepted = " | ".join(_fmt(main[l]["per_category"].get(cat)) for l in labels)
        top5 = " | ".join(_fmt(main[l]["rejected_in_top5"].get(cat)) for l in labels)
        lines.append(f"| {cat} | {_fmt(entropy, '{:.3f}')} | {accepted} | {top5} |")
    rho = " · ".join(f"{l}: {_fmt(main[l]['entropy_acceptance_spearman'])}" for l in labels)
    lines.append(f"\nRank correlation (Spearman) of verifier entropy with accepted per block across categories — {rho}")
    return "\n".join(lines)


def probe_table(main: dict[str, dict[str, Any]], prompts: dict[str, str]) -> str:
    """The published probe's format: accepted draft tokens in the first block out of γ, before -> after."""
    lines = ["| prompt | category | accepted k/γ (first block), before → after | mean accepted per block, before → after |",
             "|---|---|---|---|"]
    after = {p["id"]: p for p in main["aligned"]["per_prompt"]}
    before = {p["id"]: p for p in main["baseline"]["per_prompt"]} if "baseline" in main else {}
    for pid, a in after.items():
        b = before.get(pid)
        first = lambda p: f"{p['first_block'][0]}/{p['first_block'][1]}" if p and p["first_block"] else "-"
        lines.append(f"| {prompts.get(pid, pid)} | {a['category']} | {first(b)} → {first(a)} | "
                     f"{_fmt(b['accepted_mean'] if b else None)} → {_fmt(a['accepted_mean'])} |")
    return "\n".join(lines)


def _fmt(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


# ------------------------------------------------------------------------------------------------ plots


def plot_per_position(main: dict[str, dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in sorted(main.items()):
        alphas = r["per_position"]
        xs = [j + 1 for j, a in enumerate(alphas) if a is not None]
        ax.plot(xs, [a for a in alphas if a is not None], marker="o", color=color(label, list(main.values())), label=f"{label}: α_j")
        reach, share = [], 1.0
        for a in alphas:  # the share of blocks whose streak reaches position j: Π_{i<j} α_i
            reach.append(share)
            share *= a or 0.0
        ax.plot(range(1, len(reach) + 1), reach, ls="--", color=color(label, list(main.values())), alpha=0.7,
                label=f"{label}: share of blocks reaching j")
    ax.set(xlabel="block position j", ylabel="rate", ylim=(0, 1.02),
           title="Acceptance by block position (α_j: accepted at j given all before were)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_per_category(main: dict[str, dict[str, Any]], path: Path) -> None:
    labels = labels_of(list(main.values()))
    any_result = main[labels[0]]
    cats = sorted(any_result["per_category"], key=lambda c: any_result["verifier_entropy"].get(c) or 0)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [main[label]["per_category"].get(c) or 0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], values, width, label=label, color=color(label, list(main.values())))
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(cats))])
    ax.set_xticklabels([f"{c}\nH={any_result['verifier_entropy'].get(c) or 0:.2f}" for c in cats])
    ax.set(ylabel="accepted draft tokens per block", xlabel="category (H: verifier entropy, nats; low to high)",
           title=f"Accepted per block by category (γ={any_result['gamma']})")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_gamma(results: list[dict[str, Any]], path: Path) -> None:
    first = results[0]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in labels_of(results):
        rows = sorted((r for r in results if r["label"] == label and r["k"] == first["k"]
                       and r["temperature"] == first["temperature"] and r["steps"] == first["steps"]),
                      key=lambda r: r["gamma"])
        if rows:
            axes[0].plot([r["gamma"] for r in rows], [r["accepted_mean"] for r in rows], marker="o", label=label,
                         color=color(label, results))
            axes[1].plot([r["gamma"] for r in rows], [r["speedup"] for r in rows], marker="o", label=label,
                         color=color(label, results))
    axes[0].set(xlabel="block length γ", ylabel="accepted per block", title="Accepted draft tokens per block")
    axes[1].set(xlabel="block length γ", ylabel="tokens/s ÷ verifier alone (cached loop)", title="Wall-clock speedup")
    axes[1].axhline(1.0, color="black", lw=0.8, ls="--")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_k(results: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    groups: dict[tuple, list] = {}
    for r in results:
        if r["temperature"] == 0:
            key = (r["label"], r["scorer"] or "-", r["candidates"] or "-", r["drafter_temperature"])
            groups.setdefault(key, []).append(r)
    baselines = {r["label"]: r for r in results if r["k"] == 1 and r["temperature"] == 0}
    for (label, scorer, candidates, dt), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if scorer == "-":
            continue
        rows = sorted(rows + ([baselines[label]] if label in baselines else []), key=lambda r: r["k"])
        name = f"{label}: {scorer}/{candidates}@{dt:g}"
        axes[0].plot([r["k"] for r in rows], [r["accepted_mean"] for r in rows], marker="o", label=name)
        axes[1].plot([r["k"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
    axes[0].set(xlabel="drafts per block K", ylabel="accepted per block", title="Self-selection: accepted per block")
    axes[1].set(xlabel="drafts per block K", ylabel="tokens/s", title="Self-selection: wall-clock tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig, path: Path) -> None:
    """Save a figure as PNG under a temporary name, then rename it (a kill never leaves half a plot)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")


def write_report(document: dict[str, Any], out: Path) -> list[Path]:
    """Write report.md and its plots into ``out``; returns the files written."""
    results = document["results"]
    main = _main(results)
    written = [out / "per_position.png", out / "per_category.png"]
    plot_per_position(main, written[0])
    plot_per_category(main, written[1])
    sections = ["# Acceptance report", "",
                f"Suite **{document['suite']}** ({document['n_prompts']} prompts, at most "
                f"{document['max_new_tokens']} new tokens each). Verifier `{results[0]['verifier']}`; aligned drafter "
                f"`{main['aligned']['drafter']}`" + (f"; baseline `{main['baseline']['drafter']}`" if "baseline" in main
                                                   else "") +
                "".join(f"; {label}: `{r['drafter']}` ({r.get('family') or '?'}"
                        + (f", {KINDS[r.get('family')]}" if r.get("family") in KINDS else "") + ")"
                        for label, r in main.items() if label not in ("aligned", "baseline")) + ".",
                "", "Environment: " + ", ".join(f"{k} {v}" for k, v in document["environment"].items()), "",
                "`accepted_mean`: draft tokens the verifier kept per block (0..γ), pooled over the blocks that "
                "drafted. `τ`: tokens per verifier call, pooled over every call (a block that an accepted EOS ends "
                "adds no verifier token, and calls with no room for a draft count), so at most 1 + accepted_mean, "
                "vLLM's mean acceptance length. `expected τ`: what the per-position rates α_j imply "
                "(docs/metrics.md).", "",
                "Speed: `speedup` is tokens/s against the verifier alone in a minimal cached loop through the same "
                "verifier path (the prompt in one pass, then one token per step from the KV cache; "
                "`align.verifier.verifier_alone`), the same prompts, after a warm-up, device-synchronised timer. "
                "Hugging Face `generate` (whose output the lossless check compares with) is reported beside it; its "
                "per-step bookkeeping (logits processors, stopping criteria, input preparation) can make it slower "
                "than the minimal loop, and `speedup vs generate` then flatters.",
                "",
                "## Summary", "", summary_table(results), "",
                "## Against what a user already has", "", "Every method of this run against Hugging Face `generate`, "
                "each prompt through all of them in turn with `--interleave`: the alternatives through `generate` "
                "itself (prompt lookup, an assistant model: `--prompt-lookup`, `--assistant`), and the drafters "
                "through align's loop. τ counts the verifier's forward calls.", "", alternatives_table(document), "",
                "Speedup over `generate` per category (the best of each row in bold):", "",
                category_speed_table(document), "",
                "## Cost of a block", "", "Mean wall time per block (speculative loop) split into the drafter's "
                "pass and the verifier's scoring pass, and the block's cost in steps of the verifier-alone loop; the "
                "cost model's speedup τ / cost should match the measured one, and τ / c_verify bounds what a free "
                "drafter would give.", "", cost_table(results), "",
                f"## Per category ({setting_name(main['aligned'])})", "", category_table(main), "",
                "![accepted by category](per_category.png)", "", "## Per block position", "",
                "![acceptance by position](per_position.png)", ""]
    if len({r["gamma"] for r in results}) > 1:
        written.append(out / "gamma_sweep.png")
        plot_gamma(results, written[-1])
        sections += ["## Block length", "", "![accepted and speedup against gamma](gamma_sweep.png)", ""]
    if len({r["k"] for r in results}) > 1:
        written.append(out / "k_sweep.png")
        plot_k(results, written[-1])
        sections += ["## Self-selection", "", "![K sweep](k_sweep.png)", ""]
    if document["suite"] in ("tinyworld-probe", "probe8"):
        from eval.suites import load_suite

        prompts = {p["id"]: p["prompt"] for p in load_suite(document["suite"])}
        sections += ["## Per prompt (the probe's format)", "", probe_table(main, prompts), ""]
    if document.get("vllm"):
        sections += ["## Engines", "", "The same prompts through align's loop (hf) and through vLLM with "
                     "`align.serving.DiffusionProposer` (vLLM's own counters; speedup against the same engine "
                     "without speculation).", "", engine_table(document), ""]
    if any(r.get("lossy") for r in results):
        sections += ["## Relaxed (LOSSY) acceptance", "", "Rules that accept draft tokens the verifier would not have "
                     "chosen (align/relaxed.py): their outputs are NOT the verifier's. Beside each, what it costs "
                     "against the verifier alone's outputs on the same prompts (eval/quality.py).", "",
                     relaxed_table(results), ""]
    write_text(out / "report.md", "\n".join(sections))
    return [out / "report.md", *written]


def engine_table(document: dict[str, Any]) -> str:
    """engine × drafter × concurrency: accepted_mean, τ, tokens/s, speedup over the same engine alone, lossless."""
    lines = ["| engine | drafter | concurrency | accepted_mean | 1 + accepted_mean (vLLM's mean acceptance length) | "
             "τ (tokens per verifier call; vLLM does not count it) | tokens/s | same engine without speculation "
             "(tokens/s) | speedup | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}
    for r in document.get("results", []):
        if r["label"] in ("aligned", "baseline") and r["k"] == 1:
            lines.append(f"| hf | {r['label']} ({setting_name(r)}) | 1 | {r['accepted_mean']:.2f} | "
                         f"{1 + r['accepted_mean']:.2f} | {r['tau']:.2f} | "
                         f"{r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f} | "
                         f"{lossless.get(r['lossless'], 'n/a: LOSSY rule')} |")
    for r in document.get("vllm", {}).get("results", []):
        lines.append(f"| {r['engine']} | {r['label']} (γ={r['gamma']} T={r['steps']} temp={r['temperature']:g}) | "
                     f"{r['concurrency']} | {r['accepted_mean']:.2f} | {1 + r['accepted_mean']:.2f} | - | "
                     f"{r['tokens_per_s']:.1f} | "
                     f"{r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f} | {lossless[r['lossless']]} |")
    return "\n".join(lines)
