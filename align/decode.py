"""Try speculative decoding on one prompt.

    python -m align.decode --drafter zoo:tiny-diffusiongemma --verifier zoo:tiny-verifier \\
        --prompt "The capital of France is" --gamma 16 --steps 1 --temperature 0

Prints the text with each block's accepted draft tokens marked, then the statistics, and the verifier decoding
alone for comparison (``ar_tokens_per_s``, ``speedup``).
"""

from __future__ import annotations

import argparse
import json
import sys

from align.errors import run_cli
from align.drafters import load_pair
from align.families import FAMILIES
from align.lossless import classify
from align.metrics import now
from align.prompts import encode_prompt
from align.selection import CANDIDATES, DEFAULTS, SCORERS, make_selection
from align.speculative import SpeculativeDecoder
from align.trees import TreeShape
from align.verifier import ar_generate, eos_ids


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m align.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="drafter path, hub name or zoo:NAME; or prompt lookup: "
                   "ngram[:[MIN-]MAX][@W[/S]][+PATH] (PATH's drafter where no n-gram of MIN..MAX tokens matches; with "
                   "@W, a match mixed into PATH's rows at weight W; /S: only a match after an n-gram under S tokens)")
    p.add_argument("--verifier", required=True, help="verifier path, hub name or zoo:NAME")
    p.add_argument("--family", default=None,
                   help=f"drafter family ({', '.join(FAMILIES)}); default: the folder's (meta.json), or detected")
    p.add_argument("--prompt", required=True, help="the prompt (the chat template is applied when there is one)")
    p.add_argument("--gamma", type=int, default=16, help="draft tokens per block")
    p.add_argument("--steps", type=int, default=None,
                   help="denoising steps (drafter passes) per block; default: the T the drafter was trained for (its "
                        "meta.json's denoise_steps), 1 for a drafter that is not an export")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; >0: sampling")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=DEFAULTS.k, help="drafts per block (self-selection)")
    p.add_argument("--drafter-temperature", type=float, default=DEFAULTS.drafter_temperature,
                   help="temperature of the K drafts")
    p.add_argument("--scorer", default=DEFAULTS.scorer, choices=SCORERS)
    p.add_argument("--candidates", default=DEFAULTS.candidates, choices=CANDIDATES)
    p.add_argument("--tree", default=None, metavar="NODESxBRANCHING[/P]",
                   help="verify a token tree grown from the marginals (align/trees.py), e.g. 16x4; /P leaves out "
                        "nodes whose path probability is below P, e.g. 11x3/0.1")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    p.add_argument("--hub-kernels", action="store_true", help="let transformers swap in kernels from the Hugging "
                   "Face Hub (needs the network or a filled kernel cache; off: the models' own code)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the drafter's own modelling code")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from align.drafters import ngram
    from align.loading import trained_steps
    from align.zoo import check_drafter, check_model, resolve

    args = parse_args(argv)
    tree = None if args.tree is None else TreeShape.parse(args.tree)  # a bad shape: refused before any load
    model = ngram.parse(args.drafter)[2] if ngram.is_spec(args.drafter) else args.drafter  # None: lookup alone
    if model is not None:  # both before either is built or loaded: what each config says it is
        check_drafter(model, args.family, args.trust_remote_code)
    check_model(args.verifier, "verifier")
    for path in (model, args.verifier):
        if path is not None:
            resolve(path)  # a zoo model is built now, if it has to be
    drafter, verifier, tokenizer = load_pair(args.drafter, args.verifier, args.family, args.dtype,
                                             args.trust_remote_code, device=args.device,
                                             hub_kernels=args.hub_kernels)  # the family: the folder's
    if args.steps is None:
        args.steps = trained_steps(args.drafter)
    decoder = SpeculativeDecoder(drafter, verifier, eos_ids(verifier.model, tokenizer))
    prompt = encode_prompt(tokenizer, args.prompt)
    selection = make_selection(args.k, args.drafter_temperature, args.scorer, args.candidates)
    eos = list(decoder.eos)
    decoder.generate(prompt, args.max_new_tokens, args.gamma, args.steps)  # warm-up of both decoders, untimed
    ar_generate(verifier.model, prompt, args.max_new_tokens, 0.0, eos)
    out = decoder.generate(prompt, args.max_new_tokens, args.gamma, args.steps, args.temperature, args.seed,
                           selection, tree=tree)
    start = now(verifier.device)
    ar = ar_generate(verifier.model, prompt, args.max_new_tokens, args.temperature, eos, args.seed)
    ar_seconds = now(verifier.device) - start
    summary = out.stats.summary(args.gamma)
    summary["ar_tokens_per_s"] = len(ar) / ar_seconds
    summary["speedup"] = summary["tokens_per_s"] / summary["ar_tokens_per_s"] if ar else 0.0
    if args.temperature == 0:  # token for token, or a near-tie of a low-precision verifier
        verdict, _ = classify(verifier.model, prompt, out.tokens, ar)
        summary["lossless"], summary["lossless_verdict"] = verdict != "mismatch", verdict
    if args.json:
        print(json.dumps(summary))
        return 0
    marked = sys.stdout.isatty()
    text = []
    for kept, token in out.pieces:
        draft = tokenizer.decode(kept)
        if draft:
            text.append(f"\033[42m{draft}\033[0m" if marked else f"[{draft}]")
        if token is not None:
            text.append(tokenizer.decode([token]))
    print("".join(text))
    print("\n(draft tokens the verifier accepted are " + ("highlighted" if marked else "in [brackets]") + ")")
    alphas = " ".join("-" if a is None else f"{a:.2f}" for a in summary["per_position"])
    print(f"blocks {summary['n_blocks']}  accepted_mean {summary['accepted_mean']:.2f}  tau {summary['tau']:.2f}  "
          f"acceptance_rate {summary['acceptance_rate']:.2f}\nalpha_1..{args.gamma}: {alphas}\n"
          f"drafter {summary['drafter_s']:.2f}s  verifier {summary['verifier_s']:.2f}s  "
          f"{summary['tokens_per_s']:.1f} tok/s  verifier alone {summary['ar_tokens_per_s']:.1f} tok/s  "
          f"speedup {summary['speedup']:.2f}x" + (f"  lossless {summary['lossless']}" if "lossless" in summary else ""))
    return 0


if __name__ == "__main__":
    run_cli(main)
