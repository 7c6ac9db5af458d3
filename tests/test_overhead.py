"""`lowprec bench overhead` and `lowprec bench hf` run their whole path on the CPU (--smoke, our kernel under
Triton's interpreter) and write their records; the numbers are the GPU's to give."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from lowprec import cli
from lowprec.instruments import bench_overhead


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """(record, stdout) of one `bench overhead --smoke --profile --compile default`: the two tests below read
    it (each option alone took most of the time of both together)."""
    out = tmp_path_factory.mktemp("overhead") / "overhead.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["bench", "overhead", "--smoke", "--profile", "--compile", "default", "--out",
                         str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_bench_overhead_smoke_writes_calls_steps_and_summary(smoke: tuple[dict, str]) -> None:
    record = smoke[0]
    rows = record["calls"]
    assert {(r["impl"], r["mode"]) for r in rows} == {(impl, mode) for impl in bench_overhead.IMPLS
                                                      for mode in ("fwd", "fwd+bwd")}
    assert all(r["host_us"] > 0 and r["wall_us"] > 0 for r in rows)
    steps = record["step"]["ms"]
    assert {name: len(ms) for name, ms in steps.items()} == dict.fromkeys(bench_overhead.IMPLS, 1)
    summary = record["summary"]
    ratios = {key: value for key, value in summary.items() if key != "met"}
    assert set(summary["met"]) == set(ratios) and all(value > 0 for value in ratios.values())
    assert record["provenance"]["command"]
    profile = record["profile"]  # the host path's functions by own time, per mode
    assert profile["impl"] == "triton" and {"fwd", "fwd+bwd"} <= set(profile)
    functions = [row["function"] for row in profile["fwd"]]
    assert any(f.startswith(("lowprec/", "torch/", "triton/")) for f in functions), functions
    assert all(row["own_us"] >= 0 and row["cum_us"] >= row["own_us"] for row in profile["fwd"])
    ops = profile["ops"]  # torch.profiler's view of one fwd+bwd call, ours beside SDPA's
    assert set(ops) == {"triton", "sdpa"} and all(rows for rows in ops.values())
    assert any(r["name"] == "_EagerFlashBackward" for r in ops["triton"]), [r["name"] for r in ops["triton"]]


def test_bench_overhead_times_compiled_steps(smoke: tuple[dict, str], capsys) -> None:
    """--compile MODE times the GPT steps again with the model under torch.compile (aot_eager on the CPU):
    one list per implementation and their ratios to SDPA's in the summary; an unknown mode is a one-line
    error naming the option."""
    record, printed = smoke
    impls = bench_overhead.IMPLS
    assert record["step"]["compile"] == "default"
    compiled = bench_overhead.COMPILED
    assert {name: len(ms) for name, ms in record["step"]["compiled_ms"].items()} == dict.fromkeys(compiled, 1)
    assert {f"step_vs_sdpa compiled {impl}" for impl in compiled if impl != "sdpa"} <= set(record["summary"])
    assert set(compiled) <= set(impls)
    assert "compiled (default)" in printed and record["step"]["compiled_errors"] == {}
    assert cli.main(["bench", "overhead", "--smoke", "--compile", "fast"]) == 2
    assert "--compile" in capsys.readouterr().err


def test_a_compiled_step_that_fails_is_recorded_and_the_rest_timed(tmp_path, monkeypatch):
    """--compile: an implementation whose compiled step fails gets its error in the record; the others are
    still timed."""
    step = bench_overhead.gpt_step

    def failing(spec: str, *args):  # args: batch, block_size, device, tiny[, compile_mode]
        if len(args) == 5 and "fix" in spec:
            raise RuntimeError("graph capture failed")
        return step(spec, *args[:4])  # the others' steps eager: compiling is the test above's

    monkeypatch.setattr(bench_overhead, "gpt_step", failing)
    out = tmp_path / "overhead.json"
    assert cli.main(["bench", "overhead", "--smoke", "--compile", "default", "--out", str(out)]) == 0
    step_record = json.loads(out.read_text())["step"]
    assert step_record["compiled_errors"] == {"triton+fix": "RuntimeError: graph capture failed"}
    assert set(step_record["compiled_ms"]) == {"sdpa", "triton"}


def test_bench_overhead_refuses_no_gpu_without_smoke(capsys):
    assert cli.main(["bench", "overhead", "--out", "x.json"]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_bench_hf_compiled_smoke(tmp_path):
    """--compile: the models under torch.compile (aot_eager on the CPU), our kernel through the plug-in's
    mask function (no mask for a causal call while compiling), each step timed."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    assert cli.main(["bench", "hf", "--smoke", "--compile", "default", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["args"]["compile"] == "default" and set(record["ms"]) == {"sdpa", "lowprec", "lowprec+fix"}


def test_bench_hf_smoke_trains_each_implementation(tmp_path, monkeypatch):
    """Each implementation trains and is profiled; our kernel gets bf16 q, k, v (the model's fp32 weights
    under bf16 autocast, as SDPA's inputs are cast), never its fp32 path."""
    pytest.importorskip("transformers")
    from lowprec.attention import flash

    dtypes, kernel = set(), flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, **kw: dtypes.update(
        (q.dtype, k.dtype, v.dtype)) or kernel(q, k, v, **kw))
    out = tmp_path / "hf.json"
    assert cli.main(["bench", "hf", "--smoke", "--profile", "--out", str(out)]) == 0
    assert dtypes == {torch.bfloat16}
    record = json.loads(out.read_text())
    assert set(record["profile"]) == set(record["ms"]) and all(rows for rows in record["profile"].values())
    assert any("aten::mm" in r["name"] or "aten::addmm" in r["name"] for r in record["profile"]["sdpa"])
    assert set(record["ms"]) == {"sdpa", "lowprec", "lowprec+fix"} and record["parameters"] > 0
    assert set(record["vs_sdpa"]) == {"lowprec", "lowprec+fix"} and record["provenance"]["transformers"]
    assert record["complete"] is True and set(record["first_step_s"]) == set(record["ms"])


def test_bench_hf_keeps_what_it_measured_when_interrupted(tmp_path, monkeypatch):
    """The record is written after each phase: stopped while profiling, the file has every implementation's
    first-step seconds and step times, marked incomplete."""
    pytest.importorskip("transformers")
    from lowprec.instruments import bench_hf

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_hf, "op_profile", stopped)
    out = tmp_path / "hf.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "hf", "--smoke", "--profile", "--impls", "sdpa,lowprec", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is False and "profile" not in record
    assert set(record["first_step_s"]) == set(record["ms"]) == set(record["impls"]) == {"sdpa", "lowprec"}
    assert all(s >= 0 for s in record["first_step_s"].values())


def test_bench_hf_impls_need_the_reference(capsys):
    assert cli.main(["bench", "hf", "--smoke", "--impls", "lowprec"]) == 2
    assert "--impls must include sdpa" in capsys.readouterr().err
    assert cli.main(["bench", "hf", "--smoke", "--impls", "flash"]) == 2
    assert "argument --impls: must be a comma list of sdpa, lowprec, lowprec+fix" in capsys.readouterr().err


def test_host_path_script_times_our_python_with_stub_kernels():
    """scripts/host_path.py (the GPU's launch path, kernels stubbed) runs on the CPU and prints both modes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "lib")}
    out = subprocess.run([sys.executable, str(root / "scripts" / "host_path.py"), "--calls", "5"], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert [line.split()[0] for line in out.splitlines()] == ["fwd", "fwd+bwd"] and "us per call" in out


def test_a_missing_optional_package_is_one_line(monkeypatch, capsys):
    """`lowprec bench hf` without transformers: one line naming the package and its extra, no traceback;
    another missing module still raises."""
    import builtins

    real_import = builtins.__import__

    def without(missing):
        def imported(name, *args, **kwargs):
            if name.split(".")[0] == missing:
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
            return real_import(name, *args, **kwargs)
        return imported

    monkeypatch.setattr(builtins, "__import__", without("transformers"))
    assert cli.main(["bench", "hf", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert err == "lowprec bench hf: needs the optional package transformers: pip install 'lowprec[hf]'\n"
    monkeypatch.setattr(builtins, "__import__", real_import)
    from lowprec.instruments import bench_hf

    def broken(args):
        raise ModuleNotFoundError("No module named 'lowprec_missing'", name="lowprec_missing")

    monkeypatch.setattr(bench_hf, "run", broken)
    with pytest.raises(ModuleNotFoundError):  # not an optional package: a bug, with its traceback
        cli.main(["bench", "hf", "--smoke"])


def test_a_command_whose_module_needs_a_missing_optional_package_is_one_line(monkeypatch, tmp_path, capsys):
    """A command whose module imports a missing optional package at its top stops before parsing its
    arguments (an unknown one included), in one line naming the package and its extra."""
    (tmp_path / "lowprec_needs_hf.py").write_text("import transformers_missing_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.OPTIONAL, "transformers_missing_here", "hf")
    monkeypatch.setitem(cli.COMMANDS["bench"], "needs-hf", ("lowprec_needs_hf", "a command that needs it"))
    assert cli.main(["bench", "needs-hf", "--any"]) == 2
    assert capsys.readouterr().err == ("lowprec bench needs-hf: needs the optional package "
                                       "transformers_missing_here: pip install 'lowprec[hf]'\n")
    monkeypatch.setitem(cli.COMMANDS["bench"], "gone", ("lowprec.instruments.gone_here", "a removed command"))
    assert cli.main(["bench", "gone", "--any"]) == 2
    assert capsys.readouterr().err == ("lowprec: 'lowprec bench gone' is not available in this version "
                                       "(lowprec.instruments.gone_here is missing)\n")
