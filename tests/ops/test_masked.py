import pytest
import torch

from pyrl.ops import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten


def test_hand_computed():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_sum(x, m).item() == 7.0  # the NaN under the mask does not leak
    assert abs(masked_mean(x, m).item() - 7 / 3) < 1e-6
    assert abs(masked_var(x, m).item() - ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2) < 1e-5
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert abs(agg_loss(loss, mask, "token-mean").item() - 7 / 3) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum").item() - (3 + 4) / 2) < 1e-6  # the empty row is skipped
    assert abs(agg_loss(loss, mask, "seq-mean-token-mean").item() - (1.5 + 4) / 2) < 1e-6
    assert abs(agg_loss(loss, mask, "token-sum").item() - 7) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm").item() - 7 / 2 / 3) < 1e-6  # seq-mean / T = 3
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=7).item() - 0.5) < 1e-6
    info = {"batch_num_tokens": 3, "global_batch_size": 2, "dp_size": 1, "loss_scale_factor": 5}
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm", global_batch_info=info).item() - 0.7) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm", 7, info).item() - 0.5) < 1e-6  # the argument wins


def verl_091_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                      loss_scale_factor=None):
    """verl 0.9.1's core_algos.agg_loss, transcribed (float64 inputs)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return (loss_mat * loss_mask).sum() / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return (loss_mat * loss_mask).sum() * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).double()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).double()
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    return (seq_losses * seq_mask).sum() / global_batch_size * dp_size


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("scale", [None, 13.0])
def test_matches_verl_091_agg_loss(mode, scale):
    """Fresh random inputs with an empty row, a length-1 row and odd sizes; alone and as global-batch shares."""
    g = torch.Generator().manual_seed(hash((mode, scale)) % 2**31)
    loss = torch.randn(5, 7, dtype=torch.float64, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.4).double()
    mask[1], mask[2] = 0, 0
    mask[2, 0] = 1  # length 1
    mask[0, 0] = 1
    torch.testing.assert_close(agg_loss(loss, mask, mode, loss_scale_factor=scale),
                               verl_091_agg_loss(loss, mask, mode, loss_scale_factor=scale), rtol=1e-7, atol=1e-12)
    info = {"batch_num_tokens": 40, "global_batch_size": 9, "dp_size": 3, "loss_scale_factor": scale}
    torch.testing.assert_close(agg_loss(loss, mask, mode, global_batch_info=info),
                               verl_091_agg_loss(loss, mask, mode, 3, 40, 9, scale), rtol=1e-7, atol=1e-12)


def test_whiten_against_float64():
    x, m = torch.randn(5, 8, dtype=torch.float64), (torch.rand(5, 8) > 0.3).double()
    m[0, :2] = 1
    valid = x[m.bool()]
    expected = (x - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    torch.testing.assert_close(masked_whiten(x, m), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), expected + valid.mean(), atol=1e-6, rtol=1e-6)


def test_all_masked():
    z = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        out = agg_loss(torch.randn(2, 3), z, mode)
        assert out.item() == 0.0
    with pytest.raises(ValueError, match="mask sums to 0"):
        masked_var(torch.randn(2, 3), z)
    with pytest.raises(ValueError, match="mask sums to 1"):
        masked_whiten(torch.randn(2, 3), torch.tensor([[1.0, 0, 0], [0, 0, 0]]))


def test_gradients():
    loss = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(3, 4) > 0.3).double()
    for mode in LOSS_AGG_MODES:
        assert torch.autograd.gradcheck(lambda x: agg_loss(x, mask, mode), (loss,))


def test_bad_input():
    with pytest.raises(ValueError, match="loss_agg_mode: unknown mode 'mean'"):
        agg_loss(torch.randn(2, 3), torch.ones(2, 3), "mean")
    with pytest.raises(ValueError, match="mask: shape"):
        masked_mean(torch.randn(2, 3), torch.ones(3, 2))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_global_batch_info_shares_sum_to_the_whole_batch_aggregate(mode):
    """Split a batch over 2 ranks x uneven micro-batches: the shares summed per rank and averaged over ranks
    (what gradient accumulation + data-parallel averaging do) equal the aggregate of the whole batch."""
    torch.manual_seed(0)
    loss = torch.randn(7, 5, dtype=torch.float64)
    mask = (torch.rand(7, 5) > 0.4).to(torch.float64)
    mask[3] = 0  # an empty row
    whole = agg_loss(loss, mask, mode)
    info = {"batch_num_tokens": int(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum()), "dp_size": 2}
    ranks = [[slice(0, 1), slice(1, 4)], [slice(4, 7)]]
    per_rank = [sum(agg_loss(loss[s], mask[s], mode, global_batch_info=info) for s in micro) for micro in ranks]
    assert torch.allclose(sum(per_rank) / 2, whole, rtol=1e-9, atol=1e-12)  # masked_mean adds 1e-8 to its count
