"""Code for the cells of notebooks that tests execute in a kernel (test_book, test_explorers)."""


def wait_for(condition: str, tries: int = 600) -> str:
    """Cell code that awaits (0.1 s at a time, `tries` times at most) until `condition` holds: the kernel-side
    state of an Output widget comes back from the client as comm messages, which the kernel handles while a
    cell awaits, so a cell that reads it right after a change may run before they arrive. Under make test's
    load they took over 10 s once (the run browser's panel); the wait ends as soon as the condition holds."""
    return (f"import asyncio\nfor _ in range({tries}):\n    if {condition}:\n        break\n"
            "    await asyncio.sleep(0.1)\n")
