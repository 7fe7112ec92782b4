"""Measuring the AR drafter in standard speculative decoding (and a diffusion drafter beside it) on held-out prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from align.errors import AlignError


def spread(items: list, limit: int | None) -> list:
    """``limit`` items evenly spaced over ``items`` (all when ``limit`` is None or larger)."""
    if limit is None or limit >= len(items):
        return items
    return [items[int(i * len(items) / limit)] for i in range(limit)]


def measure(args: argparse.Namespace) -> list[dict]:
    """Greedy or sampled speculative decoding with the AR drafter (and a diffusion drafter) on held-out prompts,
    against the verifier alone: accepted per block, τ, tokens/s, and (greedy) token-for-token equality."""
    from tqdm.auto import tqdm

    from align.drafters import load_drafter
    from align.families import traits
    from align.loading import default_device, load_verifier_model
    from align.metrics import DecodeStats, now
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import Verifier, ar_generate, eos_ids, verifier_alone
    from align.zoo import load_prompts, resolve

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(resolve(args.drafter))
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    verifier_path = args.verifier or meta.get("verifier")
    if verifier_path is None:
        raise AlignError(f"{path} has no meta.json naming its verifier; pass --verifier PATH")
    device = args.device or default_device()
    verifier_model, tokenizer = load_verifier_model(verifier_path, "float32", device)
    eos = eos_ids(verifier_model, tokenizer)
    prompts = spread(load_prompts(args.prompts), args.limit)
    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]

    verifier = Verifier(verifier_model)
    ar_generate(verifier_model, encoded[0], args.max_new_tokens, 0.0, eos)  # warm-up, untimed
    start = now(device)
    reference = [ar_generate(verifier_model, ids, args.max_new_tokens, args.temperature, eos, args.seed)
                 for ids in tqdm(encoded, desc="verifier alone (generate)", leave=False)]
    generate_tps = sum(map(len, reference)) / (now(device) - start)
    # the speed reference: a minimal cached loop through the same Verifier path
    verifier_alone(verifier, encoded[0], args.max_new_tokens, eos)  # warm-up, untimed
    runs = [verifier_alone(verifier, ids, args.max_new_tokens, eos, args.temperature, args.seed)
            for ids in tqdm(encoded, desc="verifier alone (cached loop)", leave=False)]
    ar_tps = sum(len(r.tokens) for r in runs) / sum(r.total_s for r in runs)
    drafters = [("ar", str(path))] + ([("diffusion", args.diffusion)] if args.diffusion else [])
    results = []
    for label, drafter_path in drafters:
        drafter = load_drafter(drafter_path, verifier_path, verifier_model, device=device, verifier_tokenizer=tokenizer)
        if traits(drafter.family).autoregressive:
            drafter.expose_draft = not args.resample  # --resample: redraw the draft from its rows
        decoder = SpeculativeDecoder(drafter, verifier, eos)
        decoder.generate(encoded[0], args.max_new_tokens, args.gamma)  # warm-up, untimed
        stats, same = DecodeStats(), 0
        for ids, ref in zip(tqdm(encoded, desc=label, leave=False), reference):
            gen = decoder.generate(ids, args.max_new_tokens, args.gamma, 1, args.temperature, args.seed)
            stats = stats + gen.stats
            same += gen.tokens == ref
        s = stats.summary(args.gamma)
        row = {"drafter": label, "path": drafter_path, "prompts": len(encoded),
               "gamma": args.gamma, "temperature": args.temperature, "accepted_mean": s["accepted_mean"],
               "tau": s["tau"], "acceptance_rate": s["acceptance_rate"], "tokens_per_s": s["tokens_per_s"],
               "verifier_alone_tokens_per_s": ar_tps, "speedup": s["tokens_per_s"] / ar_tps,
               "generate_tokens_per_s": generate_tps,
               "drafter_s": s["drafter_s"], "verifier_s": s["verifier_s"],
               "identical_outputs": f"{same}/{len(encoded)}" if args.temperature == 0 else None}
        results.append(row)
    print(f"{len(encoded)} prompts ({args.prompts}), γ={args.gamma}, temperature {args.temperature}")
    print("| drafter | accepted_mean | τ | acceptance rate | tokens/s | verifier alone tokens/s | speedup | "
          "HF generate tokens/s | drafter s | verifier s | identical to verifier |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['drafter']} | {r['accepted_mean']:.2f} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | "
              f"{r['tokens_per_s']:.1f} | {r['verifier_alone_tokens_per_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['generate_tokens_per_s']:.1f} | {r['drafter_s']:.1f} | {r['verifier_s']:.1f} | "
              f"{r['identical_outputs'] or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results

