"""Test order: tests/test_book.py first. Its site build executes every chapter (the longest single job), so
under `make test` (two workers, one file each at a time, no reordering) it starts at once on one worker while
the other worker runs the rest."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name != "test_book.py")  # stable: the rest keep their order
