"""The `lowprec` command: prepare data, train, replay, benchmark, measure and run the book's experiments.

Every subcommand lives in its own module, which exposes `configure(parser)` (add arguments) and `run(args) ->
int` (do the work, raising ValueError for a user mistake). A module is imported only when its command is
chosen (`Commands`), so `lowprec --help` and `lowprec bench --help` import no torch, and a missing optional
dependency only affects its own subcommand. No module imports this one: `COMMANDS` is the one place a command
is registered.

One contract for errors: a ValueError (RunRecordError included) or OSError from a command, like a bad
argument, ends as one line `lowprec <command>: <message>` on stderr and exit status 2; `--traceback` (or
LOWPREC_TRACEBACK=1) shows the traceback instead, for debugging.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import sys
from typing import NoReturn

Command = tuple[str, str]  # (module, one-line help)
COMMANDS: dict[str, Command | dict[str, Command]] = {
    "data": ("lowprec.data.cli", "prepare token files from package-shipped English text"),
    "train": ("lowprec.train", "train a GPT with a named config"),
    "replay": ("lowprec.replay", "re-run the last steps of a recorded run from a checkpoint"),
    "bench": {
        "attention": ("lowprec.instruments.bench_attention", "TFLOP/s of the attention kernels"),
        "train": ("lowprec.instruments.bench_train", "training throughput per attention backend"),
        "overhead": ("lowprec.instruments.bench_overhead",
                     "host time per eager call and a small GPT's eager step, against SDPA (GPU; --smoke)"),
        "hf": ("lowprec.instruments.bench_hf",
               "training throughput of a small transformers Llama, SDPA against our kernel (GPU; --smoke)"),
    },
    "measure": {
        "suite": ("lowprec.instruments.gpu_suite",
                  "correctness, fuzz and bias of the real attention kernels (GPU; --smoke on a CPU)"),
        "cures": ("lowprec.instruments.cures",
                  "bias and cost of every cure of the rounding bias in our kernel (GPU; --smoke on a CPU)"),
        "reproducibility": ("lowprec.instruments.reproducibility",
                            "same-seed runs alone, side by side, telemetry on or off: one trajectory? (GPU)"),
    },
    "experiment": {
        "positive-control": ("lowprec.instruments.positive_control",
                             "one attention layer where biased rounding alone drives W_Q (CPU)"),
        "explode": ("lowprec.instruments.explode",
                    "train attention arms x seeds side by side; record who explodes and the signature"),
        "bias-noise": ("lowprec.instruments.bias_noise",
                       "at a run's checkpoints: the W_Q gradient's rounding bias against its batch noise"),
        "study": ("lowprec.instruments.study",
                  "make a queue's runs, each to its horizon; the survival of each arm (--status)"),
    },
}


# pyproject.toml's optional packages -> their extra (a command that needs a missing one says so in one line)
OPTIONAL = {"triton": "triton", "tiktoken": "gpt2", "tiktoken_ext": "gpt2", "transformers": "hf"}


def missing_optional(exc: ModuleNotFoundError) -> str | None:
    """The one line for a missing optional package, or None where the missing module is not one."""
    package = (exc.name or "").split(".")[0]
    if package not in OPTIONAL:
        return None
    return f"needs the optional package {package}: pip install 'lowprec[{OPTIONAL[package]}]'"


class Commands(argparse._SubParsersAction):
    """Subcommands whose parsers are configured by their module (`configure(parser)`) only when chosen."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: list[str],
                 option_string: str | None = None) -> None:
        chosen = self._name_parser_map.get(values[0])
        defaults = chosen._defaults if chosen is not None else {}
        if "_module" in defaults and not defaults.get("_configured"):
            chosen.set_defaults(_configured=True)
            try:
                importlib.import_module(defaults["_module"]).configure(chosen)
            except ModuleNotFoundError as exc:
                if (needs := missing_optional(exc)) is not None:
                    raise ArgumentsError(f"{defaults['_label']}: {needs}") from None
                if exc.name and defaults["_module"].startswith(exc.name):
                    raise ArgumentsError(f"lowprec: '{defaults['_label']}' is not available in this version "
                                         f"({defaults['_module']} is missing)") from None
                raise
        super().__call__(parser, namespace, values, option_string)


class ArgumentsError(Exception):
    """A bad or missing argument: the one line to print."""


class Parser(argparse.ArgumentParser):
    """argparse with the error contract: a bad or missing argument raises ArgumentsError with one line
    `<prog>: <message>` (a subcommand's parser is of the same class, its prog `lowprec <command>`)."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentsError(f"{self.prog}: {' '.join(message.split())} (--help lists the arguments)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lowprec", description=__doc__.split("\n")[0])
    parser.add_argument("--traceback", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=Commands)
    for name, entry in COMMANDS.items():
        if isinstance(entry, tuple):
            add_command(sub, name, entry, f"lowprec {name}")
            continue
        group = sub.add_parser(name, help=f"{name}: {', '.join(entry)}", description=f"lowprec {name}")
        inner = group.add_subparsers(dest=f"{name}_command", metavar=name.upper(), required=True,
                                     action=Commands)
        for inner_name, inner_entry in entry.items():
            add_command(inner, inner_name, inner_entry, f"lowprec {name} {inner_name}")
    return parser


def add_command(sub: argparse._SubParsersAction, name: str, entry: Command, label: str) -> None:
    """A subcommand's parser, configured by its module once chosen (`Commands`)."""
    module, help_text = entry
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module, _label=label)


PARENT_ENV = "LOWPREC_PARENT_PID"  # set by a harness that starts commands (`instruments.explode.launch`)
PR_SET_PDEATHSIG = 1


def follow_parent() -> None:
    """For a command a harness started (PARENT_ENV names its PID): have Linux send this process SIGTERM when
    the harness ends, however it ends (PR_SET_PDEATHSIG), so that a killed harness leaves no orphan (a trainer
    checkpoints and stops); a harness already gone sends it now."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for the commands this one starts
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the harness's own stop is all there is
        return
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    follow_parent()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ArgumentsError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, OSError, ModuleNotFoundError) as exc:
        if args.traceback or os.environ.get("LOWPREC_TRACEBACK", "") not in ("", "0"):
            raise
        if isinstance(exc, ModuleNotFoundError):
            message = missing_optional(exc)
            if message is None:
                raise
        else:
            message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{args._label}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
