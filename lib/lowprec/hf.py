"""Our attention in `transformers` models: a plug-in for its attention interface, and telemetry of its calls.

    from lowprec import hf
    hf.register("lowprec", "triton/precision=fa2/fix=2")   # any AttentionSpec; "triton" is fa2, no Fix
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="lowprec")
    with hf.Telemetry(model) as telemetry:
        model(input_ids)
    telemetry.signals()   # {signal: [[per head] per layer]}

The model computes q, k and v (RoPE applied, k and v with their own heads: grouped-query attention reaches the
kernel as it is; under autocast q, k and v are cast to its dtype, as SDPA's are, before the kernel and
telemetry see them: RoPE leaves q and k in fp32 there, and a cache the values); a call without a mask runs
causal attention (or full attention where the model asks for it, and for a single query), with the model's
scale. The plug-in's mask function (`causal_or_sdpa_mask`) gives no mask for plain causal attention without a
padding mask, under torch.compile too. A padding, packing or other mask, dropout, soft-capping, attention
sinks and position biases are refused with a ValueError, or a masked call runs through transformers' SDPA
where `masked="sdpa"` (telemetry then measures its scores under its mask). Importing this module does not
import transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowprec.attention import AttentionSpec, attention
from lowprec.attention.fix import STAT_NAMES, AttentionStats, ties
from lowprec.attention.plan import softmax_scale
from lowprec.attention.reference import autocast_qkv, causal_mask, expand_kv

MASKED = ("error", "sdpa")
REFUSED = ("softcap", "s_aux", "position_bias")  # keywords of the interface that change the softmax
# the config attribute of attention dropout, by family (Llama, GPT-2, BERT, ...)
DROPOUT_NAMES = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
SCORE_SIGNALS = ("max_logit", "tie_rows", "near_tie_rows")
SCORES_PER_CHUNK = 1 << 24  # scores held at once while telemetry measures a call


@dataclass
class Plugin:
    """A registered attention implementation: the spec it runs, what it does with a masked call, and the
    telemetry probe while one is open (`Telemetry`)."""

    name: str
    spec: AttentionSpec
    masked: str
    fallback: Callable | None = None  # transformers' SDPA, for masked calls
    probe: Callable | None = None

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """transformers' attention function: q (B, H, Nq, D), k and v (B, H_kv, Nk, D); returns the output as
        (B, Nq, H, D) and no weights, as its SDPA function does."""
        if dropout:
            raise ValueError(f"attention {self.name!r} has no dropout, got dropout={dropout}: set the model "
                             f"config's {dropout_name(module, dropout)} to 0 (or call model.eval())")
        refused = [name for name in REFUSED if kwargs.get(name) is not None]
        if refused:
            raise ValueError(f"attention {self.name!r} does not take {refused}; use "
                             "attn_implementation='sdpa' or 'eager' for this model")
        if attention_mask is not None:
            if self.fallback is None:
                raise ValueError(
                    f"attention {self.name!r} runs causal attention without a mask, but this call has a mask "
                    f"of shape {tuple(attention_mask.shape)} (padding, packed sequences, a sliding window or "
                    "another pattern; under torch.compile any attention_mask, even of ones): pass none on "
                    f"unpadded batches without position_ids resets, or register({self.name!r}, ..., "
                    "masked='sdpa') to run masked calls through SDPA")
            if self.probe is not None:  # the scores SDPA computes, under the call's mask
                self.probe(module, *autocast_qkv(query, key), False, scaling, None, attention_mask)
            return self.fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
        query, key, value = autocast_qkv(query, key, value)  # as SDPA: RoPE's q, k are fp32 under autocast
        n_q = query.shape[2]
        causal = n_q > 1 and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if causal and key.shape[2] > n_q:  # a prefill into an empty static cache: SDPA's keys, too
            key, value = key[:, :, :n_q], value[:, :, :n_q]
        if self.probe is not None and self.spec.caps.stats:
            o, stats = attention(query, key, value, backend=self.spec, causal=causal, scale=scaling,
                                 return_stats=True)
            self.probe(module, query, key, causal, scaling, stats)
        else:
            o = attention(query, key, value, backend=self.spec, causal=causal, scale=scaling)
            if self.probe is not None:
                self.probe(module, query, key, causal, scaling, None)
        return o.transpose(1, 2).contiguous(), None


def dropout_name(module: torch.nn.Module, dropout: float) -> str:
    """The name of the attention dropout in `module`'s config (families name it differently), for messages."""
    config = getattr(module, "config", None)
    names = [name for name in DROPOUT_NAMES if getattr(config, name, None) == dropout]
    return names[0] if names else "attention dropout"


PLUGINS: dict[str, Plugin] = {}


def register(name: str = "lowprec", spec: AttentionSpec | str = "triton", masked: str = "error") -> Plugin:
    """Register `spec` (an AttentionSpec or its string: backend, precision placement, Fix) with
    transformers under `name`, for `attn_implementation=name`; masked: "error" (a masked call raises) or
    "sdpa" (it runs through transformers' SDPA). Registering a name again replaces its plug-in."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if (name == "eager" or name in AttentionInterface._global_mapping) and name not in PLUGINS:
        raise ValueError(f"name {name!r} is transformers' own attention implementation; choose another")
    if masked not in MASKED:
        raise ValueError(f"masked must be one of {MASKED}, got {masked!r}")
    fallback = sdpa_attention_forward if masked == "sdpa" else None
    plugin = Plugin(name, AttentionSpec.parse(spec), masked, fallback)
    AttentionInterface.register(name, plugin)
    AttentionMaskInterface.register(name, causal_or_sdpa_mask)
    PLUGINS[name] = plugin
    return plugin


def causal_or_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                        mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                        local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs):
    """The plug-ins' mask function for transformers: None (the kernel's own causal mask) for a plain causal
    call without a padding mask, decided from the call's arguments alone (transformers' `sdpa_mask` looks at
    the padding mask's values, and under torch.compile gives every call a mask); any other call
    (padding, packed sequences, sliding windows, a cache whose keys do not line up) gets `sdpa_mask`'s."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    lined_up = q_length == 1 or kv_length == q_length or q_offset == 0  # the kernel's (sliced) causal rows
    if (allow_is_causal_skip and attention_mask is None and mask_function is causal_mask_function
            and local_size is None and lined_up):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     local_size, allow_is_causal_skip, **kwargs)


def score_signals(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None, window: float,
                  mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-head signals of one call's scores (fp32, as the kernel computes them: the dot exact, rounded once,
    times the fp32 scale): max_logit (over batch and rows), tie_rows (rows whose maximum occurs more than
    once), near_tie_rows (rows with another score within `window` of the maximum) and rows (rows with a
    visible key), as (heads,) float64; query rows in chunks of at most SCORES_PER_CHUNK scores. mask (with
    `causal` or alone): a transformers attention mask broadcastable to (B, H, Nq, Nk), boolean (True:
    visible) or added to the scores (values below half its dtype's lowest, -inf included: not visible)."""
    B, H, n_q, D = q.shape
    n_k = k.shape[2]
    scale = softmax_scale(D, scale)
    k = expand_kv(k, H).double()
    bias = None
    if mask is not None:
        mask = mask.expand(B, H, n_q, n_k)  # a view: each chunk of rows slices its own
        if mask.dtype != torch.bool:  # additive: any dtype's lowest value (or -inf) hides a key
            bias, mask = mask, mask > torch.finfo(mask.dtype).min / 2
    visible = causal_mask(n_q, q.device, n_k) if causal else None
    if mask is not None:
        visible = mask if visible is None else visible & mask
    out = {name: torch.zeros(H, dtype=torch.float64, device=q.device) for name in (*SCORE_SIGNALS, "rows")}
    out["max_logit"].fill_(-math.inf)
    step = max(1, SCORES_PER_CHUNK // (B * H * n_k))
    for start in range(0, n_q, step):
        rows = slice(start, start + step)
        s = (q[:, :, rows].double() @ k.transpose(-1, -2)).float() * scale
        if bias is not None:
            s = s + bias[..., rows, :]
        if visible is not None:
            s = s.masked_fill(~visible[..., rows, :], -math.inf)
        r = s.amax(-1)
        exact, near = ties(s, r, window)
        out["max_logit"] = torch.maximum(out["max_logit"], r.amax((0, 2)).double())
        out["tie_rows"] += exact.sum((0, 2))
        out["near_tie_rows"] += near.sum((0, 2))
        out["rows"] += (r > -math.inf).sum((0, 2))
    return out


class Telemetry:
    """The paper's per-head signals of every attention call `model` makes through its plug-in while the
    context is open: the scores' `SCORE_SIGNALS` and `rows` (rows with a visible key), and, from a backend
    with statistics, the kernel's counters (STAT_NAMES) summed over batch and rows, with `kernel_rows`, the
    rows they cover: a masked call that runs through SDPA (masked="sdpa") gives its scores' signals under
    its mask, not counters. One plug-in serves every model registered under its name."""

    def __init__(self, model: torch.nn.Module):
        name = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if name not in PLUGINS:
            raise ValueError(f"model must use a plug-in of lowprec.hf.register ({sorted(PLUGINS) or 'none'})"
                             f"; its attn_implementation is {name!r}")
        self.plugin = PLUGINS[name]
        self.names = {module: path for path, module in model.named_modules()}
        self.layers: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}

    def __enter__(self) -> Telemetry:
        self.plugin.probe = self.record
        return self

    def __exit__(self, *exc) -> None:
        self.plugin.probe = None

    @torch.no_grad()
    def record(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, causal: bool,
               scale: float | None, stats: AttentionStats | None, mask: torch.Tensor | None = None) -> None:
        """Add one call's signals to its layer's (the probe the plug-in calls; `mask`: a masked call's,
        which SDPA runs)."""
        window = self.plugin.spec.near_tie_window(q.dtype)
        signals = score_signals(q.detach(), k.detach(), causal, scale, window, mask)
        if stats is not None:
            signals["kernel_rows"] = torch.full_like(signals["rows"], q.shape[0] * q.shape[2])
            signals |= {name: getattr(stats, name).sum((0, 2)).double() for name in STAT_NAMES}
        layer = self.layers.setdefault(module, {})
        for name, value in signals.items():
            layer[name] = value if name not in layer else (
                torch.maximum(layer[name], value) if name == "max_logit" else layer[name] + value)

    def signals(self) -> dict[str, list]:
        """{signal: [[value per head] per layer]} in the order the layers were first called, and "layers":
        their module names; the kernel's counters and kernel_rows are 0 in a layer whose calls all ran
        through SDPA; one host sync."""
        layers = list(self.layers.values())
        if not layers:
            return {"layers": []}
        names = list(dict.fromkeys(name for layer in layers for name in layer))
        zeros = torch.zeros_like(layers[0]["rows"])  # a layer whose calls all ran through SDPA: no counters
        values = torch.stack([torch.stack([layer.get(name, zeros) for layer in layers]) for name in names])
        values = values.tolist()
        return {"layers": [self.names.get(module, "") for module in self.layers],
                **dict(zip(names, values, strict=True))}
