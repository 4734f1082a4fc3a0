"""ppo_policy_loss (one fused kernel: loss, derivative and metric sums) vs verl's torch formulation, forward +
backward at 262,144 tokens."""

import pytest
import torch

from pyrl.ops import ppo_policy_loss
from pyrl.ops import reference as ref

SHAPE = (256, 1024)


@pytest.mark.parametrize("impl", ["pyrl", "torch"])
def test_vanilla_fwd_bwd(benchmark, device, impl):
    logp = (-torch.rand(SHAPE, device=device)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(SHAPE, device=device)
    adv = torch.randn(SHAPE, device=device)
    mask = (torch.rand(SHAPE, device=device) > 0.2).float()
    fn = ppo_policy_loss if impl == "pyrl" else ref.ppo_policy_loss

    def step():
        logp.grad = None
        loss, metrics = fn(logp, old, adv, mask, 0.2, 0.28, 3.0)
        loss.backward()
        return metrics

    benchmark.group = f"ppo_policy_loss fwd+bwd {SHAPE} {device}"
    benchmark(step)
