"""The verifier's features of every rollout, computed once and read from disk (``data.feature_cache: true``).

Online (the default), every training step runs the verifier over its rollouts for the features the dflash drafter
reads. With the cache, one pass over all the rollouts before training writes them to
``$ALIGN_CACHE/features/<key>/features.bin`` (row after row, in the verifier's dtype or in bfloat16:
``data.feature_dtype``), and every step reads its rollouts' rows from that file, memory-mapped: no verifier in the
training loop. The key fingerprints the token ids of every rollout, the verifier's weights, the layers and the
dtype, so other rollouts or another verifier get a file of their own, and runs over the same ones (a sweep, a
resumed run) share one; a build copies the rows of the sequences another cache of the same verifier, dtype, layers
and storage already holds (its index names each sequence by a digest), so more text after less runs the verifier
over the new sequences only. The lead process builds it (other processes wait); a build cut short leaves no index,
and the next run resumes it: every 30 s the build flushes the file and records which rollouts it holds
(``features.bin.done``), and a rerun computes only the others. The file is written through a shared memory map,
where a full disk is a bus error, not an error: so before the verifier runs the build checks that the disk has room
for what the file still lacks, refusing in one line where it has not, and allocates it.

Size: tokens × layers × the verifier's width × bytes — the tiny world's 136k tokens of prompts and responses × 2 ×
256 in float32 is 278 MB; SmolLM2's 1.21M tokens × 5 × 576, 14 GB in float32 and 7 in bfloat16; an 8B verifier's 3
layers of 4,096 in bfloat16, 24 KB a token (the tens of terabytes users of other trainers meet at millions of
rollouts: hence online by default).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from align.dflash.batch import pad
from align.errors import AlignError
from align.features import FeatureTap
from align.files import write_text
from align.locks import exclusive
from align.paths import cache_dir

INDEX = "index.json"
DATA = "features.bin"
PARTIAL = DATA + ".partial"  # the file while it is built
DONE = DATA + ".done"  # a build cut short: the rollouts its partial file holds


def cache_key(fingerprint: str, dtype: torch.dtype, layers: list[int], sequences: list[list[int]],
              stored: torch.dtype | None = None) -> str:
    """The cache's name: a digest of every rollout's tokens, the verifier's weights (``verifier_fingerprint``, which
    does not tell float32 from bfloat16), its dtype, the layers and the dtype the features are ``stored`` in where it
    is not the verifier's (a float32 verifier's features rounded to bfloat16 are not a bfloat16 verifier's)."""
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(_tokens(seq))
        digest.update(b"|")
    digest.update(json.dumps(_setting(fingerprint, dtype, layers, stored)).encode())
    return digest.hexdigest()[:16]


def cache_setting(fingerprint: str, dtype: torch.dtype, layers: list[int], stored: torch.dtype | None = None) -> str:
    """What a cache's rows depend on besides their tokens (the arguments of :func:`cache_key` but the sequences):
    caches of one setting hold the same row for the same sequence, so a build copies the rows another one holds."""
    return hashlib.sha256(json.dumps(_setting(fingerprint, dtype, layers, stored)).encode()).hexdigest()[:16]


def _setting(fingerprint: str, dtype: torch.dtype, layers: list[int], stored: torch.dtype | None) -> list:
    return [fingerprint, str(dtype), list(layers)] + ([str(stored)] if stored not in (None, dtype) else [])


def _tokens(seq: list[int]) -> bytes:
    return torch.tensor(seq, dtype=torch.int64, device="cpu").numpy().tobytes()


def sequence_digest(seq: list[int]) -> str:
    """One sequence's name in a cache's index (how another build of the same setting finds its row)."""
    return hashlib.sha256(_tokens(seq)).hexdigest()[:16]


def stored_dtype(setting: str, verifier_dtype: torch.dtype) -> torch.dtype:
    """The dtype features are stored in (``data.feature_dtype``): the verifier's own, or bfloat16."""
    return verifier_dtype if setting == "verifier" else getattr(torch, setting)


@torch.no_grad()
def build_cache(verifier: Any, layers: list[int], sequences: list[list[int]], key: str,
                batch_tokens: int = 16384, progress: bool = True,
                known: Callable[[], dict[int, torch.Tensor]] | None = None, checkpoint_s: float = 30.0,
                dtype: torch.dtype | None = None, setting: str | None = None) -> Path:
    """Write the features of every sequence under the cache's ``key`` (nothing to do when it is there already),
    stored in ``dtype`` (None: the verifier's); the verifier runs batches of about ``batch_tokens`` padded tokens,
    sorted by length, and stops after the deepest layer read. ``known()``, called only when the cache is built,
    gives features already computed by another pass of the same verifier (the labelled text's, ``align.labels``),
    per sequence index, at least as long as the sequence: those are copied, not run again. With ``setting``
    (:func:`cache_setting`), the index records it and every sequence's digest, and the rows of sequences that
    another built cache of the same setting holds are copied from it (a larger text set after a smaller one runs the
    verifier over the new rows only); a cache built before indexes named their rows gains the names when a build of
    its setting opens it. Every ``checkpoint_s`` seconds the file is flushed and the sequences it holds recorded, so
    that a build cut short resumes where it was."""
    folder = cache_dir() / "features" / key
    with exclusive(folder.parent, key, f"the feature cache {folder}"):
        if (folder / INDEX).is_file():
            if setting:
                _name_rows(folder, setting, sequences)
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        device = next(verifier.parameters()).device
        dtype = dtype or next(verifier.parameters()).dtype
        offsets = [0]
        for seq in sequences:
            offsets.append(offsets[-1] + len(seq))
        width = len(layers) * verifier.config.get_text_config().hidden_size
        partial, size = folder / PARTIAL, offsets[-1] * width * dtype.itemsize
        done = _written(folder, size)
        _reserve(partial, size, keep=bool(done))
        data = torch.from_file(str(partial), shared=True, size=offsets[-1] * width, dtype=dtype).view(-1, width)
        bar = tqdm(total=offsets[-1], initial=sum(len(sequences[i]) for i in done), desc="features", unit="tok",
                   disable=not progress, dynamic_ncols=True)
        digests = [sequence_digest(seq) for seq in sequences] if setting else []
        copied = (known() if known else {}).items(), _shared(folder, setting, digests, dtype, width, done)
        for i, features in itertools.chain(*copied):
            if i not in done and features.shape[0] >= len(sequences[i]) and features.shape[1] == width:
                data[offsets[i]:offsets[i + 1]] = features[:len(sequences[i])].to(dtype)
                done.add(i)
                bar.update(len(sequences[i]))
        saved = _checkpoint(folder, size, done)
        order = sorted((i for i in range(len(sequences)) if i not in done), key=lambda i: len(sequences[i]))
        with FeatureTap(verifier, layers, stop=True) as tap:
            lo = 0
            while lo < len(order):
                hi = lo + 1  # the longest batch of similar lengths within the token budget
                while hi < len(order) and (hi - lo + 1) * len(sequences[order[hi]]) <= batch_tokens:
                    hi += 1
                rows = order[lo:hi]
                ids, attention = pad([sequences[i] for i in rows])
                out = tap.run(verifier, input_ids=ids.to(device), attention_mask=attention.to(device),
                              use_cache=False).to("cpu", dtype)
                for r, i in enumerate(rows):
                    data[offsets[i]:offsets[i + 1]] = out[r, :len(sequences[i])]
                done.update(rows)
                bar.update(int(attention.sum()))
                if time.monotonic() - saved >= checkpoint_s:
                    saved = _checkpoint(folder, size, done)
                lo = hi
        bar.close()
        del data
        os.replace(partial, folder / DATA)
        index = {"offsets": offsets, "width": width, "dtype": str(dtype).removeprefix("torch."), "layers": list(layers)}
        if setting:
            index.update(setting=setting, digests=digests)
        write_text(folder / INDEX, json.dumps(index))
        (folder / DONE).unlink(missing_ok=True)
    return folder


def _name_rows(folder: Path, setting: str, sequences: list[list[int]]) -> None:
    """A cache whose index does not name its rows (built before indexes did) gains their names when a run opens it
    again, its sequences being that run's: from then on it gives its rows to other builds of its setting."""
    index = json.loads((folder / INDEX).read_text())
    lengths = [hi - lo for lo, hi in zip(index["offsets"], index["offsets"][1:])]
    if "digests" not in index and lengths == [len(seq) for seq in sequences]:
        index.update(setting=setting, digests=[sequence_digest(seq) for seq in sequences])
        write_text(folder / INDEX, json.dumps(index))


def _shared(folder: Path, setting: str | None, digests: list[str], dtype: torch.dtype, width: int,
            done: set[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, rows) for each sequence not ``done`` that another built cache of ``setting`` in ``folder``'s parent
    holds, stored in the same dtype and width: its rows read from that cache's file, which stays as it is."""
    if not setting:
        return
    wanted: dict[str, list[int]] = {}
    for i, d in enumerate(digests):
        if i not in done:
            wanted.setdefault(d, []).append(i)
    for index_file in sorted(folder.parent.glob(f"*/{INDEX}")):
        if index_file.parent == folder or not wanted:
            continue
        try:
            index = json.loads(index_file.read_text())
        except (OSError, ValueError):
            continue
        if (index.get("setting") != setting or index.get("width") != width
                or index.get("dtype") != str(dtype).removeprefix("torch.")):
            continue
        donor = FeatureCache(index_file.parent.name)
        for j, d in enumerate(index["digests"]):
            for i in wanted.pop(d, []):
                yield i, donor.data[donor.offsets[j]:donor.offsets[j + 1]]


def _written(folder: Path, size: int) -> set[int]:
    """The sequences a build cut short had written (its partial file flushed): none without a record, or where the
    partial file is not the size this build writes."""
    partial = folder / PARTIAL
    try:
        record = json.loads((folder / DONE).read_text())
    except (OSError, ValueError):
        return set()
    if record.get("bytes") != size or not partial.is_file() or partial.stat().st_size != size:
        return set()
    return set(record["done"])


def _reserve(partial: Path, size: int, keep: bool) -> None:
    """Give the partial file its ``size`` bytes on the disk before the verifier runs (``keep``: a build cut short,
    whose contents stay; only its holes are allocated). The file is written through a shared memory map, where a
    full disk is a bus error that kills the process mid-build, not an error anything can report: so the space is
    checked first (one line naming the shortfall and the ways out, nothing written) and then allocated, where a disk
    that fills meanwhile is the ordinary disk-full error (``align.errors.run_cli``)."""
    held = partial.stat().st_blocks * 512 if partial.is_file() else 0  # what the old partial file occupies
    need = max(0, size - held) if keep else size
    free = shutil.disk_usage(partial.parent).free + (0 if keep else held)  # an unusable old file is rewritten
    if need > free:
        raise AlignError(f"the feature cache needs {_amount(need)} more in {partial.parent} and that disk has "
                         f"{_amount(free)} free: free space there, set ALIGN_CACHE to a folder on a larger disk, "
                         "or train without it (data.feature_cache: false: the verifier then runs in every step)")
    allocate = getattr(os, "posix_fallocate", None)  # not on every platform: there a sparse file, as checked
    with open(partial, "r+b" if keep else "wb") as f:
        f.truncate(size)
        try:
            if allocate is not None and size:
                allocate(f.fileno(), 0, size)
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # a file system that cannot allocate ahead
                raise


def _amount(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def _checkpoint(folder: Path, size: int, done: set[int]) -> float:
    """Flush the partial file to disk, then record the sequences it holds; the time it was done."""
    with open(folder / PARTIAL, "rb+") as f:
        os.fsync(f.fileno())
    write_text(folder / DONE, json.dumps({"bytes": size, "done": sorted(done)}))
    return time.monotonic()


class FeatureCache:
    """The features of every rollout of a built cache, memory-mapped: :meth:`take` gives a batch's rows."""

    def __init__(self, key: str):
        folder = cache_dir() / "features" / key
        index = json.loads((folder / INDEX).read_text())
        self.offsets, self.width = index["offsets"], index["width"]
        dtype = getattr(torch, index["dtype"])
        self.data = torch.from_file(str(folder / DATA), shared=False, size=self.offsets[-1] * self.width,
                                    dtype=dtype).view(-1, self.width)

    def take(self, rows: list[int], length: int) -> torch.Tensor:
        """The features (R, length, F) of rollouts ``rows``, zero after each rollout's end."""
        out = torch.zeros((len(rows), length, self.width), dtype=self.data.dtype, device="cpu")
        for r, i in enumerate(rows):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            out[r, :hi - lo] = self.data[lo:hi]
        return out
