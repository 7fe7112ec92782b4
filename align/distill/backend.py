"""DeepSpeed as the training engine, on one CPU or many GPUs: config, step, atomic checkpoints, export.

The DeepSpeed config is derived from the recipe here, and only here (no JSON to keep in sync). Checkpoints are
written under a temporary name and renamed to ``checkpoints/step-N`` once every process has written its part, so a
crash while saving leaves the previous checkpoint whole; a checkpoint exists if and only if its folder is named
``step-N``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from align.config import Recipe
from align.errors import AlignError
from align.machine import accelerator, bf16_training

TAG = "ds"  # DeepSpeed's own folder inside each checkpoint


def deepspeed_config(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for ``recipe`` on ``world_size`` processes."""
    t, ds = recipe.train, recipe.deepspeed
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise AlignError(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                         f"train.micro_batch_size x processes ({t.micro_batch_size} x {world_size}); change one of them")
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    pin = accelerator().device_name() != "cpu"  # pinned host memory speeds copies to a GPU; on the CPU it is none
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // per_step,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "weight_decay": t.weight_decay, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "torch_adam": ds.torch_adam}},
        "bf16": {"enabled": bf16_training(ds.bf16)},
        "zero_optimization": zero,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def lr_factor(step: int, max_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up over ``warmup`` steps, then linear/cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * shape


class Engine:
    """The model inside DeepSpeed: backward, step, save and load, whatever the ZeRO stage or device."""

    @staticmethod
    def prepare(recipe: Recipe, world_size: int) -> Any:
        """Call before loading the model: under ZeRO-3 it makes ``from_pretrained`` load the weights sharded.
        Keep the returned object alive until training ends."""
        if recipe.deepspeed.zero_stage != 3:
            return None
        from transformers.integrations import HfDeepSpeedConfig

        return HfDeepSpeedConfig(deepspeed_config(recipe, world_size))

    def __init__(self, model: torch.nn.Module, recipe: Recipe, world_size: int):
        import deepspeed

        t = recipe.train
        self.config = deepspeed_config(recipe, world_size)
        self.accumulation = self.config["gradient_accumulation_steps"]
        self.world_size = world_size

        def scheduler(optimizer):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
                s, t.max_steps, t.warmup_steps, t.schedule, t.min_lr_ratio))

        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=self.config,
                                                    lr_scheduler=scheduler)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, checkpoints: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        """Write ``checkpoints/step-<step>`` atomically (all processes take part); keep the ``keep`` newest."""
        partial = checkpoints / f".step-{step}.partial"
        final = checkpoints / f"step-{step}"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        try:
            self.engine.save_checkpoint(str(partial), tag=TAG, client_state={"trainer": state})
            if _rank() == 0:
                (partial / "trainer_state.json").write_text(json.dumps(state, indent=1))
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            # this process leaves with one line; the launcher stops the others (which may wait in the save's
            # collectives); the partial folder is the lead's to remove, and a rerun discards whatever is left
            if _rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            kept = list_checkpoints(checkpoints)
            raise AlignError(f"could not write checkpoint step-{step} into {checkpoints} (a full disk or a file size "
                             f"limit? {str(error).strip().splitlines()[0][:160]}); free space and run "
                             f"again: it resumes from {kept[-1].name if kept else 'the start'}") from None
        _barrier()
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            for old in list_checkpoints(checkpoints)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, checkpoint: Path) -> dict[str, Any]:
        """Restore weights, optimizer and schedule from ``checkpoint``; returns the trainer state saved with it."""
        check_pickles(checkpoint)
        _, client = self.engine.load_checkpoint(str(checkpoint), tag=TAG)
        if client is None:
            raise AlignError(f"checkpoint {checkpoint} could not be read; delete it to resume from the one before")
        return client["trainer"]


def list_checkpoints(checkpoints: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def deepspeed_safe_types() -> list[type]:
    """The plain-data classes DeepSpeed writes into its checkpoint pickles besides tensors and containers (found by
    loading every ZeRO stage's files weights-only): the loss scaler, the ZeRO stage enum, a fragment's address. None
    defines ``__setstate__`` or ``__reduce__``: the weights-only unpickler fills their fields and runs none of their
    code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_pickles(checkpoint: Path) -> dict[str, Any]:
    """Every pickle of ``checkpoint`` reads with torch's weights-only unpickler — tensors, containers, plain values and
    the few plain-data DeepSpeed classes of ``deepspeed_safe_types`` — which runs no code. DeepSpeed itself unpickles
    them with ``weights_only=False``, so a checkpoint folder from elsewhere could run arbitrary code on export or
    resume; refused here first, with one line. Returns what each file holds, by file name, memory-mapped: the
    tensors' data is read only when used."""
    import pickle

    loaded = {}
    with torch.serialization.safe_globals(deepspeed_safe_types()):
        for file in sorted((Path(checkpoint) / TAG).glob("*.pt")):
            try:
                loaded[file.name] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except (pickle.UnpicklingError, RuntimeError, AttributeError) as error:
                lines = [line.strip() for line in str(error).splitlines() if "Unsupported" in line]
                reason = (lines or [str(error).strip().splitlines()[0]])[0][:200]
                raise AlignError(f"{file} holds more than tensors and plain data ({reason}); unpickling it could run "
                                 "code, so it is refused: use a checkpoint align/train.py wrote") from None
    return loaded


def full_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint, whatever the ZeRO stage (consolidated from the shards)."""
    folder = Path(checkpoint) / TAG
    if not folder.is_dir():
        raise AlignError(f"{checkpoint} is not a training checkpoint (no {TAG}/ folder inside)")
    loaded = check_pickles(checkpoint)
    if any(folder.glob("*optim_states.pt")) and any(folder.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=TAG)
    if "mp_rank_00_model_states.pt" not in loaded:
        raise AlignError(f"{checkpoint} has no {TAG}/mp_rank_00_model_states.pt; delete it to use the one before")
    # stage 0: the weights are in the model states checked above (copied out of the mapped file once)
    return {k: v.to(torch.float32, copy=True) for k, v in loaded["mp_rank_00_model_states.pt"]["module"].items()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
