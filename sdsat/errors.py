"""One-line errors: a setting outside its range, and an exception turned into the line a user reads.

The range checks raise ValueError naming the setting and its allowed range. They take any value, as an
API caller may send (a string, a list, NaN, an int of 5000 digits), and never echo a huge one back.
"""

from __future__ import annotations

import math


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, or its type's name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def shown(value, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short (a 1 MB list must not come back)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        # counted from its bits: str() of an int beyond 4300 digits raises in Python 3.11
        return (f"a {len(str(abs(value)))}-digit number" if value.bit_length() < 14000
                else "a number of over 4000 digits")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {shown(value)}")


def check_whole(name: str, value, low: int, high: int, off: bool = False) -> None:
    """`value` is an int (not a bool) in [low, high]; `off`: the low end switches the setting off."""
    low_text = f"{low} (off)" if off else str(low)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number between {low_text} and {high}, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low_text} and {high}, got {shown(value)}")


def check_real(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """`value` is a finite int or float (not a bool) in [low, high], or (low, high] when `low_open`."""
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
    try:
        number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    except OverflowError:  # an int beyond float's range
        number = None
    if number is None or not math.isfinite(number):
        raise ValueError(f"{name} must be a number in {bound}, got {shown(value)}")
    if number > high or number < low or (low_open and number == low):
        raise ValueError(f"{name} must be in {bound}, got {shown(value)}")
