"""`lowprec bench overhead`: our kernel's host time per eager call against SDPA's at small shapes, and a small
GPT's step time with either, eager and (`--compile MODE`) under torch.compile.

    lowprec bench overhead --out results/attention/overhead.json      # one H200
    lowprec bench overhead --compile reduce-overhead --batch 32 --heads 6 --seq 256   # + compiled steps
    lowprec bench overhead --smoke                                    # CPU (Triton interpreter), seconds

Calls: SDPA (torch's default choice), our kernel with the Fix off and on and (`triton-jit`) with the Fix off
launched through Triton's JITFunction.run (flash.direct_launch(False)), fwd and fwd+bwd, over batch, heads
and sequence lengths at head dim 64, causal. Steps: lowprec.model's GPT at gpu-6l's shape (6 layers, 6 heads
of 64) at context 256 and batch 32, eager, bf16 autocast, AdamW, random tokens; with `--compile MODE` the same
steps again with the model under torch.compile(mode=MODE) for SDPA and our kernel, Fix off and on
("reduce-overhead": CUDA graphs; on the CPU with --smoke the aot_eager backend, which checks the path only).
The record's rows and targets: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import itertools
import math
import pstats
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lowprec.attention import attention
from lowprec.attention.flash import direct_launch
from lowprec.configs import get_config
from lowprec.instruments.bench_attention import calls_of, inside, int_list, loop_us
from lowprec.model import GPT
from tqdm import tqdm

IMPLS = {"sdpa": "sdpa", "triton": "triton/precision=fa2", "triton+fix": "triton/precision=fa2/fix=2",
         "triton-jit": "triton/precision=fa2"}
THROUGH_JIT = ("triton-jit",)  # run inside flash.direct_launch(False): the A/B of Triton's per-call Python
COMPILED = ("sdpa", "triton", "triton+fix")  # the steps timed again under torch.compile (no host path to A/B)
CALLS = 50
STEP = (32, 256)  # the GPT steps' batch and context
TARGETS = {"host_vs_sdpa": 1.2, "step_vs_sdpa": 1.05}  # at most
PATH_HEAD = r"^.*?/(?=lowprec/|torch/|triton/)"  # a profiled function's file, shown from its package on
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # torch.compile's modes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    parser.add_argument("--batch", type=int_list, default=[1, 8, 32], help="batch sizes of the calls")
    parser.add_argument("--heads", type=int_list, default=[6, 12], help="head counts of the calls")
    parser.add_argument("--seq", type=int_list, default=[128, 256, 512], help="sequence lengths of the calls")
    parser.add_argument("--steps", type=int, default=50, help="timed GPT steps per backend and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of steps per backend")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the host path (cProfile) of each call at the first shape, and "
                             "torch's ops of one fwd+bwd call, ours and SDPA's (torch.profiler)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default=None, metavar="MODE",
                        help="also time the GPT steps under torch.compile(mode=MODE): "
                             + ", ".join(COMPILE_MODES))


def host_us(fn: Callable[[], object], device: str, calls: int) -> float:
    """Median over 3 repeats of the host's microseconds per call: the wall time of each call alone, the
    device left to run behind (no sync inside the loop), so the queue's waits are not counted."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    repeats = []
    for _ in range(3):
        sync()
        spent = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            spent += time.perf_counter() - start
        sync()
        repeats.append(spent * 1e6 / calls)
    return sorted(repeats)[1]


def launched(fn: Callable[[], object], name: str) -> Callable[[], object]:
    """`fn`, inside flash.direct_launch(False) for the THROUGH_JIT implementations."""
    return inside(lambda: direct_launch(False), fn) if name in THROUGH_JIT else fn


def call_rows(batch: int, heads: int, seq: int, device: str, calls: int) -> list[dict]:
    """Per implementation and mode (fwd, fwd+bwd): host microseconds per call and wall microseconds per call
    of a loop (host and device together), or the error that stopped them."""
    rows = []
    for name, spec in IMPLS.items():
        try:
            fn = functools.partial(attention, backend=spec)
            fns, grads = calls_of(fn, batch, heads, seq, 64, True, device)
            fns = {mode: launched(call, name) for mode, call in fns.items()}
        except Exception as exc:
            rows.append({"impl": name, "batch": batch, "heads": heads, "seq": seq, "error": repr(exc)[:300]})
            continue
        for mode in ("fwd", "fwd+bwd"):
            row = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "mode": mode, "calls": calls}
            try:
                row["host_us"] = round(host_us(fns[mode], device, calls), 2)
                row["wall_us"] = round(loop_us(fns[mode], device, grads, False, calls), 2)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            rows.append(row)
    return rows


def op_profile(fn: Callable[[], object], device: str, calls: int = 1, top: int = 12, by: str = "host"
               ) -> list[dict]:
    """The `top` torch ops (autograd nodes included) of `calls` calls of `fn` (after one untimed call) by own
    `by` ("host" or "device") time, from torch.profiler, which sees every thread (the autograd engine runs a
    GPU backward on its own): name, calls, own host and device microseconds, each per call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    key = {"host": "self_cpu_time_total", "device": "self_device_time_total"}[by]
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:top]
    return [{"name": e.key, "calls": round(e.count / calls, 2),
             "self_host_us": round(e.self_cpu_time_total / calls, 1),
             "self_device_us": round(e.self_device_time_total / calls, 1)} for e in rows]


def op_lines(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """`op_profile`'s rows as text, one line each: the `keys` columns (microseconds), calls and the op."""
    return ["  " + " ".join(f"{r[key]:>10,.1f}" for key in keys) + f"  x{r['calls']:<5} {r['name'][:80]}"
            for r in rows]


def host_profile(fn: Callable[[], object], calls: int, top: int = 20) -> list[dict]:
    """The `top` functions by own host time over `calls` calls of `fn` (cProfile, after one untimed call):
    "function" (file:line(name), the path from lowprec/, torch/ or triton/ on), calls per call of `fn`, own
    and cumulative microseconds per call of `fn` (cProfile's own cost included)."""
    fn()
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fn() for _ in range(calls)])
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cum s, ...)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{re.sub(PATH_HEAD, '', file)}:{line}({name})", "calls": round(n / calls, 2),
             "own_us": round(own * 1e6 / calls, 2), "cum_us": round(cum * 1e6 / calls, 2)}
            for (file, line, name), (_, n, own, cum, _) in rows]


def first_step(step: Callable[[], None], device: str) -> float:
    """Seconds the first call of `step` takes (the autotuner's picks, compilation), synced."""
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return round(time.perf_counter() - start, 1)


def time_steps(steps: dict[str, Callable[[], None]], device: str, count: int, rounds: int,
               progress: bool = False) -> dict[str, list]:
    """Milliseconds per step of each step function, `rounds` interleaved rounds of `count` steps each (one
    untimed warm-up step per round), synced around each round; with `progress`, a bar over the rounds."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in steps}
    bar = tqdm(total=rounds * len(steps), desc="timing", unit="round", disable=not progress)
    for _ in range(rounds):
        for name, step in steps.items():
            step()
            sync()
            start = time.perf_counter()
            for _ in range(count):
                step()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3 / count)
            bar.update()
    bar.close()
    return times


def under_compile(model: torch.nn.Module, device: str, mode: str | None) -> Callable:
    """`model` itself (mode None), or torch.compile(model, mode=mode) (on the CPU: the aot_eager backend)
    whose every call starts a new CUDA-graph iteration (CUDA graphs may reuse the last one's buffers)."""
    if mode is None:
        return model
    compiled = (torch.compile(model, mode=mode) if device == "cuda"
                else torch.compile(model, backend="aot_eager"))

    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return call


def gpt_step(spec: str, batch: int, block_size: int, device: str, tiny: bool,
             compile_mode: str | None = None) -> Callable[[], None]:
    """One training step of gpu-6l's GPT (smoke-cpu's with `tiny`) at `block_size` with attention `spec`:
    bf16 autocast, AdamW (fused on a GPU), random tokens; eager, or the model under
    torch.compile(mode=`compile_mode`) (on the CPU: the aot_eager backend)."""
    model_config = dataclasses.replace(get_config("smoke-cpu" if tiny else "gpu-6l").model,
                                       block_size=block_size, attention=spec)
    torch.manual_seed(0)
    model = GPT(model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    forward = under_compile(model, device, compile_mode)
    gen = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(model_config.vocab_size, (batch, block_size + 1), device=device, generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def geomean(values: list[float]) -> float | None:
    return round(math.exp(sum(map(math.log, values)) / len(values)), 3) if values else None


def summary(rows: list[dict], steps: dict[str, list[float]], compiled: dict[str, list[float]] | None = None
            ) -> dict:
    """Our host time per call over SDPA's (geometric mean over shapes, per mode and implementation), step
    time over SDPA's (medians over rounds), eager and (`compiled`) under torch.compile, and whether each meets
    TARGETS."""
    host = {(r["impl"], r["batch"], r["heads"], r["seq"], r["mode"]): r["host_us"] for r in rows
            if "host_us" in r}
    out: dict = {}
    for impl in IMPLS:
        if impl == "sdpa":
            continue
        for mode in ("fwd", "fwd+bwd"):
            ratios = [us / host[("sdpa", *key[1:])] for key, us in host.items()
                      if key[0] == impl and key[4] == mode and ("sdpa", *key[1:]) in host]
            out[f"host_vs_sdpa {impl} {mode}"] = geomean(ratios)
        for label, timed in (("", steps), (" compiled", compiled or {})):
            median = {name: sorted(ms)[len(ms) // 2] for name, ms in timed.items() if ms}
            if impl in median and "sdpa" in median:
                out[f"step_vs_sdpa{label} {impl}"] = round(median[impl] / median["sdpa"], 3)
    out["met"] = {key: None if value is None else value <= TARGETS[key.split()[0]]
                  for key, value in out.items()}
    return out


def run(args: argparse.Namespace) -> int:
    from lowprec.runs import provenance, write_json

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise ValueError("no CUDA device; use --smoke for a CPU code-path check")
    if args.steps < 1 or args.rounds < 1:
        raise ValueError("--steps and --rounds must be >= 1")
    if args.smoke:
        args.batch, args.heads, args.seq, args.steps, args.rounds = [1], [2], [32], 1, 1
    batch, block_size = (2, 32) if args.smoke else STEP
    record = {"provenance": provenance(), "args": vars(args), "device": device, "impls": IMPLS, "calls": [],
              "step": {"config": "smoke-cpu" if args.smoke else "gpu-6l", "block_size": block_size,
                       "batch": batch}}
    start = time.perf_counter()
    for b, h, n in itertools.product(args.batch, args.heads, args.seq):
        record["calls"] += call_rows(b, h, n, device, 1 if args.smoke else CALLS)
    if args.profile:
        shape = (args.batch[0], args.heads[0], args.seq[0])
        fns = {name: calls_of(functools.partial(attention, backend=IMPLS[name]), *shape, 64, True, device)[0]
               for name in ("triton", "sdpa")}
        calls = 1 if args.smoke else CALLS
        ops = {name: op_profile(of["fwd+bwd"], device, calls) for name, of in fns.items()}  # torch's view
        hosts = {mode: host_profile(fns["triton"][mode], calls) for mode in ("fwd", "fwd+bwd")}  # cProfile's
        record["profile"] = {"impl": "triton", "shape": shape, "calls": calls, **hosts, "ops": ops}
    steps = {name: launched(gpt_step(spec, batch, block_size, device, args.smoke), name)
             for name, spec in IMPLS.items()}
    record["step"]["ms"] = time_steps(steps, device, args.steps, args.rounds)
    if args.compile:
        compiled, failed = {}, {}
        for name in COMPILED:  # one step each first: it compiles, and a failure leaves the others timed
            try:
                compiled[name] = gpt_step(IMPLS[name], batch, block_size, device, args.smoke, args.compile)
                compiled[name]()
            except Exception as exc:
                compiled.pop(name, None)
                failed[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        record["step"] |= {"compile": args.compile, "compiled_errors": failed,
                           "compiled_ms": time_steps(compiled, device, args.steps, args.rounds)}
    record["summary"] = summary(record["calls"], record["step"]["ms"], record["step"].get("compiled_ms"))
    record["seconds"] = round(time.perf_counter() - start, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, record)
    print(table(record))
    return 0


def table(record: dict) -> str:
    """One line per shape, mode and implementation (host and wall microseconds per call), the step times and
    the summary."""
    lines = [f"{'B':>3} {'H':>3} {'N':>5} {'mode':<8} {'impl':<13} {'host':>8} {'wall':>8}  us/call"]
    for r in record["calls"]:
        cells = [f"{r[k]:>8.1f}" if k in r else f"{'-':>8}" for k in ("host_us", "wall_us")]
        lines.append(f"{r['batch']:>3} {r['heads']:>3} {r['seq']:>5} {r.get('mode', '-'):<8} {r['impl']:<13} "
                     f"{' '.join(cells)}  {r.get('error', '')}")
    step = record["step"]
    for label, key in (("", "ms"), (f" compiled ({step.get('compile')})", "compiled_ms")):
        for name, ms in step.get(key, {}).items():
            lines.append(f"step{label} {step['config']} N={step['block_size']} B={step['batch']} {name:<13} "
                         f"{' '.join(f'{m:.2f}' for m in ms)} ms")
    for name, error in step.get("compiled_errors", {}).items():
        lines.append(f"step compiled ({step['compile']}) {name}: {error}")
    for name, rows in record.get("profile", {}).get("ops", {}).items():
        lines.append(f"one fwd+bwd call, {name}: torch ops by own host time (us per call; device us)")
        lines += op_lines(rows, ("self_host_us", "self_device_us"))
    lines.append(f"summary: {record['summary']}")
    return "\n".join(lines)
