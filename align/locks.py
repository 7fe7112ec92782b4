"""One writer per shared thing: file locks for the caches the toolkit fills on demand.

Two processes that need the same missing thing (the tiny world, a zoo model, a chunk of rollouts) — the ranks of
one DeepSpeed run, or two runs started at once on a fresh cache — must not both build it into the same folder. The
first takes the lock and builds; the others wait, then find it built. Locks are ``filelock.FileLock`` files under
``<cache>/locks/`` (released by the operating system when their holder dies, so a crashed builder never blocks the
next one); what a crashed builder left half-written is a ``*.partial`` folder the next builder discards with a
notice (``align.files.discard_partial``).
"""

from __future__ import annotations

import hashlib
import re
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
    lock = _try_lock(path)
    if lock is None:
        print(f"waiting for another process that is building {what or name} (lock {path})", flush=True)
        lock = FileLock(str(path))
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def hold_folder(folder: Path, what: str) -> FileLock:
    """Claim the output folder ``folder`` for this process until it exits (the lock is returned: keep it), or
    raise ``AlignError`` at once when another process is writing there. The lock lives in the cache, keyed by the
    folder's absolute path, so the folder itself holds only what the run writes."""
    from align.errors import AlignError
    from align.paths import cache_dir

    key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]
    path = lock_path(cache_dir(), f"output-{key}")
    if str(path) in _HELD and _HELD[str(path)].is_locked:  # this process holds it already (an earlier run in it)
        return _HELD[str(path)]
    lock = _try_lock(path)
    if lock is None:
        raise AlignError(f"another process is writing {what} into {folder} (lock {path}); wait for it to finish "
                         "or choose another output folder")
    _HELD[str(path)] = lock
    return lock


def _try_lock(path: Path) -> FileLock | None:
    """The lock at ``path``, taken without waiting, or None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


_HELD: dict[str, FileLock] = {}  # output folders this process has claimed (until it exits or releases them)
