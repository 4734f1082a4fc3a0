"""fused_linear_logprobs (chunked, never [N, V]) vs hidden @ W.T then log_softmax + gather: time of
forward + backward."""

import pytest
import torch
from peers import fused_linear_logprobs_fn as liger_fused_linear_logprobs

from pyrl.ops import fused_linear_logprobs
from pyrl.ops import reference as ref

N, H, V = 1024, 256, 32000


@pytest.mark.parametrize("impl", ["pyrl", "torch", "liger"])
def test_fwd_bwd(benchmark, device, impl):
    fn = {"pyrl": lambda: fused_linear_logprobs, "torch": lambda: ref.fused_linear_logprobs,
          "liger": lambda: liger_fused_linear_logprobs(device)}[impl]()
    hidden = torch.randn(N, H, device=device, requires_grad=True)
    weight = (torch.randn(V, H, device=device) / H**0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), device=device)

    def step():
        hidden.grad = weight.grad = None
        fn(hidden, weight, labels).sum().backward()

    benchmark.group = f"fused_linear_logprobs fwd+bwd N={N} H={H} V={V} {device}"
    benchmark(step)
