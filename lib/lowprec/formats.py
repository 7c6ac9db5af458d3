"""Binary floating-point formats and exact rounding into them, done with integer operations on fp32 bits.

`round_to(x, fmt, mode)` rounds a float32 tensor to any binary format that fits inside fp32 (up to 8 exponent
and 23 significand bits), with IEEE subnormals; for torch's own dtypes, "nearest" equals torch's cast bit for
bit. Overflow follows IEEE (fp8_e4m3 saturates at 448, as torch's cast does): the book's appendix "Methods and
record formats". `add_trace` explains one rounded addition with exact (Fraction) arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

MODES = ("nearest", "stochastic", "toward_zero")

_SIGN = -(2**31)  # 0x80000000 as an int32
_ABS = 0x7FFFFFFF
_MANT = 0x7FFFFF
_HIDDEN = 0x800000
_RANDOM_BITS = 31  # stochastic rounding draws this many random bits per value


@dataclass(frozen=True)
class Format:
    """A binary float format: 1 sign bit, `exp_bits` exponent bits, `man_bits` stored significand bits.

    IEEE style (subnormals, top exponent reserved for inf/NaN) unless `no_inf`: then the top exponent holds
    finite values too, only the all-ones significand there is NaN, and overflow saturates (torch's
    float8_e4m3fn convention).
    """

    exp_bits: int
    man_bits: int
    no_inf: bool = False
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.exp_bits, int) and 2 <= self.exp_bits <= 8):
            raise ValueError(f"exp_bits must be an int in 2..8 (formats inside fp32), got {self.exp_bits!r}")
        if not (isinstance(self.man_bits, int) and 1 <= self.man_bits <= 23):
            raise ValueError(f"man_bits must be an int in 1..23 (formats inside fp32), got {self.man_bits!r}")
        if self.no_inf and self.exp_bits == 8:
            raise ValueError("no_inf formats need exp_bits <= 7 so that their range fits inside fp32")

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        return 2**self.exp_bits - (1 if self.no_inf else 2) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value (for no_inf formats the all-ones significand is NaN, so one less)."""
        top = 2 ** (self.man_bits + 1) - (2 if self.no_inf else 1)
        return math.ldexp(top, self.emax - self.man_bits)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def eps(self) -> float:
        """Spacing of the grid just above 1.0 (the ulp of 1)."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def overflow(self) -> float:
        """What round-to-nearest gives for values beyond `max`: inf, or max when the format saturates."""
        return self.max if self.no_inf else math.inf

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with exactly this format, or None (e.g. tf32 or a k-bit format)."""
        return _TORCH_DTYPES.get((self.exp_bits, self.man_bits, self.no_inf))

    def __str__(self) -> str:
        label = f"e{self.exp_bits}m{self.man_bits}{'fn' if self.no_inf else ''}"
        return f"{self.name} ({label})" if self.name else label


_TORCH_DTYPES = {
    (8, 7, False): torch.bfloat16,
    (5, 10, False): torch.float16,
    (4, 3, True): torch.float8_e4m3fn,
    (5, 2, False): torch.float8_e5m2,
    (8, 23, False): torch.float32,
}

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(8, 7, name="bf16"),
        Format(5, 10, name="fp16"),
        Format(4, 3, no_inf=True, name="fp8_e4m3"),
        Format(5, 2, name="fp8_e5m2"),
        Format(8, 10, name="tf32"),
        Format(8, 23, name="fp32"),
    )
}


def as_format(fmt: Format | str) -> Format:
    """`fmt` itself, or the format named `fmt` in FORMATS."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"fmt must be a Format or one of {sorted(FORMATS)}, got {fmt!r}")


def _check_tensor(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float32 torch.Tensor (convert with x.float()), got {got}")
    return x


def _grid(a: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For |x| as int32 bits `a`: the 24-bit significand `sig` with value sig * 2**(e-23), the exponent `q`
    of fmt's grid spacing at |x|, and `shift` = q - (e - 23), the number of significand bits fmt drops."""
    biased = a >> 23
    sig = torch.where(biased > 0, (a & _MANT) | _HIDDEN, a)
    e = biased.clamp(min=1) - 127
    q = e.clamp(min=fmt.emin) - fmt.man_bits
    return sig, q, q - e + 23


def _pow2(q: torch.Tensor) -> torch.Tensor:
    """2**q as float32 for integer q in [-149, 127], built from bits (exact, subnormals included)."""
    normal = (q.clamp(min=-126) + 127) << 23
    return torch.where(q >= -126, normal, 1 << (q + 149).clamp(0, 22)).view(torch.float32)


def ulp(x: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """Spacing of fmt's grid at |x| (float32): 2**(exponent(x) - man_bits); min_subnormal if subnormal."""
    fmt = as_format(fmt)
    _, q, _ = _grid(_check_tensor(x).view(torch.int32) & _ABS, fmt)
    return _pow2(q)


def round_to(
    x: torch.Tensor, fmt: Format | str, mode: str = "nearest", generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round float32 `x` to `fmt`; returns float32 values exactly representable in fmt (same shape, device).

    mode: "nearest" (ties to even, as IEEE and torch casts), "stochastic" (up with probability
    distance-to-lower / spacing, so unbiased; random bits from `generator`, a torch.Generator on x's device,
    or torch's default one; probabilities are resolved to 2**-31), or "toward_zero" (truncation).
    Overflow follows the format's convention (module docstring). Works on the int32 view of x, no loops.
    """
    fmt = as_format(fmt)
    x = _check_tensor(x)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and generator.device.type != x.device.type:
        raise ValueError(f"generator must be on x's device ({x.device}), got one on {generator.device}")

    u = x.view(torch.int32)
    if mode == "nearest" and fmt.exp_bits == 8 and not fmt.no_inf and 1 <= fmt.man_bits < 23:
        return _nearest_fp32_exponent(x, u, 23 - fmt.man_bits)
    sig, q, shift = _grid(u & _ABS, fmt)
    kept = shift.clamp(max=25)  # sig < 2**24, so dropping 25 bits already drops every bit
    n = sig >> kept  # whole grid steps, rounded toward zero
    rem = sig - (n << kept)  # what was dropped, in units of 2**(q - kept)
    if mode == "nearest":
        twice, step = rem << 1, 1 << kept
        n = n + ((twice > step) | ((twice == step) & (n & 1 == 1))).int()
    elif mode == "stochastic":  # up iff r / 2**31 < rem / 2**shift, i.e. with probability rem / 2**shift
        frac = (rem << (_RANDOM_BITS - kept)) >> (shift - kept).clamp(max=_RANDOM_BITS)
        r = torch.randint(
            0, 2**_RANDOM_BITS, x.shape, generator=generator, device=x.device, dtype=torch.int32
        )
        n = n + (r < frac).int()

    value = n.float() * _pow2(q)  # exact: n has at most man_bits + 2 bits and fmt fits inside fp32
    beyond = fmt.max if mode == "toward_zero" else fmt.overflow
    value = torch.where(value > fmt.max, beyond, value)
    signed = (value.view(torch.int32) | (u & _SIGN)).view(torch.float32)
    return torch.where(torch.isnan(x), x, signed)


def _nearest_fp32_exponent(x: torch.Tensor, u: torch.Tensor, dropped: int) -> torch.Tensor:
    """round_to(x, fmt, "nearest") for a format with fp32's exponent (8 bits, IEEE: bf16, tf32, the k-bit
    formats) and 1 to 22 significand bits: the same grid as fp32's with the low `dropped` bits of every
    pattern cleared (subnormals included), so adding half a step less one, plus the kept last bit (ties to
    even), to the bits of |x| and clearing them rounds to nearest even; a carry moves into the exponent as
    the value moves into the next binade, and past fmt.max to inf, as round_to's general path gives (7
    tensor operations instead of about 35; tests/test_formats.py checks bf16 against torch's cast and the
    others against its float64 reference, ties and binade edges included)."""
    low = 1 << dropped
    rounded = ((u + ((u >> dropped) & 1) + (low // 2 - 1)) & -low).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


@dataclass(frozen=True)
class Bits:
    """The fields of a value in a format; `tail` holds bits beyond the format's significand, if any."""

    sign: int
    exponent: int
    significand: int
    fmt: Format
    tail: str = ""

    def __str__(self) -> str:
        text = f"{self.sign} {self.exponent:0{self.fmt.exp_bits}b} {self.significand:0{self.fmt.man_bits}b}"
        return f"{text} | {self.tail[0]} {self.tail[1:]}".rstrip() if self.tail else text


def _split(value: Fraction, fmt: Format) -> tuple[int, int, Fraction]:
    """|value| = (steps + frac) * 2**q on fmt's grid at |value|: returns (q, steps, frac), 0 <= frac < 1."""
    mag = abs(value)
    e = fmt.emin if mag == 0 else max(_floor_log2(mag), fmt.emin)
    q = e - fmt.man_bits
    scaled = mag / Fraction(2) ** q
    steps = math.floor(scaled)
    return q, steps, scaled - steps


def _floor_log2(mag: Fraction) -> int:
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    return e if Fraction(2) ** e <= mag else e - 1


def _fields(value: Fraction, fmt: Format, tail_bits: int = 0) -> Bits:
    """Fields of a finite exact value; bits below fmt's grid go to `tail` (at least `tail_bits` of them)."""
    q, steps, frac = _split(value, fmt)
    if steps >= 2 ** (fmt.man_bits + 1):
        raise ValueError(f"value {float(value)!r} is beyond the range of {fmt}")
    tail = ""
    while frac or len(tail) < tail_bits:
        frac *= 2
        tail += str(int(frac >= 1))
        frac -= int(frac >= 1)
    exponent = q + fmt.man_bits + fmt.bias if steps >> fmt.man_bits else 0
    return Bits(int(value < 0), exponent, steps & (2**fmt.man_bits - 1), fmt, tail)


def bits(x: float | torch.Tensor, fmt: Format | str) -> Bits:
    """Sign, biased exponent and stored significand of `x`, which must be exactly representable in fmt
    (round it with round_to first); e.g. str(bits(-4.71875, "bf16")) == "1 10000001 0010111"."""
    fmt = as_format(fmt)
    value = float(x.item() if isinstance(x, torch.Tensor) else x)
    top = 2**fmt.exp_bits - 1
    if math.isnan(value) or (math.isinf(value) and fmt.no_inf):
        return Bits(0, top, 2**fmt.man_bits - 1 if fmt.no_inf else 2 ** (fmt.man_bits - 1), fmt)
    if math.isinf(value):
        return Bits(int(value < 0), top, 0, fmt)
    out = _fields(Fraction(value), fmt)
    if out.tail or abs(value) > fmt.max:
        raise ValueError(f"x={value!r} is not representable in {fmt}; round it first with round_to(x, fmt)")
    return out


def _neighbours(value: Fraction, fmt: Format) -> tuple[float, float, Fraction, bool]:
    """fmt's two values around an exact value: (toward zero, away from zero, fraction of the step from the
    first to the value, whether nearest-even picks the one away from zero), overflow applied as round_to."""
    q, steps, frac = _split(value, fmt)
    step = Fraction(2) ** q

    def signed(mag: Fraction, over: float) -> float:
        return math.copysign(over if mag > fmt.max else float(mag), value)

    nearest_away = frac > Fraction(1, 2) or (frac == Fraction(1, 2) and steps % 2 == 1)
    return signed(steps * step, fmt.max), signed((steps + 1) * step, fmt.overflow), frac, nearest_away


def _round_exact(value: Fraction, fmt: Format) -> float:
    """Round an exact value to fmt, nearest-even."""
    toward, away, _, nearest_away = _neighbours(value, fmt)
    return away if nearest_away else toward


@dataclass(frozen=True)
class AddTrace:
    """One rounded addition: `running + b` rounded to fmt, with `running = fp32(a + residual)`.

    `exact_bits` shows the exact sum in fmt's fields, then after " | " the guard bit and the bits below it.

    `rounded` is round-to-nearest-even; `toward` and `away` are the neighbours toward / away from zero
    (toward_zero picks `toward`; stochastic picks `away` with probability `p_away`, so its mean is exact).
    """

    a: float
    b: float
    residual: float
    running: float
    exact: Fraction
    exact_bits: Bits
    guard: int
    sticky: int
    carry: bool
    rounded: float
    rounded_bits: Bits
    toward: float
    away: float
    p_away: Fraction
    fmt: Format

    @property
    def error(self) -> float:
        """rounded - exact, as a float (exact in float64 for every case this module can produce)."""
        return float(Fraction(self.rounded) - self.exact)

    @property
    def direction(self) -> str:
        """Where round-to-nearest-even went, in words."""
        if not (self.guard or self.sticky):
            return "nowhere: the sum is exact"
        side = "away from zero" if self.rounded == self.away else "toward zero"
        return f"to even on a tie ({side})" if self.guard and not self.sticky else side

    def __str__(self) -> str:
        fmt = self.fmt.name or str(self.fmt)
        carry = "carry into the next binade; " if self.carry else ""
        return "\n".join(
            [
                f"running = fp32(a + residual) = {self.running!r}",
                f"b                            = {self.b!r}",
                f"exact sum                    = {float(self.exact)!r}",
                f"exact sum in {fmt:<15} {self.exact_bits}",
                f"guard {self.guard}, sticky {self.sticky}: {carry}nearest rounds {self.direction}",
                f"rounded                      = {self.rounded!r}   ({self.rounded_bits})",
                f"error                        = {self.error!r}",
            ]
        )


def add_trace(a: float, b: float, fmt: Format | str, residual: float = 0.0) -> AddTrace:
    """Explain the rounding of one addition into `fmt`, with exact (Fraction) arithmetic.

    Models a fp32 running sum as in flash attention's P̄V accumulation: the running sum is
    `running = fp32(a + residual)` (`residual` stands for the small terms already accumulated; that sum is
    rounded to fp32 first, nearest-even), then `running + b` is formed exactly and rounded once to fmt.
    Reports the guard bit (first bit below fmt's grid at the sum) and the sticky bit (OR of all bits below
    it), and `carry`: whether the sum moved into a higher binade than both operands (two large same-sign
    terms). Raises ValueError if an input is not finite or a sum overflows.
    """
    fmt = as_format(fmt)
    for label, v in (("a", a), ("b", b), ("residual", residual)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{label} must be a finite float, got {v!r}")
    running = _round_exact(Fraction(a) + Fraction(residual), FORMATS["fp32"])
    if not math.isfinite(running):
        raise ValueError(f"a + residual = {float(a) + float(residual)!r} overflows fp32")
    exact = Fraction(running) + Fraction(b)
    if abs(exact) >= 2 ** (fmt.emax + 1):
        raise ValueError(f"a + residual + b = {float(exact)!r} is beyond the range of {fmt} (max {fmt.max})")
    toward, away, p_away, nearest_away = _neighbours(exact, fmt)
    rounded = away if nearest_away else toward
    operands = [_floor_log2(abs(Fraction(v))) for v in (running, b) if v != 0]
    carry = bool(exact) and bool(operands) and _floor_log2(abs(exact)) > max(operands)
    return AddTrace(
        a=float(a),
        b=float(b),
        residual=float(residual),
        running=running,
        exact=exact,
        exact_bits=_fields(exact, fmt, tail_bits=23 - fmt.man_bits),
        guard=int(p_away >= Fraction(1, 2)),
        sticky=int(p_away not in (0, Fraction(1, 2))),
        carry=carry,
        rounded=rounded,
        rounded_bits=bits(rounded, fmt),
        toward=toward,
        away=away,
        p_away=p_away,
        fmt=fmt,
    )
