"""Option types the ``kvtier`` subcommands share (argparse ``type=`` callables): one wording of
what an option must be, for every command that takes a bounded int."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

__all__ = ["int_option"]


def int_option(low: int, high: Optional[int] = None, *, none: Sequence[str] = (),
               none_text: str = "'none'") -> Callable[[str], Optional[int]]:
    """An argparse type reading an int in ``[low, high]`` (no upper bound when ``high`` is None),
    or ``None`` for any of the words in ``none`` (any case). Anything else is an
    ``ArgumentTypeError`` saying what is expected: ``must be 'none' or an int >= 0, got 'x'``."""
    bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    expected = f"{none_text} or {bound}" if none else bound
    words = {word.lower() for word in none}

    def parse(text: str) -> Optional[int]:
        if text.lower() in words:
            return None
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse
