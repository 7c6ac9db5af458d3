"""GPT in the nanoGPT shape, with attention chosen per layer and per head.

Pre-LayerNorm blocks, GELU MLP, learned positions, tied embeddings, no dropout. Attention is an
`AttentionSpec` (or its string) for the model, `layer_attention` overrides it per layer (0-indexed: the
paper's "layer 2" is index 1) and `hp_heads` runs chosen heads in fp32; how the paper's localisation
experiments map onto them: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowprec.attention import AttentionSpec, attention
from lowprec.attention.fix import Fix
from lowprec.attention.reference import causal_mask, scaled_scores
from lowprec.attention.spec import backends_with
from lowprec.checks import number


@dataclass
class GPTConfig:
    """Model shape and attention choice. Layer and head indices are 0-based (the paper's layer 2 is 1)."""

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = False
    attention: AttentionSpec = field(default_factory=AttentionSpec)     # every layer (a spec or its string)
    layer_attention: dict[int, AttentionSpec] = field(default_factory=dict)  # layer -> spec (replaces it)
    hp_heads: dict[int, list[int]] = field(default_factory=dict)     # layer -> heads whose O is fp32
    qk_layernorm: bool = False                                       # LayerNorm over head_dim on q and k
    attn_softcap: float = 0.0                                        # s -> c*tanh(s/c) on scores; 0 = off

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            number(f"GPTConfig.{name}", getattr(self, name), int, 1)
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        self.attention = AttentionSpec.parse(self.attention)
        self.layer_attention = {int(k): AttentionSpec.parse(v) for k, v in self.layer_attention.items()}
        self.hp_heads = {int(k): sorted({int(h) for h in v}) for k, v in self.hp_heads.items()}
        for what, keys in (("layer_attention", self.layer_attention), ("hp_heads", self.hp_heads)):
            bad = [k for k in keys if not 0 <= k < self.n_layer]
            if bad:
                raise ValueError(f"GPTConfig.{what} has layers {bad}; layers are 0-based in "
                                 f"[0, {self.n_layer})")
        for layer, heads in self.hp_heads.items():
            bad = [h for h in heads if not 0 <= h < self.n_head]
            if bad:
                raise ValueError(f"GPTConfig.hp_heads[{layer}] has heads {bad}; heads are 0-based in "
                                 f"[0, {self.n_head})")
        number("GPTConfig.attn_softcap (0 = off)", self.attn_softcap, float, 0)
        for name in ("bias", "qk_layernorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for layer in range(self.n_layer):
            spec = self.layer_spec(layer)
            if self.attn_softcap and not spec.caps.softcap:
                raise ValueError(f"attn_softcap={self.attn_softcap} needs attention backend in "
                                 f"{backends_with('softcap')} (layer {layer} uses {spec.backend!r}, which "
                                 "cannot cap)")

    def layer_spec(self, layer: int) -> AttentionSpec:
        """The attention spec of `layer` (0-based): its override, else the default."""
        return self.layer_attention.get(layer, self.attention)

    def with_fix(self, fix: Fix | float | None) -> GPTConfig:
        """This config with the Fix set (None: removed) in every spec whose backend takes one (the default
        and each layer_attention override); the other specs are kept. ValueError if no layer takes one."""
        specs = [self.layer_spec(layer) for layer in range(self.n_layer)]
        if not any(spec.caps.fix for spec in specs):
            raise ValueError(f"no layer can take the Fix: the model's attention specs "
                             f"{sorted({str(s) for s in specs})} use none of the backends "
                             f"{backends_with('fix')}")

        def fixed(spec: AttentionSpec) -> AttentionSpec:
            return spec.with_fix(fix) if spec.caps.fix else spec

        layers = {layer: fixed(spec) for layer, spec in self.layer_attention.items()}
        return replace(self, attention=fixed(self.attention), layer_attention=layers)

    def to_dict(self) -> dict:
        """Plain values for config files and records: specs as their strings."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["attention"] = str(self.attention)
        out["layer_attention"] = {layer: str(spec) for layer, spec in self.layer_attention.items()}
        out["hp_heads"] = {layer: list(heads) for layer, heads in self.hp_heads.items()}
        return out


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: float) -> torch.Tensor:
    """Causal attention with soft-capped scores cap*tanh(s/cap), s = q k^T / sqrt(d), in the input dtype."""
    s = cap * torch.tanh(scaled_scores(q, k) / cap)  # cap first, then mask: cap*tanh(-inf) would be -cap
    return torch.softmax(s.masked_fill(~causal_mask(q.shape[2], q.device), float("-inf")), dim=-1) @ v


# Telemetry probe: called as probe(layer, x, q, k, v, y) with the attention input x (B, T, C), the q, k, v
# that attention saw and its output y (all (B, H, T, D)); y is the tensor used downstream (dO = its grad).
Probe = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer, self.n_head = layer, config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        head_dim = config.n_embd // config.n_head
        self.q_ln = nn.LayerNorm(head_dim, bias=config.bias) if config.qk_layernorm else None
        self.k_ln = nn.LayerNorm(head_dim, bias=config.bias) if config.qk_layernorm else None
        self.spec = config.layer_spec(layer)
        self.softcap = config.attn_softcap
        self.hp_heads = config.hp_heads.get(layer, [])
        self.lp_heads = [h for h in range(config.n_head) if h not in self.hp_heads]
        order = self.lp_heads + self.hp_heads
        self.register_buffer("head_order", torch.tensor([order.index(h) for h in range(config.n_head)]),
                             persistent=False)
        self.probe: Probe | None = None
        self.stats = None  # AttentionStats of the low-precision heads, kept while a probe is set (telemetry)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if self.q_ln is not None:  # autocast runs LayerNorm in fp32: back to v's dtype, as a kernel would get
            q, k = self.q_ln(q).to(v.dtype), self.k_ln(k).to(v.dtype)
        y = self.attend(q, k, v)
        if self.probe is not None:
            self.probe(self.layer, x, q, k, v, y)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output (B, H, T, D): the layer's backend, with `hp_heads` through the fp32 path."""
        if not self.hp_heads:
            return self.via_backend(q, k, v)
        lp, hp = self.lp_heads, self.hp_heads
        with torch.autocast(q.device.type, enabled=False):
            o_hp = self.via_fp32(q[:, hp].float(), k[:, hp].float(), v[:, hp].float())
        if not lp:
            return o_hp
        o_lp = self.via_backend(q[:, lp], k[:, lp], v[:, lp])
        return torch.cat([o_lp.to(o_hp.dtype), o_hp], dim=1)[:, self.head_order]

    def via_backend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The layer's attention spec (or the soft-capped math path)."""
        if self.softcap:
            return softcap_attention(q, k, v, self.softcap)
        if self.probe is not None and self.spec.caps.stats:
            o, self.stats = attention(q, k, v, backend=self.spec, causal=True, return_stats=True)
            return o
        return attention(q, k, v, backend=self.spec, causal=True)

    def via_fp32(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """fp32 math attention (q, k, v already fp32, autocast off), soft-capped if the model caps."""
        if self.softcap:
            return softcap_attention(q, k, v, self.softcap)
        return attention(q, k, v, backend="math", causal=True)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@torch.library.custom_op("lowprec::embedding", mutates_args=())
def _embedding(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.embedding(idx, weight)


@_embedding.register_fake
def _embedding_fake(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*idx.shape, weight.shape[1]))


@torch.library.custom_op("lowprec::embedding_backward", mutates_args=())
def _embedding_backward(grad: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.aten.embedding_dense_backward(grad, idx, rows, -1, False)


@_embedding_backward.register_fake
def _embedding_backward_fake(grad: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    return grad.new_empty((rows, grad.shape[-1]))


def _embedding_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.rows = inputs[0].shape[0]


def _embedding_grad(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.lowprec.embedding_backward(grad, ctx.saved_tensors[0], ctx.rows), None


_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


def embed(table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """`table(idx)`; compiled, through ops Inductor keeps whole, so that the backward is PyTorch's own sorted
    sum (deterministic and fast on repeated ids) rather than Inductor's index_put (atomic adds, or in
    deterministic mode a sort that sums each id's rows one after another)."""
    return torch.ops.lowprec.embedding(table.weight, idx) if torch.compiler.is_compiling() else table(idx)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                torch.nn.init.normal_(proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, with targets, the mean cross-entropy (computed in fp32)."""
        T = idx.shape[1]
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = embed(self.wte, idx) + embed(self.wpe, torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def attention_layers(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.blocks]

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (tied embedding once); without position embeddings by default (nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 N (N = non-embedding params, incl. the tied lm_head) + 12 L C T for the
        attention scores and P V (nanoGPT/PaLM convention: full, non-causal T x T)."""
        c = self.config
        t = c.block_size if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * t
