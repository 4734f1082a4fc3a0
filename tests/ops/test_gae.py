import math

import pytest
import torch

from pyrl.ops import compute_gae, compute_gae_packed
from pyrl.ops import reference as ref


def _random_mask(b, t):
    """Right-padded responses of random length (some empty) with a few masked observation tokens inside."""
    lengths = torch.randint(0, t + 1, (b,))
    lengths[0] = t
    lengths[1] = 1
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    holes = torch.rand(b, t) < 0.15
    holes[:, 0] = False
    mask[holes] = 0.0
    return mask


def _oracle_scan(r, v, m, gamma, lam):
    """One sequence (lists of floats, binary mask), backwards in time: at an unmasked token
    A = r_t + gamma V_next - V_t + gamma lam A_next, and V_next, A_next become V_t, A; a masked token changes
    neither and takes A_next as its advantage. returns_t = A_t + V_t."""
    adv, next_value, next_adv = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        assert m[t] in (0.0, 1.0)
        if m[t]:
            next_adv = r[t] + gamma * next_value - v[t] + gamma * lam * next_adv
            next_value = v[t]
        adv[t] = next_adv
    return adv, [a + b for a, b in zip(adv, v)]


def _oracle_whiten(adv, m):
    """(A - mean) / sqrt(var + 1e-8) at every position; mean and unbiased variance over the unmasked tokens, each
    mean dividing by count + 1e-8 as verl's masked_mean does (with a spread small against the mean, leaving that
    out moves the whitened values by more than 1e-7)."""
    valid = [a for a, k in zip(adv, m) if k]
    n = len(valid)
    mean = math.fsum(valid) / (n + 1e-8)
    var = math.fsum((a - mean) ** 2 for a in valid) / (n + 1e-8) * n / (n - 1)
    return [(a - mean) / math.sqrt(var + 1e-8) for a in adv]


def oracle_gae(rewards, values, mask, gamma, lam, whiten=True, cu_seqlens=None):
    """Independent float64 oracle (not pyrl.ops.reference, which the torch backend runs), in Python floats from
    verl's definition: the scan per row of padded [B, T] inputs, or per sequence [cu[i], cu[i+1]) of packed [N] ones
    (mask None: all ones), then whitening over the whole batch. (advantages, returns), float64."""
    shape = rewards.shape
    r, v = rewards.double().flatten().tolist(), values.double().flatten().tolist()
    m = [1.0] * len(r) if mask is None else mask.double().flatten().tolist()
    if cu_seqlens is None:
        bounds = [(i * shape[-1], (i + 1) * shape[-1]) for i in range(shape[0])]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for a, b in bounds:
        adv[a:b], ret[a:b] = _oracle_scan(r[a:b], v[a:b], m[a:b], gamma, lam)
    if whiten:
        adv = _oracle_whiten(adv, m)
    as_t = lambda x: torch.tensor(x, dtype=torch.float64).view(shape)  # noqa: E731
    return as_t(adv), as_t(ret)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("b, t", [(5, 17), (7, 3), (2, 1)])
def test_padded_matches_verl_loop(backend, device, gamma, lam, b, t):
    rewards, values = torch.randn(b, t), torch.randn(b, t)
    mask = _random_mask(b, t)
    if mask.sum() < 2:
        mask[0, :] = 1
    adv, ret = compute_gae(rewards.to(device), values.to(device), mask.to(device), gamma, lam)
    adv64, ret64 = ref.compute_gae(rewards.double(), values.double(), mask.double(), gamma, lam)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv.cpu().double(), adv64, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret64, atol=2e-5, rtol=1e-5)
    # the independent oracle too (for the torch backend, reference.py is the code under test)
    adv_o, ret_o = oracle_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.cpu().double(), adv_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret_o, atol=2e-5, rtol=1e-5)
    adv, ret = compute_gae(rewards.to(device), values.to(device), mask.to(device), gamma, lam, whiten=False)
    adv_o, _ = oracle_gae(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(adv.cpu().double(), adv_o, atol=2e-5, rtol=1e-5)


def test_sequences_longer_than_a_scan_block(backend, device):
    """The Triton kernel scans BLOCK tokens at a time from a sequence's end and carries (nextV, lastA) into the
    block before: sequences of 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 BLOCK + 37 and 3 BLOCK tokens, padded and packed,
    masked tokens straddling a block edge, and a whole masked block the carry must cross unchanged."""
    from pyrl.kernels.gae import BLOCK

    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 37, 3 * BLOCK]
    t = max(lengths)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    mask[:, 2 * BLOCK - 3:2 * BLOCK + 2] = 0.0  # straddling the edge 2 BLOCK (rows ending at t = 3 BLOCK)
    mask[-1, BLOCK:2 * BLOCK] = 0.0  # the middle block of the last row: every token an observation
    mask[:, 0] = 1.0
    rewards, values = torch.randn(len(lengths), t), torch.randn(len(lengths), t)
    adv, ret = compute_gae(rewards.to(device), values.to(device), mask.to(device), 0.99, 0.95, whiten=False)
    adv_o, ret_o = oracle_gae(rewards, values, mask, 0.99, 0.95, whiten=False)
    torch.testing.assert_close(adv.cpu().double(), adv_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret_o, atol=2e-5, rtol=1e-5)
    cu = torch.tensor([0] + lengths).cumsum(0)
    flat = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
    adv, ret = compute_gae_packed(flat(rewards).to(device), flat(values).to(device), cu.to(device), 0.99, 0.95,
                                  mask=flat(mask).to(device), whiten=False)
    torch.testing.assert_close(adv.cpu().double(), flat(adv_o), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), flat(ret_o), atol=2e-5, rtol=1e-5)
    # whitened: the kernel's moments merged block by block and sequence by sequence give the batch's statistics
    adv, _ = compute_gae(rewards.to(device), values.to(device), mask.to(device), 0.99, 0.95)
    torch.testing.assert_close(adv.cpu().double(), oracle_gae(rewards, values, mask, 0.99, 0.95)[0],
                               atol=2e-5, rtol=1e-5)
    adv, _ = compute_gae_packed(flat(rewards).to(device), flat(values).to(device), cu.to(device), 0.99, 0.95,
                                mask=flat(mask).to(device))
    want = oracle_gae(flat(rewards), flat(values), flat(mask), 0.99, 0.95, cu_seqlens=cu)[0]
    torch.testing.assert_close(adv.cpu().double(), want, atol=2e-5, rtol=1e-5)


def test_hand_computed(backend, device):
    # one sequence, gamma = 0.5, lam = 1: A_2 = r2 - V2, A_1 = r1 + .5 V2 - V1 + .5 A_2, ...
    r = torch.tensor([[0.0, 0.0, 1.0]], device=device)
    v = torch.tensor([[0.5, 0.25, 0.0]], device=device)
    m = torch.ones(1, 3, device=device)
    adv, ret = compute_gae(r, v, m, gamma=0.5, lam=1.0, whiten=False)
    a2 = 1.0
    a1 = 0.0 + 0.5 * 0.0 - 0.25 + 0.5 * a2
    a0 = 0.0 + 0.5 * 0.25 - 0.5 + 0.5 * a1
    torch.testing.assert_close(adv.cpu(), torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret.cpu(), torch.tensor([[a0 + 0.5, a1 + 0.25, a2]]))
    # a masked middle token carries the later value and advantage through
    m = torch.tensor([[1.0, 0.0, 1.0]], device=device)
    adv, _ = compute_gae(r, v, m, gamma=0.5, lam=1.0, whiten=False)
    b0 = 0.0 + 0.5 * 0.0 - 0.5 + 0.5 * a2  # next value is V2 (skipping V1), lastA is A2
    torch.testing.assert_close(adv.cpu(), torch.tensor([[b0, a2, a2]]))


def test_whitening_stats_come_from_unmasked_tokens(backend, device):
    rewards, values = torch.randn(6, 9, device=device), torch.randn(6, 9, device=device)
    mask = _random_mask(6, 9).to(device)
    adv, _ = compute_gae(rewards, values, mask)
    valid = adv[mask.bool()].double()
    assert abs(valid.mean().item()) < 1e-5
    assert abs(valid.std().item() - 1.0) < 1e-4


@pytest.mark.parametrize("lengths", [[3, 1, 0, 7], [1, 1], [5, 0, 0, 2, 9, 1]])
def test_packed_equals_padded(backend, device, lengths):
    cu = torch.tensor([0] + lengths).cumsum(0)
    n = int(cu[-1])
    rewards, values = torch.randn(n), torch.randn(n)
    mask = (torch.rand(n) > 0.2).float()
    mask[:2] = 1
    adv, ret = compute_gae_packed(rewards.to(device), values.to(device), cu.to(device), 0.97, 0.9, mask=mask.to(device))
    adv64, ret64 = ref.compute_gae_packed(rewards.double(), values.double(), cu, 0.97, 0.9, mask.double())
    torch.testing.assert_close(adv.cpu().double(), adv64, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret64, atol=2e-5, rtol=1e-5)
    adv_o, ret_o = oracle_gae(rewards, values, mask, 0.97, 0.9, cu_seqlens=cu)  # independent of reference.py
    torch.testing.assert_close(adv.cpu().double(), adv_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret_o, atol=2e-5, rtol=1e-5)
    # the packed layout of a right-padded batch gives the padded op's numbers
    t = max(lengths)
    padded = lambda x: torch.stack([torch.nn.functional.pad(x[a:b], (0, t - (b - a))) for a, b in zip(cu[:-1], cu[1:])])  # noqa: E731
    pmask = padded(mask)
    adv_p, ret_p = compute_gae(padded(rewards).to(device), padded(values).to(device), pmask.to(device), 0.97, 0.9)
    torch.testing.assert_close(adv_p.cpu()[pmask.bool()], adv.cpu()[mask.bool()], atol=2e-5, rtol=1e-5)


def test_packed_without_mask(backend, device):
    cu = torch.tensor([0, 4, 4, 10])
    rewards, values = torch.randn(10), torch.randn(10)
    adv, ret = compute_gae_packed(rewards.to(device), values.to(device), cu.to(device), whiten=False)
    adv64, ret64 = ref.compute_gae_packed(rewards.double(), values.double(), cu, whiten=False)
    torch.testing.assert_close(adv.cpu().double(), adv64, atol=1e-5, rtol=1e-5)
    adv_o, ret_o = oracle_gae(rewards, values, None, 1.0, 1.0, whiten=False, cu_seqlens=cu)  # independent
    torch.testing.assert_close(adv.cpu().double(), adv_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ret_o, atol=1e-5, rtol=1e-5)
    adv, _ = compute_gae_packed(rewards.to(device), values.to(device), cu.to(device))  # whitened over all tokens
    torch.testing.assert_close(adv.cpu().double(), oracle_gae(rewards, values, None, 1.0, 1.0, cu_seqlens=cu)[0],
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("whiten", [True, False])
def test_reference_matches_independent_oracle(whiten):
    """reference.py (the torch backend and the other tests' float64 oracle) against the independent oracle, in
    float64: padded (empty rows, length 1, holes) and packed (empty sequences, no mask)."""
    for (b, t), (gamma, lam) in (((7, 9), (0.99, 0.95)), ((2, 1), (1.0, 1.0)), ((4, 5), (0.9, 0.0))):
        rewards, values = torch.randn(b, t, dtype=torch.float64), torch.randn(b, t, dtype=torch.float64)
        mask = _random_mask(b, t).double()
        if mask.sum() < 2:
            mask[0, :] = 1
        for got, want in zip(ref.compute_gae(rewards, values, mask, gamma, lam, whiten),
                             oracle_gae(rewards, values, mask, gamma, lam, whiten)):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    cu = torch.tensor([0, 3, 4, 4, 11, 12])
    rewards, values = torch.randn(12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    mask = (torch.rand(12) > 0.2).double()
    mask[:2] = 1
    for m in (mask, None):
        for got, want in zip(ref.compute_gae_packed(rewards, values, cu, 0.97, 0.9, m, whiten),
                             oracle_gae(rewards, values, m, 0.97, 0.9, whiten, cu_seqlens=cu)):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_all_masked_batch_cannot_be_whitened(backend, device):
    z = torch.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match="mask"):
        compute_gae(z, z, z)
    adv, ret = compute_gae(z + 1, z, z, whiten=False)  # without whitening it is fine: A carries 0
    assert torch.equal(adv.cpu(), torch.zeros(3, 4))


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: compute_gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3)), ValueError, "values: shape"),
        (lambda: compute_gae(torch.randn(6), torch.randn(6), torch.ones(6)),
         ValueError, r"rewards: expected \[batch, tokens\]"),
        (lambda: compute_gae(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), gamma=float("inf")),
         ValueError, "gamma"),
        (lambda: compute_gae(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), lam="x"), TypeError, "lam"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([0, 2, 4])),
         ValueError, "cu_seqlens: must"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([0, 3, 2, 5])),
         ValueError, "cu_seqlens"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([1.0, 5.0])),
         ValueError, "cu_seqlens"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(4), torch.tensor([0, 5])), ValueError, "values: shape"),
    ],
)
def test_bad_input(backend, call, err, match):
    with pytest.raises(err, match=match):
        call()
