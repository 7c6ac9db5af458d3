"""A missed wake-up in jupyter_client's asyncio channels, worked around: poll in slices of one second.

Seen here (jupyter_client 8.6-8.10, pyzmq 26-27, ipykernel 6.31-7.4): now and then a kernel's execute_reply
has arrived (its header is stamped when the kernel sent it) but the client's `await socket.poll(timeout)` does
not wake until the timeout, so nbclient waits the whole cell timeout (120-300 s here) and then goes on as if
nothing happened. A fresh poll re-reads the socket's state, so polling in slices of at most a second bounds
a missed wake-up to that second. `apply()` patches `AsyncZMQSocketChannel.get_msg` (nbclient's channel) in
this process; tests/conftest.py and _ext/execute_chapters.py call it.
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

from jupyter_client.channels import AsyncZMQSocketChannel

SLICE_S = 1.0


async def get_msg(self: AsyncZMQSocketChannel, timeout: float | None = None) -> dict[str, Any]:
    """The channel's next message; Empty after `timeout` seconds (None: wait for ever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, max(0.0, deadline - time.monotonic()))
        if await self.socket.poll(int(left * 1000)):
            return await self._recv()
        if deadline is not None and time.monotonic() >= deadline:
            raise Empty


def apply() -> None:
    AsyncZMQSocketChannel.get_msg = get_msg
