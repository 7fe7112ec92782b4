"""What a verifier pass costs against the number of positions it scores, per weight dtype (and attention,
``--attention align,transformers``, and linear layers, ``--linear align,transformers``): the number every speedup
divides by.

    python bench/verify_cost.py --verifier zoo:smollm2-135m-instruct --dtype float32,bfloat16 \\
        --positions 1,2,3,4,6,8,12,16,17 --out runs/bench/verify-cost.json

Through ``align.verifier.Verifier`` (the path speculative decoding takes): a prompt of ``--prefix`` random tokens run
once, then, for each count of positions q, ``--reps`` passes scoring the pending token and a random draft of q - 1
tokens from the KV cache, each rolled back to the pending token (the cache grows one token a pass, as decoding's
does). The mean of the passes between the fastest and slowest ``--trim`` each (after ``--warmup`` passes), each
count and dtype interleaved round by round so that a drifting machine slows all alike; a pass's cost in passes of
the first count (with ``--positions 1,...``: in steps of the verifier alone, per dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="zoo:smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32,bfloat16", help="weight dtypes (comma list)")
    p.add_argument("--attention", default="align", help="the verifier's attention (comma list): align (its own: "
                   "grouped heads read in place on the CPU, folded into rows in bfloat16, align.verifier.gqa_sdpa), "
                   "unfolded (align's without the folding) or transformers (the model's sdpa as transformers runs "
                   "it)")
    p.add_argument("--linear", default="align", help="the verifier's linear layers (comma list): align (a pass over "
                   "a few positions in float32 on the CPU as W x^T, align.verifier.skinny_linear) or transformers "
                   "(nn.Linear's x W^T)")
    p.add_argument("--skinny-rows", type=int, default=None, help="the most positions a pass computes as W x^T "
                   "(align.verifier.SKINNY_ROWS; raise it to see the product past where align stops using it)")
    p.add_argument("--positions", default="1,2,3,4,6,8,12,16,17", help="positions scored per pass (comma list)")
    p.add_argument("--prefix", type=int, default=300, help="tokens in the cache before the first timed pass")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trim", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    args = p.parse_args()
    from align.errors import AlignError

    try:
        positions = [int(q) for q in args.positions.split(",")]
        attentions, linears = args.attention.split(","), args.linear.split(",")
        if (min(positions) < 1 or args.reps <= 2 * args.trim
                or not set(attentions) <= {"align", "unfolded", "transformers"}
                or not set(linears) <= {"align", "transformers"}):
            raise ValueError
    except ValueError:
        raise SystemExit("error: --positions takes whole numbers of at least 1 (e.g. 1,4,16), --reps must exceed "
                         "twice --trim, --attention names align, unfolded or transformers and --linear align or "
                         "transformers") from None
    dtypes = args.dtype.split(",")
    # each setting, (dtype, attention, linear), by its label: the dtype, with the attention and the linear layers
    # where more than one of them is compared
    settings = {" ".join([d] + ([f"attention:{a}"] if len(attentions) > 1 else [])
                         + ([f"linear:{li}"] if len(linears) > 1 else [])): (d, a, li)
                for d in dtypes for a in attentions for li in linears}
    from align.loading import DTYPES, default_device, load_verifier_model

    if unknown := [d for d in dtypes if d not in DTYPES]:
        raise SystemExit(f"error: unknown --dtype {unknown[0]}; choose from {', '.join(DTYPES)}")
    import torch

    from align.metrics import now
    from align.verifier import GQA_SDPA, Verifier

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.skinny_rows is not None:
        import align.verifier

        align.verifier.SKINNY_ROWS = args.skinny_rows
    try:
        verifiers = {label: Verifier(load_verifier_model(args.verifier, d, args.device or default_device())[0])
                     for label, (d, _, _) in settings.items()}
    except AlignError as error:
        raise SystemExit(f"error: {error}") from None
    for label, (_, attention, linear) in settings.items():
        if attention == "transformers" and verifiers[label].model.config._attn_implementation == GQA_SDPA:
            verifiers[label].model.set_attn_implementation("sdpa")  # back to transformers' own
        if attention == "unfolded":
            verifiers[label].fold = False  # grouped heads read in place, never folded into rows
        if linear == "transformers":
            verifiers[label].skinny = False  # nn.Linear's own product in every pass
    vocab = min(v.model.config.get_text_config().vocab_size for v in verifiers.values())
    generator = torch.Generator(device="cpu").manual_seed(0)  # the same tokens on every device
    prompt = torch.randint(0, vocab, (args.prefix,), generator=generator, device="cpu").tolist()
    times: dict[tuple[str, int], list[float]] = {(d, q): [] for d in settings for q in positions}
    for v in verifiers.values():
        v.start(prompt)
        v.score(torch.zeros((1, 0), dtype=torch.long, device=v.device))
        v.commit(0, 0, 0)
    for rep in range(args.warmup + args.reps):
        for d in settings:
            for q in positions:
                v = verifiers[d]
                draft = torch.randint(0, vocab, (1, q - 1), generator=generator, device="cpu").to(v.device)
                start = now(v.device)
                v.score(draft)
                elapsed = now(v.device) - start
                v.commit(0, 0, int(draft[0, 0]) if q > 1 else 0)
                if rep >= args.warmup:
                    times[(d, q)].append(elapsed)

    def trimmed(xs: list[float]) -> float:
        xs = sorted(xs)[args.trim:len(xs) - args.trim]
        return sum(xs) / len(xs)

    ms = {key: 1000 * trimmed(xs) for key, xs in times.items()}
    lines = ["| positions scored | " + " | ".join(f"{d} ms | {d} cost (steps)" for d in settings) + " |",
             "|---|" + "---|---|" * len(settings)]
    for q in positions:
        lines.append(f"| {q} | " + " | ".join(f"{ms[(d, q)]:.1f} | {ms[(d, q)] / ms[(d, positions[0])]:.2f}"
                                              for d in settings) + " |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"verifier": args.verifier, "prefix": args.prefix, "threads":
                                              torch.get_num_threads(), "ms": {f"{d}/{q}": ms[(d, q)] for d, q in ms}},
                                             indent=1))


if __name__ == "__main__":
    main()
