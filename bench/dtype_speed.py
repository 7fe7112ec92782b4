"""What a dtype's matrix products cost on this machine: the measurement behind ``verifier.dtype: auto``.

    python bench/dtype_speed.py --rows 1,16,512,4096 --out runs/bench/dtype-speed.json

Times one linear layer (``--shape IN,OUT``; default SmolLM2-135M's MLP, 576 → 1536) in each ``--dtype``: its forward
over each count of ``--rows`` (one row: a decoding step; many: a prefill or a training batch) and, at the largest
count, its forward and backward, each dtype interleaved round by round, the median of ``--reps``. Prints the table
and what ``align.machine.native_bf16`` says of this device (whether ``auto`` picks bfloat16 here). Where the CPU
computes in bfloat16 natively (AVX-512 BF16, AMX) bfloat16 is faster at every size; where it converts it in software
(AVX2 only) it is faster for one row, whose cost is reading the weights, and several times slower for many.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from align.loading import DTYPES
    from align.machine import default_device, native_bf16
    from align.metrics import now

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32,bfloat16", help="weight and activation dtypes (comma list)")
    p.add_argument("--shape", default="576,1536", help="the linear layer's IN,OUT features")
    p.add_argument("--rows", default="1,16,512,4096", help="rows per product (comma list)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the accelerator when present)")
    p.add_argument("--out", default=None, help="also write the table as JSON here")
    args = p.parse_args()
    device = args.device or default_device()
    dtypes = args.dtype.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtype: unknown dtype '{unknown[0]}'; choose from {', '.join(DTYPES)}")
    n_in, n_out = (int(x) for x in args.shape.split(","))
    rows = [int(x) for x in args.rows.split(",")]
    torch.manual_seed(0)
    layers = {d: torch.nn.Linear(n_in, n_out, device=device, dtype=DTYPES[d]) for d in dtypes}
    inputs = {(d, m): torch.randn(m, n_in, device=device, dtype=DTYPES[d]) for d in dtypes for m in rows}

    def forward(d: str, m: int) -> None:
        with torch.no_grad():
            layers[d](inputs[(d, m)])

    def backward(d: str, m: int) -> None:
        x = inputs[(d, m)].detach().requires_grad_(True)
        layers[d](x).float().sum().backward()

    cases = [("forward", m, forward) for m in rows] + [("forward+backward", rows[-1], backward)]
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(2):  # warm-up
        for _, m, run in cases:
            for d in dtypes:
                run(d, m)
    for _ in range(args.reps):  # dtypes interleaved: a drifting machine slows all alike
        for what, m, run in cases:
            for d in dtypes:
                start = now(device)
                run(d, m)
                times.setdefault((what, m, d), []).append(now(device) - start)
    table = [{"pass": what, "rows": m, **{f"{d}_ms": round(1e3 * statistics.median(times[(what, m, d)]), 3)
                                         for d in dtypes}} for what, m, _ in cases]
    native = native_bf16(device)
    print(f"device {device}; native bfloat16: {native} (verifier.dtype auto picks "
          f"{'bfloat16' if native else 'float32'} here)")
    print("| pass | rows | " + " | ".join(f"{d} ms" for d in dtypes) + " |")
    print("|---|---|" + "---|" * len(dtypes))
    for row in table:
        print(f"| {row['pass']} | {row['rows']} | " + " | ".join(f"{row[f'{d}_ms']:.3f}" for d in dtypes) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": device, "native_bf16": native, "shape": [n_in, n_out],
                                              "table": table}, indent=1))


if __name__ == "__main__":
    main()
