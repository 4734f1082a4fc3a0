"""Counts a scorer keeps while it scores a sample, which the reward manager adds up into the step's metrics.

A scorer returns verl's score (a float, or a dict) and nothing else; what went wrong along the way (code_exec:
a program's output the parent refused as hostile) is counted here instead, so the score keeps its type:
`add("code_hostile_outputs", n)`. The reward manager scores each sample inside `recording()` (in the scoring
process that runs the scorer, reward.num_workers or not), gets the counts back with the score, and reports their
sum over the batch as the metric `reward/<name>` (a scorer that calls add(name, 0) makes the metric appear with 0,
so a run's plots show it from the first batch that has such samples).
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_open: list[dict[str, int]] = []  # the records of the recordings in progress in this process


def add(name: str, n: int = 1) -> None:
    """Count n of `name` into every recording in progress (none: nothing is kept)."""
    with _lock:
        for record in _open:
            record[name] = record.get(name, 0) + int(n)


@contextlib.contextmanager
def recording():
    """A dict that receives what add() counts until the block ends."""
    record: dict[str, int] = {}
    with _lock:
        _open.append(record)
    try:
        yield record
    finally:
        with _lock:
            for i, entry in enumerate(_open):
                if entry is record:
                    del _open[i]
                    break
