"""Where flash attention rounds (`Precision`), the dynamic maximum (`Fix`), and the op order they live in.

The forward pass, per query row and key/value tile j = 0, 1, ... (FlashAttention-2 order). Every arithmetic
op is fp32; `dot` means the "exact model": products summed in fp64 and rounded once to fp32. The names in
brackets are the rounding points; each has one function below, and the Triton kernel calls its mirror
image at the same place (triton_kernels.py, `_round`):

    s     = dot(q, k^T) * scale                       [scores]      round_scores
    s     = -inf where masked (causal, beyond N)
    r     = rowmax(s);  shift = r, or the Fix rule                  fix_shift
    m_new = max(m, shift);  alpha = exp(m - m_new)
    p     = exp(s - m_new)
    l     = l * alpha + rowsum(p)                     [rowsum]      round_rowsum
    p_lp  = round(p)                                  [weights]     round_weights (the P̄ entering P̄V)
    pv    = dot(p_lp, v)                              [product]     round_product
    acc   = acc * alpha + pv                          [accumulator] round_accumulator
    m     = m_new
    o     = acc / l                                   [output]      round_output (stored in q's dtype)
    lse   = m + log(l)

Backward, from the saved o and lse. It has no rounding points of its own: P and dS are cast to the input
dtype before their dots, as in FlashAttention-2.
    delta = rowsum(dO * O)
    per tile: p = exp(s - lse); dv += dot(p^T, dO); dp = dot(dO, v^T); ds = p * (dp - delta);
              dk += dot(ds^T, q); dq += dot(ds, k)
    dk, dq *= scale at the end

A point holds a `Rounding`: a lowprec.formats format (or "input" = q's dtype, or None = stays fp32) and a
mode: "nearest", "stochastic", or "ones" (weights only: the values that round to exactly 1.0 in the format
become 1.0, every other value is rounded to the input dtype -- the paper's P̄ = 1 rounding with a wider window
and nothing else, e.g. "fa2:weights=e8m3@ones" rounds P̄ in [1 - 2^-5, 1) up to 1 instead of bf16's
[1 - 2^-9, 1); a Fix with its default tol detects exactly that window). Presets:
  Precision.fa2()   production kernels: P̄ and the output in the input dtype, everything else fp32.
  Precision.paper() the authors' PyTorch reference (github ucker/why-low-precision-training-fails): S, P̄,
                    l, the P̄V result, the running O and the output all in the input dtype; 512 x 512 tiles.
  Precision.fp32()  no rounding anywhere (the high-precision forward).

Short strings (CLIs, configs): "<preset>[:<point>=<spec>,...]", spec "<format>[@<mode>]", format one of
lowprec.formats.FORMATS, "eXmY" (e.g. e8m3: bf16's range with 3 significand bits), "input" or "none";
also "tile=<int>|none". Examples: "fa2", "paper", "fa2:weights=e8m3", "fa2:weights=bf16@stochastic",
"paper:tile=none", "fa2:weights=e8m2@ones". `p.spec` is the shortest such string for p
(`Precision.parse(p.spec) == p`) and `repr(p)` shows it.

The Fix (`Fix`, `fix_shift`): in each tile row (or once per whole row, `tie="row"`), count scores within
`tol` of the row max r. If there is more than one (a repeated or near-repeated maximum), the row's shift
becomes beta*r for r > 0 and 0 for r < 0 (the published rule; r == 0 stays r), so that the largest P̄ is
exp(-(beta-1) r) or exp(r), below 1. Two guards, both counted: the shift never moves more than `max_gap`
above r (else l could underflow to 0 and O become NaN), and `variant="closed"` moves it at least `min_gap`
above r.

The published rule's edge: P̄ = exp(-gap) still rounds to exactly 1.0 when the gap shift - r is below
one_threshold(P̄'s format) (1.955e-3 for bf16), i.e. for r == 0, for 0 < r < 1.955e-3/(beta-1), and for
-1.955e-3 < r < 0. The closed variant (not in the paper) keeps the gap at least 2^-k (k = P̄'s significand
bits), so P̄ <= 1 - 2^-k there. See `Fix` for the defaults and their derivations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from lowprec.formats import FORMATS, Format, round_to

POINTS = ("scores", "weights", "rowsum", "product", "accumulator", "output")
ROUNDING_MODES = ("nearest", "stochastic", "ones")
INPUT = "input"
_DTYPE_FORMATS = {torch.bfloat16: FORMATS["bf16"], torch.float16: FORMATS["fp16"]}


def parse_format(name: str) -> Format | str | None:
    """A FORMATS name, "eXmY", "input" or "none" -> Format, "input" or None (fp32 = no rounding)."""
    if name in ("none", "fp32"):
        return None
    if name == INPUT:
        return INPUT
    match = re.fullmatch(r"e(\d)m(\d+)", name)
    if match:
        return Format(int(match[1]), int(match[2]), name=name)
    if name in FORMATS:
        return FORMATS[name]
    raise ValueError(
        f"format must be one of {sorted(FORMATS)}, 'eXmY' (e.g. 'e8m3'), 'input' or 'none'; got {name!r}"
    )


@dataclass(frozen=True)
class Rounding:
    """One rounding point: `fmt` (a Format, "input" = q's dtype, None = stays fp32) and `mode`."""

    fmt: Format | str | None = None
    mode: str = "nearest"

    def __post_init__(self) -> None:
        fmt = self.fmt
        if isinstance(fmt, str):
            fmt = parse_format(fmt)
        elif fmt is not None and not isinstance(fmt, Format):
            raise ValueError(f"fmt must be a Format, a format name, 'input' or None, got {fmt!r}")
        if isinstance(fmt, Format) and (fmt.exp_bits, fmt.man_bits, fmt.no_inf) == (8, 23, False):
            fmt = None  # rounding fp32 to fp32 is no rounding
        object.__setattr__(self, "fmt", fmt)
        if self.mode not in ROUNDING_MODES:
            raise ValueError(f"mode must be one of {ROUNDING_MODES}, got {self.mode!r}")

    @classmethod
    def parse(cls, spec: str) -> Rounding:
        """ "<format>[@<mode>]", e.g. "bf16", "e8m3@stochastic", "e8m3@ones", "input", "none"."""
        name, _, mode = spec.partition("@")
        return cls(name, mode or "nearest")

    def resolve(self, dtype: torch.dtype) -> Format | None:
        """The concrete format for inputs of `dtype` (None: no rounding)."""
        if self.fmt == INPUT:
            return _DTYPE_FORMATS.get(dtype)
        return self.fmt

    def __str__(self) -> str:
        if self.fmt is None or isinstance(self.fmt, str):
            name = self.fmt or "none"
        else:
            name = self.fmt.name or f"e{self.fmt.exp_bits}m{self.fmt.man_bits}"
        return name if self.mode == "nearest" else f"{name}@{self.mode}"


def _as_rounding(value: Rounding | str | Format | None) -> Rounding:
    if isinstance(value, Rounding):
        return value
    if isinstance(value, str):
        return Rounding.parse(value)
    return Rounding(value)


@dataclass(frozen=True)
class Precision:
    """The rounding applied at each point of the forward pass (module docstring); `tile` fixes the tile
    size (None: the caller's block sizes). Points take a Rounding, a spec string ("bf16@stochastic") or a
    Format."""

    scores: Rounding = field(default_factory=Rounding)
    weights: Rounding = field(default_factory=Rounding)
    rowsum: Rounding = field(default_factory=Rounding)
    product: Rounding = field(default_factory=Rounding)
    accumulator: Rounding = field(default_factory=Rounding)
    output: Rounding = field(default_factory=Rounding)
    tile: int | None = None

    def __post_init__(self) -> None:
        for name in POINTS:
            object.__setattr__(self, name, _as_rounding(getattr(self, name)))
        for name in POINTS:
            rounding = getattr(self, name)
            if rounding.mode == "ones" and (name != "weights" or not isinstance(rounding.fmt, Format)):
                raise ValueError(f"rounding mode 'ones' applies to the weights point with a concrete format "
                                 f"(e.g. weights='e8m3@ones'), got {name}={rounding}")
        if self.tile is not None and not (isinstance(self.tile, int) and self.tile >= 16):
            raise ValueError(f"tile must be None or an int >= 16, got {self.tile!r}")

    @classmethod
    def fa2(cls) -> Precision:
        return cls(weights=INPUT, output=INPUT)

    @classmethod
    def paper(cls) -> Precision:
        return cls(*(INPUT,) * len(POINTS), tile=512)

    @classmethod
    def fp32(cls) -> Precision:
        return cls()

    @classmethod
    def parse(cls, spec: str | Precision) -> Precision:
        """Build from a short string (module docstring), e.g. "fa2:weights=e8m3"; a Precision passes."""
        if isinstance(spec, Precision):
            return spec
        if not isinstance(spec, str):
            raise ValueError(
                f"precision must be a Precision or a string like 'fa2:weights=e8m3', got {spec!r}"
            )
        base, _, overrides = spec.partition(":")
        if base not in PRESETS:
            raise ValueError(f"precision preset must be one of {sorted(PRESETS)}, got {base!r} (in {spec!r})")
        changes: dict[str, object] = {}
        for item in filter(None, overrides.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in (*POINTS, "tile"):
                raise ValueError(
                    f"precision override must be <point>=<spec> with point one of {POINTS} or "
                    f"tile=<int>|none, got {item!r} (in {spec!r})"
                )
            if key == "tile":
                if not (value == "none" or value.isdigit()):
                    raise ValueError(f"precision tile must be an int or 'none', got {value!r} (in {spec!r})")
                changes[key] = None if value == "none" else int(value)
            else:
                changes[key] = Rounding.parse(value)
        return replace(PRESETS[base](), **changes)

    @property
    def spec(self) -> str:
        """The shortest "<preset>[:overrides]" string that parses back to this Precision."""
        candidates = []
        for name, make in PRESETS.items():
            preset = make()
            diffs = [f"{point}={getattr(self, point)}" for point in POINTS
                     if getattr(self, point) != getattr(preset, point)]
            if self.tile != preset.tile:
                diffs.append(f"tile={self.tile or 'none'}")
            candidates.append(name + (":" + ",".join(diffs) if diffs else ""))
        return min(candidates, key=len)

    def __repr__(self) -> str:
        return f"Precision({self.spec!r})"

    def stochastic(self) -> bool:
        return any(getattr(self, name).mode == "stochastic" for name in POINTS)


PRESETS = {"fa2": Precision.fa2, "paper": Precision.paper, "fp32": Precision.fp32}


def fits(fmt: Format | None, dtype: torch.dtype) -> bool:
    """Whether every value of `fmt` (None = fp32) is exactly representable in `dtype`."""
    if dtype in (torch.float32, torch.float64):
        return True
    if fmt is None:
        return False
    host = _DTYPE_FORMATS[dtype]
    wider_range = fmt.exp_bits > host.exp_bits or (fmt.exp_bits == host.exp_bits and fmt.no_inf)
    return fmt.man_bits <= host.man_bits and not wider_range


def dot_dtype(precision: Precision, dtype: torch.dtype) -> torch.dtype:
    """Dtype of P̄ and V in the P̄V dot: the input dtype when P̄'s format fits in it, else fp32."""
    return dtype if fits(precision.weights.resolve(dtype), dtype) else torch.float32


Generator = torch.Generator | None  # random bits for stochastic rounding (None: torch's default generator)


def _round(x: torch.Tensor, rounding: Rounding, dtype: torch.dtype, generator: Generator):
    fmt = rounding.resolve(dtype)
    if fmt is None:
        return x
    if rounding.mode == "ones":
        host = _DTYPE_FORMATS.get(dtype)
        rest = x if host is None else round_to(x, host)
        return torch.where(round_to(x, fmt) == 1.0, torch.ones_like(x), rest)
    return round_to(x, fmt, rounding.mode, generator)


def round_scores(s: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """S = dot(q, k^T) * scale, before masking (paper: bf16 S from a bf16 einsum; fa2: fp32)."""
    return _round(s, p.scores, dtype, gen)


def round_weights(pbar: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """P̄ = exp(S - m) as it enters the P̄V dot (fa2: cast to the input dtype, so P̄ > 1 - 2^-9 becomes
    1.0)."""
    return _round(pbar, p.weights, dtype, gen)


def round_rowsum(l: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """The running row sum l after each tile's update."""
    return _round(l, p.rowsum, dtype, gen)


def round_product(pv: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """The tile's P̄V result (fp32 accumulation inside the dot, then this rounding: the paper's (P̄V)_lp)."""
    return _round(pv, p.product, dtype, gen)


def round_accumulator(acc: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """The running output acc = acc * alpha + pv after each tile."""
    return _round(acc, p.accumulator, dtype, gen)


def round_output(o: torch.Tensor, p: Precision, dtype: torch.dtype, gen: Generator = None):
    """O = acc / l, the value stored (and used for delta = rowsum(dO * O) in the backward)."""
    return _round(o, p.output, dtype, gen)


# ----------------------------------------------------------------------------------------------- the Fix

LN2 = math.log(2.0)
FIX_VARIANTS = ("published", "closed")
TIE_SCOPES = ("tile", "row")


def one_threshold(fmt: Format | None) -> float:
    """Gap g such that exp(-x) rounds (to nearest) to exactly 1.0 in `fmt` for every 0 <= x < g.

    With k stored significand bits the largest value below 1 is 1 - 2^-(k+1); the midpoint 1 - 2^-(k+2)
    rounds to 1.0 (ties to even), so P̄ >= 1 - 2^-(k+2), i.e. s >= m - g with g = -ln(1 - 2^-(k+2)), gives P̄
    == 1.0. bf16 (k = 7): g = -ln(1 - 2^-9) = 1.9550e-3. fp16: 2.442e-4. e8m3: 3.17e-2. None (fp32): 2^-25.
    """
    k = 23 if fmt is None else fmt.man_bits
    return -math.log1p(-(2.0 ** -(k + 2)))


@dataclass(frozen=True)
class Fix:
    """The paper's dynamic maximum ("stabilized flash attention"), with two guards.

    beta: the shift factor for a positive repeated max (paper: 2; v2 of the paper and the first code: 7).
      Must be finite and > 1.
    tol: scores s >= r - tol count as ties of the row max r. None (default) derives it from P̄'s format:
      `one_threshold(fmt)`, the largest distance below the max whose P̄ still rounds to exactly 1.0 --
      for bf16 P̄ that is -ln(1 - 2^-9) = 1.955e-3 (any fp32 score within ~2^-9 of the max gives P̄ = 1.0),
      so every score that would produce P̄ = 1.0 is counted. The paper's code uses 1e-3, which misses ties in
      (1e-3, 1.955e-3). tol = 0 tests exact ties only (paper v2). Must be >= 0.
    tie: "tile" (published: ties counted within each key tile, so the result depends on the tile width) or
      "row" (ties counted over the whole row: one extra pass over the keys computing each row's top two
      scores, i.e. one more q k^T product in the forward, about +50% forward matmul work or ~+14% of a
      forward+backward step; the backward is unchanged).
    variant: "published" (shift = beta*r for r > 0, 0 for r < 0, r for r == 0) or "closed" (the same, but the
      shift is at least `min_gap` above r). The published rule leaves P̄ == 1.0 when the gap shift - r is
      below one_threshold(fmt): r == 0 (gap 0), 0 < r < one_threshold/(beta-1), or -one_threshold < r < 0.
    min_gap: the closed variant's smallest gap; None = 2^-k for P̄'s k significand bits (exp(-2^-k) rounds to
      1 - 2^-k, two grid steps below 1; bf16: 2^-7).
    max_gap: the largest gap ever applied (else exp(-(beta-1) r) underflows and l = 0 -> NaN; with beta = 2
      that happens for r > ~87 in fp32/bf16). Beyond it the shift falls back to r + max_gap and the row is
      counted as a fallback. None = half the natural-log range of P̄'s normal numbers, -ln(min_normal)/2:
      43.7 for bf16/fp32-range formats, 4.85 for fp16, so that near-max P̄ stay normal numbers (a GPU's exp
      flushes subnormals to 0).
    """

    beta: float = 2.0
    tol: float | None = None
    tie: str = "tile"
    variant: str = "published"
    min_gap: float | None = None
    max_gap: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta > 1):
            raise ValueError(f"beta must be a finite number > 1 (the paper uses 2 to 8), got {self.beta!r}")
        for name in ("tol", "min_gap", "max_gap"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")
        if self.max_gap is not None and self.max_gap <= 0:
            raise ValueError(f"max_gap must be None or > 0, got {self.max_gap!r}")
        if self.tie not in TIE_SCOPES:
            raise ValueError(f"tie must be one of {TIE_SCOPES}, got {self.tie!r}")
        if self.variant not in FIX_VARIANTS:
            raise ValueError(f"variant must be one of {FIX_VARIANTS}, got {self.variant!r}")

    def resolve(self, fmt: Format | None) -> FixParams:
        """Numbers for P̄'s format `fmt` (None = fp32)."""
        k = 23 if fmt is None else fmt.man_bits
        emin = -126 if fmt is None else fmt.emin
        tol = one_threshold(fmt) if self.tol is None else float(self.tol)
        min_gap = 2.0**-k if self.min_gap is None else float(self.min_gap)
        if self.variant == "published":
            min_gap = 0.0
        max_gap = -emin * LN2 / 2 if self.max_gap is None else float(self.max_gap)
        return FixParams(_f32(self.beta), _f32(tol), _f32(min_gap), _f32(max_gap), self.tie == "row")


@dataclass(frozen=True)
class FixParams:
    """A Fix resolved to fp32 numbers for one P̄ format (what the emulator and the kernel receive)."""

    beta: float
    tol: float
    min_gap: float
    max_gap: float
    whole_row: bool


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def as_fix(fix: Fix | float | bool | None) -> Fix | None:
    """None/False -> no fix; True -> Fix(); a number -> Fix(beta=number); a Fix passes through."""
    if fix is None or fix is False:
        return None
    if fix is True:
        return Fix()
    if isinstance(fix, Fix):
        return fix
    if isinstance(fix, (int, float)):
        return Fix(beta=float(fix))
    raise ValueError(f"fix must be None, a Fix, True or a beta value, got {fix!r}")


def fix_shift(r: torch.Tensor, ties: torch.Tensor, fp: FixParams) -> tuple[torch.Tensor, ...]:
    """The row shift for row maxima `r` (fp32) given `ties` (bool: more than one score within tol of r).

    Returns (shift, triggered, fallback). fp32 ops in this exact order (the kernel's `_fix_shift` mirrors
    them):
      want  = beta*r if r > 0, 0 if r < 0, r if r == 0     (published rule)
      want  = r + min_gap  where want - r < min_gap         (closed variant; min_gap = 0 when published)
      want  = r + max_gap  where want - r > max_gap         (guard against l = 0; counted as a fallback)
      shift = want where triggered (ties and r finite), else r
    """
    triggered = ties & (r > float("-inf"))
    beta = torch.tensor(fp.beta, dtype=torch.float32)
    want = torch.where(r > 0, r * beta, torch.where(r < 0, torch.zeros_like(r), r))
    want = torch.where(want - r < fp.min_gap, r + fp.min_gap, want)
    fallback = triggered & (want - r > fp.max_gap)
    want = torch.where(want - r > fp.max_gap, r + fp.max_gap, want)
    return torch.where(triggered, want, r), triggered, fallback


# ---------------------------------------------------------------------------------------------- statistics

STAT_NAMES = ("pbar_ones", "tie_tiles", "near_tie_tiles", "fix_triggers", "fallbacks")


@dataclass
class AttentionStats:
    """Per-row counters (int32 tensors, shape (batch, heads, seq)) from one forward pass.

    pbar_ones: P̄ entries equal to 1.0 after the weights rounding (the ones that enter P̄V unshrunk).
    tie_tiles: tiles in which the row max occurs more than once exactly.
    near_tie_tiles: tiles with more than one score within tol of the row max (tol: the Fix's, or its default).
    fix_triggers: tiles (tie="row": rows) where the Fix's rule fired (ties and a finite max); fallbacks: of
    those, the ones where max_gap capped the shift.
    """

    pbar_ones: torch.Tensor
    tie_tiles: torch.Tensor
    near_tie_tiles: torch.Tensor
    fix_triggers: torch.Tensor
    fallbacks: torch.Tensor

    def totals(self) -> dict[str, int]:
        """Sums over all rows, plus the number of rows with any trigger / any P̄ == 1."""
        out = {name: int(getattr(self, name).sum()) for name in STAT_NAMES}
        out["rows"] = int(self.pbar_ones.numel())
        out["rows_triggered"] = int((self.fix_triggers > 0).sum())
        out["rows_with_ones"] = int((self.pbar_ones > 0).sum())
        return out


__all__ = [
    "POINTS",
    "INPUT",
    "Rounding",
    "Precision",
    "Fix",
    "FixParams",
    "AttentionStats",
    "as_fix",
    "dot_dtype",
    "fits",
    "fix_shift",
    "one_threshold",
    "parse_format",
    "round_scores",
    "round_weights",
    "round_rowsum",
    "round_product",
    "round_accumulator",
    "round_output",
]
