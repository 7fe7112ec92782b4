"""Export a training checkpoint as a drafter that ``from_pretrained`` loads like the original.

    python -m align.export runs/tiny/checkpoints/step-200 runs/tiny/step-200-export

The output holds the config, safetensors weights (ZeRO shards consolidated, LoRA merged, in ``--dtype``), tokenizer
and generation config of the base drafter, plus ``recipe.yaml`` (the resolved recipe) and ``meta.json`` (base
drafter, family, verifier, objective, steps, data fingerprint, held-out E[streak] before and after).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import yaml
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import align
from align.config import build_recipe, save_recipe
from align.distill.backend import full_state_dict
from align.distill.lora import merge_lora, update_kept
from align.errors import AlignError, run_cli
from align.families import traits
from align.files import atomic_folder
from align.loading import DTYPES, load_drafter_model


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the drafter of ``checkpoint`` to ``out`` (atomically) with weights in ``dtype``; returns ``out``."""
    checkpoint, out = Path(checkpoint), Path(out)
    recipe_file, state_file = checkpoint / "recipe.yaml", checkpoint / "trainer_state.json"
    if not recipe_file.is_file() or not state_file.is_file():
        raise AlignError(f"{checkpoint} is not a complete training checkpoint (it needs recipe.yaml and "
                         "trainer_state.json); pass a checkpoints/step-N folder")
    recipe = build_recipe(yaml.safe_load(recipe_file.read_text()))
    state = json.loads(state_file.read_text())
    weights = raw = full_state_dict(checkpoint)
    if recipe.lora.r:
        weights = merge_lora(raw, recipe.lora.alpha, recipe.lora.r)
    unset_hf_deepspeed_config()  # a ZeRO-3 run's partitioned loading must not apply to the model built here
    model, tokenizer = load_drafter_model(recipe.drafter.path, recipe.drafter.family, "float32",
                                          recipe.drafter.trust_remote_code)
    load_weights(model, weights, f"{checkpoint} does not match the drafter {recipe.drafter.path}")
    if recipe.lora.r and dtype != "float32":
        kept = update_kept(raw, weights, DTYPES[dtype])
        print(f"note: rounded to {dtype}, the merged weights keep {kept:.0%} of the LoRA update "
              "(export in float32 to keep all of it)", flush=True)
    model.to(DTYPES[dtype])
    meta = {
        "base_drafter": recipe.drafter.path, "family": recipe.drafter.family, "verifier": recipe.verifier.path,
        "objective": recipe.distill.objective, "gamma": recipe.distill.gamma,
        "canvas_seed": recipe.distill.canvas_seed, "first_token": recipe.distill.first_token,
        "denoise_steps": recipe.distill.denoise_steps,  # the T decoding drafts in by default (dflash)
        # what the drafter read of the prefix in training; align.drafters.diffusion.Drafter decides who re-reads it
        "context": recipe.data.max_prefix_len,
        "temperature": recipe.distill.temperature, "steps": state["step"], "run": recipe.run.name,
        "data_fingerprint": state.get("data_fingerprint"), "heldout": state.get("heldout", {}),
        "align_version": align.__version__, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if traits(recipe.drafter.family).reads_features:  # the verifier it reads: loading refuses any other
        meta["verifier_layers"] = model.config.target_layer_ids
        meta["verifier_fingerprint"] = (state.get("data_fingerprint") or {}).get("verifier_fingerprint")
        draft_vocab = (state.get("data_fingerprint") or {}).get("draft_vocab")
        if draft_vocab:  # the tokens it was trained to propose: decoding reads them from its config
            model.config.dflash_config["draft_vocab"] = draft_vocab
            meta["draft_vocab"] = len(draft_vocab)
    with atomic_folder(out, f"the export into {out}") as partial:  # the previous export stays whole until then
        model.save_pretrained(str(partial), safe_serialization=True)
        tokenizer.save_pretrained(str(partial))
        save_recipe(recipe, partial / "recipe.yaml")
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    return out


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], problem: str) -> None:
    """Load ``weights`` into ``model``; a name may be missing only when it shares its tensor with one that is not
    (tied embeddings, DiffusionGemma's shared encoder/decoder layers)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {name for group in names.values() if any(n in weights for n in group) for name in group}
    missing = sorted(set(missing) - tied - {k for k, _ in model.named_buffers()})
    if missing or unexpected:
        raise AlignError(f"{problem}: missing {missing[:3]}, unexpected {sorted(unexpected)[:3]}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoints/step-N folder")
    parser.add_argument("out", help="output folder (replaced if it exists)")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES), help="dtype of the exported weights")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
