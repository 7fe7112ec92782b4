"""One clear line for bad input.

Every command-line entry point runs through :func:`run_cli`: an :class:`AlignError` (or a ``FileNotFoundError`` /
``ValueError`` raised while reading user input) is printed as ``error: <message>`` and the process exits with
status 2, with no traceback unless ``--debug`` is given or ``ALIGN_DEBUG=1`` is set.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable


class AlignError(Exception):
    """A problem with the user's input: the message names the problem and the fix, on one line (line breaks that
    come with the user's own text are shown escaped, as ``\\n``)."""

    def __init__(self, message: str = "", *args):
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)


def quiet_libraries() -> None:
    """Keep the libraries' own progress bars and advice out of our output (ours remain)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - both are dependencies
        pass


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> None:
    """Run ``main(argv)`` and turn an :class:`AlignError`, or a write that found no room on the disk
    (:func:`disk_full`), into one line on stderr and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_libraries()
    debug = os.environ.get("ALIGN_DEBUG") == "1"
    if "--debug" in argv:
        argv.remove("--debug")
        debug = True
    try:
        code = main(argv)
    except AlignError as error:
        if debug:
            raise
        _close_progress_bars()
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        lacking = disk_full(error)
        if debug or lacking is None:
            raise
        _close_progress_bars()
        where = f" writing {error.filename}" if getattr(error, "filename", None) else ""
        print(f"error: no room on the disk{where} ({os.strerror(lacking)}); free space and run the same command "
              "again: what was written completely is kept (checkpoints, rollout chunks) and the rest is redone",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)


DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}  # no space, file over the size limit, quota exceeded


def disk_full(error: BaseException) -> int | None:
    """The errno of a write that found no room (:data:`DISK_FULL`), or None: an OSError's own, or the one a library's
    error carries in Rust's form, ``(os error 28)`` (safetensors, which writes every model folder)."""
    if isinstance(error, OSError):
        return error.errno if error.errno in DISK_FULL else None
    return next((code for code in DISK_FULL if f"(os error {code})" in str(error)), None)


def _close_progress_bars() -> None:
    """End any progress bar still drawn, so that the error starts a line of its own."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - a dependency
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
