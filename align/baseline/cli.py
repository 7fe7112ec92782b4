"""The command line: ``python -m align.baseline train|eval`` (the package docstring says what each does)."""

from __future__ import annotations

import argparse

from align.baseline.measure import measure
from align.baseline.train import train
from align.errors import AlignError

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m align.baseline", description="The same-size autoregressive drafter: train it on a run's rollouts, or measure it.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a same-size AR drafter on a run's rollouts")
    t.add_argument("--run", required=True, help="an align/train.py run folder (holds recipe.yaml), e.g. runs/tiny")
    t.add_argument("--out", required=True, help="where the AR drafter is written, e.g. runs/tiny/ar")
    t.add_argument("--seconds", type=float, default=None,
                   help="training wall-clock budget (default: the diffusion run's training time from metrics.jsonl)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (with --seconds: whichever ends first)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW, warm-up, cosine decay)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    t.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--batch-size", type=int, default=64, help="sequences (prompt ‖ response) per step")
    t.add_argument("--prompt-weight", type=float, default=0.0,
                   help="loss weight of prompt tokens (0: prompts are context only; response tokens weigh 1)")
    t.add_argument("--hidden", type=int, default=None, help="width (default: the diffusion drafter's)")
    t.add_argument("--layers", type=int, default=None, help="layers (default: the diffusion drafter's)")
    t.add_argument("--heads", type=int, default=None, help="attention heads (default: the diffusion drafter's)")
    t.add_argument("--intermediate", type=int, default=None,
                   help="MLP width (default: what matches the diffusion drafter's parameter count)")
    t.add_argument("--init", default=None, help="start from this causal LM instead of random weights")
    t.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every N steps (0: at the end)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    e = sub.add_parser("eval", help="speculative decoding with the AR drafter vs the verifier alone")
    e.add_argument("--drafter", required=True, help="an AR drafter folder (from train)")
    e.add_argument("--diffusion", default=None, help="also measure this diffusion drafter, e.g. runs/tiny/final")
    e.add_argument("--verifier", default=None, help="verifier path (default: the AR drafter's meta.json)")
    e.add_argument("--prompts", default="tinyworld:test", help="tinyworld:test (held out everywhere) or a JSONL file")
    e.add_argument("--limit", type=int, default=None, help="N prompts evenly spaced over the file")
    e.add_argument("--gamma", type=int, default=16)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--resample", action="store_true",
                   help="temperature > 0: redraw the draft from the AR drafter's rows instead of verifying its own")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default=None)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "train":
        train(args)
    else:
        if args.gamma < 1:
            raise AlignError(f"--gamma must be at least 1, got {args.gamma}")
        measure(args)
    return 0
