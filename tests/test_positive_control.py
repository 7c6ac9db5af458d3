"""The positive control (lowprec.instruments.control, positive_control): with fa2 rounding and no fix the δ
error is one-signed and W_Q drifts along R until the attention collapses onto the sinks; with the fix it
tracks the float64 reference. Seeded; ~10 s on one core."""

from __future__ import annotations

import json

import pytest
from lowprec.cli import main
from lowprec.instruments.bias_noise import criterion_probe
from lowprec.instruments.control import ControlConfig, bias_probe, delta_identity
from lowprec.instruments.cures import train_key
from lowprec.instruments.positive_control import OTHER_BUILD_TOL, agrees, recorded_control, train_grid
from lowprec.runs import cpu_vendor

STEPS = 150


@pytest.fixture(scope="module")
def fa2_adam():
    result = train_grid(ControlConfig(steps=STEPS), ("fa2",), ("lowp", "fix", "reference"), ("adam",), False)
    return {key.split("/")[-1]: run["summary"] for key, run in result["runs"].items()}


def test_no_fix_drifts_one_signed(fa2_adam):
    s = fa2_adam["lowp"]
    assert s["delta_err_t"] > 10 and s["delta_err_cum"] > 0  # δ_lp - δ_hp > 0, far beyond chance
    assert s["delta_cum_same_sign_frac"] == 1.0  # the running sum never changes sign
    assert s["g_err_r_t"] < -10  # the W_Q gradient error points along -R, so descent moves W_Q along +R
    assert s["g_err_cos_pred_mean"] > 0.99  # and it is Eq. (2)'s δ-only prediction
    assert s["rank1_token_cos_mean"] > 0.7 and s["rank1_step_cos_last"] > 0.99  # one shared rank-1 direction
    assert s["pbar_ones_per_row"] > 3  # near-tied sinks: P̄ = 1.0 several times per row
    assert s["w_r_final"] > 1.0 and s["w_norm_growth"] > 1.3
    assert s["content_mass_last"] < 0.5 * s["content_mass_first"] and s["task_lost_last"] > 0.3


def test_fix_and_reference_do_not_drift(fa2_adam):
    fix, ref = fa2_adam["fix"], fa2_adam["reference"]
    assert abs(fix["delta_err_t"]) < 4 and abs(fix["g_err_r_t"]) < 4
    assert fix["pbar_ones_per_row"] < 0.05 and fix["fix_rows"] > 0.95
    for s in (fix, ref):
        assert abs(s["w_r_final"]) < 0.2 and s["w_norm_growth"] < 1.05
        assert s["content_mass_last"] > 0.8 * s["content_mass_first"] and s["task_lost_last"] < 0.05
    assert abs(fix["w_r_final"] - ref["w_r_final"]) < 0.15  # the Fix follows the reference's random walk


def test_fp32_pv_removes_the_bias():
    probe = bias_probe(ControlConfig(), "fa2", "fp32pv", batches=40)
    assert abs(probe["delta_err_t"]) < 4


def test_adam_eps_slows_the_drift_but_not_the_criterion(fa2_adam):
    """Adam's step is g / (sqrt(v) + eps): an eps far above the gradient's scale (~2e-5 here) divides the
    drift's steps and the noise's alike, so the criterion's verdict stays and the drift shrinks."""
    big = ControlConfig(steps=STEPS, adam_eps=1e-3)
    drift = train_grid(big, ("fa2",), ("lowp",), ("adam",), False)["runs"]["fa2/adam/lowp"]["summary"]
    assert 0 < drift["w_r_final"] < 0.2 * fa2_adam["lowp"]["w_r_final"]
    probes = [criterion_probe(cfg, "fa2", "lowp", batches=20) for cfg in (ControlConfig(), big)]
    assert all(p["biased"] for p in probes) and probes[1]["sqrt_v_median"] < 1e-3 / 10
    assert probes[1]["steps_to_drift"] == pytest.approx(probes[0]["steps_to_drift"], rel=0.1)


def test_eq1_eq2_identities():
    check = delta_identity(seed=0)
    assert check["delta_err_max"] > 1e-3  # the two passes do differ in δ
    assert check["dq_residual_max"] < 1e-3 * check["dq_diff_max"]
    assert check["dw_residual_max"] < 1e-3 * check["dw_diff_max"]


def test_config_validation():
    with pytest.raises(ValueError, match="sinks"):
        ControlConfig(sinks=1)
    with pytest.raises(ValueError, match="v_mean"):
        ControlConfig(v_mean=0.0)
    with pytest.raises(ValueError, match="adam_eps"):
        ControlConfig(adam_eps=0.0)
    with pytest.raises(ValueError, match="placement"):
        train_grid(ControlConfig(steps=1), ("bf16",), ("lowp",), ("adam",), False)
    with pytest.raises(ValueError, match="optimizer"):
        train_grid(ControlConfig(steps=1), ("fa2",), ("lowp",), ("lion",), False)


def test_cli_writes_record(tmp_path, capsys):
    out = tmp_path / "pc.json"
    argv = [
        "experiment",
        "positive-control",
        "--steps",
        "3",
        "--placements",
        "fa2",
        "--treatments",
        "lowp,reference",
    ]
    assert main([*argv, "--optimizers", "adam", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["steps"] == 3 and "git_commit" in record["provenance"]
    assert set(record["summary"]) == {"fa2/adam/lowp", "fp64/adam/reference"}
    assert "fa2/adam/lowp" in capsys.readouterr().out
    assert main(["experiment", "positive-control", "--treatments", "lowp,nofix"]) == 2
    assert capsys.readouterr().err.startswith("lowprec experiment positive-control: argument --treatments")
    assert main([*argv[:-2], "--arms", "lowp", "--optimizers", "adam"]) == 0, "as the records' commands say"


def test_recorded_control_checks_its_live_run(tmp_path):
    """A chapter reads a recorded control and re-trains one run of it: the record's runs come back with that
    run fresh; a record of another configuration, without series, or stale is a ValueError naming it."""
    out = tmp_path / "pc.json"
    argv = ["experiment", "positive-control", "--steps", "20", "--placements", "fa2", "--treatments",
            "lowp,reference", "--optimizers", "adam", "--out", str(out)]
    assert main([*argv, "--series"]) == 0
    cfg = ControlConfig(steps=20)
    runs = recorded_control(out, cfg, "fa2/adam/lowp")
    assert set(runs) == {"fa2/adam/lowp", "fp64/adam/reference"}
    record = json.loads(out.read_text())
    assert runs["fp64/adam/reference"]["series"] == record["series"]["fp64/adam/reference"]
    recorded_w_r = record["series"]["fa2/adam/lowp"]["w_r"]
    assert runs["fa2/adam/lowp"]["series"]["w_r"] == pytest.approx(recorded_w_r, rel=1e-4)
    assert recorded_control(out, cfg, None)["fa2/adam/lowp"]["series"]["w_r"] == recorded_w_r, "as recorded"
    with pytest.raises(ValueError, match="another configuration"):
        recorded_control(out, ControlConfig(steps=21), "fa2/adam/lowp")
    with pytest.raises(ValueError, match="live must be one of"):
        recorded_control(out, cfg, "paper/adam/lowp")
    record["summary"]["fa2/adam/lowp"]["w_r_final"] *= 1.05
    out.write_text(json.dumps(record))
    recorded = record["summary"]["fa2/adam/lowp"]["w_r_final"]
    with pytest.raises(ValueError, match=f"stale: fa2/adam/lowp .* w_r_final {recorded!r} recorded, .* here "
                                         r"\(compared within 2%.*\); record it again: "):
        recorded_control(out, cfg, "fa2/adam/lowp")
    assert record["provenance"]["cpu_vendor"] == cpu_vendor()
    for key, other in (("cpu_vendor", None), ("cpu_vendor", "OtherVendor"), ("cpu_capability", "DEFAULT"),
                       ("torch", "2.0.0")):  # another build (an unrecorded vendor counts as one): 5% passes
        if other is None:
            del record["provenance"][key]
        else:
            record["provenance"][key] = other
        out.write_text(json.dumps(record))
        fresh = recorded_control(out, cfg, "fa2/adam/lowp")["fa2/adam/lowp"]["summary"]
        assert fresh["w_r_final"] != recorded
    record["summary"]["fa2/adam/lowp"]["w_r_final"] *= 1.15 / 1.05
    out.write_text(json.dumps(record))
    other_build = r"within 10%: recorded with torch 2.0.0 on DEFAULT \(OtherVendor\)"
    with pytest.raises(ValueError, match=other_build):  # 15% fails
        recorded_control(out, cfg, "fa2/adam/lowp")
    del record["series"]
    out.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="no per-step series"):
        recorded_control(out, cfg, "fa2/adam/lowp")


def test_a_number_near_zero_is_compared_at_its_records_scale():
    """Trained again on another CPU or torch version, a drift near zero (0.0062 recorded, beside runs that
    drift by 6.8) may move by more than 2% of itself: it agrees within 0.1% of the record's scale only."""
    assert agrees(0.0075, 0.0062, scale=6.8) and agrees(-0.0004, 0.0062, scale=6.8)
    assert not agrees(0.02, 0.0062, scale=6.8) and not agrees(0.0075, 0.0062, scale=0.0062)
    assert agrees(6.9, 6.8, scale=6.8) and not agrees(7.1, 6.8, scale=6.8)
    assert agrees(189, 187, scale=0.0) and not agrees(190, 187, scale=0.0), "collapse steps: within 2"
    assert agrees(205, 187, 0.0, OTHER_BUILD_TOL) and not agrees(210, 187, 0.0, OTHER_BUILD_TOL), "or 10%"
    assert agrees(None, None, scale=1.0) and not agrees(None, 187, scale=1.0)


def test_cures_record_and_its_live_run(tmp_path):
    """--cures records every cure of cures.CURES under cure/<optimizer>/<name>; a cure is a live run too."""
    from lowprec.instruments.cures import CURES

    out = tmp_path / "cures.json"
    assert main(["experiment", "positive-control", "--steps", "3", "--cures", "--optimizers", "adam",
                 "--series", "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["summary"]) == {f"cure/adam/{cure.name}" for cure in CURES}
    runs = recorded_control(out, ControlConfig(steps=3), "cure/adam/consistent")
    assert len(runs) == len(CURES)
    with pytest.raises(ValueError, match="no cure named 'lion'"):
        train_key(ControlConfig(steps=3), "cure/adam/lion")
