"""The `lowprec` command. Each subcommand lives in its own module, which exposes
`configure(parser)` (add arguments) and `run(args) -> int` (do the work); they are imported lazily so
`lowprec --help` stays fast and a missing optional dependency only affects its own subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("lowprec.data.cli", "prepare token files from package-shipped English text"),
    "train": ("lowprec.train", "train a GPT with a named config"),
    "bench": ("lowprec.bench", "benchmark attention kernels or training throughput"),
    "experiment": ("lowprec.experiments", "run a named experiment and record it under results/"),
    "replay": ("lowprec.replay", "re-run the last steps of a recorded run from a checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowprec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        add_subcommand(sub.add_parser(name, help=help_text, description=help_text), module, f"lowprec {name}")
    return parser


def add_subcommand(parser: argparse.ArgumentParser, module: str, label: str) -> None:
    """Let `module` configure `parser`; a module that does not exist yet marks the command unavailable."""
    parser.set_defaults(_module=module)
    try:
        importlib.import_module(module).configure(parser)
    except ModuleNotFoundError as exc:
        if not exc.name or not module.startswith(exc.name):
            raise
        parser.set_defaults(_missing=f"'{label}' is not available in this version ({module} is missing)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        parser.exit(2, f"lowprec: {args._missing}\n")
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
