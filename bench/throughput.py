"""Throughput benchmarks, one section per flag.

    python bench/throughput.py --decode                                   # zoo verifier, zoo:tiny-diffusiongemma
    python bench/throughput.py --decode --drafter runs/tiny/final         # an aligned export (meta.json: verifier)
    python bench/throughput.py --decode --prompts 16 --gammas 8,16,32 --repeats 5 --json out.json
    python bench/throughput.py --train [--replica]                         # packed vs per-window training

Training (``--train``, :func:`train_section`): the trainer's own step (``align.distill.strategy.train_step``:
forward, the recipe's loss, backward and the optimizer step, through DeepSpeed) over global batches of windows
taken in the trainer's order, per window and packed, after one untimed batch: windows/s, and the share of the
positions the model ran (padding included) that carry a label; on ``recipes/tiny.yaml``'s rollouts with its drafter,
and with ``--replica`` on zoo:replica-diffusiongemma (Gemma's structure, random weights) with random-token rollouts.
Three paths: per window, packed in the recipe's groups (``data.group_size``), and packed in whole rollouts (each
read once); beside them the ceiling, :func:`packing_ceiling`, the most packing can gain on those rollouts. Then the
per-window path's micro-batches (32 of 64, ``recipes/tiny-mdlm.yaml``'s; 8 of 128, the GPU recipes') cut from
each global batch in random order and, as the trainer cuts them, by prefix length.

Decoding (``--decode``, :func:`decode_section`): the verifier and a DiffusionGemma drafter on N held-out tinyworld
prompts, greedy. Two paths, measured in the same run: "before", the models' own forwards (``Drafter(lean=False)``,
``Verifier(lean=False)``, what ``ALIGN_LEAN=0`` selects), and "after", the lean passes (the default). Every path is
warmed up first; the rounds (``--repeats``) run the paths alternately, so that the load of a shared CPU falls on
both. Timer: ``align.metrics.now`` (device synchronised). Reported figures are medians over all blocks (or steps) of
all prompts and rounds, except tokens/s (all tokens over all wall time).

Per γ: the block's time split (drafter pass, verifier scoring pass, the loop's own work: prefix, draft, acceptance,
bookkeeping), the block's cost in steps of the verifier alone, and tokens/s against the verifier alone. The verifier
alone is the minimal cached greedy loop through the same ``Verifier`` path (``align.verifier.verifier_alone``: the
prompt in one pass, then one token per step from the KV cache); Hugging Face ``generate`` is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PATHS = {"before": False, "after": True}  # label -> lean
PATH_NAMES = {"before": "before (model forwards)", "after": "after (lean passes)"}


def comma_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got '{text}'")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/throughput.py", description=__doc__.split("\n\n")[0])
    sections = p.add_argument_group("sections (at least one)")
    sections.add_argument("--decode", action="store_true", help="speculative decoding: block time split, speedup")
    sections.add_argument("--train", action="store_true", help="training windows/s: packed vs per window")
    t = p.add_argument_group("training")
    t.add_argument("--micro", type=int, default=256, help="windows per micro-batch (tiny recipe)")
    t.add_argument("--train-steps", type=int, default=4, help="timed micro-batches per path")
    t.add_argument("--replica", action="store_true", help="also the Gemma-structured replica (random weights)")
    t.add_argument("--replica-micro", type=int, default=32, help="windows per micro-batch (replica)")
    t.add_argument("--replica-prompt", type=int, default=128, help="replica rollouts: prompt tokens")
    t.add_argument("--replica-response", type=int, default=256, help="replica rollouts: response tokens")
    d = p.add_argument_group("decoding")
    d.add_argument("--drafter", default="zoo:tiny-diffusiongemma",
                   help="a DiffusionGemma drafter (zoo:NAME or a folder)")
    d.add_argument("--verifier", default=None,
                   help="the verifier (default: the drafter's meta.json names it, else zoo:tiny-verifier)")
    d.add_argument("--suite", default="tinyworld", help="prompt suite (default: tinyworld, its held-out prompts)")
    d.add_argument("--prompts", type=int, default=8, help="number of prompts (the suite's first N)")
    d.add_argument("--gammas", type=comma_ints, default=[8, 16], help="block lengths (comma list)")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3, help="timed rounds over all prompts, per path")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    d.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if not (args.decode or args.train):
        p.error("choose a section: --decode and/or --train")
    if args.prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--prompts, --repeats and --max-new-tokens must be at least 1")
    return args


# ------------------------------------------------------------------------------------------------ decoding


def _built(path: str) -> str:
    """``path``, refusing a zoo model that is not built (this benchmark never starts a build)."""
    from align.zoo import is_built, model_dir

    if path.startswith("zoo:"):
        name = path[len("zoo:"):]
        if not is_built(name):
            raise SystemExit(f"{path} is not built ({model_dir(name)}/zoo.json is missing): "
                             f"build it first with python -m align.zoo build {name}")
        return str(model_dir(name))
    return path


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def _spread_ms(values: list[float]) -> str:
    """The middle half (25th-75th percentile), ms: how much the timings moved."""
    if len(values) < 4:
        return "-"
    q = statistics.quantiles(values, n=4)
    return f"{q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}"


def decode_section(args: argparse.Namespace) -> dict[str, Any]:
    """Speculative decoding's block, part by part, before and after, against the verifier alone."""
    import torch

    from align.drafters import load_drafter
    from align.loading import default_device, load_verifier_model
    from align.metrics import now
    from align.models.diffusiongemma_pass import DiffusionGemmaPass
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, eos_ids, verifier_alone
    from eval.suites import load_suite

    drafter_path = _built(args.drafter)
    meta = Path(drafter_path) / "meta.json"
    verifier_path = args.verifier or (json.loads(meta.read_text()).get("verifier") if meta.is_file() else None) \
        or "zoo:tiny-verifier"
    verifier_path = _built(verifier_path)
    device = args.device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, args.dtype, device)
    eos = eos_ids(verifier_model, tokenizer)
    prompts = load_suite(args.suite)[:args.prompts]
    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]
    n_new = args.max_new_tokens

    verifiers = {label: Verifier(verifier_model, lean=lean) for label, lean in PATHS.items()}
    drafters = {}  # an export drafts as it was trained (its fixed canvas, its first token): the one loader reads it
    for label, lean in PATHS.items():
        drafters[label] = load_drafter(drafter_path, verifier_path, verifier_model, family="diffusiongemma",
                                       dtype=args.dtype, device=device, verifier_tokenizer=tokenizer)
        drafters[label].lean = lean
        drafters[label].reset()  # lean takes effect here
    drafter_model = drafters["after"].model
    decoders = {label: SpeculativeDecoder(drafters[label], verifiers[label], eos) for label in PATHS}
    reason = DiffusionGemmaPass.supported(drafter_model)
    lean_pass = drafters["after"].lean_pass
    fused = lean_pass is not None and lean_pass.fused and args.dtype == "float32"
    print(f"verifier {verifier_path} ({sum(p.numel() for p in verifier_model.parameters()) / 1e6:.2f}M parameters)")
    kind = "one fused encoder+decoder pass" if fused else "two passes" if lean_pass else f"not supported: {reason}"
    print(f"drafter  {drafter_path} ({sum(p.numel() for p in drafter_model.parameters()) / 1e6:.2f}M parameters); "
          f"lean pass: {kind}")
    load = ", load average %.2f %.2f %.2f" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    print(f"device {device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}{load}; {len(encoded)} "
          f"{args.suite} prompts, at most {n_new} new tokens, {args.repeats} timed rounds after a warm-up\n")

    # warm-up: every path once (the lean pass compares itself with the model's forward on its first call)
    for label in PATHS:
        verifier_alone(verifiers[label], encoded[0], n_new, eos)
        for gamma in args.gammas:
            decoders[label].generate(encoded[0], n_new, gamma)
    ar_generate(verifier_model, encoded[0], n_new, 0.0, eos)
    if lean_pass is not None and not lean_pass.usable:
        print("WARNING: the lean pass disagreed with the model's forward and was switched off\n")

    alone = {label: {"steps": [], "tokens": 0, "seconds": 0.0, "outputs": []} for label in PATHS}
    generate = {"tokens": 0, "seconds": 0.0, "outputs": []}
    spec = {(label, g): {"blocks": [], "tokens": 0, "seconds": 0.0, "outputs": []}
            for label in PATHS for g in args.gammas}
    for round_ in range(args.repeats):
        first = round_ == 0
        for ids in encoded:
            start = now(device)
            out = ar_generate(verifier_model, ids, n_new, 0.0, eos)
            generate["seconds"] += now(device) - start
            generate["tokens"] += len(out)
            if first:
                generate["outputs"].append(out)
        for label in (PATHS if round_ % 2 == 0 else reversed(list(PATHS))):
            for ids in encoded:
                run = verifier_alone(verifiers[label], ids, n_new, eos)
                a = alone[label]
                a["steps"] += run.step_times
                a["tokens"] += len(run.tokens)
                a["seconds"] += run.total_s
                if first:
                    a["outputs"].append(run.tokens)
            for gamma in args.gammas:
                s = spec[(label, gamma)]
                for ids in encoded:
                    gen = decoders[label].generate(ids, n_new, gamma)
                    s["blocks"] += gen.stats.blocks
                    s["tokens"] += gen.stats.new_tokens
                    s["seconds"] += gen.stats.total_s
                    if first:
                        s["outputs"].append(gen.tokens)

    expected = generate["outputs"]
    gen_tps = generate["tokens"] / generate["seconds"]
    result: dict[str, Any] = {"verifier": verifier_path, "drafter": drafter_path, "device": str(device),
                              "threads": torch.get_num_threads(), "prompts": len(encoded), "max_new_tokens": n_new,
                              "repeats": args.repeats, "lean": "fused" if fused else
                              "two passes" if lean_pass else f"unsupported: {reason}",
                              "generate": {"tokens_per_s": gen_tps, "ms_per_token": 1e3 / gen_tps}, "alone": {},
                              "speculative": []}

    print("## Verifier alone (greedy)\n")
    print("| loop | step ms (median) | middle half ms | tokens/s (prompt pass included) | output = generate's |")
    print("|---|---|---|---|---|")
    for label in PATHS:
        a = alone[label]
        step = _median_ms(a["steps"])
        tps = a["tokens"] / a["seconds"]
        same = sum(o == e for o, e in zip(a["outputs"], expected))
        result["alone"][label] = {"step_ms": step, "tokens_per_s": tps, "matches_generate": same,
                                  "steps": len(a["steps"])}
        print(f"| minimal cached loop, {PATH_NAMES[label]} | {step:.2f} | {_spread_ms(a['steps'])} | {tps:.1f} | "
              f"{same}/{len(expected)} |")
    print(f"| Hugging Face generate (mean per token, prompt pass included) | {1e3 / gen_tps:.2f} | - | {gen_tps:.1f} "
          "| - |\n")

    for gamma in args.gammas:
        print(f"## γ = {gamma}: one block, medians over {len(spec[('after', gamma)]['blocks'])} blocks\n")
        print("| path | drafter pass ms | verifier pass ms | loop's own ms | block ms (middle half) | block in "
              "verifier-alone steps | drafter ÷ verifier pass | τ | tokens/s | speedup vs minimal loop | speedup vs "
              "generate | output = generate's |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for label in PATHS:
            s = spec[(label, gamma)]
            blocks = s["blocks"]
            drafter_ms = _median_ms([b.drafter_s for b in blocks])
            verifier_ms = _median_ms([b.verifier_s for b in blocks])
            loop_ms = _median_ms([b.total_s - b.drafter_s - b.verifier_s for b in blocks])
            block_ms = _median_ms([b.total_s for b in blocks])
            steps = block_ms / result["alone"][label]["step_ms"]
            tau = sum(b.produced for b in blocks) / len(blocks)
            tps = s["tokens"] / s["seconds"]
            same = sum(o == e for o, e in zip(s["outputs"], expected))
            row = {"gamma": gamma, "path": label, "drafter_ms": drafter_ms, "verifier_ms": verifier_ms,
                   "loop_ms": loop_ms, "block_ms": block_ms, "block_in_alone_steps": steps,
                   "drafter_over_verifier": drafter_ms / verifier_ms, "tau": tau, "tokens_per_s": tps,
                   "speedup_vs_alone": tps / result["alone"][label]["tokens_per_s"],
                   "speedup_vs_generate": tps / gen_tps, "matches_generate": same, "blocks": len(blocks)}
            result["speculative"].append(row)
            spread = _spread_ms([b.total_s for b in blocks])
            print(f"| {PATH_NAMES[label]} | {drafter_ms:.2f} | {verifier_ms:.2f} | {loop_ms:.2f} | {block_ms:.2f} "
                  f"({spread}) | {steps:.2f} | {row['drafter_over_verifier']:.2f} | {tau:.2f} | {tps:.1f} | "
                  f"{row['speedup_vs_alone']:.2f} | {row['speedup_vs_generate']:.2f} | {same}/{len(expected)} |")
        print()
    return result


# ------------------------------------------------------------------------------------------------ training


def synthetic_rollouts(count: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[dict]:
    """Random-token rollouts of fixed lengths (a replica has no trained verifier to roll out)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [{"prompt_ids": torch.randint(4, vocab, (prompt_len,), generator=generator, device="cpu").tolist(),
             "response_ids": torch.randint(4, vocab, (response_len,), generator=generator, device="cpu").tolist()}
            for _ in range(count)]


def training_cost(recipe, model, rows: list[dict], strategy_cls, micro: int, steps: int,
                  global_batch: int | None = None) -> dict:
    """Windows/s of the trainer's own step (``align.distill.strategy.train_step``: forward, loss, backward and the
    optimizer step, through DeepSpeed) over ``steps`` global batches of ``global_batch`` windows (default
    ``micro``) in micro-batches of ``micro``, taken in the trainer's order with ``strategy_cls``'s layout, after
    one untimed global batch; and the supervised share of the positions the model ran (padding included)."""
    import dataclasses

    import torch

    from align.distill.backend import Engine
    from align.distill.data import WindowOrder, rollout_spans
    from align.distill.packing import offsets_per_call
    from align.distill.strategy import train_step
    from align.distill.windows import window_index
    from align.metrics import now

    size = global_batch or micro
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(
        recipe.train, micro_batch_size=micro, global_batch_size=size, max_steps=steps + 1, warmup_steps=0))
    vocab = model.config.text_config.vocab_size
    engine = Engine(model, recipe, 1)
    strategy = strategy_cls(recipe, engine.engine, rows, vocab, None, device=engine.device)
    pairs = window_index([len(r["response_ids"]) for r in rows], list(range(len(rows))))
    order = WindowOrder(len(pairs), 0, rollout_spans(pairs) if strategy.packs else None,
                        recipe.data.group_size or offsets_per_call(recipe.distill.gamma))
    engine.train(True)
    timed = supervised = processed = 0.0
    for i in range(steps + 1):
        windows = pairs[order.take(i * size, size)]
        arranged, _ = strategy.arrange(windows, i)
        for lo in range(0, size, micro):  # what the step's micro-batches run (counted outside the timing)
            batch = strategy.batch(arranged[lo:lo + micro], train=True)
            if hasattr(batch, "slots"):  # packed: the rollouts once, then the decoder calls that run
                run_slots = int((batch.offsets[:, :, 0] >= 0).sum()) * batch.offsets.shape[2]
                ran = batch.seq.numel() + run_slots * recipe.distill.gamma
            else:
                ran = batch.prefix.numel() + batch.canvas.numel()
            if i:
                supervised += float((batch.labels >= 0).sum())
                processed += ran
        start = now(engine.device)
        train_step(strategy, engine, windows, i, micro)
        if i:  # the first global batch warms up
            timed += now(engine.device) - start
    del engine
    torch.set_grad_enabled(True)
    return {"windows_per_s": steps * size / timed, "supervised_share": supervised / processed,
            "positions_per_window": processed / (steps * size)}


def packing_ceiling(rows: list[dict], gamma: int, max_prefix_len: int) -> float:
    """The most packing can gain here, counted in positions: what per-window training runs (each window's prefix and
    its γ canvas positions) over what packing runs with every rollout read once (``prompt ‖ response``, then γ canvas
    positions per window), padding left out of both. Packed windows/s can exceed per-window by this much at most
    when a position costs the same on both paths."""
    per_window = packed = 0
    for r in rows:
        prompt, n = len(r["prompt_ids"]), len(r["response_ids"])
        per_window += sum(min(prompt + t, max_prefix_len) + gamma for t in range(n))
        packed += min(prompt, max_prefix_len) + n + n * gamma
    return per_window / packed


def train_section(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    from align.config import load_recipe
    from align.distill.data import within_vocab
    from align.distill.packing import offsets_per_call
    from align.distill.strategy import PackedStrategy, WindowStrategy
    from align.loading import load_drafter_model
    from align.rollouts import load_rollouts

    class RandomOrder(WindowStrategy):
        """The per-window step with each global batch's micro-batches cut in random order (not by prefix length)."""

        def arrange(self, windows, step):
            return windows, None

    print("\n## Training: windows/s of the trainer's step, per window vs packed\n")
    print("| model | rollouts | γ | micro-batch | path | windows/s | positions run per window | supervised ÷ processed "
          "positions | ÷ per window | ceiling (positions) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    from align.distill.distributed import init_distributed

    init_distributed()
    recipe = load_recipe("recipes/tiny.yaml", ["distill.objective=ce", "distill.next_token_weight=0",
                                               "distill.first_token=canvas", "distill.denoise_steps=1"])
    _, tokenizer = load_drafter_model(recipe.drafter.path, "diffusiongemma")
    rows, _ = within_vocab(load_rollouts(recipe).select_columns(["prompt_ids", "response_ids"]).to_list(),
                           len(tokenizer))
    cases = [("zoo:tiny-diffusiongemma", recipe, rows, "tiny recipe's")]
    if args.replica:
        replica = dataclasses.replace(recipe, drafter=dataclasses.replace(recipe.drafter,
                                                                          path="zoo:replica-diffusiongemma"),
                                      distill=dataclasses.replace(recipe.distill, gamma=16),
                                      data=dataclasses.replace(recipe.data, max_prefix_len=2048, group_size=None))
        vocab_r = load_drafter_model(replica.drafter.path, "diffusiongemma")[0].config.text_config.vocab_size
        cases.append(("zoo:replica-diffusiongemma", replica,
                      synthetic_rollouts(16, args.replica_prompt, args.replica_response, vocab_r, 0),
                      f"random, prompt {args.replica_prompt} + response {args.replica_response}"))

    def fresh(case_recipe):  # each path trains its own copy (the step changes the weights)
        return load_drafter_model(case_recipe.drafter.path, "diffusiongemma")[0]

    out = {}
    for name, case, data, what in cases:
        gamma, group = case.distill.gamma, case.data.group_size
        micro = args.micro if name.endswith("tiny-diffusiongemma") else args.replica_micro
        whole = max(len(r["response_ids"]) for r in data)  # a group as long as any rollout: each rollout read once
        paths = {"per window": (WindowStrategy, None),
                 f"packed, groups of {group or offsets_per_call(gamma)}": (PackedStrategy, group),
                 "packed, whole rollouts": (PackedStrategy, whole)}
        ceiling = packing_ceiling(data, gamma, case.data.max_prefix_len)
        results = {}
        for label, (strategy, size) in paths.items():
            grouped = dataclasses.replace(case, data=dataclasses.replace(case.data, group_size=size))
            results[label] = r = training_cost(grouped, fresh(case), data, strategy, micro, args.train_steps)
            packed = strategy.packs
            ratio = f"{r['windows_per_s'] / results['per window']['windows_per_s']:.1f}×" if packed else ""
            rate = f"{r['windows_per_s']:.{0 if r['windows_per_s'] >= 100 else 1}f}"
            print(f"| {name} | {what} | {gamma} | {micro} | {label} | {rate} | "
                  f"{r['positions_per_window']:.1f} | {r['supervised_share']:.3f} | {ratio} | "
                  f"{'' if packed else f'{ceiling:.2f}×'} |", flush=True)
        out[name] = {"paths": results, "ceiling": ceiling}
    print("\nceiling: positions per window on the per-window path ÷ with every rollout read once and γ canvas "
          "positions per window (padding left out): the most packing gains where a position costs the same on both "
          "paths.")
    print("\n## Per-window training: micro-batches cut from a global batch in random order vs by prefix length\n")
    print("| model | micro-batch | global batch | order | windows/s | positions run per window | ÷ random |")
    print("|---|---|---|---|---|---|---|")
    for micro, size in ((32, 64), (8, 128)):  # recipes/tiny-mdlm.yaml's, the GPU recipes'
        results = {by_length: training_cost(recipe, fresh(recipe), rows, WindowStrategy if by_length else RandomOrder,
                                            micro, args.train_steps, size)
                   for by_length in (False, True)}
        for by_length, r in results.items():
            ratio = f"{r['windows_per_s'] / results[False]['windows_per_s']:.2f}×" if by_length else ""
            print(f"| zoo:tiny-diffusiongemma | {micro} | {size} | {'by prefix length' if by_length else 'random'} | "
                  f"{r['windows_per_s']:.0f} | {r['positions_per_window']:.1f} | {ratio} |", flush=True)
        out[f"by_length_{micro}_{size}"] = {"random": results[False], "by_prefix_length": results[True]}
    return out


SECTIONS = {"decode": decode_section, "train": train_section}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results = {name: run(args) for name, run in SECTIONS.items() if getattr(args, name)}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
