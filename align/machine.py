"""What this process may use: its CPU cores and its accelerator."""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The CPU cores this process may run on (taskset, cgroups), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_device() -> str:
    """The accelerator when there is one (this process's GPU under a launcher), else the CPU."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"
