"""(c) Padded vs packed memory for a batch with long-tailed response lengths (log-normal, capped at the
padded width): bytes of the PPO loop's token-level fields. Target: packed within 5% of the true token
count. Also the time of packing and unpacking."""

import torch

from pyrl.protocol import DataProto, PackedLayout, PackedTensor

B, WIDTH = 1024, 8192
FIELDS = {"input_ids": torch.int64, "position_ids": torch.int64, "old_log_probs": torch.float32,
          "ref_log_prob": torch.float32, "advantages": torch.float32}


def _batch():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(6.0, 1.0).sample((B,)).clamp(1, WIDTH).long()
    lengths[0] = WIDTH  # one sequence reaches the limit, as one always does
    mask = PackedLayout.from_lengths(lengths, WIDTH).mask().long()
    tensors = {k: torch.randint(0, 100, (B, WIDTH), generator=gen).to(dtype) for k, dtype in FIELDS.items()}
    tensors["attention_mask"] = mask
    return DataProto.from_dict(tensors), lengths


def _bytes(data):
    total = 0
    for value in data.batch.values():
        total += value.nbytes() if isinstance(value, PackedTensor) else value.numel() * value.element_size()
    layouts = {id(v.layout): v.layout for v in data.batch.values() if isinstance(v, PackedTensor)}
    return total + sum(layout.nbytes() for layout in layouts.values())


def test_packed_memory(benchmark):
    padded, lengths = _batch()
    packed = benchmark.pedantic(padded.to_packed, rounds=3)
    token_bytes = int(lengths.sum()) * sum(torch.empty(0, dtype=d).element_size() for d in FIELDS.values())
    padded_bytes, packed_bytes = _bytes(padded), _bytes(packed)
    benchmark.extra_info.update({"tokens": int(lengths.sum()), "padded_MiB": padded_bytes / 2**20,
                                 "packed_MiB": packed_bytes / 2**20, "token_MiB": token_bytes / 2**20,
                                 "packed_over_tokens": packed_bytes / token_bytes})
    print(f"\npadded {padded_bytes / 2**20:.1f} MiB, packed {packed_bytes / 2**20:.1f} MiB, "
          f"true tokens {token_bytes / 2**20:.1f} MiB ({packed_bytes / token_bytes:.4f}x)")
    assert packed_bytes <= 1.05 * token_bytes


def test_unpack(benchmark):
    packed = _batch()[0].to_packed()
    benchmark.pedantic(packed.to_padded, rounds=3)
