"""Writing files and folders so that a crash never leaves a half-written one: write a temporary sibling, then
rename it.

``os.replace`` within one folder is atomic on POSIX file systems: a reader sees the old file or the new one, never a
mix; a process killed mid-write leaves only a ``.<name>.tmp-<pid>`` file or a ``<name>.partial`` folder, which the
next write of that file or folder removes (folders with a notice).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


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


def save_tensors(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically. torch reports a write that failed (a full disk, a file size limit) as a
    RuntimeError of its zip writer; it is raised here as the OSError it is (ENOSPC), so that the command ends with
    its one line on the disk (:func:`align.errors.run_cli`) instead of a traceback."""
    import torch

    with atomic_path(path) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as error:
            if not any(mark in str(error) for mark in ("inline_container", "PytorchStreamWriter")):
                raise
            raise OSError(errno.ENOSPC, f"torch.save could not write {path} ({str(error).splitlines()[0][:120]})",
                          str(path)) from error


def discard_partial(partial: Path, what: str) -> None:
    """Remove ``partial``, the leftover of a build that did not finish, telling the user when there was one."""
    if partial.exists():
        print(f"discarding {partial}: an unfinished build of {what} (its builder stopped before the end)", flush=True)
        shutil.rmtree(partial, ignore_errors=True)


@contextmanager
def atomic_folder(out: str | Path, what: str) -> Iterator[Path]:
    """A fresh ``<out>.partial`` folder to write ``what`` into; when the block ends without error it replaces
    ``out``, whose previous contents stay whole until the new ones are in place."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    discard_partial(partial, what)
    partial.mkdir()
    yield partial
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)
