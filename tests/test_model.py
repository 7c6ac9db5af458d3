"""GPT: shape, init, per-layer attention routing, per-head fp32 output, QK-LayerNorm, soft-capping."""

from __future__ import annotations

import math

import lowprec.model as model_mod
import pytest
import torch
from lowprec.attention import AttentionSpec, attention, math_attention
from lowprec.model import GPT, GPTConfig, softcap_attention


def small(**kw) -> GPTConfig:
    base = dict(vocab_size=97, block_size=16, n_layer=3, n_head=4, n_embd=32, attention="math")
    return GPTConfig(**{**base, **kw})


def tokens(cfg: GPTConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (batch, cfg.block_size), generator=gen)


def test_shapes_init_and_tied_embeddings():
    torch.manual_seed(0)
    cfg = small(n_layer=4, n_embd=64)
    model = GPT(cfg)
    x = tokens(cfg)
    logits, loss = model(x, tokens(cfg, seed=1))
    assert logits.shape == (2, cfg.block_size, cfg.vocab_size)
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=0.1)
    assert model.lm_head.weight is model.wte.weight
    assert model.blocks[0].attn.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    n = sum(p.numel() for p in model.parameters())
    assert model.num_params() == n - cfg.block_size * cfg.n_embd
    assert model.flops_per_token() == 6 * model.num_params() + 12 * 4 * 64 * 16
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_per_layer_overrides_route_to_backends(monkeypatch):
    calls = []

    def recording(q, k, v, backend="sdpa", causal=True, **kw):
        spec = AttentionSpec.parse(backend)  # the model passes its layer's typed spec
        calls.append((spec.backend, {**spec.kwargs(), **kw}))
        return attention(q, k, v, backend=backend, causal=causal, **kw)

    monkeypatch.setattr(model_mod, "attention", recording)
    # the paper's "flash attention only in layer 2" (index 1) and "standard attention only in layer 2"
    cfg = small(attention="math", layer_attention={"1": "sdpa/sdpa_backend=math", 2: "reference"})
    GPT(cfg)(tokens(cfg))
    assert calls == [("math", {}), ("sdpa", {"sdpa_backend": "math"}), ("reference", {})]
    calls.clear()
    cfg = small(attention="sdpa", layer_attention={1: "math"})
    GPT(cfg)(tokens(cfg))
    assert [c[0] for c in calls] == ["sdpa", "math", "sdpa"]


def test_attention_spec_parsing():
    from lowprec.attention import Fix, Precision
    spec = AttentionSpec.parse("emulated/precision=paper:tile=none/fix=2/block_m=64")
    assert (spec.backend, spec.options) == ("emulated", (("block_m", 64),))
    layer_kw = spec.kwargs()  # plain values (str, int, None): torch.compile keeps them as constants
    assert layer_kw == {"block_m": 64, "precision": "paper:tile=none", "fix": "2"}
    assert Precision.parse(layer_kw["precision"]) == spec.precision and Fix.parse(layer_kw["fix"]) == spec.fix
    assert AttentionSpec.parse("emulated/fix=none").kwargs()["fix"] is None
    assert Fix.parse(AttentionSpec.parse("emulated/fix=true").kwargs()["fix"]) == Fix()
    layer_kw["fix"] = "3"
    assert spec.kwargs()["fix"] == "2"  # a copy each call
    with pytest.raises(ValueError, match="backend must be one of"):
        AttentionSpec.parse("flash2")
    with pytest.raises(ValueError, match="key=value"):
        AttentionSpec.parse("emulated/paper")
    with pytest.raises(ValueError, match="layers are 0-based"):
        small(layer_attention={3: "math"})
    with pytest.raises(ValueError, match="heads are 0-based"):
        small(hp_heads={0: [4]})


def test_hp_heads_run_fp32_and_the_rest_the_backend():
    torch.manual_seed(0)
    cfg = small(hp_heads={1: [0, 2]})
    model = GPT(cfg)
    seen = {}
    model.blocks[1].attn.probe = lambda layer, x, q, k, v, y: seen.update(q=q, k=k, v=v, y=y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens(cfg))
    q, k, v, y = seen["q"], seen["k"], seen["v"], seen["y"]
    assert q.dtype == torch.bfloat16 and y.dtype == torch.float32
    hp = math_attention(q[:, [0, 2]].float(), k[:, [0, 2]].float(), v[:, [0, 2]].float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = math_attention(q[:, [1, 3]], k[:, [1, 3]], v[:, [1, 3]])
    assert torch.equal(y[:, [0, 2]], hp)
    assert torch.equal(y[:, [1, 3]], lp.float())
    assert not torch.equal(y[:, [0, 2]], y[:, [0, 2]].bfloat16().float())  # really fp32 values


def test_qk_layernorm_and_softcap():
    torch.manual_seed(0)
    cfg = small(qk_layernorm=True, attn_softcap=2.0)
    model = GPT(cfg)
    seen = {}
    model.blocks[0].attn.probe = lambda layer, x, q, k, v, y: seen.update(q=q, k=k, v=v, y=y)
    _, loss = model(tokens(cfg), tokens(cfg, seed=1))
    loss.backward()
    q = seen["q"]
    assert torch.allclose(q.mean(-1), torch.zeros(()), atol=1e-5)  # normalised over head_dim
    s = (q @ seen["k"].transpose(-1, -2)) / math.sqrt(q.shape[-1])
    capped = 2.0 * torch.tanh(s / 2.0)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    expected = torch.softmax(capped.masked_fill(~mask, float("-inf")), -1) @ seen["v"]
    torch.testing.assert_close(seen["y"], expected)
    torch.testing.assert_close(softcap_attention(q, seen["k"], seen["v"], 1e6),
                               math_attention(q, seen["k"], seen["v"]), rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # LayerNorm runs in fp32 under autocast
        model(tokens(cfg))
    assert seen["q"].dtype == seen["k"].dtype == seen["v"].dtype == torch.bfloat16
    cfg = small(qk_layernorm=True, attention="sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        GPT(cfg)(tokens(cfg))
    with pytest.raises(ValueError, match="attn_softcap=2.0 needs attention backend in"):
        small(attention="math", layer_attention={1: "sdpa"}, attn_softcap=2.0)


def test_the_compiled_embedding_op_is_the_embedding_and_its_gradient():
    """`lowprec::embedding` (what a compiled GPT looks its tables up with): the lookup and the gradient of
    nn.Embedding, bit for bit, repeated ids included; torch.library's checks of its fake and autograd pass."""
    from lowprec.model import embed

    table = torch.nn.Embedding(50, 8)
    idx = torch.randint(0, 50, (4, 7))
    idx[0, :5] = 3
    out = torch.ops.lowprec.embedding(table.weight, idx)
    grad = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, table.weight, grad)
    (plain,) = torch.autograd.grad(embed(table, idx), table.weight, grad)
    assert torch.equal(out, table(idx)) and torch.equal(ours, plain)
    torch.library.opcheck(torch.ops.lowprec.embedding, (table.weight, idx))
