"""Test order: tests/test_book.py first, tests/test_lab.py second. The site build executes every chapter (the
longest single job), so under `make test` (two workers, one file each at a time, no reordering) it starts at
once on one worker, and the JupyterLab test (the next longest) at once on the other, which then runs the rest
(a worker is handed its next file before it finishes the one it runs: a long file third would wait for the
site build). Every kernel the tests start polls its channels in one-second slices
(_ext/kernel_poll.py: a missed wake-up otherwise stalls a notebook test for its whole cell timeout). The runs
the tests read are kept in a run cache of the test session's own (`run_cache`), not in the one `make` exports
for the book: the tests' temporary records would stay there, about 100 MB a `make test`."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_ext"))
import kernel_poll  # noqa: E402

kernel_poll.apply()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = ["test_book.py", "test_lab.py"]
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda item: rank.get(item.path.name, len(first)))  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """$LOWPREC_RUN_CACHE (`runs.load_run` keeps the runs it parses there) set to a folder of this session
    for every test and the processes it starts; the site build (`make book`) keeps its own."""
    before = os.environ.get("LOWPREC_RUN_CACHE")
    os.environ["LOWPREC_RUN_CACHE"] = str(tmp_path_factory.mktemp("run-cache"))
    yield
    if before is None:
        del os.environ["LOWPREC_RUN_CACHE"]
    else:
        os.environ["LOWPREC_RUN_CACHE"] = before
