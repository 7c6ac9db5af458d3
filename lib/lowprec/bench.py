"""`lowprec bench {attention,train}`: thin dispatch to the benchmark that lives next to the code it measures
(lowprec.attention.bench for the kernels, lowprec.train for training throughput)."""

from __future__ import annotations

import argparse
import importlib

from lowprec.cli import add_subcommand

TARGETS = {
    "attention": "lowprec.attention.bench",
    "train": "lowprec.train_bench",
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, module in TARGETS.items():
        parser_for_target = sub.add_parser(name, help=f"benchmark {name} ({module})")
        add_subcommand(parser_for_target, module, f"lowprec bench {name}")


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._module).run(args) or 0)
