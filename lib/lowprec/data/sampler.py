"""Deterministic batches: the window starts of step `s` under seed `n` are a pure function of (n, s).

They come from the Philox4x64-10 counter-based generator (Random123), read as raw 64-bit words: word j of
step s is word j % 4 of Philox4x64-10 with key = seed and counter (j // 4 + 1, s, 0, 0), and a window start is
that word modulo (n_tokens - block_size). No NumPy sampling algorithm (which may change between versions) is
involved. Any run's data order can therefore be replayed from any step, on any machine. The global batch
has batch_size * world_size rows and rank r takes rows [r * batch_size, (r + 1) * batch_size), so one process
with batch_size * world_size rows sees exactly the data of the distributed run."""

from __future__ import annotations

import numpy as np
import torch


def batch_indices(seed: int, step: int, n_tokens: int, batch_size: int, block_size: int,
                  rank: int = 0, world_size: int = 1) -> np.ndarray:
    """Window starts (int64, shape (batch_size,)) of `rank`'s rows of the global batch at `step`. A window is
    block_size + 1 tokens (inputs and the next-token targets), so starts lie in [0, n_tokens - block_size)."""
    for name, value in (("seed", seed), ("step", step)):
        if not 0 <= value < 2**64:
            raise ValueError(f"{name}={value}: expected an integer in [0, 2**64)")
    if batch_size < 1 or block_size < 1:
        raise ValueError(f"batch_size={batch_size}, block_size={block_size}: both must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    n_starts = n_tokens - block_size
    if n_starts < 1:
        raise ValueError(f"{n_tokens} tokens are too few for block_size={block_size} (need block_size + 1)")
    philox = np.random.Philox(key=seed, counter=step << 64)
    words = philox.random_raw(batch_size * world_size)[rank * batch_size:(rank + 1) * batch_size]
    return (words % np.uint64(n_starts)).astype(np.int64)  # modulo bias < n_tokens / 2**64: negligible


def batch_from_indices(tokens: np.ndarray, starts: np.ndarray, block_size: int,
                       device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 tensors of shape (len(starts), block_size): x = tokens[s : s + block_size] and y the same
    windows shifted by one. Use it to replay recorded window starts."""
    windows = np.asarray(tokens[np.asarray(starts)[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    batch = torch.from_numpy(windows)
    x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def sample_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, block_size: int,
                 rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The (x, y) batch of `rank` at `step` for `seed`: random windows of `tokens` (e.g. TokenData.train)."""
    starts = batch_indices(seed, step, len(tokens), batch_size, block_size, rank, world_size)
    return batch_from_indices(tokens, starts, block_size, device)
