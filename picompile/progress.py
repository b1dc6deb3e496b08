"""Progress for long steps (calibration, profiling, predictor training, builds).

tqdm, because it already handles terminals, notebooks, pipes and rate estimates well; `quiet`
(or PICOMPILE_QUIET=1) turns it off for scripts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm


def quiet_by_default() -> bool:
    return os.environ.get("PICOMPILE_QUIET", "") not in ("", "0")


def progress_bar(items: Iterable, desc: str, quiet: bool = False, total: int | None = None):
    return tqdm(items, desc=f"picompile: {desc}", total=total, leave=False,
                disable=quiet or quiet_by_default())


def note(message: str, quiet: bool = False) -> None:
    """One line on stderr about a decision the user may want to know of (not when quiet)."""
    if not (quiet or quiet_by_default()):
        tqdm.write(f"picompile: {message}", file=sys.stderr)
