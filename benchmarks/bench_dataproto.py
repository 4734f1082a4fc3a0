"""(d) DataProto.concat of 64 chunks and chunk(64) of a 1M-token batch: packed token-level fields (C++
layouts) vs the same data padded to the longest sequence."""

import numpy as np
import pytest
import torch

from pyrl.protocol import DataProto, PackedLayout

B = 4096


def _batch(packed: bool):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(5.0, 0.9).sample((B,)).clamp(1, 2048).long()
    lengths = (lengths.double() * (1_000_000 / float(lengths.sum()))).round().clamp(1, 2048).long()  # ~1M tokens
    mask = PackedLayout.from_lengths(lengths).mask().long()
    data = DataProto.from_dict(
        {"input_ids": torch.randint(0, 32000, mask.shape, generator=gen),
         "old_log_probs": torch.randn(mask.shape, generator=gen),
         "attention_mask": mask, "score": torch.randn(B, generator=gen)},
        {"uid": np.array([f"uid-{i // 8}" for i in range(B)], dtype=object)},
    )
    return data.to_packed() if packed else data


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_chunk_64(benchmark, layout):
    data = _batch(layout == "packed")
    benchmark.group = "DataProto.chunk(64), ~1M tokens"
    chunks = benchmark(data.chunk, 64)
    assert len(chunks) == 64


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_concat_64(benchmark, layout):
    chunks = _batch(layout == "packed").chunk(64)
    benchmark.group = "DataProto.concat of 64 chunks, ~1M tokens"
    joined = benchmark(DataProto.concat, chunks)
    assert len(joined) == B
