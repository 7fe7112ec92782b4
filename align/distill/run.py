"""A training run's folder and its life: the recipe a rerun may resume (and the one it refuses), the batch split over
the processes, metrics.jsonl (and wandb), and what a non-finite loss leaves behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from align.config import Recipe, build_recipe
from align.distill.backend import deepspeed_config, list_checkpoints
from align.distill.distributed import barrier
from align.errors import AlignError
from align.files import write_text

# keys a rerun may change without changing the run (micro_batch_size: the same global batch, exactly accumulated)
RESUMABLE = {"train": {"max_steps", "save_every", "eval_every", "eval_windows", "keep_checkpoints", "micro_batch_size"},
             "data": {"feature_cache"}, "run": {"output_dir", "hub_kernels"}, "log": "*"}


def fit_micro_batch(recipe: Recipe, world: int, lead: bool) -> Recipe:
    """The recipe for ``world`` processes: a global batch smaller than micro-batch × processes is split evenly over
    the processes (with a notice), so a recipe written for one process runs unchanged on several; a batch that does
    not divide is refused now, before rollouts or models cost time."""
    t = recipe.train
    if t.micro_batch_size * world > t.global_batch_size and t.global_batch_size % world == 0:
        micro = t.global_batch_size // world
        if lead:
            print(f"train.micro_batch_size {t.micro_batch_size} x {world} processes is more than "
                  f"train.global_batch_size {t.global_batch_size}: {micro} windows per process", flush=True)
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(t, micro_batch_size=micro))
    deepspeed_config(recipe, world)  # raises the one-line error for a batch that does not divide
    return recipe


def freeze_embeddings(model) -> None:
    """No gradient for the token embeddings and the output head (tied or not)."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if module is not None:
            module.weight.requires_grad_(False)


class MetricsLog:
    """``metrics.jsonl`` always (lines after a resumed step are dropped), wandb when the recipe turns it on."""

    def __init__(self, path: Path, recipe: Recipe, lead: bool, resumed_step: int):
        self.path, self.lead, self.wandb = path, lead, None
        if not lead:
            return
        if path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_step]
            write_text(path, "".join(line + "\n" for line in kept))
        if recipe.log.wandb:
            import wandb

            self.wandb = wandb.init(project=recipe.log.wandb_project, name=recipe.run.name, mode=recipe.log.wandb_mode,
                                    dir=str(path.parent), config=recipe.to_dict(), resume="allow",
                                    id=f"{recipe.run.name}-{recipe.fingerprint(('run', 'drafter', 'distill'))}")

    def write(self, record: dict) -> None:
        if not self.lead:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            prefix = record["split"] + "/"
            self.wandb.log({prefix + k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def check_run_folder(out: Path, recipe: Recipe) -> None:
    """Refuse to write into a folder that holds a run of a different recipe (nothing there is touched)."""
    saved = out / "recipe.yaml"
    if not saved.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise AlignError(f"run.output_dir {out} is not empty and holds no run of align; choose another folder")
        return
    try:
        old = build_recipe(yaml.safe_load(saved.read_text())).to_dict()
    except (AlignError, yaml.YAMLError):
        raise AlignError(f"{saved} is not a valid recipe; {out} holds something else: choose another run.output_dir")
    new = recipe.to_dict()
    for section, keys in new.items():
        for key, value in keys.items():
            allowed = RESUMABLE.get(section, ())
            if allowed != "*" and key not in allowed and old[section][key] != value:
                raise AlignError(f"{out} holds a run of a different recipe ({section}.{key} was {old[section][key]!r}, "
                                 f"now {value!r}); choose another run.output_dir or delete that folder")


def stop_on_nonfinite(checkpoints: Path, step: int, lead: bool) -> str:
    """The weights after ``step`` steps gave a non-finite loss: set their checkpoint aside (renamed, not deleted)
    and say which checkpoint a rerun will resume from."""
    suspect = checkpoints / f"step-{step}"
    barrier()
    if lead and suspect.is_dir():
        suspect.rename(checkpoints / f"step-{step}.nonfinite")
    barrier()
    good = list_checkpoints(checkpoints)
    where = f"the last good checkpoint is {good[-1]}" if good else "there is no good checkpoint to resume from"
    aside = f" ({suspect.name} was set aside as {suspect.name}.nonfinite)" if suspect.exists() or lead else ""
    return (f"the loss is not finite at step {step + 1}; stopped without saving: {where}{aside}. Lower train.lr or "
            "check the rollouts, then run again")
