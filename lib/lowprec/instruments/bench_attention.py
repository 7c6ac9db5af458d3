"""`lowprec bench attention`: forward, backward and forward+backward TFLOP/s of the attention kernels.

Implementations, bf16, all in one process: our Triton kernel (Fix off and on, autotuned), torch SDPA's flash
and cuDNN backends (skipped, with the reason, where they cannot run). FLOPs are counted as FlashAttention
does: forward 4·B·H·N²·D (two matmuls), backward 2.5x that (five matmuls, as FA2's benchmark counts),
halved for causal. Total tokens per configuration are constant (B·N = --tokens, 16k by default, with
H·D = 2048), as in the FlashAttention papers. Times are medians of triton.testing.do_bench on a GPU; with
--smoke on a CPU one tiny case runs once through Triton's interpreter, only to check the code path.

Rows of our kernel record the autotuner's picks (`configs`); `fix_overhead` lists, per configuration, how much
slower the Fix makes our kernel (time ratio - 1, fwd and fwd+bwd) and our speed relative to SDPA's flash.

    lowprec bench attention --out results/attention/bench.json     # ~4 min on one H200 (compiles included)
    lowprec bench attention --smoke                                # CPU, seconds
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lowprec.attention.dispatch import sdpa_attention
from lowprec.attention.fix import Fix

HIDDEN = 2048  # heads x head_dim, as in the FlashAttention-2 paper's benchmarks
MODES = ("fwd", "bwd", "fwd+bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    parser.add_argument(
        "--seq", type=int_list, default=[1024, 2048, 4096, 8192, 16384], help="sequence lengths"
    )
    parser.add_argument("--head-dim", type=int_list, default=[64, 128], help="head dimensions")
    parser.add_argument("--causal", choices=("false", "true", "both"), default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seq per configuration")
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds; no new (seq, head dim, causal) configuration starts after this (results are kept)",
    )
    parser.add_argument("--smoke", action="store_true", help="one tiny case on the CPU (Triton interpreter)")


def flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, mode: str) -> float:
    """FlashAttention's FLOP count for one call of `mode` ("fwd", "bwd" or "fwd+bwd")."""
    forward = 4.0 * batch * heads * seq * seq * head_dim
    return forward * FLOP_FACTOR[mode] / (2 if causal else 1)


def implementations(device: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> f(q, k, v, causal) for every runnable implementation, name -> why it was skipped)."""
    from lowprec.attention.flash import flash_attention  # triton only when benchmarking

    impls: dict[str, Callable] = {
        "triton": flash_attention,
        "triton+fix": functools.partial(flash_attention, fix=Fix()),
    }
    skipped = {}
    x = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16)
    for backend in ("flash", "cudnn"):
        fn = functools.partial(sdpa_attention, sdpa_backend=backend)
        try:
            fn(x, x, x, causal=True)
            impls[f"sdpa-{backend}"] = fn
        except Exception as exc:  # torch raises RuntimeError (with warnings) when a backend cannot run
            skipped[f"sdpa-{backend}"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return impls, skipped


def time_ms(fn: Callable[[], object], device: str, grads: list[torch.Tensor]) -> float:
    """Median milliseconds of fn(): triton.testing.do_bench on a GPU; on CPU, one call after a warm-up."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grads, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_one(
    fn: Callable, batch: int, heads: int, seq: int, head_dim: int, causal: bool, device: str
) -> dict:
    """Milliseconds and TFLOP/s of fn for forward, backward and forward+backward."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    grads = [q, k, v]

    def forward():
        with torch.no_grad():
            return fn(q, k, v, causal=causal)

    o = fn(q, k, v, causal=causal)
    calls = {
        "fwd": forward,
        "bwd": lambda: o.backward(do, retain_graph=True),
        "fwd+bwd": lambda: fn(q, k, v, causal=causal).backward(do),
    }
    out = {}
    for mode, call in calls.items():
        ms = time_ms(call, device, grads)
        out[f"{mode}_ms"] = ms
        out[f"{mode}_tflops"] = flops(batch, heads, seq, head_dim, causal, mode) / (ms * 1e-3) / 1e12
    return out


def run(args: argparse.Namespace) -> int:
    from lowprec.runs import provenance, write_json  # records layer, imported only by this command

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise ValueError("no CUDA device; use --smoke for a CPU code-path check")
    seqs, dims = ([64], [16]) if args.smoke else (args.seq, args.head_dim)
    tokens = 128 if args.smoke else args.tokens
    hidden = 32 if args.smoke else HIDDEN
    causals = {"false": [False], "true": [True], "both": [False, True]}[args.causal]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    impls, skipped = implementations(device)
    from lowprec.attention.flash import autotuned_configs

    record = {
        "provenance": provenance(),
        "args": vars(args),
        "device": device,
        "skipped": skipped,
        "results": [],
    }
    start = time.perf_counter()
    for seq in seqs:
        for head_dim in dims:
            for causal in causals:
                batch, heads = max(1, tokens // seq), max(1, hidden // head_dim)
                over_budget = time.perf_counter() - start > args.budget  # all implementations or none
                for name, fn in impls.items():
                    row = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim}
                    row["causal"] = causal
                    if over_budget:
                        row["skipped"] = "time budget"
                    else:
                        try:
                            row |= bench_one(fn, batch, heads, seq, head_dim, causal, device)
                            if name.startswith("triton"):
                                row["configs"] = autotuned_configs()
                        except Exception as exc:
                            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                    record["results"].append(row)
                    if args.out:
                        write_json(args.out, record)
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["fix_overhead"] = fix_overhead(record["results"])
    if args.out:
        write_json(args.out, record)
    print(table(record))
    return 0


def fix_overhead(results: list[dict]) -> list[dict]:
    """Per configuration: time(triton+fix) / time(triton) - 1 and TFLOP/s(triton) / TFLOP/s(sdpa-flash),
    for fwd and fwd+bwd (where both were measured)."""
    rows: dict[tuple, dict] = {}
    for r in results:
        if "fwd_ms" in r:
            rows.setdefault((r["seq"], r["head_dim"], r["causal"]), {})[r["impl"]] = r
    out = []
    for (seq, head_dim, causal), impls in rows.items():
        entry = {"seq": seq, "head_dim": head_dim, "causal": causal}
        for mode in ("fwd", "fwd+bwd"):
            if "triton" in impls and "triton+fix" in impls:
                entry[f"{mode}_fix_overhead"] = round(
                    impls["triton+fix"][f"{mode}_ms"] / impls["triton"][f"{mode}_ms"] - 1, 4
                )
            if "triton" in impls and "sdpa-flash" in impls:
                entry[f"{mode}_vs_flash"] = round(
                    impls["sdpa-flash"][f"{mode}_ms"] / impls["triton"][f"{mode}_ms"], 3
                )
        out.append(entry)
    return out


def table(record: dict) -> str:
    """One line per (configuration, implementation): fwd / bwd / fwd+bwd TFLOP/s."""
    lines = [f"{'seq':>6} {'D':>4} {'causal':>6} {'impl':<12} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8}  TFLOP/s"]
    for r in record["results"]:
        cells = [f"{r[f'{m}_tflops']:>8.4g}" if f"{m}_tflops" in r else f"{'-':>8}" for m in MODES]
        note = r.get("skipped") or r.get("error") or ""
        lines.append(
            f"{r['seq']:>6} {r['head_dim']:>4} {r['causal']!s:>6} {r['impl']:<12} {' '.join(cells)}  {note}"
        )
    for name, why in record["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    lines.append(
        f"{'seq':>6} {'D':>4} {'causal':>6}  Fix overhead fwd, fwd+bwd   speed vs sdpa-flash fwd, fwd+bwd"
    )
    for e in record.get("fix_overhead", []):
        cells = [
            f"{e[k]:>+8.1%}" if k in e else f"{'-':>8}" for k in ("fwd_fix_overhead", "fwd+bwd_fix_overhead")
        ]
        cells += [f"{e[k]:>8.3f}x" if k in e else f"{'-':>9}" for k in ("fwd_vs_flash", "fwd+bwd_vs_flash")]
        lines.append(f"{e['seq']:>6} {e['head_dim']:>4} {e['causal']!s:>6}  {' '.join(cells)}")
    lines.append(f"device: {record['provenance'].get('device')}; {record.get('seconds')} s")
    return "\n".join(lines)

