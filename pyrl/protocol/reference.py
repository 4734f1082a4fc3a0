"""Pure-Python formulations of the batching index work, as verl writes it: the baselines that
benchmarks time pyrl._C against and that tests compare with."""

from __future__ import annotations

import heapq


class _Part:
    """One partition; ordered by (sum, size, items) through __lt__, as verl's Set."""

    __slots__ = ("total", "items")

    def __init__(self):
        self.total = 0
        self.items = []  # (index, seqlen)

    def add(self, idx, seqlen):
        self.items.append((idx, seqlen))
        self.total += seqlen

    def merge(self, other):
        for idx, seqlen in other.items:
            self.add(idx, seqlen)

    def __lt__(self, other):
        if self.total != other.total:
            return self.total < other.total
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """k parts kept sorted from the largest sum down; the heap pops the largest spread first."""

    __slots__ = ("k", "parts")

    def __init__(self, items, k):
        self.k = k
        self.parts = [_Part() for _ in range(k)]
        for part, (idx, seqlen) in zip(self.parts, items):
            part.add(idx, seqlen)
        self.parts = sorted(self.parts, reverse=True)

    @property
    def spread(self):
        return self.parts[0].total - self.parts[-1].total

    def merge(self, other):
        for i in range(self.k):
            self.parts[i].merge(other.parts[self.k - 1 - i])
        self.parts = sorted(self.parts, reverse=True)

    def __lt__(self, other):
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0] > other.parts[0]


def karmarkar_karp(seqlens, k: int, equal_size: bool) -> list[list[int]]:
    """verl's get_seqlen_balanced_partitions: heap-based largest differencing, then its check that
    every index appears once and the sort of each partition (utils/seqlen_balancing.py)."""
    ordered = sorted((s, i) for i, s in enumerate(seqlens))
    heap = []
    if equal_size:
        assert len(seqlens) % k == 0
        for off in range(0, len(ordered), k):
            heapq.heappush(heap, _State([(i, s) for s, i in ordered[off:off + k]], k))
    else:
        for s, i in ordered:
            heapq.heappush(heap, _State([(i, s)], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    partitions = [[i for i, _ in part.items] for part in heap[0].parts]
    seen = set()
    for i, partition in enumerate(partitions):
        assert partition, f"partition {i} is empty"
        seen.update(partition)
    assert seen == set(range(len(seqlens)))
    return [sorted(partition) for partition in partitions]


def greedy_micro_batches(seqlens, max_tokens: int) -> list[list[int]]:
    """Consecutive runs under the token budget, a Python loop over sequences."""
    batches, current, tokens = [], [], 0
    for i, s in enumerate(seqlens):
        if current and (s > max_tokens or tokens + s > max_tokens):
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += s
        if s > max_tokens:
            batches.append(current)
            current, tokens = [], 0
    if current:
        batches.append(current)
    return batches
