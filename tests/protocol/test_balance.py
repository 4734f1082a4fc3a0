"""Balanced partitions and token-budget micro-batches: properties, verl's results, and errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyrl.protocol import balanced_partitions, token_budget_micro_batches
from pyrl.protocol import reference as ref


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=60), st.data())
def test_partitions_equal_verls_exactly(seqlens, data):
    k = data.draw(st.integers(1, len(seqlens)))
    equal_size = data.draw(st.booleans()) and len(seqlens) % k == 0
    parts = balanced_partitions(seqlens, k, equal_size)
    assert parts == ref.karmarkar_karp(seqlens, k, equal_size)
    assert sorted(i for p in parts for i in p) == list(range(len(seqlens)))  # every index exactly once
    assert len(parts) == k and all(p == sorted(p) and p for p in parts)
    if equal_size:
        assert {len(p) for p in parts} == {len(seqlens) // k}


def test_partitions_by_hand_and_input_types():
    # largest differencing pairs the extremes: 10+1 | 9+2 | 8+3, all 11; ties list the later first item first
    assert balanced_partitions([1, 2, 3, 8, 9, 10], 3, equal_size=True) == [[0, 5], [1, 4], [2, 3]]
    as_tensor = balanced_partitions(torch.tensor([5, 1, 4, 2]), 2)
    assert as_tensor == balanced_partitions(np.array([5, 1, 4, 2]), 2) == balanced_partitions([5, 1, 4, 2], 2)

    def spread(parts, lens):
        return max(sum(lens[i] for i in p) for p in parts) - min(sum(lens[i] for i in p) for p in parts)

    lens = np.random.default_rng(0).integers(1, 8193, 6400).tolist()
    assert spread(balanced_partitions(lens, 64), lens) <= spread(ref.karmarkar_karp(lens, 64, True), lens)
    assert balanced_partitions(lens, 8) == balanced_partitions(lens, 8)  # deterministic


def test_partition_errors_name_the_argument():
    with pytest.raises(ValueError, match="seqlens: 2 sequences cannot fill 3"):
        balanced_partitions([1, 2], 3)
    with pytest.raises(ValueError, match=r"equal_size needs the number of sequences \(5\) to be a multiple of k \(2\)"):
        balanced_partitions([1, 2, 3, 4, 5], 2, equal_size=True)
    with pytest.raises(ValueError, match="seqlens: entry 1 is -4"):
        balanced_partitions([1, -4], 1)
    with pytest.raises(ValueError, match="k: expected at least 1"):
        balanced_partitions([1, 2], 0)
    with pytest.raises(TypeError, match="seqlens: expected integer lengths"):
        balanced_partitions([1.5, 2.0], 1)
    with pytest.raises(ValueError, match="seqlens: expected a 1-D"):
        balanced_partitions([[1, 2]], 1)
    with pytest.raises(TypeError, match="k: expected an int"):
        balanced_partitions([1, 2], 1.0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=80), st.integers(1, 64), st.booleans())
def test_micro_batches_cover_and_respect_the_budget(seqlens, budget, balanced):
    with pytest.warns(UserWarning) if any(s > budget for s in seqlens) else _no_warning():
        batches = token_budget_micro_batches(seqlens, budget, balanced=balanced)
    assert sorted(i for b in batches for i in b) == list(range(len(seqlens)))
    for b in batches:
        assert b and (sum(seqlens[i] for i in b) <= budget or len(b) == 1)
    if not balanced:
        assert [i for b in batches for i in b] == list(range(len(seqlens)))  # order preserved
        assert batches == ref.greedy_micro_batches(seqlens, budget)
    else:
        fitting = sum(s for s in seqlens if s <= budget)
        oversized = sum(s > budget for s in seqlens)
        assert len(batches) >= -(-fitting // budget) + oversized


def test_micro_batches_by_hand():
    assert token_budget_micro_batches([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert token_budget_micro_batches([6, 1, 5, 2], 8, balanced=True) == [[0, 1], [2, 3]]  # 7 and 7
    with pytest.warns(UserWarning, match=r"1 sequence\(s\) longer than max_tokens=8 .*: 1 \(9 tokens\)"):
        assert token_budget_micro_batches([3, 9, 3], 8) == [[0], [1], [2]]
    assert token_budget_micro_batches([], 8) == []
    with pytest.raises(ValueError, match="max_tokens: expected a budget of at least 1"):
        token_budget_micro_batches([1], 0)


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
