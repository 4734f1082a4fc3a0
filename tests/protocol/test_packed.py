"""Packed layouts: properties (hypothesis) against plain torch indexing of the padded view."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyrl.protocol import DataProto, PackedLayout, PackedTensor


@st.composite
def padded_batches(draw):
    """A [B, P + R] attention mask as the PPO loop builds it: a left-padded prompt then a right-padded
    response (either part may be empty), and random values."""
    rows = draw(st.integers(0, 7))
    prompt_width, response_width = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    prompt_lens = draw(st.lists(st.integers(0, prompt_width), min_size=rows, max_size=rows))
    response_lens = draw(st.lists(st.integers(0, response_width), min_size=rows, max_size=rows))
    prompt = torch.arange(prompt_width)[None] >= prompt_width - torch.tensor(prompt_lens,
                                                                             dtype=torch.int64).reshape(-1, 1)
    response = torch.arange(response_width)[None] < torch.tensor(response_lens, dtype=torch.int64).reshape(-1, 1)
    mask = torch.cat([prompt.reshape(rows, prompt_width), response.reshape(rows, response_width)], 1)
    # a row with an empty response but a prompt, or the reverse, is still one contiguous run
    return mask.long()


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_pack_unpack_is_the_identity_on_tokens(mask, dtype):
    layout = PackedLayout.from_mask(mask)
    values = (torch.randn(mask.shape) * 10).to(dtype)
    packed = layout.pack(values)
    assert packed.shape[0] == int(mask.sum()) == layout.num_tokens
    assert torch.equal(packed, values[mask.bool()])  # row-major order of the tokens
    assert torch.equal(layout.unpack(packed), torch.where(mask.bool(), values, torch.zeros((), dtype=dtype)))
    assert torch.equal(layout.mask(), mask)
    assert layout.lengths.tolist() == mask.sum(1).tolist()


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.data())
def test_take_matches_indexing_the_padded_view(mask, data):
    layout = PackedLayout.from_mask(mask)
    rows = mask.shape[0]
    idx = data.draw(st.lists(st.integers(0, rows - 1), max_size=10)) if rows else []
    values = torch.randn(mask.shape + (3,))
    new_layout, token_index = layout.take(idx)
    taken = PackedTensor(layout.pack(values).index_select(0, token_index), new_layout)
    expected = torch.where(mask.bool()[..., None], values, torch.zeros(()))[idx]
    assert torch.equal(taken.to_padded(), expected)
    assert torch.equal(new_layout.mask(), mask[idx])


@settings(max_examples=40, deadline=None)
@given(st.lists(padded_batches(), min_size=1, max_size=4))
def test_concat_of_layouts(masks):
    width = max(m.shape[1] for m in masks)
    masks = [torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks]  # one padded width
    layouts = [PackedLayout.from_mask(m) for m in masks]
    joined = PackedLayout.concat(layouts)
    assert torch.equal(joined.mask(), torch.cat(masks)) if masks[0].numel() or joined.num_sequences == 0 else True
    assert joined.cu_seqlens.tolist() == [0] + np.cumsum(torch.cat(masks).sum(1).tolist()).tolist()


def test_position_ids_and_padded_index_by_hand():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    layout = PackedLayout.from_mask(mask)
    assert layout.cu_seqlens.tolist() == [0, 2, 5] and layout.starts.tolist() == [2, 0]
    assert layout.position_ids().tolist() == [0, 1, 0, 1, 2]
    assert layout.padded_index().tolist() == [2, 3, 4, 5, 6]
    left = PackedLayout.from_lengths([2, 3], width=4, padding_side="left")
    assert left.starts.tolist() == [2, 1] and left.mask().tolist() == [[False, False, True, True],
                                                                       [False, True, True, True]]


def test_gradients_flow_through_pack_and_unpack():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    layout = PackedLayout.from_mask(mask)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: layout.unpack(layout.pack(t) * 2.0), (x,))
    packed = layout.pack(x)
    packed.sum().backward()
    assert torch.equal(x.grad, mask.double())


def test_bad_masks_and_layouts_are_named():
    with pytest.raises(ValueError, match="mask: row 1 has gaps"):
        PackedLayout.from_mask(torch.tensor([[1, 1, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match=r"mask: expected a \[batch, tokens\] tensor"):
        PackedLayout.from_mask(torch.ones(3))
    with pytest.raises(ValueError, match="cu_seqlens: must be non-decreasing, entry 2 < entry 1"):
        PackedLayout([0, 3, 2], [0, 0], 4)
    with pytest.raises(ValueError, match=r"starts: row 0 \(start 2, length 3\) does not fit in width 4"):
        PackedLayout([0, 3], [2], 4)
    with pytest.raises(TypeError, match="cu_seqlens: expected integers"):
        PackedLayout(torch.tensor([0.0, 1.0]), [0], 4)
    layout = PackedLayout.from_mask(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"indices: entry 1 is 5, outside \[0, 2\)"):
        layout.take([0, 5])
    with pytest.raises(ValueError, match=r"packed: expected 4 tokens"):
        layout.unpack(torch.zeros(3))
    with pytest.raises(ValueError, match=r"values: expected \[4, \.\.\.\]"):
        PackedTensor(torch.zeros(5), layout)


def test_packed_memory_is_the_token_count():
    # long-tailed response lengths (log-normal, median ~150 tokens, capped at 4096), as RL rollouts give
    lengths = torch.distributions.LogNormal(5.0, 1.0).sample((256,)).clamp(1, 4096).long()
    mask = PackedLayout.from_lengths(lengths).mask().long()
    d = DataProto.from_dict({"input_ids": torch.randint(0, 1000, mask.shape), "old_log_probs": torch.randn(mask.shape),
                             "attention_mask": mask})
    packed = d.to_packed()
    layout = packed.batch["input_ids"].layout
    packed_bytes = sum(v.nbytes() for v in packed.batch.values()) + layout.nbytes()
    token_bytes = int(lengths.sum()) * (8 + 4)  # one int64 and one float32 per token
    assert token_bytes <= packed_bytes <= 1.05 * token_bytes
