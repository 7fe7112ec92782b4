"""Sampling losslessness on a real pair, at a scale two CPU cores afford: the first two tokens of speculative sampling
against the verifier's exact distribution.

    python bench/sampling_check.py --ckpt runs/smollm2-dream/final --samples 400 --out runs/real/smollm2-sampling.json

The verifier's distribution of the first new token after the prompt is exact (one forward pass); so is that of the
second given the first. ``--samples`` generations of two tokens (seeds 0..N-1, one block of γ each: the drafter's
sampled draft, then the acceptance rule) give the empirical ones; a chi-square test (``align.lossless.chi_square_p``)
compares the first tokens with p(x₁ | prompt), and the second tokens of the generations whose first token was the
verifier's most likely one with p(x₂ | prompt, that token). The unit tests (``tests/test_sampling.py``) run the same
test at 20,000 samples on tiny models, and show that it rejects a broken acceptance rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402


def main() -> None:
    from align.drafters import load_pair
    from align.drafters import drafting_of
    from align.families import traits
    from align.lossless import chi_square_p
    from align.prompts import encode_prompt
    from align.speculative import SpeculativeDecoder
    from align.verifier import eos_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="an exported drafter (its meta.json names the verifier)")
    p.add_argument("--prompt", default="Give me a haiku about the ocean")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    meta = json.loads((Path(args.ckpt) / "meta.json").read_text())
    drafter, verifier, tokenizer = load_pair(args.ckpt, meta["verifier"], meta["family"], device="cpu",
                                             trust_remote_code=traits(meta["family"]).remote_code)
    prompt = encode_prompt(tokenizer, args.prompt)
    with torch.no_grad():
        ids = torch.tensor([prompt], device=verifier.device)
        first = (verifier.model(input_ids=ids).logits[0, -1].float() / args.temperature).softmax(-1)
        mode = int(first.argmax())
        ids = torch.tensor([prompt + [mode]], device=verifier.device)
        second = (verifier.model(input_ids=ids).logits[0, -1].float() / args.temperature).softmax(-1)
    decoder = SpeculativeDecoder(drafter, verifier, eos_ids(verifier.model, tokenizer))
    firsts, seconds = Counter(), Counter()
    for seed in tqdm(range(args.samples), desc="speculative samples"):
        tokens = decoder.generate(prompt, 2, gamma=args.gamma, temperature=args.temperature, seed=seed).tokens
        firsts[tokens[0]] += 1
        if tokens[0] == mode and len(tokens) > 1:
            seconds[tokens[1]] += 1
    n2 = sum(seconds.values())

    def probs(p: torch.Tensor) -> dict[int, float]:
        return {i: float(v) for i, v in enumerate(p.tolist()) if v > 0}

    def tv(counts: Counter, p: torch.Tensor, n: int) -> float:
        empirical = torch.zeros_like(p)
        for token, c in counts.items():
            empirical[token] = c / n
        return 0.5 * float((empirical - p).abs().sum())

    result = {"ckpt": args.ckpt, "prompt": args.prompt, "samples": args.samples, "gamma": args.gamma,
              "temperature": args.temperature, "drafting": drafting_of(args.ckpt),
              "p_first": chi_square_p(firsts, probs(first), args.samples), "tv_first": tv(firsts, first, args.samples),
              "second_samples": n2, "p_second": chi_square_p(seconds, probs(second), n2) if n2 else None,
              "tv_second": tv(seconds, second, n2) if n2 else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
