"""`lowprec bench attention`: forward, backward and forward+backward TFLOP/s of the attention kernels.

    lowprec bench attention --out results/attention/bench.json     # one H200
    lowprec bench attention --smoke                                # CPU, seconds
    lowprec bench attention --launch --seq 256,1024 --head-dim 64,128      # host time per call

Our Triton kernel (Fix off and on) and torch SDPA's flash and cuDNN kernels, interleaved in one process over
sequence lengths, head dims and causal masks; the record's rows, FLOP counts and targets: the book's appendix
"Methods and record formats".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lowprec.attention.dispatch import sdpa_attention, sdpa_failure
from lowprec.attention.fix import Fix
from lowprec.checks import option
from tqdm import tqdm

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
    parser.add_argument("--head-dim", type=int_list, default=[64, 128, 256], help="head dimensions")
    parser.add_argument("--rounds", type=option(int, 1), default=3,
                        help="interleaved timing rounds per configuration, each starting one implementation "
                             "later in the order")
    parser.add_argument("--causal", choices=("false", "true", "both"), default="both")
    parser.add_argument("--tokens", type=option(int, 1), default=16384, help="batch x seq per configuration")
    parser.add_argument(
        "--budget",
        type=option(float, 0, low_open=True),
        default=900.0,
        help="seconds; no new (seq, head dim, causal) configuration starts after this (results are kept)",
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="time the host's share instead: a loop of calls, plain against replayed from a CUDA graph",
    )
    parser.add_argument("--tma", action="store_true",
                        help="also our kernel with its streamed tiles through tensor descriptors "
                             "(triton-tma, triton+fix-tma; flash.tma_loads), interleaved with the rest")
    parser.add_argument("--aa", action="store_true",
                        help="also our plain kernel a second time (triton-again, listed last; every round "
                             "rotates the order): "
                             "its time over triton's is the timing method's own spread (A/A)")
    parser.add_argument("--smoke", action="store_true", help="one tiny case on the CPU (Triton interpreter)")


def flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, mode: str) -> float:
    """FlashAttention's FLOP count for one call of `mode` ("fwd", "bwd" or "fwd+bwd")."""
    forward = 4.0 * batch * heads * seq * seq * head_dim
    return forward * FLOP_FACTOR[mode] / (2 if causal else 1)


def inside(context: Callable[[], contextlib.AbstractContextManager], fn: Callable) -> Callable:
    """`fn`, each call run inside a fresh `context()` (e.g. flash.tma_loads, flash.direct_launch)."""

    def call(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    return call


def implementations(device: str, tma: bool = False, aa: bool = False
                    ) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> f(q, k, v, causal) for every runnable implementation, name -> why it was skipped); `tma`
    adds our kernel with its streamed tiles through tensor descriptors, Fix off and on; `aa` our plain kernel
    again, listed last (`triton-again`: the same launches as `triton`, timed apart from them)."""
    from lowprec.attention.flash import flash_attention, tma_loads  # triton only when benchmarking

    impls: dict[str, Callable] = {
        "triton": flash_attention,
        "triton+fix": functools.partial(flash_attention, fix=Fix()),
    }
    if tma:
        impls |= {f"{name}-tma": inside(tma_loads, fn) for name, fn in impls.items()}
    skipped = {}
    x = torch.randn(1, 2, 128, 64, device=device, dtype=torch.bfloat16)
    for backend in ("flash", "cudnn"):
        fn = functools.partial(sdpa_attention, sdpa_backend=backend)
        try:
            fn(x, x, x, causal=True)
            impls[f"sdpa-{backend}"] = fn
        except Exception as exc:
            skipped[f"sdpa-{backend}"] = sdpa_failure(exc)
    if aa:
        impls["triton-again"] = flash_attention
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


def bench_inputs(batch: int, heads: int, seq: int, head_dim: int, device: str) -> tuple[torch.Tensor, ...]:
    """Seeded bf16 (q, k, v, dO), each (batch, heads, seq, head_dim); q, k and v require grad."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    return q, k, v, torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)


def calls_of(fn: Callable, batch: int, heads: int, seq: int, head_dim: int, causal: bool, device: str,
             inputs: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[dict[str, Callable], list[torch.Tensor]]:
    """The fwd, bwd and fwd+bwd calls of fn on `inputs` (default: new `bench_inputs`), and the tensors
    whose grads to reset."""
    q, k, v, do = inputs or bench_inputs(batch, heads, seq, head_dim, device)

    def forward():
        with torch.no_grad():
            return fn(q, k, v, causal=causal)

    o = fn(q, k, v, causal=causal)
    calls = {
        "fwd": forward,
        "bwd": lambda: o.backward(do, retain_graph=True),
        "fwd+bwd": lambda: fn(q, k, v, causal=causal).backward(do),
    }
    return calls, [q, k, v]


def bench_config(impls: dict[str, Callable], batch: int, heads: int, seq: int, head_dim: int, causal: bool,
                 device: str, rounds: int) -> dict[str, dict]:
    """Per implementation: milliseconds (median over `rounds` interleaved rounds) and TFLOP/s of fwd, bwd and
    fwd+bwd, or the error that stopped it. Every implementation runs on the same input tensors; round r times
    them from the (r mod n)-th on, so that over n rounds each takes every place in the order once."""
    out: dict[str, dict] = {}
    prepared = {}
    inputs = bench_inputs(batch, heads, seq, head_dim, device)
    for name, fn in impls.items():
        try:
            prepared[name] = calls_of(fn, batch, heads, seq, head_dim, causal, device, inputs)
            out[name] = {}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    for mode in MODES:
        times: dict[str, list[float]] = {name: [] for name in prepared}
        names = list(prepared)
        for r in range(rounds if names else 0):
            for name in names[r % len(names):] + names[:r % len(names)]:
                calls, grads = prepared[name]
                if "error" in out[name]:
                    continue
                try:
                    times[name].append(time_ms(calls[mode], device, grads))
                except Exception as exc:
                    out[name] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
        for name, ms_list in times.items():
            if "error" not in out[name] and ms_list:
                ms = sorted(ms_list)[len(ms_list) // 2]
                out[name][f"{mode}_ms"] = ms
                work = flops(batch, heads, seq, head_dim, causal, mode)
                out[name][f"{mode}_tflops"] = work / (ms * 1e-3) / 1e12
    return out


LAUNCH_CALLS = 50


def loop_us(fn: Callable[[], object], device: str, grads: list[torch.Tensor], graph: bool,
            calls: int) -> float:
    """Median over 3 repeats of microseconds per call of `calls` calls of fn, timed around the whole loop;
    with `graph`, the loop is captured once in a CUDA graph and replayed."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def loop():
        for _ in range(calls):
            fn()

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for g in grads:
            g.grad = None
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            loop()
        loop = cuda_graph.replay
    loop()
    times = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        loop()
        sync()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return sorted(times)[1]


def launch_overhead(impls: dict[str, Callable], batch: int, heads: int, seq: int, head_dim: int, causal: bool,
                    device: str, calls: int = LAUNCH_CALLS) -> list[dict]:
    """Per implementation and mode (fwd, fwd+bwd): microseconds per call plain and from a CUDA graph (GPU
    only), their ratio, or the error that stopped either."""
    rows = []
    for name, fn in impls.items():
        fns, grads = calls_of(fn, batch, heads, seq, head_dim, causal, device)
        for mode in ("fwd", "fwd+bwd"):
            row = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim,
                   "causal": causal, "mode": mode, "calls": calls}
            for key, graph in (("plain_us", False), ("graph_us", True)):
                if graph and device != "cuda":
                    continue
                try:
                    row[key] = round(loop_us(fns[mode], device, grads, graph, calls), 2)
                except Exception as exc:
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if "plain_us" in row and "graph_us" in row:
                row["plain_over_graph"] = round(row["plain_us"] / row["graph_us"], 3)
            rows.append(row)
    return rows


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
    impls, skipped = implementations(device, args.tma, args.aa)
    from lowprec.attention.flash import autotuned_configs

    record = {
        "provenance": provenance(),
        "args": vars(args),
        "device": device,
        "skipped": skipped,
        "results": [],
    }
    start = time.perf_counter()
    shapes = tqdm([(seq, head_dim, causal) for seq in seqs for head_dim in dims for causal in causals],
                  desc="shapes", mininterval=10, disable=args.smoke)  # minutes on a GPU: show how far it is
    if args.launch:
        record["launch"] = []
        for seq, head_dim, causal in shapes:
            batch, heads = max(1, tokens // seq), max(1, hidden // head_dim)
            record["launch"] += launch_overhead(impls, batch, heads, seq, head_dim, causal, device,
                                                2 if args.smoke else LAUNCH_CALLS)
        record["seconds"] = round(time.perf_counter() - start, 1)
        if args.out:
            write_json(args.out, record)
        print(launch_table(record["launch"]))
        return 0
    for seq, head_dim, causal in shapes:
        batch, heads = max(1, tokens // seq), max(1, hidden // head_dim)
        over_budget = time.perf_counter() - start > args.budget  # all implementations or none
        measured = {} if over_budget else bench_config(impls, batch, heads, seq, head_dim, causal, device,
                                                       1 if args.smoke else args.rounds)
        for name in impls:
            row = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim}
            row["causal"] = causal
            row |= measured.get(name, {"skipped": "time budget"})
            record["results"].append(row)
        if args.out:
            write_json(args.out, record)
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["configs"] = autotuned_configs()
    record["fix_overhead"] = fix_overhead(record["results"])
    record["targets"] = targets(record["fix_overhead"])
    if args.out:
        write_json(args.out, record)
    print(table(record))
    return 0


def fix_readings(plain: dict, fixed: dict) -> dict:
    """Two readings of the Fix's cost from one configuration's `<mode>_ms` without and with it that need no
    difference of backwards (its backward kernels take no Fix: the same launches either way):
    `fwd+bwd_fix_from_fwd`, the forward's extra time over forward+backward time, and `bwd_fix_ratio`, the
    same backward timed with over without (1 but for the timing method's spread)."""
    return {"fwd+bwd_fix_from_fwd": round((fixed["fwd_ms"] - plain["fwd_ms"]) / plain["fwd+bwd_ms"], 4),
            "bwd_fix_ratio": round(fixed["bwd_ms"] / plain["bwd_ms"], 4)}


def fix_overhead(results: list[dict], key: str = "impl", plain: str = "triton", fixed: str = "triton+fix"
                 ) -> list[dict]:
    """Per configuration: time(fixed) / time(plain) - 1, TFLOP/s(triton) / TFLOP/s(sdpa-flash) and
    (with --tma) time(triton) / time(triton-tma), the same with the Fix, for fwd and fwd+bwd (where both
    were measured); with --aa time(triton-again) / time(triton) for every mode (`<mode>_aa_ratio`);
    `fix_readings` where every mode of plain and fixed was measured. Rows name their implementation under
    `key` (a cures record's `cost`: key="cure", plain="none (fa2)", fixed="Fix")."""
    rows: dict[tuple, dict] = {}
    for r in results:
        if "fwd_ms" in r:
            rows.setdefault((r["seq"], r["head_dim"], r["causal"]), {})[r[key]] = r
    out = []
    for (seq, head_dim, causal), impls in rows.items():
        entry = {"seq": seq, "head_dim": head_dim, "causal": causal}
        for mode in ("fwd", "fwd+bwd"):
            if plain in impls and fixed in impls:
                entry[f"{mode}_fix_overhead"] = round(
                    impls[fixed][f"{mode}_ms"] / impls[plain][f"{mode}_ms"] - 1, 4
                )
            if "triton" in impls and "sdpa-flash" in impls:
                entry[f"{mode}_vs_flash"] = round(
                    impls["sdpa-flash"][f"{mode}_ms"] / impls["triton"][f"{mode}_ms"], 3
                )
            for name in ("triton", "triton+fix"):  # with --tma: the descriptors' speed-up
                if name in impls and f"{name}-tma" in impls:
                    entry[f"{mode}_tma_speedup{name.removeprefix('triton')}"] = round(
                        impls[name][f"{mode}_ms"] / impls[f"{name}-tma"][f"{mode}_ms"], 3
                    )
        first, again = impls.get("triton", {}), impls.get("triton-again", {})
        for mode in MODES:  # with --aa: the timing method's own spread, every mode
            if f"{mode}_ms" in again and f"{mode}_ms" in first:
                entry[f"{mode}_aa_ratio"] = round(again[f"{mode}_ms"] / first[f"{mode}_ms"], 4)
        if all(f"{mode}_ms" in impls.get(name, {}) for mode in MODES for name in (plain, fixed)):
            entry |= fix_readings(impls[plain], impls[fixed])
        out.append(entry)
    return out


def record_fix_overhead(path: Path) -> list[dict]:
    """`fix_overhead` of a committed record: a benchmark's `results` (our kernel with and without the Fix)
    or a cures record's `cost` (`none (fa2)` and `Fix`)."""
    record = json.loads(Path(path).read_text())
    if "cost" in record:
        return fix_overhead(record["cost"], "cure", "none (fa2)", "Fix")
    return fix_overhead(record["results"])


def targets(overhead: list[dict], seqs: tuple[int, ...] = (4096, 8192, 16384), head_dim: int = 128) -> dict:
    """The drop-in targets over `overhead`'s configurations with seq in `seqs` at `head_dim` (causal and
    not): geometric means of our speed relative to SDPA flash, the worst Fix overhead (both readings of
    forward+backward: the times' ratio and `fwd+bwd_fix_from_fwd`), and whether each target holds (None where
    nothing was measured)."""
    rows = [e for e in overhead if e["seq"] in seqs and e["head_dim"] == head_dim]

    def geomean(key: str) -> float | None:
        values = [e[key] for e in rows if key in e]
        return round(math.exp(sum(map(math.log, values)) / len(values)), 3) if values else None

    def worst(key: str) -> float | None:
        values = [e[key] for e in rows if key in e]
        return max(values) if values else None

    out = {"fwd+bwd_vs_flash": geomean("fwd+bwd_vs_flash"), "fwd_vs_flash": geomean("fwd_vs_flash"),
           "fwd+bwd_fix_overhead": worst("fwd+bwd_fix_overhead"),
           "fwd+bwd_fix_from_fwd": worst("fwd+bwd_fix_from_fwd"),
           "fwd_fix_overhead": worst("fwd_fix_overhead")}
    limits = {"fwd+bwd_vs_flash": (1.1, 1), "fwd_vs_flash": (1.0, 1), "fwd+bwd_fix_overhead": (0.02, -1),
              "fwd+bwd_fix_from_fwd": (0.02, -1), "fwd_fix_overhead": (0.05, -1)}
    out["met"] = {key: None if out[key] is None else (out[key] - bound) * sign >= 0
                  for key, (bound, sign) in limits.items()}
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
        tma = [f"{mode} Fix {switch} {e[key]:.3f}x" for mode in ("fwd", "fwd+bwd")
               for switch, key in (("off", f"{mode}_tma_speedup"), ("on", f"{mode}_tma_speedup+fix"))
               if key in e]
        lines.append(f"{e['seq']:>6} {e['head_dim']:>4} {e['causal']!s:>6}  {' '.join(cells)}"
                     + (f"   descriptors: {', '.join(tma)}" if tma else ""))
    if "targets" in record:
        lines.append(f"targets (N 4k-16k, d=128): {record['targets']}")
    lines.append(f"device: {record['provenance'].get('device')}; {record.get('seconds')} s")
    return "\n".join(lines)


def launch_table(rows: list[dict]) -> str:
    """One line per (configuration, implementation, mode): microseconds per call plain and from a graph."""
    lines = [f"{'seq':>6} {'D':>4} {'causal':>6} {'impl':<12} {'mode':<8} {'plain':>9} {'graph':>9}  us/call"]
    for r in rows:
        cells = [f"{r[k]:>9.1f}" if k in r else f"{'-':>9}" for k in ("plain_us", "graph_us")]
        note = r.get("plain_us_error") or r.get("graph_us_error") or ""
        ratio = f"{r['plain_over_graph']:.2f}x" if "plain_over_graph" in r else ""
        lines.append(f"{r['seq']:>6} {r['head_dim']:>4} {r['causal']!s:>6} {r['impl']:<12} {r['mode']:<8} "
                     f"{' '.join(cells)}  {ratio} {note}")
    return "\n".join(lines)
