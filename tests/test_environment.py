"""environment.yml (conda, mamba) lists the packages of requirements.txt (.venv), with the same specifiers.

Conda packages and the pip section count alike; `python`, `pip` and the pip section's option lines (an extra
index, `-e .`) are the environment's frame, not packages of requirements.txt.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FRAME = {"python", "pip"}
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge names that differ from the PyPI ones


def requirements_txt(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def environment_yml(text: str) -> list[str]:
    specs: list[str] = []
    for dep in yaml.safe_load(text)["dependencies"]:
        if isinstance(dep, dict):
            specs += [s.strip() for s in dep.get("pip", []) if not s.strip().startswith("-")]
        elif re.split(r"[\s=<>!~]", dep, maxsplit=1)[0] not in FRAME:
            specs.append(dep.replace(" ", ""))  # conda allows `numpy >=1.26`
    return specs


def parse(specs: list[str]) -> dict[str, SpecifierSet]:
    """Name -> specifiers; a spec that is not a PEP 508 requirement (conda's `name=1.2`) fails here."""
    out: dict[str, SpecifierSet] = {}
    for spec in specs:
        try:
            req = Requirement(spec)
        except InvalidRequirement as e:
            raise AssertionError(f"{spec!r}: write it as requirements.txt does (conda's `=` is fuzzy)") from e
        name = canonicalize_name(CONDA_NAMES.get(req.name, req.name))
        assert name not in out, f"{name} is listed twice"
        out[name] = req.specifier
    return out


def differences(requirements: dict[str, SpecifierSet], environment: dict[str, SpecifierSet]) -> list[str]:
    problems = [f"{n} only in requirements.txt" for n in sorted(requirements.keys() - environment.keys())]
    problems += [f"{n} only in environment.yml" for n in sorted(environment.keys() - requirements.keys())]
    problems += [
        f"{n}: requirements.txt has '{requirements[n]}', environment.yml has '{environment[n]}'"
        for n in sorted(requirements.keys() & environment.keys())
        if requirements[n] != environment[n]
    ]
    return problems


def test_environment_yml_matches_requirements_txt() -> None:
    requirements = parse(requirements_txt((ROOT / "requirements.txt").read_text()))
    environment = parse(environment_yml((ROOT / "environment.yml").read_text()))
    assert not differences(requirements, environment), differences(requirements, environment)


def test_a_package_in_one_file_only_is_caught() -> None:
    both = parse(["torch==2.13.0", "numpy>=1.26"])
    assert differences(both, parse(["numpy>=1.26", "torch==2.13.0"])) == []
    assert differences(both, parse(["torch==2.13.0"])) == ["numpy only in requirements.txt"]
    assert differences(parse(["torch==2.13.0"]), both) == ["numpy only in environment.yml"]
    assert differences(both, parse(["torch==2.12.0", "numpy>=1.26"])) == [
        "torch: requirements.txt has '==2.13.0', environment.yml has '==2.12.0'"
    ]
    frame_only = "dependencies: [python=3.11, pip, numpy >=1.26, {pip: [--extra-index-url x, -e .]}]"
    assert environment_yml(frame_only) == ["numpy>=1.26"]
