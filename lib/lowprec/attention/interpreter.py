"""Make Triton's CPU interpreter (TRITON_INTERPRET=1) compute what the emulator computes, bit for bit.

`apply()` patches Triton 3.6.0's interpreter builder: dots, exp, exp2, log, log2 and fp32 sums computed in
fp64 and rounded once to fp32, fp32 -> bf16 casts rounded to nearest even (the interpreter truncates), bf16 ->
fp32 casts exact (it gets subnormals wrong), and tensor `__index__` for numpy >= 2.3. It checks that the
internals it replaces are there; `active()` says whether it is applied; triton_mode.py applies it under
TRITON_INTERPRET=1 only. Why each replacement: the book's appendix "Methods and record formats".

It also spares the interpreter work that changes nothing (`_fast_patch_lang`): the stock interpreter patches
triton.language again (every builtin wrapped anew, found by `inspect.getmembers`) at every call of a
`@triton.jit` helper inside a kernel, once per program and loop step: a third of the time of an interpreted
kernel. Within one launch, a helper whose language modules the launch has already patched is run under
those patches, which are the ones the call would set again.
"""

from __future__ import annotations

import warnings

import numpy as np

PINNED = "3.6.0"
_state = {"applied": False}


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_rne(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded.astype(np.uint16))


def active() -> bool:
    """Whether `apply()` has patched the interpreter in this process."""
    return _state["applied"]


def apply() -> None:
    """Patch the interpreter (idempotent). Raises RuntimeError if its internals are not the expected ones."""
    if _state["applied"]:
        return
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder, reduce_ops = interp.InterpreterBuilder, interp.ReduceOps
    needed = [
        (builder, name)
        for name in ("create_dot", "cast_impl", "create_exp", "create_exp2", "create_log", "create_log2")
    ] + [(reduce_ops, "sum"), (interp, "_patch_lang_tensor"), (interp, "_patch_lang"),
         (interp.GridExecutor, "__call__")]
    missing = [name for owner, name in needed if not hasattr(owner, name)]
    if missing or not hasattr(interp, "TensorHandle"):
        raise RuntimeError(
            f"triton {triton.__version__}'s interpreter lacks {missing or ['TensorHandle']}; the "
            f"lowprec interpreter patch was written for triton {PINNED} (pip install triton=={PINNED})"
        )
    if triton.__version__ != PINNED:
        warnings.warn(
            f"lowprec's interpreter patch was verified on triton {PINNED}, this is {triton.__version__}; "
            "tests/test_flash_kernel.py checks whether it still works",
            stacklevel=2,
        )
    handle = interp.TensorHandle
    cast_impl, original_sum, patch_tensor = builder.cast_impl, reduce_ops.sum, interp._patch_lang_tensor

    def to_f64(h) -> np.ndarray:
        data = _bf16_to_f32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data
        return data.astype(np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32:
            raise TypeError(f"the interpreter patch supports fp32 dot accumulators only, got {d.data.dtype}")
        exact = np.matmul(to_f64(a), to_f64(b)).astype(np.float32)
        return handle(exact + d.data, d.dtype.scalar)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(_f32_to_bf16_rne(src.data), tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:  # exact, subnormals too
            return handle(_bf16_to_f32(src.data), tl.float32)
        return cast_impl(self, src, dst_type)

    def in_fp64(fn, original):
        def op(self, arg):
            if arg.data.dtype == np.float32:
                return handle(fn(arg.data.astype(np.float64)).astype(np.float32), arg.dtype.scalar)
            return original(self, arg)

        return op

    def reduce_sum(self, input):
        data = input.handle.data
        if data.dtype != np.float32:
            return original_sum(self, input)
        total = np.sum(data.astype(np.float64), axis=self.axis, keepdims=self.keep_dims).astype(np.float32)
        return self.to_tensor(total, input.dtype)

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    builder.create_dot = create_dot
    builder.cast_impl = cast
    for name, fn in (
        ("create_exp", np.exp),
        ("create_exp2", np.exp2),
        ("create_log", np.log),
        ("create_log2", np.log2),
    ):
        setattr(builder, name, in_fp64(fn, getattr(builder, name)))
    reduce_ops.sum = reduce_sum
    _fast_patch_lang(interp, tl)
    _state["applied"] = True


class _NoPatch:
    """The scope of a patch that was already in place: nothing of its own to restore."""

    @staticmethod
    def restore() -> None:
        pass


def _fast_patch_lang(interp, tl) -> None:
    """`interp._patch_lang(fn)` (patch the triton.language modules that fn's globals name, for the
    interpreter; the stock one runs at every launch, which restores its patches when the launch ends, and at
    every call of a jit'd helper, whose patches are never restored) skipped within a launch for a helper whose
    modules that launch has already patched: a second patch finds every builtin already replaced and sets the
    rest (`_patch_lang_tensor`, `_patch_lang_core`) to functions that do the same, and until the launch ends
    nothing removes them."""
    patch_lang, grid_call = interp._patch_lang, interp.GridExecutor.__call__
    launch: dict[str, set[int] | None] = {"patched": None}  # ids of the modules patched in this launch

    def modules(fn) -> set[int]:  # what the stock one patches: tl and tl.core, where fn's globals name them
        return {id(m) for m in (tl, tl.core) if any(v is m for v in fn.__globals__.values())}

    def fast_patch_lang(fn):
        patched = launch["patched"]
        wanted = modules(fn) if patched is not None else set()
        if wanted and wanted <= patched:
            return _NoPatch
        scope = patch_lang(fn)  # raises as the stock one does when fn names no triton.language
        if patched is not None:
            patched |= wanted
        return scope

    def call(self, *args, **kwargs):
        outer, launch["patched"] = launch["patched"], set()  # a launch patches afresh (its first call)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["patched"] = outer

    interp._patch_lang = fast_patch_lang
    interp.GridExecutor.__call__ = call
