"""The FLOPs of one training step, counted op by op where no GPU is at hand: the arithmetic behind an MFU.

    python bench/step_flops.py --pair gemma --scale gpu --micro-batch 4,8      # the GPU recipe's replica (~1B)
    python bench/step_flops.py --pair gemma --scale cpu --micro-batch 1        # seconds, for a try

Builds the pair's replica drafter (align/zoo/replicas.py), runs one micro-batch of the recipe's strategy (its batch,
forward, loss and backward; bf16, the bare model: no optimizer) under ``torch.utils.flop_counter.FlopCounterMode``,
LoRA r=32 and full fine-tuning, on random-token rollouts of ``--prefix`` prompt and ``--response`` response tokens
(every window of each). Prints FLOPs per window and where they go (the outermost modules the strategy calls: the
encoder, the decoder, the head): what a
measured windows/s turns into model FLOPs utilisation, ``windows/s x FLOPs per window / peak``; and the operations a
GPU would launch a kernel for and the host syncs among them, the launch-bound floor of the step's time. The count is the
same on any device: matmuls and attention as they run (masked positions included), elementwise work not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAIRS = {"gemma": ("replica-diffusiongemma", "diffusiongemma"), "qwen-diffucoder": ("replica-diffucoder", "dream")}


SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave")


class LaunchCount:
    """A dispatch mode counting the operations a GPU would launch a kernel for (views excluded) and those that make
    the host wait for the device (a value read back: ``item``, ``tolist``, ``nonzero``, a ``repeat_interleave`` of
    unknown size): the launch-bound floor of a step, whatever its FLOPs."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {"launches": 0, "syncs": 0}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not func.is_view and func.__name__.split(".")[0] not in ("detach", "lift_fresh", "alias"):
                    counts["launches"] += 1
                    name = func.__name__.split(".")[0]
                    if name in SYNCS and not (name == "repeat_interleave" and kwargs.get("output_size")):
                        counts["syncs"] += 1
                return func(*args, **kwargs)

        self.mode = Mode()


def count(pair: str, lora: bool, micro_batch: int, prefix: int, response: int) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from align.config import load_recipe
    from align.distill.lora import add_lora
    from align.distill.strategy import strategy_for
    from align.distill.windows import window_index
    from align.loading import load_drafter_model

    name, family = PAIRS[pair]
    recipe = load_recipe(ROOT / "recipes" / f"{pair}.yaml", [
        f"drafter.path=zoo:{name}", "deepspeed.bf16=true", "deepspeed.zero_stage=0", f"lora.r={32 if lora else 0}",
        f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}",
        f"data.max_prefix_len={prefix}"])
    model, tokenizer = load_drafter_model(recipe.drafter.path, family, "bfloat16", recipe.drafter.trust_remote_code)
    if lora:
        model = add_lora(model, 32, 32, 0.0, recipe.lora.target_modules)
    model.train()
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = [{"prompt_ids": torch.randint(300, 20_000, (prefix,), generator=generator, device="cpu").tolist(),
             "response_ids": torch.randint(300, 20_000, (response,), generator=generator, device="cpu").tolist()}
            for _ in range(micro_batch)]
    mask = recipe.drafter.mask_token_id if recipe.drafter.mask_token_id is not None else tokenizer.mask_token_id
    strategy = strategy_for(recipe)(recipe, model, rows, len(tokenizer), mask)
    windows = window_index([response] * len(rows), list(range(len(rows))))[:micro_batch]
    arranged, given = strategy.arrange(windows, 0)
    dens = strategy.denominators(arranged, given)
    launches = LaunchCount()
    with FlopCounterMode(display=False) as counter, launches.mode:
        strategy.micro_loss(strategy.batch(arranged, given, train=True), 0, 0, dens, 1.0).backward()
    total = int(counter.get_total_flops())
    # the outermost modules called (the packed strategy calls the encoder, the decoder and the head, a Linear, itself)
    roots = {k: int(sum(v.values())) for k, v in counter.get_flop_counts().items() if k != "Global" and "." not in k}
    return {"pair": pair, "strategy": strategy.name, "lora": lora, "micro_batch": micro_batch, "prefix": prefix,
            "response": response, "flops": total, "flops_per_window": total / micro_batch, "roots": roots,
            **launches.counts,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="gemma", choices=tuple(PAIRS))
    p.add_argument("--scale", default="gpu", choices=("cpu", "gpu"))
    p.add_argument("--micro-batch", default="4,8", help="windows per micro-batch (comma list)")
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from align.zoo.build import ZooSpec, build

    build([PAIRS[args.pair][0]], ZooSpec(replica_scale=args.scale))
    rows = [count(args.pair, lora, int(b), args.prefix, args.response)
            for b in args.micro_batch.split(",") for lora in (True, False)]
    print("| setting | micro-batch | TFLOPs per window | where (share of the step's FLOPs) | launches | host syncs |"
          "\n|---|---|---|---|---|---|")
    for r in rows:
        where = ", ".join(f"{k} {v / r['flops']:.0%}" for k, v in r["roots"].items())
        print(f"| {r['strategy']}, {'LoRA r=32' if r['lora'] else 'full'} | {r['micro_batch']} | "
              f"{r['flops_per_window'] / 1e12:.3f} | {where} | {r['launches']:,} | {r['syncs']:,} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
