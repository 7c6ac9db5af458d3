"""`lowprec experiment bias-noise`: when does a rounding bias in the W_Q gradient beat the batch noise?

For a checkpoint of a recorded run, on the run's own batches, per layer and head: the W_Q (and W_K) gradients
with each low-precision attention spec under test against a high-precision one, the same weights and batch
for all. `bias_noise` gives one head's statistics (the bias along its shared direction R, cross-fitted, its t,
the batch noise, the critical batch size, the Adam steps to drift), `criterion_probe` the same in the
positive control; with `--keys-batches` the record also says which keys R is made of. Every statistic and
record key: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from lowprec.analysis import BIASED_T, ErrorStats
from lowprec.attention import AttentionSpec, emulated_attention
from lowprec.checkpoint import load_checkpoint
from lowprec.checks import option
from lowprec.configs import TrainConfig, apply_overrides
from lowprec.data import sample_batch
from lowprec.instruments.control import (
    ControlConfig,
    control_batch,
    cos,
    make_problem,
    single_thread,
    step,
    treatment_precision,
)
from lowprec.instruments.lowrank import key_shares, mean_alignment
from lowprec.model import GPT
from lowprec.runs import load_run, provenance, write_json
from lowprec.telemetry import scores
from lowprec.train import load_tokens, make_optimizer

HP_SPEC = "emulated/precision=fp32/o_for_delta=fp32"
PROJECTIONS = ("q", "k")  # W_Q and W_K: the rows of c_attn's weight, in its order
DOMINANT = 0.9  # a row's largest weight at least this: one key dominates the row
TILE = 64  # key tile width of the explode arms' kernels (tile=64)


@dataclass
class HeadBias:
    """`bias_noise` for one head (its statistics: the appendix)."""

    bias_norm: float
    rank1: float
    t: float
    biased: bool
    noise: float
    critical_tokens: float
    drift: float | None
    walk: float | None
    steps_to_drift: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def bias_noise(g_lp: torch.Tensor, g_hp: torch.Tensor, tokens_per_batch: int, tokens_per_step: int,
               adam_v: torch.Tensor | None = None, eps: float = 1e-8) -> tuple[HeadBias, torch.Tensor]:
    """Statistics of one head from per-batch gradients g_lp, g_hp (batches, head_dim, n_embd); adam_v is the
    optimizer's (bias-corrected) second moment for the same slice. Returns the statistics and R (from all
    batches). Every projection is cross-fitted: batch i is projected on R_-i, the top singular pair of the
    mean error over the other batches, so that noise cannot pick its own direction (fitted on the same
    batches, pure noise of a 64 x 384 slice gives t ~ 28)."""
    err, hp = (g_lp - g_hp).double(), g_hp.double()
    n = err.shape[0]
    b = err.mean(0)
    u, sigma, vh = torch.linalg.svd(b, full_matrices=False)
    r = torch.outer(u[:, 0], vh[0])
    energy = float(sigma[0] ** 2 / (sigma**2).sum()) if sigma.sum() > 0 else 0.0
    if n < 2 or not sigma[0] > 0:
        stats = HeadBias(0.0, energy, 0.0, False, math.nan, math.inf, None, None, None)
        return stats, r
    fold = torch.arange(n) % 2  # two folds: batch i is projected on the R of the other fold's mean error
    means = torch.stack([err[fold == f].mean(0) for f in (0, 1)])
    u_f, _, vh_f = torch.linalg.svd(means, full_matrices=False)
    r_f = u_f[:, :, :1] * vh_f[:, :1, :]  # (2, D, C): u1 v1^T per fold (unique: no sign to choose)
    r_i = r_f[1 - fold]  # (n, D, C)

    def along(x: torch.Tensor) -> torch.Tensor:
        return (x * r_i).sum((1, 2))

    e = along(err)
    bias = float(e.mean())
    t = bias / (float(e.std()) / math.sqrt(n)) if e.std() > 0 else 0.0
    noise = float(along(hp).std())
    critical = tokens_per_batch * (noise / bias) ** 2 if bias > 0 else math.inf
    drift = walk = steps = None
    if adam_v is not None:
        scale = 1.0 / (adam_v.double().sqrt() + eps)
        drift = float(along(err * scale).mean())
        walk = float(along(hp * scale).std())
        steps = (walk / drift) ** 2 * tokens_per_batch / tokens_per_step if drift > 0 else math.inf
    stats = HeadBias(bias, energy, t, abs(t) >= BIASED_T, noise, critical, drift, walk, steps)
    return stats, r


@single_thread()
def criterion_probe(cfg: ControlConfig, placement: str, treatment: str, batches: int = 100) -> dict:
    """`bias_noise` in the positive control at its initial weights: a treatment's W_Q gradients against
    float64 attention's on the same batches, with Adam's v estimated as the mean square of the float64
    gradient (what v settles to; its median square root is returned as sqrt_v_median); tokens per step = one
    batch."""
    precision, fix = treatment_precision(placement, treatment, cfg.beta)
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    grads: dict[str, list[torch.Tensor]] = {"lp": [], "hp": []}
    for _ in range(batches):
        batch = control_batch(cfg, prob, gen)
        for key, (prec, fx) in (("lp", (precision, fix)), ("hp", (None, None))):
            w = prob.w0.clone().requires_grad_(True)
            step(cfg, prob, w, batch, prec, fx)
            grads[key].append(w.grad.detach().clone())
    g_lp, g_hp = torch.stack(grads["lp"]), torch.stack(grads["hp"])
    tokens = cfg.batch * cfg.seq
    v = (g_hp.double() ** 2).mean(0)
    stats, r = bias_noise(g_lp, g_hp, tokens, tokens, adam_v=v, eps=cfg.adam_eps)
    return stats.to_dict() | {"r_cos": abs(cos(r, prob.r)), "sqrt_v_median": float(v.sqrt().median())}


def _rows(model: GPT, weight: torch.Tensor, part: str) -> torch.Tensor:
    """(heads, head_dim, n_embd) rows of a c_attn-shaped (3 n_embd, n_embd) tensor: W_Q's ("q") or W_K's."""
    c = model.config
    start = PROJECTIONS.index(part) * c.n_embd
    return weight[start : start + c.n_embd].detach().float().view(c.n_head, c.n_embd // c.n_head, c.n_embd)


def projection_grads(model: GPT) -> torch.Tensor:
    """(projections, layers, heads, head_dim, n_embd) gradients of W_Q and W_K (PROJECTIONS order), from each
    layer's c_attn weight gradient."""
    layers = model.attention_layers()
    return torch.stack([torch.stack([_rows(model, a.c_attn.weight.grad, part) for a in layers])
                        for part in PROJECTIONS])


def adam_second_moment(model: GPT, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """(projections, layers, heads, head_dim, n_embd) bias-corrected exp_avg_sq of W_Q and W_K from a loaded
    Adam(W) optimizer, or None if it has taken no step yet."""
    beta2 = optimizer.param_groups[0]["betas"][1]
    moments = []
    for attn in model.attention_layers():
        state = optimizer.state.get(attn.c_attn.weight)
        if not state:
            return None
        moments.append(state["exp_avg_sq"] / (1 - beta2 ** float(state["step"])))
    return torch.stack([torch.stack([_rows(model, v, part) for v in moments]) for part in PROJECTIONS])


def run_batch(tokens, cfg: TrainConfig, step: int, i: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's own batch i from checkpoint step `step` on (the batches of its next optimizer steps)."""
    return sample_batch(tokens, cfg.seed, step * cfg.grad_accum + i, cfg.batch_size, cfg.model.block_size,
                        device=device)


def attention_inputs(model: GPT, idx: torch.Tensor, autocast) -> list[tuple[torch.Tensor, ...]]:
    """Per attention layer (X, q, k) of one no-grad forward of `model` on token ids idx: the attention input
    (B, T, C) and the q, k the attention saw (B, H, T, D), through the layers' probe (as telemetry does)."""
    layers = model.attention_layers()
    saved: dict[int, tuple[torch.Tensor, ...]] = {}

    def probe(layer, x_in, q, k, v, o):
        saved[layer] = (x_in.detach(), q.detach(), k.detach())

    for attn in layers:
        attn.probe = probe
    try:
        with torch.no_grad(), autocast:
            model(idx)
    finally:
        for attn in layers:
            attn.probe, attn.stats = None, None  # the probe makes stat-keeping backends keep stats
    return [saved[i] for i in range(len(layers))]


def head_sources(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> dict:
    """Where one head's mean rank-1 term M = Σ_T (PK)[T]^T X[T] comes from, and how many of its rows one key
    dominates (the appendix: key0_share, top_share, top_position, half_positions, mean_key_cos,
    mean_input_cos, pk_energy, dominant_rows, early_dominant_rows).

    p: (B, T, N) probabilities (causal: query t sees keys 0..t), k: (B, N, D) keys, x: (B, T, C) attention
    inputs; sums run over B."""
    largest, key = p.max(dim=-1)  # (B, T)
    dominant = largest >= DOMINANT
    query_tile = torch.arange(p.shape[1], device=p.device) // TILE
    early = dominant & (key // TILE < query_tile)
    ones = torch.ones(p.shape[:2], dtype=torch.float64, device=p.device).unsqueeze(1)
    p, k = p.unsqueeze(1), k.unsqueeze(1)
    shares = key_shares(p, k, x, ones)[0].cpu()
    align = {name: float(value[0]) for name, value in mean_alignment(p, k, x, ones).items()}
    top = int(shares.abs().argmax())
    ranked = shares.sort(descending=True).values
    return {"key0_share": float(shares[0]), "top_share": float(shares[top]), "top_position": top,
            "half_positions": int((ranked.cumsum(0) < 0.5).sum()) + 1,
            "mean_key_cos": align["key"], "mean_input_cos": align["input"], "pk_energy": align["pk_energy"],
            "dominant_rows": float(dominant.double().mean()),
            "early_dominant_rows": float(early.double().mean())}


def layer_sources(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  softcap: float = 0.0) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """`head_sources` of every head of one layer from its captured X (B, T, C), q, k (B, H, T, D), one head at
    a time (P is B x T x T float64); also the mean keys (H, D) and the mean input (C,), float64 on the CPU."""
    out = []
    for head in range(q.shape[1]):
        s64, _ = scores(q[:, head:head + 1], k[:, head:head + 1], softcap)
        p = torch.softmax(s64, dim=-1)[:, 0]
        out.append(head_sources(p, k[:, head], x))
    return out, k.double().mean((0, 2)).cpu(), x.double().mean((0, 1)).cpu()


def norm_errors(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> list[dict]:
    """Per head of one layer: `spec`'s normalisation error (norm_error, norm_error_t) on
    causal attention over q, k (B, H, T, D), from the emulator with V = 1 and the output kept in fp32."""
    heads = q.shape[1]
    if spec.precision is None or spec.precision.weights.mode == "ones":
        return [{"norm_error": None, "norm_error_t": None} for _ in range(heads)]
    precision = replace(spec.precision.for_dtype(q.dtype), output=None)
    o = emulated_attention(q.float(), k.float(), torch.ones_like(k, dtype=torch.float32), causal=True,
                           precision=precision, fix=spec.fix)
    err = o[..., 0].double() - 1  # (B, H, T): the same in every column of O
    return [{"norm_error": float(err[:, h].mean()), "norm_error_t": ErrorStats.of(err[:, h].mean(-1)).t}
            for h in range(heads)]


def r_alignment(r: torch.Tensor, k_mean: torch.Tensor, x_mean: torch.Tensor) -> dict[str, float]:
    """|cos| of R = u1 v1^T's (unit u1, v1) left factor with k_mean and of its right one with x_mean:
    ‖k^T R‖ / ‖k‖ and ‖R x‖ / ‖x‖."""
    r, k_mean, x_mean = r.double(), k_mean.double(), x_mean.double()
    return {"r_key_cos": float((k_mean @ r).norm() / k_mean.norm()),
            "r_input_cos": float((r @ x_mean).norm() / x_mean.norm())}


def measure(run_dir: Path, checkpoints: list[Path], specs: list[str], hp: str, batches: int,
            batch_size: int | None, overrides: list[str], keys_batches: int = 0) -> dict:
    """The record of `lowprec experiment bias-noise` (its keys: the appendix)."""
    run = load_run(run_dir)
    cfg = apply_overrides(TrainConfig.from_dict(run.config), overrides)
    if batch_size is not None:
        cfg = apply_overrides(cfg, [f"batch_size={batch_size}"])
    hp_spec, lp_specs = AttentionSpec.parse(hp), [AttentionSpec.parse(s) for s in specs]
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    data = load_tokens(cfg.data)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
                else torch.autocast(device.type, enabled=False))
    model = GPT(cfg.model).to(device)
    tokens_per_batch = cfg.batch_size * cfg.model.block_size
    record: dict = {"run": str(run_dir), "hp": str(hp_spec), "specs": [str(s) for s in lp_specs],
                    "batches": batches, "keys_batches": keys_batches, "tokens_per_batch": tokens_per_batch,
                    "tokens_per_step": run.config["batch_size"] * run.config["grad_accum"]
                    * run.config["model"]["block_size"], "eps": cfg.eps, "checkpoints": []}
    previous: dict[str, torch.Tensor] = {}
    for path in checkpoints:
        state = load_checkpoint(path)  # checked against its sha256
        model.load_state_dict(state["model"])
        optimizer = make_optimizer(model, cfg, device)
        optimizer.load_state_dict(state["optimizer"])
        v = adam_second_moment(model, optimizer)
        grads: dict[str, list[torch.Tensor]] = {str(s): [] for s in [hp_spec, *lp_specs]}
        for i in range(batches):
            x, y = run_batch(data.train, cfg, state["step"], i, device)
            for spec in [hp_spec, *lp_specs]:
                for attn in model.attention_layers():
                    attn.spec = spec
                model.zero_grad(set_to_none=True)
                with autocast:
                    _, loss = model(x, y)
                loss.backward()
                grads[str(spec)].append(projection_grads(model).cpu())
        g_hp = torch.stack(grads[str(hp_spec)])  # (batches, projections, layers, heads, head_dim, n_embd)
        entry: dict = {"path": str(path), "step": state["step"], "specs": {}}
        means = None  # per layer: (mean keys (H, D), mean input (C,))
        qk = None  # per layer: the q, k (B, H, T, D) of the keys batches, for norm_errors
        if keys_batches:
            for attn in model.attention_layers():
                attn.spec = hp_spec
            captured = [attention_inputs(model, run_batch(data.train, cfg, state["step"], i, device)[0],
                                         autocast) for i in range(keys_batches)]
            entry["sources"], means, qk = [], [], []
            for layer in range(len(captured[0])):
                x, q, k = (torch.cat([c[layer][j] for c in captured]) for j in range(3))
                heads_sources, k_mean, x_mean = layer_sources(x, q, k, cfg.model.attn_softcap)
                entry["sources"].append(heads_sources)
                means.append((k_mean, x_mean))
                qk.append((q, k))
            del captured
        for spec in lp_specs:
            g_lp = torch.stack(grads[str(spec)])
            heads, heads_k, directions = [], [], []
            for layer in range(g_lp.shape[2]):
                row, row_k = [], []
                norms = (norm_errors(*qk[layer], spec) if qk is not None and not cfg.model.attn_softcap
                         else None)
                for head in range(g_lp.shape[3]):
                    (stats, r), (stats_k, _) = (
                        bias_noise(g_lp[:, i, layer, head], g_hp[:, i, layer, head], tokens_per_batch,
                                   record["tokens_per_step"], None if v is None else v[i, layer, head].cpu(),
                                   cfg.eps) for i in range(len(PROJECTIONS)))
                    found = stats.to_dict()
                    if means is not None:
                        found.update(r_alignment(r, means[layer][0][head], means[layer][1]))
                    if norms is not None:
                        found.update(norms[head])
                    row.append(found)
                    row_k.append(stats_k.to_dict())
                    directions.append(r)
                heads.append(row)
                heads_k.append(row_k)
            directions_t = torch.stack(directions)
            spec_entry = {"heads": heads, "heads_k": heads_k}
            if str(spec) in previous:
                cos = (directions_t * previous[str(spec)]).sum((1, 2)).abs()
                spec_entry["alignment"] = cos.view(len(heads), -1).tolist()
            previous[str(spec)] = directions_t
            entry["specs"][str(spec)] = spec_entry
        record["checkpoints"].append(entry)
    return record


def _head_lines(heads: list[list[dict]], sources: list[list[dict]] | None, rows: int) -> list[str]:
    """The header and the `rows` heads with the largest |t| of one table; with `sources` (W_Q of records that
    have them) six more columns (`format_table`)."""
    header = (f"  {'layer':>5} {'head':>4} {'t':>7} {'rank1':>6} {'|b|':>9} {'noise':>9} "
              f"{'crit. tokens':>13} {'steps to drift':>15}")
    if sources is not None:
        header += f" {'key0':>6} {'early':>6} {'u1·k':>6} {'v1·x':>6} {'norm %':>8} {'norm t':>7}"
    lines = [header]
    flat = [(layer, head, h) for layer, row in enumerate(heads) for head, h in enumerate(row)]
    for layer, head, h in sorted(flat, key=lambda x: -abs(x[2]["t"]))[:rows]:
        steps = "-" if h["steps_to_drift"] is None else f"{h['steps_to_drift']:.3g}"
        line = (f"  {layer:>5} {head:>4} {h['t']:>+7.2f} {h['rank1']:>6.3f} {h['bias_norm']:>9.2e} "
                f"{h['noise']:>9.2e} {h['critical_tokens']:>13.3g} {steps:>15}")
        if sources is not None:
            found = {**sources[layer][head], **h}
            columns = ("key0_share", "early_dominant_rows", "r_key_cos", "r_input_cos")
            line += "".join(f" {found[k]:>6.3f}" if k in found else f" {'-':>6}" for k in columns)
            norm, norm_t = h.get("norm_error"), h.get("norm_error_t")
            line += f" {100 * norm:>+8.3f} {norm_t:>+7.1f}" if norm is not None else f" {'-':>8} {'-':>7}"
        lines.append(line)
    return lines


def format_table(record: dict, rows: int = 8) -> str:
    """The heads with the largest |t| per checkpoint and spec, for W_Q and (records that have it) W_K; with
    `sources` in the record, six more W_Q columns: key position 0's share of the mean term M, the share of
    early-dominated rows, |cos| of R's u1 with the mean key and of its v1 with the mean input, the
    normalisation error in % and its t (a record without a column: -)."""
    lines = []
    for entry in record["checkpoints"]:
        sources = entry.get("sources")
        for spec, result in entry["specs"].items():
            for name, key in (("W_Q", "heads"), ("W_K", "heads_k")):
                if key in result:
                    lines.append(f"step {entry['step']}  {name}  {spec}  vs {record['hp']}  "
                                 f"({record['batches']} batches of {record['tokens_per_batch']} tokens)")
                    lines += _head_lines(result[key], sources if key == "heads" else None, rows)
        if sources is not None:
            lines.append(f"  key0: key position 0's share of the mean term M ({record['keys_batches']} "
                         f"batches); early: share of rows whose largest weight (>= {DOMINANT}) is on a "
                         f"key in an earlier {TILE}-key tile; u1·k, v1·x: |cos| of R's singular vectors "
                         "with the mean key and the mean input; norm: sum(P̄) / l̃ - 1, the forward's "
                         "normalisation error (% over rows; t over sequences)")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="a recorded run folder (its config.json gives model and data)")
    parser.add_argument("--ckpt", type=Path, action="append", required=True,
                        help="checkpoint file(s) of that run, e.g. RUN/checkpoint/ckpt-003000.pt "
                             "(repeatable)")
    parser.add_argument("--spec", action="append", default=None, dest="specs",
                        help="low-precision attention spec(s) to test (default: the run's own)")
    parser.add_argument("--hp", default=HP_SPEC, help=f"high-precision reference spec (default {HP_SPEC})")
    parser.add_argument("--batches", type=int, default=32, help="batches per checkpoint (default 32)")
    parser.add_argument("--keys-batches", type=int, default=4,
                        help="the first N batches also give each head's key shares and mean alignment, and "
                             "R's alignment with the mean key and input (default 4; 0: off)")
    parser.add_argument("--batch-size", type=option(int, 1), default=None,
                        help="sequences per batch (default: the run's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a field of the run's config, e.g. --set device=cpu")
    parser.add_argument("--out", type=Path, help="write the record (JSON) here")


def run(args: argparse.Namespace) -> int:
    if args.batches < 2:
        raise ValueError(f"--batches must be >= 2 (the noise is a spread over batches), got {args.batches}")
    if not 0 <= args.keys_batches <= args.batches:
        raise ValueError(f"--keys-batches must be between 0 and --batches ({args.batches}), got "
                         f"{args.keys_batches}")
    for path in args.ckpt:
        if not path.is_file():
            raise ValueError(f"--ckpt {path} is not a file")
    specs = args.specs or [load_run(args.run).config["model"]["attention"]]
    record = measure(args.run, args.ckpt, specs, args.hp, args.batches, args.batch_size, args.overrides,
                     args.keys_batches)
    record["provenance"] = provenance()
    print(format_table(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, record)
        print(f"wrote {args.out}")
    return 0
