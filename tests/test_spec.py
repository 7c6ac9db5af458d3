"""AttentionSpec, the one typed attention choice: its string form round-trips and keeps recorded meanings."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import pytest
from lowprec.attention import BACKENDS, AttentionSpec, Fix, Precision
from lowprec.attention.spec import backends_with
from lowprec.model import GPTConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"
PRECISIONS = ["fa2", "paper", "fp32", "paper:tile=64", "fa2:weights=e8m3@ones", "fa2:weights=bf16@stochastic",
              "paper:tile=64,weights=none,product=none,accumulator=none", "paper:tile=none", "consistent",
              "consistent:weights=e8m3", "paper:norm=rounded"]
FIXES = [None, Fix(), Fix(beta=7.0), Fix(beta=2.5, tie="row"), Fix(tol=0.0, variant="closed"),
         Fix(beta=3.0, min_gap=0.01, max_gap=10.0, tol=1e-3)]
OPTIONS = {"sdpa": [{}, {"sdpa_backend": "flash"}], "emulated": [{}, {"block_m": 32, "delta": "dP_P"}],
           "triton": [{}, {"block_n": 64, "seed": 7}], "math": [{}], "reference": [{}]}


def every_spec() -> list[AttentionSpec]:
    specs = []
    for backend, caps in BACKENDS.items():
        precisions, fixes = (PRECISIONS, FIXES) if caps.precision else ([None], [None])
        for precision, fix, options in itertools.product(precisions, fixes, OPTIONS[backend]):
            specs.append(AttentionSpec(backend, precision, fix, tuple(options.items())))
    return specs


@pytest.mark.parametrize("spec", every_spec(), ids=str)
def test_string_form_round_trips(spec: AttentionSpec) -> None:
    assert AttentionSpec.parse(str(spec)) == spec
    assert AttentionSpec.parse(spec) is spec


def test_a_string_is_parsed_once(monkeypatch) -> None:
    for _ in range(2):  # a string that does not parse raises at every call
        with pytest.raises(ValueError, match="attention spec 'triton/block_m=x'"):
            AttentionSpec.parse("triton/block_m=x")
    text = "triton/precision=fa2:norm=rounded/fix=2/block_m=32"
    first = AttentionSpec.parse(text)
    monkeypatch.setattr(Precision, "parse", lambda *a: pytest.fail("parsed again"))
    assert AttentionSpec.parse(text) is first


def test_fix_string_form_round_trips() -> None:
    for fix in FIXES[1:]:
        assert Fix.parse(fix.spec) == fix
    assert Fix.parse("none") is None and Fix.parse("true") == Fix() and Fix.parse("2.0") == Fix(beta=2.0)
    for bad, words in (("two", "fix must be"), ("2:beta=3", "fix option"), ("2:tol=x", "tol must be")):
        with pytest.raises(ValueError, match=words):
            Fix.parse(bad)


def old_meaning(text: str) -> tuple[str, Precision | None, Fix | None, dict]:
    """What the string meant to the parser that wrote the records (model.parse_attention before the
    AttentionSpec): values parsed as int, float, true/false, none, else strings; precision defaults to fa2."""
    backend, *items = text.split("/")
    raw = {}
    for item in items:
        key, _, value = item.partition("=")
        low = value.lower()
        raw[key] = (low == "true" if low in ("true", "false") else None if low == "none" else value)
        for cast in (int, float):
            if isinstance(raw[key], str):
                with contextlib.suppress(ValueError):
                    raw[key] = cast(raw[key])
    precision = Precision.parse(str(raw.pop("precision", "fa2"))) if BACKENDS[backend].precision else None
    fix = raw.pop("fix", None)
    fix = Fix() if fix is True else None if fix in (None, False) else Fix(beta=float(fix))
    return backend, precision, fix, raw


def recorded_specs() -> set[str]:
    texts = set()
    for path in RESULTS.rglob("config.json"):
        model = json.loads(path.read_text())["config"]["model"]
        texts |= {model["attention"], *model.get("layer_attention", {}).values()}
    return texts


def test_recorded_strings_keep_their_meaning() -> None:
    texts = recorded_specs()
    assert len(texts) >= 10, texts  # the explosion records name many placements
    for text in texts:
        spec = AttentionSpec.parse(text)
        backend, precision, fix, options = old_meaning(text)
        assert (spec.backend, spec.precision, spec.fix, dict(spec.options)) == (backend, precision, fix,
                                                                                 options), text


def test_configs_take_a_spec_or_its_string_and_record_strings() -> None:
    spec = AttentionSpec("triton", "paper:tile=64", Fix())
    a = GPTConfig(n_layer=2, attention=spec, layer_attention={1: "math"})
    b = GPTConfig(n_layer=2, attention=str(spec), layer_attention={"1": AttentionSpec("math")})
    assert a.attention == b.attention == spec and a.layer_attention == b.layer_attention
    assert a.to_dict()["attention"] == "triton/precision=paper:tile=64/fix=2"
    assert a.to_dict()["layer_attention"] == {1: "math"}
    assert json.loads(json.dumps(a.to_dict()))  # plain values only


def test_capabilities_come_from_one_table() -> None:
    assert backends_with("fix") == backends_with("stats") == ("emulated", "triton")
    assert backends_with("softcap") == ("math",)
    with pytest.raises(ValueError, match="takes no precision or fix"):
        AttentionSpec("sdpa", fix=Fix())
    with pytest.raises(ValueError, match="has no option 'seed'"):
        AttentionSpec.parse("emulated/seed=3")
    with pytest.raises(ValueError, match="block_m must be an int"):
        AttentionSpec("triton", options={"block_m": "64"})
    with pytest.raises(ValueError, match="attention spec 'triton/block_m=x'"):
        AttentionSpec.parse("triton/block_m=x")


def test_consistent_placement_is_fa2_with_rounded_normalisation() -> None:
    consistent = Precision.parse("consistent")
    assert consistent == Precision.parse("fa2:norm=rounded") and consistent.norm == "rounded"
    assert consistent.spec == "consistent" and Precision.parse("consistent:norm=exact") == Precision.fa2()
    spec = AttentionSpec.parse("triton/precision=fa2:norm=rounded/fix=2")
    assert str(spec) == "triton/precision=consistent/fix=2"
    with pytest.raises(ValueError, match="norm must be one of"):
        Precision.parse("fa2:norm=approx")
