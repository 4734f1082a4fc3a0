"""value_loss (one fused kernel) vs verl's torch formulation, forward + backward."""

import pytest
import torch

from pyrl.ops import reference as ref
from pyrl.ops import value_loss

SHAPE = (256, 1024)


@pytest.mark.parametrize("impl", ["pyrl", "torch"])
def test_value_loss_fwd_bwd(benchmark, device, impl):
    values = torch.randn(SHAPE, device=device, requires_grad=True)
    old, returns = values.detach() + 0.3 * torch.randn(SHAPE, device=device), torch.randn(SHAPE, device=device)
    mask = (torch.rand(SHAPE, device=device) > 0.2).float()
    fn = value_loss if impl == "pyrl" else ref.value_loss

    def step():
        values.grad = None
        fn(values, old, returns, mask, 0.5)[0].backward()

    benchmark.group = f"value_loss fwd+bwd {SHAPE} {device}"
    benchmark(step)
