"""The verl 0.9.1 transcriptions the benchmarks compare against (benchmarks/verl091.py) compute what pyrl's ops
compute, so the benchmark rows time the same result.

Tolerances. Log-probs, float32: 1e-5 (abs and rel; |logp| ~ 10, float32 rounding of a logsumexp). bfloat16: verl's
CPU path (logprobs_from_logits_v2, bf16 branch) and its naive one return bfloat16 log-probs (log_softmax in the
logits' dtype), pyrl float32: they agree to bfloat16 rounding of the row's logsumexp and of the result, 2**-7 x
max(|logsumexp|, |logp|) (one bf16 ulp of the larger; measured <= 0.55 of that over 500 seeds). Gradients:
float32 1e-6 abs, bfloat16 one ulp of the gradient's magnitude. Group advantages: float32 rewards 1e-5 (verl computes
mean and std in float32, pyrl accumulates in float64); bfloat16 rewards: verl's loop computes mean, std and the
result in bfloat16 (0.02 abs + 0.02 rel; measured <= 0.017 abs over 200 seeds), its vectorized estimator in
float32 (1e-5).
"""

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from pyrl.algos.advantage import get_adv_estimator_fn
from pyrl.ops import group_advantages, logprobs_from_logits

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "verl091.py"
_spec = importlib.util.spec_from_file_location("verl091", _PATH)
verl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verl)


@pytest.mark.parametrize("shape", [(37,), (3, 13)])
def test_logprobs_fp32(shape):
    vocab = 1000 + int(torch.randint(0, 100, ()))
    logits = torch.randn(*shape, vocab) * 3
    labels = torch.randint(0, vocab, shape)
    ours = logprobs_from_logits(logits, labels)
    for fn in (verl.logprobs_from_logits, verl.logprobs_from_logits_v2, verl.logprobs_from_logits_naive):
        theirs = fn(logits, labels)
        assert theirs.dtype == torch.float32 and theirs.shape == labels.shape
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_grad(dtype):
    n, vocab = 19, 777
    x = (torch.randn(n, vocab) * 3).to(dtype)
    labels = torch.randint(0, vocab, (n,))
    w = torch.randn(n)
    grads = {}
    for name, fn in [("pyrl", logprobs_from_logits), ("v2", verl.logprobs_from_logits_v2),
                     ("naive", verl.logprobs_from_logits_naive)]:
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, labels)
        if dtype == torch.bfloat16:
            # the dtype difference by design: verl returns the logits' dtype, pyrl float32
            assert out.dtype == (torch.float32 if name == "pyrl" else torch.bfloat16)
        (out.float() * w).sum().backward()
        assert leaf.grad.dtype == dtype
        grads[name] = leaf.grad.float()
    for name in ("v2", "naive"):
        if dtype == torch.float32:
            torch.testing.assert_close(grads[name], grads["pyrl"], atol=1e-6, rtol=1e-5)
        else:  # d logp / d z = onehot - softmax, |.| <= |w| ~ 3: one bf16 ulp there is 2**-6
            torch.testing.assert_close(grads[name], grads["pyrl"], atol=2**-6, rtol=2**-7)


@pytest.mark.parametrize("shape", [(37,), (3, 13)])
def test_logprobs_bf16(shape):
    vocab = 1000 + int(torch.randint(0, 100, ()))
    logits = (torch.randn(*shape, vocab) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, shape)
    ours = logprobs_from_logits(logits, labels)
    assert ours.dtype == torch.float32
    for fn in (verl.logprobs_from_logits, verl.logprobs_from_logits_naive):
        theirs = fn(logits, labels)
        assert theirs.dtype == torch.bfloat16 and theirs.shape == labels.shape
        # log_softmax in bf16 rounds the row's logsumexp and the result: one bf16 ulp of the larger of the two
        bound = 2**-7 * torch.maximum(torch.logsumexp(logits.float(), -1).abs(), ours.abs())
        assert bool(((theirs.float() - ours).abs() <= bound).all()), (
            float(((theirs.float() - ours).abs() / bound).max()))


def _grpo_batch(dtype, n_groups=40, T=6):
    """verl's inputs: token-level rewards [B, T] with the outcome score on the last valid token, the response mask,
    and string uids (numpy object array). Group sizes 1..8, group 0 a singleton, some groups all-equal (std 0).
    Scores are multiples of 1/4 (exact in bf16 and fp32), so groups' std is 0 exactly or >= ~0.1."""
    sizes = torch.randint(1, 9, (n_groups,))
    sizes[0] = 1
    sizes[1] = 4
    ids = torch.repeat_interleave(torch.arange(n_groups), sizes)
    ids = ids[torch.randperm(ids.numel())]
    b = ids.numel()
    scores = torch.randint(0, 9, (b,)).float() / 4 - 1
    scores[ids == 1] = 0.75  # all equal: std 0, advantage 0
    lengths = torch.randint(1, T + 1, (b,))
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.zeros(b, T)
    rewards[torch.arange(b), lengths - 1] = scores
    uids = np.array([f"uid-{int(g) * 7919 % 1000:04d}" for g in ids], dtype=object)
    return rewards.to(dtype), mask, uids, scores, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_loop_and_vectorized(dtype, norm):
    rewards, mask, uids, scores, ids = _grpo_batch(dtype)
    loop, _ = verl.compute_grpo_outcome_advantage(rewards.clone(), mask, uids, 1e-6, norm)
    vec, _ = verl.compute_grpo_vectorized_outcome_advantage(rewards.clone(), mask, uids, 1e-6, norm)
    assert vec.dtype == torch.float32
    ours = group_advantages(scores.to(dtype), ids, "grpo", norm, 1e-6).unsqueeze(-1) * mask
    for name in ("grpo", "grpo_vectorized"):  # pyrl's registered estimators, verl's signature
        adv, _ = get_adv_estimator_fn(name)(rewards, mask, uids, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(adv, ours, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vec, ours, atol=1e-5, rtol=1e-5)
    loop_tol = 1e-5 if dtype == torch.float32 else 0.02  # the loop's mean, std and result in bf16
    torch.testing.assert_close(loop.float(), ours, atol=loop_tol, rtol=loop_tol)
    # singleton group: mu 0, sigma 1 in both verl estimators and in pyrl
    single = int(np.nonzero(ids.numpy() == 0)[0][0])
    expected = scores[single] / (1 + 1e-6) if norm else scores[single]
    for adv in (loop.float(), vec, ours):
        torch.testing.assert_close(adv[single, 0], expected, atol=1e-6, rtol=1e-6)
    # all-equal group: 0 everywhere
    assert float(vec[ids == 1].abs().max()) == 0.0 and float(ours[ids == 1].abs().max()) == 0.0


def test_group_mean_std_variance_floor():
    """group_mean_std floors the variance (sqrt(max(var, eps))), but grpo_vectorized calls it with eps=0.0 and adds
    epsilon to sigma instead, as the loop does; with the default eps=1e-6 a constant group's sigma would be 1e-3."""
    s = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    _, std0, _ = verl.group_mean_std(s, g, eps=0.0)
    _, std6, _ = verl.group_mean_std(s, g)
    assert float(std0[0]) == 0.0 and abs(float(std6[0]) - 1e-3) < 1e-9
    torch.testing.assert_close(std0[1], torch.tensor(2**-0.5))
