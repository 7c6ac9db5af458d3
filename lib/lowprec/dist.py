"""Processes: this process's rank and device, joining and leaving torchrun's process group."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowprec.configs import TrainConfig


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: TrainConfig) -> tuple[Dist, torch.device]:
    """This process's rank and device; joins the process group that torchrun (or a test) describes in
    RANK / WORLD_SIZE / LOCAL_RANK (NCCL on CUDA, gloo on CPU). A single process needs no group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0"))) if world > 1 else Dist()
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {cfg.device!r}")
    device = torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use --set device=cpu")
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    if d.enabled and not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=d.rank, world_size=world)
    return d, device


def leave_process_group() -> None:
    """End of a command: leave the process group if this process joined one (torchrun)."""
    if dist.is_initialized():
        dist.destroy_process_group()
