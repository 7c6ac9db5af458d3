"""The attention kernels on a real GPU: correctness, a fuzz run, and the signed bias of every fast kernel.

    lowprec measure suite --out DIR          # on a CUDA machine (~4 min on one H200)
    lowprec measure suite --out DIR --smoke  # on a CPU, via Triton's interpreter (<1 min)

Sections `bias`, `correctness` and `fuzz`, each case in its own try/except, DIR/gpu_suite.json rewritten after
every case; a failed check runs again with torch SDPA's kernels. What each section measures: the book's
appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lowprec.attention.dispatch import SDPA_BACKENDS, attention, math_attention, sdpa_failure
from lowprec.attention.fix import Fix
from lowprec.attention.flash import FIXED_BLOCKS, flash_attention
from lowprec.attention.reference import reference_attention
from lowprec.checks import option
from lowprec.instruments.bias import CASES, BiasResult, Rows, bias_of, format_table, with_v_mean
from lowprec.runs import provenance, write_json
from tqdm import tqdm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FACTOR = 2.0
MIN_ROWS = 256  # query rows per fuzz config at least, so that max errors are not a few-sample draw
# Fixed tiles (64 x 64, the emulator's default; compile_for_gpu checks that they fit at every head dim)
# instead of the autotuner (its key includes N, so every new sequence length would re-tune); a few checks
# use other tile shapes.
BLOCKS = FIXED_BLOCKS
# The compiled variants: (dtype, head dim) -> each with causal on/off and Fix on/off (--smoke: the first two)
VARIANTS = (
    ("bf16", 16),
    ("bf16", 32),
    ("bf16", 64),
    ("bf16", 80),
    ("bf16", 128),
    ("bf16", 160),
    ("bf16", 256),
    ("fp16", 32),
    ("fp16", 128),
    ("fp16", 256),
    ("fp32", 16),
    ("fp32", 64),
)
SMOKE_VARIANTS = (("bf16", 16), ("fp16", 16), ("fp32", 16))
SEQS = (1, 17, 100, 255, 513, 1024)  # correctness: two per variant, in turn
BIAS_CASES = (
    "unique",
    "exact-k4",
    "near-k4",
    "near-k4-neg",
    "unique-v+3",
    "near-k4-v+3",
    "exact-k4-huge",
    "random",
)


@dataclass(frozen=True)
class Check:
    """One correctness configuration: q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq_k,
    head_dim) (None: heads, seq); layout "bshd" passes transposed views of (B, N, H, D) memory."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    dtype: str = "bf16"
    fix: bool = False
    logit_scale: float = 1.0
    ties: int = 0
    v_mean: float = 0.0
    blocks: tuple[int, int] = BLOCKS
    kv_heads: int | None = None
    seq_k: int | None = None
    layout: str = "bhsd"
    precision: str = "fa2"


def make_inputs(c: Check, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of config `c` on `device`: unit Gaussians, q times logit_scale, V shifted by v_mean
    (same-sign V), and `ties` copies of one key per head (so every row that prefers that key has an exact
    repeated maximum) when seq >= 2 * ties. (With all keys tied, softmax is uniform and dQ is exactly 0; a
    flash backward then shows only its δ error, from the rounded O, while plain attention's cancels: a real
    difference the 2x rule cannot judge.)"""
    gen = torch.Generator(device=device).manual_seed(seed)
    q_shape = (c.batch, c.heads, c.seq, c.head_dim)
    kv_shape = (c.batch, c.kv_heads or c.heads, c.seq_k or c.seq, c.head_dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    q, k, v, do = (torch.randn(s, generator=gen, device=device) for s in shapes)
    q = q * c.logit_scale
    v = v + c.v_mean
    if c.ties > 1 and kv_shape[2] >= 2 * c.ties:
        pos = torch.randperm(kv_shape[2], generator=gen, device=device)[: c.ties]
        k[:, :, pos[1:]] = k[:, :, pos[:1]]
    dtype = DTYPES[c.dtype]
    out = tuple(t.to(dtype) for t in (q, k, v, do))
    if c.layout == "bshd":  # (B, N, H, D) memory seen as (B, H, N, D), as the model passes them
        out = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in out)
    return out


def grads_of(fn, q, k, v, do) -> list[torch.Tensor]:
    """[o, dq, dk, dv] of fn(q, k, v) for upstream gradient do."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(do.to(o.dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


def check(c: Check, seed: int, device: str, sdpa_backend: str | None = None) -> dict:
    """Max errors of the Triton kernel (or, with `sdpa_backend`, of that torch SDPA kernel in its place) and
    of a baseline vs float64, and whether FlashAttention's rule holds for o, dq, dk and dv: kernel error <=
    2 x (baseline error + the fp32 rounding noise at the reference's magnitude). The baseline and the noise
    where the reference is zero: the appendix."""
    q, k, v, do = make_inputs(c, seed, device)
    fix = Fix() if c.fix else None
    blocks = {"block_m": c.blocks[0], "block_n": c.blocks[1]}
    if sdpa_backend is None:
        tested = functools.partial(flash_attention, causal=c.causal, fix=fix, precision=c.precision, **blocks)
    else:
        tested = functools.partial(attention, backend="sdpa", causal=c.causal, sdpa_backend=sdpa_backend)
    kernel = grads_of(tested, q, k, v, do)
    exact = grads_of(
        lambda q_, k_, v_: reference_attention(q_, k_, v_, c.causal)[0],
        q.double(),
        k.double(),
        v.double(),
        do.double(),
    )
    if c.dtype != "fp32":  # FlashAttention's baseline: plain attention in the input dtype
        baseline_name, baseline = "plain", functools.partial(math_attention, causal=c.causal)
    elif device == "cuda":  # fp32: a flash algorithm (plain fp32 attention beats any that recomputes P)
        baseline_name = "sdpa-efficient"
        baseline = functools.partial(attention, backend="sdpa", causal=c.causal, sdpa_backend="efficient")
    else:
        baseline_name = "emulated"
        baseline = functools.partial(attention, backend="emulated", causal=c.causal, fix=fix,
                                     precision=c.precision, **blocks)
    base = grads_of(baseline, q, k, v, do)
    names = ("o", "dq", "dk", "dv")
    err = {n: (a.double() - e).abs().max().item() for n, a, e in zip(names, kernel, exact, strict=True)}
    base_err = {n: (a.double() - e).abs().max().item() for n, a, e in zip(names, base, exact, strict=True)}
    noise = {  # fp32 rounding noise at the reference's magnitude, as FlashAttention-3's tests take it
        n: (e.float() + 0.3 - 0.3 - e.float()).abs().max().item() for n, e in zip(names, exact, strict=True)
    }
    zero_reference = [n for n, e in zip(names, exact, strict=True) if not e.any()]
    amax = {name: t.abs().max().item() for name, t in (("q", q), ("k", k), ("v", v), ("do", do))}
    for n in zero_reference:  # dQ, dK of a single key are 0: the noise of the δ - dP cancellation instead
        other = amax["k"] if n == "dq" else amax["q"]
        noise[n] = 2.0**-23 * math.sqrt(c.head_dim) * amax["do"] * amax["v"] * other
    ratio = {n: _ratio(err[n], base_err[n] + noise[n]) for n in names}
    failed = [n for n in names if not (math.isfinite(err[n]) and ratio[n] <= FACTOR)]
    return {
        "config": asdict(c),
        "seed": seed,
        "error": err,
        "baseline_error": base_err,
        "baseline": baseline_name,
        "zero_reference": zero_reference,
        "ratio": ratio,
        "pass": not failed,
        "failed": failed,
    }


def recheck(c: Check, seed: int, device: str) -> dict:
    """Check `c` again with each of torch SDPA's fused kernels in place of ours: backend -> its ratios under
    the same rule, or why it could not run (does the production kernel fail the same check?)."""
    out: dict[str, object] = {}
    for backend in ("flash", "efficient"):
        try:
            out[backend] = check(c, seed, device, sdpa_backend=backend)["ratio"]
        except Exception as exc:  # torch: "No available kernel"
            out[backend] = sdpa_failure(exc)
    return out


def check_kernel(c: Check, seed: int, device: str) -> dict:
    """check() of our kernel; a failure also records recheck()'s SDPA ratios under "sdpa"."""
    result = check(c, seed, device)
    if not result["pass"]:
        result["sdpa"] = recheck(c, seed, device)
    return result


def _ratio(err: float, allowed: float) -> float:
    """err / allowed, with 0/0 = 0 and x/0 = inf (exact zeros, e.g. dQ of a single key, are common)."""
    if err == 0:
        return 0.0
    return err / allowed if allowed > 0 else math.inf


def correctness_checks(smoke: bool) -> list[Check]:
    """Every compiled variant (VARIANTS x causal x Fix) at two sequence lengths from SEQS in turn (smoke: one,
    the two lengths alternating), two other tile shapes, and large logits with exact ties."""
    variants = SMOKE_VARIANTS if smoke else VARIANTS
    seqs = (1, 37) if smoke else SEQS
    per_combo = 1 if smoke else 2
    combos = [
        (dtype, d, causal, fix) for dtype, d in variants for causal in (False, True) for fix in (False, True)
    ]
    checks = [
        Check(2, 3, seqs[(per_combo * i + j) % len(seqs)], d, causal, dtype, fix)
        for i, (dtype, d, causal, fix) in enumerate(combos)
        for j in range(per_combo)
    ]
    if smoke:
        return checks
    checks += [
        Check(2, 3, 300, 64, causal, blocks=blocks)
        for causal in (False, True)
        for blocks in ((128, 32), (32, 128))
    ]
    checks += [Check(1, 4, 512, 64, True, fix=True, logit_scale=s, ties=4) for s in (4.0, 16.0, 64.0)]
    checks += [  # the drop-in features: GQA / MQA, Nq != Nk both ways, transposed views, consistent norm
        Check(2, 8, 300, 128, True, kv_heads=2, fix=True),
        Check(2, 8, 257, 64, False, kv_heads=1, dtype="fp16"),
        Check(1, 4, 200, 128, True, seq_k=1000, layout="bshd"),
        Check(1, 4, 1000, 64, True, seq_k=333, kv_heads=2),
        Check(2, 4, 129, 256, False, seq_k=700, fix=True),
        Check(1, 4, 512, 64, True, fix=True, logit_scale=16.0, ties=4, precision="consistent"),
        Check(70, 1000, 3, 16, True),  # one launch of B·H = 70,000 programs per query block
    ]
    return checks


def fuzz_check(rng: random.Random, smoke: bool) -> Check:
    """A random configuration within the compiled variants (VARIANTS, causal, Fix): Nq and Nk from 1 (odd and
    even; equal half the time), key/value heads a divisor of the query heads (GQA, MQA), random logit scale,
    injected exact ties, same-sign V, strided views."""
    dtype, head_dim = rng.choice(SMOKE_VARIANTS if smoke else VARIANTS)
    longest = 40 if smoke else 1100
    batch, seq = rng.randint(1, 4), rng.randint(1, longest)
    seq_k = seq if rng.random() < 0.5 else rng.randint(1, longest)
    min_rows = MIN_ROWS // 4 if smoke else MIN_ROWS
    kv_heads = rng.choice((1, 1, 2, 4))
    group = max(rng.choice((1, 1, 2, 4)), -(-min_rows // (batch * seq * kv_heads)))
    return Check(
        batch=batch,
        heads=kv_heads * group,
        seq=seq,
        head_dim=head_dim,
        causal=rng.random() < 0.5,
        dtype=dtype,
        fix=rng.random() < 0.5,
        logit_scale=rng.choice((0.5, 1.0, 4.0, 16.0)),
        ties=rng.choice((0, 0, 2, 4, 8)),
        v_mean=rng.choice((0.0, 0.0, 3.0)),
        kv_heads=kv_heads,
        seq_k=seq_k,
        layout=rng.choice(("bhsd", "bshd")),
    )


def sdpa_available(backend: str, device: str) -> str | None:
    """None if SDPA's `backend` runs the bias inputs' shape (bf16, head dim 128, non-causal), else why not."""
    x = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16)
    try:
        attention(x, x, x, backend="sdpa", causal=False, sdpa_backend=backend)
    except Exception as exc:
        return sdpa_failure(exc)
    return None


def bias_impls(device: str, skipped: dict) -> dict:
    """Every implementation to measure, as non-causal callables; unavailable SDPA backends go to `skipped`."""
    kernel = functools.partial(
        flash_attention, causal=False, block_m=BLOCKS[0], block_n=BLOCKS[1], return_stats=True
    )
    impls = {
        "triton": kernel,
        "triton+fix": functools.partial(kernel, fix=Fix()),
        "emulated-fa2": functools.partial(attention, backend="emulated", causal=False),
    }
    for backend in SDPA_BACKENDS:
        reason = sdpa_available(backend, device)
        if reason is None:
            impls[f"sdpa-{backend}"] = functools.partial(
                attention, backend="sdpa", causal=False, sdpa_backend=backend
            )
        else:
            skipped[f"sdpa-{backend}"] = reason
    return impls


class Report:
    """The JSON record, rewritten after every case so that a killed run keeps what it measured."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.data = {
            "provenance": provenance(),
            "args": vars(args),
            "bias": [],
            "bias_skipped": {},
            "correctness": [],
            "fuzz": {"configs": 0, "failures": 0, "failing": [], "worst_ratio": {}, "by_dtype": {}},
            "errors": [],
            "seconds": {},
        }
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)

    def error(self, section: str, what: object, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        self.data["errors"].append({"section": section, "case": str(what), "error": error})
        self.save()


def run_bias(report: Report, device: str, rows: int) -> None:
    impls = bias_impls(device, report.data["bias_skipped"])
    cases = [CASES[name] for name in BIAS_CASES] + [with_v_mean(CASES["exact-k4"], 3.0)]
    for case in tqdm(cases, desc="bias", mininterval=10):
        data = Rows.make(case, rows, seed=0, device=device)
        for label, impl in impls.items():
            try:
                report.data["bias"].append(bias_of(impl, data, name=label).to_dict())
            except Exception as exc:
                report.error("bias", f"{label} on {case.name}", exc)
        report.save()


def run_correctness(report: Report, device: str, smoke: bool) -> None:
    for i, c in enumerate(tqdm(correctness_checks(smoke), desc="correctness", mininterval=10)):
        try:
            report.data["correctness"].append(check_kernel(c, seed=i, device=device))
        except Exception as exc:
            report.error("correctness", c, exc)
        report.save()


def run_fuzz(report: Report, device: str, n: int, smoke: bool) -> None:
    rng = random.Random(1234)
    fuzz = report.data["fuzz"]
    for i in tqdm(range(n), desc="fuzz", mininterval=10):
        c = fuzz_check(rng, smoke)
        try:
            result = check_kernel(c, seed=10_000 + i, device=device)
        except Exception as exc:
            report.error("fuzz", c, exc)
            result = {"config": asdict(c), "pass": False, "failed": [f"{type(exc).__name__}: {exc}"]}
        fuzz["configs"] += 1
        by_dtype = fuzz["by_dtype"].setdefault(c.dtype, {"configs": 0, "failures": 0})
        by_dtype["configs"] += 1
        by_dtype["failures"] += not result["pass"]
        for name, ratio in result.get("ratio", {}).items():
            fuzz["worst_ratio"][name] = max(fuzz["worst_ratio"].get(name, 0.0), ratio)
        if not result["pass"]:
            fuzz["failures"] += 1
            fuzz["failing"].append(result)
        if i % 25 == 0 or i == n - 1:
            report.save()


def summary(data: dict) -> str:
    """The compact text summary printed at the end."""
    lines = ["== bias (O: mean error and t over rows; δ = rowsum(dO∘O): mean error and t) =="]
    lines.append(format_table(BiasResult.from_dict(d) for d in data["bias"]))
    for name, why in data["bias_skipped"].items():
        lines.append(f"skipped {name}: {why}")
    corr = data["correctness"]
    failed = [r for r in corr if not r["pass"]]
    lines.append(
        f"== correctness: {len(corr) - len(failed)}/{len(corr)} pass (rule: err <= {FACTOR:g} x "
        "(baseline err + fp32 noise)) =="
    )
    lines += [f"FAIL {r['config']}: err / (baseline err + noise) = {r['ratio']}; SDPA in its place: "
              f"{r.get('sdpa')}" for r in failed[:10]]
    lines.append(f"worst ratios: {_worst(r['ratio'] for r in corr if 'ratio' in r)}")
    fuzz = data["fuzz"]
    lines.append(f"== fuzz: {fuzz['failures']} failures in {fuzz['configs']} random configs ==")
    lines.append(f"by dtype: {fuzz['by_dtype']}; worst ratios: {_worst([fuzz['worst_ratio']])}")
    lines += [f"FAIL {r['config']}: {r.get('ratio', r['failed'])}; SDPA in its place: {r.get('sdpa')}"
              for r in fuzz["failing"][:10]]
    lines.append(f"errors: {len(data['errors'])}; seconds: {data['seconds']}")
    return "\n".join(lines)


def _worst(ratios) -> dict[str, float]:
    """The largest err / allowed ratio per tensor over `ratios` (dicts tensor -> ratio)."""
    worst: dict[str, float] = {}
    for ratio in ratios:
        for name, value in ratio.items():
            worst[name] = round(max(worst.get(name, 0.0), value), 3)
    return worst


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json (created if missing)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on a CPU via the interpreter)")
    parser.add_argument(
        "--rows",
        type=option(int, 1),
        default=None,
        help="adversarial rows per bias case (default 100000 on a GPU, 256 with --smoke)",
    )
    parser.add_argument(
        "--fuzz", type=option(int, 0), default=None,
        help="random configurations (default 1000; 6 with --smoke)",
    )
    parser.add_argument("--sections", default="bias,correctness,fuzz", help="comma-separated subset to run")


def run(args: argparse.Namespace) -> int:
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - {"bias", "correctness", "fuzz"})
    if unknown:
        raise ValueError(f"--sections takes bias, correctness, fuzz; got {unknown}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise ValueError("no CUDA device: run with --smoke (tiny sizes through Triton's interpreter)")
    rows = args.rows or (256 if args.smoke else 100_000)
    n_fuzz = args.fuzz if args.fuzz is not None else (6 if args.smoke else 1000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "gpu_suite.json", args)
    for name in sections:
        start = time.perf_counter()
        if name == "bias":
            run_bias(report, device, rows)
        elif name == "correctness":
            run_correctness(report, device, args.smoke)
        else:
            run_fuzz(report, device, n_fuzz, args.smoke)
        report.data["seconds"][name] = round(time.perf_counter() - start, 1)
        report.save()
    print(summary(report.data))
    print(f"wrote {report.path}")
    return 0
