"""`lowprec experiment NAME ...`: named experiments, each in its own module of this package.

A module exposes `configure(parser)` (its arguments) and `run(args) -> int`; add an experiment by adding one
line to EXPERIMENTS (e.g. "explode": ("lowprec.experiments.explode", "...")). Modules are imported lazily,
as in lowprec.cli, so one experiment's dependencies never slow down or break another.
"""

from __future__ import annotations

import argparse
import importlib

from lowprec.cli import add_subcommand

# experiment -> (module, one-line help)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "positive-control": (
        "lowprec.experiments.positive_control",
        "one attention layer where biased rounding is the only driver of W_Q drift (CPU, ~1 min)",
    ),
    "explode": (
        "lowprec.experiments.explode",
        "train attention arms x seeds side by side for a time budget; record who explodes and the signature",
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name, (module, help_text) in EXPERIMENTS.items():
        add_subcommand(
            sub.add_parser(name, help=help_text, description=help_text), module, f"lowprec experiment {name}"
        )


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._module).run(args) or 0)
