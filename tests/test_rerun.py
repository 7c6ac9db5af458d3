"""The GPU chapters' re-run path (their RERUN parameter cell), at tiny sizes on the CPU so it cannot rot."""

from __future__ import annotations

from lowprec.instruments import rerun


def test_chapter2_rerun_measures_bias_and_speed() -> None:
    """The GPU suite's bias section and the benchmark at toy sizes, through Triton's interpreter."""
    live = rerun.chapter2(smoke=True)
    suite = live["bias"]
    assert suite["provenance"]["git_commit"] and suite["errors"] == []
    assert {r["impl"] for r in suite["bias"]} >= {"triton", "triton+fix", "emulated-fa2"}
    kernel = {(r["impl"], r["case"]): r["o"]["mean"] for r in suite["bias"] if r["impl"] != "emulated-fa2"}
    emulator = {r["case"]: r["o"]["mean"] for r in suite["bias"] if r["impl"] == "emulated-fa2"}
    assert all(kernel["triton", case] == mean for case, mean in emulator.items())  # bit-identical on CPU
    assert {r["impl"] for r in live["bench"]["results"]} >= {"triton", "triton+fix"}
    assert all(r["fwd+bwd_tflops"] > 0 for r in live["bench"]["results"] if r["impl"].startswith("triton"))


def test_chapter3_rerun_trains_both_arms() -> None:
    live = rerun.chapter3(smoke=True)
    assert set(live) == {"paper64", "fa2"}
    for arm in live.values():
        assert arm["steps"][-1] == 19 and len(arm["layer1_logit"]) == len(arm["telemetry_steps"]) == 2
