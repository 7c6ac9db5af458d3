"""`AttentionSpec`: which attention implementation runs, with its `Precision`, its `Fix` and its options.

Its string form is "backend[/key=value/...]", e.g. "sdpa", "sdpa/sdpa_backend=flash",
"math/dtype=float32" (fp32, autocast off),
"emulated/precision=paper", "triton/precision=fa2:weights=e8m3/fix=2" or "triton/precision=fa2/fix=2:tie=row";
`AttentionSpec.parse(text)` and `str(spec)` are the only conversions, and they round-trip. A backend that
takes a precision gets fa2 when none is named. `BACKENDS` says what each backend accepts; `kwargs()` gives a
call's keywords (precision and fix as spec strings).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from lowprec.attention.fix import Fix, as_fix, one_threshold
from lowprec.attention.precision import INPUT, Precision, Rounding


@dataclass(frozen=True)
class Backend:
    """What one backend accepts: a Precision (and then a Fix and statistics), soft-capping, options typed
    for the spec string, and keywords only a call can pass (tensors, flags)."""

    name: str
    precision: bool = False
    softcap: bool = False
    options: dict[str, type] = field(default_factory=dict)
    call_keywords: tuple[str, ...] = ()

    @property
    def fix(self) -> bool:
        return self.precision

    @property
    def stats(self) -> bool:
        return self.precision


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("reference", call_keywords=("scale",)),
    Backend("math", softcap=True, options={"dtype": str}, call_keywords=("scale",)),
    Backend("sdpa", options={"sdpa_backend": str}, call_keywords=("scale",)),
    Backend("emulated", precision=True,
            options={"block_m": int, "block_n": int, "delta": str, "o_for_delta": str},
            call_keywords=("scale", "generator", "return_stats", "return_lse")),
    Backend("triton", precision=True, options={"block_m": int, "block_n": int, "seed": int},
            call_keywords=("scale", "return_stats", "return_lse")),
)}


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
            if not isinstance(value, caps.options[key]) or isinstance(value, bool):
                kind = caps.options[key].__name__
                raise ValueError(f"attention option {key} must be {'an' if kind == 'int' else 'a'} {kind}, "
                                 f"got {value!r}")
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
            try:
                if key in ("precision", "fix"):
                    fields[key] = Precision.parse(value) if key == "precision" else Fix.parse(value)
                elif key in caps.options:
                    options[key] = caps.options[key](value)
                else:
                    keys = [*(("precision", "fix") if caps.precision else ()), *caps.options]
                    raise ValueError(f"backend {backend!r} has no option {key!r}; it takes {keys or 'none'}")
            except ValueError as exc:
                raise ValueError(f"attention spec {spec!r}: {exc}") from None
        try:
            return cls(backend, options=tuple(options.items()), **fields)
        except ValueError as exc:
            raise ValueError(f"attention spec {spec!r}: {exc}") from None

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
