"""`AttentionSpec`: which attention implementation runs, with its `Precision`, its `Fix` and its options.

Its string form is "backend[/key=value/...]", e.g. "sdpa", "sdpa/sdpa_backend=flash",
"math/dtype=float32" (fp32, autocast off),
"emulated/precision=paper", "triton/precision=fa2:weights=e8m3/fix=2" or "triton/precision=fa2/fix=2:tie=row";
`AttentionSpec.parse(text)` and `str(spec)` are the only conversions, and they round-trip. A backend that
takes a precision gets fa2 when none is named. `BACKENDS` says what each backend accepts; `kwargs()` gives a
call's keywords (precision and fix as spec strings).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from lowprec.attention.fix import Fix, as_fix, one_threshold
from lowprec.attention.precision import INPUT, Precision, Rounding

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")  # the kernels torch's SDPA can be pinned to
MATH_DTYPES = ("float32", "float64")
DELTAS = ("dO_O", "dP_P")  # the emulator's backward: delta from dO·O (the kernel's) or from dP·P
O_FOR_DELTA = ("saved", "fp32")
TILES = tuple(2**k for k in range(4, 15))  # the kernel's tile sizes: powers of two from 16
BLOCKS = range(1, 2**31)  # the emulator's tile sizes
SEEDS = range(2**31)  # the kernel's stochastic-rounding seeds

Option = type | tuple | range  # a spec option's values: any of a type, or one of these


@dataclass(frozen=True)
class Backend:
    """What one backend accepts: a Precision (and then a Fix and statistics), soft-capping, the options of
    the spec string with their values (a type, or the values allowed), and keywords only a call can pass
    (tensors, flags)."""

    name: str
    precision: bool = False
    softcap: bool = False
    options: dict[str, Option] = field(default_factory=dict)
    call_keywords: tuple[str, ...] = ()

    @property
    def fix(self) -> bool:
        return self.precision

    @property
    def stats(self) -> bool:
        return self.precision


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("reference", call_keywords=("scale",)),
    Backend("math", softcap=True, options={"dtype": MATH_DTYPES}, call_keywords=("scale",)),
    Backend("sdpa", options={"sdpa_backend": SDPA_BACKENDS}, call_keywords=("scale",)),
    Backend("emulated", precision=True,
            options={"block_m": BLOCKS, "block_n": BLOCKS, "delta": DELTAS, "o_for_delta": O_FOR_DELTA},
            call_keywords=("scale", "generator", "return_stats", "return_lse")),
    Backend("triton", precision=True, options={"block_m": TILES, "block_n": TILES, "seed": SEEDS},
            call_keywords=("scale", "return_stats", "return_lse")),
)}


def _allows(rule: Option, value: object) -> bool:
    """Whether an option's `rule` (a type, or the values allowed) admits `value` (a bool is no int)."""
    if isinstance(rule, type):
        return isinstance(value, rule) and not isinstance(value, bool)
    kind = int if isinstance(rule, range) else type(rule[0])
    return isinstance(value, kind) and not isinstance(value, bool) and value in rule


def _rule_text(rule: Option) -> str:
    if isinstance(rule, type):
        return f"{'an' if rule is int else 'a'} {rule.__name__}"
    if isinstance(rule, range):
        return f"an int in [{rule.start}, {rule.stop})"
    if rule == TILES:
        return f"an int, a power of two in [{TILES[0]}, {TILES[-1]}]"
    return f"one of {rule}"


def _option_value(rule: Option, text: str) -> object:
    """The text of an option's value as its rule's kind (ints for int and range rules and tuples of ints)."""
    kind = rule if isinstance(rule, type) else int if isinstance(rule, range) else type(rule[0])
    try:
        return kind(text)
    except ValueError:
        return text  # refused with the rule in __post_init__


def backends_with(capability: str) -> tuple[str, ...]:
    """Names of the backends with a capability: "precision", "fix", "stats" or "softcap"."""
    return tuple(name for name, b in BACKENDS.items() if getattr(b, capability))


@dataclass(frozen=True)
class AttentionSpec:
    """A backend, its Precision and Fix (backends that take them) and its options (sorted (key, value)
    pairs; a dict is accepted). Construct directly or with `parse`; `str()` gives the string form."""

    backend: str = "sdpa"
    precision: Precision | None = None
    fix: Fix | None = None
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {tuple(BACKENDS)}, got {self.backend!r}")
        caps = BACKENDS[self.backend]
        precision, fix = self.precision, as_fix(self.fix)
        if caps.precision:
            precision = Precision.parse(precision if precision is not None else "fa2")
        elif precision is not None or fix is not None:
            raise ValueError(f"attention backend {self.backend!r} takes no precision or fix; those that do: "
                             f"{backends_with('precision')}")
        options = dict(self.options)
        for key, value in options.items():
            if key not in caps.options:
                raise ValueError(f"attention backend {self.backend!r} has no option {key!r}; it takes "
                                 f"{sorted(caps.options) or 'none'}")
            if not _allows(caps.options[key], value):
                raise ValueError(f"attention option {key} must be {_rule_text(caps.options[key])}, got "
                                 f"{value!r}")
        tiles = caps.options.get("block_m")
        tile = None if precision is None else precision.tile
        if tiles and tile is not None and not _allows(tiles, tile):
            raise ValueError(f"backend {self.backend!r}: precision tile must be {_rule_text(tiles)}, got "
                             f"{tile}")
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "fix", fix)
        object.__setattr__(self, "options", tuple(sorted(options.items())))
        call = dict(self.options)
        if caps.precision:
            call.update(precision=precision.spec, fix=None if fix is None else fix.spec)
        object.__setattr__(self, "_call", call)  # not fields: kwargs() and accepts(), worked out once
        object.__setattr__(self, "_allowed", frozenset({*call, *caps.options, *caps.call_keywords}))

    @classmethod
    def parse(cls, spec: AttentionSpec | str) -> AttentionSpec:
        """The spec of a string "backend[/key=value/...]" (module docstring); a spec passes through."""
        if isinstance(spec, AttentionSpec):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"attention must be an AttentionSpec or a string like 'triton/precision=fa2', "
                             f"got {spec!r}")
        return _parsed(spec)

    def __repr__(self) -> str:
        return f"AttentionSpec({str(self)!r})"

    def __str__(self) -> str:
        items = [self.backend]
        if self.precision is not None:
            items.append(f"precision={self.precision.spec}")
        if self.fix is not None:
            items.append(f"fix={self.fix.spec}")
        items += [f"{key}={value}" for key, value in self.options]
        return "/".join(items)

    @property
    def caps(self) -> Backend:
        return BACKENDS[self.backend]

    def with_fix(self, fix: Fix | float | bool | str | None) -> AttentionSpec:
        """This spec with its Fix replaced (None: removed); ValueError if the backend takes no Fix."""
        if not self.caps.fix:
            raise ValueError(f"attention spec {str(self)!r}: backend {self.backend!r} cannot take a fix; "
                             f"only {backends_with('fix')} can")
        return replace(self, fix=as_fix(fix))

    def near_tie_window(self, dtype: torch.dtype) -> float:
        """Distance below a row's maximum within which P̄ rounds to exactly 1.0, for inputs of `dtype`: from
        the precision's weights format, or (backends without one) from the input dtype's format."""
        weights = self.precision.weights if self.precision is not None else Rounding(INPUT)
        return one_threshold(weights.resolve(dtype))

    def kwargs(self) -> dict[str, object]:
        """The keywords `attention()` passes to the backend's function: the options, and precision and fix as
        their spec strings. Plain values, rendered at construction: torch.compile (2.11) cannot turn a frozen
        dataclass met while tracing back into a constant, which the kernel's option check needs."""
        return dict(self._call)

    def accepts(self, keywords: Iterable[str]) -> None:
        """ValueError naming the keywords a call may not pass to this backend."""
        if not self._allowed.issuperset(keywords):
            unknown = sorted(set(keywords) - self._allowed)
            raise ValueError(f"backend {self.backend!r} does not take {unknown}; it accepts "
                             f"{sorted(self._allowed) or 'none'}")


@functools.lru_cache(maxsize=256)
def _parsed(spec: str) -> AttentionSpec:
    """`AttentionSpec.parse` of a string, kept: a string names one frozen spec, and code that passes the
    string at every call (a model's attention, `attention(q, k, v, "triton/...")`) would otherwise parse it,
    and render its precision back to text, every time. A string that does not parse raises each
    time."""
    backend, *items = spec.strip().split("/")
    if backend not in BACKENDS:
        raise ValueError(f"attention spec {spec!r}: backend must be one of {tuple(BACKENDS)}")
    caps = BACKENDS[backend]
    fields: dict[str, object] = {}
    options: dict[str, object] = {}
    for item in items:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(f"attention spec {spec!r}: options are key=value items separated by '/', "
                             f"got {item!r}")
        if key in fields or key in options:
            raise ValueError(f"attention spec {spec!r} sets {key} twice")
        try:
            if key in ("precision", "fix"):
                fields[key] = Precision.parse(value) if key == "precision" else Fix.parse(value)
            elif key in caps.options:
                options[key] = _option_value(caps.options[key], value)
            else:
                keys = [*(("precision", "fix") if caps.precision else ()), *caps.options]
                raise ValueError(f"backend {backend!r} has no option {key!r}; it takes {keys or 'none'}")
        except ValueError as exc:
            raise ValueError(f"attention spec {spec!r}: {exc}") from None
    try:
        return AttentionSpec(backend, options=tuple(options.items()), **fields)
    except ValueError as exc:
        raise ValueError(f"attention spec {spec!r}: {exc}") from None
