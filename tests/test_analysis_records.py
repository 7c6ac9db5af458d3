"""Reading run and criterion records (lowprec.analysis, runs.load_experiment, viz.plots.logit_figure) on
small synthetic records with known answers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from lowprec import analysis
from lowprec.runs import RunWriter, experiments, load_experiment, load_run
from lowprec.viz.plots import logit_figure, name_overlaps, new_figure, survival_figure

CONFIG = {"warmup_iters": 0, "seed": 1, "batch_size": 4, "grad_accum": 2, "lr": 2e-3, "min_lr": 1e-5,
          "lr_decay_iters": 30000,
          "data": "/data/gpt2-english+code", "model": {"n_layer": 2, "n_embd": 8, "block_size": 16}}


def logits(step: int) -> list[list[float]]:
    """Layer 0 flat at 10; layer index 1: head 0 flat, head 1 past 1e3 from step 2,000, head 2 at 30 from
    1,500 and past 1e3 from 2,500."""
    head2 = 10.0 if step < 1500 else 30.0 if step < 2500 else 2e3
    return [[10.0, 10.0, 10.0], [10.0, 10.0 if step < 2000 else 2e3, head2]]


def norms(step: int, grown: float) -> list[list[float]]:
    """Every head at 1; head 1 of layer index 1 at `grown` from step 1,250."""
    return [[1.0] * 3, [1.0, 1.0 if step < 1250 else grown, 1.0]]


def write_run(path: Path, last: int = 2650, spike_from: int = 2600, diverged: int | None = 2650,
              logit=logits, loss_shift: float = 0.0, config: dict | None = None) -> Path:
    """A run logging its loss every 10 steps (3 nats, 10 from `spike_from`) and telemetry every 50, ending at
    step `last` (by the stop rule where `diverged` is set)."""
    writer = RunWriter(path, config or CONFIG)
    for step in range(0, last + 1, 10):
        loss = (3.0 if step < spike_from else 10.0) + loss_shift * (step >= 40)
        row = {"step": step, "tokens": step, "loss": loss, "lr": 1.0, "grad_norm": 1.0, "time_s": 1.0}
        if step % 50 == 0:
            row["telemetry"] = {"max_logit": logit(step), "wq_norm": norms(step, 2.0),
                                "wk_norm": norms(step, 3.0)}
        writer.log(row)
    status = {"status": "diverged", "diverged_step": diverged} if diverged else {"status": "finished"}
    writer.update_summary(steps=last if diverged else last + 1, **status)
    writer.close()
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return load_run(write_run(tmp_path_factory.mktemp("run") / "a"))


def test_onsets(run) -> None:
    assert analysis.first_over(run) == {1: 2000, 2: 2500}
    assert analysis.first_over(run, layer=0) == {}
    assert analysis.runaway_step(run) == 2000 and analysis.runaway_step(run, layer=0) is None
    assert analysis.runaway_step(run, threshold=20.0) == 1500  # head 2 at 30
    assert analysis.first_layer(run) == 1
    steps, largest = analysis.layer_logit(run)
    assert steps[:2] == [0, 50] and largest[steps.index(1500)] == 30.0 and largest[-1] == 2e3
    assert analysis.largest_logit(run) == 2e3
    assert analysis.head_series(run, "max_logit", 1, 2)[steps.index(1500)] == 30.0


def test_first_layer_takes_the_lowest_of_one_sample(tmp_path) -> None:
    both = load_run(write_run(tmp_path / "both", logit=lambda s: [[2e3 if s >= 1000 else 1.0] * 3] * 2))
    first0 = load_run(write_run(tmp_path / "zero",
                                logit=lambda s: [[2e3 if s >= 500 else 1.0] * 3, logits(s)[1]]))
    none = load_run(write_run(tmp_path / "none", logit=lambda s: [[1.0] * 3] * 2))
    assert analysis.first_layer(both) == 0 and analysis.first_layer(first0) == 0
    # the runaway is any layer's; a layer's own onset is asked for by index
    assert analysis.runaway_step(first0) == 500 and analysis.runaway_step(first0, layer=1) == 2000
    assert analysis.first_past(first0) == (500, 0) and analysis.first_past(first0, until=450) is None
    assert analysis.first_layer(none) is None and analysis.runaway_step(none) is None


def test_growth(run) -> None:
    assert analysis.window_growth([0, 1, 2, 3], [1.0, 3.0, 4.0, 12.0], early=(0, 2), late=(2, 4)) == 4.0
    assert analysis.slow_growth(run) == pytest.approx(200.0)  # 10 -> 2,000
    assert analysis.head_growth(run, "max_logit", 2, late=(1500, 2000)) == pytest.approx(3.0)
    assert analysis.head_growth(run, "max_logit", 0) == pytest.approx(1.0)
    assert analysis.fastest_head(run) == 1  # 200x; head 2: the median of 30 and 2,000, /10
    assert analysis.norm_growth_before(run) == pytest.approx({"wq_norm": 2.0, "wk_norm": 3.0})
    flat = load_run(write_run(run.path.parent / "flat", logit=lambda s: [[1.0] * 3] * 2))
    with pytest.raises(ValueError, match="no runaway"):
        analysis.norm_growth_before(flat)


def test_losses_and_events(run, tmp_path) -> None:
    steps, smooth = analysis.smoothed_loss(run, window=5)
    assert steps[0] == 40 and smooth[0] == 3.0 and smooth[steps.index(2600)] == pytest.approx(4.4)
    assert analysis.mean_loss(run, 2590, 2620) == pytest.approx((3.0 + 10.0 + 10.0) / 3)
    assert analysis.outcomes(run) == {"runaway": 2000, "spike": 2600, "explosion": 2650, "steps": 2650}
    calm = load_run(write_run(tmp_path / "calm", last=2990, spike_from=10**6, diverged=None))
    assert analysis.outcomes(calm) == {"runaway": 2000, "spike": None, "explosion": None, "steps": 2991}
    assert analysis.first_difference(run, calm) == 2600 and analysis.first_difference(run, run) is None
    cut = RunWriter(tmp_path / "cut", CONFIG)  # a record cut off while running: no steps in its summary
    cut.log({"step": 0, "tokens": 0, "loss": 3.0, "lr": 1.0, "grad_norm": 1.0, "time_s": 1.0,
             "telemetry": {"max_logit": logits(0)}})
    cut.close()
    assert analysis.outcomes(load_run(tmp_path / "cut"))["steps"] == 1
    shifted = load_run(write_run(tmp_path / "shifted", loss_shift=0.5))
    assert analysis.first_difference(shifted, run) == 40
    # keys=None: every logged value but the timings, telemetry included
    def odd(step: int) -> list[list[float]]:
        return [[7.0] * 3] * 2 if step == 100 else logits(step)
    other = load_run(write_run(tmp_path / "other", logit=odd))
    assert analysis.first_difference(other, run) is None
    assert analysis.first_difference(other, run, None) == 100
    timed = [{**m, "time_s": 2.0, "tokens_per_s": 5.0} for m in run.metrics]
    slower = dataclasses.replace(run, metrics=timed)
    assert analysis.first_difference(slower, run, None) is None
    assert analysis.first_difference(shifted, run, ("grad_norm",)) is None


def test_recipe(run, tmp_path) -> None:
    assert analysis.recipe(run) == {"model": "2x8", "tokens_per_step": 128, "corpus": "gpt2-english+code",
                                    "lr": 2e-3, "decay_steps": 30000}
    writer = RunWriter(tmp_path, {**CONFIG, "data": "", "min_lr": 2e-3})  # the corpus: its start event
    writer.event("start", 0, data="/somewhere/gpt2-permissive")
    writer.log({"step": 0, "tokens": 0, "loss": 3.0, "lr": 1.0, "grad_norm": 1.0, "time_s": 1.0})
    writer.update_summary(status="finished", steps=1)
    writer.close()
    assert analysis.recipe(load_run(tmp_path)) == {"model": "2x8", "tokens_per_step": 128, "corpus":
                                                   "gpt2-permissive", "lr": 2e-3, "decay_steps": None}
    assert analysis.recipe_label(analysis.recipe(run)) == \
        "2x8 model, 128 tokens per step, gpt2-english+code, lr 0.002 (cosine over 30,000 steps)"
    assert analysis.recipe_label(analysis.recipe(load_run(tmp_path))) == \
        "2x8 model, 128 tokens per step, gpt2-permissive, lr 0.002 (constant)"


def test_split_name() -> None:
    assert analysis.split_name("paper64-fp32pv-s1337") == ("paper64-fp32pv", 1337)
    assert analysis.split_name("kbit3-consistent-fix-s3") == ("kbit3-consistent-fix", 3)
    assert analysis.split_name("fa2-lr8e-3-s1") == ("fa2-lr8e-3", 1)  # the last "-s" parts the seed off
    for bad in ("fa2", "fa2-s", "-s1", "fa2-sx", "lead-s1337/fa2"):
        with pytest.raises(ValueError, match="not a run name"):
            analysis.split_name(bad)


def test_load_experiment(tmp_path) -> None:
    write_run(tmp_path / "exp" / "a-s1")
    write_run(tmp_path / "exp" / "b-s2", config={**CONFIG, "seed": 2})
    write_run(tmp_path / "exp" / "a-s1" / "replay-from-100")  # a replay inside a run is not a run
    (tmp_path / "exp" / "a-s1" / "replay-from-100" / "replay.json").write_text("{}")
    (tmp_path / "exp" / "bias-noise").mkdir()
    runs = load_experiment(tmp_path / "exp")
    assert list(runs) == ["a-s1", "b-s2"] and runs["a-s1"].summary["diverged_step"] == 2650
    named = load_experiment(tmp_path / "exp", name=lambda config: f"x-s{config['seed']}")
    assert list(named) == ["x-s1", "x-s2"] and named["x-s2"].path.name == "b-s2"


def test_experiment_runs(tmp_path) -> None:
    write_run(tmp_path / "one" / "a-s1")
    write_run(tmp_path / "two" / "b-s2", config={**CONFIG, "seed": 2})
    runs = analysis.experiment_runs(tmp_path, "one", "two")
    assert list(runs) == ["a-s1", "b-s2"] and runs["b-s2"].path == tmp_path / "two" / "b-s2"
    named = analysis.experiment_runs(tmp_path, "one", "two", name=lambda config: f"x-s{config['seed']}")
    assert list(named) == ["x-s1", "x-s2"]
    with pytest.raises(ValueError, match="two runs named 'x'"):
        analysis.experiment_runs(tmp_path, "one", "two", name=lambda config: "x")


def test_load_experiment_refuses_two_runs_of_one_name_and_an_empty_folder(tmp_path) -> None:
    write_run(tmp_path / "a")
    write_run(tmp_path / "b")
    with pytest.raises(ValueError, match="two runs named 'x'"):
        load_experiment(tmp_path, name=lambda config: "x")
    assert list(load_experiment(tmp_path / "a")) == ["a"]  # a folder that is itself one run
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no run"):
        load_experiment(tmp_path / "empty")


def head(t: float, biased: bool = False, norm: float = 0.0) -> dict:
    return {"t": t, "biased": biased, "norm_error_t": norm}


def write_criterion(folder: Path, name: str, step: int, t: float, batches: int = 32) -> None:
    """A criterion record of two layers x two heads: layer index 1 head 0 at `t` (biased from 4), the rest at
    1 (W_Q) and 2 (W_K)."""
    heads = [[head(1.0), head(1.0)], [head(t, t >= 4, norm=-t), head(1.0)]]
    heads_k = [[head(2.0), head(2.0)], [head(2.0), head(2.0)]]
    record = {"batches": batches, "tokens_per_batch": 8192, "checkpoints": [
        {"step": step, "sources": [[{"dominant_rows": 0.0}] * 2] * 2,
         "specs": {"triton/precision=fa2": {"heads": heads, "heads_k": heads_k},
                   "triton/precision=paper": {"heads": heads_k, "heads_k": heads}}}]}
    (folder / "bias-noise").mkdir(parents=True, exist_ok=True)
    (folder / "bias-noise" / f"{name}-step{step}.json").write_text(json.dumps(record))


def test_criterion_records(tmp_path) -> None:
    for step, t in ((1000, 2.0), (2000, 6.0)):
        write_criterion(tmp_path, "r-s1", step, t)
    write_criterion(tmp_path, "r-s1", 3000, 1.0, batches=8)
    with pytest.raises(ValueError, match="spec"):
        analysis.criterion(tmp_path, "r-s1", 1000)  # two specs: name one
    with pytest.raises(ValueError, match="8 batches"):
        analysis.criterion(tmp_path, "r-s1", 3000, "triton/precision=fa2")
    records = [analysis.criterion(tmp_path, "r-s1", step, "triton/precision=fa2") for step in (1000, 2000)]
    assert records[1]["sources"][1][0] == {"dominant_rows": 0.0}
    assert analysis.biased_heads(records[0]["heads"]) == []
    assert analysis.biased_heads(records[1]["heads"]) == [(1, 0)]
    z = analysis.combined_z(records)
    assert z.shape == (2, 2) and z[1, 0].item() == pytest.approx(8 / 2**0.5)
    assert z[0, 0].item() == pytest.approx(2**0.5)
    assert analysis.combined_z(records, "heads_k")[1, 0].item() == pytest.approx(4 / 2**0.5)
    assert analysis.combined_z(records, key="norm_error_t")[1, 0].item() == pytest.approx(-8 / 2**0.5)
    assert analysis.layer_t2(records) == pytest.approx([1.0, (4 + 36 + 1 + 1) / 4])
    assert analysis.layer_t2(records, "heads_k") == pytest.approx([4.0, 4.0])
    torch.testing.assert_close(analysis.head_t(records[1]["heads"]), torch.tensor([[1.0, 1.0], [6.0, 1.0]],
                                                                                    dtype=torch.float64))
    paper = analysis.criterion(tmp_path, "r-s1", 2000, "triton/precision=paper")
    assert analysis.biased_heads(paper["heads"]) == []


def test_figures(run) -> None:
    fig = logit_figure("title", {"a": run, "b": run}, colours={"a": "#d62728"}, dashes={"b": "dot"})
    assert [trace.name for trace in fig.data] == ["a", "b"] and fig.layout.yaxis.type == "log"
    assert fig.data[0].line.color == "#d62728" and fig.data[1].line.color is None
    assert fig.data[1].line.dash == "dot"
    assert fig.layout.xaxis.title.text == "step" and "logit" in fig.layout.yaxis.title.text
    calm = analysis.Outcome(None, None, None, 800)
    table = analysis.survival_table({"fa2": [analysis.Outcome(100, 1, None, 800), calm], "other": [calm],
                                     "third": [calm, calm]})
    km = survival_figure("survival", table, "runaway", horizon=800)
    assert list(km.data[0].x) == [0, 100, 800] and list(km.data[0].y) == [1.0, 0.5, 0.5]
    assert list(km.data[1].x) == [0, 800] and km.data[1].line.shape == "hv"
    assert [trace.name for trace in km.data] == ["fa2: 1 of 2", "other: 0 of 1", "third: 0 of 2"]
    assert km.layout.title.subtitle.text.endswith("one line at 1: other, third")  # the lines hidden in one
    del table["third"]  # one flat line: nothing hidden
    assert not survival_figure("survival", table, "runaway", horizon=800).layout.title.subtitle.text


def test_name_overlaps_names_the_lines_a_reader_cannot_see() -> None:
    """Lines within 2% of the axis's span of each other at 95% of their points or more, at the same x, are
    named by group; on a log axis the span is in decades; a line apart from the rest, or at other x values,
    is not named."""
    fig = new_figure("t", "step", "y")
    for name, y in (("a", [0, 5, 10]), ("b", [0, 0.05, 0.02]), ("c", [0.01, 0, 0.05]), ("d", [0, 5.05, 10]),
                    ("e", [0, 0.5, 0])):
        fig.add_scatter(x=[0, 1, 2], y=y, mode="lines", name=name)
    fig.add_scatter(x=[0, 1, 3], y=[0, 0.05, 0.02], mode="lines", name="other x")
    text = name_overlaps(fig).layout.title.subtitle.text
    assert text == "drawn on one another (within 2% of the axis at 95% of the points): a = d; b = c"
    log = new_figure("t", "step", "y", yaxis_type="log")
    for name, y in (("a", [1, 1e4]), ("b", [1.01, 1.02e4]), ("c", [1, 1.3e4])):
        log.add_scatter(x=[0, 1], y=y, mode="lines", name=name)
    assert name_overlaps(log).layout.title.subtitle.text.endswith(": a = b")  # c is 0.11 of 4 decades away
    alone = new_figure("t", "step", "y")
    alone.add_scatter(x=[0, 1], y=[0, 1], mode="lines", name="a")
    assert not name_overlaps(alone).layout.title.subtitle.text


def test_experiments_lists_folders_that_hold_runs(tmp_path) -> None:
    write_run(tmp_path / "exp" / "a-s1")
    write_run(tmp_path / "single")
    (tmp_path / "queue-only").mkdir()
    (tmp_path / "queue-only" / "queue.json").write_text("{}")
    assert [folder.name for folder in experiments(tmp_path)] == ["exp", "single"]
