"""pyrl.ops on DataProto's packed view give the padded op's numbers."""

import pytest
import torch

from pyrl.ops import compute_gae, compute_gae_packed
from pyrl.protocol import DataProto, PackedLayout, PackedTensor


def test_compute_gae_packed_on_a_packed_dataproto(backend):
    lengths = torch.tensor([5, 1, 7, 3, 7])
    mask = PackedLayout.from_lengths(lengths).mask().float()
    b, t = mask.shape
    rewards, values = torch.randn(b, t) * mask, torch.randn(b, t) * mask
    d = DataProto.from_dict({"token_level_rewards": rewards, "values": values, "response_mask": mask})
    packed = d.to_packed("response_mask")
    adv, ret = compute_gae_packed(packed.batch["token_level_rewards"], packed.batch["values"], gamma=0.99, lam=0.95)
    assert isinstance(adv, PackedTensor) and adv.layout is packed.batch["values"].layout
    adv_padded, ret_padded = compute_gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv.to_padded(), adv_padded * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.to_padded(), ret_padded * mask, atol=1e-5, rtol=1e-5)


def test_packed_inputs_must_share_a_layout():
    a = PackedTensor(torch.randn(4), PackedLayout.from_lengths([2, 2]))
    b = PackedTensor(torch.randn(4), PackedLayout.from_lengths([1, 3]))
    with pytest.raises(ValueError, match="values: laid out differently from rewards"):
        compute_gae_packed(a, b)
    with pytest.raises(ValueError, match="cu_seqlens: required"):
        compute_gae_packed(torch.randn(4), torch.randn(4))
