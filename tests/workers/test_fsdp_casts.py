"""pyrl.workers.fsdp.cast_per_forward on a small plain module (no process group), against autograd through explicit
casts: the gradients of two micro-batches, a tied weight and a transposed use, the masters outside the forward."""

import copy

import pytest
import torch
from torch import nn

from pyrl.workers import fsdp


class Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, hidden, gate=None):
        # a copy of the transpose (as some remote-code models make): the weight's gradient comes back transposed
        out = torch.tanh(hidden @ self.weight.t().contiguous()) * self.scale
        return out if gate is None else out * gate


class Model(nn.Module):
    """A tied embedding and head (one weight used twice), and a float input each layer casts."""

    def __init__(self, vocab: int = 11, width: int = 6, depth: int = 2):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(vocab, width))
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))

    def forward(self, ids, gate):
        hidden = self.embed[ids]
        for layer in self.layers:
            hidden = layer(hidden, gate=gate)
        return hidden @ self.embed.t()


def reference_loss(model: Model, ids, gate, dtype) -> torch.Tensor:
    """The same forward with every weight cast by hand (autograd's own .to, whose gradient autograd accumulates)."""
    embed = model.embed.to(dtype)
    hidden = embed[ids]
    for layer in model.layers:
        out = torch.tanh(hidden @ layer.weight.to(dtype).t().contiguous()) * layer.scale.to(dtype)
        hidden = out * gate.to(dtype)
    return (hidden @ embed.t()).float().logsumexp(-1).sum()


def test_gradients_equal_autograd_through_explicit_casts():
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    fsdp.cast_per_forward(model, model.layers, torch.bfloat16)
    for seed in (1, 2):  # two micro-batches: the second adds into the float32 .grad the first made
        g = torch.Generator().manual_seed(seed)
        ids, gate = torch.randint(0, 11, (5, 3), generator=g), torch.rand(6, generator=g)
        logits = model(ids, gate)
        assert logits.dtype == torch.bfloat16
        logits.float().logsumexp(-1).sum().backward()
        reference_loss(reference, ids, gate, torch.bfloat16).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert type(p) is nn.Parameter and p.dtype == torch.float32, name
        assert p.grad.dtype == torch.float32 and p.grad.stride() == p.stride(), name  # fused AdamW reads it so
        assert torch.equal(p.grad, q.grad), name


def test_masters_come_back_after_a_failed_or_gradient_free_forward():
    model = Model()
    fsdp.cast_per_forward(model, model.layers, torch.bfloat16)
    masters = dict(model.named_parameters())
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]), torch.ones(6))  # an id past the vocabulary
    with torch.no_grad():
        assert model(torch.tensor([[1, 2]]), torch.ones(6)).dtype == torch.bfloat16
    assert dict(model.named_parameters()) == masters
    assert all(p.grad is None for p in model.parameters())
