"""The library's layers (lib/lowprec/README.md): each part imports only from the parts below it, and no module
imports, however indirectly, one that imports it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "lib" / "lowprec"

# part -> the parts it may import (a part is lowprec.<first name>; "lowprec" alone is the package's __init__)
ALLOWED = {
    "formats": set(),
    "fsutil": set(),
    "checks": set(),
    "attention": {"formats", "checks"},
    "model": {"attention", "formats", "checks"},
    "hf": {"attention"},
    "configs": {"model", "checks"},
    "dist": {"configs"},
    "checkpoint": {"fsutil"},
    "runs": {"fsutil"},
    "analysis": {"runs"},
    "data": {"fsutil", "runs", "lowprec", "checks"},
    "telemetry": {"model", "attention", "formats"},
    "train": {"model", "telemetry", "data", "runs", "configs", "dist", "checkpoint", "fsutil", "lowprec",
              "checks"},
    "replay": {"train", "configs", "dist", "runs", "model", "attention", "checks"},
    "instruments": {"analysis", "attention", "checkpoint", "configs", "formats", "hf", "model", "runs",
                    "train", "telemetry", "data", "checks", "fsutil"},
    "viz": {"formats", "attention", "analysis", "runs", "instruments"},
    "cli": set(),
}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lowprec"


def lowprec_imports(path: Path) -> set[str]:
    """Every lowprec module a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lowprec"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lowprec":
            if node.module == "lowprec":  # `from lowprec import data` imports lowprec.data
                found |= {f"lowprec.{a.name}" if (LIB / a.name).exists() or (LIB / f"{a.name}.py").exists()
                          else "lowprec" for a in node.names}
            else:
                found.add(node.module)
    return found


FILES = sorted(p for p in LIB.rglob("*.py") if p.name != "__init__.py" or p.parent != LIB)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(LIB)))
def test_each_part_imports_only_the_parts_below_it(path: Path) -> None:
    own = path.relative_to(LIB).parts[0].removesuffix(".py")
    assert own in ALLOWED, f"{own}: a new part of lib/lowprec needs a row in ALLOWED and in the README"
    bad = sorted(m for m in lowprec_imports(path) if part(m) != own and part(m) not in ALLOWED[own])
    assert not bad, f"{path.relative_to(LIB)} imports {bad}; {own} may import only {sorted(ALLOWED[own])}"


def module_name(path: Path) -> str:
    """lowprec.attention.flash for lib/lowprec/attention/flash.py; a package by its name (its __init__.py)."""
    parts = path.relative_to(LIB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in LIB.rglob("*.py")}


def module_imports(path: Path) -> set[str]:
    """The lowprec modules a file imports, at the top or inside functions: `from lowprec.x import y` names
    lowprec.x.y where that is a module, else lowprec.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return found - {module_name(path)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> the modules it imports) as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(stack: list[str]) -> list[str] | None:
        for imported in sorted(graph[stack[-1]]):
            if imported in stack:
                return [*stack[stack.index(imported):], imported]
            if imported not in done and (cycle := visit([*stack, imported])):
                return cycle
        done.add(stack[-1])
        return None

    return next((cycle for m in sorted(graph) if m not in done and (cycle := visit([m]))), None)


def test_find_cycle_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circle() -> None:
    cycle = find_cycle({name: module_imports(path) for name, path in MODULES.items()})
    assert cycle is None, f"import circle {' -> '.join(cycle)}: move what both need into a module below them"


def test_nothing_imports_the_cli() -> None:
    users = [str(p.relative_to(LIB)) for p in FILES if "lowprec.cli" in lowprec_imports(p)]
    assert not users, f"{users} import lowprec.cli: commands register in cli.COMMANDS instead"


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["experiment", "--help"]])
def test_help_imports_no_command_module(argv: list[str]) -> None:
    """`lowprec --help` and a group's help list the commands without importing them (nor torch)."""
    code = "\n".join([
        "import sys", "from lowprec import cli", "try:", "    cli.main(sys.argv[1:])", "except SystemExit:",
        "    pass", "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('lowprec.'))",
        "assert loaded == ['lowprec.cli'], loaded",
    ])  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: lowprec" in result.stdout, result.stderr[-2000:]


# Each import below runs in a fresh interpreter: a child forked from one that has imported torch and nothing
# else (torch's import is most of each check's 2.5 s), or, where torch itself must stay out, a new process.
# A module torch had loaded could only make a check fail, never pass: none of `absent` is among them.
FORKER = """
import json, os, sys
import torch
assert not [m for m in sys.modules if m.startswith("lowprec")]
for line in sys.stdin:
    code = json.loads(line)
    pid = os.fork()
    if pid == 0:
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        try:
            exec(code, {"__name__": "__main__"})
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            status = 1
        os._exit(status)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


@pytest.fixture(scope="module")
def with_torch() -> Iterator[Callable[[str], int]]:
    """Runs code in a child of an interpreter that has imported torch; its exit status."""
    forker = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)

    def run(code: str) -> int:
        forker.stdin.write(json.dumps(code) + "\n")
        forker.stdin.flush()
        return int(forker.stdout.readline())

    yield run
    forker.stdin.close()
    forker.wait(timeout=60)


@pytest.mark.parametrize("module,absent", [
    ("lowprec.runs", "torch"),
    ("lowprec.analysis", "lowprec.model"),
    ("lowprec.analysis", "lowprec.attention"),
    ("lowprec.viz", "lowprec.train"),
    ("lowprec.formats", "lowprec.attention"),
    ("lowprec.attention", "lowprec.model"),
    ("lowprec.hf", "transformers"),  # the plug-in imports transformers when it registers
    ("lowprec.train", "torch._dynamo"),  # the compiler (1.2 s of CPU) only where a run compiles
])
def test_importing_a_lower_layer_loads_no_upper_one(with_torch, module: str, absent: str) -> None:
    code = f"import sys, {module}; assert {absent!r} not in sys.modules, sorted(sys.modules)"
    if absent == "torch":
        status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode
    else:
        status = with_torch(code)
    assert status == 0, f"importing {module} loads {absent}"
