"""Number checks shared by configs and commands: `number` checks a value (finite, of a kind, within
bounds) and raises a ValueError naming it; `option` is the same check as an argparse type, so that every
numeric option of every command is refused before any work starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _bound(value: float | None) -> str:
    """A bound as written: 2**k for a large power of two, else as short as it reads."""
    if isinstance(value, int) and value >= 2**16 and not value & (value - 1):
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else f"{value}"


def _describe(kind: type, low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """E.g. ">= 1 (an int)", "> 0 (a finite number)", "in [0, 1) (a finite number)"."""
    what = "an int" if kind is int else "a finite number"
    lo, hi = (_bound(b) for b in (low, high))
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'} ({what})"
    if low is not None:
        return f"{'>' if low_open else '>='} {lo} ({what})"
    if high is not None:
        return f"{'<' if high_open else '<='} {hi} ({what})"
    return what


def _fits(value: object, kind: type, low: float | None, high: float | None, low_open: bool,
          high_open: bool) -> bool:
    kinds = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        return False
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def number(name: str, value: object, kind: type = float, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> int | float:
    """`value` if it is a finite `kind` (int: an int; float: an int or a float; never a bool) within [low,
    high] (an open end excludes its bound; None: unbounded); else ValueError naming `name`."""
    if not _fits(value, kind, low, high, low_open, high_open):
        raise ValueError(f"{name} must be {_describe(kind, low, high, low_open, high_open)}, got {value!r}")
    return value


def option(kind: type = float, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], int | float]:
    """An argparse type: the text as `kind`, checked as `number` checks it (argparse names the option)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if not _fits(value, kind, low, high, low_open, high_open):
            raise argparse.ArgumentTypeError(f"must be {_describe(kind, low, high, low_open, high_open)}, "
                                             f"got {text!r}")
        return value

    return parse


def comma_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: "a,b" -> ("a", "b"), each one of `allowed`."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(filter(None, text.split(",")))
        if not items or any(i not in allowed for i in items):
            raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(allowed)}; got {text!r}")
        return items

    return parse
