"""The transformers plug-in (lowprec.hf) on a tiny random Llama: our kernel (under the CPU interpreter) gives
SDPA's logits, trains, reaches the kernel with grouped-query k and v, refuses what it does not run, and its
telemetry counts each layer's signals."""

from __future__ import annotations

import pytest
import torch
from lowprec import hf
from lowprec.attention import flash
from lowprec.attention.fix import STAT_NAMES
from lowprec.attention.plan import softmax_scale

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama(attn: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)


def tokens(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    hf.register("lowprec-test", "triton")
    return llama("lowprec-test")


def test_logits_match_sdpa_and_the_kernel_sees_grouped_heads(model, monkeypatch):
    """Same weights, attn_implementation "sdpa" against ours: logits within bf16's rounding; every call
    reached flash_attention with k and v at the model's 2 key/value heads for its 4 query heads."""
    seen = []
    kernel = flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, **kw: seen.append(
        (q.shape[1], k.shape[1], kw["causal"])) or kernel(q, k, v, **kw))
    ids = tokens()
    with torch.no_grad():
        ours = model(ids).logits.float()
        reference = llama("sdpa")(ids).logits.float()
    torch.testing.assert_close(ours, reference, rtol=1.6e-2, atol=1e-2)
    assert seen == [(4, 2, True)] * CONFIG["num_hidden_layers"]


def test_a_training_step_runs_and_checkpointing_gives_its_gradients(model, monkeypatch):
    """A training step through our forward and backward (fp32 weights, bf16 autocast): a finite loss, a
    gradient on every weight, an AdamW step. With transformers' gradient checkpointing, reentrant (its first
    forward runs without gradients, so without autograd's Function) and not: the same loss and gradients
    bit for bit."""
    calls = {"forward": 0, "autograd": 0}
    forward, apply = flash._flash_forward, flash._EagerFlash.apply
    monkeypatch.setattr(flash, "_flash_forward", lambda *a: calls.update(forward=calls["forward"] + 1)
                        or forward(*a))
    monkeypatch.setattr(flash._EagerFlash, "apply", lambda *a: calls.update(autograd=calls["autograd"] + 1)
                        or apply(*a))
    ids = tokens()
    losses, grads, without = {}, {}, {}
    for reentrant in (None, True, False):
        calls.update(forward=0, autograd=0)
        trained = llama("lowprec-test", torch.float32).train()
        if reentrant is not None:
            trained.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = trained(ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in trained.parameters())
        losses[reentrant] = loss.item()
        grads[reentrant] = torch.cat([p.grad.flatten() for p in trained.parameters()])
        without[reentrant] = calls["forward"] - calls["autograd"]  # forwards that skipped autograd
    assert losses[None] == losses[True] == losses[False] and torch.isfinite(grads[None]).all()
    assert torch.equal(grads[None], grads[True]) and torch.equal(grads[None], grads[False])
    assert without == {None: 0, True: CONFIG["num_hidden_layers"], False: 0}
    torch.optim.AdamW(trained.parameters(), lr=1e-3).step()


@pytest.mark.parametrize("use_cache", [True, False])
def test_under_autocast_the_kernel_and_telemetry_get_autocasts_dtype(model, monkeypatch, use_cache):
    """An fp32 model under bf16 autocast (as `bench hf` trains): RoPE leaves q and k in fp32, and the cache
    (use_cache) the values too; the plug-in casts them to bf16 as SDPA's inputs are cast, so the kernel and
    telemetry see bf16, and the logits are SDPA's within bf16's rounding."""
    seen = {"kernel": [], "telemetry": []}
    kernel, signals = flash.flash_attention, hf.score_signals
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, **kw: seen["kernel"].append(
        (q.dtype, k.dtype, v.dtype)) or kernel(q, k, v, **kw))
    monkeypatch.setattr(hf, "score_signals", lambda q, k, *args: seen["telemetry"].append(
        (q.dtype, k.dtype)) or signals(q, k, *args))
    ids = tokens()
    ours = llama("lowprec-test", torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with hf.Telemetry(ours):
            logits = ours(ids, use_cache=use_cache).logits.float()
        reference = llama("sdpa", torch.float32)(ids, use_cache=use_cache).logits.float()
    layers = CONFIG["num_hidden_layers"]
    assert seen == {"kernel": [(torch.bfloat16,) * 3] * layers, "telemetry": [(torch.bfloat16,) * 2] * layers}
    torch.testing.assert_close(logits, reference, rtol=1.6e-2, atol=1e-2)


def test_greedy_generation_under_autocast_gives_sdpas_tokens(model):
    """model.generate through the plug-in (a prefill, then one query a step against the key/value cache),
    fp32 weights under bf16 autocast: SDPA's greedy tokens."""
    ids = tokens(seq=8)
    out = {}
    for attn in ("lowprec-test", "sdpa"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[attn] = llama(attn, torch.float32).eval().generate(ids, max_new_tokens=6, do_sample=False,
                                                                  pad_token_id=0)
    assert out["lowprec-test"].shape == (2, 14) and torch.equal(out["lowprec-test"], out["sdpa"])


def test_a_masked_call_is_refused_or_runs_through_sdpa_when_asked(model):
    """A padding mask raises a ValueError that says what to do; with masked="sdpa" the same call gives SDPA's
    logits. A mask of ones is no mask."""
    ids = tokens()
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="masked='sdpa'"):
        model(ids, attention_mask=padded)
    hf.register("lowprec-test", "triton", masked="sdpa")
    try:
        with torch.no_grad():
            ours = model(ids, attention_mask=padded).logits
            reference = llama("sdpa")(ids, attention_mask=padded).logits
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    finally:
        hf.register("lowprec-test", "triton")
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids)).logits, model(ids).logits)


def test_a_compiled_model_runs_the_kernel_without_a_mask(model):
    """Under torch.compile (aot_eager on the CPU) transformers' own mask function masks every call; the
    plug-in's (`causal_or_sdpa_mask`) gives none for plain causal attention, so the compiled model runs our
    kernel and gives the eager model's logits. A padding mask and sliding windows still get a mask."""
    ids = tokens()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0, atol=0)
    torch._dynamo.reset()
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    plain = dict(batch_size=1, q_length=4, kv_length=4)
    assert hf.causal_or_sdpa_mask(**plain, mask_function=causal_mask_function) is None
    padded = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    windowed = and_masks(causal_mask_function, sliding_window_overlay(2))
    assert hf.causal_or_sdpa_mask(**plain, attention_mask=padded, allow_is_causal_skip=False) is not None
    assert hf.causal_or_sdpa_mask(**plain, mask_function=windowed, local_size=2, allow_is_causal_skip=False
                                  ) is not None


def test_telemetry_counts_each_layers_signals(model, monkeypatch):
    """Per layer and head: the kernel's counters and the scores' signals, which agree where they count the
    same thing, and the first layer's max logit against a direct computation from the q and k the kernel
    saw."""
    captured = []
    kernel = flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, **kw: captured.append((q, k)) or kernel(
        q, k, v, **kw))
    ids = tokens()
    with torch.no_grad(), hf.Telemetry(model) as telemetry:
        model(ids)
    assert telemetry.plugin.probe is None
    signals = telemetry.signals()
    layers, heads = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"]
    assert signals["layers"] == [f"model.layers.{i}.self_attn" for i in range(layers)]
    for name in (*hf.SCORE_SIGNALS, "rows", *STAT_NAMES):
        assert len(signals[name]) == layers and all(len(row) == heads for row in signals[name]), name
    assert signals["rows"] == [[ids.numel()] * heads] * layers
    assert all(ones >= ids.numel() for row in signals["pbar_ones"] for ones in row)  # each row's max: P̄ = 1
    # 32 keys fit one key tile: the kernel's per-tile tie counts are the rows' counts from the scores
    for kernel_count, score_count in (("near_tie_tiles", "near_tie_rows"), ("tie_tiles", "tie_rows")):
        assert signals[kernel_count] == signals[score_count]
    q, k = captured[0]
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)).float() * softmax_scale(16)
    s = s.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    assert signals["max_logit"][0] == s.amax((0, 2, 3)).tolist()


def test_telemetry_measures_masked_calls_under_their_mask(model, monkeypatch):
    """With masked="sdpa", a padded batch's calls run through SDPA and telemetry measures their scores under
    the call's mask: the left-padded sequence's 4 padding rows see no key and are not counted, the largest
    logit is the masked scores'; the kernel's counters cover only the kernel's calls (kernel_rows)."""
    captured = []
    signals_of = hf.score_signals
    monkeypatch.setattr(hf, "score_signals", lambda q, k, causal, scale, window, mask=None: captured.append(
        (q, k, mask)) or signals_of(q, k, causal, scale, window, mask))
    ids = tokens()
    padded = torch.ones_like(ids)
    padded[0, :4] = 0
    hf.register("lowprec-test", "triton", masked="sdpa")
    try:
        with torch.no_grad(), hf.Telemetry(model) as telemetry:
            model(ids, attention_mask=padded)
        masked = telemetry.signals()
        with torch.no_grad(), hf.Telemetry(model) as telemetry:
            model(ids, attention_mask=padded)
            model(ids)
        both = telemetry.signals()
    finally:
        hf.register("lowprec-test", "triton")
    layers, heads = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"]
    assert masked["rows"] == [[ids.numel() - 4] * heads] * layers and not set(STAT_NAMES) & set(masked)
    q, k, mask = captured[0]
    assert mask is not None and mask.dtype == torch.bool
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)).float() * softmax_scale(16)
    assert masked["max_logit"][0] == s.masked_fill(~mask, float("-inf")).amax((0, 2, 3)).tolist()
    assert both["rows"] == [[2 * ids.numel() - 4] * heads] * layers
    assert both["kernel_rows"] == [[ids.numel()] * heads] * layers and set(STAT_NAMES) <= set(both)


def test_score_signals_read_every_form_of_mask_alike(monkeypatch):
    """One pattern as a boolean mask, as additive masks (0 where visible, the lowest value of fp32 or bf16
    elsewhere, as transformers' eager masks; bf16's in an fp32 mask too), per head, and chunked a row at a
    time: the same signals; with `causal` the mask and the causal mask combine; a row with no visible key is
    not counted. A key-padding mask (B, 1, 1, Nk) reads as its rows broadcast, chunked too."""
    q, k = torch.randn(2, 4, 8, 16).bfloat16(), torch.randn(2, 2, 8, 16).bfloat16()
    visible = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.3
    visible[0, 0, 0] = False  # batch 0's first row sees no key
    window = 2.0 ** -9

    def signals(causal: bool, mask: torch.Tensor) -> dict[str, list[float]]:
        out = hf.score_signals(q, k, causal, None, window, mask)
        return {name: value.tolist() for name, value in out.items()}

    def additive(mask: torch.Tensor, dtype: torch.dtype, lowest: torch.dtype) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(lowest).min)

    boolean = signals(False, visible)
    assert boolean["rows"] == [float(visible.any(-1).sum())] * 4 and boolean["rows"][0] < 16
    forms = [additive(visible, dtype, lowest) for dtype, lowest in (
        (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16))]
    assert all(signals(False, mask) == boolean for mask in [*forms, visible.expand(2, 4, 8, 8)])
    lower = torch.ones(8, 8, dtype=torch.bool).tril()
    assert signals(True, visible) == signals(False, visible & lower) != boolean
    padding = torch.tensor([[1] * 8, [0, 0] + [1] * 6], dtype=torch.bool)[:, None, None, :]
    whole = signals(True, padding)
    monkeypatch.setattr(hf, "SCORES_PER_CHUNK", 1)  # one row at a time
    assert signals(False, visible) == boolean and signals(True, padding) == whole
    assert whole["rows"] == [14.0] * 4  # batch 1's first two rows see no key


def test_telemetry_keeps_counters_when_a_layer_ran_only_through_sdpa(model):
    """A layer whose calls all ran through SDPA (no counters) beside one the kernel ran: the counters stay,
    0 (and kernel_rows 0) for the first."""
    telemetry = hf.Telemetry(model)
    masked, kernel = (torch.nn.Identity() for _ in range(2))
    ones = torch.ones(4, dtype=torch.float64)
    telemetry.layers = {masked: {"max_logit": ones, "rows": 3 * ones},
                        kernel: {"max_logit": ones, "rows": 5 * ones, "kernel_rows": 5 * ones,
                                 "pbar_ones": 7 * ones}}
    signals = telemetry.signals()
    assert signals["kernel_rows"] == [[0.0] * 4, [5.0] * 4] and signals["pbar_ones"] == [[0.0] * 4, [7.0] * 4]
    assert signals["rows"] == [[3.0] * 4, [5.0] * 4]


SMALL = dict(CONFIG, num_hidden_layers=1, num_key_value_heads=4, pad_token_id=0)  # one layer: fast
SEQ2SEQ = dict(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
               max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=0)
FAMILIES = {  # config, its arguments, auto class, the causal flag of each attention call in order
    "qwen2": ("Qwen2Config", dict(SMALL, num_key_value_heads=2), "CausalLM", [True]),
    "qwen3": ("Qwen3Config", dict(SMALL, num_key_value_heads=2, head_dim=16), "CausalLM", [True]),
    "gemma2": ("Gemma2Config", dict(SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=None, final_logit_softcapping=None), "CausalLM",
               [True]),
    "phi": ("PhiConfig", SMALL, "CausalLM", [True]),
    "gpt_neox": ("GPTNeoXConfig", SMALL, "CausalLM", [True]),
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64,
                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), "CausalLM", [True]),
    "bert": ("BertConfig", dict(SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "MaskedLM",
             [False]),
    "bart": ("BartConfig", SEQ2SEQ, "Seq2SeqLM", [False, True, False]),  # encoder, decoder, cross-attention
}


def family_model(family: str, attn: str, dtype: torch.dtype, **overrides) -> torch.nn.Module:
    config, kwargs, auto, _ = FAMILIES[family]
    torch.manual_seed(0)
    auto = getattr(transformers, f"AutoModelFor{auto}")
    config = getattr(transformers, config)(**kwargs | overrides)
    return auto.from_config(config, attn_implementation=attn, dtype=dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_give_sdpas_logits_and_gradients(model, monkeypatch, family):
    """Other model families (grouped heads, biases, QK-norm, partial rotary, the model's own scale, GPT-2's
    attention, an encoder, an encoder-decoder's cross-attention with fewer queries than keys): every attention
    call reaches the kernel, causal where the model is; logits within bf16's rounding of SDPA's, and one
    step's gradients (fp32 weights, bf16 autocast) within 2% of SDPA's."""
    seen = []
    kernel = flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, **kw: seen.append(
        (kw["causal"], kw["scale"])) or kernel(q, k, v, **kw))
    ids = tokens(seq=24)
    inputs = dict(input_ids=ids, labels=ids) if family != "bart" else dict(
        input_ids=ids, decoder_input_ids=ids[:, :10], labels=ids[:, :10].contiguous())
    logits, grads = {}, {}
    for attn in ("lowprec-test", "sdpa"):
        with torch.no_grad():
            logits[attn] = family_model(family, attn, torch.bfloat16).eval()(**inputs).logits.float()
        trained = family_model(family, attn, torch.float32).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trained(**inputs).loss.backward()
        grads[attn] = torch.cat([p.grad.flatten() for p in trained.parameters() if p.grad is not None])
    calls = FAMILIES[family][3]
    assert [causal for causal, _ in seen] == calls * 2  # evaluation, then the training step's forward
    if family == "gemma2":  # its scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
        assert {scale for _, scale in seen} == {24 ** -0.5}
    torch.testing.assert_close(logits["lowprec-test"], logits["sdpa"], rtol=1.6e-2, atol=1e-2)
    assert (grads["lowprec-test"] - grads["sdpa"]).norm() < 0.02 * grads["sdpa"].norm()


def test_dropout_is_refused_naming_the_configs_attribute(model):
    """Attention dropout in training is refused in one line that names the family's config attribute."""
    ids = tokens(seq=8)
    for family, name in (("gpt2", "attn_pdrop"), ("qwen2", "attention_dropout")):
        with pytest.raises(ValueError, match=f"config's {name} to 0"):
            family_model(family, "lowprec-test", torch.float32, **{name: 0.1}).train()(ids)
        with torch.no_grad():
            family_model(family, "lowprec-test", torch.float32, **{name: 0.1}).eval()(ids)  # none in eval


def test_register_refuses_transformers_names_and_unknown_options():
    for kwargs, words in (({"name": "sdpa"}, "transformers' own"), ({"masked": "pad"}, "masked must"),
                          ({"spec": "triton/fix=0.5"}, "beta")):
        with pytest.raises(ValueError, match=words):
            hf.register(**{"name": "lowprec-test-2", **kwargs})
    with pytest.raises(ValueError, match="plug-in"):
        hf.Telemetry(llama("sdpa"))
