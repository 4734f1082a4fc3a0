"""group_advantages("grpo", segment reductions) against each named baseline, on the same per-sample scores:

- `verl091_grpo_loop`: verl 0.9.1's `compute_grpo_outcome_advantage` ("grpo"), a Python loop over samples.
- `verl091_grpo_vectorized`: verl 0.9.1's `compute_grpo_vectorized_outcome_advantage` ("grpo_vectorized",
  groupwise.group_mean_std: index_add_ segment sums in float32).
- `reference_group_loop`: pyrl.ops.reference.group_advantages, a Python loop over groups (one vectorized update per
  group); the baseline of the earlier RESULTS rows, faster than verl's loop over samples.

verl's estimators take token-level rewards [B, T] and a numpy index; here T = 1 (the score itself, mask 1) and the
index holds int64 group ids (verl's cheapest index: no string factorization), so every row computes the same B
per-sample advantages. `test_grpo_estimator_uids` compares whole estimators as verl's trainer calls them: [B, T]
rewards and string uids. Transcriptions in benchmarks/verl091.py (checked against pyrl in
tests/ops/test_verl091_baselines.py). Target (CPU): 65,536 scores in 8,192 groups >= 50x faster."""

import uuid

import numpy as np
import pytest
import torch
import verl091

from pyrl.algos.advantage import get_adv_estimator_fn
from pyrl.ops import group_advantages
from pyrl.ops import reference as ref

N, GROUPS = 65536, 8192
IMPLS = ["pyrl", "verl091_grpo_loop", "verl091_grpo_vectorized", "reference_group_loop"]
ROUNDS = {"pyrl": 50, "verl091_grpo_loop": 3, "verl091_grpo_vectorized": 50, "reference_group_loop": 5}


def _op(impl, scores, index):
    """fn, args computing the B per-sample grpo advantages."""
    if impl == "pyrl":
        return group_advantages, (scores, index, "grpo")
    if impl == "reference_group_loop":
        return ref.group_advantages, (scores, index, "grpo")
    rewards, mask, ids = scores.unsqueeze(-1), torch.ones(scores.shape[0], 1, device=scores.device), index.cpu().numpy()
    if impl == "verl091_grpo_loop":
        return verl091.compute_grpo_outcome_advantage, (rewards, mask, ids)  # writes into its own sum(-1), not rewards
    return verl091.compute_grpo_vectorized_outcome_advantage, (rewards, mask, ids)


@pytest.mark.parametrize("impl", IMPLS)
def test_grpo(benchmark, device, impl):
    scores = torch.randint(0, 2, (N,), device=device).float()
    index = torch.randperm(N, device=device) % GROUPS
    fn, args = _op(impl, scores, index)
    benchmark.group = f"group_advantages grpo {N} scores / {GROUPS} groups {device}"
    benchmark.pedantic(fn, args=args, rounds=ROUNDS[impl], warmup_rounds=1)


@pytest.mark.parametrize("impl", ["pyrl", "verl091_grpo_loop", "verl091_grpo_vectorized"])
def test_grpo_estimator_uids(benchmark, device, impl):
    """The estimators as verl's trainer calls them: rewards [B, T] (the score on the last valid token), the response
    mask and `uid` strings (uuid4, a numpy object array); pyrl's is its registered `grpo` estimator."""
    T = 16
    scores = torch.randint(0, 2, (N,), device=device).float()
    lengths = torch.randint(1, T + 1, (N,), device=device)
    mask = (torch.arange(T, device=device) < lengths[:, None]).float()
    rewards = torch.zeros(N, T, device=device)
    rewards[torch.arange(N, device=device), lengths - 1] = scores
    names = np.array([str(uuid.uuid4()) for _ in range(GROUPS)], dtype=object)
    uids = names[(torch.randperm(N) % GROUPS).numpy()]
    if impl == "pyrl":
        fn, args = get_adv_estimator_fn("grpo"), (rewards, mask, uids)
    elif impl == "verl091_grpo_loop":
        fn, args = verl091.compute_grpo_outcome_advantage, (rewards, mask, uids)
    else:
        fn, args = verl091.compute_grpo_vectorized_outcome_advantage, (rewards, mask, uids)
    benchmark.group = f"grpo estimator, uid strings, {N} x {T} / {GROUPS} groups {device}"
    benchmark.pedantic(fn, args=args, rounds=ROUNDS[impl] if impl != "pyrl" else 20, warmup_rounds=1)
