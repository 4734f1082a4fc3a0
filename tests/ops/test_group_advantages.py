import math

import pytest
import torch

from pyrl.ops import GROUP_ESTIMATORS, group_advantages
from pyrl.ops import reference as ref


def _inputs(n_groups=7, singletons=True):
    sizes = torch.randint(2, 6, (n_groups,))
    if singletons:
        sizes[0] = 1
    ids = torch.repeat_interleave(torch.randint(-10**12, 10**12, (n_groups,)), sizes)  # arbitrary int64 ids
    perm = torch.randperm(ids.numel())  # groups interleaved, not contiguous
    ids = ids[perm]
    scores = torch.randint(0, 3, (ids.numel(),)).float() + torch.rand(ids.numel()) * (torch.rand(ids.numel()) > 0.5)
    scores[:2] = 0.0
    lengths = torch.randint(0, 9, (ids.numel(),))
    return scores, ids, lengths


def oracle_group_advantages(scores, group_index, estimator="grpo", norm_by_std=True, eps=1e-6, lengths=None):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs), in Python floats straight
    from the estimators' definitions (the op module's docstring; verl 0.9.1 core_algos); rloo from its leave-one-out
    form s_i - mean_{j != i} s_j rather than n/(n-1) (s_i - mu)."""
    s = [float(x) for x in scores.double().tolist()]
    lens = None if lengths is None else [float(x) for x in lengths.tolist()]
    groups = {}
    for i, g in enumerate(group_index.tolist()):
        groups.setdefault(g, []).append(i)
    alpha = len(s) / max(1, sum(1 for x in s if x != 0.0))
    out = [0.0] * len(s)
    for members in groups.values():
        n, vals = len(members), [s[i] for i in members]
        mu = math.fsum(vals) / n if n > 1 else 0.0
        sigma = math.sqrt(math.fsum((x - mu) ** 2 for x in vals) / (n - 1)) if n > 1 else 1.0
        if estimator == "grpo_passk":
            assert n >= 2
            best = max(range(n), key=lambda k: (vals[k], -k))  # the first best sample
            second = max(vals[k] for k in range(n) if k != best)
            adv = vals[best] - second
            out[members[best]] = adv / (sigma + eps) if norm_by_std else adv
            continue
        if estimator == "opo":
            total = math.fsum(lens[i] for i in members)
            base = math.fsum(lens[i] * s[i] for i in members) / total if n > 1 and total > 0 else 0.0
        for i in members:
            if estimator == "grpo":
                out[i] = (s[i] - mu) / (sigma + eps) if norm_by_std else s[i] - mu
            elif estimator == "rloo":
                out[i] = s[i] - math.fsum(s[j] for j in members if j != i) / (n - 1) if n > 1 else s[i]
            elif estimator == "reinforce_plus_plus_baseline":
                out[i] = s[i] - mu
            elif estimator == "opo":
                out[i] = s[i] - base
            elif estimator == "gpg":
                out[i] = alpha * (s[i] - mu)
            else:
                raise AssertionError(estimator)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("estimator", list(GROUP_ESTIMATORS))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_verl_loops(backend, device, estimator, norm_by_std):
    scores, ids, lengths = _inputs(singletons=estimator != "grpo_passk")
    lengths[ids == ids[-1]] = 0  # opo: a group whose responses are all empty (baseline 0)
    out = group_advantages(scores.to(device), ids.to(device), estimator, norm_by_std, 1e-6, lengths=lengths.to(device))
    expected = ref.group_advantages(scores.double(), ids, estimator, norm_by_std, 1e-6, lengths)
    assert out.dtype == torch.float32 and out.shape == scores.shape
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)
    # the independent oracle too (for the torch backend, reference.py is the code under test)
    oracle = oracle_group_advantages(scores, ids, estimator, norm_by_std, 1e-6, lengths)
    torch.testing.assert_close(out.cpu().double(), oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimator", list(GROUP_ESTIMATORS))
def test_reference_matches_independent_oracle(estimator):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64, with singleton groups (except grpo_passk), ties, zero scores and all-empty opo groups."""
    for norm_by_std in (True, False):
        scores, ids, lengths = _inputs(n_groups=12, singletons=estimator != "grpo_passk")
        scores = scores.double()
        if estimator == "opo":
            lengths[ids == ids[0]] = 0  # a group whose responses are all empty
        got = ref.group_advantages(scores, ids, estimator, norm_by_std, 1e-6, lengths)
        want = oracle_group_advantages(scores, ids, estimator, norm_by_std, 1e-6, lengths)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_hand_computed(backend, device):
    s = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0], device=device)
    g = torch.tensor([0, 0, 0, 9, 3, 3], device=device)
    # group 0: mean 1/3, std (unbiased) sqrt(1/3); group 9 singleton; group 3 all equal (std 0)
    std0 = (1 / 3) ** 0.5
    grpo = group_advantages(s, g, "grpo", eps=1e-6).cpu()
    torch.testing.assert_close(grpo, torch.tensor([(2 / 3) / (std0 + 1e-6), (-1 / 3) / (std0 + 1e-6),
                                                   (-1 / 3) / (std0 + 1e-6), 5 / (1 + 1e-6), 0.0, 0.0]))
    rloo = group_advantages(s, g, "rloo").cpu()
    torch.testing.assert_close(rloo, torch.tensor([1.0, -0.5, -0.5, 5.0, 0.0, 0.0]))
    passk = group_advantages(s[[0, 1, 2, 4, 5]], g[[0, 1, 2, 4, 5]], "grpo_passk", norm_by_std=False).cpu()
    torch.testing.assert_close(passk, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))
    opo = group_advantages(s[:3], g[:3], "opo", lengths=torch.tensor([1, 3, 0], device=device)).cpu()
    torch.testing.assert_close(opo, torch.tensor([0.75, -0.25, -0.25]))  # baseline (1*1 + 3*0) / 4
    gpg = group_advantages(s, g, "gpg").cpu()  # alpha = 6 / 4 nonzero scores
    torch.testing.assert_close(gpg, 1.5 * torch.tensor([2 / 3, -1 / 3, -1 / 3, 5.0, 0.0, 0.0]))


def test_opo_all_empty_group_is_not_nan(backend, device):
    out = group_advantages(torch.tensor([1.0, 0.0], device=device), torch.tensor([4, 4], device=device), "opo",
                           lengths=torch.tensor([0, 0], device=device))
    torch.testing.assert_close(out.cpu(), torch.tensor([1.0, 0.0]))


def test_large_and_empty(backend, device):
    scores, ids, _ = _inputs(n_groups=300)
    out = group_advantages(scores.to(device), ids.to(device))
    torch.testing.assert_close(out.cpu().double(), ref.group_advantages(scores.double(), ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu().double(), oracle_group_advantages(scores, ids), atol=1e-5, rtol=1e-5)
    assert group_advantages(torch.zeros(0, device=device),
                            torch.zeros(0, dtype=torch.long, device=device)).shape == (0,)


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: group_advantages(torch.randn(3), torch.tensor([0, 0])), ValueError, "group_index: shape"),
        (lambda: group_advantages(torch.randn(3), torch.tensor([0.0, 0.0, 1.0])),
         TypeError, "group_index: expected an integer"),
        (lambda: group_advantages(torch.randn(3), torch.tensor([0, 0, 1]), "ppo"),
         ValueError, "estimator: unknown 'ppo'"),
        (lambda: group_advantages(torch.randn(3), torch.tensor([0, 0, 1]), "opo"),
         ValueError, "lengths: the opo estimator"),
        (lambda: group_advantages(torch.randn(3), torch.tensor([0, 0, 1]), "grpo_passk"),
         ValueError, "at least 2 samples per group"),
        (lambda: group_advantages(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.long)),
         ValueError, r"scores: expected \[B\]"),
        (lambda: group_advantages(torch.randn(3), torch.tensor([0, 0, 1]), eps=-1.0), ValueError, "eps"),
    ],
)
def test_bad_input(backend, call, err, match):
    with pytest.raises(err, match=match):
        call()
