"""Adversarial attention rows and the signed error they leave in O and in δ = rowsum(dO ∘ O).

A `Case` describes a family of score rows (unique max, exact ties, near ties, random, huge logits) and of
value columns; `adversarial_inputs` turns it into bf16 q, k, v and an fp32 dO whose scaled scores are those
rows. `bias_of(impl, rows)` measures one implementation (a callable f(q, k, v) -> o or a backend name)
against the float64 reference, `bias_table` several on the same rows: mean, std and t of the per-row O and δ
errors. The construction and the statistics: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

import torch
from lowprec.analysis import BIASED_T, ErrorStats
from lowprec.attention.dispatch import attention
from lowprec.attention.reference import reference_attention, scaled_scores

SCORES = ("unique", "exact", "near", "random")
SEQ = 64  # keys (= queries) per head in the adversarial inputs
NEAR_WINDOW = 1e-3  # near-ties lie in (max - NEAR_WINDOW, max): their exp(s - max) rounds to 1.0 in bf16
UNIQUE_GAP = 0.05  # every other score lies at least this far below the max (and the near-ties)


@dataclass(frozen=True)
class Case:
    """A family of adversarial rows.

    scores: "unique" (one max, the rest >= UNIQUE_GAP below), "exact" (`ties` keys share the max exactly),
    "near" (the max plus ties-1 keys 0.05..0.9 `window` below it; default NEAR_WINDOW), "random"
    (Gaussian q, k: score std `spread`).
    The row max is uniform in `max_range` (negative range: negative maxima); the other scores are
    max − UNIQUE_GAP − spread·Exp(1). V entries ~ N(v_mean, 0.5²), dO entries ~ N(sign(v_mean), 1)
    (dO has O's sign, as in the paper's Fig. 5).
    """

    name: str
    scores: str = "unique"
    ties: int = 1
    max_range: tuple[float, float] = (1.0, 3.0)
    spread: float = 1.0
    v_mean: float = -1.5
    window: float = NEAR_WINDOW

    def __post_init__(self) -> None:
        if not 0 < self.window < UNIQUE_GAP:
            raise ValueError(f"Case.window must be in (0, {UNIQUE_GAP}), got {self.window}")
        if self.scores not in SCORES:
            raise ValueError(f"Case.scores must be one of {SCORES}, got {self.scores!r}")
        if not 1 <= self.ties <= SEQ // 2:
            raise ValueError(f"Case.ties must be in [1, {SEQ // 2}], got {self.ties}")
        if (self.scores in ("exact", "near")) != (self.ties > 1):
            raise ValueError(f"Case {self.name!r}: 'exact'/'near' need ties >= 2, the others ties=1")
        lo, hi = self.max_range
        if not lo <= hi or lo < 0 < hi:
            raise ValueError(f"Case.max_range must be (lo, hi), lo <= hi, of one sign; got {self.max_range}")
        if self.v_mean == 0:
            raise ValueError("Case.v_mean must be nonzero (same-sign V is the point)")


def _named(cases: Iterable[Case]) -> dict[str, Case]:
    return {c.name: c for c in cases}


CASES: dict[str, Case] = _named(
    [
        Case("unique"),
        *(Case(f"exact-k{k}", "exact", ties=k) for k in range(2, 9)),
        Case("near-k2", "near", ties=2),
        Case("near-k4", "near", ties=4),
        Case("near-k8", "near", ties=8),
        Case("near-k4-neg", "near", ties=4, max_range=(-3.0, -1.0)),
        # near-ties up to 0.0225 below the max: mostly outside bf16's round-to-1 window (1.955e-3), inside
        # e8m3's (0.0317): what "fa2:weights=e8m3@ones" amplifies
        Case("near-k4-wide", "near", ties=4, window=0.025),
        Case("unique-v+3", v_mean=3.0),
        Case("near-k4-v+3", "near", ties=4, v_mean=3.0),
        Case("unique-v-1", v_mean=-1.0),
        Case("near-k4-v-1", "near", ties=4, v_mean=-1.0),
        Case("exact-k4-huge", "exact", ties=4, max_range=(60.0, 120.0), spread=10.0),
        Case("random", "random", spread=2.0),
    ]
)
"""Named cases. v_mean -1.5 and +3 are mid-binade (O away from a power of two); -1 shows the binade effect."""


@dataclass(frozen=True)
class BiasResult:
    """Bias of one implementation on one case; `to_dict()` is JSON-ready."""

    impl: str
    case: str
    o: ErrorStats
    delta: ErrorStats
    rows: int
    nonfinite: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BiasResult:
        """Inverse of to_dict (e.g. for results read back from JSON)."""
        return cls(**{**d, "o": ErrorStats(**d["o"]), "delta": ErrorStats(**d["delta"])})


def biased(result: BiasResult) -> bool:
    """The book's one definition of a bias: |t| >= BIASED_T for the O error or the δ error."""
    return max(abs(result.o.t), abs(result.delta.t)) >= BIASED_T


def target_scores(case: Case, rows: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, SEQ) float64 score rows with the case's max / tie structure (not used for "random")."""
    lo, hi = case.max_range
    m = lo + (hi - lo) * torch.rand(rows, 1, generator=generator, dtype=torch.float64)
    gaps = torch.empty(rows, SEQ, dtype=torch.float64).exponential_(generator=generator)
    s = m - UNIQUE_GAP - case.spread * gaps
    # the max and its (near-)ties sit at random positions of each row
    pos = torch.rand(rows, SEQ, generator=generator).argsort(dim=1)[:, : case.ties]
    near = torch.zeros(rows, case.ties, dtype=torch.float64)
    if case.scores == "near":
        # offsets in [0.05, 0.9) * window: clear of the max and of the window edge by more than the
        # ~5e-5 representation error of adversarial_inputs' bf16 pairs (for |max| <= 3)
        offsets = torch.rand(rows, case.ties - 1, generator=generator, dtype=torch.float64)
        near[:, 1:] = case.window * (0.05 + 0.85 * offsets)
    s.scatter_(1, pos, m - near)
    return s


def adversarial_inputs(
    case: Case,
    rows: int = 20_000,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q, k, v and fp32 dO, each (1, heads, SEQ, 2·SEQ), heads = ceil(rows / SEQ); see the module doc.

    Every query row is one independent adversarial row (non-causal attention over SEQ keys).
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    gen = torch.Generator().manual_seed(seed)
    heads, d = -(-rows // SEQ), 2 * SEQ
    scale = 1.0 / math.sqrt(d)
    if case.scores == "random":
        std = math.sqrt(case.spread)  # q·k/√d has std spread when q, k entries have std √spread
        q = (std * torch.randn(1, heads, SEQ, d, generator=gen)).bfloat16()
        k = (std * torch.randn(1, heads, SEQ, d, generator=gen)).bfloat16()
    else:
        want = target_scores(case, heads * SEQ, gen).view(1, heads, SEQ, SEQ) / scale
        a = want.bfloat16()
        b = (want - a.double()).bfloat16()
        q = torch.cat([a, b], dim=-1)
        eye = torch.eye(SEQ, dtype=torch.bfloat16)
        k = torch.cat([eye, eye], dim=-1).expand(1, heads, SEQ, d).contiguous()
    v = (case.v_mean + 0.5 * torch.randn(1, heads, SEQ, d, generator=gen)).bfloat16()
    do = math.copysign(1.0, case.v_mean) + torch.randn(1, heads, SEQ, d, generator=gen)
    return q.to(device), k.to(device), v.to(device), do.to(device)


Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | str


def as_case(case: Case | str) -> Case:
    """A Case, or the named one from CASES."""
    if isinstance(case, str) and case in CASES:
        return CASES[case]
    if not isinstance(case, Case):
        raise ValueError(f"case must be a Case or one of {sorted(CASES)}, got {case!r}")
    return case


@dataclass
class Rows:
    """One case's inputs and its float64 reference output, shared by every implementation measured on it."""

    case: Case
    rows: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    o_ref: torch.Tensor

    @classmethod
    def make(cls, case: Case | str, rows: int = 20_000, seed: int = 0, device: str | torch.device = "cpu"):
        case = as_case(case)
        q, k, v, do = adversarial_inputs(case, rows, seed, device)
        return cls(case, rows, q, k, v, do, reference_attention(q, k, v, causal=False)[0])


def run_impl(impl: Impl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw):
    """Non-causal result of `impl` (a callable, or a backend name with keywords `kw`): o or (o, ...)."""
    if isinstance(impl, str):
        return attention(q, k, v, backend=impl, causal=False, **kw)
    if not callable(impl):
        raise ValueError(f"impl must be a callable f(q, k, v) -> o or a backend name, got {impl!r}")
    if kw:
        raise ValueError(f"keywords {sorted(kw)} go with a backend name; bind them into the callable")
    return impl(q, k, v)


def bias_of(impl: Impl, data: Rows, name: str | None = None, **kw) -> BiasResult:
    """Signed error statistics of `impl` on prepared rows `data` (see the module docstring)."""
    out = run_impl(impl, data.q, data.k, data.v, **kw)
    o = (out[0] if isinstance(out, tuple) else out).double()
    err = (o - data.o_ref).flatten(0, 2)[: data.rows]
    finite = torch.isfinite(err).all(dim=-1)
    err = err[finite]
    delta_err = (data.do.double().flatten(0, 2)[: data.rows][finite] * err).sum(dim=-1)
    label = name or (impl if isinstance(impl, str) else getattr(impl, "__name__", type(impl).__name__))
    stats = out[-1].totals() if isinstance(out, tuple) and hasattr(out[-1], "totals") else {}
    # the O errors of one row share its P̄ rounding, so they are correlated: n counts rows (row means)
    return BiasResult(
        impl=label,
        case=data.case.name,
        o=ErrorStats.of(err.mean(dim=-1)),
        delta=ErrorStats.of(delta_err),
        rows=int(finite.sum()),
        nonfinite=int((~finite).sum()),
        extra={"stats": stats} if stats else {},
    )


def measure_bias(
    impl: Impl,
    case: Case | str,
    rows: int = 20_000,
    seed: int = 0,
    device: str | torch.device = "cpu",
    name: str | None = None,
    **kw,
) -> BiasResult:
    """Signed error statistics of `impl` on `rows` fresh rows of `case` vs the float64 reference."""
    return bias_of(impl, Rows.make(case, rows, seed, device), name, **kw)


def bias_table(
    impls: dict[str, Impl],
    cases: Iterable[Case | str],
    rows: int = 20_000,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[BiasResult]:
    """bias_of for every (implementation, case) pair, cases outermost; the same rows for every impl."""
    results = []
    for case in cases:
        data = Rows.make(case, rows, seed, device)
        results += [bias_of(impl, data, name=label) for label, impl in impls.items()]
    return results


def format_table(results: Iterable[BiasResult]) -> str:
    """A compact text table: impl, case, O mean error (t), δ mean error (t), rows."""
    head = ("impl", "case", "O mean err", "t(O)", "δ mean err", "t(δ)", "rows")
    lines = ["{:<24} {:<16} {:>11} {:>8} {:>11} {:>8} {:>7}".format(*head)]
    for r in results:
        lines.append(
            f"{r.impl:<24} {r.case:<16} {r.o.mean:>11.3e} {r.o.t:>8.1f} {r.delta.mean:>11.3e} "
            f"{r.delta.t:>8.1f} {r.rows:>7}"
        )
    return "\n".join(lines)


def with_v_mean(case: Case, v_mean: float) -> Case:
    """The same score rows with another V mean (named '<case>@v<mean>')."""
    return replace(case, name=f"{case.name}@v{v_mean:+g}", v_mean=v_mean)


@dataclass(frozen=True)
class ScaleError:
    """O's relative scale error on long rows with one dominant key (`dominant_key_scale_error`)."""

    top_weight: float  # mean softmax weight of the dominant key
    scale: ErrorStats  # per row: <o, o_ref> / <o_ref, o_ref> - 1 (positive: O too large)


def dominant_key_scale_error(
    impl: Impl,
    score: float,
    position: int,
    seq: int = 1024,
    heads: int = 4,
    head_dim: int = 64,
    seed: int = 0,
    **kw,
) -> ScaleError:
    """Rows of `seq` keys where key `position` scores `score` and the others ~ N(0, 1) (bf16 q, k, v): the
    relative error of each row's O along the float64 O. Rounding the row sum of a tile loop shows here, where
    each row is one tile per 64 keys and the tiles after a dominant key add little to the running sum."""
    if not 0 <= position < seq:
        raise ValueError(f"position must be in [0, {seq}), got {position}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, head_dim, generator=g)
    k = torch.randn(1, heads, seq, head_dim, generator=g)
    q[..., -1], k[..., -1] = 1.0, 0.0  # the last coordinate carries the dominant key's score only
    k[:, :, position] = 0.0
    k[:, :, position, -1] = score * math.sqrt(head_dim)
    v = torch.randn(1, heads, seq, head_dim, generator=g) * 0.5 - 1.5
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    out = run_impl(impl, q, k, v, **kw)
    o = (out[0] if isinstance(out, tuple) else out).double()
    o_ref, lse = reference_attention(q, k, v, causal=False)
    top = torch.exp(scaled_scores(q.double(), k.double()[:, :, position : position + 1])[..., 0] - lse)
    scale = (o * o_ref).sum(-1) / (o_ref * o_ref).sum(-1) - 1
    return ScaleError(top_weight=top.mean().item(), scale=ErrorStats.of(scale))
