"""One writer per shared thing: file locks for the caches the toolkit fills on demand.

Two processes that need the same missing thing (the tiny world, a zoo model, a chunk of rollouts) — the ranks of
one DeepSpeed run, or two runs started at once on a fresh cache — must not both build it into the same folder. The
first takes the lock and builds; the others wait, then find it built. Locks are ``filelock.FileLock`` files under
``<cache>/locks/`` (released by the operating system when their holder dies, so a crashed builder never blocks the
next one); what a crashed builder left half-written is a ``*.partial`` folder the next builder discards with a
notice.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout


def lock_path(folder: Path, name: str) -> Path:
    """The lock file for ``name`` in ``folder/locks`` (the name made file-safe)."""
    return folder / "locks" / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".lock")


@contextmanager
def exclusive(folder: Path, name: str, what: str | None = None) -> Iterator[None]:
    """Hold the lock ``name`` of ``folder`` for the block; when another process holds it, say so once and wait."""
    path = lock_path(folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process that is building {what or name} (lock {path})", flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def discard_partial(partial: Path, what: str) -> None:
    """Remove ``partial``, the leftover of a build that did not finish, telling the user when there was one."""
    if partial.exists():
        print(f"discarding {partial}: an unfinished build of {what} (its builder stopped before the end)", flush=True)
        shutil.rmtree(partial, ignore_errors=True)


def hold_folder(folder: Path, what: str) -> FileLock:
    """Claim the output folder ``folder`` for this process until it exits (the lock is returned: keep it), or
    raise ``AlignError`` at once when another process is writing there. The lock lives in the cache, keyed by the
    folder's absolute path, so the folder itself holds only what the run writes."""
    from align.errors import AlignError
    from align.zoo import cache_dir

    key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]
    path = lock_path(cache_dir(), f"output-{key}")
    if str(path) in _HELD and _HELD[str(path)].is_locked:  # this process holds it already (an earlier run in it)
        return _HELD[str(path)]
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise AlignError(f"another process is writing {what} into {folder} (lock {path}); wait for it to finish "
                         "or choose another output folder") from None
    _HELD[str(path)] = lock
    return lock


_HELD: dict[str, FileLock] = {}  # output folders this process has claimed (until it exits or releases them)
