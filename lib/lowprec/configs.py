"""Training configs: `TrainConfig`, the named configs (`CONFIGS`) and `--set key=value` overrides.

`smoke-cpu` trains in seconds on a CPU (tests, the book); `gpu-6l` (6L/6H/384, GPT-2 BPE) and
`gpu-12l-narrow` (12L/6H/384) are the explosion hunt's models; `paper-gpt2-small` is the paper's recipe
(12L/12H/768, 524,288 tokens per step; run it under `torchrun --nproc_per_node=N`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lowprec.checks import number
from lowprec.model import GPTConfig


@dataclass
class TrainConfig:
    """Everything a run needs. Steps are optimizer updates, 0-based."""

    name: str = "custom"
    model: GPTConfig = field(default_factory=GPTConfig)
    data: str = "sample:bytes"   # "sample:bytes"/"sample:gpt2" (the committed sample), a token folder, or
                                 # "" = lowprec.data's default folder ($LOWPREC_DATA or data/gpt2-<sources>)
    seed: int = 1337             # model init and batch order (the sampler is a pure function of (seed, step))
    batch_size: int = 32         # sequences per micro-batch per process
    grad_accum: int = 1          # micro-batches per step, summed over all processes (divisible by world size)
    max_iters: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_iters: int = 100      # linear warmup lr*(step+1)/(warmup+1), then cosine to min_lr
    lr_decay_iters: int = 0      # end of the cosine (0: max_iters)
    weight_decay: float = 0.0    # on 2-D weights only (nanoGPT: matrices and embeddings; not biases or norms)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0       # global norm; 0 = off
    dtype: str = "bfloat16"      # autocast dtype ("bfloat16") or "float32" (no autocast)
    device: str = "auto"         # "auto" = cuda if available else cpu
    compile: bool | None = None  # torch.compile the model; None = on for cuda, off for cpu
    allow_tf32: bool = False     # the paper's code keeps TF32 off
    deterministic: bool = True   # the same seed gives the same weights in every run (`train.set_determinism`;
                                 # records made before this key: false)
    log_interval: int = 10       # metrics every this many steps (one host sync each)
    eval_interval: int = 0       # validation loss every this many steps (a multiple of log_interval); 0 = off
    eval_batches: int = 4        # micro-batches of the (fixed) validation windows per evaluation
    telemetry_interval: int = 0  # telemetry every this many steps (a multiple of log_interval); 0 = off
    telemetry_seqs: int = 1      # sequences of the step's batch that telemetry looks at
    telemetry_power_iters: int = 2
    ckpt_interval: int = 500     # checkpoint every this many steps (multiple of log_interval); 0 = at the
                                 # end and on interrupt only; -1 = never (benchmarks)
    ckpt_dir: str = ""           # "" = <out>/checkpoint (kept out of git by a .gitignore written there)
    ckpt_keep: bool = False      # also keep each checkpoint as <ckpt_dir>/ckpt-<step:06d>.pt (a hard link to
                                 # ckpt.pt; a full file on disk each): the starting points of `lowprec replay`
    diverge_factor: float = 3.0  # stop when loss > factor * its minimum since warmup (0 = NaN/Inf only)
    debug_nan_step: int = -1     # test hook: poison one weight with NaN before this step (-1 = never)
    progress: bool = True        # tqdm bar on rank 0

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = GPTConfig(**self.model)
        for name in ("batch_size", "grad_accum", "max_iters", "log_interval", "telemetry_seqs",
                     "eval_batches", "telemetry_power_iters"):
            number(name, getattr(self, name), int, 1)
        for name in ("warmup_iters", "lr_decay_iters"):
            number(name, getattr(self, name), int, 0)
        number("seed", self.seed, int, 0, 2**32, high_open=True)
        number("debug_nan_step", self.debug_nan_step, int, -1)
        for name in ("telemetry_interval", "ckpt_interval", "eval_interval"):
            value = number(name, getattr(self, name), int, -1 if name == "ckpt_interval" else 0)
            if value > 0 and value % self.log_interval:
                raise ValueError(f"{name} must be 0 or a positive multiple of log_interval "
                                 f"({self.log_interval}), got {value}")
        number("lr", self.lr, float, 0, low_open=True)
        number("min_lr", self.min_lr, float, 0, self.lr)  # a learning rate that decays, never below 0
        number("weight_decay", self.weight_decay, float, 0)
        for name in ("beta1", "beta2"):
            number(name, getattr(self, name), float, 0, 1, high_open=True)
        number("eps", self.eps, float, 0, low_open=True)
        number("grad_clip", self.grad_clip, float, 0)
        if self.diverge_factor != 0:  # 0: NaN/Inf only; a factor <= 1 stops at any loss above its minimum
            number("diverge_factor (0 = off)", self.diverge_factor, float, 1, low_open=True)
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        for name in ("compile", "allow_tf32", "deterministic", "ckpt_keep", "progress"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (name == "compile" and value is None)):
                raise ValueError(f"{name} must be true or false, got {value!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.model.block_size

    def to_dict(self) -> dict:
        """Plain values for config files and records (attention specs as strings)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**{"deterministic": False, **d, "model": GPTConfig(**d.get("model", {}))})


def smoke_cpu() -> TrainConfig:
    return TrainConfig(
        name="smoke-cpu", model=GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=64,
                                          attention="math"),
        data="sample:bytes", batch_size=8, max_iters=60, lr=3e-3, min_lr=3e-4, warmup_iters=10,
        dtype="float32", device="cpu", log_interval=5, telemetry_interval=20, eval_interval=20,
        eval_batches=2, ckpt_interval=0, progress=False)


def gpu_6l() -> TrainConfig:
    return TrainConfig(
        name="gpu-6l", model=GPTConfig(vocab_size=50304, block_size=1024, n_layer=6, n_head=6, n_embd=384),
        data="", batch_size=32, max_iters=5000, lr=1e-3, min_lr=1e-5, warmup_iters=200,
        log_interval=10, telemetry_interval=100, eval_interval=250, eval_batches=8, ckpt_interval=1000)


def gpu_12l_narrow() -> TrainConfig:
    return replace(gpu_6l(), name="gpu-12l-narrow", model=replace(gpu_6l().model, n_layer=12))


def paper_gpt2_small() -> TrainConfig:
    return TrainConfig(
        name="paper-gpt2-small", model=GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12,
                                                 n_embd=768),
        data="", batch_size=32, grad_accum=16, max_iters=600000, lr=1e-3, min_lr=1e-5,
        warmup_iters=2000, lr_decay_iters=600000, weight_decay=0.0, grad_clip=1.0, dtype="bfloat16",
        log_interval=10, telemetry_interval=100, eval_interval=250, eval_batches=16, ckpt_interval=1000)


CONFIGS: dict[str, Callable[[], TrainConfig]] = {
    "smoke-cpu": smoke_cpu,
    "gpu-6l": gpu_6l,
    "gpu-12l-narrow": gpu_12l_narrow,
    "paper-gpt2-small": paper_gpt2_small,
}


def get_config(name: str, overrides: list[str] | None = None) -> TrainConfig:
    """The named config with `key=value` overrides applied."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}")
    return apply_overrides(CONFIGS[name](), overrides or [])


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def parse_value(key: str, text: str, typ) -> typing.Any:
    """Parse `text` as `typ` (bool, int, float, str, X | None, dict/list as JSON, or a class with a `parse`
    classmethod such as AttentionSpec); ValueError if it is not."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if type(None) in typing.get_args(typ):
        if text.lower() == "none":
            return None
        typ = args[0]
    origin = typing.get_origin(typ)
    if hasattr(typ, "parse"):
        try:
            return typ.parse(text)
        except ValueError as exc:
            raise ValueError(f"--set {key}: {exc}") from None
    try:
        if typ is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if typ in (int, float, str):
            return typ(text)
        if origin in (dict, list):
            value = json.loads(text)
            if not isinstance(value, origin):
                raise ValueError
            return value
    except (ValueError, json.JSONDecodeError):
        pass
    else:
        raise ValueError(f"--set {key}: unsupported field type {typ}")
    raise ValueError(f"--set {key}={text!r}: expected {getattr(typ, '__name__', typ)}"
                     + (" (JSON)" if origin in (dict, list) else ""))


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply "key=value" strings; a key is a TrainConfig field or a model field (bare or as "model.key")."""
    train_types, model_types = _field_types(TrainConfig), _field_types(GPTConfig)
    train_changes: dict = {}
    model_changes: dict = {}
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"--set expects key=value, got {item!r}")
        bare = key.removeprefix("model.")
        if key in train_types and key != "model":
            train_changes[key] = parse_value(key, text, train_types[key])
        elif bare in model_types:
            model_changes[bare] = parse_value(key, text, model_types[bare])
        else:
            valid = sorted(k for k in train_types if k != "model") + sorted(model_types)
            raise ValueError(f"--set: unknown key {key!r}; valid keys: {', '.join(valid)}")
    model = replace(cfg.model, **model_changes) if model_changes else cfg.model
    return replace(cfg, model=model, **train_changes)
