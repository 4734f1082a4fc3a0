"""pyrl.models.gated_mlp: the gated MLP that keeps only x, the gate and up projections for its backward. Its outputs
and every gradient equal transformers' own MLP bit for bit (the same operations), and a float64 transcription of
the formula within float tolerance; fp32 and bf16, 1 and odd token counts, 2-D and 3-D inputs, frozen weights; it
keeps half the MLP's activations; LoRA-wrapped projections, other classes, biases and activations run their own
forward; a whole patched model
equals the unpatched one (logits and gradients); CUDA (marked gpu)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from pyrl.models.gated_mlp import gated_mlp, patch_gated_mlps, runs_gated
from pyrl.ops._dispatch import triton_available

HIDDEN, INTERMEDIATE = 24, 40
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]


def mlps(dtype, device, seed=0):
    """transformers' Qwen2MLP and a patched copy of it with the same weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    plain = Qwen2MLP(config).to(device=device, dtype=dtype)
    patched = Qwen2MLP(config).to(device=device, dtype=dtype)
    patched.load_state_dict(plain.state_dict())
    assert patch_gated_mlps(patched) == 1
    return plain, patched


def forward_backward(mlp, x, grad_out):
    x = x.clone().requires_grad_()
    for p in mlp.parameters():
        p.grad = None
    out = mlp(x)
    out.backward(grad_out)
    return out.detach(), x.grad, {name: p.grad for name, p in mlp.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1,), (7,), (1, 1), (3, 5), (1, 33)], ids=lambda s: "x".join(map(str, s)))
def test_equals_transformers_bit_for_bit(shape, dtype, device):
    plain, patched = mlps(dtype, device, seed=sum(shape))
    g = torch.Generator(device=device).manual_seed(len(shape))
    x = torch.randn(*shape, HIDDEN, generator=g, device=device).to(dtype)
    grad_out = torch.randn(*shape, HIDDEN, generator=g, device=device).to(dtype)
    want, got = forward_backward(plain, x, grad_out), forward_backward(patched, x, grad_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_matches_the_formula_in_float64(dtype, tol):
    torch.manual_seed(3)
    x = torch.randn(2, 9, HIDDEN, dtype=torch.float64)
    weights = [torch.randn(INTERMEDIATE, HIDDEN, dtype=torch.float64) * 0.2,
               torch.randn(INTERMEDIATE, HIDDEN, dtype=torch.float64) * 0.2,
               torch.randn(HIDDEN, INTERMEDIATE, dtype=torch.float64) * 0.2]
    grad_out = torch.randn(2, 9, HIDDEN, dtype=torch.float64)
    ref_inputs = [t.clone().requires_grad_() for t in (x, *weights)]
    xr, wg, wu, wd = ref_inputs
    gate, up = xr @ wg.T, xr @ wu.T
    ref = (gate / (1 + torch.exp(-gate)) * up) @ wd.T  # silu(g) = g * sigmoid(g), written out
    ref.backward(grad_out)
    inputs = [t.to(dtype).requires_grad_() for t in (x, *weights)]
    out = gated_mlp(*inputs)
    out.backward(grad_out.to(dtype))
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol * scale, rtol=tol)
    for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), inputs, ref_inputs):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tol * want.grad.abs().max().item(), rtol=tol,
                                   msg=name)


def test_keeps_x_gate_and_up_only():
    """Bytes autograd keeps for backward beyond the weights: x, g and u (transformers' MLP: x, g, silu(g), u, h)."""
    tokens = 11
    kept = {}
    for name, mlp in zip(("plain", "patched"), mlps(torch.float32, "cpu")):
        saved = []

        def pack(t):
            if t.shape[-2:] != (INTERMEDIATE, HIDDEN) and t.shape[-2:] != (HIDDEN, INTERMEDIATE):  # not a weight
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(torch.randn(tokens, HIDDEN, requires_grad=True))
        kept[name] = sum(saved)
    assert kept["patched"] == tokens * (HIDDEN + 2 * INTERMEDIATE)
    assert kept["plain"] >= tokens * (HIDDEN + 4 * INTERMEDIATE)


def test_frozen_weights_get_no_gradient_and_x_still_does():
    plain, patched = mlps(torch.float32, "cpu")
    for mlp in (plain, patched):
        mlp.requires_grad_(False)
    x, grad_out = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    want, got = forward_backward(plain, x, grad_out), forward_backward(patched, x, grad_out)
    assert torch.equal(got[1], want[1])
    assert all(grad is None for grad in got[2].values())


def test_lora_wrapped_projections_run_transformers_forward():
    peft = pytest.importorskip("peft")
    plain, patched = mlps(torch.float32, "cpu")
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                           init_lora_weights=False)
    plain, patched = (peft.inject_adapter_in_model(lora, m) for m in (plain, patched))
    assert not runs_gated(patched)
    patched.load_state_dict(plain.state_dict())
    x, grad_out = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    want, got = forward_backward(plain, x, grad_out), forward_backward(patched, x, grad_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_only_transformers_plain_gated_mlps_are_patched():
    """An MLP with the same attributes but another forward (here a subclass that scales its output, as Falcon-H1's
    multipliers do) keeps its own; so do a biased one and one with another activation."""

    class ScaledMLP(Qwen2MLP):
        def forward(self, x):
            return 2 * super().forward(x)

    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    scaled = ScaledMLP(config)
    biased = Qwen2MLP(config)
    biased.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE)
    gelu = Qwen2MLP(Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, hidden_act="gelu"))
    assert [patch_gated_mlps(m) for m in (scaled, biased, gelu)] == [0, 0, 0]
    x = torch.randn(3, HIDDEN)
    assert torch.equal(scaled(x), 2 * Qwen2MLP.forward(scaled, x))


def test_a_patched_model_equals_the_unpatched_one():
    from transformers import AutoModelForCausalLM

    from pyrl.models import tiny_model_path

    plain, patched = (AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32) for _ in range(2))
    assert patch_gated_mlps(patched) == plain.config.num_hidden_layers
    ids = torch.randint(3, plain.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    grads = []
    for model in (plain, patched):
        loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for name, grad in grads[0][1].items():
        assert torch.equal(grads[1][1][name], grad), name


# ---- the Triton kernels of the elementwise part (pyrl.kernels.swiglu): CUDA tensors take them by default; CPU
# tensors under the interpreter when PYRL_OPS_BACKEND=triton (the conftest sets TRITON_INTERPRET=1 without CUDA) ----

needs_triton = pytest.mark.skipif(not triton_available(), reason="no triton")
# CPU tensors reach the kernels through the interpreter, which the conftest sets only where there is no CUDA
TRITON_DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                               reason="the interpreter runs where there is no CUDA")),
                  DEVICES[1]]


def torch_swiglu(gate, up, grad_hidden):
    """The elementwise part as GatedMLPFunction runs it with torch's ops: (h, dh * silu(g), (dh * u) silu'(g))."""
    activated = F.silu(gate)
    grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
    return activated * up, grad_hidden * activated, grad_gate


def assert_same(got, want, device, dtype, what):
    """Bit for bit on CUDA (the kernels round as torch's kernels do); under the interpreter, whose exp is numpy's, to
    one rounding of the dtype."""
    if device == "cuda":
        assert torch.equal(got, want), f"{what}: max diff {(got.double() - want.double()).abs().max()}"
    else:
        tol = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
        scale = want.abs().max().item() if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=what)


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 1023, 2049], ids=lambda n: f"n{n}")
def test_swiglu_kernels_equal_torchs_ops_and_the_formula_in_float64(n, dtype, device, monkeypatch):
    monkeypatch.setenv("PYRL_OPS_BACKEND", "triton")
    from pyrl.kernels import swiglu

    g = torch.Generator().manual_seed(n)
    gate, up, grad_hidden = ((torch.randn(n, generator=g) * 4).to(dtype).to(device) for _ in range(3))
    hidden = swiglu.swiglu_forward(gate, up)
    dh = grad_hidden.clone()
    hidden_again, grad_up, grad_gate = swiglu.swiglu_backward(gate, up, dh)
    assert grad_gate is dh  # written over the incoming gradient
    want = torch_swiglu(gate, up, grad_hidden)
    for got, ref, what in zip((hidden, hidden_again, grad_up, grad_gate), (want[0], *want), ("h", "h again", "du",
                                                                                            "dg")):
        assert got.dtype == dtype and got.shape == (n,)
        assert_same(got, ref, device, dtype, what)
    # and the formula in float64, to the dtype's precision
    gd, ud, dhd = (t.double() for t in (gate, up, grad_hidden))
    s = 1 / (1 + torch.exp(-gd))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, ref in ((hidden, gd * s * ud), (grad_up, dhd * gd * s), (grad_gate, dhd * ud * s * (1 + gd * (1 - s)))):
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * (ref.abs().max().item() if n else 1))


@needs_triton
def test_swiglu_kernels_refuse_mismatched_tensors(monkeypatch):
    monkeypatch.setenv("PYRL_OPS_BACKEND", "triton")
    from pyrl.kernels import swiglu

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        swiglu.swiglu_forward(torch.zeros(4, device=device), torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        swiglu.swiglu_backward(torch.zeros(4, device=device), torch.zeros(4, device=device),
                               torch.zeros(4, dtype=torch.float64, device=device))


@needs_triton
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_mlp_through_the_triton_kernels_equals_transformers(dtype, device, monkeypatch, spy_calls):
    """CUDA takes the kernels by default (checked by counting their calls) and equals transformers' MLP bit for bit;
    CPU tensors take them under the interpreter when PYRL_OPS_BACKEND=triton, equal to a rounding."""
    from pyrl.kernels import swiglu

    if device == "cpu":
        monkeypatch.setenv("PYRL_OPS_BACKEND", "triton")
    calls = spy_calls(swiglu, "swiglu_forward", "swiglu_backward")
    plain, patched = mlps(dtype, device, seed=7)
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(3, 37, HIDDEN, generator=g, device=device).to(dtype)
    grad_out = torch.randn(3, 37, HIDDEN, generator=g, device=device).to(dtype)
    want, got = forward_backward(plain, x, grad_out), forward_backward(patched, x, grad_out)
    assert calls == ["swiglu_forward", "swiglu_backward"]
    assert_same(got[0], want[0], device, dtype, "out")
    assert_same(got[1], want[1], device, dtype, "dx")
    for name, grad in want[2].items():
        assert_same(got[2][name], grad, device, dtype, name)
