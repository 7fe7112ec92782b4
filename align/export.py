"""Export a training checkpoint as a drafter that ``from_pretrained`` loads like the original.

    python -m align.export runs/tiny/checkpoints/step-200 runs/tiny/step-200-export

The output holds the config, safetensors weights (ZeRO shards consolidated, LoRA merged), tokenizer and generation
config of the base drafter, plus ``recipe.yaml`` (the resolved recipe) and ``meta.json`` (base drafter, family,
verifier, objective, steps, data fingerprint, held-out E[streak] before and after).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

import align
from align.config import Recipe, build_recipe, save_recipe
from align.distill.backend import full_state_dict
from align.errors import AlignError, run_cli
from align.loading import load_drafter_model


def lora_model(model: Any, recipe: Recipe) -> Any:
    """``model`` wrapped with the recipe's LoRA adapters (PEFT)."""
    from peft import LoraConfig, get_peft_model

    lora = recipe.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, bias="none")
    return get_peft_model(model, config)


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the drafter of ``checkpoint`` to ``out`` (atomically); returns ``out``."""
    checkpoint, out = Path(checkpoint), Path(out)
    recipe_file, state_file = checkpoint / "recipe.yaml", checkpoint / "trainer_state.json"
    if not recipe_file.is_file() or not state_file.is_file():
        raise AlignError(f"{checkpoint} is not a complete training checkpoint (it needs recipe.yaml and "
                         "trainer_state.json); pass a checkpoints/step-N folder")
    recipe = build_recipe(yaml.safe_load(recipe_file.read_text()))
    state = json.loads(state_file.read_text())
    weights = full_state_dict(checkpoint)
    model, tokenizer = load_drafter_model(recipe.drafter.path, recipe.drafter.family, "float32",
                                          recipe.drafter.trust_remote_code)
    if recipe.lora.r:
        model = lora_model(model, recipe)
        model.load_state_dict(weights, strict=False)
        model = model.merge_and_unload()
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {k for k in missing if any(k.endswith(s) for s in ("lm_head.weight", "decoder.weight"))}
        if set(missing) - tied or unexpected:
            raise AlignError(f"{checkpoint} does not match the drafter {recipe.drafter.path}: missing "
                             f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial), safe_serialization=True)
    tokenizer.save_pretrained(str(partial))
    save_recipe(recipe, partial / "recipe.yaml")
    meta = {
        "base_drafter": recipe.drafter.path, "family": recipe.drafter.family, "verifier": recipe.verifier.path,
        "objective": recipe.distill.objective, "gamma": recipe.distill.gamma,
        "temperature": recipe.distill.temperature, "steps": state["step"], "run": recipe.run.name,
        "data_fingerprint": state.get("data_fingerprint"), "heldout": state.get("heldout", {}),
        "align_version": align.__version__, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoints/step-N folder")
    parser.add_argument("out", help="output folder (replaced if it exists)")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
