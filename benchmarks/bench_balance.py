"""(a) Balanced partition of 99,968 sequence lengths (1..8192) into 64 ranks with equal counts: pyrl._C vs
verl's heap-based Python Karmarkar-Karp; time and the max-min spread of rank totals. Target: >= 20x faster
with a spread no larger. (b) Micro-batching 100,000 sequences under a 16,384-token budget."""

import functools

import numpy as np
import pytest

from pyrl.protocol import balanced_partitions, token_budget_micro_batches
from pyrl.protocol import reference as ref

N_SEQS, RANKS = 99_968, 64


def _spread(parts, lengths):
    totals = [sum(lengths[i] for i in p) for p in parts]
    return max(totals) - min(totals)


def _lengths():
    return np.random.default_rng(0).integers(1, 8193, N_SEQS).tolist()  # a Python list, as verl receives it


@functools.lru_cache(maxsize=None)
def _verl_spread():
    lengths = _lengths()
    return _spread(ref.karmarkar_karp(lengths, RANKS, True), lengths)


@pytest.mark.parametrize("impl", ["pyrl", "python_verl"])
def test_balanced_partitions(benchmark, impl):
    lengths = _lengths()
    fn = balanced_partitions if impl == "pyrl" else ref.karmarkar_karp
    benchmark.group = f"balanced partitions {N_SEQS} seqs -> {RANKS} ranks, equal size"
    parts = benchmark.pedantic(fn, args=(lengths, RANKS, True), rounds=3 if impl == "python_verl" else 30,
                               warmup_rounds=1)
    spread = _spread(parts, lengths)
    benchmark.extra_info["spread"] = spread
    assert spread <= _verl_spread()  # the target: a spread no larger than verl's on the same lengths


@pytest.mark.parametrize("impl", ["pyrl_ordered", "pyrl_balanced", "python_ordered"])
def test_token_budget_micro_batches(benchmark, impl):
    lengths = np.random.default_rng(1).integers(1, 8193, 100_000).tolist()
    budget = 16_384
    fns = {"pyrl_ordered": lambda: token_budget_micro_batches(lengths, budget),
           "pyrl_balanced": lambda: token_budget_micro_batches(lengths, budget, balanced=True),
           "python_ordered": lambda: ref.greedy_micro_batches(lengths, budget)}
    benchmark.group = f"token-budget micro-batches, 100,000 seqs, budget {budget}"
    batches = benchmark.pedantic(fns[impl], rounds=5, warmup_rounds=1)
    totals = [sum(lengths[i] for i in b) for b in batches]
    benchmark.extra_info.update({"micro_batches": len(batches), "min_tokens": min(totals), "max_tokens": max(totals),
                                 "lower_bound": -(-sum(lengths) // budget)})
    assert max(totals) <= budget
