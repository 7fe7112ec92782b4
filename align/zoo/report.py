"""How good is the tiny zoo? Per category of the held-out prompts:

- the verifier's greedy answer against the generator's (exact match; meaningful where the answer is determined),
  its mean length in tokens and the number of distinct greedy answers;
- the verifier's mean next-token entropy on the generator's answers, beside the design entropy;
- each drafter's one-step token accuracy against the verifier's greedy continuation (γ = 16 blocks, T = 1).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
from tqdm.auto import tqdm

from align.drafters import load_pair
from align.loading import default_device, load_verifier_model
from align.prompts import encode_prompt
from align.tinyworld.corpus import entropy_table, read_jsonl
from align.zoo.registry import is_built, model_dir, world_dir


@torch.no_grad()
def greedy_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, eos: int, batch: int = 32) -> list[list[int]]:
    """Greedy continuations (ending at EOS, which is dropped) of many prompts, left-padded in batches."""
    out = []
    for i in tqdm(range(0, len(prompts), batch), desc="verifier greedy", leave=False):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(eos)] if eos in row else row)
    return out


@torch.no_grad()
def verifier_entropy(model: Any, prompt: list[int], response: list[int]) -> float:
    """Mean next-token entropy (nats) of the verifier over a teacher-forced response."""
    ids = torch.tensor([prompt + response], device=model.device)
    logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def zoo_report(gamma: int = 16, max_new_tokens: int = 160) -> dict[str, Any]:
    """Measure the zoo on the held-out prompts (on the accelerator when present); write and return
    ``<cache>/zoo/report.json``."""
    tests = read_jsonl(world_dir() / "test_prompts.jsonl")
    device = default_device()
    model, tokenizer = load_verifier_model("zoo:tiny-verifier", device=device)
    eos = tokenizer.eos_token_id
    prompts = [encode_prompt(tokenizer, t["prompt"]) for t in tests]
    greedy = greedy_batch(model, prompts, max_new_tokens, eos)
    by_cat: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for test, prompt, out in zip(tests, prompts, greedy):
        ref = tokenizer(test["reference"], add_special_tokens=False)["input_ids"]
        row = by_cat[test["category"]]
        row["match"].append(out == ref)
        row["length"].append(len(out))
        row["output"].append(tuple(out))
        row["entropy"].append(verifier_entropy(model, prompt, ref + [eos]))
    design = entropy_table([{**t, "response": t["reference"]} for t in tests],
                           lambda r: len(tokenizer(r, add_special_tokens=False)["input_ids"]))
    report: dict[str, Any] = {"verifier": {}, "drafters": {}}
    for cat, row in by_cat.items():
        report["verifier"][cat] = {
            "prompts": len(row["match"]), "greedy_matches_generator": sum(row["match"]) / len(row["match"]),
            "mean_greedy_tokens": sum(row["length"]) / len(row["length"]), "distinct_greedy": len(set(row["output"])),
            "verifier_entropy": sum(row["entropy"]) / len(row["entropy"]),
            "design_nats_per_token": design[cat]["nats_per_token"],
        }
    for name, family in (("tiny-diffusiongemma", "diffusiongemma"), ("tiny-mdlm", "mdlm")):
        if not is_built(name):
            continue
        drafter, _, _ = load_pair(f"zoo:{name}", "zoo:tiny-verifier", family, device=device)
        hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for test, prompt, out in tqdm(list(zip(tests, prompts, greedy)), desc=f"{name} one-step", leave=False):
            target = out + [eos]
            for t in range(0, len(target), gamma):
                drafter.reset()
                logq = drafter.marginals(torch.tensor([prompt + target[:t]], device=device), gamma)[0]
                truth = torch.tensor(target[t:t + gamma], device=device)
                hits[test["category"]][0] += int((logq.argmax(-1)[:len(truth)] == truth).sum())
                hits[test["category"]][1] += len(truth)
        report["drafters"][name] = {cat: h[0] / h[1] for cat, h in hits.items()}
    (model_dir("report.json").parent / "report.json").write_text(json.dumps(report, indent=1))
    return report


def format_report(report: dict[str, Any]) -> str:
    drafters = list(report["drafters"])
    head = ("| category | prompts | greedy = generator | mean tokens | distinct greedy | verifier entropy | "
            "design entropy | " + " | ".join(f"{d} 1-step acc" for d in drafters) + " |")
    lines = [head, "|" + "---|" * (7 + len(drafters))]
    order = ("formulaic", "factual", "reasoning", "structured", "semi-open", "open", "creative")
    for cat in sorted(report["verifier"], key=lambda c: order.index(c) if c in order else 99):
        v = report["verifier"][cat]
        accs = " | ".join(f"{report['drafters'][d].get(cat, 0):.2f}" for d in drafters)
        lines.append(f"| {cat} | {v['prompts']} | {v['greedy_matches_generator']:.2f} | {v['mean_greedy_tokens']:.1f} | "
                     f"{v['distinct_greedy']} | {v['verifier_entropy']:.3f} | {v['design_nats_per_token']:.3f} | {accs} |")
    return "\n".join(lines)
