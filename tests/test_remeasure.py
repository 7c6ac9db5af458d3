"""The GPU chapters' live re-measurement (their REMEASURE cell), at tiny sizes on the CPU so it cannot rot."""

from __future__ import annotations

from lowprec.instruments import remeasure


def test_chapter2_remeasure_measures_bias_and_speed() -> None:
    """The GPU suite's bias section and the benchmark at toy sizes, through Triton's interpreter."""
    live = remeasure.chapter2(smoke=True)
    suite = live["bias"]
    assert suite["provenance"]["git_commit"] and suite["errors"] == []
    assert {r["impl"] for r in suite["bias"]} >= {"triton", "triton+fix", "emulated-fa2"}
    kernel = {(r["impl"], r["case"]): r["o"]["mean"] for r in suite["bias"] if r["impl"] != "emulated-fa2"}
    emulator = {r["case"]: r["o"]["mean"] for r in suite["bias"] if r["impl"] == "emulated-fa2"}
    assert all(kernel["triton", case] == mean for case, mean in emulator.items())  # bit-identical on CPU
    assert {r["impl"] for r in live["bench"]["results"]} >= {"triton", "triton+fix"}
    assert all(r["fwd+bwd_tflops"] > 0 for r in live["bench"]["results"] if r["impl"].startswith("triton"))


def test_chapter3_remeasure_trains_both_arms() -> None:
    live = remeasure.chapter3(smoke=True)
    assert set(live) == {"paper64", "fa2"}
    for arm in live.values():
        assert arm["steps"][-1] == 19 and len(arm["layer1_logit"]) == len(arm["telemetry_steps"]) == 2


def test_chapter4_remeasure_trains_and_reads_the_key_sources() -> None:
    """A short run of the authors' placement with a checkpoint at its end, and the bias-noise key sources of
    layer index 1 on it (what chapter 4 reads from the lead's records)."""
    from lowprec.instruments.lowrank import SIMILARITIES

    live = remeasure.chapter4(smoke=True)
    assert live["ckpt_step"] == 20 and live["steps"] == (10, 15) and live["wq_norm"] > 0
    assert set(live["similarity"]) == set(SIMILARITIES)
    assert all(-1 <= value <= 1 for value in live["similarity"].values())
    assert len(live["sources"]) == 2  # the smoke model's two heads
    for head in live["sources"]:
        assert 0 < head["mean_key_cos"] <= 1 and head["half_positions"] >= 1


def test_chapter5_remeasure_measures_the_cures_through_the_kernel() -> None:
    """Three cures through the kernel (Triton's interpreter here) on one family, bit-identical with the
    emulator's cure table on the same rows, and their cost against plain fa2."""
    from lowprec.instruments.cures import CURES, FAMILIES, cure_table

    live = remeasure.chapter5(smoke=True)
    assert live["device"] == "cpu" and live["rows"] == 64 and not live["bias_errors"]
    names = ["none (fa2)", "Fix", "consistent"]
    assert [r["impl"] for r in live["bias"]] == names
    emulated = cure_table([c for c in CURES if c.name in names], FAMILIES[:1], rows=64)
    assert [r["o"]["mean"] for r in live["bias"]] == [r.o.mean for r in emulated]
    measured = {(row["cure"], row["causal"]) for row in live["cost"]}
    assert measured == {(name, causal) for name in names for causal in (False, True)}
    assert all(row["fwd+bwd_vs_fa2"] > 0 for row in live["cost"])


def test_last_rerun_reads_the_newest_passing_remeasure(tmp_path) -> None:
    """A page's re-run time comes from the newest GPU record that re-measured and passed; none: an error."""
    import json

    import pytest

    def record(folder: str, time: str, remeasure: bool, passed: bool, seconds: float) -> None:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "02-flash-attention.json").write_text(json.dumps({
            "chapter": "02-flash-attention.md", "remeasure": remeasure, "seconds": seconds, "passed": passed,
            "provenance": {"time": time, "device": "NVIDIA H200", "git_commit": folder[-7:] + "0" * 33,
                           "torch": "2.11.0+cu130"}}))

    with pytest.raises(FileNotFoundError, match="no passing GPU re-run of 02-flash-attention.md"):
        remeasure.last_rerun("02-flash-attention.md", tmp_path)
    record("gpu-chapters-aaaaaaa", "2026-12-01T00:00:00", True, True, 90.0)
    record("gpu-chapters-bbbbbbb", "2026-12-03T00:00:00", True, False, 10.0)  # newer, failed
    record("gpu-chapters-ccccccc", "2026-12-04T00:00:00", False, True, 20.0)  # newer, not re-measured
    record("gpu-chapters-0000000", "2026-12-02T00:00:00", True, True, 150.0)  # sorts first, newest passing
    rerun = remeasure.last_rerun("02-flash-attention.md", tmp_path)
    assert (rerun["seconds"], rerun["commit"], rerun["torch"]) == (150.0, "0000000", "2.11.0")
    assert rerun["note"] == ("With `REMEASURE = True` this page ran in 2.5 minutes on one NVIDIA H200 (torch "
                             "2.11.0, commit 0000000).")
