"""Progress for long steps (calibration, profiling, predictor training, builds).

On a terminal (or in a notebook) a tqdm bar, because tqdm handles those and rate estimates well.
Anywhere else (a pipe, a log file, CI) a bar is carriage returns and escape codes, so plain lines
instead: about one per tenth of the work, and one when it is done. `quiet` (or PICOMPILE_QUIET=1)
prints nothing, for scripts."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator

from tqdm.auto import tqdm

LINES_PER_STAGE = 10  # plain-line mode: at most about this many lines before the final one
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn, naming the user's line (the first caller outside picompile: compile(...),
    generate(...)) rather than where inside picompile the warning was raised."""
    frame, level = sys._getframe(0), 1  # this function: stacklevel 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def quiet_by_default() -> bool:
    return os.environ.get("PICOMPILE_QUIET", "") not in ("", "0")


def progress_bar(items: Iterable, desc: str, quiet: bool = False, total: int | None = None,
                 file=None):
    """`items`, iterated with progress shown on `file` (default: sys.stderr at call time)."""
    if quiet or quiet_by_default():
        return items
    file = sys.stderr if file is None else file
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    if _interactive(file):
        return tqdm(items, desc=f"picompile: {desc}", total=total, leave=False, file=file)
    return _lines(items, desc, total, file)


def _interactive(file) -> bool:
    """A terminal, or a notebook (tqdm.auto picked its widget): where a live bar renders."""
    notebook = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)
    return notebook or bool(getattr(file, "isatty", lambda: False)())


def _lines(items: Iterable, desc: str, total: int | None, file) -> Iterator:
    """Yield `items`, writing `picompile: desc: i/total (p%)` lines, each ending in a newline:
    every step when there are few, else about every LINES_PER_STAGE-th of the work; a final
    line with the time taken. Without a total: a start line and the final line only."""
    t0 = time.perf_counter()
    every = max(1, -(-total // LINES_PER_STAGE)) if total else None
    if total is None:
        print(f"picompile: {desc}: started", file=file, flush=True)
    done = 0
    for item in items:
        yield item
        done += 1
        if every is not None and done % every == 0 and done < total:
            print(f"picompile: {desc}: {done}/{total} ({done / total:.0%})", file=file, flush=True)
    of = f"{done}/{total}" if total else f"{done} steps"
    print(f"picompile: {desc}: {of} done in {time.perf_counter() - t0:.1f}s", file=file, flush=True)


class _WithoutBars:
    """sys.stderr without the frames of tqdm bars that libraries draw with plain tqdm (each a
    write holding a carriage return, and the newline that closes the bar), every other write
    passed on: transformers' GGUF loader ("Converting and de-quantizing GGUF tensors") ignores
    its own disable_progress_bar()."""

    def __init__(self, stream):
        self.stream, self.in_bar = stream, False

    def write(self, text: str) -> int:
        if "\r" in text or (self.in_bar and text == "\n"):
            self.in_bar = "\r" in text
        else:
            self.in_bar = False
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def library_bars(quiet: bool = False):
    """Within it, Hugging Face's own bars (transformers' "Loading weights", its GGUF loader's)
    show only where ours would be a bar: not in a pipe or a log, nor when quiet."""
    from transformers.utils import logging as hf_logging

    hide = quiet or quiet_by_default() or not _interactive(sys.stderr)
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not hide:
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(_WithoutBars(sys.stderr)):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_transformers():
    """Within it, transformers logs errors only (its warnings, where picompile says the same
    in its own words or they do not apply)."""
    import logging

    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def note(message: str, quiet: bool = False) -> None:
    """One line on stderr about a decision the user may want to know of (not when quiet)."""
    if not (quiet or quiet_by_default()):
        tqdm.write(f"picompile: {message}", file=sys.stderr)
