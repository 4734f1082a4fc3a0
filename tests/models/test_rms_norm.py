"""pyrl.models.rms_norm: transformers' Llama-style RMSNorm with a hand-written backward, and its Triton kernels.
Against transformers' own norm (the torch path's forward bit for bit; gradients to rounding) and a float64
transcription of the formula; fp32 and bf16, no rows, one row, odd widths, 2-D to 4-D inputs, frozen weights or
inputs; the torch path on CPU and CUDA (the default on both), the Triton kernels (PYRL_OPS_BACKEND=triton) under the
interpreter on CPU and on CUDA (marked gpu), checked to have run; a whole patched model."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from pyrl.models.rms_norm import patch_rms_norms, runs_fused_norm
from pyrl.ops._dispatch import triton_available

# the interpreter runs Triton on CPU tensors only where the conftest set it (no CUDA on the machine)
PATHS = [pytest.param(("cpu", "torch"), id="cpu-torch"),
         pytest.param(("cuda", "torch"), id="cuda-torch", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available(), reason="needs CUDA")]),
         pytest.param(("cpu", "triton"), id="cpu-triton-interpreter", marks=pytest.mark.skipif(
             not triton_available() or torch.cuda.is_available(),
             reason="the interpreter runs where there is no CUDA")),
         pytest.param(("cuda", "triton"), id="cuda-triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")])]
EPS = 1e-6


def norms(hidden, dtype, device, seed):
    torch.manual_seed(seed)
    plain = Qwen2RMSNorm(hidden, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(1 + 0.3 * torch.randn(hidden))
    patched = Qwen2RMSNorm(hidden, eps=EPS).to(device=device, dtype=dtype)
    patched.load_state_dict(plain.state_dict())
    assert patch_rms_norms(patched) == 1
    return plain, patched


def forward_backward(norm, x, grad_y):
    x = x.clone().requires_grad_()
    norm.weight.grad = None
    y = norm(x)
    y.backward(grad_y)
    return y.detach(), x.grad, norm.weight.grad


def float64_formula(x, weight, grad_y):
    x, weight = x.double().requires_grad_(), weight.double().requires_grad_()
    y = weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    y.backward(grad_y.double())
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(0, 8), (1, 8), (7, 37), (2, 5, 64), (2, 3, 2, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_equals_transformers_and_the_formula_in_float64(shape, dtype, path, monkeypatch, spy_calls):
    device, backend = path
    calls = kernel_calls(backend, monkeypatch, spy_calls)
    plain, patched = norms(shape[-1], dtype, device, seed=sum(shape))
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(device)
    grad_y = torch.randn(shape, generator=g).to(dtype).to(device)
    want, got = forward_backward(plain, x, grad_y), forward_backward(patched, x, grad_y)
    assert calls == (["rms_norm_forward", "rms_norm_backward"] if backend == "triton" else [])
    if backend == "torch":  # transformers' own operations forward
        assert torch.equal(got[0], want[0])
    # one rounding of the dtype apart at most (the Triton sum and the backward's formula run in another order)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        scale = b.abs().max().item() if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=name)
    ref = float64_formula(x.cpu(), plain.weight.detach().cpu(), grad_y.cpu())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        scale = b.abs().max().item() if b.numel() else 1.0
        torch.testing.assert_close(a.cpu().double(), b, rtol=tol, atol=tol * scale, msg=name)


def kernel_calls(backend, monkeypatch, spy_calls) -> list:
    """PYRL_OPS_BACKEND=triton for the Triton paths, and the list their kernels' launchers append to as they run."""
    if backend != "triton":
        return []
    monkeypatch.setenv("PYRL_OPS_BACKEND", "triton")
    from pyrl.kernels import rms_norm as kernels

    return spy_calls(kernels, "rms_norm_forward", "rms_norm_backward")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_a_frozen_weight_or_input(frozen, path, monkeypatch, spy_calls):
    """Only the gradient asked for is computed (the torch path's needs_input_grad branches, the kernel without its
    weight-gradient sums), and it equals transformers'."""
    device, backend = path
    calls = kernel_calls(backend, monkeypatch, spy_calls)
    plain, patched = norms(24, torch.float32, device, seed=1)
    x, grad_y = torch.randn(5, 24, device=device), torch.randn(5, 24, device=device)
    results = []
    for norm in (plain, patched):
        norm.weight.requires_grad_(frozen != "weight")
        leaf = x.clone().requires_grad_(frozen != "input")
        norm(leaf).backward(grad_y)
        results.append(leaf.grad if frozen == "weight" else norm.weight.grad)
    assert results[1] is not None
    torch.testing.assert_close(results[1], results[0], rtol=2e-6, atol=2e-6)
    if backend == "triton":
        assert calls == ["rms_norm_forward", "rms_norm_backward"]


def test_a_weight_of_another_dtype_promotes_as_transformers_does():
    """A float32 weight over bf16 inputs (a model not cast whole) gives float32 outputs, as transformers' product
    does; the torch path takes it."""
    plain, patched = norms(16, torch.float32, "cpu", seed=2)
    x, grad_y = torch.randn(3, 16).bfloat16(), torch.randn(3, 16)
    want, got = forward_backward(plain, x, grad_y), forward_backward(patched, x, grad_y)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=2 ** -7 * b.abs().max().item())


def test_only_transformers_llama_style_norms_are_patched():
    class ScaledNorm(Qwen2RMSNorm):  # e.g. Gemma's (1 + w)
        def forward(self, x):
            return 2 * super().forward(x)

    assert not runs_fused_norm(ScaledNorm(8)) and not runs_fused_norm(torch.nn.LayerNorm(8))
    assert patch_rms_norms(torch.nn.Sequential(ScaledNorm(8), torch.nn.LayerNorm(8))) == 0


def test_a_patched_model_equals_the_unpatched_one():
    from transformers import AutoModelForCausalLM

    from pyrl.models import tiny_model_path

    plain, patched = (AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32) for _ in range(2))
    assert patch_rms_norms(patched) == 2 * plain.config.num_hidden_layers + 1
    ids = torch.randint(3, plain.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    out = []
    for model in (plain, patched):
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        out.append((logits.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert torch.equal(out[0][0], out[1][0])  # the forward is transformers' own operations on CPU
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item(), msg=name)
