"""Turning an exception into the one line a user reads."""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, or its type's name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
