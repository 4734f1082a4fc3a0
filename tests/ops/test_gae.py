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


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("b, t", [(5, 17), (33, 3), (2, 1)])
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
        (lambda: compute_gae(torch.randn(6), torch.randn(6), torch.ones(6)), ValueError, r"rewards: expected \[batch, tokens\]"),
        (lambda: compute_gae(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), gamma=float("inf")), ValueError, "gamma"),
        (lambda: compute_gae(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), lam="x"), TypeError, "lam"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([0, 2, 4])), ValueError, "cu_seqlens: must"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([0, 3, 2, 5])), ValueError, "cu_seqlens"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(5), torch.tensor([1.0, 5.0])), ValueError, "cu_seqlens"),
        (lambda: compute_gae_packed(torch.randn(5), torch.randn(4), torch.tensor([0, 5])), ValueError, "values: shape"),
    ],
)
def test_bad_input(backend, call, err, match):
    with pytest.raises(err, match=match):
        call()
