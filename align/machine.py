"""What this process may use: its CPU cores and its accelerator.

One rule says where work runs, for training and decoding alike: DeepSpeed's accelerator. ``DS_ACCELERATOR=cpu``
keeps everything on the CPU on a machine with a GPU (the Makefile sets it where there is none; the tests set it
for CPU runs), otherwise a visible GPU is used. The process group's backend follows the same accelerator (gloo on
the CPU, NCCL on CUDA), so a CPU-scale run on a GPU machine never pairs NCCL with CPU tensors.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The CPU cores this process may run on (taskset, cgroups), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def on_cpu_by_choice() -> bool:
    """Whether ``DS_ACCELERATOR=cpu`` keeps this process on the CPU whatever GPUs are visible."""
    return os.environ.get("DS_ACCELERATOR", "").strip().lower() == "cpu"


def default_device() -> str:
    """Where models run unless told otherwise: this process's GPU (``cuda:LOCAL_RANK`` under a launcher) when one is
    visible and ``DS_ACCELERATOR`` is not ``cpu``, else the CPU. DeepSpeed's engine picks the same device
    (:func:`check_accelerator` refuses a disagreement)."""
    if torch.cuda.is_available() and not on_cpu_by_choice():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def native_bf16(device: str | torch.device | None = None) -> bool:
    """Whether ``device`` (default: :func:`default_device`) computes in bfloat16 natively: a CUDA GPU that supports
    it; a CPU with AVX-512 BF16 or AMX tiles (x86) or the BF16 extension (Arm). Elsewhere bfloat16 is converted in
    software: on an AVX2-only AMD EPYC a 576x1536 linear layer ran 9x slower forward and 29x slower forward and
    backward in bfloat16 than in float32, and SmolLM2 scoring 16 positions 5.75 steps of one against float32's
    2.06 (docs/results.md)."""
    device = torch.device(device or default_device())
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own probes of the x86 CPU
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks) or _arm_bf16()


def _arm_bf16() -> bool:
    """Whether the kernel lists Arm's BF16 extension among the CPU's features."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("Features") and " bf16" in line for line in info)
    except OSError:
        return False


def resolve_dtype(dtype: str, device: str | torch.device | None = None) -> str:
    """A dtype name, with ``auto`` made concrete: bfloat16 where ``device`` computes in it natively
    (:func:`native_bf16`), else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16(device) else "float32"


def bf16_training(setting: bool | None) -> bool:
    """``deepspeed.bf16`` made concrete: null trains in bfloat16 where the device computes in it natively."""
    return native_bf16() if setting is None else setting


def vllm_on_every_core() -> None:
    """Before vLLM's CPU build starts an engine: the engine in this process, the model's threads on every core.

    By default vLLM runs its engine core in a second process, whose scheduler polls, and binds the model's threads to
    every core but one, kept for that process (``VLLM_CPU_NUM_OF_RESERVED_CPU``): on 2 cores the model runs on one.
    In this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler runs between the model's steps and no core
    waits for it: 256 SmolLM2 rollouts in bfloat16 took 104 s instead of 190 on 2 cores (docs/results.md). A value
    the user set is kept; nothing changes where CUDA is visible."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def accelerator():
    """DeepSpeed's accelerator for this process (its device, its collective backend)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def check_accelerator() -> None:
    """DeepSpeed's accelerator and :func:`default_device` name the same kind of device: the models a run loads go
    where the engine puts the drafter. (A DS_ACCELERATOR other than cpu or cuda is not one this toolkit has run
    on.)"""
    from align.errors import AlignError

    kind = accelerator().device_name()
    if kind != torch.device(default_device()).type:
        raise AlignError(f"DeepSpeed's accelerator is {kind} but the models would load on {default_device()}; set "
                         "DS_ACCELERATOR=cpu for a CPU run, or unset it to use the GPU")
