"""The GPU chapters' re-run path (their RERUN parameter cell), at tiny sizes on the CPU so it cannot rot."""

from __future__ import annotations

from lowprec.instruments import rerun


def test_chapter2_rerun_measures_bias_and_speed() -> None:
    live = rerun.chapter2(smoke=True)
    impls = {r["impl"] for r in live["bias"]["bias"]}
    assert {"triton", "triton+fix", "emulated-fa2"} <= impls
    assert any(r["impl"] == "triton" and r["fwd+bwd_tflops"] > 0 for r in live["bench"]["results"])


def test_chapter3_rerun_trains_both_arms() -> None:
    live = rerun.chapter3(smoke=True)
    assert set(live) == {"paper64", "fa2"}
    for arm in live.values():
        assert arm["steps"][-1] == 19 and len(arm["layer1_logit"]) == len(arm["telemetry_steps"]) == 2
