"""verl 0.9.1's `simple_timer` (verl.utils.profiler): seconds spent in a block, added up per name."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def simple_timer(name: str, timing: dict):
    """timing[name] += the seconds the block took (0 first)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
