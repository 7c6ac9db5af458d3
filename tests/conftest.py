"""Test order: tests/test_book.py first. Its site build executes every chapter (the longest single job), so
under `make test` (two workers, one file each at a time, no reordering) it starts at once on one worker while
the other worker runs the rest. Every kernel the tests start polls its channels in one-second slices
(_ext/kernel_poll.py: a missed wake-up otherwise stalls a notebook test for its whole cell timeout)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_ext"))
import kernel_poll  # noqa: E402

kernel_poll.apply()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name != "test_book.py")  # stable: the rest keep their order
