"""The tiny zoo's command line.

    python -m align.zoo build [NAME ...] [--force]   # build what is missing (the tiny models by default)
    python -m align.zoo build smollm2-135m-instruct gemma3-270m smollm2-dream gemma3-diffusiongemma  # the real ones
                                                      # (after make real-install)
    python -m align.zoo build replica-gemma4-verifier replica-diffusiongemma [--scale cpu|gpu]  # replicas
    python -m align.zoo report                        # measure the built zoo on held-out prompts
    python -m align.zoo list                          # what exists and where
"""

from __future__ import annotations

import argparse
import json
import time

from align.errors import AlignError, run_cli
from align.zoo import DEFAULT_BUILD, MODELS, REAL, cache_dir, is_built, model_dir, world_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.zoo", description="Build and inspect the zoo.")
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build missing zoo models")
    build_cmd.add_argument("names", nargs="*",
                           help=f"models to build: {', '.join(MODELS)} (default: {', '.join(DEFAULT_BUILD)})")
    build_cmd.add_argument("--force", action="store_true", help="rebuild even if built")
    build_cmd.add_argument("--scale", default="cpu", choices=("cpu", "gpu"),
                           help="size of the replica-* models (cpu: small, with the real vocabulary; gpu: ~1B)")
    sub.add_parser("report", help="measure the zoo on held-out prompts (writes report.json)")
    sub.add_parser("list", help="list zoo models")
    args = parser.parse_args(argv)

    if args.command == "build":
        from align.zoo.build import build

        unknown = [n for n in args.names if n not in MODELS]
        if unknown:
            raise AlignError(f"unknown zoo model '{unknown[0]}'; the zoo has: {', '.join(MODELS)}")
        start = time.time()
        from align.zoo.build import ZooSpec

        built = build(args.names or None, ZooSpec(replica_scale=args.scale), force=args.force)
        print(f"zoo ready in {cache_dir()} ({time.time() - start:.0f} s; built: {', '.join(built) or 'nothing new'})")
        names = args.names or DEFAULT_BUILD
        if any(name not in REAL for name in names):
            world = json.loads((world_dir() / "world.json").read_text())
            print("tiny world documents per category:", world["train_docs"])
            print("held-out prompts per category:", world["test_prompts"])
        for name in names:
            meta = json.loads((model_dir(name) / "zoo.json").read_text())
            if name in REAL and "loss_last" not in meta:  # a converted verifier, or prompts
                print(f"  zoo:{name}: {meta['description']}; built in {meta['seconds']:.0f} s")
                continue
            if "loss_last" not in meta and "scale" not in meta:  # random weights, nothing trained (tiny-dflash)
                print(f"  zoo:{name}: {meta['description']}; {meta['parameters'] / 1e6:.2f}M parameters, random "
                      "weights")
                continue
            if "loss_last" not in meta:  # a random-weight replica
                print(f"  zoo:{name}: {meta['description']}; {meta['parameters'] / 1e6:.1f}M parameters, "
                      f"{meta['tokens']} tokens, scale {meta['scale']}")
                continue
            print(f"  zoo:{name}: {meta['description']}; {meta['parameters'] / 1e6:.2f}M parameters, "
                  f"loss {meta['loss_last']:.3f}, built in {meta['seconds']:.0f} s")
    elif args.command == "report":
        from align.zoo.report import format_report, zoo_report

        if not is_built("tiny-verifier"):
            raise AlignError("the zoo is not built: run python -m align.zoo build first")
        print(format_report(zoo_report()))
    else:
        for name, description in MODELS.items():
            state = "built" if is_built(name) else "not built"
            print(f"zoo:{name:22s} {state:9s} {model_dir(name)}  ({description})")
    return 0


if __name__ == "__main__":
    run_cli(main)
