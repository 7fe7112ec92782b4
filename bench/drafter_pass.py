"""What one drafter pass costs per drafter dtype, as decoding pays it: right after a verifier pass.

    python bench/drafter_pass.py --drafter runs/smollm2-dflash/final --verifier zoo:smollm2-135m-instruct \\
        --verifier-dtype bfloat16 --dtype float32,bfloat16,int8 --prefix 40,900 --out runs/bench/drafter-pass.json

Through ``align.drafters.load_drafter`` and ``align.verifier.Verifier`` (the path speculative decoding takes): for
each prompt length (``--prefix`` random tokens, run once by the verifier with its features recorded), ``--reps``
rounds of a verifier pass over 9 positions (which evicts the drafter's weights from the caches, as decoding's passes
do) and then one drafter pass (``marginals``: γ rows) per dtype, the dtypes interleaved round by round so that a
drifting machine slows all alike; the mean of the passes between the fastest and slowest ``--trim`` each, after
``--warmup`` rounds. The verifier's own pass is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def trimmed_mean(values: list[float], trim: int) -> float:
    kept = sorted(values)[trim:len(values) - trim]
    return sum(kept) / len(kept)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="the drafter (a folder or zoo:NAME)")
    p.add_argument("--verifier", default="zoo:smollm2-135m-instruct")
    p.add_argument("--verifier-dtype", default="bfloat16")
    p.add_argument("--dtype", default="float32,bfloat16,int8", help="the drafter's dtypes (comma list)")
    p.add_argument("--prefix", default="40,900", help="prompt lengths in tokens (comma list)")
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trim", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    args = p.parse_args()
    from align.loading import DRAFTER_DTYPES

    try:
        prefixes = [int(n) for n in args.prefix.split(",")]
        dtypes = args.dtype.split(",")
        if min(prefixes) < 2 or args.gamma < 1 or args.reps <= 2 * args.trim:
            raise ValueError
    except ValueError:
        raise SystemExit("error: --prefix takes whole numbers of at least 2 (e.g. 40,900), --gamma at least 1, and "
                         "--reps must exceed twice --trim") from None
    if unknown := [d for d in dtypes if d not in DRAFTER_DTYPES]:
        raise SystemExit(f"error: unknown --dtype {unknown[0]}; choose from {', '.join(DRAFTER_DTYPES)}")
    import torch

    from align.drafters import load_drafter
    from align.errors import AlignError
    from align.loading import load_verifier_model
    from align.metrics import now
    from align.verifier import Verifier

    if args.threads:
        torch.set_num_threads(args.threads)

    def measure() -> dict:
        model, tokenizer = load_verifier_model(args.verifier, args.verifier_dtype, "cpu")
        verifier = Verifier(model)
        drafters = {d: load_drafter(args.drafter, args.verifier, model, dtype=d, verifier_tokenizer=tokenizer)
                    for d in dtypes}
        reads = next(iter(drafters.values())).verifier_layers
        generator = torch.Generator(device="cpu").manual_seed(0)
        vocab = next(iter(drafters.values())).vocab_size
        table = {}
        for length in prefixes:
            prompt = torch.randint(0, vocab, (length,), generator=generator, device="cpu").tolist()
            if reads:
                verifier.record(reads)
            verifier.start(prompt)
            verifier.score(torch.zeros((1, 0), dtype=torch.long, device="cpu"))
            verifier.commit(0, 0, prompt[-1])
            prefix = torch.tensor([prompt + [prompt[-1]]], device="cpu")
            draft = torch.randint(0, vocab, (1, 9), generator=generator, device="cpu")
            times = {d: [] for d in dtypes}
            with torch.inference_mode():
                for drafter in drafters.values():
                    drafter.bind(verifier)
                for round_ in range(args.warmup + args.reps):
                    for dtype, drafter in drafters.items():
                        model(input_ids=draft)  # a verifier pass over 9 positions (no cache), uncounted
                        start = now("cpu")
                        drafter.marginals(prefix, args.gamma)
                        if round_ >= args.warmup:
                            times[dtype].append(now("cpu") - start)
            verifier.record(None)
            table[length] = {d: round(1000 * trimmed_mean(t, args.trim), 2) for d, t in times.items()}
            print(f"prefix {length}: " + ", ".join(f"{d} {ms} ms" for d, ms in table[length].items()), flush=True)
        return {"drafter": args.drafter, "verifier": args.verifier, "verifier_dtype": args.verifier_dtype,
                "gamma": args.gamma, "threads": torch.get_num_threads(), "ms_per_pass": table}

    try:
        result = measure()
    except AlignError as error:
        raise SystemExit(f"error: {error}") from None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
