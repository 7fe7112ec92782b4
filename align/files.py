"""Writing files so that a crash never leaves a half-written one: write a temporary sibling, then rename it.

``os.replace`` within one folder is atomic on POSIX file systems: a reader sees the old file or the new one, never a
mix; a process killed mid-write leaves only a ``.<name>.tmp-<pid>`` sibling, which the next write of that file
removes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # a killed writer's leftovers
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """``Path(path).write_text(text)``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
