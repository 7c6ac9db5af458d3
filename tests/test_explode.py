"""`lowprec experiment explode` on CPU: arms x seeds side by side, records, the summary and the signature."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from lowprec.analysis import signature
from lowprec.attention import AttentionSpec, Precision
from lowprec.cli import main as lowprec_main
from lowprec.configs import get_config
from lowprec.instruments.explode import arm_of, arm_overrides, arm_spec
from lowprec.model import GPTConfig
from lowprec.runs import load_run


def test_arm_specs_name_the_attention_they_run():
    assert str(arm_spec("fa2")) == "triton/precision=fa2"
    assert str(arm_spec("ones3-fix")) == "triton/precision=fa2:weights=e8m3@ones/fix=2"
    assert str(arm_spec("kbit4", "emulated")) == "emulated/precision=fa2:weights=e8m4"
    assert str(arm_spec("fp32pv")) == "triton/precision=fa2:weights=none"
    assert str(arm_spec("paper64")) == "triton/precision=paper:tile=64"
    assert arm_spec("paper64-fp32pv-fix") == AttentionSpec.parse(
        "triton/precision=paper:tile=64,weights=none,product=none,accumulator=none/fix=2")
    assert str(arm_spec("kbit3-consistent-fix")) == "triton/precision=consistent:weights=e8m3/fix=2"
    assert str(arm_spec("fa2-consistent")) == "triton/precision=consistent"
    # paper64-fp32pv's two bf16 points one at a time
    both = arm_spec("paper64-fp32pv").precision
    assert arm_spec("bf16scores").precision == replace(both, rowsum=Precision.parse("fa2").rowsum)
    assert arm_spec("bf16rowsum").precision == replace(both, scores=Precision.parse("fa2").scores)
    for arm in ("fa2", "paper64-fix", "ones2", "kbit5-fix", "fp32pv", "paper64-fp32pv", "kbit3-consistent"):
        GPTConfig(attention=arm_spec(arm))  # every arm is a valid model spec
    for bad in ("fa3", "ones", "ones12", "fix", "paper", "consistent", "kbit3-fix-consistent"):
        with pytest.raises(ValueError, match="unknown arm"):
            arm_spec(bad)
    for arm in ("fa2", "paper64-fix", "ones2", "kbit5-fix", "fp32pv", "paper64-fp32pv",
                "kbit3-consistent-fix", "fa2-consistent", "bf16scores", "bf16rowsum-fix"):
        assert arm_of(str(arm_spec(arm))) == arm
    assert arm_of("triton/precision=paper:tile=64/fix=2.0") == "paper64-fix"  # as the records name it
    with pytest.raises(ValueError, match="no explode arm"):
        arm_of("triton/precision=paper")


def test_the_fp32_arms_take_bf16_out_of_attention_or_out_of_the_model():
    assert arm_overrides("fa2") == ["attention=triton/precision=fa2"]
    assert arm_overrides("attn-fp32") == ["attention=math/dtype=float32"]
    assert arm_overrides("model-fp32") == ["attention=math", "dtype=float32"]
    for arm in ("attn-fp32", "model-fp32"):
        cfg = get_config("gpu-6l", arm_overrides(arm))  # a bf16 model unless the arm says otherwise
        assert arm_of(cfg.model.attention, cfg.dtype) == arm
    with pytest.raises(ValueError, match="no explode arm"):
        arm_of("math", "bfloat16")  # math in bf16 is no arm


def test_explode_runs_arms_and_seeds_and_records_them(tmp_path, capsys):
    out = tmp_path / "exp"
    code = lowprec_main(["experiment", "explode", "--out", str(out), "--config", "smoke-cpu", "--backend",
                         "emulated", "--arms", "ones1,ones1-fix", "--seeds", "1,2", "--minutes", "5",
                         "--gpus", "0", "--set", "max_iters=40"])
    assert code == 0
    record = json.loads((out / "experiment.json").read_text())
    assert set(record["runs"]) == {"ones1-s1", "ones1-fix-s1", "ones1-s2", "ones1-fix-s2"}
    assert record["plan"]["arms"]["ones1-fix"] == "emulated/precision=fa2:weights=e8m1@ones/fix=2"
    assert record["provenance"]["git_commit"] is not None or "LOWPREC_GIT_COMMIT" not in record["provenance"]
    for name, run in record["runs"].items():
        assert run["status"] == "finished" and run["steps"] == 40, (name, run)
        config = json.loads((out / name / "config.json").read_text())["config"]
        assert config["seed"] == run["seed"] and config["model"]["attention"] == run["attention"]
        sig = run["signature"]
        assert sig["samples"] == 2 or sig["samples"] >= 3  # smoke-cpu samples telemetry every 20 steps
    # same seed: same init and first batch, so the arms' first losses differ only by the rounding of P̄
    first = {n: json.loads((out / n / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for n in record["runs"]}
    assert abs(first["ones1-s1"] - first["ones1-fix-s1"]) < 1e-3 < abs(first["ones1-s1"] - first["ones1-s2"])
    assert "ones1-fix-s2" in capsys.readouterr().out


def test_signature_reads_the_per_head_telemetry(tmp_path):
    code = lowprec_main(["train", "--config", "smoke-cpu", "--out", str(tmp_path / "r"), "--set",
                         "attention=emulated/precision=fa2:weights=e8m1@ones", "--set", "max_iters=60",
                         "--set", "telemetry_interval=10", "--set", "log_interval=5"])
    assert code == 0
    sig = signature(load_run(tmp_path / "r"))
    assert sig["samples"] == 6 and sig["heads"] == 4
    assert 0 <= sig["cum_same_sign_fraction"] <= 1 and sig["wq_growth"] > 0
    assert sig["max_abs_t"] == abs(sig["t"]) and sig["sum_t2"] >= sig["t"] ** 2


def test_explode_rejects_bad_arguments(tmp_path, capsys):
    (tmp_path / "x" / "fa2-s1").mkdir(parents=True)
    (tmp_path / "x" / "fa2-s1" / "metrics.jsonl").write_text("")
    for extra in (["--arms", "fa3"], ["--seeds", ""], ["--seeds", "1,two"], ["--minutes", "0"],
                  ["--set", "nonsense=1"], ["--arms", "fa2", "--seeds", "1"]):
        code = lowprec_main(["experiment", "explode", "--out", str(tmp_path / "x"), "--gpus", "0", *extra])
        assert code == 2, extra
        assert "lowprec experiment explode:" in capsys.readouterr().err
