"""Checkpoint files: the RNG states a bit-exact resume needs, crash-safe saving with a sha256 beside each
file, loading that checks it, and kept copies.

`save_atomic` writes <name> and its checksum <name>.sha256 ("<sha256>  <name>" lines, as sha256sum writes
them). While a new file is renamed in, the checksum file lists the old file's sha256 too, so a crash or a full
disk at any moment leaves a checkpoint that verifies (the old one or the new one); `load_checkpoint` refuses a
file that matches no listed sha256, or has no checksum file.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from lowprec.fsutil import atomic_write

KEPT = re.compile(r"ckpt-(\d+)\.pt")


class CheckpointError(ValueError):
    """A checkpoint is missing or unreadable, has no checksum file, does not match it, is no checkpoint or
    lacks a key (the message names the file)."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digests(path: Path) -> list[str]:
    """The sha256 values the checksum file of `path` accepts (none if it is missing)."""
    try:
        text = checksum_path(path).read_text()
    except FileNotFoundError:
        return []
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def _write_digests(path: Path, digests: list[str]) -> None:
    with atomic_write(checksum_path(path)) as handle:
        handle.write("".join(f"{d}  {path.name}\n" for d in dict.fromkeys(digests)))


def save_atomic(obj: dict, path: Path) -> str:
    """torch.save into memory, then the bytes through `atomic_write` and their sha256 into <path>.sha256 (the
    old file's sha256 stays listed until the new file is in place); returns the sha256."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    _write_digests(path, [digest, *_digests(path)])
    with atomic_write(path, "wb") as handle:
        handle.write(data)
    _write_digests(path, [digest])
    return digest


def load_checkpoint(path: Path, keys: tuple[str, ...] = ()) -> dict:
    """The checkpoint in `path` (tensors on the CPU), after checking its bytes against <path>.sha256;
    CheckpointError naming the file when it is missing or unreadable, has no checksum file, matches none of
    its sums, is not a checkpoint torch loads or lacks one of `keys`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    digests = _digests(path)
    if not digests:
        raise CheckpointError(f"checkpoint {path} has no checksum file {checksum_path(path).name} (lost, or "
                              "saved before checkpoints had one): its content cannot be trusted")
    if hashlib.sha256(data).hexdigest() not in digests:
        raise CheckpointError(f"checkpoint {path} is corrupt: its sha256 does not match "
                              f"{checksum_path(path).name} (truncated or changed on disk)")
    try:
        ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises RuntimeError, pickle errors, EOFError...: none is a checkpoint
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise CheckpointError(f"checkpoint {path} matches its sha256 but is no checkpoint ({reason})") \
            from None
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing} (saved by another version, or not by "
                              "lowprec train)")
    return ckpt


def kept_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt-{step:06d}.pt"


def kept_checkpoints(ckpt_dir: Path) -> dict[int, Path]:
    """step -> kept copy ckpt-<step>.pt in `ckpt_dir`, by step."""
    found = {int(m.group(1)): p for p in ckpt_dir.glob("ckpt-*.pt") if (m := KEPT.fullmatch(p.name))}
    return dict(sorted(found.items()))


def keep_file(path: Path, kept: Path, digest: str) -> None:
    """Give `path` the second name `kept` atomically (a hard link under a temp name, renamed; a copy through
    `atomic_write` where the filesystem has no hard links), then its checksum file (sha256 `digest`). Later
    atomic saves to `path` replace its name, not the kept file."""
    tmp = kept.with_name(kept.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        with atomic_write(kept, "wb") as handle, open(path, "rb") as source:
            shutil.copyfileobj(source, handle)
    else:
        os.replace(tmp, kept)
    _write_digests(kept, [digest])
