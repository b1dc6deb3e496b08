"""GPU budget strings, read the way accelerate's `max_memory` reads them.

"24GB" = 24e9 bytes, "24GiB" / "24 GiB" = 24 * 2**30, "512MB", "0"; an int is a byte count.
Written here rather than borrowed from accelerate, whose parser also reads a lowercase "b" as
bits ("24Gb" = 3e9), which is a surprise we would rather turn into an error."""

from __future__ import annotations

import re
from fractions import Fraction

UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


def parse_budget(budget: int | str | None) -> int | None:
    """Bytes as an int, or None for "no GPU budget given". Raises ValueError on anything else."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ValueError(
            f"gpu_budget must be an int (bytes) or a string like '24GB' or '24GiB', "
            f"not {type(budget).__name__}"
        )
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(
                f"gpu_budget must not be negative, got {budget}: give bytes (an int >= 0) or a "
                "string like '24GB' or '24GiB'"
            )
        return budget
    m = _BUDGET.match(budget)
    if not m or (m.group(2) and m.group(2)[-1] != "B"):
        raise ValueError(
            f"gpu_budget {budget!r} is not a size: use bytes (an int) or a number with a unit, "
            "e.g. '24GB' (24e9 bytes), '24GiB' (24 * 2**30), '512MB', '0'"
        )
    unit = (m.group(2) or "").upper()
    # Exact decimal arithmetic ("2.01GB" is 2_010_000_000, not float's 2_009_999_999); a
    # fractional byte rounds down, so the budget is never exceeded.
    return int(Fraction(m.group(1)) * UNITS[unit])
