"""Where flash attention rounds (`Precision`): six rounding points in FlashAttention-2's op order, one torch
function each, from round_scores to round_output.

A point holds a `Rounding`: a lowprec.formats format ("input" = q's dtype, None = stays fp32) and a mode,
"nearest", "stochastic" or "ones" (weights only). `PLACEMENTS` names the settings of all six: fa2 (production
kernels), paper (the authors' all-bf16 reference), fp32 (no rounding) and consistent (fa2 with the row sum of
the rounded P̄). Short strings: "<placement>[:<point>=<format>[@<mode>],...]" with tile=<int>|none and
norm=exact|rounded, e.g. "fa2:weights=e8m3"; `Precision.parse(p.spec) == p`. The op order, the norm option
and the backward: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from lowprec.formats import FORMATS, Format, round_to

POINTS = ("scores", "weights", "rowsum", "product", "accumulator", "output")
ROUNDING_MODES = ("nearest", "stochastic", "ones")
NORMS = ("exact", "rounded")  # what the row sum l adds up: the fp32 P, or the rounded P̄
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
    """The rounding applied at each point of the forward pass (the appendix's op order); `tile` fixes the tile
    size (None: the caller's block sizes); `norm` whether l sums P ("exact") or P̄ ("rounded"). Points take a
    Rounding, a spec string ("bf16@stochastic") or a Format."""

    scores: Rounding = field(default_factory=Rounding)
    weights: Rounding = field(default_factory=Rounding)
    rowsum: Rounding = field(default_factory=Rounding)
    product: Rounding = field(default_factory=Rounding)
    accumulator: Rounding = field(default_factory=Rounding)
    output: Rounding = field(default_factory=Rounding)
    tile: int | None = None
    norm: str = "exact"

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
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")

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
    def consistent(cls) -> Precision:
        return replace(cls.fa2(), norm="rounded")

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
        if base not in PLACEMENTS:
            raise ValueError(f"precision placement must be one of {sorted(PLACEMENTS)}, got {base!r} "
                             f"(in {spec!r})")
        changes: dict[str, object] = {}
        for item in filter(None, overrides.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in (*POINTS, "tile", "norm"):
                raise ValueError(
                    f"precision override must be <point>=<spec> with point one of {POINTS}, "
                    f"tile=<int>|none or norm={'|'.join(NORMS)}, got {item!r} (in {spec!r})"
                )
            if key in changes:
                raise ValueError(f"precision {spec!r} sets {key} twice")
            if key == "norm":
                changes[key] = value
            elif key == "tile":
                if not (value == "none" or value.isdigit()):
                    raise ValueError(f"precision tile must be an int or 'none', got {value!r} (in {spec!r})")
                changes[key] = None if value == "none" else int(value)
            else:
                changes[key] = Rounding.parse(value)
        return replace(PLACEMENTS[base](), **changes)

    @property
    def spec(self) -> str:
        """The shortest "<placement>[:overrides]" string that parses back to this Precision."""
        candidates = []
        for name, make in PLACEMENTS.items():
            placement = make()
            diffs = [f"{point}={getattr(self, point)}" for point in POINTS
                     if getattr(self, point) != getattr(placement, point)]
            if self.tile != placement.tile:
                diffs.append(f"tile={self.tile or 'none'}")
            if self.norm != placement.norm:
                diffs.append(f"norm={self.norm}")
            candidates.append(name + (":" + ",".join(diffs) if diffs else ""))
        return min(candidates, key=len)

    def __repr__(self) -> str:
        return f"Precision({self.spec!r})"

    def stochastic(self) -> bool:
        return any(getattr(self, name).mode == "stochastic" for name in POINTS)

    def for_dtype(self, dtype: torch.dtype) -> Precision:
        """The same rounding with every "input" point in `dtype`'s format, so that fp32 tensors holding
        `dtype` values round as `dtype` inputs would (and the output may be asked for in fp32). A "ones" point
        rounds its other values to the tensors' dtype, which fp32 tensors cannot mimic: ValueError."""
        if self.weights.mode == "ones":
            raise ValueError(f"precision {self.spec!r} rounds its weights with mode 'ones', whose other "
                             "values follow the tensors' dtype: it has no fp32 equivalent")
        return replace(self, **{name: Rounding(getattr(self, name).resolve(dtype), getattr(self, name).mode)
                                for name in POINTS})


PLACEMENTS = {"fa2": Precision.fa2, "paper": Precision.paper, "fp32": Precision.fp32,
              "consistent": Precision.consistent}


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


__all__ = [
    "INPUT",
    "NORMS",
    "PLACEMENTS",
    "POINTS",
    "Precision",
    "Rounding",
    "dot_dtype",
    "fits",
    "parse_format",
    "round_accumulator",
    "round_output",
    "round_product",
    "round_rowsum",
    "round_scores",
    "round_weights",
]
