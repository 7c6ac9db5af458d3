"""Cures of flash attention's rounding bias, measured on one harness (the book's chapter 5).

`cure_rows` and `FAMILIES` give the bias harness's adversarial rows with chosen row maxima; a `Cure` (of
`CURES`) is a precision string and a Fix, `cure_table` its bias on every family; `failure_map` the Fix's own
bias; `train_cure` trains the positive control with a cure, `train_key` any run of its records by key;
`lowprec measure cures --out DIR` (`--smoke` on a CPU) measures every cure through our Triton kernel with its
cost. The methods are in the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from lowprec.analysis import ErrorStats
from lowprec.attention import Fix, Precision, Rounding, emulated_attention, reference_attention
from lowprec.attention.precision import INPUT, POINTS
from lowprec.checks import option
from lowprec.formats import FORMATS, Format, round_to
from lowprec.instruments.bias import (
    CASES,
    SEQ,
    BiasResult,
    Case,
    Rows,
    as_case,
    bias_of,
    format_table,
    target_scores,
)
from lowprec.instruments.control import ControlConfig, single_thread, train_treatment, train_w_q

SCALE = 0.125  # softmax scale of the cure rows: a power of two, so a bf16-grid maximum stays exact
BF16 = FORMATS["bf16"]
Maxima = str | float | Sequence[float]  # "continuous", "bf16", one value for all rows, or one per group


# ---------------------------------------------------------------------------------------------------- rows


def row_maxima(case: Case, rows: int, maxima: Maxima, gen: torch.Generator) -> torch.Tensor:
    """(rows, 1) float64 row maxima: uniform in case.max_range ("continuous"), the same snapped to the bf16
    grid ("bf16"), one value for every row (a float), or len(maxima) equal consecutive groups of rows, group i
    at maxima[i] (a sequence; rows must be a multiple of its length)."""
    if isinstance(maxima, str):
        if maxima not in ("continuous", "bf16"):
            raise ValueError(f"maxima must be 'continuous', 'bf16', a number or a sequence, got {maxima!r}")
        lo, hi = case.max_range
        r = lo + (hi - lo) * torch.rand(rows, 1, generator=gen, dtype=torch.float64)
        return r if maxima == "continuous" else round_to(r.float(), BF16).double()
    values = [float(maxima)] if isinstance(maxima, (int, float)) else [float(x) for x in maxima]
    if not values or rows % len(values):
        raise ValueError(f"rows ({rows}) must be a positive multiple of the number of maxima ({len(values)})")
    return torch.tensor(values, dtype=torch.float64).repeat_interleave(rows // len(values))[:, None]


def cure_rows(case: Case | str, rows: int = 4096, seed: int = 0, maxima: Maxima = "continuous") -> Rows:
    """The bias harness's rows for `case` (bf16 q, k, v, fp32 dO, float64 reference at SCALE) with the row
    maxima of `maxima` (`row_maxima`); the pattern below the maximum (ties, near ties, the rest) is the
    case's. A maximum on the bf16 grid is the exact fp32 score of its key(s)."""
    case = as_case(case)
    if case.scores == "random":
        raise ValueError("cure_rows needs a case with a prescribed maximum (not scores='random')")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    gen = torch.Generator().manual_seed(seed)
    heads, d = -(-rows // SEQ), 2 * SEQ
    s = target_scores(case, heads * SEQ, gen)
    r = row_maxima(case, rows, maxima, gen)
    r = torch.cat([r, r[-1:].expand(heads * SEQ - rows, 1)])  # the last head's spare rows (never measured)
    s = s - s.amax(dim=-1, keepdim=True) + r  # the ties stay bit-exact: their s - max is 0
    want = (s / SCALE).view(1, heads, SEQ, SEQ)
    a = want.bfloat16()
    q = torch.cat([a, (want - a.double()).bfloat16()], dim=-1)  # q·k = a + b (as bias.adversarial_inputs)
    eye = torch.eye(SEQ, dtype=torch.bfloat16)
    k = torch.cat([eye, eye], dim=-1).expand(1, heads, SEQ, d).contiguous()
    v = (case.v_mean + 0.5 * torch.randn(1, heads, SEQ, d, generator=gen)).bfloat16()
    do = math.copysign(1.0, case.v_mean) + torch.randn(1, heads, SEQ, d, generator=gen)
    return Rows(case, rows, q, k, v, do, reference_attention(q, k, v, causal=False, scale=SCALE)[0])


@dataclass(frozen=True)
class Family:
    """A family of rows for the cure table: a Case (score pattern and V's mean) and its row maxima."""

    name: str
    case: Case
    maxima: str | float = "continuous"

    def rows(self, rows: int = 4096, seed: int = 0) -> Rows:
        return cure_rows(replace(self.case, name=self.name), rows, seed, self.maxima)


FAMILIES: tuple[Family, ...] = (
    Family("near, r continuous", CASES["near-k4"]),
    Family("near, r on bf16 grid", CASES["near-k4"], "bf16"),
    Family("exact, r on bf16 grid", CASES["exact-k4"], "bf16"),
    Family("exact, r = 5 (sinks)", CASES["exact-k4"], 5.0),
    Family("near, r continuous, V -0.75", replace(CASES["near-k4"], v_mean=-0.75)),
)
"""Near or exact ties (4 keys) with continuous, bf16-grid or shared maxima, V ~ N(-1.5, 0.5²) (mid-binade),
and near ties with V ~ N(-0.75, 0.5²), mid-binade on the other side of 1. r is uniform in [1, 3] unless fixed;
r = 5 is the sink lead of chapter 4's positive control."""


# -------------------------------------------------------------------------------------------------- cures


def pinned(precision: Precision | str, dtype: torch.dtype) -> Precision:
    """`precision` with every "input" rounding point replaced by the format of `dtype` (same mode), so that
    it rounds the same way on fp32 copies of inputs of that dtype."""
    p = Precision.parse(precision)
    changes = {}
    for point in POINTS:
        rounding = getattr(p, point)
        if rounding.fmt == INPUT:
            changes[point] = Rounding(rounding.resolve(dtype), rounding.mode)
    return replace(p, **changes)


@dataclass(frozen=True)
class Cure:
    """A change of the forward that may remove its bias: a precision string (lowprec.attention.precision)
    and a Fix; `about` says what it changes, for tables."""

    name: str
    precision: str = "fa2"
    fix: Fix | None = None
    about: str = ""

    def __post_init__(self) -> None:
        Precision.parse(self.precision)  # ValueError for a bad string, at construction

    @property
    def fp32_store(self) -> bool:
        """The output point is unrounded: the backward's δ uses the fp32 O, not the stored (cast) one."""
        return Precision.parse(self.precision).output.fmt is None

    def impl(self, seed: int = 1, kernel: bool = False, **options) -> Callable[..., torch.Tensor]:
        """f(q, k, v) -> the O the backward uses (non-causal, SCALE), for bias_of; `seed` drives stochastic
        rounding; `options` go to emulated_attention (e.g. block_n, return_stats), or with `kernel` to our
        Triton kernel, flash_attention (64 x 64 tiles unless given)."""
        gen = torch.Generator().manual_seed(seed)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            precision: Precision | str = self.precision
            if self.fp32_store:  # the same forward on fp32 copies: O = acc / l, unrounded
                precision = pinned(precision, q.dtype)
                q, k, v = q.float(), k.float(), v.float()
            if kernel:
                from lowprec.attention.flash import flash_attention  # triton only when asked for

                return flash_attention(q, k, v, causal=False, scale=SCALE, precision=precision, fix=self.fix,
                                       seed=seed, **{"block_m": 64, "block_n": 64} | options)
            return emulated_attention(q, k, v, causal=False, scale=SCALE, precision=precision, fix=self.fix,
                                      generator=gen, **options)

        run.__name__ = self.name
        return run


CURES: tuple[Cure, ...] = (
    Cure("none (fa2)", about="production placement: P̄ and O in bf16, l sums the fp32 P"),
    Cure("Fix", fix=Fix(), about="the published dynamic maximum, beta = 2, ties per tile"),
    Cure("Fix, closed", fix=Fix(variant="closed"), about="the Fix with a gap of at least 2^-7 above r"),
    Cure("consistent", "consistent", about="l sums the rounded P̄ that enter P̄V (norm=rounded)"),
    Cure("consistent + Fix", "consistent", Fix(), about="both"),
    Cure("stochastic P̄", "fa2:weights=bf16@stochastic", about="P̄ rounded stochastically to bf16"),
    Cure("fp32 P̄V", "fa2:weights=none", about="P̄ not rounded (an fp32 P̄V product)"),
    Cure("fp32 O for δ", "fa2:output=none", about="the backward's δ from the unrounded O"),
    Cure("fp16 P̄", "fa2:weights=fp16", about="P̄ in fp16 (10 significand bits)"),
    Cure("fp8 e4m3 P̄", "fa2:weights=fp8_e4m3", about="P̄ in fp8 e4m3 (3 bits, the FP8 kernels' P)"),
    Cure("fp8 e5m2 P̄", "fa2:weights=fp8_e5m2", about="P̄ in fp8 e5m2 (2 bits)"),
)


def cure_by_name(name: str) -> Cure:
    """The cure of CURES called `name`; a ValueError naming the cures otherwise."""
    cure = next((c for c in CURES if c.name == name), None)
    if cure is None:
        raise ValueError(f"no cure named {name!r}: cure must be one of {[c.name for c in CURES]}")
    return cure


@single_thread()
def cure_table(cures: Sequence[Cure], families: Sequence[Family], rows: int = 4096, seed: int = 0,
               kernel: bool = False, device: str | torch.device = "cpu",
               errors: dict[str, str] | None = None) -> list[BiasResult]:
    """bias_of for every (cure, family), families outermost; the same rows for every cure; with `kernel`, our
    Triton kernel on `device` instead of the emulator. A cure the kernel rejects raises its ValueError, or,
    with `errors`, is recorded there (cure name -> message) and skipped."""
    results = []
    for family in families:
        data = family.rows(rows, seed)
        moved = {name: getattr(data, name).to(device) for name in ("q", "k", "v", "do", "o_ref")}
        data = replace(data, **moved)
        for cure in cures:
            try:
                results.append(bias_of(cure.impl(seed + 1, kernel), data, cure.name))
            except ValueError as exc:
                if errors is None:
                    raise
                errors[cure.name] = str(exc)
    return results


# -------------------------------------------------------------------------------------- the Fix's own bias


def top_weight_error(beta: float, r: float, fmt: Format = BF16) -> float:
    """Relative rounding error of the Fix's largest weight exp(-(beta-1) r) (r > 0) in `fmt`: the same for
    every row whose maximum is r, so it does not average out over such rows."""
    x = torch.tensor([math.exp(-(beta - 1.0) * r)], dtype=torch.float32)
    return float(round_to(x, fmt).double() / x.double() - 1.0)


def row_errors(impl: Callable, data: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row O error (mean over features) and δ error (rowsum dO * error) of `impl` on `data`, as bias_of
    computes them (float64; no row may be non-finite)."""
    out = impl(data.q, data.k, data.v)
    o = (out[0] if isinstance(out, tuple) else out).double()
    err = (o - data.o_ref).flatten(0, 2)[: data.rows]
    if not torch.isfinite(err).all():
        raise ValueError("row_errors: non-finite outputs (use bias_of, which drops such rows)")
    return err.mean(dim=-1), (data.do.double().flatten(0, 2)[: data.rows] * err).sum(dim=-1)


@single_thread()
def failure_map(betas: Sequence[float], maxima: Sequence[float], case: Case | str = "exact-k4",
                rows: int = 512, seed: int = 0, precision: str = "fa2") -> dict[str, list[list[float]]]:
    """t(O) and t(δ) of the published Fix(beta) for `rows` rows whose maximum is exactly r, for every beta in
    `betas` (outer lists) and r in `maxima` (inner lists), on the same rows for every beta."""
    data = cure_rows(case, rows * len(maxima), seed, tuple(maxima))
    out: dict[str, list[list[float]]] = {"o_t": [], "delta_t": []}
    for beta in betas:
        o_err, d_err = row_errors(Cure(f"beta {beta}", precision, Fix(beta=beta)).impl(), data)
        out["o_t"].append([ErrorStats.of(e).t for e in o_err.view(len(maxima), rows)])
        out["delta_t"].append([ErrorStats.of(e).t for e in d_err.view(len(maxima), rows)])
    return out


# ----------------------------------------------------------------------------------------- positive control


@single_thread()
def train_cure(cfg: ControlConfig, cure: Cure, optimizer: str = "adam") -> dict:
    """The positive control (`control.train_w_q`) with a cure's precision and Fix: the same initialisation,
    data and summary as its treatments. Returns {"series", "summary"}."""
    return train_w_q(cfg, cure.precision, cure.fix, optimizer)


def train_key(cfg: ControlConfig, key: str) -> dict:
    """One positive-control run by its record key: "<placement>/<optimizer>/<treatment>" (placement "fp64"
    for the reference) or "cure/<optimizer>/<cure name>"."""
    placement, optimizer, name = key.split("/", 2)
    if placement == "cure":
        return train_cure(cfg, cure_by_name(name), optimizer)
    return train_treatment(cfg, "fa2" if placement == "fp64" else placement, name, optimizer)


# ------------------------------------------------------------------------------- `lowprec measure cures`


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for cures.json (created if missing)")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per input family (default 100000 on a GPU, 64 with --smoke)")
    parser.add_argument("--seq", type=option(int, 1), default=4096,
                        help="sequence length of the cost benchmark")
    parser.add_argument("--head-dim", type=option(int, 1), default=128,
                        help="head dimension of the cost benchmark")
    parser.add_argument("--rounds", type=option(int, 1), default=3,
                        help="interleaved timing rounds of the benchmark")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on a CPU via the interpreter)")


def cost_table(cures: Sequence[Cure], seq: int, head_dim: int, device: str, rounds: int,
               tokens: int = 16384, hidden: int = 2048) -> list[dict]:
    """Per causal setting and cure: fwd, bwd, fwd+bwd ms of our kernel with the cure's precision and Fix
    (bench_attention.bench_config, interleaved), and its time over the first cure's, plain fa2 in CURES
    ("<mode>_vs_fa2"; "error" if the kernel rejects the cure)."""
    from lowprec.attention.flash import flash_attention
    from lowprec.instruments.bench_attention import MODES, bench_config

    impls = {c.name: functools.partial(flash_attention, precision=c.precision, fix=c.fix) for c in cures}
    batch, heads = max(1, tokens // seq), max(1, hidden // head_dim)
    rows = []
    for causal in (False, True):
        measured = bench_config(impls, batch, heads, seq, head_dim, causal, device, rounds)
        base = measured.get(cures[0].name, {})
        for name, result in measured.items():
            row = {"cure": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim,
                   "causal": causal} | result
            for mode in MODES:
                if f"{mode}_ms" in result and f"{mode}_ms" in base:
                    row[f"{mode}_vs_fa2"] = round(result[f"{mode}_ms"] / base[f"{mode}_ms"], 4)
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from lowprec.attention.flash import autotuned_configs
    from lowprec.runs import provenance, write_json  # records layer, imported only by this command
    from tqdm import tqdm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise ValueError("no CUDA device: run with --smoke (tiny sizes through Triton's interpreter)")
    for name in ("rows", "seq", "head_dim", "rounds"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    rows = args.rows or (64 if args.smoke else 100_000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"provenance": provenance(), "args": vars(args), "device": device, "bias": [],
                    "bias_errors": {}, "cost": [], "seconds": {}}
    start = time.perf_counter()
    for family in tqdm(FAMILIES, desc="bias", mininterval=10):  # a family's rows, built once for every cure
        found = cure_table(CURES, [family], rows, kernel=True, device=device, errors=record["bias_errors"])
        record["bias"] += [r.to_dict() for r in found]
        write_json(out / "cures.json", record)
    record["seconds"]["bias"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    seq, head_dim = (64, 16) if args.smoke else (args.seq, args.head_dim)
    record["cost"] = cost_table(CURES, seq, head_dim, device, 1 if args.smoke else args.rounds,
                                tokens=128 if args.smoke else 16384, hidden=32 if args.smoke else 2048)
    record["seconds"]["cost"] = round(time.perf_counter() - start, 1)
    record["configs"] = autotuned_configs()  # each variant's tiles (on a GPU): the costs compare these picks
    write_json(out / "cures.json", record)
    print(format_table(BiasResult.from_dict(d) for d in record["bias"]))
    for row in record["cost"]:
        ratios = ", ".join(f"{m} x{row[m + '_vs_fa2']:.3f}" for m in ("fwd", "fwd+bwd")
                           if m + "_vs_fa2" in row)
        print(f"{row['cure']:<18} causal={row['causal']!s:<5} {ratios or row.get('error', '')}")
    print(f"wrote {out / 'cures.json'}")
    return 0


__all__ = [
    "CURES",
    "FAMILIES",
    "SCALE",
    "Cure",
    "Family",
    "cure_by_name",
    "cure_rows",
    "cost_table",
    "cure_table",
    "failure_map",
    "pinned",
    "row_errors",
    "row_maxima",
    "top_weight_error",
    "train_cure",
    "train_key",
]
