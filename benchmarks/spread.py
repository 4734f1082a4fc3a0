"""Repeated measurements, reported as median (min-max), and the rule for claiming a ratio from them: a ratio of
medians is claimed only when the two ranges do not overlap; otherwise the result is "within noise". One run on a
shared 2-core machine is an anecdote; rounds interleave the systems so that load falls on all of them alike."""

from __future__ import annotations

import statistics


def spread(values) -> tuple[float, float, float]:
    """(median, min, max)."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


def show(values, digits: int = 2) -> str:
    """'median (min-max)'."""
    med, lo, hi = spread(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def ratio(numerator, denominator) -> str:
    """median(numerator) / median(denominator) as 'R.RRx', or 'R.RRx, within noise' when the ranges overlap."""
    (a, a_lo, a_hi), (b, b_lo, b_hi) = spread(numerator), spread(denominator)
    text = f"{a / b:.2f}x"
    return text if a_hi < b_lo or b_hi < a_lo else f"{text}, within noise"


def rotated(items: list, round_index: int) -> list:
    """The run order of a round: each round starts one system later, so none always runs first (or last)."""
    k = round_index % len(items) if items else 0
    return items[k:] + items[:k]
