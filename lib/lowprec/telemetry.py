"""The paper's signals, per layer and per head, measured on a sampled step without touching the training step.

`Telemetry(model).measure(x, y)` runs one extra eager forward and backward of the model on a few sequences of
the current batch, captures each attention call's X, q, k, v, O and dO (autograd.grad on O: no parameter's
.grad is touched) and returns {signal: [[value per head] per layer]} with one host sync (`SIGNALS`,
`STAT_SIGNALS`). Every signal: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from lowprec.attention.fix import ties
from lowprec.attention.reference import causal_mask
from lowprec.model import GPT

SIGNALS = ("wq_norm", "wk_norm", "max_logit", "entropy", "tie_rows", "near_tie_rows", "delta_error",
           "delta_error_abs", "delta_error_cum", "rank1_cos", "rank1_cos_prev", "delta_term_cos_prev")
STAT_SIGNALS = ("pbar_ones", "fix_triggers", "fix_fallbacks")  # AttentionStats counters, summed per head
FIRST_POWER_ITERS = 20
NO_AUTOCAST = contextlib.nullcontext()


def head_weights(model: GPT) -> torch.Tensor:
    """W_Q and W_K of every layer split by head: (layers, 2, heads, head_dim, n_embd), fp32, detached."""
    c = model.config
    d = c.n_embd // c.n_head
    return torch.stack([a.c_attn.weight.detach()[: 2 * c.n_embd].float().view(2, c.n_head, d, c.n_embd)
                        for a in model.attention_layers()])


def power_iteration(w: torch.Tensor, v: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value of each matrix in the batch w (..., m, n) from start vectors v (..., n).

    Returns (sigma (...), v) with v the updated unit right singular vector estimate (reuse it to warm-start).
    """
    for _ in range(iters):
        v = F.normalize((w.transpose(-1, -2) @ (w @ v.unsqueeze(-1))).squeeze(-1), dim=-1)
    return (w @ v.unsqueeze(-1)).squeeze(-1).norm(dim=-1), v


def scores(q: torch.Tensor, k: torch.Tensor, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal scaled scores (fp64, fp32): fp64 throughout; fp32 = the fp64 dot rounded once, scaled in fp32.

    Masked entries are -inf. Soft-capping (cap*tanh(s/cap)) is applied when softcap > 0.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    dot = q.double() @ k.double().transpose(-1, -2)
    s64, s32 = dot * scale, dot.float() * scale
    if softcap:
        s64, s32 = softcap * torch.tanh(s64 / softcap), softcap * torch.tanh(s32 / softcap)
    masked = ~causal_mask(q.shape[2], q.device)
    return s64.masked_fill(masked, float("-inf")), s32.masked_fill(masked, float("-inf"))


def layer_signals(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  do: torch.Tensor, window: float, softcap: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-head signals of one attention call (`SIGNALS`, defined in the appendix) as (heads,) tensors, plus
    the (heads, head_dim, n_embd) mean and δ-weighted rank-1 terms under "mean_term" and "delta_term".

    x: attention input (B, T, C); q, k, v, o, do: (B, H, T, D); window: the near-tie window.
    """
    s64, s32 = scores(q, k, softcap)
    p = torch.softmax(s64, dim=-1)
    o_hp = p @ v.double()
    err = ((do.double() * o.double()).sum(-1) - (do.double() * o_hp).sum(-1))   # (B, H, T): δ_lp - δ_hp
    exact, near = ties(s32, s32.amax(-1), window)
    return {
        "max_logit": s64.amax(dim=(-1, -2)).amax(0),
        "entropy": torch.special.entr(p).sum(-1).mean((0, 2)),
        "tie_rows": exact.sum((0, 2)).double(),
        "near_tie_rows": near.sum((0, 2)).double(),
        "delta_error": err.sum((0, 2)),
        "delta_error_abs": err.abs().sum((0, 2)),
        **rank1_terms(p, k, x, err),
    }


def rank1_terms(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
                delta_err: torch.Tensor) -> dict[str, torch.Tensor]:
    """The paper's rank-1 terms (PK)[T]^T X[T] of one attention call: "rank1_cos" (heads,), the mean cosine
    over token pairs T != T' of a sequence; "mean_term" and the δ-weighted "delta_term" (heads, head_dim,
    n_embd). p: (B, H, T, N) probabilities (any mask), k: (B, H, N, D), x: (B, T, C) the attention input,
    delta_err: (B, H, T) δ_lp - δ_hp."""
    pk = (p.double() @ k.double()).float()
    a, b = F.normalize(pk, dim=-1), F.normalize(x.float(), dim=-1)
    n = p.shape[2]
    pair = ((a @ a.transpose(-1, -2)) * (b @ b.transpose(-1, -2)).unsqueeze(1)).sum((-1, -2)) - n
    return {
        "rank1_cos": (pair / max(n * (n - 1), 1)).mean(0),
        "mean_term": torch.einsum("bhtd,btc->hdc", pk, x.float()) / (p.shape[0] * n),
        "delta_term": torch.einsum("bhtd,btc->hdc", delta_err.float().unsqueeze(-1) * pk, x.float()),
    }


def stats_signals(model: GPT) -> dict[str, torch.Tensor]:
    """(layers, heads) sums of the AttentionStats the layers kept during capture (NaN where a layer has none);
    {} when no layer has stats. Clears the stats."""
    layers = model.attention_layers()
    if all(a.stats is None for a in layers):
        return {}
    c = model.config
    out = {name: torch.full((c.n_layer, c.n_head), math.nan, dtype=torch.float64) for name in STAT_SIGNALS}
    for i, attn in enumerate(layers):
        if attn.stats is None:
            continue
        for name in STAT_SIGNALS:
            out[name][i] = 0.0
            out[name][i, attn.lp_heads] = getattr(attn.stats, name).sum((0, 2)).double().cpu()
        attn.stats = None
    return out


def _cos_prev(cur: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """Per-head cosine of flattened (L, H, ...) terms to the previous sample's (NaN when there is none)."""
    if prev is None:
        return torch.full(cur.shape[:2], float("nan"), device=cur.device)
    return F.cosine_similarity(cur.flatten(2), prev.flatten(2), dim=-1)


class Telemetry:
    """Samples the paper's signals from `model` (the raw GPT, not a compiled or DDP wrapper)."""

    def __init__(self, model: GPT, power_iters: int = 2, seed: int = 0):
        if power_iters < 1:
            raise ValueError(f"power_iters must be >= 1, got {power_iters}")
        self.model, self.power_iters = model, power_iters
        c = model.config
        device = model.wte.weight.device
        gen = torch.Generator().manual_seed(seed)
        start = torch.randn(c.n_layer, 2, c.n_head, c.n_embd, generator=gen)
        self.vectors = F.normalize(start, dim=-1).to(device)
        self.delta_cum = torch.zeros(c.n_layer, c.n_head, dtype=torch.float64, device=device)
        self.prev_mean_term: torch.Tensor | None = None
        self.prev_delta_term: torch.Tensor | None = None
        self.samples = 0

    @torch.no_grad()
    def spectral_norms(self, iters: int | None = None) -> torch.Tensor:
        """(layers, 2, heads): ‖W_Q,h‖₂ and ‖W_K,h‖₂, warm-started power iteration (updates the vectors)."""
        if iters is None:
            iters = FIRST_POWER_ITERS if self.samples == 0 else self.power_iters
        sigma, self.vectors = power_iteration(head_weights(self.model), self.vectors, iters)
        return sigma

    def capture(self, x: torch.Tensor, y: torch.Tensor, autocast=NO_AUTOCAST) -> list[tuple]:
        """Forward + backward on (x, y); per layer (X, q, k, v, O, dO), all detached."""
        layers = self.model.attention_layers()
        saved: dict[int, tuple] = {}

        def probe(layer, x_in, q, k, v, o):
            saved[layer] = (x_in.detach(), q.detach(), k.detach(), v.detach(), o)

        for attn in layers:
            attn.probe = probe
        try:
            with autocast:
                _, loss = self.model(x, y)
            outs = [saved[i][4] for i in range(len(layers))]
            grads = torch.autograd.grad(loss, outs)
        finally:
            for attn in layers:
                attn.probe = None
        return [(*saved[i][:4], outs[i].detach(), grads[i]) for i in range(len(layers))]

    def measure(self, x: torch.Tensor, y: torch.Tensor, autocast=NO_AUTOCAST) -> dict:
        """{signal: [[per head] per layer]} plus "rows" (sampled query rows per head); one host sync."""
        captured = self.capture(x, y, autocast)
        with torch.no_grad():
            specs = [attn.spec for attn in self.model.attention_layers()]
            per_layer = [layer_signals(*c, window=spec.near_tie_window(c[1].dtype),
                                       softcap=self.model.config.attn_softcap)
                         for c, spec in zip(captured, specs, strict=True)]
            out = {name: torch.stack([s[name] for s in per_layer]).double()
                   for name in per_layer[0] if not name.endswith("_term")}
            mean_term = torch.stack([s["mean_term"] for s in per_layer])
            delta_term = torch.stack([s["delta_term"] for s in per_layer])
            self.delta_cum += out["delta_error"]
            out["delta_error_cum"] = self.delta_cum.clone()
            out["rank1_cos_prev"] = _cos_prev(mean_term, self.prev_mean_term).double()
            out["delta_term_cos_prev"] = _cos_prev(delta_term, self.prev_delta_term).double()
            self.prev_mean_term, self.prev_delta_term = mean_term, delta_term
            norms = self.spectral_norms()
            out["wq_norm"], out["wk_norm"] = norms[:, 0].double(), norms[:, 1].double()
            self.samples += 1
            values = torch.stack([out[name] for name in SIGNALS]).cpu().tolist()
            stats = stats_signals(self.model)
        result = {name: [[None if math.isnan(v) and name.endswith("_prev") else v for v in row]
                         for row in layer] for name, layer in zip(SIGNALS, values, strict=True)}
        result.update({name: [[None if math.isnan(v) else v for v in row] for row in layer.tolist()]
                       for name, layer in stats.items()})
        result["rows"] = x.shape[0] * x.shape[1]
        return result

    def state_dict(self) -> dict:
        return {"vectors": self.vectors, "delta_cum": self.delta_cum, "prev_mean_term": self.prev_mean_term,
                "prev_delta_term": self.prev_delta_term, "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        device = self.vectors.device
        self.vectors = state["vectors"].to(device)
        self.delta_cum = state["delta_cum"].to(device)
        self.prev_mean_term, self.prev_delta_term = (None if state[key] is None else state[key].to(device)
                                                     for key in ("prev_mean_term", "prev_delta_term"))
        self.samples = state["samples"]
