"""The processes of a training run: torch.distributed through DeepSpeed, on the backend of DeepSpeed's accelerator
(gloo on the CPU, NCCL on GPUs: ``align.machine``); a plain ``python`` run is one process of one, and every helper
here does nothing then."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from align.machine import accelerator, check_accelerator


def init_distributed(timeout_minutes: int = 120) -> tuple[int, int]:
    """Start torch.distributed through DeepSpeed on its accelerator's backend (gloo where ``DS_ACCELERATOR=cpu`` or
    no GPU is visible, NCCL on GPUs); a plain ``python`` run is one process of one.
    ``timeout_minutes``: how long a collective waits (torch's default, 10 to 30 minutes, is shorter than a rollout
    shard can take)."""
    import deepspeed

    if "RANK" not in os.environ:  # not started by a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if not dist.is_initialized():
        check_accelerator()
        if accelerator().device_name() == "cpu" and os.environ["WORLD_SIZE"] == "1":
            # DeepSpeed's shared-memory all-reduce speeds up CPU collectives between processes; one process has
            # none, and loading the op JIT-compiles it on first use (about 43 s) and then waits on a lock every
            # DeepSpeed process on the machine shares: skipped, gloo serves
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=accelerator().communication_backend_name(),
                                   timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        device_tensor = tensor.to(accelerator().current_device_name())  # NCCL reduces only tensors on its GPU
        dist.all_reduce(device_tensor)
        tensor.copy_(device_tensor.cpu())


def all_finite(loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every process (all stop together)."""
    flag = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], dtype=torch.float64, device="cpu")
    all_reduce(flag)
    return float(flag) == 0.0
