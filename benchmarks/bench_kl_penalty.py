"""kl_penalty (one fused kernel forward and backward) vs the torch formulation (verl's)."""

import pytest
import torch

from pyrl.ops import kl_penalty
from pyrl.ops import reference as ref

SHAPE = (256, 1024)


@pytest.mark.parametrize("impl", ["pyrl", "torch"])
def test_k3_fwd_bwd(benchmark, device, impl):
    logp = torch.randn(SHAPE, device=device, requires_grad=True)
    ref_logp = torch.randn(SHAPE, device=device)
    fn = kl_penalty if impl == "pyrl" else ref.kl_penalty

    def step():
        logp.grad = None
        fn(logp, ref_logp, "low_var_kl").sum().backward()

    benchmark.group = f"kl_penalty k3 fwd+bwd {SHAPE} {device}"
    benchmark(step)
