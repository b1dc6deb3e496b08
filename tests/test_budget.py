"""parse_budget: GPU budget strings read the way accelerate's max_memory reads them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picompile.budget import parse_budget


@pytest.mark.parametrize("text,want", [
    ("24GB", 24 * 10**9),
    ("24GiB", 24 * 2**30),
    ("24 GiB", 24 * 2**30),
    ("24GIB", 24 * 2**30),
    ("512MB", 512 * 10**6),
    ("512MiB", 512 * 2**20),
    ("1KB", 1000),
    ("1KiB", 1024),
    ("2TB", 2 * 10**12),
    ("1TiB", 2**40),
    ("0", 0),
    ("0GB", 0),
    ("123", 123),
    ("123B", 123),
    (" 24GB ", 24 * 10**9),
    ("1.5GB", 1_500_000_000),
    ("0.5GiB", 2**29),
])
def test_strings(text, want):
    got = parse_budget(text)
    assert got == want and type(got) is int


@pytest.mark.parametrize("value", [0, 123, 24 * 10**9, 10**15])
def test_ints_are_bytes(value):
    got = parse_budget(value)
    assert got == value and type(got) is int


def test_none_means_no_budget():
    assert parse_budget(None) is None


@given(st.integers(0, 99_999), st.sampled_from([("GB", 10**9), ("MB", 10**6), ("KB", 10**3)]))
def test_decimal_fractions_are_exact(hundredths, unit):
    """'2.01GB' is 2_010_000_000 bytes, not 2_009_999_999 (binary floating point)."""
    name, size = unit
    text = f"{hundredths // 100}.{hundredths % 100:02d}{name}"
    assert parse_budget(text) == hundredths * size // 100


def test_fractional_bytes_round_down():
    assert parse_budget("0.1GiB") == 2**30 // 10  # a budget is never exceeded by rounding up
    assert parse_budget("1.9") == 1


@pytest.mark.parametrize("bad", [
    "24 parsecs", "-1", "-1GB", "GB", "24Gb", "24gb", "24kb", "24Mi", "", "  ", "1e9", "24 G B",
    "24GBs", "0x10", "24,5GB", "nan", "inf",
    -5, -1, 1.5, 24.0, True, False, [24], b"24GB",
])
def test_rejects_with_a_helpful_message(bad):
    with pytest.raises(ValueError) as e:
        parse_budget(bad)
    msg = str(e.value)
    assert "gpu_budget" in msg
    assert "24GB" in msg or "24GiB" in msg, msg  # an example of what works
