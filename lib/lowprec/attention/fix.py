"""The paper's dynamic maximum (`Fix`, `fix_shift`), tie detection (`ties`) and the per-row counters
(`AttentionStats`).

Where more than one score lies within `tol` of a row's maximum r, the Fix shifts the row by beta*r (r > 0) or
0 (r < 0) instead of r, so that its largest P̄ stays below 1; "2" or "2:tie=row" is its string form
(`Fix.spec`, `Fix.parse`). The rule, its guards and its edge: the book's appendix "Methods and record
formats".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.formats import Format

LN2 = math.log(2.0)
FIX_VARIANTS = ("published", "closed")
TIE_SCOPES = ("tile", "row")
FIX_FIELDS = ("tol", "tie", "variant", "min_gap", "max_gap")  # besides beta, in the order `Fix.spec` writes


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
    """The paper's dynamic maximum ("stabilized flash attention"), with two guards (the appendix derives the
    defaults).

    beta: the shift factor for a positive repeated max (paper: 2), finite and > 1.
    tol: scores s >= r - tol count as ties of the row max r; None: `one_threshold` of P̄'s format, so that
      every score whose P̄ rounds to exactly 1.0 counts (bf16: 1.955e-3); 0: exact ties only.
    tie: "tile" (ties counted within each key tile, as published) or "row" (over the whole row).
    variant: "published" or "closed" (the shift at least `min_gap` above r).
    min_gap: the closed variant's smallest gap; None: 2^-k for P̄'s k significand bits.
    max_gap: the largest gap applied (beyond it the shift is r + max_gap, counted as a fallback); None: half
      the natural-log range of P̄'s normal numbers (bf16: 43.7).
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

    @classmethod
    def parse(cls, text: str) -> Fix | None:
        """ "<beta>[:<field>=<value>,...]", "true" (Fix()) or "none"/"false" (no fix): the `spec` strings,
        e.g. "2", "7", "2:tie=row", "2:tol=0.001,variant=closed"."""
        if not isinstance(text, str):
            raise ValueError(f"fix must be a string like '2' or '2:tie=row' (or 'none'), got {text!r}")
        head, _, rest = text.strip().partition(":")
        if head.lower() in ("none", "false") and not rest:
            return None
        changes: dict[str, object] = {}
        if head.lower() != "true":
            try:
                changes["beta"] = float(head)
            except ValueError:
                raise ValueError(f"fix must be 'none', 'true' or '<beta>[:field=value,...]', got {text!r}") \
                    from None
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in FIX_FIELDS:
                raise ValueError(f"fix option must be <field>=<value> with field one of {FIX_FIELDS}, got "
                                 f"{item!r} (in {text!r})")
            if key in changes:
                raise ValueError(f"fix {text!r} sets {key} twice")
            if key in ("tie", "variant"):
                changes[key] = value
            else:
                try:
                    changes[key] = None if value == "none" else float(value)
                except ValueError:
                    raise ValueError(f"fix {key} must be a number or 'none', got {value!r} (in {text!r})") \
                        from None
        return cls(**changes)

    @property
    def spec(self) -> str:
        """The shortest string `Fix.parse` turns back into this Fix: the beta, then the non-default fields."""
        default = Fix()
        extras = [f"{name}={_number(getattr(self, name))}" for name in FIX_FIELDS
                  if getattr(self, name) != getattr(default, name)]
        return _number(self.beta) + (":" + ",".join(extras) if extras else "")

    def resolve(self, fmt: Format | None) -> FixParams:
        """Numbers for P̄'s format `fmt` (None = fp32)."""
        k = 23 if fmt is None else fmt.man_bits
        emin = -126 if fmt is None else fmt.emin
        tol = one_threshold(fmt) if self.tol is None else float(self.tol)
        min_gap = 2.0**-k if self.min_gap is None else float(self.min_gap)
        if self.variant == "published":
            min_gap = 0.0
        max_gap = -emin * LN2 / 2 if self.max_gap is None else float(self.max_gap)
        return FixParams(f32(self.beta), f32(tol), f32(min_gap), f32(max_gap), self.tie == "row")


@dataclass(frozen=True)
class FixParams:
    """A Fix resolved to fp32 numbers for one P̄ format (what the emulator and the kernel receive)."""

    beta: float
    tol: float
    min_gap: float
    max_gap: float
    whole_row: bool


def _number(x: object) -> str:
    """2.0 -> "2", 2.5 -> "2.5", None -> "none", strings unchanged (shortest exact float text)."""
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() else repr(x)
    return "none" if x is None else str(x)


def f32(x: float) -> float:
    """x rounded to the nearest fp32 value (ties to even, overflow to inf), in plain Python: no torch op, so
    torch.compile traces the option handling around the kernels without a graph break."""
    if not math.isfinite(x) or x == 0:
        return float(x)
    step = math.ldexp(1.0, max(math.frexp(x)[1] - 24, -149))  # the fp32 grid step at |x|
    y = round(x / step) * step  # round() ties to even; x / step is exact
    return y if abs(y) < 2.0**128 else math.copysign(math.inf, x)


def as_fix(fix: Fix | float | bool | str | None) -> Fix | None:
    """None/False -> no fix; True -> Fix(); a number -> Fix(beta=number); a string -> Fix.parse; a Fix
    passes through."""
    if fix is None or fix is False:
        return None
    if fix is True:
        return Fix()
    if isinstance(fix, Fix):
        return fix
    if isinstance(fix, str):
        return Fix.parse(fix)
    if isinstance(fix, (int, float)):
        return Fix(beta=float(fix))
    raise ValueError(f"fix must be None, a Fix, True, a beta value or a string like '2:tie=row', got {fix!r}")


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


def ties(s: torch.Tensor, r: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row booleans for scores `s` (..., cols) with row maxima `r` (...): the maximum occurs more than
    once exactly; more than one score lies within `tol` of it (P̄ = exp(s - r) rounds to 1.0 for those when
    tol = one_threshold(P̄'s format)). Rows with r = -inf (all masked) have neither."""
    finite = r > float("-inf")
    exact = ((s == r[..., None]).sum(-1) > 1) & finite
    near = ((s >= (r - tol)[..., None]).sum(-1) > 1) & finite
    return exact, near


# ---------------------------------------------------------------------------------------------- statistics

STAT_NAMES = ("pbar_ones", "tie_tiles", "near_tie_tiles", "fix_triggers", "fix_fallbacks")


@dataclass
class AttentionStats:
    """Per-row counters (int32 tensors, shape (batch, heads, seq)) from one forward pass.

    pbar_ones: P̄ entries equal to 1.0 after the weights rounding (the ones that enter P̄V unshrunk).
    tie_tiles: tiles in which the row max occurs more than once exactly.
    near_tie_tiles: tiles with more than one score within tol of the row max (tol: the Fix's, or its default).
    fix_triggers: tiles (tie="row": rows) where the Fix's rule fired (ties and a finite max); fix_fallbacks:
    of those, the ones where max_gap capped the shift.
    """

    pbar_ones: torch.Tensor
    tie_tiles: torch.Tensor
    near_tie_tiles: torch.Tensor
    fix_triggers: torch.Tensor
    fix_fallbacks: torch.Tensor

    def totals(self) -> dict[str, int]:
        """Sums over all rows, plus the number of rows with any trigger / any P̄ == 1."""
        out = {name: int(getattr(self, name).sum()) for name in STAT_NAMES}
        out["rows"] = int(self.pbar_ones.numel())
        out["rows_triggered"] = int((self.fix_triggers > 0).sum())
        out["rows_with_ones"] = int((self.pbar_ones > 0).sum())
        return out
