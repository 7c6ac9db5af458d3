"""`lowprec train --config NAME --out DIR [--set key=value ...] [--resume]`: train a GPT and record the run.

nanoGPT's loop with the paper's recipe (AdamW, warmup then cosine, clipping, bf16 autocast on CUDA, optional
torch.compile, DDP under torchrun). The batch of a step is a pure function of (seed, step), so a run killed
and resumed reproduces its loss curve bit for bit on CPU; a divergence (NaN, or a loss above diverge_factor x
its minimum since warmup) stops the run and records its batch; Ctrl-C / SIGTERM checkpoint and stop. A
checkpoint names its run and the record rows it follows: a resume takes only one that fits
(`Trainer._resume_checkpoint`) and changes only RESUMABLE settings, recording each change. Methods in
detail: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from lowprec import data as lpdata
from lowprec.checkpoint import (
    CheckpointError,
    keep_file,
    kept_checkpoints,
    kept_path,
    load_checkpoint,
    rng_state,
    save_atomic,
    set_rng_state,
)
from lowprec.configs import CONFIGS, TrainConfig, apply_overrides, get_config
from lowprec.dist import leave_process_group, setup_distributed
from lowprec.fsutil import atomic_write, check_target, remove_temporaries
from lowprec.model import GPT
from lowprec.runs import (
    RunLock,
    RunRecordError,
    RunWriter,
    check_free,
    check_resumable,
    load_record,
    load_run,
    provenance,
    record_matches,
)
from lowprec.telemetry import Telemetry

CHECKPOINT = "ckpt.pt"
EXIT_CODES = {"finished": 0, "diverged": 1, "interrupted": 130}
STATE_KEYS = ("model", "optimizer", "rng", "step", "running_min", "elapsed", "telemetry", "config")
RESUME_KEYS = (*STATE_KEYS, "run_id", "record")  # a resume also needs to know whose state it is
# what a resume may change (`--set`): how often the run logs, measures, evaluates and saves, and how far it
# goes; everything else would make the record describe another run than the one its steps came from
RESUMABLE = ("max_iters", "log_interval", "eval_interval", "telemetry_interval", "ckpt_interval", "ckpt_keep",
             "progress")


# ---- pieces ----

def load_tokens(spec: str) -> lpdata.TokenData:
    """"sample:bytes" / "sample:gpt2" (the committed sample), "" (the default prepared dir) or a folder."""
    if spec.startswith("sample:"):
        return lpdata.sample_data(tokenizer=spec.removeprefix("sample:"))
    return lpdata.TokenData(spec or None)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """nanoGPT's schedule: warmup lr*(step+1)/(warmup+1), cosine to min_lr at lr_decay_iters, then flat."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / (cfg.warmup_iters + 1)
    if step >= decay_iters:
        return cfg.min_lr
    ratio = (step - cfg.warmup_iters) / max(decay_iters - cfg.warmup_iters, 1)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def set_determinism(on: bool) -> None:
    """Process-wide, like torch.manual_seed: with `on`, a seed gives the same weights in every run on one kind
    of GPU, alone or beside other processes, with or without telemetry: PyTorch's deterministic algorithms
    (an op without one warns), a fixed cuBLAS workspace, Inductor without timing-based choices that change
    the arithmetic, and our kernel's tiles from a fixed table instead of the autotuner's timings."""
    import torch._inductor.config as inductor  # 1.5 s: only for a trainer

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # a NaN fill of every empty(): cost, no use
    inductor.deterministic = on


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's state (names, dtypes, shapes, bytes, in order): equal only for equal weights."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def config_changes(before: dict, after: dict) -> dict[str, list]:
    """{key: [before, after]} of every setting two configs (`TrainConfig.to_dict()`) differ in; model settings
    as "model.<key>"."""
    flat = [{**{k: v for k, v in c.items() if k != "model"},
             **{f"model.{k}": v for k, v in c["model"].items()}} for c in (before, after)]
    return {k: [flat[0].get(k), flat[1].get(k)] for k in sorted(flat[0].keys() | flat[1].keys())
            if flat[0].get(k) != flat[1].get(k)}


def unresumable(changes: dict[str, list]) -> str | None:
    """The changes a resume may not make (not RESUMABLE), in words, or None."""
    bad = [f"{k} ({old!r} -> {new!r})" for k, (old, new) in changes.items() if k not in RESUMABLE]
    return ", ".join(bad) or None


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on parameters of dim >= 2 (matrices and embeddings), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type == "cuda")


def dynamo_counts() -> dict[str, Counter]:
    """A snapshot of Dynamo's per-process counters of compiled graphs and of graph breaks (by reason)."""
    from torch._dynamo.utils import counters

    return {key: Counter(counters[key]) for key in ("stats", "graph_break")}


def compile_report(before: dict[str, Counter]) -> dict:
    """What torch.compile made since the snapshot `before`: graphs, graph breaks and their first reasons."""
    now = dynamo_counts()
    breaks = now["graph_break"] - before["graph_break"]
    return {"graphs": now["stats"]["unique_graphs"] - before["stats"]["unique_graphs"],
            "graph_breaks": sum(breaks.values()),
            "break_reasons": [reason.splitlines()[0][:200] for reason, _ in breaks.most_common(3)]}


class StopRequest:
    """Turns the first SIGINT / SIGTERM into a flag checked between steps (a second SIGINT raises at once)."""

    def __init__(self):
        self.requested = False
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# ---- the trainer ----

class Trainer:
    """One run: build everything, then `run()` the loop.

    resume: continue the record in `out` from its checkpoint. init_from: start a fresh record in `out` from
    the state in this checkpoint file (any run's, e.g. a kept ckpt-<step>.pt): same weights, optimizer, RNG,
    divergence monitor, step and clock, so a run with the same config continues it bit for bit on CPU.
    start_fields: extra fields of the record's "start" event (e.g. replay_of, from_step).
    """

    def __init__(self, cfg: TrainConfig, out: str | Path, resume: bool = False,
                 command: list[str] | None = None, callback: Callable[[int, dict], None] | None = None,
                 init_from: str | Path | None = None, start_fields: dict | None = None):
        if resume and init_from is not None:
            raise ValueError("resume and init_from exclude each other: resume continues <out>'s own record, "
                             "init_from starts a new one")
        self.cfg, self.out, self.callback = cfg, check_target(out, "--out"), callback
        set_determinism(cfg.deterministic)
        self.ckpt_dir = check_target(cfg.ckpt_dir, "ckpt_dir") if cfg.ckpt_dir else self.out / "checkpoint"
        if cfg.ckpt_interval != -1:
            check_target(self.ckpt_path, "checkpoint", folder=False)
        self.changes: dict[str, list] = {}  # a resume's changes of the recorded config
        if resume:
            self.changes = config_changes(read_config(self.out).to_dict(), cfg.to_dict())
            if unresumable(self.changes):
                raise ValueError(f"a resume may change only {', '.join(RESUMABLE)} (each change is "
                                 f"recorded), not {unresumable(self.changes)}: start a new run in a new "
                                 "--out instead")
        self.dist, self.device = setup_distributed(cfg)
        if cfg.grad_accum % self.dist.world_size:
            raise ValueError(f"grad_accum ({cfg.grad_accum}) must be divisible by the number of processes "
                             f"({self.dist.world_size})")
        self.micro_steps = cfg.grad_accum // self.dist.world_size
        if self.dist.enabled and not self.dist.main:
            dist.barrier()  # rank 0 builds any missing data cache first
        self.data = load_tokens(cfg.data)
        if self.dist.enabled and self.dist.main:
            dist.barrier()
        if cfg.model.vocab_size < self.data.vocab_size:
            raise ValueError(f"vocab_size {cfg.model.vocab_size} is smaller than the data's vocabulary "
                             f"({self.data.vocab_size}, {self.data.path})")
        for split in ("train", "val") if cfg.eval_interval else ("train",):
            if len(self.data.splits[split]) <= cfg.model.block_size:
                raise ValueError(f"block_size {cfg.model.block_size} needs more tokens than the {split} "
                                 f"split of {self.data.path} holds ({len(self.data.splits[split])})")
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
            torch.backends.cudnn.allow_tf32 = cfg.allow_tf32
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model = GPT(cfg.model).to(self.device)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
                         else contextlib.nullcontext())
        self.telemetry = (Telemetry(self.model, cfg.telemetry_power_iters)
                          if cfg.telemetry_interval and self.dist.main else None)
        self.start_step, self.running_min, self.elapsed, self.last_loss = 0, math.inf, 0.0, None
        if init_from is not None:
            self._restore(Path(init_from), load_checkpoint(Path(init_from), STATE_KEYS))
        use_compile = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        self.compiled = use_compile
        self.forward: torch.nn.Module = torch.compile(self.model) if use_compile else self.model
        self.ddp = None
        if self.dist.enabled:  # compile first, then DDP (as nanoGPT)
            self.ddp = self.forward = torch.nn.parallel.DistributedDataParallel(
                self.forward, device_ids=[self.dist.local_rank] if self.device.type == "cuda" else None,
                broadcast_buffers=False)  # the only buffers are constants (head_order)
        self.pending: list[dict] = []
        self.writer: RunWriter | None = None
        self.done: dict | None = None  # the summary of a finished run that a resume leaves as it is
        lock = RunLock(self.out) if self.dist.main else None  # the record is this process's from here on
        try:
            if lock is not None:
                for folder in (self.out, self.ckpt_dir):  # what a killed writer left half-written
                    remove_temporaries(folder)
            if resume:
                resumed_from = self._resume_checkpoint()
                self._restore(*resumed_from)
                if self.dist.enabled:
                    dist.barrier()  # every rank chose its checkpoint before rank 0 rewrites the record
            elif lock is not None:
                self._check_fresh()
            if lock is not None and resume and self.start_step >= cfg.max_iters:
                summary = load_run(self.out).summary
                self.done = summary if summary["status"] == "finished" else None
            if lock is not None and self.done is None:
                self.writer = RunWriter(self.out, cfg.to_dict(), command, resume=resume, lock=lock)
        finally:
            if lock is not None and self.writer is None:
                lock.release()
        self.completed = self.start_step
        if self.writer is not None:
            try:
                if resume:
                    self.writer.truncate_after(self.start_step - 1)
                    changed = {"changed": self.changes} if self.changes else {}
                    self.writer.event("resumed", self.start_step, provenance=provenance(command),
                                      checkpoint=str(resumed_from[0]), **changed)
                else:
                    self.writer.event("start", self.start_step, data=str(self.data.path),
                                      corpus=self.data.describe(), world_size=self.dist.world_size,
                                      params=self.model.num_params(), tokens_per_step=cfg.tokens_per_step,
                                      device=str(self.device),
                                      compile=use_compile, **(start_fields or {}))
            except Exception as exc:
                self._fail(exc)
                raise

    # -- checkpoints --

    @property
    def ckpt_path(self) -> Path:
        return self.ckpt_dir / CHECKPOINT

    def _check_fresh(self) -> None:
        """ValueError unless a fresh record may start: `out` holds no run (`runs.check_free`) and ckpt_dir
        no checkpoint (another run's, whose ckpt.pt this one would overwrite)."""
        check_free(self.out)
        taken = [p.name for p in (self.ckpt_path, *kept_checkpoints(self.ckpt_dir).values()) if p.exists()]
        if taken:
            raise ValueError(f"ckpt_dir {self.ckpt_dir} already holds checkpoints ({', '.join(taken[:3])}"
                             f"{', ...' if len(taken) > 3 else ''}) of another run: runs must not share a "
                             "ckpt_dir; pass a new --out or ckpt_dir, or resume that run (--resume)")

    def _resume_checkpoint(self) -> tuple[Path, dict]:
        """The checkpoint a resume continues from: ckpt.pt, or when it cannot be used, the newest kept copy
        ckpt-<step>.pt that can (said on stderr). One can be used if it loads (it exists, is readable, matches
        its sha256 and holds RESUME_KEYS), belongs to this run (its run_id, and its config but for
        RESUMABLE settings) and fits the record (`runs.record_matches`: metrics rows lost, repeated or
        changed since it was saved rule it out). CheckpointError naming the first problem if none can."""
        check_resumable(self.out)
        record = load_record(self.out)
        problems = []
        for path in (self.ckpt_path, *reversed(kept_checkpoints(self.ckpt_dir).values())):
            try:
                ckpt = load_checkpoint(path, RESUME_KEYS)
                self._check_belongs(path, ckpt, record)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            if problems and self.dist.main:
                print(f"{problems[0]}; resuming from the kept copy {path} (step {ckpt['step']})",
                      file=sys.stderr)
            return path, ckpt
        if len(problems) == 1 and not self.ckpt_path.exists():
            raise CheckpointError(f"{problems[0]}: the run kept no checkpoint (killed before its first?); "
                                  f"remove {self.out} to start it over, or pass a new --out")
        raise CheckpointError(f"{problems[0]}, and no kept copy (ckpt-<step>.pt) to resume from instead")

    def _check_belongs(self, path: Path, ckpt: dict, record: dict) -> None:
        """CheckpointError unless checkpoint `ckpt` (in `path`) is one of this run's and fits its record."""
        if ckpt["run_id"] != record.get("run_id"):
            raise CheckpointError(f"checkpoint {path} belongs to another run (run_id {ckpt['run_id']}; "
                                  f"{self.out} records run_id {record.get('run_id')}): runs must not share a "
                                  "ckpt_dir")
        try:
            saved = TrainConfig.from_dict(ckpt["config"]).to_dict()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: its config is not one of this version ({exc})") \
                from None
        changed = unresumable(config_changes(saved, self.cfg.to_dict()))
        if changed:
            raise CheckpointError(f"checkpoint {path} was saved under another config: {changed}")
        problem = record_matches(self.out, ckpt["step"], ckpt["record"])
        if problem:
            raise CheckpointError(f"checkpoint {path} (step {ckpt['step']}) does not fit the record: "
                                  f"{problem}")

    def _restore(self, path: Path, ckpt: dict) -> None:
        """Load the state that `_checkpoint` saved in `path` (RNG states stay on the CPU)."""
        try:
            self.model.load_state_dict(ckpt["model"])
        except RuntimeError:  # parameters missing, unexpected or of another shape
            saved, now = ckpt["config"]["model"], self.cfg.model.to_dict()
            changed = [f"{k}={saved[k]!r} there, {v!r} here" for k, v in now.items()
                       if k in saved and saved[k] != v]
            raise ValueError(f"checkpoint {path} does not fit this model ({', '.join(changed)}): keep the "
                             "model settings of the run it comes from") from None
        self.optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        if self.telemetry is not None and ckpt["telemetry"] is not None:
            self.telemetry.load_state_dict(ckpt["telemetry"])
        self.start_step, self.running_min, self.elapsed = ckpt["step"], ckpt["running_min"], ckpt["elapsed"]
        self.last_loss = ckpt.get("last_loss")  # the loss of the step before (checkpoints since it was kept)

    def _checkpoint(self, next_step: int) -> None:
        """Save everything needed to continue at `next_step` (rank 0 writes; the file is shared)."""
        if self.cfg.ckpt_interval == -1:
            return
        if self.dist.main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if not (self.ckpt_dir / ".gitignore").exists():
                with atomic_write(self.ckpt_dir / ".gitignore") as handle:
                    handle.write("*\n")
            self.writer.sync()  # the rows the checkpoint counts are on the disk before it is
            digest = save_atomic({
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": rng_state(), "step": next_step, "running_min": self.running_min,
                "last_loss": self.last_loss,
                "elapsed": self.elapsed + time.perf_counter() - self.t_start,
                "telemetry": None if self.telemetry is None else self.telemetry.state_dict(),
                "config": self.cfg.to_dict(), "run_id": self.writer.run_id, "record": self.writer.mark()},
                self.ckpt_path)
            kept = {}
            if self.cfg.ckpt_keep:
                kept_copy = kept_path(self.ckpt_dir, next_step)
                keep_file(self.ckpt_path, kept_copy, digest)
                kept["kept"] = str(kept_copy)
            self.writer.event("checkpoint", next_step, path=str(self.ckpt_path), **kept)
        if self.dist.enabled:
            dist.barrier()

    # -- the loop --

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return lpdata.sample_batch(self.data.train, self.cfg.seed, step * self.micro_steps + micro,
                                   self.cfg.batch_size, self.cfg.model.block_size, self.dist.rank,
                                   self.dist.world_size, self.device)

    @torch.no_grad()
    def evaluate(self) -> torch.Tensor:
        """Mean loss over the fixed validation windows (micro-batches 0..eval_batches-1 of the val split under
        the run's seed; each process takes its rows), averaged over processes."""
        cfg = self.cfg
        total = torch.zeros((), device=self.device)
        for i in range(cfg.eval_batches):
            x, y = lpdata.sample_batch(self.data.val, cfg.seed, i, cfg.batch_size, cfg.model.block_size,
                                       self.dist.rank, self.dist.world_size, self.device)
            with self.autocast:
                total += self.forward(x, y)[1].float()
        if self.dist.enabled:
            dist.all_reduce(total)
        return total / (cfg.eval_batches * self.dist.world_size)

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        lr = lr_at(cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        entry: dict = {"step": step, "lr": lr}
        if self.telemetry is not None and step % cfg.telemetry_interval == 0:
            x, y = self.batch(step, 0)
            self._sync()
            t0 = time.perf_counter()
            entry["telemetry"] = self.telemetry.measure(x[: cfg.telemetry_seqs], y[: cfg.telemetry_seqs],
                                                        self.autocast)
            entry["telemetry_s"] = time.perf_counter() - t0
            fallbacks = [sum(v or 0 for v in row) for row in entry["telemetry"].get("fix_fallbacks", [])]
            if any(fallbacks) and self.writer is not None:
                self.writer.event("fix_fallback", step, per_layer=fallbacks,
                                  note="Fix max_gap guard capped the shift (sampled sequences only)")
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            entry["val_loss"] = self.evaluate()
        if step == cfg.debug_nan_step:
            with torch.no_grad():
                self.model.blocks[0].attn.c_attn.weight[0, 0] = float("nan")
            if self.writer is not None:
                self.writer.event("debug_nan_injected", step, weight="blocks.0.attn.c_attn.weight[0, 0]")
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.micro_steps):
            x, y = self.batch(step, micro)
            last = micro == self.micro_steps - 1
            sync_ctx = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync_ctx:
                with self.autocast:
                    _, loss = self.forward(x, y)
                (loss / self.micro_steps).backward()
            loss_sum += loss.detach()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        entry["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        entry["loss"] = loss_sum / self.micro_steps
        return entry

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def flush(self, stop: bool) -> tuple[str | None, bool]:
        """Sync the pending steps: check divergence, log metrics. Returns (divergence reason or None, stop)
        where stop is agreed by all processes."""
        cfg = self.cfg
        packed = torch.cat([torch.stack([e["loss"] for e in self.pending]).float(),
                            torch.stack([e["grad_norm"] for e in self.pending]).float(),
                            torch.tensor([float(stop)], device=self.device)])
        if self.dist.enabled:
            dist.all_reduce(packed)
            packed[:-1] /= self.dist.world_size
        values = packed.tolist()
        n = len(self.pending)
        now = time.perf_counter()
        interval_s, self.t_flush = now - self.t_flush, now
        tokens_per_s = n * cfg.tokens_per_step / max(interval_s, 1e-9)
        reason = None
        for entry, loss, norm in zip(self.pending, values[:n], values[n:2 * n], strict=True):
            step = entry["step"]
            if not math.isfinite(loss):
                reason = f"non-finite loss ({loss})"
            elif (step >= cfg.warmup_iters and cfg.diverge_factor and math.isfinite(self.running_min)
                  and loss > cfg.diverge_factor * self.running_min):
                reason = (f"loss {loss:.4g} > {cfg.diverge_factor:g} x its minimum since warmup "
                          f"({self.running_min:.4g})")
            if step >= cfg.warmup_iters and reason is None:
                self.running_min = min(self.running_min, loss)
            self.last_loss = loss
            logged = reason or step % cfg.log_interval == 0 or step == cfg.max_iters - 1
            if self.writer is not None and logged:
                record = {"step": step, "tokens": (step + 1) * cfg.tokens_per_step, "loss": loss,
                          "lr": entry["lr"], "grad_norm": norm, "time_s": self.elapsed + now - self.t_start,
                          "tokens_per_s": tokens_per_s}
                if "val_loss" in entry:
                    record["val_loss"] = entry["val_loss"].item()
                if "telemetry" in entry:
                    record["telemetry_s"] = entry["telemetry_s"]
                    record["telemetry"] = entry["telemetry"]
                self.writer.log(record)
            if reason:
                self._record_divergence(step, loss, reason)
                break
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{values[n - 1]:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.pending = []
        return reason, values[-1] > 0

    def _record_divergence(self, step: int, loss: float, reason: str) -> None:
        cfg = self.cfg
        self.diverged_step = step
        if self.writer is None:
            return
        world_rows = cfg.batch_size * self.dist.world_size
        data_steps = [step * self.micro_steps + i for i in range(self.micro_steps)]
        n_tokens = len(self.data.train)
        starts = [lpdata.batch_indices(cfg.seed, s, n_tokens, world_rows, cfg.model.block_size).tolist()
                  for s in data_steps]
        self.writer.event("divergence", step, loss=loss, reason=reason, running_min=self.running_min,
                          batch={"seed": cfg.seed, "data_steps": data_steps, "rows": world_rows,
                                 "block_size": cfg.model.block_size, "starts": starts},
                          checkpoint=str(self.ckpt_path) if self.ckpt_path.exists() else None)

    def run(self) -> dict:
        """Train from start_step to max_iters (or until divergence / a stop request); returns the summary. An
        exception marks the record "failed" with the reason and propagates."""
        if self.done is not None:
            print(f"{self.out}: nothing to do: the run finished at step {self.start_step} (max_iters "
                  f"{self.cfg.max_iters}); --set max_iters=N continues it", file=sys.stderr)
            if self.dist.enabled:
                dist.barrier()  # the other ranks' (empty) run
            return self.done
        self.t_start = self.t_flush = time.perf_counter()
        self.diverged_step = None
        try:
            return self._finish(self._loop())
        except Exception as exc:
            self._fail(exc)
            raise

    def _loop(self) -> str:
        """The steps; returns the status to record."""
        cfg = self.cfg
        self.bar = (tqdm(total=cfg.max_iters, initial=self.start_step, unit="step", dynamic_ncols=True)
                    if cfg.progress and self.dist.main else None)
        status = "finished"
        if self.start_step >= cfg.max_iters and self.writer is not None:
            self.writer.event("nothing_to_do", self.start_step, max_iters=cfg.max_iters)
        try:
            with StopRequest() as stop:
                before = dynamo_counts() if self.compiled else None  # until the first step has compiled
                for step in range(self.start_step, cfg.max_iters):
                    entry = self.train_step(step)
                    if before is not None:
                        self._report_compile(step, compile_report(before))
                        before = None
                    self.pending.append(entry)
                    self.completed = next_step = step + 1
                    if self.callback is not None:
                        self.callback(step, entry)
                    if self.bar is not None:
                        self.bar.update()
                    due_ckpt = cfg.ckpt_interval > 0 and next_step % cfg.ckpt_interval == 0
                    local_stop = stop.requested and not self.dist.enabled
                    if step % cfg.log_interval == 0 or due_ckpt or next_step == cfg.max_iters or local_stop:
                        reason, stop_all = self.flush(stop.requested)
                        if reason:
                            status = "diverged"
                            break
                        if stop_all:
                            self._checkpoint(next_step)
                            status = "interrupted"
                            break
                        if due_ckpt or next_step == cfg.max_iters:
                            self._checkpoint(next_step)
        except KeyboardInterrupt:
            status = "interrupted"
            if self.writer is not None:
                self.writer.event("aborted", self.completed,
                                  note="second interrupt: no new checkpoint, the last one is kept")
        finally:
            if self.bar is not None:
                self.bar.close()
        return status

    def _report_compile(self, step: int, report: dict) -> None:
        """The record's "compiled" event; a graph break also said on stderr (it leaves code uncompiled)."""
        if self.writer is not None:
            self.writer.event("compiled", step, **report)
        if report["graph_breaks"] and self.dist.main:
            print(f"{self.out}: torch.compile broke the model's forward ({report['graph_breaks']} graph "
                  f"break(s), {report['graphs']} graph(s); first: {report['break_reasons'][0]}): parts of "
                  "each step run uncompiled", file=sys.stderr)

    def _finish(self, status: str) -> dict:
        cfg = self.cfg
        done = self.diverged_step if status == "diverged" else self.completed
        summary = {"status": status, "steps": done, "tokens": done * cfg.tokens_per_step,
                   "time_s": self.elapsed + time.perf_counter() - self.t_start,
                   "diverged_step": self.diverged_step, "final_loss": self.last_loss,
                   "min_loss_after_warmup": self.running_min if math.isfinite(self.running_min) else None,
                   "repetition": self.data.repetition(done * cfg.tokens_per_step),  # epochs of the corpus
                   "weights_sha256": weights_digest(self.model)}
        if self.last_loss is not None:
            summary["final_loss_hex"] = float.hex(self.last_loss)  # the exact fp32 value, for twins
        flash = sys.modules.get("lowprec.attention.flash")
        if flash is not None and self.device.type == "cuda":
            summary["kernel_tiles"] = flash.launched_tiles()
        if self.writer is not None:
            if self.last_loss is None:  # no step ran: the loss the record has stays
                summary["final_loss"] = self.writer.summary.get("final_loss")
            self.writer.event(status, done)
            self.writer.update_summary(**summary)
            self.writer.close()
            self.writer = None
        if self.dist.enabled:
            dist.barrier()
        return summary

    def _fail(self, exc: Exception) -> None:
        """Record the failure ("failed" event and status, with the reason) as far as the disk lets us, and
        release the folder."""
        if self.writer is None:
            return
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        try:
            with contextlib.suppress(OSError, ValueError):  # a full disk; files a failed close left closed
                self.writer.event("failed", self.completed, reason=reason)
                self.writer.update_summary(status="failed", reason=reason, steps=self.completed,
                                           tokens=self.completed * self.cfg.tokens_per_step)
        finally:
            with contextlib.suppress(OSError):
                self.writer.close()
            self.writer = None


def train(cfg: TrainConfig, out: str | Path, resume: bool = False, command: list[str] | None = None,
          callback: Callable[[int, dict], None] | None = None, init_from: str | Path | None = None,
          start_fields: dict | None = None) -> dict:
    """Train `cfg`, recording into `out` (resume / init_from / start_fields: see `Trainer`). `callback(step,
    entry)` runs after every step (tests, benchmarks); entry holds "loss" and "grad_norm" as device tensors
    (reading them syncs), "lr" and any "telemetry"."""
    return Trainer(cfg, out, resume, command, callback, init_from, start_fields).run()


def read_config(out: str | Path) -> TrainConfig:
    """The TrainConfig recorded in a run folder's config.json (RunRecordError naming the file if it is not
    one)."""
    config = load_record(out)["config"]
    try:
        return TrainConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise RunRecordError(f"{Path(out) / 'config.json'}: not a config of this version ({exc})") from None


# ---- CLI ----

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=sorted(CONFIGS), help="named config (lowprec.configs)")
    parser.add_argument("--out", required=True, help="run folder (records; checkpoints in <out>/checkpoint)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a config field (repeatable): --set max_iters=200 --set attention=math")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")


def run(args: argparse.Namespace) -> int:
    try:
        if args.resume:
            cfg = apply_overrides(read_config(args.out), args.overrides)
            if args.config and args.config != cfg.name:
                raise ValueError(f"--config {args.config} differs from the recorded config {cfg.name!r}; "
                                 "omit --config when resuming")
        elif args.config:
            cfg = get_config(args.config, args.overrides)
        else:
            raise ValueError(f"--config is required (one of {sorted(CONFIGS)}) unless --resume")
        summary = train(cfg, args.out, resume=args.resume)
    finally:
        leave_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary))
    return EXIT_CODES[summary["status"]]
