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
